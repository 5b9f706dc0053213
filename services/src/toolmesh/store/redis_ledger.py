"""The ledger's storage port on Redis: claim, finish and confirm are one script each (the claim
takes the lease, the finish gives it back).

Keys, under the connection's prefix:
- `ledger:inv:<tool request id>`: a hash: `rec` (the record's bytes), `end`
  (set once finished), `dlv` (set once delivery is confirmed), `keep` (ms to
  keep it once finished), `same` (the identity whose pointer names it, "" for
  none), `once` (set when it finished with an outcome not to replay: its
  idempotency key starts over), `join` (set when a call joined it while it ran: a
  cancellation leaves it alone), `cxl` (set when a cancellation finished it), `n`
  (how many attachments it has had: the last one's id), `open` (how many are
  unconfirmed), `a<id>` (set per unconfirmed attachment), `lease` (the lease key
  its claim took a place under, its id the tool request id; "" for none: finishing
  gives the place back), `gen` (its dispatch generation, absent: 1), `st` (when a start was
  marked, Unix ms on the server's clock; absent: none), `sb` (the marker of that start).
  Finishing it publishes
  on its name, for watchers.
- `ledger:same:<session>:<tool>:<arguments digest>`: the tool request id of
  the running or unconfirmed invocation with that identity.
- `ledger:idem:<length of session>:<session>:<key>`: a hash: `id`, `identity`.
- the lease key a claim names (`LeaseTerms.key`, e.g. `quota:in_flight:<session>`): a
  sorted set of the tool request ids holding a place, scored by when each lapses.

Every key expires. The scripts read keys named by other keys (the invocation
a pointer names), so all the keys of a script live in one slot: on a cluster
each carries its session's hash tag (_names, toolmesh.store.slots).

With durable claims (toolmesh.store.durability) the claim and finish scripts
are answered once a replica has them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.store import slots
from toolmesh.store.durability import NotReplicated
from toolmesh.store.ledger import (
    ClaimNotReplicated,
    Delivered,
    KeyReused,
    LeaseRefused,
    LeaseTerms,
    MarkVerdict,
    StartMark,
    StoredInvocation,
)
from toolmesh.store.redis import RedisConnection, Script, expires_in, milliseconds
from toolmesh.store.redis_watch import watch

if TYPE_CHECKING:
    from toolmesh.store.redis_cluster import ClusterConnection

log = logging.getLogger("toolmesh.store")

# Leases: a sorted set of lease ids scored by when each lapses (the server's clock, in ms).
# take_lease(key, id, limit, ttl ms) holds one of at most `limit`; false when they are held.
# The claim scripts include it, to take the lease in the claim's own step.
_LEASE_TAKING = """
local function take_lease(key, id, limit, ttl)
  local clock = redis.call('TIME')
  local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('ZSCORE', key, id) == false and redis.call('ZCARD', key) >= tonumber(limit) then
    return false
  end
  redis.call('ZADD', key, now + tonumber(ttl), id)
  if redis.call('PTTL', key) < tonumber(ttl) then redis.call('PEXPIRE', key, ttl) end
  return true
end
"""
_RELEASE_LEASE = Script("""
redis.call('ZREM', KEYS[1], ARGV[1])
return 0
""")


# Confirms deliveries to the invocations named by KEYS[first_key …] (ids in ARGV[first_arg …],
# each followed by its attachment id, "" for all): confirms the attachment of a finished
# one; once none is left unconfirmed, marks it delivered, keeps it `keep` ms from now and
# drops its pointer if it still names it. Returns the ids of those still running.
# attach(key, delivered, ended) gives the invocation at `key` one more attachment (marking it
# joined while it runs) and returns its id.
_CONFIRMING = """
local function confirm(first_key, first_arg, count, pointers)
  local running = {}
  for i = 0, count - 1 do
    local key, id = KEYS[first_key + i], ARGV[first_arg + 2 * i]
    local attachment = ARGV[first_arg + 2 * i + 1]
    local found = redis.call('HMGET', key, 'end', 'dlv', 'keep', 'same')
    if found[1] then
      if not found[2] and (attachment == '' or (redis.call('HDEL', key, 'a' .. attachment) == 1
          and redis.call('HINCRBY', key, 'open', -1) <= 0)) then
        redis.call('HSET', key, 'dlv', '1')
        redis.call('PEXPIRE', key, found[3])
        if found[4] and found[4] ~= '' then
          local pointer = pointers .. found[4]
          if redis.call('GET', pointer) == id then redis.call('DEL', pointer) end
        end
      end
    elseif found[4] then
      running[#running + 1] = id
    end
  end
  return running
end

local function attach(key, delivered, ended)
  local attachment = redis.call('HINCRBY', key, 'n', 1)
  if not delivered then
    if ended then redis.call('HSET', key, 'a' .. attachment, '1')
    else redis.call('HSET', key, 'a' .. attachment, '1', 'join', '1') end
    redis.call('HINCRBY', key, 'open', 1)
  end
  return tostring(attachment)
end
"""

# take_lease_for(id, first) takes the lease ARGV[first …] (key, limit, ttl ms; key "" for none)
# as `id`: whether it is held.
_LEASING = (
    _LEASE_TAKING
    + """
local function take_lease_for(id, first)
  return ARGV[first] == '' or take_lease(ARGV[first], id, ARGV[first + 1], ARGV[first + 2])
end
"""
)

# KEYS: the identity pointer, the new record, the records to confirm first. ARGV: id,
# record, ttl ms, identity, record key prefix, pointer key prefix, lease key, limit and ttl
# ms, the (id, attachment) pairs to confirm. Returns {id, record, attachment} of the
# invocation attached to; 0 when the new one's lease is refused (nothing stored).
_CLAIM = Script(
    _CONFIRMING
    + _LEASING
    + """
confirm(3, 10, #KEYS - 2, ARGV[6])
local other = redis.call('GET', KEYS[1])
if other and other ~= ARGV[1] then
  local key = ARGV[5] .. other
  local found = redis.call('HMGET', key, 'rec', 'dlv', 'end')
  if found[1] and not found[2] then return {other, found[1], attach(key, false, found[3])} end
end
if not take_lease_for(ARGV[1], 7) then return 0 end
redis.call('HSET', KEYS[2], 'rec', ARGV[2], 'same', ARGV[4], 'n', 1, 'open', 1, 'a1', '1', 'lease', ARGV[7])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return false
"""
)

# KEYS: the idempotency key, the new record, the records to confirm first. ARGV: id,
# record, ttl ms, identity, record key prefix, key ttl ms, pointer key prefix, lease key,
# limit and ttl ms, the (id, attachment) pairs to confirm. Returns {0, id} for a key reused
# with other arguments, {1, id, record, delivered, attachment} for the invocation the key
# names (unless its outcome is not to be replayed), 0 when the new one's lease is refused.
_CLAIM_KEYED = Script(
    _CONFIRMING
    + _LEASING
    + """
confirm(3, 11, #KEYS - 2, ARGV[7])
local claimed = redis.call('HMGET', KEYS[1], 'id', 'identity')
if claimed[1] and claimed[1] ~= ARGV[1] then
  if claimed[2] ~= ARGV[4] then return {0, claimed[1]} end
  local key = ARGV[5] .. claimed[1]
  local found = redis.call('HMGET', key, 'rec', 'dlv', 'once', 'end')
  if found[1] and not found[3] then
    return {1, claimed[1], found[1], found[2] and 1 or 0, attach(key, found[2], found[4])}
  end
end
if not take_lease_for(ARGV[1], 8) then return 0 end
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'identity', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('HSET', KEYS[2], 'rec', ARGV[2], 'same', '', 'n', 1, 'open', 1, 'a1', '1', 'lease', ARGV[8])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return false
"""
)

# KEYS: the record, and the identity pointer when there is one. ARGV: id, record,
# keep ms, replay ms ('' for an outcome not to replay: drops the pointer if it names
# this id, and marks the record `once`), identity. Gives back the lease its claim took. The
# record is kept at least as long as its pointer (`keep` again once its delivery is confirmed).
_FINISHING = """
local function finish()
local lease = redis.call('HGET', KEYS[1], 'lease')
if lease and lease ~= '' then redis.call('ZREM', lease, ARGV[1]) end
redis.call('HSET', KEYS[1], 'rec', ARGV[2], 'end', '1', 'keep', ARGV[3], 'same', ARGV[5])
if ARGV[4] == '' then redis.call('HSET', KEYS[1], 'once', '1') end
local kept = tonumber(ARGV[3])
if ARGV[4] ~= '' and tonumber(ARGV[4]) > kept then kept = tonumber(ARGV[4]) end
redis.call('PEXPIRE', KEYS[1], kept)
if KEYS[2] then
  if ARGV[4] ~= '' then redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[4])
  elseif redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
end
redis.call('PUBLISH', KEYS[1], '1')
end
"""
_FINISH = Script(
    _FINISHING
    + """
local state = redis.call('HMGET', KEYS[1], 'rec', 'end', 'cxl')
if not state[1] then return 'ended' end
if state[2] then return state[3] and 'cancelled' or 'ended' end
finish()
return 'wrote'
"""
)

# As _FINISH, but only for a running invocation no call joined. Returns 'cancelled', 'ended',
# 'joined', or false when not stored.
_CANCEL = Script(
    _FINISHING
    + """
local state = redis.call('HMGET', KEYS[1], 'rec', 'end', 'join')
if not state[1] then return false end
if state[2] then return 'ended' end
if state[3] then return 'joined' end
finish()
redis.call('HSET', KEYS[1], 'cxl', '1')
return 'cancelled'
"""
)

# KEYS: the records. ARGV: the pointer key prefix, then (id, attachment) pairs. Returns the
# ids still running.
_CONFIRM = Script(
    _CONFIRMING
    + """
return confirm(1, 2, #KEYS, ARGV[1])
"""
)

_READ = Script("""
local found = redis.call('HMGET', KEYS[1], 'rec', 'dlv', 'gen', 'st', 'late')
return {found[1], found[2], redis.call('PTTL', KEYS[1]), found[3], found[4], found[5]}
""")

# KEYS: the record. ARGV: what to keep. Keeps it beside a finished record (its expiry unchanged)
# that has none kept. Returns 1 when it did, else 0.
_KEEP_LATE = Script("""
local found = redis.call('HMGET', KEYS[1], 'rec', 'end', 'late')
if not found[1] or not found[2] or found[3] then return 0 end
redis.call('HSET', KEYS[1], 'late', ARGV[1])
return 1
""")

# KEYS: the records (one slot). ARGV: the generation of each one's delivery, then each mark's
# marker. Marks each running one started, now, by its marker, if its generation is that and no
# start is marked. Returns per key 1 (marked, or marked before by the same marker), 0 (another
# start was marked, or the generation moved on), -1 (ended), -2 (not stored).
_MARK_STARTED = Script("""
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local verdicts = {}
local count = #KEYS
for i, key in ipairs(KEYS) do
  local marker = ARGV[count + i]
  local found = redis.call('HMGET', key, 'rec', 'end', 'gen', 'st', 'sb')
  if not found[1] then verdicts[i] = -2
  elseif found[2] then verdicts[i] = -1
  elseif tonumber(found[3] or '1') ~= tonumber(ARGV[i]) then verdicts[i] = 0
  elseif found[4] then verdicts[i] = (marker ~= '' and found[5] == marker) and 1 or 0
  else
    redis.call('HSET', key, 'st', now, 'sb', marker)
    verdicts[i] = 1
  end
end
return verdicts
""")

# KEYS: the record. ARGV: the generation to move on from. Returns the new one, or 0 when it did not.
_REDISPATCH = Script("""
local found = redis.call('HMGET', KEYS[1], 'rec', 'end', 'gen', 'st')
if not found[1] or found[2] or found[4] then return 0 end
local generation = tonumber(found[3] or '1')
if generation ~= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'gen', generation + 1)
return generation + 1
""")

_MARK_VERDICTS = {1: MarkVerdict.WON, 0: MarkVerdict.LOST, -1: MarkVerdict.ENDED, -2: MarkVerdict.ABSENT}


class RedisLedgerStore:
    """The LedgerStore port on Redis (one server, or a cluster: see _names)."""

    synchronous = False

    def __init__(self, connection: RedisConnection | ClusterConnection) -> None:
        self._connection = connection
        self.claims_replicated = connection.claims_replicated
        self._prefix = connection.prefix
        self._cluster = connection.cluster
        self._run = connection.run

    def _names(self, tag: str) -> tuple[str, str, str, str]:
        """The key prefixes of records, identity pointers, idempotency keys and leases, in the slot
        of `tag`: on a cluster every ledger key of a session carries its hash tag
        (`ledger:inv:{<tag>}<id>`, `ledger:same:{<tag>}…`, `ledger:idem:{<tag>}…`, `{<tag>}<lease key>`),
        so each script's keys share one slot; on one Redis none does (the layout it always had)."""
        tagged = slots.hash_tag(tag) if self._cluster and tag else ""
        prefix = self._prefix
        return (
            f"{prefix}ledger:inv:{tagged}",
            f"{prefix}ledger:same:{tagged}",
            f"{prefix}ledger:idem:{tagged}",
            f"{prefix}{tagged}",
        )

    def _tag(self, tool_request_id: str) -> str:
        """The slot tag of an invocation's keys (its id carries it); "" on one Redis."""
        if not self._cluster:
            return ""
        return slots.id_tag(tool_request_id) or ""

    def _claim_tag(self, tool_request_id: str) -> str:
        tag = self._tag(tool_request_id)
        if self._cluster and not tag:
            raise ValueError(
                f"{tool_request_id}: on a Redis Cluster an invocation id carries its session's tag"
            )
        return tag

    async def _confirm_elsewhere(self, tag: str, confirmed: Sequence[Delivered]) -> list[Delivered]:
        """Confirm first, each in its own slot, the deliveries not in `tag`'s; return those that are."""
        if not self._cluster:
            return list(confirmed)
        here = [delivered for delivered in confirmed if self._tag(delivered.tool_request_id) == tag]
        elsewhere = [delivered for delivered in confirmed if self._tag(delivered.tool_request_id) != tag]
        if elsewhere:
            await self.confirm(elsewhere)
        return here

    async def claim(
        self,
        tool_request_id: str,
        record: bytes,
        identity: str,
        running_ttl_s: float,
        *,
        confirmed: Sequence[Delivered] = (),
        lease: LeaseTerms | None = None,
    ) -> StoredInvocation | None:
        tag = self._claim_tag(tool_request_id)
        confirmed = await self._confirm_elsewhere(tag, confirmed)
        records, identities, _, leases = self._names(tag)
        keys = [identities + identity, records + tool_request_id, *_named(records, confirmed)]
        terms = self._lease(leases, lease)
        args: list[bytes | str] = [
            tool_request_id,
            record,
            milliseconds(running_ttl_s),
            identity,
            records,
            identities,
            *terms,
            *_pairs(confirmed),
        ]
        return await self._claiming(_CLAIM, keys, args, terms[0], _claimed)

    async def _claiming(
        self,
        script: Script,
        keys: list[str],
        args: list[bytes | str],
        lease_key: str,
        claimed: Callable[[Any], StoredInvocation | None],
    ) -> StoredInvocation | None:
        """Run a claim script (durably, with durable claims on); `claimed` reads its reply."""
        try:
            found = await self._run(script, keys, args, durable=True)
        except NotReplicated as unconfirmed:
            if unconfirmed.reply == 0:
                raise LeaseRefused(lease_key) from None  # nothing was stored
            raise ClaimNotReplicated(claimed(unconfirmed.reply)) from None
        if found == 0:
            raise LeaseRefused(lease_key)
        return claimed(found)

    async def claim_keyed(
        self,
        tool_request_id: str,
        record: bytes,
        key: str,
        identity: str,
        *,
        running_ttl_s: float,
        key_ttl_s: float,
        confirmed: Sequence[Delivered] = (),
        lease: LeaseTerms | None = None,
    ) -> StoredInvocation | None:
        tag = self._claim_tag(tool_request_id)
        confirmed = await self._confirm_elsewhere(tag, confirmed)
        records, identities, idempotency, leases = self._names(tag)
        keys = [idempotency + key, records + tool_request_id, *_named(records, confirmed)]
        terms = self._lease(leases, lease)
        args: list[bytes | str] = [
            tool_request_id,
            record,
            milliseconds(running_ttl_s),
            identity,
            records,
            milliseconds(key_ttl_s),
            identities,
            *terms,
            *_pairs(confirmed),
        ]
        return await self._claiming(_CLAIM_KEYED, keys, args, terms[0], _claimed_keyed)

    def _ending(self, tool_request_id: str, identity: str) -> list[str]:
        records, identities, _, _ = self._names(self._tag(tool_request_id))
        keys = [records + tool_request_id]
        if identity:
            keys.append(identities + identity)
        return keys

    async def finish(
        self, tool_request_id: str, record: bytes, identity: str, keep_s: float, replay_s: float | None
    ) -> str:
        keys = self._ending(tool_request_id, identity)
        args: list[bytes | str] = [
            tool_request_id,
            record,
            milliseconds(keep_s),
            milliseconds(replay_s),
            identity,
        ]
        try:
            answer = await self._run(_FINISH, keys, args, durable=True)
        except NotReplicated as unconfirmed:
            # The outcome is known and stored on the primary: the call goes on with it (a failover
            # now could lose it, and an exact retry would then be told the outcome is unavailable).
            log.warning("outcome not confirmed by a replica", extra={"tool_request_id": tool_request_id})
            answer = unconfirmed.reply
        return bytes(answer).decode()

    async def cancel(
        self, tool_request_id: str, record: bytes, identity: str, keep_s: float, replay_s: float
    ) -> str | None:
        keys = self._ending(tool_request_id, identity)
        args: list[bytes | str] = [
            tool_request_id,
            record,
            milliseconds(keep_s),
            milliseconds(replay_s),
            identity,
        ]
        answer = await self._run(_CANCEL, keys, args)
        return None if answer is None else bytes(answer).decode()

    def _by_slot(self, items: Sequence[_Named]) -> dict[tuple[str, str], list[int]]:
        """The positions of `items` grouped by their slot tag: one script per group (on one Redis,
        one in all); an id without a tag is a slot of its own."""
        groups: dict[tuple[str, str], list[int]] = {}
        for position, item in enumerate(items):
            tag = self._tag(item.tool_request_id)
            slot = (tag, "") if tag or not self._cluster else ("", item.tool_request_id)
            groups.setdefault(slot, []).append(position)
        return groups

    async def confirm(self, deliveries: Sequence[Delivered]) -> list[str]:
        running: list[str] = []
        for (tag, _own), positions in self._by_slot(deliveries).items():
            group = [deliveries[position] for position in positions]
            records, identities = self._names(tag)[:2]
            still = await self._run(_CONFIRM, _named(records, group), [identities, *_pairs(group)])
            running.extend(tool_request_id.decode() for tool_request_id in still)
        return running

    async def mark_started(self, marks: Sequence[StartMark]) -> list[MarkVerdict]:
        verdicts: list[MarkVerdict] = [MarkVerdict.ENDED] * len(marks)
        for (tag, _own), positions in self._by_slot(marks).items():
            records = self._names(tag)[0]
            keys = [records + marks[position].tool_request_id for position in positions]
            generations = [str(marks[position].generation) for position in positions]
            markers = [marks[position].marker for position in positions]
            # Durable like a claim: a start a failover forgot would let a redispatch run it again.
            try:
                answers = await self._run(_MARK_STARTED, keys, [*generations, *markers], durable=True)
            except NotReplicated:
                raise ToolmeshError(
                    Code.STORE_UNAVAILABLE, "No replica confirmed the start in time."
                ) from None
            for position, answer in zip(positions, answers, strict=True):
                verdicts[position] = _MARK_VERDICTS[int(answer)]
        return verdicts

    async def redispatch(self, tool_request_id: str, generation: int) -> int:
        try:
            moved = await self._run(
                _REDISPATCH, [self._record(tool_request_id)], [str(generation)], durable=True
            )
        except NotReplicated:
            raise ToolmeshError(
                Code.STORE_UNAVAILABLE, "No replica confirmed the redispatch in time."
            ) from None
        return int(moved)

    def _lease(self, leases: str, lease: LeaseTerms | None) -> list[str]:
        """The claim scripts' lease arguments: key (under the prefix), limit, ttl ms; "" for none."""
        if lease is None:
            return ["", "", ""]
        return [leases + lease.key, str(lease.limit), milliseconds(lease.ttl_s)]

    async def release_lease(self, key: str, tool_request_id: str) -> None:
        leases = self._names(self._tag(tool_request_id))[3]
        await self._run(_RELEASE_LEASE, [leases + key], [tool_request_id])

    def _record(self, tool_request_id: str) -> str:
        return self._names(self._tag(tool_request_id))[0] + tool_request_id

    async def keep_late(self, tool_request_id: str, late: bytes) -> bool:
        try:
            kept = await self._run(_KEEP_LATE, [self._record(tool_request_id)], [late], durable=True)
        except NotReplicated as unconfirmed:
            # Kept on the primary, as an unconfirmed finish is: a failover now may lose it.
            log.warning("late outcome not confirmed by a replica", extra={"tool_request_id": tool_request_id})
            kept = unconfirmed.reply
        return bool(int(kept))

    async def get(self, tool_request_id: str) -> StoredInvocation | None:
        stored, _ = await self._read_expiring(tool_request_id)
        return stored

    async def _read_expiring(self, tool_request_id: str) -> tuple[StoredInvocation | None, float | None]:
        record, delivered, pttl, generation, started, late = await self._run(
            _READ, [self._record(tool_request_id)]
        )
        if record is None:
            return None, None
        stored = StoredInvocation(
            tool_request_id,
            record,
            delivered is not None,
            generation=1 if generation is None else int(generation),
            started_at_ms=0 if started is None else int(started),
            late=b"" if late is None else bytes(late),
        )
        return stored, expires_in(int(pttl))

    def watch(self, tool_request_id: str) -> AsyncGenerator[StoredInvocation | None, None]:
        channel = self._record(tool_request_id).encode()
        return watch(self._connection.subscriptions, channel, lambda: self._read_expiring(tool_request_id))


def _claimed(found: Any) -> StoredInvocation | None:
    """The _CLAIM script's reply (not 0: a refused lease): None for a new invocation, else the
    invocation it attached to."""
    return None if found is None else StoredInvocation(found[0].decode(), found[1], False, found[2].decode())


def _claimed_keyed(found: Any) -> StoredInvocation | None:
    """The _CLAIM_KEYED script's reply (not 0), as _claimed; KeyReused for a key of other arguments."""
    if found is None:
        return None
    if found[0] == 0:
        raise KeyReused(found[1].decode())
    return StoredInvocation(found[1].decode(), found[2], found[3] == 1, found[4].decode())


class _Named(Protocol):
    @property
    def tool_request_id(self) -> str: ...


def _named(records: str, deliveries: Sequence[Delivered]) -> list[str]:
    return [records + delivered.tool_request_id for delivered in deliveries]


def _pairs(deliveries: Sequence[Delivered]) -> list[str]:
    """The scripts' arguments for `deliveries`: id, attachment, id, attachment, ..."""
    return [part for delivered in deliveries for part in delivered]

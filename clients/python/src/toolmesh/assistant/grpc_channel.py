"""ToolChannel over toolmesh's gRPC services.

UNSUPPORTED_WEBMCP here means the tool channel cannot serve an assistant at all:
- insecure: TLS is required (ToolServices.require_tls) but the channel is plaintext;
- absent or incomplete: the server behind the registry or invocation address
  does not offer that service. It is asked with the standard gRPC health check
  for the service's full name (every toolmesh server serves grpc.health.v1): the
  answer NOT_FOUND (service not offered) or UNIMPLEMENTED (no health service: not
  a toolmesh server) is UNSUPPORTED_WEBMCP. A server that cannot be reached
  leaves the question open: reading the tools then fails with DISCOVERY_FAILED.
A positive check is remembered for the life of the channel.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from grpc_health.v1 import health_pb2

from toolmesh.assistant.config import ToolServices
from toolmesh.assistant.errors import AssistantError, TurnCode
from toolmesh.client.invocation import CallResult, InvocationClient
from toolmesh.client.registry import RegistryClient
from toolmesh.core.channels import open_channel
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSet
from toolmesh.v1 import invocation_pb2, registry_pb2

REGISTRY_SERVICE = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name
INVOCATION_SERVICE = invocation_pb2.DESCRIPTOR.services_by_name["InvocationService"].full_name
PROBE_TIMEOUT_S = 5.0
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def _channel(target: str, services: ToolServices) -> grpc.aio.Channel:
    credentials = None
    if services.tls:
        credentials = grpc.ssl_channel_credentials(
            services.root_certificates, services.private_key, services.certificate_chain
        )
    return open_channel(target, credentials)


class GrpcToolChannel:
    """ToolChannel over the registry and invocation services of one session.

    Args:
        session_id: The session whose tools are listed and called.
        services: The services' addresses and TLS settings.
    """

    def __init__(self, session_id: str, services: ToolServices) -> None:
        self._session_id = session_id
        self._services = services
        self._channels = {
            REGISTRY_SERVICE: _channel(services.registry, services),
            INVOCATION_SERVICE: _channel(services.invocation, services),
        }
        self._registry = RegistryClient(
            services.registry, channel=self._channels[REGISTRY_SERVICE], token=services.token
        )
        self._invocation = InvocationClient(
            services.invocation, channel=self._channels[INVOCATION_SERVICE], token=services.token
        )
        self._checked = False

    async def check(self) -> None:
        """Raise AssistantError(UNSUPPORTED_WEBMCP) if TLS is required but off, or a service is not offered.

        A server that cannot be reached is not refused here: reading the tools
        then fails with DISCOVERY_FAILED.
        """
        if self._checked:
            return
        if self._services.require_tls and not self._services.tls:
            raise AssistantError(
                TurnCode.UNSUPPORTED_WEBMCP,
                "TLS is required, but the channel to the tool services is plaintext.",
            )
        answers = await asyncio.gather(*(_offers(name, channel) for name, channel in self._channels.items()))
        for name, offered in zip(self._channels, answers, strict=True):
            if offered is False:
                raise AssistantError(
                    TurnCode.UNSUPPORTED_WEBMCP, f"The server does not offer {name}.", {"service": name}
                )
        self._checked = all(answers)

    async def list_tools(self) -> ToolSet:
        """The session's tools; raises AssistantError(DISCOVERY_FAILED) when the registry refuses or fails."""
        try:
            return await self._registry.list_tools(self._session_id)
        except grpc.aio.AioRpcError as error:
            code = error_code(error)
            reason = code.value if code is not None else error.code().name
            where = self._services.registry
            if code is None and error.code() is grpc.StatusCode.UNAVAILABLE:
                detail = f"Nothing answered at the registry address {where} ({reason}): is toolmesh running?"
            else:
                detail = f"The registry at {where} refused or could not answer ({reason})."
            raise AssistantError(TurnCode.DISCOVERY_FAILED, detail, {"registry": where}) from None

    async def wait_for_change(self, revision: int) -> None:
        """Return once the registry's watch shows a revision other than `revision`; never raises.

        If the watch fails, waits until cancelled (the next `list_tools` finds the change).
        """
        try:
            async with contextlib.aclosing(self._registry.watch_tools(self._session_id)) as watch:
                async for tools in watch:
                    if tools.revision != revision:
                        return
        except grpc.aio.AioRpcError:
            pass
        # Without a watch, whoever waits finds out from the next list_tools.
        await asyncio.Event().wait()

    async def invoke(
        self, tool_name: str, arguments_json: str, *, turn_id: str, timeout: float
    ) -> CallResult:
        """One tool call within `timeout` seconds; never raises: a refused request is a CallResult too."""
        try:
            return await self._invocation.invoke(
                self._session_id, tool_name, turn_id=turn_id, arguments_json=arguments_json, timeout=timeout
            )
        except grpc.aio.AioRpcError as error:
            return CallResult(None, None, error_code(error) or Code.INVALID_REQUEST, error.details() or "")
        except ToolmeshError as error:  # the service sent an outcome that cannot be read
            return CallResult(None, None, Code.INTERNAL, error.message)

    async def close(self) -> None:
        """Close the invocation client (it sends its pending confirmations), then the channels."""
        # The client first: it sends the delivery confirmations it still holds.
        await self._invocation.close()
        for channel in self._channels.values():
            await channel.close()


async def _offers(service: str, channel: grpc.aio.Channel) -> bool | None:
    """Whether the server offers `service`: True, False, or None when it could not be asked."""
    # The method itself, as health_pb2_grpc.HealthStub makes it: the stub's typing leaves its methods out.
    check = channel.unary_unary(
        HEALTH_CHECK,
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    try:
        await check(health_pb2.HealthCheckRequest(service=service), timeout=PROBE_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        if error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
            return False
        return None
    return True

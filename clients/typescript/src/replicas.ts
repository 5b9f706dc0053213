/**
 * Which bridge replica a page opens its host stream on, when it knows several.
 *
 * A frozen replica (SIGSTOP, a stuck event loop) takes connections and answers nothing: a page
 * that opens its stream there waits out its first-event wait while another replica is up, and a
 * result it holds waits with it. So before opening, the host asks every replica's web port
 * health check (`GET /healthz`) at once and opens on the first that answers (its current one, if
 * that answers within PREFERRED_MS): any HTTP answer, a refusal or a 404 from an older bridge
 * included, comes from a replica that runs. A replica that refuses connections (restarting) is
 * asked again every PROBE_AGAIN_MS until it answers or the wait ends: one that comes back meanwhile
 * is where the page goes. As the Python host SDK does with gRPC's health check.
 */

/** The current replica's head start: it keeps the host when it answers within it. */
export const PREFERRED_MS = 500;

/** How soon a health check that failed (the replica refused the connection) is asked again. */
export const PROBE_AGAIN_MS = 200;

/** Where a web port's health check is, from its base URL. */
export function healthUrl(baseUrl: string): string {
  return `${baseUrl.replace(/\/+$/, "")}/healthz`;
}

/**
 * The index of the replica to open on: `preferred` if it answers within PREFERRED_MS, else the
 * first of all to answer within `timeoutMs`; undefined if none does, or `stop` ends the wait first.
 */
export async function firstAnswering(
  urls: readonly string[],
  preferred: number,
  timeoutMs: number,
  stop: Promise<unknown>,
): Promise<number | undefined> {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), timeoutMs);
  const probes = urls.map((url, index) => probe(url, controller.signal).then((answered) => (answered ? index : undefined)));
  const ended = stop.then(() => undefined);
  try {
    const head = await Promise.race([probes[preferred], pause(PREFERRED_MS), ended]);
    if (head === preferred) {
      return preferred;
    }
    // The first to answer: a probe that failed never settles here, and once all have, undefined.
    const never = new Promise<never>(() => {});
    const answered = probes.map((probe) => probe.then((index) => (index === undefined ? never : index)));
    const allFailed = Promise.all(probes).then(() => undefined);
    return await Promise.race([...answered, allFailed, ended]);
  } finally {
    clearTimeout(timer);
    controller.abort();
  }
}

/** Whether any replica of `urls` answers its health check within `timeoutMs`. */
export async function anyAnswers(urls: readonly string[], timeoutMs: number): Promise<boolean> {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), timeoutMs);
  try {
    const probes = urls.map((url) => probe(url, controller.signal));
    // The first that answers: a probe that failed never settles here, and once all have, false.
    const never = new Promise<never>(() => {});
    const answered = probes.map((probe) => probe.then((ok) => (ok ? true : never)));
    return await Promise.race([...answered, Promise.all(probes).then(() => false)]);
  } finally {
    clearTimeout(timer);
    controller.abort();
  }
}

/** Whether `url` answers before `signal` aborts, asking again while its replica refuses connections. */
async function probe(url: string, signal: AbortSignal): Promise<boolean> {
  while (!signal.aborted) {
    try {
      const response = await fetch(url, { signal, cache: "no-store", credentials: "omit" });
      void response.body?.cancel();
      return true;
    } catch {
      if (!signal.aborted) {
        await pause(PROBE_AGAIN_MS);
      }
    }
  }
  return false;
}

function pause(ms: number): Promise<undefined> {
  return new Promise((resolve) => setTimeout(() => resolve(undefined), ms));
}

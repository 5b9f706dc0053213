// Drives Debian's Chromium (playwright-core, no browser download) for the Python tests and benchmark.
//
// It serves the test page (page.html and the bundled build/test/page.js) on two
// origins, the second meant to be one the bridge does not allow, then prints
// one JSON line {"origins": [...]} and reads commands, one JSON object a line,
// answering each with {"id", "ok", "value"} or {"id", "ok": false, "error"}:
//   open {tab, origin (index), query, webmcp}  load the page in a new tab
//   eval {tab, expression}                     evaluate in the tab, awaited
//   wait {tab, expression, timeoutMs}          until the expression is truthy
//   close {tab}
//   hold {tab, method}                         hold the tab's calls of that BridgeService method, unanswered
//   held {tab}                                 how many calls are held
//   unserved {tab, method}                     answer the tab's calls of that method 404, as a bridge
//                                              without the RPC does
//   reload {tab}                               fail the held calls (never sent) and reload the page
//   press {tab, key}                           a real key press on the focused element
//   axe {tab}                                  axe-core's violations on the page
//   screenshot {tab, path, selector?}          a PNG of the page, or of one element
//   heap {tab}                                 after a full GC (CDP): {heapBytes, nodes, listeners}:
//                                              the JS heap in use, DOM nodes, JS event listeners
// `open` takes a `path`: "/" the host's test page, "/assistant" the assistant's.
// Browsers launched with and without WebMCP (--enable-features=WebMCP) as tabs need them.
import { chromium } from "playwright-core";
import { readFile } from "node:fs/promises";
import http from "node:http";
import path from "node:path";
import readline from "node:readline";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const files = {
  "/": ["page.html", "text/html"],
  "/page.js": ["../../build/test/page.js", "text/javascript"],
  "/page.js.map": ["../../build/test/page.js.map", "application/json"],
  "/assistant": ["../../assistant/test/page.html", "text/html"],
  "/assistant.js": ["../../build/assistant-test/page.js", "text/javascript"],
  "/assistant.js.map": ["../../build/assistant-test/page.js.map", "application/json"],
};
const axeSource = path.join(here, "../../node_modules/axe-core/axe.min.js");
const executablePath = process.env.TOOLMESH_CHROMIUM ?? "/usr/bin/chromium";

async function serve() {
  const server = http.createServer(async (request, response) => {
    const file = files[new URL(request.url, "http://page").pathname];
    if (file === undefined) {
      response.writeHead(404).end();
      return;
    }
    response.writeHead(200, { "content-type": file[1], "cache-control": "no-store" });
    response.end(await readFile(path.join(here, file[0])));
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  return server;
}

const servers = [await serve(), await serve()];
const origins = servers.map((server) => `http://127.0.0.1:${server.address().port}`);
const browsers = new Map();
const tabs = new Map();
// The calls `hold` keeps unanswered, by tab.
const holding = new Map();

async function browser(webmcp) {
  if (!browsers.has(webmcp)) {
    const args = ["--no-sandbox", "--disable-dev-shm-usage"];
    if (webmcp) {
      args.push("--enable-features=WebMCP");
    }
    browsers.set(webmcp, chromium.launch({ executablePath, args }));
  }
  return browsers.get(webmcp);
}

const commands = {
  async open({ tab, origin = 0, query = {}, webmcp = false, path: where = "/" }) {
    const page = await (await browser(webmcp)).newPage();
    tabs.set(tab, page);
    const logs = [];
    page.on("pageerror", (error) => logs.push(`pageerror: ${error.message}`));
    await page.goto(`${origins[origin]}${where}?${new URLSearchParams(query)}`);
    return started(page);
  },
  async hold({ tab, method }) {
    const held = [];
    holding.set(tab, held);
    await tabs.get(tab).route(`**/toolmesh.v1.BridgeService/${method}`, (route) => held.push(route));
    return true;
  },
  async unserved({ tab, method }) {
    await tabs.get(tab).route(`**/toolmesh.v1.BridgeService/${method}`, (route) =>
      route.fulfill({ status: 404, headers: { "access-control-allow-origin": "*" }, body: "" }),
    );
    return true;
  },
  async held({ tab }) {
    return holding.get(tab)?.length ?? 0;
  },
  async reload({ tab }) {
    const page = tabs.get(tab);
    // Failed in the page, never sent on: the bridge never hears of them.
    await Promise.all((holding.get(tab) ?? []).map((route) => route.abort()));
    holding.delete(tab);
    await page.unrouteAll({ behavior: "ignoreErrors" });
    await page.reload();
    return started(page);
  },
  async eval({ tab, expression }) {
    return tabs.get(tab).evaluate(`(async () => (${expression}))()`);
  },
  async wait({ tab, expression, timeoutMs = 10_000 }) {
    await tabs.get(tab).waitForFunction(expression, null, { timeout: timeoutMs, polling: 20 });
    return true;
  },
  async press({ tab, key }) {
    await tabs.get(tab).keyboard.press(key);
    return true;
  },
  async axe({ tab }) {
    const page = tabs.get(tab);
    if (!(await page.evaluate(() => "axe" in window))) {
      await page.addScriptTag({ path: axeSource });
    }
    return page.evaluate(async () =>
      (await window.axe.run(document)).violations.map((v) => ({ id: v.id, impact: v.impact, nodes: v.nodes.map((n) => n.target) })),
    );
  },
  async screenshot({ tab, path: file, selector }) {
    const page = tabs.get(tab);
    await (selector ? page.locator(selector).screenshot({ path: file }) : page.screenshot({ path: file }));
    return true;
  },
  async heap({ tab }) {
    const page = tabs.get(tab);
    const cdp = await page.context().newCDPSession(page);
    try {
      await cdp.send("HeapProfiler.collectGarbage");
      const { usedSize } = await cdp.send("Runtime.getHeapUsage");
      const { nodes, jsEventListeners } = await cdp.send("Memory.getDOMCounters");
      return { heapBytes: usedSize, nodes, listeners: jsEventListeners };
    } finally {
      await cdp.detach();
    }
  },
  async close({ tab }) {
    await tabs.get(tab)?.close();
    tabs.delete(tab);
    return true;
  },
};

/** Once the page has run its start(): whether it resolved, or why it rejected. */
async function started(page) {
  await page.waitForFunction(() => window.toolmesh && (window.toolmesh.started || window.toolmesh.startError), null, {
    timeout: 30_000,
  });
  return page.evaluate(() => ({ started: window.toolmesh.started, startError: window.toolmesh.startError }));
}

const write = (message) => process.stdout.write(`${JSON.stringify(message)}\n`);
write({ origins });
const lines = readline.createInterface({ input: process.stdin });
for await (const line of lines) {
  const command = JSON.parse(line);
  // Commands run concurrently: a test may open a tab while another waits.
  (async () => {
    try {
      write({ id: command.id, ok: true, value: (await commands[command.op](command)) ?? null });
    } catch (error) {
      write({ id: command.id, ok: false, error: String(error) });
    }
  })();
}
for (const pending of browsers.values()) {
  await (await pending).close();
}
for (const server of servers) {
  server.close();
}

// Bundles with esbuild: `size` (the package, minified, and its gzipped size),
// `test` (the browser tests' page), `example` (the example page).
import { build } from "esbuild";
import { gzipSync } from "node:zlib";
import { fileURLToPath } from "node:url";
import path from "node:path";

const root = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const what = process.argv[2];
const entries = {
  size: { entry: "src/index.ts", out: "build/size/index.js" },
  test: { entry: "test/browser/page.ts", out: "build/test/page.js" },
  example: { entry: "example/app.ts", out: "build/example/app.js" },
  "assistant-test": { entry: "assistant/test/page.ts", out: "build/assistant-test/page.js" },
  "assistant-example": { entry: "assistant/example/app.ts", out: "build/assistant-example/app.js" },
  // @toolmesh/assistant and its widget, over @toolmesh/host: the bench subtracts `size`.
  "assistant-size": { entry: "assistant/test/size.ts", out: "build/assistant-size/index.js" },
  // @toolmesh/assistant and its widget alone (what a page adds when it has no @toolmesh/host).
  "assistant-alone-size": { entry: "assistant/test/size-alone.ts", out: "build/assistant-size/alone.js" },
};
const target = entries[what];
if (target === undefined) {
  console.error(`usage: node scripts/bundle.mjs ${Object.keys(entries).join("|")}`);
  process.exit(2);
}
const result = await build({
  absWorkingDir: root,
  entryPoints: [target.entry],
  outfile: target.out,
  bundle: true,
  format: "esm",
  platform: "browser",
  target: "es2022",
  minify: true,
  sourcemap: !what.endsWith("size"),
  write: !what.endsWith("size"),
  logLevel: "warning",
});
if (what.endsWith("size")) {
  const code = result.outputFiles.find((file) => file.path.endsWith(".js")).contents;
  console.log(JSON.stringify({ minifiedBytes: code.length, gzippedBytes: gzipSync(code, { level: 9 }).length }));
}

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
  sourcemap: what !== "size",
  write: what !== "size",
  logLevel: "warning",
});
if (what === "size") {
  const code = result.outputFiles.find((file) => file.path.endsWith(".js")).contents;
  console.log(JSON.stringify({ minifiedBytes: code.length, gzippedBytes: gzipSync(code, { level: 9 }).length }));
}

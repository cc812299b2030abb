// node tools/ort_op_coverage.mjs DIR: try a session for each DIR/<op>.onnx (tools/ort_op_coverage.py)
// on onnxruntime-web (wasm) and onnxruntime-node; prints the ops without a kernel on each and writes
// DIR/result.json. Run from a folder whose node_modules has both packages (NODE_PATH works too).
import { readdir, readFile, writeFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { join, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';

const dir = resolve(process.argv[2]);
const require = createRequire(join(process.cwd(), 'x.js'));
const runtimes = {};
for (const [name, pkg] of [['onnxruntime-web', 'onnxruntime-web'], ['onnxruntime', 'onnxruntime-node']]) {
  try {
    const mod = await import(pathToFileURL(require.resolve(pkg)).href);
    const ort = mod.default?.InferenceSession ? mod.default : mod;
    if (name === 'onnxruntime-web') ort.env.wasm.numThreads = 1;
    runtimes[name] = { ort, version: ort.env?.versions?.web ?? ort.env?.versions?.node ?? ort.env?.versions?.common };
  } catch (e) {
    console.log(`no ${pkg}: ${e.message}`);
  }
}
const missing = Object.fromEntries(Object.keys(runtimes).map((k) => [k, []]));
const other = Object.fromEntries(Object.keys(runtimes).map((k) => [k, {}]));
for (const file of (await readdir(dir)).filter((f) => f.endsWith('.onnx')).sort()) {
  const op = file.slice(0, -5);
  const bytes = await readFile(join(dir, file));
  for (const [name, { ort }] of Object.entries(runtimes)) {
    try {
      const s = await ort.InferenceSession.create(bytes);
      await s.release?.();
    } catch (e) {
      const msg = String(e.message ?? e);
      if (/Could not find an implementation|NOT_IMPLEMENTED|not implemented/i.test(msg)) missing[name].push(op);
      else other[name][op] = msg.slice(0, 160);
    }
  }
}
const versions = Object.fromEntries(Object.entries(runtimes).map(([k, v]) => [k, v.version]));
await writeFile(join(dir, 'result.json'), JSON.stringify({ versions, missing, other }, null, 1));
for (const [name, ops] of Object.entries(missing)) console.log(`${name} ${versions[name]}: no kernel for ${ops.join(', ')}`);

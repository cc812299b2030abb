// node tools/ort_webgpu_coverage.mjs DIR: which standard ops onnxruntime-web's WebGPU provider has a kernel for.
// DIR holds one-node models (tools/ort_op_coverage.py DIR OPSET: float inputs where the schema allows).
// Each gets a session with executionProviders ['webgpu'] in headless chromium on its software adapter
// (--enable-unsafe-webgpu, SwiftShader), onnxruntime-web's default bundle (JSEP), verbose log: an op whose
// node the log reports as "webgpu kernel not found in registries" runs on the CPU fallback, i.e. has no
// WebGPU kernel for that type. Writes DIR/webgpu.json; run from examples/web (its node_modules: onnxruntime-web,
// puppeteer-core; CHROMIUM=/path or /usr/bin/chromium). The table of onnxgrad.artifacts.targets comes from this.
import { existsSync } from 'node:fs';
import { readdir, readFile, writeFile } from 'node:fs/promises';
import { createServer } from 'node:http';
import { extname, join, resolve } from 'node:path';

const dir = resolve(process.argv[2]);
const modules = resolve('node_modules');
const ops = (await readdir(dir)).filter((f) => f.endsWith('.onnx')).map((f) => f.slice(0, -5)).sort();
const PAGE = `<!doctype html><script type="module">
const seen = []; // the log, hooked before onnxruntime binds console's methods
for (const k of ['log', 'info', 'warn', 'error', 'debug']) console[k] = (...a) => { seen.push(a.join(' ')); };
const ort = await import('/node_modules/onnxruntime-web/dist/ort.min.mjs');
ort.env.wasm.numThreads = 1;
ort.env.wasm.wasmPaths = '/node_modules/onnxruntime-web/dist/';
ort.env.logLevel = 'verbose';
const result = { version: ort.env.versions?.web, onGpu: [], missing: [], other: {} };
for (const op of ${JSON.stringify(ops)}) {
  seen.length = 0;
  try {
    const bytes = new Uint8Array(await (await fetch('/models/' + op + '.onnx')).arrayBuffer());
    const s = await ort.InferenceSession.create(bytes, { executionProviders: ['webgpu'], logSeverityLevel: 0 });
    await s.release();
    if (seen.some((l) => l.includes('kernel not found in registries for Op type: ' + op + ' '))) result.missing.push(op);
    else if (seen.some((l) => /All nodes placed on \\[JsExecutionProvider\\]/.test(l))) result.onGpu.push(op);
    else result.other[op] = (seen.find((l) => /placed on/.test(l)) ?? 'no placement logged').slice(-120);
  } catch (e) {
    result.other[op] = String(e.message ?? e).slice(0, 160);
  }
}
window.__coverage = result;
</script>`;
const TYPES = { '.mjs': 'text/javascript', '.js': 'text/javascript', '.wasm': 'application/wasm' };
const server = createServer(async (req, res) => {
  const path = decodeURIComponent(new URL(req.url, 'http://x').pathname);
  if (path === '/') return res.writeHead(200, { 'Content-Type': 'text/html' }).end(PAGE);
  const file = path.startsWith('/models/') ? join(dir, path.slice(8)) : path.startsWith('/node_modules/') ? join(modules, path.slice(14)) : null;
  if (!file || !existsSync(file)) return res.writeHead(404).end();
  res.writeHead(200, { 'Content-Type': TYPES[extname(file)] ?? 'application/octet-stream' }).end(await readFile(file));
});
await new Promise((ok) => server.listen(0, '127.0.0.1', ok));
const puppeteer = (await import(join(modules, 'puppeteer-core/lib/esm/puppeteer/puppeteer-core.js'))).default;
const browser = await puppeteer.launch({
  executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
  headless: true,
  protocolTimeout: 900_000,
  args: ['--no-sandbox', '--enable-unsafe-webgpu', '--use-angle=swiftshader', '--use-webgpu-adapter=swiftshader'],
});
try {
  const page = await browser.newPage();
  await page.goto(`http://127.0.0.1:${server.address().port}/`);
  await page.waitForFunction(() => window.__coverage, { timeout: 900_000, polling: 1000 });
  const result = await page.evaluate(() => window.__coverage);
  await writeFile(join(dir, 'webgpu.json'), JSON.stringify(result, null, 1));
  console.log(`onnxruntime-web ${result.version} webgpu: ${result.onGpu.length} ops on the GPU; no kernel for ${result.missing.join(', ')}`);
  console.log(`not classified (session failed): ${Object.keys(result.other).length}`);
} finally {
  await browser.close();
  server.close();
}

// make bench-js: onnxgrad's training steps against TensorFlow.js, one thread, same models and weights.
//
//   node bench/js/bench.mjs [FIXTURE] [--runs 5] [--steps 100] [--no-browser] [--json out/bench_js.json]
//
// FIXTURE (default bench/js/fixture) is what js/test/make_fixture.py writes: the digits MLP (FIXTURE/)
// and the LeNet-style CNN (FIXTURE/cnn/), each an artifacts folder (and artifacts_webgpu/), the digits
// and the Python runner's losses. In this one Node process: onnxgrad on onnxruntime-node and on
// onnxruntime-web (wasm), TensorFlow.js on its cpu and wasm backends; then in one headless chromium
// page (page.html): onnxgrad on onnxruntime-web wasm and WebGPU (where chromium gives an adapter; on a
// machine without a GPU its software one, SwiftShader), TensorFlow.js cpu and wasm. Each runtime
// trains `steps` steps from the same state, `runs` times, runs interleaved across runtimes so that a
// busy machine slows all alike; a run's figure is its median step time after 5 warm-up steps, the
// table gives the median over runs. Every run's losses are checked against the Python runner's
// (|difference| <= 1e-5 (1 + |loss|)): that is the check that both libraries compute the same thing.
import { existsSync } from 'node:fs';
import { mkdir, readFile, writeFile } from 'node:fs/promises';
import { createServer } from 'node:http';
import { dirname, extname, join, normalize, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { median, runOnnxgrad, runTfjs, worstDifference } from './common.mjs';

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, '..', '..');
const args = process.argv.slice(2);
const option = (name, fallback) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : fallback;
};
const fixture = resolve(args[0] && !args[0].startsWith('--') ? args[0] : join(here, 'fixture'));
const RUNS = Number(option('--runs', 5));
const STEPS = Number(option('--steps', 100));
const WARMUP = 5;
const TOL = 1e-5;
const jsonOut = option('--json', join(root, 'out', 'bench_js.json'));
const MODELS = { mlp: fixture, cnn: join(fixture, 'cnn') };

const { TrainingSession, readSafetensors } = await import('../../js/src/index.js');
const ortNode = await import('onnxruntime-node');
const ortWeb = await import('onnxruntime-web');
ortWeb.env.wasm.numThreads = 1;
const tf = await import('@tensorflow/tfjs');
const tfWasm = await import('@tensorflow/tfjs-backend-wasm');
tfWasm.setThreadsCount?.(1);

async function inputs(dir) {
  const expected = JSON.parse(await readFile(join(dir, 'expected.json'), 'utf8'));
  const data = readSafetensors(await readFile(join(dir, 'digits.safetensors'))).tensors;
  const state = readSafetensors(await readFile(join(dir, 'artifacts', 'state.safetensors')));
  const manifest = JSON.parse(await readFile(join(dir, 'artifacts', 'manifest.json'), 'utf8'));
  return { expected, data, state, hyper: manifest.optimizer };
}

const nodeRuntimes = {
  'onnxgrad, onnxruntime-node': (dir, inp) =>
    runOnnxgrad({
      ort: ortNode, TrainingSession, data: inp.data, expected: inp.expected, steps: STEPS,
      load: (name) => readFile(join(dir, 'artifacts', name)),
      sessionOptions: { intraOpNumThreads: 1, interOpNumThreads: 1, extra: { session: { intra_op: { allow_spinning: '0' } } } },
    }),
  'onnxgrad, onnxruntime-web (wasm)': (dir, inp) =>
    runOnnxgrad({
      ort: ortWeb, TrainingSession, data: inp.data, expected: inp.expected, steps: STEPS,
      load: (name) => readFile(join(dir, 'artifacts', name)), sessionOptions: { executionProviders: ['wasm'] },
    }),
  'TensorFlow.js (cpu)': async (dir, inp) => {
    await tf.setBackend('cpu');
    return runTfjs({ tf, kind: inp.expected.model, ...inp, steps: STEPS });
  },
  'TensorFlow.js (wasm)': async (dir, inp) => {
    await tf.setBackend('wasm');
    return runTfjs({ tf, kind: inp.expected.model, ...inp, steps: STEPS });
  },
};

/** runs x runtimes, interleaved; {runtime: {ms_per_step, runs_ms, worst, error}} */
async function compare(runtimes, call) {
  const out = Object.fromEntries(Object.keys(runtimes).map((k) => [k, { runs_ms: [], min_ms: Infinity, worst: 0 }]));
  for (let r = 0; r < RUNS; r++) {
    for (const name of Object.keys(runtimes)) {
      if (out[name].error) continue;
      try {
        const { losses, times, worst } = await call(name);
        out[name].runs_ms.push(median(times.slice(WARMUP)));
        out[name].min_ms = Math.min(out[name].min_ms, ...times.slice(WARMUP));
        out[name].worst = Math.max(out[name].worst, worst);
        if (!(worst <= TOL)) out[name].error = `losses differ from Python's by ${worst.toExponential(2)} (> ${TOL})`;
        out[name].last_loss = losses.at(-1);
      } catch (e) {
        out[name].error = String(e.message ?? e).split('\n')[0].slice(0, 200);
      }
    }
  }
  for (const v of Object.values(out)) {
    if (v.runs_ms.length) v.ms_per_step = median(v.runs_ms);
    else delete v.min_ms;
  }
  return out;
}

const results = { steps: STEPS, runs: RUNS, warmup: WARMUP, node: process.version, versions: {}, models: {} };
results.versions = {
  'onnxruntime-node': ortNode.env?.versions?.node ?? null,
  'onnxruntime-web': ortWeb.env?.versions?.web ?? null,
  '@tensorflow/tfjs': tf.version?.tfjs ?? tf.version_core ?? null,
  '@tensorflow/tfjs-backend-wasm': tfWasm.version_wasm ?? null,
};
for (const [model, dir] of Object.entries(MODELS)) {
  const inp = await inputs(dir);
  results.models[model] = { node: await compare(nodeRuntimes, async (name) => {
    const run = await nodeRuntimes[name](dir, inp);
    return { ...run, worst: worstDifference(run.losses, inp.expected.losses) };
  }) };
  report(model, 'Node', results.models[model].node);
}

function report(model, where, table) {
  console.log(`\n${model}, ${where} (ms/step: median of ${RUNS} runs of ${STEPS} steps, fastest step):`);
  for (const [name, v] of Object.entries(table)) {
    const figure = v.ms_per_step === undefined ? '-' : v.ms_per_step.toFixed(2);
    const fastest = v.ms_per_step === undefined ? '-' : v.min_ms.toFixed(2);
    console.log(`  ${name.padEnd(52)} ${figure.padStart(9)} ${fastest.padStart(9)}  ${v.error ? `FAILED: ${v.error}` : `losses within ${v.worst.toExponential(1)}`}`);
  }
}

// ---- the browser ----------------------------------------------------------------------------
const TYPES = { '.html': 'text/html', '.js': 'text/javascript', '.mjs': 'text/javascript', '.json': 'application/json', '.wasm': 'application/wasm' };
function serve() {
  const server = createServer(async (req, res) => {
    const file = join(root, normalize(decodeURIComponent(new URL(req.url, 'http://x').pathname)));
    if (!file.startsWith(root) || !existsSync(file)) return res.writeHead(404).end();
    try {
      res.writeHead(200, { 'Content-Type': TYPES[extname(file)] ?? 'application/octet-stream' }).end(await readFile(file));
    } catch {
      res.writeHead(404).end();
    }
  });
  return new Promise((ok) => server.listen(0, '127.0.0.1', () => ok(server)));
}

if (!args.includes('--no-browser')) {
  const executablePath = [process.env.CHROMIUM, '/usr/bin/chromium', '/usr/bin/chromium-browser', '/usr/bin/google-chrome'].find((p) => p && existsSync(p));
  if (!executablePath) {
    console.log('\nno chromium (apt-get install -y chromium, or CHROMIUM=): browser figures left out');
  } else {
    const puppeteer = (await import('puppeteer-core')).default;
    const server = await serve();
    const browser = await puppeteer.launch({
      executablePath, headless: true, protocolTimeout: 3_600_000,
      args: ['--no-sandbox', '--enable-unsafe-webgpu', '--use-angle=swiftshader', '--use-webgpu-adapter=swiftshader'],
    });
    try {
      const page = await browser.newPage();
      page.on('console', (msg) => { if (/^bench:/.test(msg.text())) console.log(`  [page] ${msg.text()}`); });
      const rel = (p) => '/' + p.slice(root.length + 1).split('\\').join('/') + '/';
      const query = new URLSearchParams({ runs: RUNS, steps: STEPS, warmup: WARMUP, mlp: rel(MODELS.mlp), cnn: rel(MODELS.cnn) });
      await page.goto(`http://127.0.0.1:${server.address().port}/bench/js/page.html?${query}`);
      await page.waitForFunction(() => window.__bench, { timeout: 3_600_000, polling: 1000 });
      const browserResults = await page.evaluate(() => window.__bench);
      results.chromium = { version: await browser.version(), adapter: browserResults.adapter };
      for (const [model, table] of Object.entries(browserResults.models)) {
        for (const v of Object.values(table)) {
          if (v.worst !== undefined && !(v.worst <= TOL) && !v.error) v.error = `losses differ from Python's by ${v.worst.toExponential(2)} (> ${TOL})`;
        }
        results.models[model].chromium = table;
        report(model, `chromium (WebGPU adapter: ${browserResults.adapter ?? 'none'})`, table);
      }
    } finally {
      await browser.close();
      server.close();
    }
  }
}
await mkdir(dirname(jsonOut), { recursive: true });
await writeFile(jsonOut, JSON.stringify(results, null, 1));
console.log(`\nwrote ${jsonOut}`);

// make test-web: serve the repository on localhost, open examples/web/index.html in headless
// chromium (puppeteer-core drives the system's chromium; nothing is downloaded), wait for the 200
// training steps of the digits MLP, then of the LeNet-style CNN, check the losses against the Python runner's (within 1e-5 (1 + |loss|)) and write a
// screenshot ($SCREENSHOT or examples/web/out/screenshot.png).
//
// Then the same on onnxruntime-web's WebGPU provider (the folder generated for target
// onnxruntime-web-webgpu, fixture/artifacts_webgpu/), on chromium's software adapter (SwiftShader,
// --enable-unsafe-webgpu): every node must be placed on WebGPU but the Casts of the lr and step
// inputs and the int64 shape ops (the page's verbose log says where each node runs). WEBGPU=0 skips it.
//
// Also runs the same TrainingSession on onnxruntime-web in Node (wasm backend, no browser).
import { existsSync } from 'node:fs';
import { mkdir, readFile } from 'node:fs/promises';
import { createServer } from 'node:http';
import { dirname, extname, join, normalize, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { check as checkConcurrent, concurrentSteps } from './concurrency.js';

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, '..', '..');
const FIXTURES = { mlp: 'fixture/', cnn: 'fixture/cnn/' }; // relative to here; make_fixture.py writes both
const screenshot = process.env.SCREENSHOT ?? join(here, 'out', 'screenshot.png');
const RTOL = 1e-5;
const WEBGPU = process.env.WEBGPU !== '0';
// steps on WebGPU: the software adapter takes 0.5 s (MLP) to several s (CNN) a step on a loaded 2-core machine
const WEBGPU_STEPS = { mlp: Number(process.env.WEBGPU_STEPS ?? 60), cnn: Number(process.env.WEBGPU_STEPS ?? 12) };
const TYPES = {
  '.html': 'text/html', '.js': 'text/javascript', '.mjs': 'text/javascript', '.json': 'application/json',
  '.wasm': 'application/wasm', '.png': 'image/png',
};

function check(losses, expected, where) {
  if (where.includes('webgpu')) expected = expected.slice(0, losses.length); // a shorter run: its first steps
  if (losses.length !== expected.length) throw new Error(`${where}: ${losses.length} losses, expected ${expected.length}`);
  losses.forEach((l, i) => {
    if (!(Math.abs(l - expected[i]) <= RTOL * (1 + Math.abs(expected[i])))) {
      throw new Error(`${where}: step ${i} loss ${l}, Python ${expected[i]}`);
    }
  });
  console.log(`${where}: ${losses.length} losses within ${RTOL} of Python's (${losses[0].toFixed(4)} -> ${losses.at(-1).toFixed(4)})`);
}

async function inNode(expected, fixture) {
  const ort = await import('onnxruntime-web');
  ort.env.wasm.numThreads = 1;
  const { TrainingSession, readSafetensors } = await import('../../js/src/index.js');
  const { tensors } = readSafetensors(await readFile(join(fixture, 'digits.safetensors')));
  const create = () => TrainingSession.create(ort, (name) => readFile(join(fixture, 'artifacts', name)));
  const [rows, ...sample] = tensors.pixels.dims;
  const width = sample.reduce((a, b) => a * b, 1);
  const size = expected.batch_size;
  const batchAt = (k) => {
    const start = (k % Math.floor(rows / size)) * size;
    return {
      pixels: new ort.Tensor('float32', tensors.pixels.data.slice(start * width, (start + size) * width), [size, ...sample]),
      target: tensors.target.data.slice(start, start + size),
    };
  };
  const where = `${expected.model ?? 'mlp'}: onnxruntime-web (wasm) in Node`;
  checkConcurrent(await concurrentSteps(create, batchAt), where);
  const session = await create();
  const losses = [];
  for (let k = 0; k < expected.steps; k++) losses.push(await session.step(batchAt(k)));
  check(losses, expected.losses, where);
}

function serve() {
  const server = createServer(async (req, res) => {
    const path = normalize(decodeURIComponent(new URL(req.url, 'http://x').pathname));
    const file = join(root, path);
    if (!file.startsWith(root) || !existsSync(file)) {
      res.writeHead(404).end();
      return;
    }
    try {
      res.writeHead(200, { 'Content-Type': TYPES[extname(file)] ?? 'application/octet-stream' });
      res.end(await readFile(file));
    } catch {
      res.writeHead(404).end();
    }
  });
  return new Promise((ok) => server.listen(0, '127.0.0.1', () => ok(server)));
}

function findChromium() {
  const candidates = [process.env.CHROMIUM, '/usr/bin/chromium', '/usr/bin/chromium-browser', '/usr/bin/google-chrome'];
  return candidates.find((p) => p && existsSync(p));
}

// Ops that may run on the CPU inside a WebGPU step: the Casts of the lr (double) and step (int64)
// inputs, and int64 shape arithmetic (onnxruntime puts shape computations on the CPU on purpose).
const CPU_ALLOWED = new Set(['Cast', 'Shape', 'Size', 'Gather', 'Concat', 'Unsqueeze', 'Squeeze', 'ReduceProd', 'Equal', 'Greater', 'Where', 'Add', 'Mul', 'Sub', 'Div', 'Neg', 'Pow', 'Sqrt', 'Exp']);

async function inBrowser(expected, fixture, shot, ep = 'wasm', steps = expected.steps) {
  const executablePath = findChromium();
  if (!executablePath) throw new Error('no chromium: apt-get install -y chromium, or set CHROMIUM');
  const puppeteer = (await import('puppeteer-core')).default;
  const server = await serve();
  const query = ep === 'webgpu' ? `fixture=${fixture}&artifacts=artifacts_webgpu/&ep=webgpu&log=0&steps=${steps}` : `fixture=${fixture}`;
  const url = `http://127.0.0.1:${server.address().port}/examples/web/index.html?${query}`;
  const args = ep === 'webgpu'
    ? ['--no-sandbox', '--enable-unsafe-webgpu', '--use-angle=swiftshader', '--use-webgpu-adapter=swiftshader']
    : ['--no-sandbox', '--disable-gpu'];
  const browser = await puppeteer.launch({ executablePath, headless: true, args, protocolTimeout: 900_000 });
  const placements = [];
  try {
    const page = await browser.newPage();
    await page.setViewport({ width: 1000, height: 520 });
    page.on('console', (msg) => {
      const text = msg.text();
      const cpu = /kernel not found in registries for Op type: (\S+) node name: (\S*)/.exec(text);
      if (cpu) placements.push(`${cpu[1]} ${cpu[2] || '(unnamed)'}`);
      else if (/placed on/.test(text)) console.log(`  [page] ${text.replace(/^.*\] +/, '')}`);
      else if (!/\[[VIW]:onnxruntime/.test(text)) console.log(`  [page] ${text}`);
    });
    await page.goto(url);
    await page.waitForFunction(() => window.__result?.done, { timeout: 800_000, polling: 500 });
    const result = await page.evaluate(() => window.__result);
    await mkdir(dirname(shot), { recursive: true });
    await page.screenshot({ path: shot });
    console.log(`screenshot: ${shot}`);
    if (result.error) throw new Error(`the page failed: ${result.error}`);
    if (ep === 'webgpu') {
      const cpu = [...new Set(placements)];
      console.log(`  on the CPU (no WebGPU kernel): ${cpu.join(', ') || 'nothing'}`);
      const bad = cpu.filter((p) => !CPU_ALLOWED.has(p.split(' ')[0]));
      if (bad.length) throw new Error(`${result.model}: nodes left on the CPU inside a WebGPU step: ${bad.join(', ')}`);
    }
    if (ep === 'wasm') checkConcurrent(result.concurrent, `${result.model}: chromium, onnxruntime-web (${ep})`);
    check(result.losses, expected.losses, `${result.model}: chromium, onnxruntime-web (${ep})`);
    console.log(`  ${result.msPerStep.toFixed(2)} ms/step, held-out accuracy ${(result.accuracy * 100).toFixed(1)}%`);
  } finally {
    await browser.close();
    server.close();
  }
}

const ONLY = process.env.ONLY_WEBGPU === '1';
for (const [model, sub] of Object.entries(FIXTURES)) {
  const fixture = join(here, sub);
  const expected = JSON.parse(await readFile(join(fixture, 'expected.json'), 'utf8'));
  if (!ONLY) await inNode(expected, fixture);
  const shot = model === 'mlp' ? screenshot : screenshot.replace(/(\.png)?$/, `-${model}.png`);
  if (!ONLY) await inBrowser(expected, sub, shot);
  if (WEBGPU) await inBrowser(expected, sub, shot.replace(/(\.png)?$/, '-webgpu.png'), 'webgpu', WEBGPU_STEPS[model]);
}

// The migrated example of docs/migrate_ort_training.md with onnxruntime-web's former TrainingSession
// names (ort_training.html): its losses, eval loss and parameter count against the Python API's
// (make_ort_training_fixture.py writes fixture/ort_training/), in Node and in chromium.
const ORT_TRAINING_RTOL = 1e-5;

function checkOrtTraining(result, where) {
  const { expected } = result;
  if (result.size !== expected.size) throw new Error(`${where}: ${result.size} parameters, Python ${expected.size}`);
  const refused = [
    'Cannot perform TrainStep with a nominal state. Please load the model parameters first.',
    'For nominal checkpoint state, all parameters need to be loaded into the model (trainableOnly = false).',
  ];
  if (JSON.stringify(result.nominal.refused) !== JSON.stringify(refused)) {
    throw new Error(`${where}: a nominal checkpoint was not refused as 1.19.2 refuses it: ${JSON.stringify(result.nominal.refused)}`);
  }
  const all = [...result.losses, result.evalLoss, result.restoredLoss, result.nominal.loss];
  const want = [...expected.losses, expected.eval_loss, expected.losses[0], expected.losses[0]];
  if (all.length !== want.length) throw new Error(`${where}: ${result.losses.length} losses, expected ${expected.losses.length}`);
  all.forEach((l, i) => {
    if (!(Math.abs(l - want[i]) <= ORT_TRAINING_RTOL * Math.abs(want[i]))) {
      const what = `of ${expected.steps} losses, the eval loss, the reloaded loss, the completed nominal checkpoint's loss`;
      throw new Error(`${where}: value ${i} (${what}) ${l}, Python ${want[i]}`);
    }
  });
  console.log(
    `${where}: a nominal checkpoint refused until complete; ${result.losses.length} losses, the eval loss, the ` +
      "reloaded parameters' loss and the completed nominal checkpoint's within " +
      `${ORT_TRAINING_RTOL} of Python's (${result.losses[0].toFixed(4)} -> ${result.losses.at(-1).toFixed(4)})`,
  );
}

async function ortTrainingInNode(fixture) {
  const ort = await import('onnxruntime-web');
  ort.env.wasm.numThreads = 1;
  const { trainMigratedExample } = await import('./ort_training_example.js');
  const result = await trainMigratedExample(ort, (path) => readFile(join(fixture, path)));
  checkOrtTraining(result, 'TrainingSession: onnxruntime-web (wasm) in Node');
}

async function ortTrainingInBrowser(sub, shot) {
  const executablePath = findChromium();
  if (!executablePath) throw new Error('no chromium: apt-get install -y chromium, or set CHROMIUM');
  const puppeteer = (await import('puppeteer-core')).default;
  const server = await serve();
  const url = `http://127.0.0.1:${server.address().port}/examples/web/ort_training.html?fixture=${sub}`;
  const browser = await puppeteer.launch({ executablePath, headless: true, args: ['--no-sandbox', '--disable-gpu'] });
  try {
    const page = await browser.newPage();
    page.on('console', (msg) => console.log(`  [page] ${msg.text()}`));
    await page.goto(url);
    await page.waitForFunction(() => window.__result?.done, { timeout: 240_000, polling: 500 });
    const result = await page.evaluate(() => window.__result);
    await mkdir(dirname(shot), { recursive: true });
    await page.screenshot({ path: shot, fullPage: true });
    console.log(`screenshot: ${shot}`);
    if (result.error) throw new Error(`ort_training.html failed: ${result.error}`);
    checkOrtTraining(result, 'TrainingSession: chromium, onnxruntime-web (wasm)');
  } finally {
    await browser.close();
    server.close();
  }
}

{
  const sub = 'fixture/ort_training/';
  await ortTrainingInNode(join(here, sub));
  await ortTrainingInBrowser(sub, screenshot.replace(/(\.png)?$/, '-ort-training.png'));
}

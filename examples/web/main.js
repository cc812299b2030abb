// Trains the digits MLP (or, with ?fixture=fixture/cnn/, the LeNet-style CNN) from an onnxgrad artifacts folder with onnxruntime-web
// (wasm backend, or WebGPU with ?ep=webgpu and a folder generated for target onnxruntime-web-webgpu), with
// the same TrainingSession class Node uses (../../js/src/index.js, ort injected). The folder, the
// data and the Python runner's losses come from js/test/make_fixture.py (in ./fixture/).
import { readSafetensors, TrainingSession } from '../../js/src/index.js';
import { concurrentSteps } from './concurrency.js';

const query = new URLSearchParams(location.search);
const ep = query.get('ep') ?? 'wasm'; // 'wasm' or 'webgpu'
const artifacts = query.get('artifacts') ?? 'artifacts/'; // artifacts_webgpu/: generated for WebGPU
// WebGPU: onnxruntime-web's default bundle (its JSEP WebGPU provider; ort.webgpu.min.mjs, the native one, has no
// float64 kernel at all, not even on its CPU fallback, so it cannot read the step's double lr input)
const ort = await import(`./node_modules/onnxruntime-web/dist/ort.${ep === 'webgpu' ? '' : 'wasm.'}min.mjs`);

if (query.get('log') === '0') ort.env.logLevel = 'verbose'; // ?log=0: where each node runs
ort.env.wasm.numThreads = 1; // no cross-origin isolation needed
ort.env.wasm.wasmPaths = new URL('./node_modules/onnxruntime-web/dist/', import.meta.url).href;

const status = document.getElementById('status');
const fixture = new URLSearchParams(location.search).get('fixture') ?? 'fixture/';
const fetchBytes = async (path) => {
  const response = await fetch(fixture + path);
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
};

// The model each fixture trains (expected.json's "model", written by js/test/make_fixture.py).
const MODEL_NAMES = { mlp: 'Digits MLP', cnn: 'Digits CNN (LeNet-style)' };

// A round step between ticks: 1, 2 or 5 times a power of ten, about span / count.
function tickStep(span, count) {
  const raw = span / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
}

function drawCurve(losses, expected) {
  const c = document.getElementById('curve').getContext('2d');
  const { width, height } = c.canvas;
  const plot = { left: 48, right: width - 10, top: 22, bottom: height - 34 }; // room for the tick labels
  const top = Math.max(...expected);
  const steps = expected.length - 1;
  const xOf = (i) => plot.left + (i / steps) * (plot.right - plot.left);
  const yOf = (v) => plot.bottom - (v / top) * (plot.bottom - plot.top);
  c.clearRect(0, 0, width, height);
  // axes, ticks and their labels: loss on the left, step below
  c.strokeStyle = '#888';
  c.lineWidth = 1;
  c.fillStyle = '#444';
  c.font = '11px system-ui, sans-serif';
  c.beginPath();
  c.moveTo(plot.left, plot.top);
  c.lineTo(plot.left, plot.bottom);
  c.lineTo(plot.right, plot.bottom);
  const dy = tickStep(top, 4);
  c.textAlign = 'right';
  c.textBaseline = 'middle';
  for (let v = 0; v <= top + 1e-9; v += dy) {
    c.moveTo(plot.left - 4, yOf(v));
    c.lineTo(plot.left, yOf(v));
    c.fillText(Number(v.toPrecision(6)).toString(), plot.left - 6, yOf(v));
  }
  const dx = tickStep(steps, 6);
  c.textAlign = 'center';
  c.textBaseline = 'top';
  for (let i = 0; i <= steps; i += dx) {
    c.moveTo(xOf(i), plot.bottom);
    c.lineTo(xOf(i), plot.bottom + 4);
    c.fillText(String(i), xOf(i), plot.bottom + 6);
  }
  c.stroke();
  c.fillText('step', (plot.left + plot.right) / 2, plot.bottom + 20);
  c.save();
  c.translate(12, (plot.top + plot.bottom) / 2);
  c.rotate(-Math.PI / 2);
  c.fillText('loss', 0, -6);
  c.restore();
  const line = (values, color, widthPx) => {
    c.strokeStyle = color;
    c.lineWidth = widthPx;
    c.beginPath();
    values.forEach((v, i) => {
      if (i === 0) c.moveTo(xOf(i), yOf(v));
      else c.lineTo(xOf(i), yOf(v));
    });
    c.stroke();
  };
  line(expected, '#bbb', 5); // the Python runner's losses, under the browser's
  line(losses, '#d33', 1.5);
  c.fillStyle = '#222';
  c.textAlign = 'left';
  c.textBaseline = 'alphabetic';
  c.fillText(`loss (red: browser, grey: Python), ${losses.length} steps`, plot.left + 6, 14);
}

function drawDigits(pixels, labels, predicted, count) {
  const box = document.getElementById('digits');
  for (let k = 0; k < count; k++) {
    const canvas = document.createElement('canvas');
    canvas.width = canvas.height = 8;
    canvas.style.width = canvas.style.height = '40px';
    const ctx = canvas.getContext('2d');
    const image = ctx.createImageData(8, 8);
    for (let i = 0; i < 64; i++) {
      const v = 255 - Math.round(pixels[k * 64 + i] * 255);
      image.data.set([v, v, v, 255], i * 4);
    }
    ctx.putImageData(image, 0, 0);
    canvas.title = `label ${labels[k]}, predicted ${predicted[k]}`;
    canvas.style.outline = predicted[k] === Number(labels[k]) ? '2px solid #3a3' : '2px solid #d33';
    box.appendChild(canvas);
  }
}

async function main() {
  const expected = JSON.parse(new TextDecoder().decode(await fetchBytes('expected.json')));
  const model = expected.model ?? 'mlp';
  document.getElementById('heading').textContent =
    `${MODEL_NAMES[model] ?? model} trained with onnxruntime-web (wasm)`;
  const { tensors } = readSafetensors(await fetchBytes('digits.safetensors'));
  const [rows, ...sample] = tensors.pixels.dims; // [64] for the MLP, [1, 8, 8] for the CNN
  const width = sample.reduce((a, b) => a * b, 1);
  const size = expected.batch_size;
  const batchAt = (step) => {
    const start = (step % Math.floor(rows / size)) * size;
    return {
      pixels: new ort.Tensor('float32', tensors.pixels.data.slice(start * width, (start + size) * width), [size, ...sample]),
      target: tensors.target.data.slice(start, start + size),
    };
  };
  const create = () =>
    TrainingSession.create(ort, (name) => fetchBytes(`${artifacts}${name}`), {
      sessionOptions: { executionProviders: ep === 'webgpu' ? ['webgpu', 'wasm'] : [ep], logSeverityLevel: Number(query.get('log') ?? 2) },
    });
  // steps called at once run in call order (wasm only: WebGPU's software adapter is slow)
  const concurrent = ep === 'wasm' ? await concurrentSteps(create, batchAt) : null;
  const session = await create();
  const steps = Math.min(Number(query.get('steps') ?? expected.steps), expected.steps); // ?steps=N: the first N
  const losses = [];
  const started = performance.now();
  for (let k = 0; k < steps; k++) {
    losses.push(await session.step(batchAt(k)));
    if (k % 20 === 19) {
      status.textContent = `step ${k + 1}/${steps}: loss ${losses.at(-1).toFixed(4)}`;
      drawCurve(losses, expected.losses);
      await new Promise((r) => setTimeout(r, 0));
    }
  }
  const ms = (performance.now() - started) / steps;
  drawCurve(losses, expected.losses);
  const worst = Math.max(...losses.map((l, i) => Math.abs(l - expected.losses[i]) / Math.abs(expected.losses[i])));
  // the last 297 rows were never trained on: predict them with inference.onnx and the trained weights
  const held = rows - 297;
  const pixels = tensors.pixels.data.slice(held * width);
  const { logits } = await session.predict({ pixels: new ort.Tensor('float32', pixels, [297, ...sample]) });
  const predicted = [];
  for (let r = 0; r < 297; r++) {
    const row = logits.data.slice(r * 10, r * 10 + 10);
    predicted.push(row.indexOf(Math.max(...row)));
  }
  const labels = tensors.target.data.slice(held);
  const accuracy = predicted.filter((p, i) => p === Number(labels[i])).length / 297;
  drawDigits(pixels, labels, predicted, 40);
  document.getElementById('accuracy').textContent = `accuracy on 297 rows: ${(accuracy * 100).toFixed(1)}%`;
  status.textContent =
    `done: ${steps} steps, loss ${losses[0].toFixed(4)} → ${losses.at(-1).toFixed(4)}, ` +
    `${ms.toFixed(2)} ms/step (${ep}), largest relative difference from Python ${worst.toExponential(2)}`;
  document.title = `onnxgrad: ${expected.model ?? 'mlp'} trained in the browser`;
  window.__result = {
    done: true, model: expected.model ?? 'mlp', ep, losses, expected: expected.losses, worst, accuracy, msPerStep: ms, concurrent,
  };
}

main().catch((err) => {
  status.textContent = `error: ${err.message}`;
  window.__result = { done: true, error: String(err.stack ?? err) };
});

// The browser half of bench.mjs: the same runs (common.mjs) in chromium, one thread each:
// onnxgrad on onnxruntime-web wasm and WebGPU (artifacts_webgpu/, where an adapter exists),
// TensorFlow.js cpu and wasm. Query: runs, steps, warmup, mlp and cnn (fixture folders, site paths).
import { readSafetensors, TrainingSession } from '../../js/src/index.js';
import { median, runOnnxgrad, runTfjs, worstDifference } from './common.mjs';

const ort = await import('./node_modules/onnxruntime-web/dist/ort.min.mjs'); // wasm and (JSEP) WebGPU
ort.env.wasm.numThreads = 1;
ort.env.wasm.wasmPaths = new URL('./node_modules/onnxruntime-web/dist/', import.meta.url).href;
const tf = window.tf;
tf.wasm.setWasmPaths(new URL('./node_modules/@tensorflow/tfjs-backend-wasm/dist/', import.meta.url).href);
tf.wasm.setThreadsCount?.(1);

const q = new URLSearchParams(location.search);
const RUNS = Number(q.get('runs') ?? 5);
const STEPS = Number(q.get('steps') ?? 100);
const WARMUP = Number(q.get('warmup') ?? 5);
const bytes = async (path) => {
  const r = await fetch(path);
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return new Uint8Array(await r.arrayBuffer());
};
const adapter = navigator.gpu ? await navigator.gpu.requestAdapter() : null;
const adapterName = adapter ? `${adapter.info?.vendor ?? ''} ${adapter.info?.architecture ?? ''}`.trim() || 'yes' : null;

async function inputs(dir) {
  const expected = JSON.parse(new TextDecoder().decode(await bytes(dir + 'expected.json')));
  const data = readSafetensors(await bytes(dir + 'digits.safetensors')).tensors;
  const state = readSafetensors(await bytes(dir + 'artifacts/state.safetensors'));
  const manifest = JSON.parse(new TextDecoder().decode(await bytes(dir + 'artifacts/manifest.json')));
  return { expected, data, state, hyper: manifest.optimizer, feedback: manifest.train_step.feedback };
}

function runtimes(dir, inp) {
  const onnxgrad = (folder, sessionOptions) => () =>
    runOnnxgrad({ ort, TrainingSession, data: inp.data, expected: inp.expected, steps: STEPS, sessionOptions,
      load: (name) => bytes(`${dir}${folder}/${name}`) });
  const table = { 'onnxgrad, onnxruntime-web (wasm)': onnxgrad('artifacts', { executionProviders: ['wasm'] }) };
  if (adapter) {
    table['onnxgrad, onnxruntime-web (webgpu)'] = onnxgrad('artifacts_webgpu', { executionProviders: ['webgpu'] });
    // the parameters and optimizer state stay on the GPU between steps: the next/... outputs as GPU buffers
    const onGpu = Object.fromEntries(Object.keys(inp.feedback).map((name) => [name, 'gpu-buffer']));
    table['onnxgrad, onnxruntime-web (webgpu, state on the GPU)'] = onnxgrad('artifacts_webgpu', {
      executionProviders: ['webgpu'], preferredOutputLocation: onGpu });
  }
  for (const backend of ['cpu', 'wasm']) {
    table[`TensorFlow.js (${backend})`] = async () => {
      await tf.setBackend(backend);
      return runTfjs({ tf, kind: inp.expected.model, ...inp, steps: STEPS });
    };
  }
  return table;
}

const result = { adapter: adapterName, models: {} };
try {
  for (const model of ['mlp', 'cnn']) {
    const dir = q.get(model);
    const inp = await inputs(dir);
    const table = runtimes(dir, inp);
    const out = Object.fromEntries(Object.keys(table).map((k) => [k, { runs_ms: [], min_ms: Infinity, worst: 0 }]));
    for (let r = 0; r < RUNS; r++) {
      for (const [name, run] of Object.entries(table)) {
        if (out[name].error) continue;
        try {
          const { losses, times } = await run();
          out[name].runs_ms.push(median(times.slice(WARMUP)));
          out[name].min_ms = Math.min(out[name].min_ms, ...times.slice(WARMUP));
          out[name].worst = Math.max(out[name].worst, worstDifference(losses, inp.expected.losses));
          out[name].last_loss = losses.at(-1);
        } catch (e) {
          out[name].error = String(e.message ?? e).split('\n')[0].slice(0, 200);
        }
        console.log(`bench: ${model} run ${r + 1}/${RUNS} ${name}: ${out[name].error ?? `${out[name].runs_ms.at(-1).toFixed(2)} ms/step`}`);
      }
    }
    for (const v of Object.values(out)) {
      if (v.runs_ms.length) v.ms_per_step = median(v.runs_ms);
      else delete v.min_ms;
    }
    result.models[model] = out;
  }
} catch (e) {
  result.error = String(e.stack ?? e);
}
document.getElementById('out').textContent = JSON.stringify(result, null, 1);
window.__bench = result;

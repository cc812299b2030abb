// ort_training.html: the migrated example (docs/migrate_ort_training.md) trained in the browser
// with onnxruntime-web (wasm) through the TrainingSession names (ort_training_example.js). The
// folder and the Python API's losses come from make_ort_training_fixture.py (in
// ./fixture/ort_training/, or ?fixture=...); test-web.mjs reads window.__result.
import * as ort from './node_modules/onnxruntime-web/dist/ort.wasm.min.mjs';
import { fetchBytes } from '../../js/src/ort_training.js';
import { trainMigratedExample } from './ort_training_example.js';

ort.env.wasm.numThreads = 1; // no cross-origin isolation needed
ort.env.wasm.wasmPaths = new URL('./node_modules/onnxruntime-web/dist/', import.meta.url).href;

const status = document.getElementById('status');
const fixture = new URLSearchParams(location.search).get('fixture') ?? 'fixture/ort_training/';

async function main() {
  const table = document.getElementById('losses');
  const result = await trainMigratedExample(ort, (path) => fetchBytes(fixture + path), async (k, loss) => {
    const row = table.insertRow();
    row.insertCell().textContent = String(k + 1);
    row.insertCell().textContent = loss.toFixed(6);
    status.textContent = `step ${k + 1}: loss ${loss.toFixed(4)}`;
  });
  const { expected, losses, evalLoss } = result;
  [...table.rows].slice(1).forEach((row, k) => {
    row.insertCell().textContent = expected.losses[k].toFixed(6);
  });
  status.textContent =
    `done: ${losses.length} steps, loss ${losses[0].toFixed(4)} → ${losses.at(-1).toFixed(4)}, ` +
    `eval loss ${evalLoss.toFixed(4)} (Python: ${expected.eval_loss.toFixed(4)})`;
  window.__result = { done: true, model: 'migrated example', ...result };
}

main().catch((err) => {
  status.textContent = `error: ${err.message}`;
  window.__result = { done: true, error: String(err.stack ?? err) };
});

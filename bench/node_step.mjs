// node bench/node_step.mjs FOLDER BATCH.safetensors [STEPS] [THREADS]: times TrainingSession.step
// (js/, onnxruntime-node) on an artifacts folder with one batch, after 3 warm-up steps; prints
// {"median_ms", "min_ms", "steps", "ort", "times_ms"} as JSON. bench/artifacts_step.py --node runs it
// (js/node_modules must be installed: cd js && npm ci).
import { readFile } from 'node:fs/promises';
import { loadTrainingFolder, ort, readSafetensors } from '../js/src/node.js';

const [folder, batchFile, stepsArg = '20', threadsArg = '2'] = process.argv.slice(2);
const steps = Number(stepsArg);
const { tensors } = readSafetensors(await readFile(batchFile));
const batch = Object.fromEntries(Object.entries(tensors).map(([k, t]) => [k, new ort.Tensor(t.type, t.data, t.dims)]));
const session = await loadTrainingFolder(folder, {
  sessionOptions: { intraOpNumThreads: Number(threadsArg), interOpNumThreads: 1, extra: { session: { intra_op: { allow_spinning: '0' } } } },
});
for (let k = 0; k < 3; k++) await session.step(batch);
const times = [];
for (let k = 0; k < steps; k++) {
  const t0 = performance.now();
  await session.step(batch);
  times.push(performance.now() - t0);
}
times.sort((a, b) => a - b);
const median = steps % 2 ? times[(steps - 1) / 2] : (times[steps / 2 - 1] + times[steps / 2]) / 2;
console.log(JSON.stringify({ median_ms: median, min_ms: times[0], steps, ort: ort.env?.versions?.node ?? null, times_ms: times }));
await session.release();

// A project that installed the packed onnxgrad-artifacts (and onnxruntime-node, its peer) trains
// a few steps of the digits fixture through the package's own names (js/test/package.test.js runs
// this in a fresh temporary project):  node usage.mjs FIXTURE_DIR STEPS
// Prints one JSON line: the losses, the generic entry's first loss, the shape error's message and
// where the package was resolved from.
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { TrainingSession } from 'onnxgrad-artifacts';
import { loadTrainingFolder, ort, readSafetensors } from 'onnxgrad-artifacts/node';

const [fixture, steps = '5'] = process.argv.slice(2);
const expected = JSON.parse(await readFile(join(fixture, 'expected.json'), 'utf8'));
const { tensors } = readSafetensors(await readFile(join(fixture, 'digits.safetensors')));
const size = expected.batch_size;
const width = tensors.pixels.dims.slice(1).reduce((a, b) => a * b, 1);
const rows = Math.floor(tensors.target.dims[0] / size);
const batchAt = (k) => {
  const start = (k % rows) * size;
  return {
    pixels: new ort.Tensor('float32', tensors.pixels.data.slice(start * width, (start + size) * width), [size, width]),
    target: tensors.target.data.slice(start, start + size),
  };
};

const sessionOptions = { intraOpNumThreads: 1 };
const session = await loadTrainingFolder(join(fixture, 'artifacts'), { sessionOptions });
const losses = [];
for (let k = 0; k < Number(steps); k++) losses.push(await session.step(batchAt(k)));

// the runtime-free entry, onnxruntime-node injected (the browser injects onnxruntime-web)
const generic = await TrainingSession.create(ort, (name) => readFile(join(fixture, 'artifacts', name)), { sessionOptions });
const genericLoss = await generic.step(batchAt(0));

// a flat batch of the wrong width: an Error naming the input and both shapes
let shapeError = null;
try {
  await session.step({ pixels: tensors.pixels.data.slice(0, size * width - width / 2), target: batchAt(0).target });
} catch (error) {
  shapeError = error.message;
}
await session.release();
await generic.release();
console.log(JSON.stringify({ losses, genericLoss, shapeError, resolved: import.meta.resolve('onnxgrad-artifacts/node') }));

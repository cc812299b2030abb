// The digits MLP and a LeNet-style CNN trained from artifacts folders on onnxruntime-node: the
// losses of the Python runner (onnxgrad.artifacts.Runner) over 200 steps. The fixtures come from
// make_fixture.py, in $ONNXGRAD_JS_FIXTURE (the MLP's; the CNN's in its cnn/ subfolder) or
// test/fixture (make test-js writes them).
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { loadTrainingFolder, ort, readSafetensors, writeSafetensors } from '../src/node.js';

const ROOT = process.env.ONNXGRAD_JS_FIXTURE ?? fileURLToPath(new URL('./fixture/', import.meta.url));
const RTOL = 1e-4;

function close(actual, expected, rtol = RTOL, atol = 1e-6) {
  return Math.abs(actual - expected) <= atol + rtol * Math.abs(expected);
}

async function fixture(model = 'mlp') {
  const FIXTURE = model === 'mlp' ? ROOT : join(ROOT, model);
  if (!existsSync(join(FIXTURE, 'expected.json'))) {
    throw new Error(`no fixture in ${FIXTURE}: run python js/test/make_fixture.py ${FIXTURE}`);
  }
  const expected = JSON.parse(await readFile(join(FIXTURE, 'expected.json'), 'utf8'));
  const { tensors } = readSafetensors(await readFile(join(FIXTURE, 'digits.safetensors')));
  const batchAt = (step) => {
    const n = Math.floor(tensors.target.dims[0] / expected.batch_size);
    const start = (step % n) * expected.batch_size;
    const sample = tensors.pixels.dims.slice(1);
    const width = sample.reduce((a, b) => a * b, 1);
    return {
      pixels: new ort.Tensor('float32', tensors.pixels.data.slice(start * width, (start + expected.batch_size) * width), [
        expected.batch_size,
        ...sample,
      ]),
      target: tensors.target.data.slice(start, start + expected.batch_size), // a TypedArray: dims inferred
    };
  };
  return { expected, batchAt, folder: join(FIXTURE, 'artifacts'), dir: FIXTURE };
}

for (const model of ['mlp', 'cnn']) {
test(`${model}: 200 steps give the losses of the Python runner`, async () => {
  const { expected, batchAt, folder, dir } = await fixture(model);
  const session = await loadTrainingFolder(folder, { sessionOptions: { intraOpNumThreads: 1 } });
  assert.equal(session.lr, expected.lr);
  for (let k = 0; k < expected.steps; k++) {
    const loss = await session.step(batchAt(k));
    assert.ok(close(loss, expected.losses[k]), `step ${k}: loss ${loss}, python ${expected.losses[k]}`);
  }
  assert.ok(expected.losses.at(-1) < 0.5 * expected.losses[0], 'the model learns');
  const { loss } = await session.evaluate(batchAt(0));
  assert.ok(close(loss, expected.eval_loss), `eval loss ${loss}, python ${expected.eval_loss}`);

  // the exported parameters are the Python runner's after the same steps
  const trained = readSafetensors(await readFile(join(dir, 'trained.safetensors')));
  assert.equal(trained.metadata.step, String(expected.steps));
  const exported = readSafetensors(session.exportParameters()).tensors;
  const names = session.manifest.parameters.map((p) => p.name);
  assert.deepEqual(Object.keys(exported), names);
  for (const name of names) {
    const ref = trained.tensors[name].data;
    const got = exported[name].data;
    assert.deepEqual(exported[name].dims, trained.tensors[name].dims);
    let worst = 0;
    for (let i = 0; i < ref.length; i++) worst = Math.max(worst, Math.abs(got[i] - ref[i]) / (1e-3 + Math.abs(ref[i])));
    assert.ok(worst < 1e-3, `${name}: worst relative difference ${worst}`);
  }

  // inference.onnx takes the trained parameters: its logits are the eval step's
  const batch = batchAt(3);
  const { outputs } = await session.evaluate(batch);
  const predicted = await session.predict({ pixels: batch.pixels });
  assert.deepEqual(Array.from(predicted.logits.data), Array.from(outputs.logits.data));
  await session.release();
});
}

test('a state exported from one session resumes in another', async () => {
  const { expected, batchAt, folder } = await fixture();
  const options = { sessionOptions: { intraOpNumThreads: 1 } };
  const first = await loadTrainingFolder(folder, options);
  for (let k = 0; k < 5; k++) await first.step(batchAt(k));
  const second = await loadTrainingFolder(folder, { ...options, state: first.exportState() });
  assert.equal(second.iterations, 5);
  const a = await first.step(batchAt(5));
  const b = await second.step(batchAt(5));
  assert.equal(a, b);
  assert.ok(close(a, expected.losses[5]));
});

test('safetensors round trip', () => {
  const tensors = {
    a: { type: 'float32', dims: [2, 3], data: Float32Array.of(1, 2, 3, 4, 5, 6.5) },
    b: { type: 'int64', dims: [], data: BigInt64Array.of(7n) },
    c: { type: 'float64', dims: [1], data: Float64Array.of(Math.PI) },
  };
  const back = readSafetensors(writeSafetensors(tensors, { step: 3 }));
  assert.deepEqual(back.metadata, { step: '3' });
  for (const [name, t] of Object.entries(tensors)) {
    assert.equal(back.tensors[name].type, t.type);
    assert.deepEqual(back.tensors[name].dims, t.dims);
    assert.deepEqual(Array.from(back.tensors[name].data), Array.from(t.data));
  }
});

// Batch values are checked against the manifest before a run: a value of the wrong width, rank,
// dtype or batch size is an Error naming the input, the expected and the given shape, not
// onnxruntime's `dims[0] must be an integer, got: 31.5`; nothing is updated. Uses the MLP fixture
// of make_fixture.py (pixels [N, 64] float32, target [N] int64).
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { before, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { loadTrainingFolder, ort } from '../src/node.js';

const ROOT = process.env.ONNXGRAD_JS_FIXTURE ?? fileURLToPath(new URL('./fixture/', import.meta.url));
const N = 32;
const pixels = (rows, width = 64) => new Float32Array(rows * width).fill(0.5);
const target = (rows) => BigInt64Array.from({ length: rows }, (_, i) => BigInt(i % 10));
let session;

before(async () => {
  if (!existsSync(join(ROOT, 'artifacts', 'manifest.json'))) throw new Error(`no fixture in ${ROOT}: run python js/test/make_fixture.py ${ROOT}`);
  session = await loadTrainingFolder(join(ROOT, 'artifacts'), { sessionOptions: { intraOpNumThreads: 1 } });
});

const cases = {
  'a flat batch of the wrong width (the issue: 2016 = 31.5 rows)': [
    { pixels: pixels(31.5), target: target(N) },
    'batch input pixels has shape [2016] (a flat array), the model expects [N, 64]: 2016 values are not a whole number of 64-value rows',
  ],
  'a tensor of the wrong width': [
    { pixels: new ort.Tensor('float32', pixels(N, 63), [N, 63]), target: target(N) },
    'batch input pixels has shape [32, 63], the model expects [N, 64] (dimension 1 must be 64)',
  ],
  'a tensor of the wrong rank': [
    { pixels: new ort.Tensor('float32', pixels(N), [N, 8, 8]), target: target(N) },
    'batch input pixels has shape [32, 8, 8], the model expects [N, 64] (rank 2)',
  ],
  'a tensor of the wrong dtype': [
    { pixels: new ort.Tensor('float64', new Float64Array(N * 64), [N, 64]), target: target(N) },
    'batch input pixels has dtype float64, the model expects float32 (shape [N, 64])',
  ],
  'targets for another batch size': [
    { pixels: pixels(N), target: target(N - 1) },
    'batch input target has shape [31], the model expects [N] with N = 32 as in pixels (dimension 0 is 31)',
  ],
  'a fractional class index': [
    { pixels: pixels(N), target: [1, 2.5, 3] },
    'batch input target: value 2.5 at index 1 is not an integer (the model expects int64)',
  ],
  'nested arrays': [
    { pixels: [Array(64).fill(0)], target: [1] },
    'batch input pixels: the value at index 0 is an array (nested arrays are not read: pass a flat array or an ort.Tensor), not a number',
  ],
  'a tensor-like object whose data do not fill its dims': [
    { pixels: { type: 'float32', dims: [N, 64], data: pixels(N - 1) }, target: target(N) },
    'batch input pixels has dims [32, 64] (2048 values) but 1984 values',
  ],
  'a number for an input': [{ pixels: 3, target: [1] }, 'batch input pixels must be an ort.Tensor, a typed array or an array, got number'],
  'a missing target': [{ pixels: pixels(N) }, 'missing batch input target; this run takes pixels, target'],
};

for (const [what, [batch, message]] of Object.entries(cases)) {
  test(`step: ${what}`, async () => {
    const before = session.parameters['fc1.weight'];
    await assert.rejects(session.step(batch), (error) => {
      assert.equal(error.constructor, Error);
      assert.equal(error.message, message);
      return true;
    });
    assert.equal(session.iterations, 0, 'no update was made');
    assert.equal(session.parameters['fc1.weight'], before);
  });
}

test('evaluate and predict check their inputs too', async () => {
  await assert.rejects(session.evaluate({ pixels: pixels(N), target: target(N + 1) }), {
    message: 'batch input target has shape [33], the model expects [N] with N = 32 as in pixels (dimension 0 is 33)',
  });
  await assert.rejects(session.predict({ pixels: pixels(2, 63) }), {
    message: 'batch input pixels has shape [126] (a flat array), the model expects [N, 64]: 126 values are not a whole number of 64-value rows',
  });
});

test('batches that fit train: flat arrays get the batch size from the manifest', async () => {
  const loss = await session.step({ pixels: Array.from(pixels(N)), target: Array.from({ length: N }, (_, i) => i % 10) });
  assert.ok(Number.isFinite(loss) && loss > 0, `loss ${loss}`);
  assert.equal(session.iterations, 1);
  const { logits } = await session.predict({ pixels: pixels(3) });
  assert.deepEqual(logits.dims, [3, 10]);
  const { outputs } = await session.evaluate({ pixels: new ort.Tensor('float32', pixels(5), [5, 64]), target: target(5) });
  assert.deepEqual(outputs.logits.dims, [5, 10]);
});

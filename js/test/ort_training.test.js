// onnxruntime-web's former training API (TrainingSession: runTrainStep, runOptimizerStep,
// runEvalStep, lazyResetGrad, getParametersSize, getContiguousParameters, loadParametersBuffer)
// on onnxruntime-node, over a folder of onnxgrad.compat.training: the numbers of the Python API.
// Fixture: make_ort_training_fixture.py, in $ONNXGRAD_ORT_TRAINING_FIXTURE or
// test/ort_training_fixture (tests/compat_training/test_js.py writes it and runs this file).
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { readSafetensors } from '../src/node.js';
import { TrainingSession, ort, readCheckpoint } from '../src/ort_training_node.js';

const ROOT = process.env.ONNXGRAD_ORT_TRAINING_FIXTURE ?? fileURLToPath(new URL('./ort_training_fixture/', import.meta.url));
const MISSING = !existsSync(join(ROOT, 'expected.json'));
const SKIP = MISSING && `no fixture in ${ROOT}: run python js/test/make_ort_training_fixture.py`;

function assertClose(actual, expected, what, rtol = 1e-4) {
  const scale = Math.max(...expected.map(Math.abs), 1e-3);
  assert.equal(actual.length, expected.length, what);
  actual.forEach((a, i) => assert.ok(Math.abs(a - expected[i]) <= rtol * scale, `${what}[${i}]: ${a} vs ${expected[i]}`));
}

async function setup() {
  const expected = JSON.parse(await readFile(join(ROOT, 'expected.json'), 'utf8'));
  const { tensors } = readSafetensors(await readFile(join(ROOT, 'data.safetensors')));
  const dir = join(ROOT, 'artifacts');
  const session = await TrainingSession.create({
    checkpointState: join(dir, 'checkpoint'),
    trainModel: join(dir, 'training_model.onnx'),
    evalModel: join(dir, 'eval_model.onnx'),
    optimizerModel: join(dir, 'optimizer_model.onnx'),
  });
  const rows = (start, n) => ({
    input: new ort.Tensor('float32', tensors.input.data.slice(start * 4, (start + n) * 4), [n, 4]),
    labels: new ort.Tensor('int64', tensors.labels.data.slice(start, start + n), [n]),
  });
  return { expected, session, rows, total: tensors.labels.dims[0] };
}

test('training steps give the Python API numbers', { skip: SKIP }, async () => {
  const { expected, session, rows, total } = await setup();
  assert.deepEqual(session.trainingInputNames, expected.input_names);
  assert.deepEqual(session.trainingOutputNames, expected.output_names);
  assert.equal(await session.getParametersSize(), expected.size);
  assert.equal(await session.getParametersSize(false), expected.size_all);
  session.setLearningRate(expected.lr);
  const losses = [];
  for (let k = 0; k < expected.updates; k++) {
    for (let h = 0; h < 2; h++) {
      const out = await session.runTrainStep(rows((2 * k + h) * expected.half, expected.half));
      losses.push(Number(out[session.trainingOutputNames[0]].data[0]));
    }
    await session.runOptimizerStep();
    await session.lazyResetGrad();
  }
  assertClose(losses, expected.losses, 'losses');
  const evalOut = await session.runEvalStep(rows(0, total));
  assertClose([Number(evalOut[session.evalOutputNames[0]].data[0])], [expected.eval_loss], 'eval loss');
  const params = await session.getContiguousParameters();
  assertClose(Array.from(params.data), expected.contiguous, 'parameters');
  await session.release();
});

test('loadParametersBuffer writes the parameters back', { skip: SKIP }, async () => {
  const { expected, session, rows } = await setup();
  const trained = Float32Array.from(expected.contiguous);
  await session.loadParametersBuffer(new Uint8Array(trained.buffer));
  assertClose(Array.from((await session.getContiguousParameters()).data), expected.contiguous, 'loaded');
  await assert.rejects(session.loadParametersBuffer(new Uint8Array(8)), /the buffer has 8 bytes/);
  const out = await session.runEvalStep(rows(0, 8));
  assert.ok(Number.isFinite(Number(out[session.evalOutputNames[0]].data[0])));
  await session.release();
});

test('the checkpoint reader reads the folder checkpoint', { skip: SKIP }, async () => {
  const state = readCheckpoint(await readFile(join(ROOT, 'artifacts', 'checkpoint')));
  assert.deepEqual(Object.keys(state.trainable), ['fc1.weight', 'fc1.bias', 'fc2.weight', 'fc2.bias']);
  assert.deepEqual(state.trainable['fc1.weight'].dims, [4, 8]);
  assert.equal(state.nominal, false);
  assert.throws(() => readCheckpoint(new Uint8Array(16)), /no ODTC file identifier/);
});

test('a checkpoint with external data (over 2 GB) is refused, not read as zeros', { skip: SKIP }, async () => {
  const bytes = await readFile(join(ROOT, 'external', 'checkpoint'));
  assert.throws(() => readCheckpoint(bytes), /checkpoint tensor fc1\.weight keeps its data in the checkpoint's external file/);
});

/** The folder's files as TrainingSession.create takes them, `changes` applied (null: left out). */
function files(changes = {}) {
  const dir = join(ROOT, 'artifacts');
  const all = {
    checkpointState: join(dir, 'checkpoint'),
    trainModel: join(dir, 'training_model.onnx'),
    evalModel: join(dir, 'eval_model.onnx'),
    optimizerModel: join(dir, 'optimizer_model.onnx'),
    ...changes,
  };
  return Object.fromEntries(Object.entries(all).filter(([, v]) => v !== null));
}

const NOMINAL = 'Please load the model parameters first.';

test('a nominal checkpoint trains nothing until every parameter is loaded', { skip: SKIP }, async () => {
  const { expected, session: complete, rows } = await setup();
  const all = await complete.getContiguousParameters(false);
  await complete.release();
  const session = await TrainingSession.create(files({ checkpointState: join(ROOT, 'nominal', 'checkpoint') }));
  await assert.rejects(session.runTrainStep(rows(0, 4)), { message: `Cannot perform TrainStep with a nominal state. ${NOMINAL}` });
  await assert.rejects(session.runEvalStep(rows(0, 4)), { message: `Cannot perform EvalStep with a nominal state. ${NOMINAL}` });
  await assert.rejects(session.runOptimizerStep(), { message: `Cannot fetch named parameters from a nominal checkpoint state. ${NOMINAL}` });
  await assert.rejects(session.getContiguousParameters(), {
    message: `Cannot copy parameters from a nominal checkpoint state. ${NOMINAL}`,
  });
  const trainable = new Float32Array(all.data.slice(0, expected.size));
  await assert.rejects(session.loadParametersBuffer(new Uint8Array(trainable.buffer), true), {
    message: 'For nominal checkpoint state, all parameters need to be loaded into the model (trainableOnly = false).',
  });
  await session.loadParametersBuffer(new Uint8Array(all.data.buffer), false);
  session.setLearningRate(expected.lr);
  const out = await session.runTrainStep(rows(0, expected.half));
  assertClose([Number(out[session.trainingOutputNames[0]].data[0])], [expected.losses[0]], 'first loss');
  await session.release();
});

test('int64 checkpoint properties are read exactly, as BigInts', { skip: SKIP }, async () => {
  const { properties } = readCheckpoint(await readFile(join(ROOT, 'properties', 'checkpoint')));
  assert.deepEqual(properties, { big: 2n ** 60n + 1n, low: -(2n ** 63n), epoch: 3n, rate: 0.5, note: 'text' });
});

test('wrong files and feeds are clear errors', { skip: SKIP }, async () => {
  const { session, rows } = await setup();
  const noEval = await TrainingSession.create(files({ evalModel: null }));
  await assert.rejects(noEval.runEvalStep(rows(0, 4)), {
    message: 'runEvalStep needs the eval model: pass evalModel (eval_model.onnx) to TrainingSession.create',
  });
  await noEval.release();
  const dir = join(ROOT, 'artifacts');
  await assert.rejects(TrainingSession.create(files({ trainModel: join(dir, 'eval_model.onnx') })), {
    message:
      'trainModel must be the training model (training_model.onnx), but the file given is the eval model (eval_model.onnx): pass it as evalModel',
  });
  await assert.rejects(TrainingSession.create(files({ optimizerModel: join(dir, 'training_model.onnx') })), {
    message:
      'optimizerModel must be the optimizer model (optimizer_model.onnx), but the file given is the training model (training_model.onnx): pass it as trainModel',
  });
  const { input, labels } = rows(0, 4);
  await assert.rejects(session.runTrainStep({ input: input.data, labels }), {
    message: 'input input must be an ort.Tensor, got Float32Array: wrap it, new ort.Tensor(type, data, dims)',
  });
  await assert.rejects(session.runTrainStep({ input, labels: rows(0, 3).labels }), {
    message: 'batch input labels has shape [3], the model expects [batch] with batch = 4 as in input (dimension 0 is 3)',
  });
  await assert.rejects(session.runEvalStep({ input: new ort.Tensor('float64', new Float64Array(16), [4, 4]), labels }), {
    message: 'batch input input has dtype float64, the model expects float32',
  });
  for (const lr of [-1, NaN, Infinity]) {
    assert.throws(() => session.setLearningRate(lr), {
      message: `lr must be >= 0, got ${lr}: a finite number (a negative rate climbs the loss, an infinite or NaN one makes every parameter NaN)`,
    });
  }
  await session.release();
});

test('calls started together run in call order, as awaited one by one', { skip: SKIP }, async () => {
  const { expected, rows } = await setup();
  const run = async (together) => {
    const { session } = await setup();
    session.setLearningRate(expected.lr);
    const calls = [];
    for (let k = 0; k < 3; k++) {
      const feeds = rows(k * expected.half, expected.half);
      if (together) calls.push(session.runTrainStep(feeds), session.runOptimizerStep(), session.lazyResetGrad());
      else calls.push(await session.runTrainStep(feeds), await session.runOptimizerStep(), await session.lazyResetGrad());
    }
    const losses = (await Promise.all(calls)).filter(Boolean).map((o) => Number(o[session.trainingOutputNames[0]].data[0]));
    return { losses, params: Array.from((await session.getContiguousParameters(false)).data) };
  };
  const oneByOne = await run(false);
  const together = await run(true);
  assert.deepEqual(together.losses, oneByOne.losses);
  assert.deepEqual(together.params, oneByOne.params);
});

test('class labels outside the classes are refused before a run (onnxruntime read -1 as class C - 1)', { skip: SKIP }, async () => {
  const { session, rows } = await setup();
  const { input, labels } = rows(0, 4);
  for (const bad of [-1n, 3n, -100n]) {
    const data = labels.data.slice();
    data[2] = bad;
    const feeds = { input, labels: new ort.Tensor('int64', data, labels.dims) };
    const message = `batch input labels holds class ${bad} at row 2: class labels must lie in [0, 3) (1 such label(s))`;
    await assert.rejects(session.runTrainStep(feeds), { message });
    await assert.rejects(session.runEvalStep(feeds), { message });
  }
  await session.release();
});

test('a truncated checkpoint is a damaged checkpoint file, in Python\'s words', { skip: SKIP }, async () => {
  const bytes = await readFile(join(ROOT, 'artifacts', 'checkpoint'));
  for (const n of [8, 100, 300, 5000].filter((k) => k < bytes.length)) {
    assert.throws(() => readCheckpoint(bytes.subarray(0, n)), /^Error: the checkpoint file is damaged: RangeError: /);
  }
});

test('feeds the model does not take are refused, as the artifacts API refuses them', { skip: SKIP }, async () => {
  const { session, rows } = await setup();
  const feeds = { ...rows(0, 4), lables: rows(0, 4).labels };
  await assert.rejects(session.runTrainStep(feeds), { message: 'unknown input(s) lables; the model takes input, labels' });
  await assert.rejects(session.runEvalStep(feeds), { message: 'unknown input(s) lables; the model takes input, labels' });
  await session.release();
});

test('optimizerModel may be left out, as onnxruntime-web 1.19 allowed', { skip: SKIP }, async () => {
  const { rows } = await setup();
  const session = await TrainingSession.create(files({ optimizerModel: null }));
  const out = await session.runTrainStep(rows(0, 4));
  assert.ok(Number.isFinite(Number(out[session.trainingOutputNames[0]].data[0])));
  await assert.rejects(session.runOptimizerStep(), {
    message: 'runOptimizerStep needs the optimizer model: pass optimizerModel (optimizer_model.onnx) to TrainingSession.create',
  });
  await session.release();
  await assert.rejects(TrainingSession.create(files({ trainModel: null })), { message: 'TrainingSession.create needs trainModel' });
});

// The migrated MNIST-style example of docs/migrate_ort_training.md, on onnxruntime-web's former
// TrainingSession names: the folder the Python example writes (data/), trained step by step as
// the Python API trains it in make_ort_training_fixture.py. Runs in the browser (ort_training.js)
// and in Node (test-web.mjs), `ort` and the file loader injected.
import { readSafetensors } from '../../js/src/safetensors.js';
import { trainingSessionOf } from '../../js/src/ort_training.js';

/** Train `expected.steps` steps; resolves to {losses, evalLoss, size, restoredLoss, nominal}. `load(path)`: the
 * bytes of a file of the fixture folder; `onStep(k, loss)` is called after each update. */
export async function trainMigratedExample(ort, load, onStep = async () => {}) {
  const expected = JSON.parse(new TextDecoder().decode(await load('expected.json')));
  const { tensors } = readSafetensors(await load('digits.safetensors'));
  const TrainingSession = trainingSessionOf(ort, load);
  const folder = (checkpointState) => ({
    checkpointState,
    trainModel: 'data/training_model.onnx',
    evalModel: 'data/eval_model.onnx',
    optimizerModel: 'data/optimizer_model.onnx',
  });
  const session = await TrainingSession.create(folder('data/checkpoint'));
  const [inputName, labelName] = session.trainingInputNames;
  const width = tensors.x.dims[1];
  const batch = (x, y, start, n) => ({
    [inputName]: new ort.Tensor('float32', x.data.slice(start * width, (start + n) * width), [n, width]),
    [labelName]: new ort.Tensor('int64', y.data.slice(start, start + n), [n]),
  });
  session.setLearningRate(expected.lr);
  const size = await session.getParametersSize(true);
  const initial = await session.getContiguousParameters(true);
  const initialAll = await session.getContiguousParameters(false);
  const losses = [];
  for (let k = 0; k < expected.steps; k++) {
    const out = await session.runTrainStep(batch(tensors.x, tensors.y, k * expected.batch, expected.batch));
    losses.push(Number(out[session.trainingOutputNames[0]].data[0]));
    await session.runOptimizerStep();
    await session.lazyResetGrad();
    await onStep(k, losses.at(-1));
  }
  const rows = tensors.y_test.dims[0];
  const evalOut = await session.runEvalStep(batch(tensors.x_test, tensors.y_test, 0, rows));
  const evalLoss = Number(evalOut[session.evalOutputNames[0]].data[0]);
  // loadParametersBuffer: the untrained parameters back, the first loss again
  const trained = await session.getContiguousParameters(true);
  await session.loadParametersBuffer(new Uint8Array(initial.data.buffer), true);
  const again = await session.runEvalStep(batch(tensors.x, tensors.y, 0, expected.batch));
  await session.loadParametersBuffer(new Uint8Array(trained.data.buffer), true);
  await session.release();
  // a nominal checkpoint (names and shapes, no values: make_ort_training_fixture.py) refuses to train
  // and to take the trainable parameters alone; with every parameter loaded it gives the first loss
  const nominal = await TrainingSession.create(folder('nominal_checkpoint'));
  const refused = [];
  await nominal.runTrainStep(batch(tensors.x, tensors.y, 0, expected.batch)).catch((e) => refused.push(e.message));
  await nominal.loadParametersBuffer(new Uint8Array(initial.data.buffer), true).catch((e) => refused.push(e.message));
  await nominal.loadParametersBuffer(new Uint8Array(initialAll.data.buffer), false);
  nominal.setLearningRate(expected.lr);
  const first = await nominal.runTrainStep(batch(tensors.x, tensors.y, 0, expected.batch));
  await nominal.release();
  return {
    expected,
    losses,
    evalLoss,
    size,
    restoredLoss: Number(again[session.evalOutputNames[0]].data[0]),
    nominal: { refused, loss: Number(first[session.trainingOutputNames[0]].data[0]) },
  };
}

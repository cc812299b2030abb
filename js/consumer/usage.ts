// Type-checked with `tsc --noEmit` (tsconfig.json: node16 resolution, tsconfig.bundler.json: a
// bundler's) in a fresh project that installed the packed onnxgrad-artifacts and onnxruntime-node:
// the declarations resolve through package.json `exports` and type what the package returns.
// Each @ts-expect-error fails the compilation if the line it marks stops being a type error.
import { type Batch, type Manifest, TrainingSession, writeSafetensors } from 'onnxgrad-artifacts';
import { loadTrainingFolder, ort, readSafetensors } from 'onnxgrad-artifacts/node';

export async function usage(dir: string, pixels: Float32Array, target: BigInt64Array): Promise<number> {
  const session = await loadTrainingFolder(dir, { lr: (step: number) => 0.01 / (1 + step), sessionOptions: { intraOpNumThreads: 1 } });
  const loss: number = await session.step({ pixels, target });
  const batch: Batch<ort.Tensor> = { pixels: new ort.Tensor('float32', pixels, [pixels.length / 64, 64]), target: [1, 2, 3] };
  const { loss: evalLoss, outputs } = await session.evaluate(batch);
  const logits: ort.Tensor = outputs.logits;
  const dims: readonly number[] = logits.dims;
  const predicted: ort.Tensor = (await session.predict({ pixels })).logits;
  const manifest: Manifest = session.manifest;
  const first: string = manifest.parameters[0].name;
  const weights: Uint8Array = session.exportParameters();
  const read = readSafetensors(weights).tensors[first];
  const again: Uint8Array = writeSafetensors({ [first]: read, w: session.parameters[first] }, { step: session.iterations });
  const resumed = await loadTrainingFolder(dir, { state: session.exportState() });

  // the runtime-free entry infers the tensor type from the ort module it is given
  const generic = await TrainingSession.create(ort, async (name: string) => new Uint8Array(name.length));
  const tensor: ort.Tensor = generic.parameters[first];

  // @ts-expect-error: a batch is an object {input name: values}
  await session.step(42);
  // @ts-expect-error: strings are not batch values
  await session.step({ pixels: ['a'] });
  // @ts-expect-error: lr is a number or a schedule
  await loadTrainingFolder(dir, { lr: 'fast' });
  // @ts-expect-error: the loss is a number
  const wrong: string = await session.step({ pixels, target });
  // @ts-expect-error: the module must have Tensor and InferenceSession
  await TrainingSession.create({}, async () => new Uint8Array(0));

  await Promise.all([session.release(), resumed.release(), generic.release()]);
  return loss + evalLoss + dims.length + predicted.size + again.length + tensor.size + wrong.length;
}

// onnxruntime-web's former training names (onnxgrad.compat.training folders)
import { TrainingSession as OrtTrainingSession } from 'onnxgrad-artifacts/ort-training';
import { createTrainingSession } from 'onnxgrad-artifacts/ort-training/core';

export async function ortTraining(dir: string, x: ort.Tensor, y: ort.Tensor): Promise<number> {
  const session = await OrtTrainingSession.create({
    checkpointState: `${dir}/checkpoint`, trainModel: `${dir}/training_model.onnx`,
    evalModel: `${dir}/eval_model.onnx`, optimizerModel: `${dir}/optimizer_model.onnx`,
  });
  const out = await session.runTrainStep({ input: x, labels: y });
  const loss: ort.Tensor = out[session.trainingOutputNames[0]];
  await session.runOptimizerStep();
  await session.lazyResetGrad();
  const size: number = await session.getParametersSize(true);
  const flat: ort.Tensor = await session.getContiguousParameters(true);
  const bytes = new Uint8Array(0);
  const web = await createTrainingSession(ort, { checkpointState: bytes, trainModel: bytes, optimizerModel: bytes });
  const lr: number = web.getLearningRate();
  // @ts-expect-error: create needs the checkpoint, the training and the optimizer models
  await OrtTrainingSession.create({ trainModel: 'a' });
  await Promise.all([session.release(), web.release()]);
  return loss.size + size + flat.size + lr;
}

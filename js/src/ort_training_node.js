// Node entry point of onnxruntime-web's former training API on onnxruntime-node:
//
//   import { TrainingSession } from 'onnxgrad-artifacts/ort-training';
//   const session = await TrainingSession.create({
//     checkpointState: 'out/checkpoint', trainModel: 'out/training_model.onnx',
//     evalModel: 'out/eval_model.onnx', optimizerModel: 'out/optimizer_model.onnx',
//   });
import { readFile } from 'node:fs/promises';
import * as ort from 'onnxruntime-node';
import { trainingSessionOf } from './ort_training.js';

export {
  OrtTrainingSession,
  createTrainingSession,
  fetchBytes,
  onnxMetadata,
  readCheckpoint,
  trainingSessionOf,
} from './ort_training.js';
export { ort };

/** `TrainingSession.create(options, sessionOptions)`: files as paths, Uint8Arrays or ArrayBuffers. */
export const TrainingSession = trainingSessionOf(ort, readFile);

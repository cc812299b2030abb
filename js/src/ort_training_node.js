// Node entry point of onnxruntime-web's former training API on onnxruntime-node:
//
//   import { TrainingSession } from 'onnxgrad-artifacts/ort-training';
//   const session = await TrainingSession.create({
//     checkpointState: 'out/checkpoint', trainModel: 'out/training_model.onnx',
//     evalModel: 'out/eval_model.onnx', optimizerModel: 'out/optimizer_model.onnx',
//   });
import { readFile } from 'node:fs/promises';
import * as ort from 'onnxruntime-node';
import { createTrainingSession } from './ort_training.js';

export { OrtTrainingSession, createTrainingSession, onnxMetadata, readCheckpoint } from './ort_training.js';
export { ort };

export const TrainingSession = {
  /** Files as paths, Uint8Arrays or ArrayBuffers. */
  async create(options, sessionOptions = {}) {
    const files = {};
    for (const [key, value] of Object.entries(options)) files[key] = typeof value === 'string' ? await readFile(value) : value;
    return createTrainingSession(ort, files, sessionOptions);
  },
};

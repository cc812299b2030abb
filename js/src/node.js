// Node entry point: TrainingSession on onnxruntime-node, files read from a folder.
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import * as ort from 'onnxruntime-node';
import { TrainingSession } from './index.js';

export * from './index.js';
export { ort };

/** A TrainingSession on the artifacts folder `dir` (written by `onnxgrad artifacts`). */
export async function loadTrainingFolder(dir, options = {}) {
  return TrainingSession.create(ort, (name) => readFile(join(dir, name)), options);
}

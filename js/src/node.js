// Node entry point: TrainingSession on onnxruntime-node, files read from a folder.
// onnxruntime-node is a peer dependency: the project that uses this entry installs it (see README).
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { TrainingSession } from './index.js';

const ort = await import('onnxruntime-node').catch((error) => {
  if (error?.code === 'ERR_MODULE_NOT_FOUND' && String(error.message).includes("'onnxruntime-node'")) {
    throw new Error(
      "onnxgrad-artifacts/node needs onnxruntime-node, a peer dependency: install it next to onnxgrad-artifacts " +
        '(ONNXRUNTIME_NODE_INSTALL=skip npm install onnxruntime-node); in the browser, import onnxgrad-artifacts ' +
        'with onnxruntime-web instead',
      { cause: error },
    );
  }
  throw error;
});

export * from './index.js';
export { ort };

/** A TrainingSession on the artifacts folder `dir` (written by `onnxgrad artifacts`). */
export async function loadTrainingFolder(dir, options = {}) {
  return TrainingSession.create(ort, (name) => readFile(join(dir, name)), options);
}

// Types of ort_training_node.js: onnxruntime-web's former TrainingSession names on onnxruntime-node.
import * as ort from 'onnxruntime-node';
import type { FileBytes, OrtTrainingSession, TrainingFiles } from './ort_training.js';

export * from './ort_training.js';
export { ort };

/** `TrainingSession.create` of onnxruntime's former training API: files as paths or bytes. */
export const TrainingSession: {
  create(
    options: TrainingFiles<string | FileBytes>,
    sessionOptions?: ort.InferenceSession.SessionOptions,
  ): Promise<OrtTrainingSession<ort.Tensor>>;
};

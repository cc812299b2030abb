// Types of node.js: TrainingSession on onnxruntime-node (a peer dependency), files read from a folder.
import * as ort from 'onnxruntime-node';
import type { TrainingOptions, TrainingSession } from './index.js';

export * from './index.js';
export { ort };

/** A TrainingSession on the artifacts folder `dir` (written by `onnxgrad artifacts`). */
export function loadTrainingFolder(dir: string, options?: TrainingOptions): Promise<TrainingSession<ort.Tensor>>;

// Types of ort_training.js: onnxruntime-web's former training API over an onnxgrad.compat.training
// folder, on any onnxruntime module passed in (onnxruntime-web in the browser).

/** A model file or checkpoint as bytes. */
export type FileBytes = Uint8Array | ArrayBuffer;

/** The four files of a folder written by `onnxgrad.compat.training.artifacts.generate_artifacts`. */
export interface TrainingFiles<F = FileBytes> {
  checkpointState: F;
  trainModel: F;
  evalModel?: F;
  /** optional, as in onnxruntime-web 1.19: without it runOptimizerStep rejects */
  optimizerModel?: F;
}

/** A checkpoint read from onnxruntime-training's FlatBuffer format. */
export interface Checkpoint {
  trainable: Record<string, { dims: number[]; data: ArrayLike<number> }>;
  frozen: Record<string, { dims: number[]; data: ArrayLike<number> }>;
  /** Names and shapes only, no values (zeros here): train after `loadParametersBuffer(buffer, false)`. */
  nominal: boolean;
  /** int properties as BigInts (int64 in the file), float ones as numbers, str ones as strings. */
  properties: Record<string, bigint | number | string>;
  group?: { step: number; initialLr: number; states: Record<string, unknown> };
}

/** onnxruntime-web 1.19's TrainingSession, on stock onnxruntime. */
export class OrtTrainingSession<T = unknown> {
  readonly properties: Record<string, bigint | number | string>;
  get trainingInputNames(): string[];
  get trainingOutputNames(): string[];
  get evalInputNames(): string[];
  get evalOutputNames(): string[];
  runTrainStep(feeds: Record<string, T>): Promise<Record<string, T>>;
  runEvalStep(feeds: Record<string, T>): Promise<Record<string, T>>;
  runOptimizerStep(): Promise<void>;
  lazyResetGrad(): Promise<void>;
  setLearningRate(lr: number): void;
  getLearningRate(): number;
  getParametersSize(trainableOnly?: boolean): Promise<number>;
  getContiguousParameters(trainableOnly?: boolean): Promise<T>;
  loadParametersBuffer(buffer: Float32Array, trainableOnly?: boolean): Promise<void>;
  release(): Promise<void>;
}

/** The metadata_props of an ONNX model, read from its bytes. */
export function onnxMetadata(bytes: FileBytes): Record<string, string>;

/** Reads an onnxruntime-training checkpoint (FlatBuffer, identifier ODTC). */
export function readCheckpoint(bytes: FileBytes): Checkpoint;

/** `TrainingSession.create({checkpointState, trainModel, evalModel, optimizerModel}, sessionOptions)` on the `ort` module given. */
export function createTrainingSession<M extends { Tensor: abstract new (...args: never[]) => unknown }>(
  ort: M,
  options: TrainingFiles,
  sessionOptions?: object,
): Promise<OrtTrainingSession<InstanceType<M['Tensor']>>>;

/** The bytes at `url`, fetched (the browser, or Node >= 18). */
export function fetchBytes(url: string): Promise<Uint8Array>;

/**
 * onnxruntime-web's `TrainingSession` over the `ort` module given: `create` takes each file as
 * bytes or as a string that `load` reads (default: `fetchBytes`, URLs in the browser).
 */
export function trainingSessionOf<M extends { Tensor: abstract new (...args: never[]) => unknown }>(
  ort: M,
  load?: (path: string) => Promise<FileBytes>,
): {
  create(
    options: TrainingFiles<string | FileBytes>,
    sessionOptions?: object,
  ): Promise<OrtTrainingSession<InstanceType<M['Tensor']>>>;
};

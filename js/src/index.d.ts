// Types of index.js: TrainingSession on an injected onnxruntime module (onnxruntime-node,
// onnxruntime-web or onnxruntime-common), so that no runtime is imported here.
import type { TensorLike } from './safetensors.js';

export { readSafetensors, writeSafetensors } from './safetensors.js';
export type { SafetensorsTensor, TensorData, TensorLike, TensorType } from './safetensors.js';

/** The `format` of an onnxgrad artifacts manifest. */
export const FORMAT: 'onnxgrad.artifacts';

/** An input or output of the manifest: a dimension is a size, a name shared across inputs (`N`) or null. */
export interface ValueSpec {
  name: string;
  dtype: string;
  shape: (number | string | null)[] | null;
}

/** `manifest.json` of an artifacts folder (docs/on_device.md); only the fields read here are typed. */
export interface Manifest {
  format: 'onnxgrad.artifacts';
  version: number;
  files: { train_step: string; eval_step: string; inference: string; state: string; [file: string]: string };
  batch: ValueSpec[];
  lr: { name: string; dtype: string; default: number };
  step: { name: string; dtype: string };
  loss: { name: string; kind: string; options: Record<string, unknown> };
  optimizer: { name: string; [hyperparameter: string]: unknown };
  parameters: ValueSpec[];
  model_outputs: string[];
  train_step: { inputs: ValueSpec[]; outputs: ValueSpec[]; feedback: Record<string, string> };
  eval_step: { inputs: ValueSpec[]; outputs: ValueSpec[] };
  inference: { inputs: ValueSpec[]; outputs: ValueSpec[]; parameters: string[] };
  [field: string]: unknown;
}

/** What a TrainingSession uses of an inference session of the runtime. */
export interface OrtSessionLike<T extends TensorLike = TensorLike> {
  run(feeds: Record<string, T>): Promise<Record<string, T>>;
  release(): Promise<void>;
}

/** What a TrainingSession uses of the onnxruntime module: `import * as ort from 'onnxruntime-web'` fits. */
export interface OrtModule<T extends TensorLike = TensorLike> {
  Tensor: new (type: any, data: any, dims?: readonly number[]) => T;
  InferenceSession: {
    create(model: Uint8Array, options?: any): Promise<OrtSessionLike<T>>;
  };
}

/** Reads one file of the artifacts folder by name (`manifest.json`, `train_step.onnx`...). */
export type FileLoader = (name: string) => Promise<Uint8Array | ArrayBuffer> | Uint8Array | ArrayBuffer;

/** Values of one batch input: a tensor, or flat values whose batch dimension is inferred from the manifest. */
export type BatchValue<T extends TensorLike = TensorLike> =
  | T
  | TensorLike
  | Float32Array
  | Float64Array
  | Int8Array
  | Uint8Array
  | Int16Array
  | Uint16Array
  | Int32Array
  | Uint32Array
  | BigInt64Array
  | BigUint64Array
  | readonly (number | bigint | boolean)[];

/** A batch: {input name: values}, the target included for step() and evaluate(). */
export type Batch<T extends TensorLike = TensorLike> = Record<string, BatchValue<T>>;

export interface TrainingOptions {
  /** The learning rate, or a schedule `step -> lr` (step: updates already made); the manifest's default otherwise. */
  lr?: number | ((step: number) => number);
  /** Passed to `ort.InferenceSession.create` (execution providers, threads...). */
  sessionOptions?: any;
  /** A state to resume from: the bytes of `exportState()` (safetensors). */
  state?: Uint8Array | ArrayBuffer;
  /** Steps in a row with a non-finite loss (their updates skipped) after which `step()` throws; default 5. */
  maxConsecutiveSkips?: number;
}

/** The default of `maxConsecutiveSkips`. */
export const MAX_CONSECUTIVE_SKIPS: number;

/**
 * Training from an artifacts folder: one run of train_step.onnx per step, parameters kept as tensors.
 * Calls run one at a time in call order: concurrent `step()`s equal the same steps awaited one by one.
 */
export class TrainingSession<T extends TensorLike = TensorLike> {
  /** A session on the folder that `load` reads, with `ort` the runtime module. */
  static create<T extends TensorLike>(ort: OrtModule<T>, load: FileLoader, options?: TrainingOptions): Promise<TrainingSession<T>>;

  /** Use `TrainingSession.create`. */
  protected constructor(
    ort: OrtModule<T>,
    load: FileLoader,
    manifest: Manifest,
    train: OrtSessionLike<T>,
    state: { tensors: Record<string, TensorLike>; step?: number; metadata?: Record<string, string> },
    options: TrainingOptions,
  );

  readonly ort: OrtModule<T>;
  readonly manifest: Manifest;
  /** Updates made so far. */
  iterations: number;
  /** The learning rate of the last (or, before any, the first) step. */
  lr: number;
  schedule: (step: number) => number;
  /** Output name -> the input it feeds at the next step. */
  feedback: Record<string, string>;
  lossName: string;
  batchSpecs: Record<string, ValueSpec>;
  /** Parameters, optimizer state and buffers carried between steps. */
  carried: Record<string, T>;
  /** Steps in a row with a non-finite loss after which `step()` throws. */
  maxConsecutiveSkips: number;
  /** Steps whose loss was not finite: their updates were skipped (`iterations` unchanged). */
  skippedSteps: number;
  /** The current run of steps with a non-finite loss (0 after a finite one). */
  consecutiveSkips: number;

  /**
   * One update on `batch`; resolves to the loss. Errors name the input when a value does not fit the
   * manifest. A non-finite loss skips the update (counted in `skippedSteps`).
   */
  step(batch: Batch<T>): Promise<number>;
  /** The loss and the model's outputs on `batch`, without updating. */
  evaluate(batch: Batch<T>): Promise<{ loss: number; outputs: Record<string, T> }>;
  /** The model's outputs on `inputs` with the trained parameters (inference.onnx). */
  predict(inputs: Batch<T>): Promise<Record<string, T>>;
  /** The trainable parameters, {name: tensor}. */
  get parameters(): Record<string, T>;
  /** The trained parameters (and running statistics) as safetensors bytes: what inference.onnx takes. */
  exportParameters(): Uint8Array;
  /** Everything carried between steps, with the step count: safetensors bytes for the `state` option. */
  exportState(): Uint8Array;
  /** Releases the runtime sessions. */
  release(): Promise<void>;
}

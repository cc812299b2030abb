// Types of safetensors.js: the safetensors format in plain JavaScript (Node and browsers).

/** The element types the safetensors reader and writer know (ort tensor type names). */
export type TensorType = 'float64' | 'float32' | 'float16' | 'int64' | 'int32' | 'int8' | 'uint8' | 'bool';

/** The TypedArray holding a tensor's values (`BigInt64Array` for int64, `Uint16Array` for float16 bits). */
export type TensorData =
  | Float64Array
  | Float32Array
  | Uint16Array
  | BigInt64Array
  | Int32Array
  | Int8Array
  | Uint8Array;

/** A tensor as plain data; an `ort.Tensor` has these fields too. */
export interface TensorLike {
  readonly type: string;
  readonly dims: readonly number[];
  readonly data: unknown;
}

/** A tensor read from a safetensors file. */
export interface SafetensorsTensor {
  type: TensorType;
  dims: number[];
  data: TensorData;
}

/** The ort tensor type ('float32'...) of a safetensors dtype code ('F32'...). */
export function typeOfCode(code: string): TensorType;

/** The TypedArray class holding values of an ort tensor type. */
export function arrayClassOf(type: TensorType | string): { new (length: number): TensorData; from(values: ArrayLike<unknown>): TensorData };

/** Parse safetensors bytes: the tensors (copies) and the metadata strings; `source` (a file name) names them in errors. */
export function readSafetensors(bytes: Uint8Array | ArrayBuffer, source?: string): {
  tensors: Record<string, SafetensorsTensor>;
  metadata: Record<string, string>;
};

/** Safetensors bytes of `tensors` (ort.Tensors work), with `metadata` values written as strings. */
export function writeSafetensors(
  tensors: Record<string, TensorLike>,
  metadata?: Record<string, string | number | boolean>,
): Uint8Array;

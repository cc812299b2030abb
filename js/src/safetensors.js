// The safetensors format, read and written in plain JavaScript (no Node API: browsers too).
// Layout: u64 little-endian header length N, N bytes of JSON, then the raw little-endian buffers.
// JSON: {name: {dtype: "F32", shape: [...], data_offsets: [begin, end]}, "__metadata__": {...}}.

const CODES = {
  F64: ['float64', Float64Array],
  F32: ['float32', Float32Array],
  F16: ['float16', Uint16Array],
  I64: ['int64', BigInt64Array],
  I32: ['int32', Int32Array],
  I8: ['int8', Int8Array],
  U8: ['uint8', Uint8Array],
  BOOL: ['bool', Uint8Array],
};
const BY_TYPE = Object.fromEntries(Object.entries(CODES).map(([code, [type]]) => [type, code]));

/** The ort tensor type ('float32'...) of a safetensors dtype code ('F32'...). */
export function typeOfCode(code) {
  const entry = CODES[code];
  if (!entry) throw new Error(`unsupported safetensors dtype ${code}`);
  return entry[0];
}

/** The TypedArray class holding values of an ort tensor type. */
export function arrayClassOf(type) {
  const code = BY_TYPE[type];
  if (!code) throw new Error(`unsupported tensor type ${type}`);
  return CODES[code][1];
}

/**
 * Parse safetensors bytes (Uint8Array or ArrayBuffer).
 * Returns {tensors: {name: {type, dims, data}}, metadata}; `data` is a TypedArray copy.
 */
export function readSafetensors(bytes) {
  // a plain Uint8Array view: Node's Buffer.slice would not copy
  const u8 = ArrayBuffer.isView(bytes) ? new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength) : new Uint8Array(bytes);
  if (u8.byteLength < 8) throw new Error('not a safetensors file: shorter than 8 bytes');
  const view = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  const n = Number(view.getBigUint64(0, true));
  if (8 + n > u8.byteLength) throw new Error('not a safetensors file: the header runs past the end');
  const header = JSON.parse(new TextDecoder().decode(u8.subarray(8, 8 + n)));
  const metadata = header.__metadata__ ?? {};
  delete header.__metadata__;
  const base = 8 + n;
  const tensors = {};
  for (const [name, spec] of Object.entries(header)) {
    const type = typeOfCode(spec.dtype);
    const Cls = arrayClassOf(type);
    const [begin, end] = spec.data_offsets;
    // a copy: the offsets need not be aligned to the element size
    const buffer = u8.slice(base + begin, base + end).buffer;
    tensors[name] = { type, dims: spec.shape.slice(), data: new Cls(buffer) };
  }
  return { tensors, metadata };
}

/**
 * Safetensors bytes (Uint8Array) of `tensors`: {name: {type, dims, data}} (ort.Tensor works).
 * `metadata`: an object of strings.
 */
export function writeSafetensors(tensors, metadata = undefined) {
  const header = {};
  if (metadata) header.__metadata__ = Object.fromEntries(Object.entries(metadata).map(([k, v]) => [k, String(v)]));
  const chunks = [];
  let offset = 0;
  for (const [name, t] of Object.entries(tensors)) {
    const code = BY_TYPE[t.type];
    if (!code) throw new Error(`tensor ${name}: unsupported type ${t.type}`);
    const bytes = new Uint8Array(t.data.buffer, t.data.byteOffset, t.data.byteLength);
    header[name] = { dtype: code, shape: Array.from(t.dims), data_offsets: [offset, offset + bytes.byteLength] };
    chunks.push(bytes);
    offset += bytes.byteLength;
  }
  let json = JSON.stringify(header);
  json += ' '.repeat((8 - (new TextEncoder().encode(json).byteLength % 8)) % 8);
  const head = new TextEncoder().encode(json);
  const out = new Uint8Array(8 + head.byteLength + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(head.byteLength), true);
  out.set(head, 8);
  let at = 8 + head.byteLength;
  for (const c of chunks) {
    out.set(c, at);
    at += c.byteLength;
  }
  return out;
}

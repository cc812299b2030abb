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
 * Parse safetensors bytes (Uint8Array or ArrayBuffer). `source` names the bytes (a file name) in
 * the Error a malformed file gets, e.g. `state.safetensors: tensor 'fc1.bias' lies outside the file`.
 * Returns {tensors: {name: {type, dims, data}}, metadata}; `data` is a TypedArray copy.
 */
export function readSafetensors(bytes, source = 'the data') {
  // a plain Uint8Array view: Node's Buffer.slice would not copy
  const u8 = ArrayBuffer.isView(bytes) ? new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength) : new Uint8Array(bytes);
  const notSafetensors = (why) => new Error(`${source} is not a safetensors file: ${why}`);
  if (u8.byteLength < 8) throw notSafetensors("shorter than its 8-byte header length");
  const view = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  const n = view.getBigUint64(0, true);
  if (n > BigInt(u8.byteLength - 8)) throw notSafetensors('the header runs past the end');
  const base = 8 + Number(n);
  let header;
  try {
    header = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(u8.subarray(8, base)));
  } catch (error) {
    throw notSafetensors(error.message);
  }
  if (header === null || typeof header !== 'object' || Array.isArray(header)) throw notSafetensors('the header is not a JSON object');
  const metadata = header.__metadata__ ?? {};
  delete header.__metadata__;
  if (typeof metadata !== 'object' || Array.isArray(metadata) || Object.values(metadata).some((v) => typeof v !== 'string')) {
    throw notSafetensors('__metadata__ is not a mapping of strings');
  }
  const body = u8.byteLength - base;
  const tensors = {};
  const spans = []; // [begin, end, name]: they must tile the data part, as safetensors writes it
  for (const [name, spec] of Object.entries(header)) {
    const where = `${source}: tensor '${name}'`;
    const offsets = spec?.data_offsets;
    const shape = spec?.shape;
    const whole = (v) => Number.isSafeInteger(v) && v >= 0;
    if (!Array.isArray(offsets) || offsets.length !== 2 || !Array.isArray(shape) || !offsets.every(whole) || !shape.every(whole)) {
      throw new Error(`${where} has a corrupt header entry`);
    }
    if (!CODES[spec.dtype]) throw new Error(`${where} has an unsupported safetensors dtype ${JSON.stringify(spec.dtype)}`);
    const type = typeOfCode(spec.dtype);
    const Cls = arrayClassOf(type);
    const [begin, end] = offsets;
    if (!(begin <= end && end <= body)) {
      throw new Error(`${where} lies outside the file (bytes ${begin} to ${end} of ${body} after the header: truncated?)`);
    }
    const size = shape.reduce((a, b) => a * b, 1);
    if (size * Cls.BYTES_PER_ELEMENT !== end - begin) {
      throw new Error(`${where} has ${end - begin} bytes for shape [${shape.join(', ')}] (${type}: ${size * Cls.BYTES_PER_ELEMENT})`);
    }
    // a copy: the offsets need not be aligned to the element size
    const buffer = u8.slice(base + begin, base + end).buffer;
    tensors[name] = { type, dims: shape.slice(), data: new Cls(buffer) };
    spans.push([begin, end, name]);
  }
  // Python's rule (onnxgrad.model.safetensors.loads): no overlap, no hole, nothing after the last tensor
  spans.sort((a, b) => a[0] - b[0] || a[1] - b[1] || (a[2] < b[2] ? -1 : 1));
  let at = 0;
  for (const [begin, end, name] of spans) {
    if (begin !== at) {
      const what = begin < at ? 'overlaps the tensor before it' : `leaves bytes ${at} to ${begin} to no tensor`;
      throw new Error(`${source}: tensor '${name}' (bytes ${begin} to ${end}) ${what}: the tensors of a safetensors file fill its data end to end`);
    }
    at = end;
  }
  if (at !== body) throw new Error(`${source} has ${body - at} bytes after its last tensor: not a safetensors file`);
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

// Training with onnxgrad's artifacts folders (onnxgrad.artifacts.generate) on onnxruntime-node or
// onnxruntime-web. The `ort` module is injected, so the same code runs on both:
//
//   import * as ort from 'onnxruntime-web';           // or 'onnxruntime-node'
//   const load = (name) => fetch(`artifacts/${name}`).then((r) => r.arrayBuffer()).then((b) => new Uint8Array(b));
//   const trainer = await TrainingSession.create(ort, load, { lr: 0.01 });
//   const loss = await trainer.step({ pixels: x, target: y });   // ort.Tensor or TypedArray values
//   const weights = trainer.exportParameters();                  // safetensors bytes
import { arrayClassOf, readSafetensors, writeSafetensors } from './safetensors.js';

export { readSafetensors, writeSafetensors } from './safetensors.js';
export const FORMAT = 'onnxgrad.artifacts';

function product(dims) {
  return dims.reduce((a, b) => a * b, 1);
}

/** A TypedArray of `type` holding `values` (converting numbers to BigInt for int64). */
function asTypedArray(values, type) {
  const Cls = arrayClassOf(type);
  if (values instanceof Cls) return values;
  if (type === 'int64') return BigInt64Array.from(values, (v) => BigInt(v));
  return Cls.from(values, (v) => Number(v));
}

/** A shape as text, `[N, 64]`; `?` for a dimension without a size or a name. */
function shapeText(dims) {
  return `[${dims.map((d) => (d === null || d === undefined ? '?' : String(d))).join(', ')}]`;
}

/** A fixed size in a manifest shape (a named or unknown dimension is not). */
function isFixed(d) {
  return Number.isInteger(d) && d >= 0;
}

/**
 * `value` (an ort.Tensor, a tensor-like {type, data, dims}, a TypedArray or an array) as an
 * ort.Tensor of the manifest entry `spec` ({name, dtype, shape}), or an Error naming the input
 * with the expected and the given dtype or shape. `sizes` (named dimension -> {size, from}) makes
 * a named dimension (the batch `N`) take one size across the inputs of a run.
 */
function checkedTensor(ort, spec, value, sizes) {
  const { name, dtype } = spec;
  const expected = spec.shape ?? null;
  const wanted = expected ? shapeText(expected) : 'any shape';
  let tensor;
  if (value instanceof ort.Tensor || (value.dims && value.type)) {
    if (dtype && value.type !== dtype) {
      throw new Error(`batch input ${name} has dtype ${value.type}, the model expects ${dtype} (shape ${wanted})`);
    }
    if (!(value instanceof ort.Tensor) && value.data?.length !== product(value.dims)) {
      const dims = `${shapeText(value.dims)} (${product(value.dims)} values)`;
      throw new Error(`batch input ${name} has dims ${dims} but ${value.data?.length} values`);
    }
    tensor = value instanceof ort.Tensor ? value : new ort.Tensor(value.type, value.data, value.dims);
  } else {
    if (!ArrayBuffer.isView(value) && !Array.isArray(value)) {
      const kind = typeof value === 'object' ? (value.constructor?.name ?? 'object') : typeof value;
      throw new Error(`batch input ${name} must be an ort.Tensor, a typed array or an array, got ${kind}`);
    }
    if (!dtype) throw new Error(`batch input ${name}: the manifest gives no dtype; pass an ort.Tensor`);
    if (Array.isArray(value)) {
      const bad = value.findIndex((v) => typeof v !== 'number' && typeof v !== 'bigint' && typeof v !== 'boolean');
      if (bad >= 0) {
        const what = Array.isArray(value[bad])
          ? 'an array (nested arrays are not read: pass a flat array or an ort.Tensor)'
          : `${typeof value[bad]} ${JSON.stringify(value[bad])}`;
        throw new Error(`batch input ${name}: the value at index ${bad} is ${what}, not a number`);
      }
    }
    if (dtype.startsWith('int') || dtype.startsWith('uint')) {
      const bad = Array.prototype.findIndex.call(value, (v) => typeof v !== 'bigint' && !Number.isInteger(Number(v)));
      if (bad >= 0) {
        throw new Error(`batch input ${name}: value ${value[bad]} at index ${bad} is not an integer (the model expects ${dtype})`);
      }
    }
    const data = asTypedArray(value, dtype);
    const given = `has shape [${data.length}] (a flat array)`;
    if (!expected) {
      tensor = new ort.Tensor(dtype, data, [data.length]);
    } else {
      const free = expected.filter((d) => !isFixed(d));
      if (free.length > 1) {
        throw new Error(`batch input ${name} ${given}, the model expects ${wanted}: pass an ort.Tensor with its dims`);
      }
      const row = product(expected.filter(isFixed)); // the values of one batch row (or of the whole shape)
      if (free.length === 1 ? row === 0 || data.length % row !== 0 : data.length !== row) {
        const why =
          free.length === 1 ? `${data.length} values are not a whole number of ${row}-value rows` : `the shape holds ${row} values`;
        throw new Error(`batch input ${name} ${given}, the model expects ${wanted}: ${why}`);
      }
      tensor = new ort.Tensor(dtype, data, expected.map((d) => (isFixed(d) ? d : data.length / row)));
    }
  }
  checkDims(name, tensor.dims, expected, sizes);
  return tensor;
}

/** An Error unless `dims` (of input `name`) fit the manifest shape `expected` and the named sizes so far. */
function checkDims(name, dims, expected, sizes) {
  if (!expected) return;
  const given = `has shape ${shapeText(dims)}, the model expects ${shapeText(expected)}`;
  if (dims.length !== expected.length) throw new Error(`batch input ${name} ${given} (rank ${expected.length})`);
  expected.forEach((want, i) => {
    if (isFixed(want) && dims[i] !== want) throw new Error(`batch input ${name} ${given} (dimension ${i} must be ${want})`);
  });
  expected.forEach((want, i) => {
    if (typeof want !== 'string' || !want) return;
    const seen = sizes[want];
    if (!seen) sizes[want] = { size: dims[i], from: name };
    else if (seen.size !== dims[i]) {
      const why = `with ${want} = ${seen.size} as in ${seen.from} (dimension ${i} is ${dims[i]})`;
      throw new Error(`batch input ${name} ${given} ${why}`);
    }
  });
}

/** Training from an artifacts folder: one session run per step, parameters kept as tensors. */
export class TrainingSession {
  /**
   * @param ort the onnxruntime module (onnxruntime-node, onnxruntime-web or onnxruntime-common API)
   * @param load async (fileName) => Uint8Array | ArrayBuffer: reads a file of the folder
   * @param options {lr: number | (step) => number, sessionOptions, state: Uint8Array (safetensors)}
   */
  static async create(ort, load, options = {}) {
    const bytes = async (name) => {
      const b = await load(name);
      return b instanceof Uint8Array ? b : new Uint8Array(b);
    };
    const manifest = JSON.parse(new TextDecoder().decode(await bytes('manifest.json')));
    if (manifest.format !== FORMAT) throw new Error(`not an onnxgrad artifacts folder (format ${manifest.format})`);
    const train = await ort.InferenceSession.create(await bytes(manifest.files.train_step), options.sessionOptions ?? {});
    const state = readSafetensors(options.state ?? (await bytes(manifest.files.state)));
    return new TrainingSession(ort, load, manifest, train, state, options);
  }

  constructor(ort, load, manifest, train, state, options) {
    this.ort = ort;
    this.manifest = manifest;
    this._load = load;
    this._train = train;
    this._eval = null;
    this._inference = null;
    this._sessionOptions = options.sessionOptions ?? {};
    const lr = options.lr ?? manifest.lr.default;
    this.schedule = typeof lr === 'function' ? lr : () => lr;
    this.iterations = Number(state.metadata.step ?? 0); // updates made so far
    this.lr = this.schedule(this.iterations);
    this.feedback = manifest.train_step.feedback; // output name -> input name at the next step
    this.lossName = manifest.loss.name;
    this.batchSpecs = Object.fromEntries(manifest.batch.map((s) => [s.name, s]));
    // every input the batch may feed: the train step's, the eval step's and inference.onnx's
    const specs = [...(manifest.inference?.inputs ?? []), ...(manifest.eval_step?.inputs ?? []), ...manifest.batch];
    this._inputSpecs = Object.fromEntries(specs.map((s) => [s.name, s]));
    this.carried = {};
    for (const name of Object.values(this.feedback)) {
      const t = state.tensors[name];
      if (!t) throw new Error(`the state file lacks ${name}`);
      this.carried[name] = new ort.Tensor(t.type, t.data, t.dims);
    }
  }

  /**
   * The batch as ort tensors; values may be ort.Tensor, TypedArray or arrays. Each is checked
   * against the manifest (dtype, rank, fixed dimensions, one size per named dimension such as the
   * batch's `N`): a mismatch is an Error naming the input, the expected and the given shape.
   */
  _batch(batch, names) {
    if (batch === null || typeof batch !== 'object') {
      throw new Error(`the batch must be an object {input name: values} with ${names.join(', ')}, got ${batch}`);
    }
    const feeds = {};
    const sizes = {}; // named dimension -> {size, from: the input that set it}
    for (const name of names) {
      const spec = this._inputSpecs[name] ?? { name, dtype: undefined, shape: null };
      const value = batch[name];
      if (value === undefined || value === null) throw new Error(`missing batch input ${name}; this run takes ${names.join(', ')}`);
      feeds[name] = checkedTensor(this.ort, spec, value, sizes);
    }
    return feeds;
  }

  /** One update on `batch` ({input name: values}, the target included); resolves to the loss. */
  async step(batch) {
    const m = this.manifest;
    const feeds = this._batch(batch, Object.keys(this.batchSpecs));
    this.lr = this.schedule(this.iterations);
    feeds[m.lr.name] = new this.ort.Tensor('float64', Float64Array.of(this.lr), []);
    feeds[m.step.name] = new this.ort.Tensor('int64', BigInt64Array.of(BigInt(this.iterations)), []);
    Object.assign(feeds, this.carried);
    const results = await this._train.run(feeds);
    for (const [out, input] of Object.entries(this.feedback)) this.carried[input] = results[out];
    this.iterations += 1;
    return Number(results[this.lossName].data[0]);
  }

  /** {loss, outputs: {name: ort.Tensor}} on `batch`, without updating. */
  async evaluate(batch) {
    const m = this.manifest;
    if (!this._eval) this._eval = await this._session(m.files.eval_step);
    const inputs = m.eval_step.inputs.map((s) => s.name);
    const feeds = this._batch(batch, inputs.filter((n) => !(n in this.carried)));
    for (const n of inputs) if (n in this.carried) feeds[n] = this.carried[n];
    const results = await this._eval.run(feeds);
    const outputs = {};
    for (const name of m.model_outputs) outputs[name] = results[name];
    return { loss: Number(results[this.lossName].data[0]), outputs };
  }

  /** The model's outputs on `inputs` with the trained parameters (inference.onnx). */
  async predict(inputs) {
    const m = this.manifest;
    if (!this._inference) this._inference = await this._session(m.files.inference);
    const names = m.inference.inputs.map((s) => s.name).filter((n) => !(n in this.carried));
    const feeds = this._batch(inputs, names);
    for (const n of m.inference.parameters) feeds[n] = this.carried[n];
    return this._inference.run(feeds);
  }

  async _session(file) {
    const b = await this._load(file);
    return this.ort.InferenceSession.create(b instanceof Uint8Array ? b : new Uint8Array(b), this._sessionOptions);
  }

  /** The trainable parameters, {name: ort.Tensor}. */
  get parameters() {
    return Object.fromEntries(this.manifest.parameters.map((p) => [p.name, this.carried[p.name]]));
  }

  /** The trained parameters (and running statistics) as safetensors bytes: what inference.onnx takes. */
  exportParameters() {
    const names = this.manifest.inference.parameters;
    return writeSafetensors(Object.fromEntries(names.map((n) => [n, this.carried[n]])), { format: FORMAT });
  }

  /** Everything carried between steps, with the step count: a state.safetensors to resume from. */
  exportState() {
    return writeSafetensors(this.carried, { format: FORMAT, step: String(this.iterations) });
  }

  async release() {
    for (const s of [this._train, this._eval, this._inference]) if (s) await s.release();
  }
}

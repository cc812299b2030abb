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
    this.carried = {};
    for (const name of Object.values(this.feedback)) {
      const t = state.tensors[name];
      if (!t) throw new Error(`the state file lacks ${name}`);
      this.carried[name] = new ort.Tensor(t.type, t.data, t.dims);
    }
  }

  /** The batch as ort tensors; values may be ort.Tensor, TypedArray or arrays. */
  _batch(batch, names) {
    const feeds = {};
    for (const name of names) {
      const spec = this.batchSpecs[name];
      const value = batch[name];
      if (value === undefined) throw new Error(`missing batch input ${name}; the step takes ${Object.keys(this.batchSpecs)}`);
      if (value instanceof this.ort.Tensor || (value.dims && value.type)) {
        feeds[name] = value instanceof this.ort.Tensor ? value : new this.ort.Tensor(value.type, value.data, value.dims);
        continue;
      }
      const data = asTypedArray(value, spec.dtype);
      const known = (spec.shape ?? [data.length]).map((d) => (typeof d === 'number' && d > 0 ? d : null));
      const free = known.filter((d) => d === null).length;
      if (free > 1) throw new Error(`batch input ${name}: pass an ort.Tensor (shape ${JSON.stringify(spec.shape)})`);
      const dims = known.map((d) => (d === null ? data.length / product(known.filter((k) => k !== null)) : d));
      feeds[name] = new this.ort.Tensor(spec.dtype, data, dims);
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

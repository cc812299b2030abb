// Training with onnxgrad's artifacts folders (onnxgrad.artifacts.generate) on onnxruntime-node or
// onnxruntime-web. The `ort` module is injected, so the same code runs on both:
//
//   import * as ort from 'onnxruntime-web';           // or 'onnxruntime-node'
//   const load = (name) => fetch(`artifacts/${name}`).then((r) => r.arrayBuffer()).then((b) => new Uint8Array(b));
//   const trainer = await TrainingSession.create(ort, load, { lr: 0.01 });
//   const loss = await trainer.step({ pixels: x, target: y });   // ort.Tensor or TypedArray values
//   const weights = trainer.exportParameters();                  // safetensors bytes
import { CallQueue, checkClassLabels, checkDims, checkLearningRate, isFixed, shapeText, shown } from './checks.js';
import { onnxMetadata } from './ort_training.js';
import { arrayClassOf, readSafetensors, writeSafetensors } from './safetensors.js';

export { readSafetensors, writeSafetensors } from './safetensors.js';
export const FORMAT = 'onnxgrad.artifacts';
const FORMAT_VERSION = 1; // the manifest's version (Python's FORMAT_VERSION)
const OPTIMIZER_METADATA = 'onnxgrad.optimizer'; // the step graph's optimizer (Python's OPTIMIZER_METADATA)

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

/** Steps in a row with a non-finite loss at which `step()` throws: Python's `MAX_CONSECUTIVE_SKIPS`. */
export const MAX_CONSECUTIVE_SKIPS = 5;
const MANIFEST = 'manifest.json';
const CLASS_LOSSES = ['cross_entropy', 'nll']; // integer class targets, classes on axis 1
const LOSS_METADATA = 'onnxgrad.loss'; // the step graph's description of its loss (Python's LossSpec)

/**
 * An Error unless `name` (manifest `files.<key>`) is a file inside the folder: a relative path
 * with no `..` part, no absolute path, drive, URL or backslash (the loader joins it to the folder).
 */
function checkFileName(key, name) {
  const bad =
    typeof name !== 'string' ||
    !name ||
    name.startsWith('/') ||
    name.includes('\\') ||
    name.includes('\0') ||
    /^[A-Za-z][A-Za-z0-9+.-]*:/.test(name) ||
    name.split('/').some((part) => part === '..' || part === '');
  if (bad) {
    throw new Error(
      `${MANIFEST}: files.${key} is ${shown(name)}: a file of the folder must be a relative path inside it ` +
        "(no '..', no absolute path or URL)",
    );
  }
  return name;
}

/** The manifest's entries the session reads, or an Error naming the first that is missing. */
function checkManifest(m) {
  if (m === null || typeof m !== 'object' || Array.isArray(m)) throw new Error(`${MANIFEST} is not a JSON object`);
  if (m.format !== FORMAT) throw new Error(`not an onnxgrad artifacts folder (format ${m.format})`);
  const needed = ['files', 'batch', 'lr', 'step', 'loss', 'parameters', 'model_outputs', 'train_step', 'eval_step', 'inference'];
  const missing = needed.filter((k) => m[k] === undefined || m[k] === null);
  if (m.train_step && !m.train_step.feedback) missing.push('train_step.feedback');
  if (missing.length) throw new Error(`${MANIFEST} lacks ${missing.join(', ')}`);
  if (m.version !== FORMAT_VERSION) {
    throw new Error(`${MANIFEST} is corrupt: its version is ${shown(m.version)}; this onnxgrad reads version ${FORMAT_VERSION}`);
  }
  for (const key of ['train_step', 'eval_step', 'inference', 'state']) checkFileName(key, m.files[key]);
  for (const [key, name] of Object.entries(m.files)) checkFileName(key, name); // every file it lists, read or not
  if (typeof m.lr.default !== 'number') throw new Error(`${MANIFEST} is corrupt: lr.default is not a number`);
  checkLearningRate(m.lr.default, `${MANIFEST}'s lr.default`);
}

/** The step graph's `onnxgrad.optimizer` metadata ({optimizer, nonnegative}, Python's `optimizer_of`), or null. */
function optimizerOf(text, file) {
  if (text === undefined) return null; // a folder written before it was recorded
  let value;
  try {
    value = JSON.parse(text);
  } catch {
    value = null;
  }
  if (value === null || typeof value !== 'object' || typeof value.optimizer !== 'object' || value.optimizer === null) {
    throw new Error(`${file}: its ${OPTIMIZER_METADATA} metadata is not an optimizer description`);
  }
  return value;
}

/** JSON values equal as Python compares them (objects whatever their key order). */
function sameJson(a, b) {
  if (Array.isArray(a) || Array.isArray(b)) {
    return Array.isArray(a) && Array.isArray(b) && a.length === b.length && a.every((v, i) => sameJson(v, b[i]));
  }
  if (a !== null && b !== null && typeof a === 'object' && typeof b === 'object') {
    const keys = Object.keys(a);
    return keys.length === Object.keys(b).length && keys.every((k) => k in b && sameJson(a[k], b[k]));
  }
  return a === b;
}

/**
 * An Error unless the step graph fits the manifest beyond its names (Python's `check_step_model`):
 * the carried tensors' dtypes and shapes and the batch dtypes the runtime declares, and the
 * optimizer the graph records.
 */
function checkStepGraph(session, recorded, manifest, file) {
  const declared = Object.fromEntries((session.inputMetadata ?? []).map((d) => [d.name, d]));
  const carried = [...manifest.parameters, ...(manifest.optimizer_state ?? []), ...(manifest.buffers ?? [])];
  for (const spec of carried) {
    const d = declared[spec.name];
    if (d?.type && Array.isArray(d.shape) && (d.type !== spec.dtype || shapeText(d.shape) !== shapeText(spec.shape ?? []))) {
      throw new Error(
        `${file} does not fit ${MANIFEST}: input ${spec.name} is ${d.type} ${shapeText(d.shape)}, the manifest says ` +
          `${spec.dtype} ${shapeText(spec.shape ?? [])}`,
      );
    }
  }
  for (const spec of manifest.batch) {
    const type = declared[spec.name]?.type;
    if (type && spec.dtype && type !== spec.dtype) {
      throw new Error(`${file} does not fit ${MANIFEST}: batch input ${spec.name} is ${type}, the manifest says ${spec.dtype}`);
    }
  }
  if (recorded && !sameJson(recorded.optimizer, manifest.optimizer)) {
    throw new Error(
      `${file} does not fit ${MANIFEST}: the step updates with ${JSON.stringify(recorded.optimizer)}, the manifest says ` +
        `${JSON.stringify(manifest.optimizer)} (was the manifest copied from another folder?)`,
    );
  }
}

/**
 * An Error unless the runtime session of `file` takes exactly the inputs `spec.inputs` and gives
 * the outputs `spec.outputs` of the manifest: a manifest copied from another folder is caught
 * here, not as onnxruntime's "input ... is missing in 'feeds'" at the first step.
 */
function checkSessionFits(session, spec, file) {
  const pairs = [
    ['inputs', 'takes', session.inputNames, spec.inputs],
    ['outputs', 'gives', session.outputNames, spec.outputs],
  ];
  for (const [what, verb, actual, listed] of pairs) {
    if (!actual || !listed) continue; // a runtime without names: onnxruntime checks at the run
    const names = listed.map((s) => s.name);
    const extra = actual.filter((n) => !names.includes(n));
    const lacking = names.filter((n) => !actual.includes(n));
    if (extra.length || lacking.length) {
      const parts = [];
      if (extra.length) parts.push(`the model ${verb} ${extra.join(', ')}, which the manifest does not list`);
      if (lacking.length) parts.push(`the manifest lists ${what} ${lacking.join(', ')}, which the model lacks`);
      throw new Error(`${file} does not fit ${MANIFEST}: ${parts.join('; ')} (was the manifest copied from another folder?)`);
    }
  }
}

/**
 * The state read from `bytes` (`source` names it), checked against the manifest: every tensor the
 * step carries, with the manifest's dtype and shape, finite float values, and a step count that is
 * a whole number >= 0. Returns {tensors, step}.
 */
function checkedState(bytes, source, manifest, nonnegative = []) {
  const { tensors, metadata } = readSafetensors(bytes, source);
  const text = metadata.step;
  if (text === undefined) {
    throw new Error(
      `${source} does not record its step (the updates already made: 'step' in its __metadata__), which every ` +
        'state onnxgrad writes holds: a state written elsewhere? Add it',
    );
  }
  if (!/^(0|[1-9]\d*)$/.test(text) || !Number.isSafeInteger(Number(text))) {
    throw new Error(
      `${source}: its step (the updates already made) is ${shown(text)}, not a whole number from 0 to 2**53 - 1 ` +
        "(JavaScript's exact integers) in decimal digits without leading zeros",
    );
  }
  const specs = [...manifest.parameters, ...(manifest.optimizer_state ?? []), ...(manifest.buffers ?? [])];
  const byName = Object.fromEntries(specs.map((s) => [s.name, s]));
  const carried = Object.values(manifest.train_step.feedback);
  const extra = Object.keys(tensors).filter((n) => !carried.includes(n));
  if (extra.length) throw new Error(`${source} holds ${extra.join(', ')}, which the folder does not carry (the state of another folder?)`);
  for (const name of carried) {
    const t = tensors[name];
    if (!t) throw new Error(`${source} lacks ${name}, which the step carries (was it written for another folder?)`);
    const spec = byName[name];
    if (spec && (t.type !== spec.dtype || shapeText(t.dims) !== shapeText(spec.shape))) {
      throw new Error(`${source}: tensor '${name}' is ${t.type} ${shapeText(t.dims)}, the manifest says ${spec.dtype} ${shapeText(spec.shape)}`);
    }
    if (t.type.startsWith('float') && t.type !== 'float16') {
      const bad = t.data.findIndex((v) => !Number.isFinite(v));
      if (bad >= 0) throw new Error(`${source}: tensor '${name}' holds ${t.data[bad]} at index ${bad}: a state must be finite`);
    }
    if (nonnegative.includes(spec?.key) && (manifest.optimizer_state ?? []).includes(spec)) {
      const count = Array.prototype.filter.call(t.data, (v) => v < 0).length;
      if (count) {
        throw new Error(
          `${source}: tensor '${name}' holds ${count} negative values, which a second moment (a mean of squares) never ` +
            'holds: a state that would make its parameter NaN',
        );
      }
    }
  }
  return { tensors, step: Number(text) };
}

/**
 * Training from an artifacts folder: one session run per step, parameters kept as tensors.
 * Calls run one at a time in call order (`step`, `evaluate`, `predict`, `release`): each step
 * starts from the previous one's result, so `await Promise.all(batches.map((b) => tr.step(b)))`
 * equals the same steps awaited one by one.
 */
export class TrainingSession {
  /**
   * @param ort the onnxruntime module (onnxruntime-node, onnxruntime-web or onnxruntime-common API)
   * @param load async (fileName) => Uint8Array | ArrayBuffer: reads a file of the folder
   * @param options {lr: number | (step) => number, sessionOptions, state: Uint8Array (safetensors),
   *   maxConsecutiveSkips}
   */
  static async create(ort, load, options = {}) {
    const bytes = async (name) => {
      const b = await load(name);
      return b instanceof Uint8Array ? b : new Uint8Array(b);
    };
    let manifest;
    try {
      manifest = JSON.parse(new TextDecoder().decode(await bytes(MANIFEST)));
    } catch (error) {
      if (!(error instanceof SyntaxError)) throw error;
      throw new Error(`${MANIFEST} is not JSON: ${error.message}`);
    }
    checkManifest(manifest);
    const limit = options.maxConsecutiveSkips;
    if (limit !== undefined && !(Number.isInteger(limit) && limit >= 1)) {
      throw new Error(`maxConsecutiveSkips must be an integer >= 1, got ${shown(limit)}`);
    }
    if (options.lr !== undefined && typeof options.lr !== 'function') checkLearningRate(options.lr);
    // the step graph first: a manifest from another folder is blamed as such, not its state
    const file = manifest.files.train_step;
    const trainBytes = await bytes(file);
    const metadata = onnxMetadata(trainBytes);
    const recorded = optimizerOf(metadata[OPTIMIZER_METADATA], file);
    const train = await ort.InferenceSession.create(trainBytes, options.sessionOptions ?? {});
    checkSessionFits(train, manifest.train_step, file);
    checkStepGraph(train, recorded, manifest, file);
    const nonnegative = recorded?.nonnegative ?? [];
    const state = options.state
      ? checkedState(options.state, 'the state option', manifest, nonnegative)
      : checkedState(await bytes(manifest.files.state), manifest.files.state, manifest, nonnegative);
    const session = new TrainingSession(ort, load, manifest, train, state, options);
    session._labels = classLabels(manifest, metadata[LOSS_METADATA], file);
    return session;
  }

  constructor(ort, load, manifest, train, state, options) {
    this.ort = ort;
    this.manifest = manifest;
    this._load = load;
    this._train = train;
    this._eval = null;
    this._inference = null;
    this._sessionOptions = options.sessionOptions ?? {};
    this._queue = new CallQueue(); // the calls run one at a time, in call order
    const lr = options.lr ?? manifest.lr.default;
    this.schedule = typeof lr === 'function' ? lr : () => lr;
    this.iterations = state.step ?? Number(state.metadata?.step ?? 0); // updates made so far
    this.lr = this._learningRate();
    this.maxConsecutiveSkips = options.maxConsecutiveSkips ?? MAX_CONSECUTIVE_SKIPS;
    this.skippedSteps = 0; // steps skipped for a non-finite loss, in all
    this.consecutiveSkips = 0; // ... since the last update made
    this.feedback = manifest.train_step.feedback; // output name -> input name at the next step
    this.lossName = manifest.loss.name;
    this.batchSpecs = Object.fromEntries(manifest.batch.map((s) => [s.name, s]));
    // every input the batch may feed: the train step's, the eval step's and inference.onnx's
    const specs = [...(manifest.inference?.inputs ?? []), ...(manifest.eval_step?.inputs ?? []), ...manifest.batch];
    this._inputSpecs = Object.fromEntries(specs.map((s) => [s.name, s]));
    this._labels = null; // the class-label inputs to check: create() reads them from the step graph
    this.carried = {};
    for (const name of Object.values(this.feedback)) {
      const t = state.tensors[name];
      if (!t) throw new Error(`the state file lacks ${name}`);
      this.carried[name] = new ort.Tensor(t.type, t.data, t.dims);
    }
  }

  /** The schedule's rate at the current step, checked (a finite number >= 0). */
  _learningRate() {
    return checkLearningRate(this.schedule(this.iterations), `the schedule's value at step ${this.iterations}`);
  }

  /** Runs `work` after every call made before it (settled or failed); resolves to its result. */
  _serial(work) {
    return this._queue.run(work);
  }

  /**
   * The batch as ort tensors; values may be ort.Tensor, TypedArray or arrays. Each is checked
   * against the manifest (dtype, rank, fixed dimensions, one size per named dimension such as the
   * batch's `N`, class labels in range): a mismatch is an Error naming the input, the expected and
   * the given value. A key that is neither a batch input of the folder nor an input of this run is
   * refused (Python's rule).
   */
  _batch(batch, names) {
    if (batch === null || typeof batch !== 'object') {
      throw new Error(`the batch must be an object {input name: values} with ${names.join(', ')}, got ${batch}`);
    }
    const unknown = Object.keys(batch).filter((k) => batch[k] !== undefined && !(k in this.batchSpecs) && !names.includes(k));
    if (unknown.length) throw new Error(`unknown batch input(s) ${unknown.join(', ')}; this run takes ${names.join(', ')}`);
    const feeds = {};
    const sizes = {}; // named dimension -> {size, from: the input that set it}
    for (const name of names) {
      const spec = this._inputSpecs[name] ?? { name, dtype: undefined, shape: null };
      const value = batch[name];
      if (value === undefined || value === null) throw new Error(`missing batch input ${name}; this run takes ${names.join(', ')}`);
      feeds[name] = checkedTensor(this.ort, spec, value, sizes);
    }
    if (this._labels) {
      const { names: labelNames, classes, ignoreIndex } = this._labels;
      for (const name of labelNames) if (feeds[name]) checkClassLabels(name, feeds[name], classes, ignoreIndex);
    }
    return feeds;
  }

  /**
   * Whether the loss counts no row of the batch `feeds` (Python's `Runner._counts_nothing`): an
   * input with no values (an empty batch), or every class label the loss's ignore_index.
   */
  _countsNothing(feeds) {
    if (Object.values(feeds).some((t) => t.data.length === 0)) return true;
    const labels = this._labels;
    if (!labels || labels.ignoreIndex === null || labels.ignoreIndex === undefined) return false;
    const ignored = (name) => Array.prototype.every.call(feeds[name].data, (v) => Number(v) === labels.ignoreIndex);
    return labels.names.some((name) => feeds[name] && ignored(name));
  }

  /**
   * One update on `batch` ({input name: values}, the target included); resolves to the loss.
   * Steps run in call order, each from the previous one's result. A non-finite loss (a NaN in the
   * batch...) leaves the parameters, the optimizer state and `iterations` as they were and counts
   * in `skippedSteps`; `maxConsecutiveSkips` such steps in a row throw. A batch the loss counts no
   * row of (empty, or every class label the ignore_index) is skipped before anything runs: the
   * step resolves to NaN and counts in `skippedSteps` only (no divergence), as in Python.
   */
  step(batch) {
    return this._serial(() => this._step(batch));
  }

  async _step(batch) {
    const m = this.manifest;
    const feeds = this._batch(batch, Object.keys(this.batchSpecs));
    if (this.iterations >= Number.MAX_SAFE_INTEGER) {
      throw new Error(
        `the step count is ${this.iterations}, the largest JavaScript counts exactly (2**53 - 1): no further update can ` +
          'be counted (exportState writes it; start a new count from a state with a smaller step)',
      );
    }
    this.lr = this._learningRate();
    if (this._countsNothing(feeds)) {
      this.skippedSteps += 1; // not a divergence: consecutiveSkips stays
      return Number.NaN;
    }
    feeds[m.lr.name] = new this.ort.Tensor('float64', Float64Array.of(this.lr), []);
    feeds[m.step.name] = new this.ort.Tensor('int64', BigInt64Array.of(BigInt(this.iterations)), []);
    Object.assign(feeds, this.carried);
    const results = await this._train.run(feeds);
    const loss = Number(results[this.lossName].data[0]);
    if (!Number.isFinite(loss)) {
      this.skippedSteps += 1;
      this.consecutiveSkips += 1;
      if (this.consecutiveSkips >= this.maxConsecutiveSkips) {
        throw new Error(
          `the loss is ${loss} at update ${this.iterations}: the update was skipped, the parameters and optimizer ` +
            `state are unchanged (${this.consecutiveSkips} skipped in a row, the limit maxConsecutiveSkips=` +
            `${this.maxConsecutiveSkips}). Check the batches for NaN and infinite values, or lower the learning rate`,
        );
      }
      return loss;
    }
    this.consecutiveSkips = 0;
    for (const [out, input] of Object.entries(this.feedback)) this.carried[input] = results[out];
    this.iterations += 1;
    return loss;
  }

  /** {loss, outputs: {name: ort.Tensor}} on `batch`, without updating (after the steps called before). */
  evaluate(batch) {
    return this._serial(async () => {
      const m = this.manifest;
      if (!this._eval) this._eval = await this._session('eval_step');
      const inputs = m.eval_step.inputs.map((s) => s.name);
      const feeds = this._batch(batch, inputs.filter((n) => !(n in this.carried)));
      for (const n of inputs) if (n in this.carried) feeds[n] = this.carried[n];
      const results = await this._eval.run(feeds);
      const outputs = {};
      for (const name of m.model_outputs) outputs[name] = results[name];
      return { loss: Number(results[this.lossName].data[0]), outputs };
    });
  }

  /** The model's outputs on `inputs` with the trained parameters (inference.onnx), after the steps called before. */
  predict(inputs) {
    return this._serial(async () => {
      const m = this.manifest;
      if (!this._inference) this._inference = await this._session('inference');
      const names = m.inference.inputs.map((s) => s.name).filter((n) => !(n in this.carried));
      const feeds = this._batch(inputs, names);
      for (const n of m.inference.parameters) feeds[n] = this.carried[n];
      return this._inference.run(feeds);
    });
  }

  /** The runtime session of the manifest's `key` file, checked against the manifest. */
  async _session(key) {
    const file = this.manifest.files[key];
    const b = await this._load(file);
    const session = await this.ort.InferenceSession.create(b instanceof Uint8Array ? b : new Uint8Array(b), this._sessionOptions);
    checkSessionFits(session, this.manifest[key], file);
    return session;
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

  /** Releases the runtime sessions, after the calls made before. */
  release() {
    return this._serial(async () => {
      for (const s of [this._train, this._eval, this._inference]) if (s) await s.release();
    });
  }
}

/**
 * The class-label inputs to check before a run, {names, classes, ignoreIndex}, or null. `text` is
 * the step graph's `onnxgrad.loss` metadata (Python's LossSpec: kind, target, classes, ignore_index),
 * the one description of the loss; a folder written before it had one falls back on the manifest:
 * the integer batch inputs the model does not take, classes from dimension 1 of the scores.
 */
function classLabels(m, text, file) {
  if (text !== undefined) {
    let spec;
    try {
      spec = JSON.parse(text);
    } catch (error) {
      throw new Error(`${file}: its ${LOSS_METADATA} metadata is not a loss description: ${error.message}`);
    }
    if (!CLASS_LOSSES.includes(spec?.kind) || typeof spec.target !== 'string') return null;
    return { names: [spec.target], classes: isFixed(spec.classes) ? spec.classes : null, ignoreIndex: spec.ignore_index ?? null };
  }
  if (!CLASS_LOSSES.includes(m.loss?.kind)) return null;
  const options = m.loss.options ?? {};
  const scores = (m.eval_step.outputs ?? []).find((s) => s.name === (options.output ?? m.model_outputs[0]));
  const classes = scores?.shape?.[1];
  const modelInputs = new Set((m.inference.inputs ?? []).map((s) => s.name));
  const names = m.batch.filter((s) => !modelInputs.has(s.name) && /^u?int/.test(s.dtype ?? '')).map((s) => s.name);
  return names.length ? { names, classes: isFixed(classes) ? classes : null, ignoreIndex: options.ignore_index ?? -100 } : null;
}

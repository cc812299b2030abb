// onnxruntime-web's former training API (ort.TrainingSession, dropped after 1.19) over a folder
// written by onnxgrad.compat.training.artifacts.generate_artifacts: training_model.onnx (forward,
// loss and backward, plain ONNX), eval_model.onnx, optimizer_model.onnx and checkpoint
// (onnxruntime-training's FlatBuffer). The `ort` module is injected, so the same code runs on
// onnxruntime-node and onnxruntime-web:
//
//   const session = await createTrainingSession(ort, {checkpointState, trainModel, evalModel, optimizerModel});
//   const {[session.trainingOutputNames[0]]: loss} = await session.runTrainStep({input: x, labels: y});
//   await session.runOptimizerStep(); await session.lazyResetGrad();
//
// Each file is a Uint8Array or ArrayBuffer (the Node entry point also takes paths). Folders
// written by onnxruntime-training itself hold com.microsoft training kernels: regenerate them with
// onnxgrad (Python) first.
import { CallQueue, checkClassLabels, checkDims, checkLearningRate } from './checks.js';
import { arrayClassOf } from './safetensors.js';

const META_KEY = 'onnxgrad.compat.training';
const ONNX_TYPES = { 1: 'float32', 2: 'uint8', 3: 'int8', 6: 'int32', 7: 'int64', 9: 'bool', 10: 'float16', 11: 'float64' };

function u8(bytes) {
  return ArrayBuffer.isView(bytes) ? new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength) : new Uint8Array(bytes);
}

/** The metadata_props of an ONNX model (ModelProto field 14), read from its protobuf bytes. */
export function onnxMetadata(bytes) {
  const b = u8(bytes);
  let pos = 0;
  const varint = () => {
    let value = 0;
    let shift = 1;
    for (;;) {
      if (pos >= b.length) throw new Error('not an ONNX model: truncated protobuf');
      const byte = b[pos++];
      value += (byte & 0x7f) * shift;
      if (byte < 0x80) return value;
      shift *= 128;
    }
  };
  const fields = (start, end, visit) => {
    pos = start;
    while (pos < end) {
      const key = varint();
      const field = Math.floor(key / 8);
      const wire = key % 8;
      if (wire === 0) varint();
      else if (wire === 1) pos += 8;
      else if (wire === 5) pos += 4;
      else if (wire === 2) {
        const n = varint();
        const at = pos;
        pos += n;
        visit(field, at, at + n);
      } else throw new Error(`not an ONNX model: protobuf wire type ${wire}`);
    }
  };
  const text = (s, e) => new TextDecoder().decode(b.subarray(s, e));
  const meta = {};
  fields(0, b.length, (field, s, e) => {
    if (field !== 14) return;
    const after = pos;
    const entry = {};
    fields(s, e, (f, s2, e2) => {
      entry[f] = text(s2, e2);
    });
    pos = after;
    meta[entry[1] ?? ''] = entry[2] ?? '';
  });
  return meta;
}

/**
 * Parse onnxruntime-training's checkpoint (FlatBuffer 'ODTC'): {trainable, frozen, nominal, group,
 * properties}. A nominal checkpoint (names and shapes, no values) gives zeros and `nominal: true`;
 * int properties are BigInts (int64 in the file: 2**60 + 1 stays exact), float ones numbers.
 */
export function readCheckpoint(bytes) {
  try {
    return parseCheckpoint(bytes);
  } catch (error) {
    if (!(error instanceof RangeError)) throw error; // a read past the end: a truncated or corrupted buffer
    throw new Error(`the checkpoint file is damaged: ${error.name}: ${error.message}`, { cause: error }); // Python's words
  }
}

function parseCheckpoint(bytes) {
  const b = u8(bytes);
  const view = new DataView(b.buffer, b.byteOffset, b.byteLength);
  if (b.length < 8 || new TextDecoder().decode(b.subarray(4, 8)) !== 'ODTC') {
    throw new Error('not an onnxruntime training checkpoint (no ODTC file identifier)');
  }
  const field = (table, slot) => {
    const vtable = table - view.getInt32(table, true);
    const at = 4 + 2 * slot;
    if (at >= view.getUint16(vtable, true)) return 0;
    const off = view.getUint16(vtable + at, true);
    return off ? table + off : 0;
  };
  const deref = (p) => p + view.getUint32(p, true);
  const sub = (table, slot) => (field(table, slot) ? deref(field(table, slot)) : 0);
  const vector = (table, slot) => {
    const p = sub(table, slot);
    return p ? { start: p + 4, length: view.getUint32(p, true) } : { start: 0, length: 0 };
  };
  const tables = (table, slot) => {
    const { start, length } = vector(table, slot);
    return Array.from({ length }, (_, j) => deref(start + 4 * j));
  };
  const string = (table, slot) => {
    const p = sub(table, slot);
    return p ? new TextDecoder().decode(b.subarray(p + 4, p + 4 + view.getUint32(p, true))) : '';
  };
  const scalar = (table, slot, get, fallback) => (field(table, slot) ? get(field(table, slot)) : fallback);
  const root = deref(0);
  const module = sub(root, 1);
  const nominal = module ? scalar(module, 2, (p) => view.getUint8(p) !== 0, false) : false;
  const tensor = (t) => {
    const dims = [];
    const d = vector(t, 2);
    for (let j = 0; j < d.length; j++) dims.push(Number(view.getBigInt64(d.start + 8 * j, true)));
    const type = ONNX_TYPES[scalar(t, 3, (p) => view.getInt32(p, true), 0)];
    if (!type) throw new Error(`checkpoint tensor ${string(t, 0)}: unsupported data type`);
    const Cls = arrayClassOf(type);
    const size = dims.reduce((a, c) => a * c, 1);
    if (scalar(t, 6, (p) => Number(view.getBigInt64(p, true)), -1) !== -1) {
      throw new Error(
        `checkpoint tensor ${string(t, 0)} keeps its data in the checkpoint's external file (<checkpoint>.data, ` +
          'written for checkpoints too big for one FlatBuffer), which the JavaScript reader does not read',
      );
    }
    const raw = vector(t, 4);
    const data = new Cls(size);
    if (raw.length !== data.byteLength && (raw.length || (!nominal && size))) {
      const has = raw.length ? `${raw.length} bytes` : 'no data';
      throw new Error(`checkpoint tensor ${string(t, 0)} has ${has} for shape [${dims.join(', ')}] of ${type}`);
    }
    if (raw.length) new Uint8Array(data.buffer).set(b.subarray(raw.start, raw.start + raw.length));
    return [string(t, 0), { type, dims, data }];
  };
  const groups = tables(root, 2).map((g) => ({
    name: string(g, 0),
    step: Number(scalar(g, 1, (p) => view.getBigInt64(p, true), 0n)),
    initialLr: scalar(g, 2, (p) => view.getFloat32(p, true), 0),
    states: Object.fromEntries(tables(g, 3).map((s) => [string(s, 0), Object.fromEntries(tables(s, 1).map(tensor))])),
  }));
  const properties = {};
  const bag = sub(root, 3);
  if (bag) {
    for (const p of tables(bag, 0)) properties[string(p, 0)] = scalar(p, 1, (q) => view.getBigInt64(q, true), 0n); // int64: exact
    for (const p of tables(bag, 1)) properties[string(p, 0)] = scalar(p, 1, (q) => view.getFloat32(q, true), 0);
    for (const p of tables(bag, 2)) properties[string(p, 0)] = string(p, 1);
  }
  return {
    trainable: Object.fromEntries(module ? tables(module, 0).map(tensor) : []),
    frozen: Object.fromEntries(module ? tables(module, 1).map(tensor) : []),
    nominal,
    group: groups[0] ?? null,
    properties,
  };
}

/** What each option of TrainingSession.create holds. */
const ROLES = {
  trainModel: 'the training model (training_model.onnx)',
  evalModel: 'the eval model (eval_model.onnx)',
  optimizerModel: 'the optimizer model (optimizer_model.onnx)',
};

/** The option a model's onnxgrad metadata belongs to: the entry only that model's metadata has. */
function roleOf(meta) {
  if ('grads' in meta) return 'trainModel';
  if ('optimizer' in meta) return 'optimizerModel';
  return 'loss_outputs' in meta ? 'evalModel' : null;
}

/** The onnxgrad metadata of the model passed as `key` (trainModel...), or an Error saying what the file is instead. */
function metaOf(bytes, key) {
  const text = onnxMetadata(bytes)[META_KEY];
  if (!text) {
    throw new Error(
      `${key} was not written by onnxgrad.compat.training (onnxruntime-training's files hold com.microsoft ` +
        'training kernels): regenerate the folder with onnxgrad.compat.training.artifacts.generate_artifacts',
    );
  }
  const meta = JSON.parse(text);
  const role = roleOf(meta);
  if (role !== key) {
    const is = role ? `${ROLES[role]}: pass it as ${role}` : 'no model of such a folder';
    throw new Error(`${key} must be ${ROLES[key]}, but the file given is ${is}`);
  }
  return meta;
}

/** The message of onnxruntime-training for `what` on a nominal checkpoint state. */
function nominalMessage(what) {
  return `${what}. Please load the model parameters first.`;
}

/** The training session of onnxruntime-web 1.19, on stock onnxruntime: see the file's header. */
export class OrtTrainingSession {
  constructor(ort, files, sessions, sessionOptions) {
    this.ort = ort;
    this._files = files;
    this._sessionOptions = sessionOptions;
    [this._train, this._optimizer] = sessions;
    this._eval = null;
    this._meta = metaOf(files.trainModel, 'trainModel');
    const state = readCheckpoint(files.checkpointState);
    this._nominal = state.nominal; // no values yet: loadParametersBuffer(buffer, false) fills them
    this._trainable = state.trainable;
    this._values = { ...state.frozen, ...state.trainable };
    this.properties = state.properties;
    const group = state.group ?? { step: 0, initialLr: 1e-3, states: {} };
    this._step = group.step;
    this._lr = group.initialLr;
    this._moments = group.states;
    this._grads = {};
    this._reset = true;
    this._queue = new CallQueue(); // the async calls run one at a time, in call order (index.js's rule)
    for (const p of this._meta.parameters) {
      if (!this._values[p]) throw new Error(`the checkpoint lacks the parameter ${p}`);
    }
  }

  get trainingInputNames() {
    return [...this._meta.user_inputs];
  }

  get trainingOutputNames() {
    return [...this._meta.loss_outputs];
  }

  get evalInputNames() {
    return [...this._meta.user_inputs];
  }

  get evalOutputNames() {
    return [...this._meta.loss_outputs];
  }

  _tensor(name) {
    const v = this._values[name];
    return new this.ort.Tensor(v.type, v.data, v.dims);
  }

  /** An Error while the checkpoint is nominal (its parameters have no values yet). */
  _checkLoaded(what) {
    if (this._nominal) throw new Error(nominalMessage(what));
  }

  /**
   * The feeds of `session`: the user's, checked (ort.Tensors of the declared dtype and shape, one
   * size per named dimension such as the batch), and the parameters.
   */
  _feeds(feeds, session) {
    if (feeds === null || typeof feeds !== 'object') {
      throw new Error(`the feeds must be an object {input name: ort.Tensor} with ${this._meta.user_inputs.join(', ')}, got ${feeds}`);
    }
    const declared = Object.fromEntries((session.inputMetadata ?? []).map((m) => [m.name, m]));
    const takes = session.inputNames.filter((n) => !(n in this._values));
    const unknown = Object.keys(feeds).filter((k) => feeds[k] !== undefined && !takes.includes(k));
    if (unknown.length) throw new Error(`unknown input(s) ${unknown.join(', ')}; the model takes ${takes.join(', ')}`); // the artifacts API's rule
    const out = {};
    const sizes = {};
    for (const name of session.inputNames) {
      if (name in this._values) {
        out[name] = this._tensor(name);
        continue;
      }
      const value = feeds[name];
      if (value === undefined) throw new Error(`missing input ${name}; the model takes ${this._meta.user_inputs.join(', ')}`);
      if (!(value instanceof this.ort.Tensor)) {
        const kind = value === null || typeof value !== 'object' ? typeof value : (value.constructor?.name ?? 'object');
        throw new Error(`input ${name} must be an ort.Tensor, got ${kind}: wrap it, new ort.Tensor(type, data, dims)`);
      }
      const meta = declared[name];
      if (meta?.type && value.type !== meta.type) {
        throw new Error(`batch input ${name} has dtype ${value.type}, the model expects ${meta.type}`);
      }
      checkDims(name, value.dims, meta?.shape ?? null, sizes);
      out[name] = value;
    }
    // the class labels of the loss (Python's graphs.class_labels): onnxruntime reads -1 as class C - 1
    for (const [name, spec] of Object.entries(this._meta.labels ?? {})) {
      if (out[name]) checkClassLabels(name, out[name], spec.classes ?? null, spec.ignore_index ?? null);
    }
    return out;
  }

  /** Forward, loss and backward; the gradients accumulate until lazyResetGrad(). Resolves to {loss output: Tensor}. */
  runTrainStep(feeds) {
    return this._queue.run(() => this._runTrainStep(feeds));
  }

  async _runTrainStep(feeds) {
    this._checkLoaded('Cannot perform TrainStep with a nominal state');
    const m = this._meta;
    const results = await this._train.run(this._feeds(feeds, this._train));
    for (const [param, out] of Object.entries(m.grads)) {
      const g = results[out].data;
      if (this._reset || !this._grads[param]) this._grads[param] = Float32Array.from(g);
      else {
        const acc = this._grads[param];
        for (let i = 0; i < acc.length; i++) acc[i] += g[i];
      }
    }
    this._reset = false;
    for (const [stat, out] of Object.entries(m.stats)) {
      const t = results[out];
      this._values[stat] = { type: t.type, dims: [...t.dims], data: t.data.slice() };
    }
    return Object.fromEntries(m.loss_outputs.map((n) => [n, results[n]]));
  }

  /** The eval model (inference mode) on `feeds`: {loss output: Tensor}. */
  runEvalStep(feeds) {
    return this._queue.run(() => this._runEvalStep(feeds));
  }

  async _runEvalStep(feeds) {
    this._checkLoaded('Cannot perform EvalStep with a nominal state');
    if (!this._files.evalModel) {
      throw new Error('runEvalStep needs the eval model: pass evalModel (eval_model.onnx) to TrainingSession.create');
    }
    if (!this._eval) this._eval = await this.ort.InferenceSession.create(this._files.evalModel, this._sessionOptions);
    return this._eval.run(this._feeds(feeds, this._eval));
  }

  /** One update of the trainable parameters from the accumulated gradients. */
  runOptimizerStep() {
    return this._queue.run(() => this._runOptimizerStep());
  }

  async _runOptimizerStep() {
    if (!this._optimizer) {
      throw new Error('runOptimizerStep needs the optimizer model: pass optimizerModel (optimizer_model.onnx) to TrainingSession.create');
    }
    this._checkLoaded('Cannot fetch named parameters from a nominal checkpoint state'); // 1.19.2's Module::NamedParameters
    const T = this.ort.Tensor;
    const feeds = {
      learning_rate: new T('float32', Float32Array.of(this._lr), []),
      step: new T('int64', BigInt64Array.of(BigInt(this._step)), []),
    };
    const adamw = this._optimizer.inputNames.some((n) => n.endsWith('/momentum0'));
    const params = Object.keys(this._meta.grads);
    for (const p of params) {
      const v = this._values[p];
      feeds[p] = this._tensor(p);
      feeds[`${p}/grad`] = new T('float32', this._grads[p] ?? new Float32Array(v.data.length), v.dims);
      if (adamw) {
        const moments = (this._moments[p] ??= {});
        for (const k of ['momentum0', 'momentum1']) {
          moments[k] ??= { type: 'float32', dims: v.dims, data: new Float32Array(v.data.length) };
          feeds[`${p}/${k}`] = new T('float32', moments[k].data, v.dims);
        }
      }
    }
    const results = await this._optimizer.run(feeds);
    for (const p of params) {
      this._values[p] = { ...this._values[p], data: results[`new/${p}`].data.slice() };
      if (adamw) {
        for (const k of ['momentum0', 'momentum1']) this._moments[p][k].data = results[`new/${p}/${k}`].data.slice();
      }
    }
    this._step += 1;
  }

  /** The next training step overwrites the gradients instead of adding to them. */
  lazyResetGrad() {
    return this._queue.run(() => this._lazyResetGrad());
  }

  async _lazyResetGrad() {
    this._reset = true;
  }

  setLearningRate(lr) {
    this._lr = checkLearningRate(lr);
  }

  getLearningRate() {
    return Math.fround(this._lr);
  }

  _bufferNames(trainableOnly) {
    return this._meta.parameters.filter((p) => !trainableOnly || p in this._trainable);
  }

  /** The number of elements of the (trainable) parameters. */
  async getParametersSize(trainableOnly = true) {
    return this._parametersSize(trainableOnly);
  }

  _parametersSize(trainableOnly) {
    return this._bufferNames(trainableOnly).reduce((n, p) => n + this._values[p].data.length, 0);
  }

  /** The (trainable) parameters in one float32 tensor, in the training model's input order. */
  getContiguousParameters(trainableOnly = true) {
    return this._queue.run(() => this._getContiguousParameters(trainableOnly));
  }

  async _getContiguousParameters(trainableOnly) {
    this._checkLoaded('Cannot copy parameters from a nominal checkpoint state');
    const size = this._parametersSize(trainableOnly);
    const out = new Float32Array(size);
    let at = 0;
    for (const p of this._bufferNames(trainableOnly)) {
      out.set(this._values[p].data, at);
      at += this._values[p].data.length;
    }
    return new this.ort.Tensor('float32', out, [size]);
  }

  /**
   * Load parameters from the bytes of a float32 buffer laid out as getContiguousParameters. A
   * nominal checkpoint takes every parameter (`trainableOnly = false`), then it is complete.
   */
  loadParametersBuffer(buffer, trainableOnly = true) {
    return this._queue.run(() => this._loadParametersBuffer(buffer, trainableOnly));
  }

  async _loadParametersBuffer(buffer, trainableOnly) {
    if (this._nominal && trainableOnly) {
      throw new Error(
        'For nominal checkpoint state, all parameters need to be loaded into the model (trainableOnly = false).',
      );
    }
    const b = u8(buffer);
    const size = this._parametersSize(trainableOnly);
    if (b.byteLength !== 4 * size) throw new Error(`the buffer has ${b.byteLength} bytes, the parameters ${4 * size}`);
    const flat = new Float32Array(b.slice().buffer);
    let at = 0;
    for (const p of this._bufferNames(trainableOnly)) {
      const n = this._values[p].data.length;
      this._values[p] = { ...this._values[p], data: flat.slice(at, at + n) };
      at += n;
    }
    this._nominal = false;
  }

  release() {
    return this._queue.run(() => this._release());
  }

  async _release() {
    for (const s of [this._train, this._eval, this._optimizer]) if (s) await s.release();
  }
}

/** The bytes at `url` (fetch: the browser, or Node >= 18). */
export async function fetchBytes(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
}

/**
 * onnxruntime-web's `TrainingSession` over an injected `ort`: `create(options, sessionOptions)`
 * takes the four files as Uint8Arrays, ArrayBuffers or strings, which `load` reads (by default
 * fetched: URLs in the browser):
 *
 *   const TrainingSession = trainingSessionOf(ort);
 *   const session = await TrainingSession.create({checkpointState: 'data/checkpoint', trainModel: ...});
 */
export function trainingSessionOf(ort, load = fetchBytes) {
  return {
    async create(options, sessionOptions = {}) {
      const files = {};
      for (const [key, value] of Object.entries(options ?? {})) files[key] = typeof value === 'string' ? await load(value) : value;
      return createTrainingSession(ort, files, sessionOptions);
    },
  };
}

/**
 * onnxruntime-web's TrainingSession.create({checkpointState, trainModel, evalModel, optimizerModel}, sessionOptions);
 * evalModel and optimizerModel may be left out (runEvalStep and runOptimizerStep then say they need them).
 */
export async function createTrainingSession(ort, options, sessionOptions = {}) {
  const files = {};
  for (const key of ['checkpointState', 'trainModel', 'evalModel', 'optimizerModel']) {
    const value = options[key];
    const absent = value === undefined || value === null;
    // evalModel and optimizerModel are optional, as in onnxruntime-web 1.19
    if (absent && (key === 'checkpointState' || key === 'trainModel')) throw new Error(`TrainingSession.create needs ${key}`);
    if (!absent) files[key] = u8(value);
  }
  for (const key of Object.keys(ROLES)) if (files[key]) metaOf(files[key], key); // each file where it belongs
  const train = await ort.InferenceSession.create(files.trainModel, sessionOptions);
  const optimizer = files.optimizerModel ? await ort.InferenceSession.create(files.optimizerModel, sessionOptions) : null;
  return new OrtTrainingSession(ort, files, [train, optimizer], sessionOptions);
}

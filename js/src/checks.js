// The checks both JavaScript front ends make (the artifacts TrainingSession of index.js and the
// former onnxruntime-web TrainingSession of ort_training.js): one rule each, as the Python side's.

/** A value as the error messages show it: strings quoted, the rest as JavaScript prints it. */
export function shown(value) {
  return typeof value === 'string' ? JSON.stringify(value) : String(value);
}

/** The largest learning rate a float32 update holds (Python's `LR_MAX`, float32's largest value). */
export const LR_MAX = 3.4028234663852886e38;

/**
 * `lr` as a number when it is a finite number >= 0 and at most `LR_MAX` (the rule of Python's
 * `check_lr`), an Error otherwise: a negative rate climbs the loss, an infinite or NaN one makes
 * every parameter NaN, one beyond float32's range overflows the update. `from` says where the
 * value came from (`the schedule at step 3`).
 */
export function checkLearningRate(lr, from = '') {
  const where = from ? ` (${from})` : '';
  if (typeof lr !== 'number') throw new Error(`lr must be a number >= 0, got ${shown(lr)}${where}`);
  if (!(Number.isFinite(lr) && lr >= 0)) {
    throw new Error(
      `lr must be >= 0, got ${lr}${where}: a finite number (a negative rate climbs the loss, an infinite or NaN one ` +
        'makes every parameter NaN)',
    );
  }
  if (lr > LR_MAX) {
    throw new Error(
      `lr must be at most ${LR_MAX} (float32's largest value), got ${lr}${where}: a larger rate overflows the float32 ` +
        'update (every parameter inf or NaN)',
    );
  }
  return lr;
}

/**
 * Calls that run one at a time, in call order: `run(work)` starts `work` once every call made
 * before it has settled (resolved or failed) and resolves to its result. The one queue of both
 * JavaScript front ends, so that `Promise.all` over a session's calls equals the same calls awaited
 * one by one (each step from the previous one's weights).
 */
export class CallQueue {
  constructor() {
    this._last = Promise.resolve();
  }

  run(work) {
    const result = this._last.then(work);
    this._last = result.catch(() => {});
    return result;
  }
}

/** A shape as text, `[N, 64]`; `?` for a dimension without a size or a name. */
export function shapeText(dims) {
  return `[${dims.map((d) => (d === null || d === undefined ? '?' : String(d))).join(', ')}]`;
}

/** A fixed size in a declared shape (a named or unknown dimension is not). */
export function isFixed(d) {
  return Number.isInteger(d) && d >= 0;
}

/**
 * An Error unless `dims` (of batch input `name`) fit the declared shape `expected` and the sizes
 * of named dimensions seen so far in this run (`sizes`: name -> {size, from: the input that set it}),
 * so that the batch's `N` takes one size across the inputs.
 */
export function checkDims(name, dims, expected, sizes) {
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

/**
 * An Error unless every value of the class labels `tensor` (batch input `name`, classes on axis 1
 * of the scores) lies in [0, classes) or equals `ignoreIndex` (a row the loss skips, torch's rule):
 * a label outside would add nothing to the loss, or make it NaN, with no error. `classes` null (a
 * symbolic class count): only negative labels are refused. Names the first such value and its row,
 * as Python's `check_labels`.
 */
export function checkClassLabels(name, tensor, classes, ignoreIndex = -100) {
  const { data, dims } = tensor;
  const isBad = (v) => v !== ignoreIndex && (v < 0 || (classes !== null && v >= classes));
  let first = -1;
  let count = 0;
  for (let i = 0; i < data.length; i++) {
    if (!isBad(Number(data[i]))) continue;
    if (first < 0) first = i;
    count += 1;
  }
  if (first < 0) return;
  const where = [];
  for (let k = dims.length - 1, rest = first; k >= 0; k--) {
    where.unshift(rest % dims[k]);
    rest = Math.floor(rest / dims[k]);
  }
  const row = where.length > 1 ? `row ${where[0]} (position [${where.join(', ')}])` : `row ${where[0] ?? 0}`;
  const valid = classes !== null ? `[0, ${classes})` : '[0, C)';
  const skipped = ignoreIndex !== null ? `; only ignore_index ${ignoreIndex} may lie outside` : '';
  throw new Error(
    `batch input ${name} holds class ${data[first]} at ${row}: class labels must lie in ${valid}${skipped} (${count} such label(s))`,
  );
}

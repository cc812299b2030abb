// Shared by bench.mjs (Node) and page.mjs (chromium): one timed run of onnxgrad's train_step.onnx
// (js/src TrainingSession on an onnxruntime) or of the same model in TensorFlow.js (core API, the
// same weights from state.safetensors, the same cross-entropy and AdamW, written as onnxgrad's and
// torch's AdamW: p *= 1 - lr wd; m += (g - m)(1 - b1); v = b2 v + (1 - b2) g^2;
// p += -lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)).
// A run starts from the same state, trains `steps` steps on the fixture's batches (those of
// js/test/make_fixture.py) and returns its losses and the time of each step (the loss read back).

export function median(values) {
  const s = [...values].sort((a, b) => a - b);
  const n = s.length;
  return n % 2 ? s[(n - 1) / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

/** The batch of step k: consecutive rows, wrapping at the last full batch (make_fixture.batch_at). */
export function batchAt(tensors, k, size) {
  const [rows, ...sample] = tensors.pixels.dims;
  const width = sample.reduce((a, b) => a * b, 1);
  const start = (k % Math.floor(rows / size)) * size;
  return {
    pixels: tensors.pixels.data.slice(start * width, (start + size) * width),
    dims: [size, ...sample],
    target: tensors.target.data.slice(start, start + size),
  };
}

/** Largest |loss - expected| / (1 + |expected|) over the run. */
export function worstDifference(losses, expected) {
  return Math.max(...losses.map((l, i) => Math.abs(l - expected[i]) / (1 + Math.abs(expected[i]))));
}

export async function runOnnxgrad({ ort, TrainingSession, load, data, expected, steps, sessionOptions }) {
  const session = await TrainingSession.create(ort, load, { sessionOptions, lr: expected.lr });
  const losses = [];
  const times = [];
  for (let k = 0; k < steps; k++) {
    const b = batchAt(data, k, expected.batch_size);
    const t0 = performance.now();
    losses.push(await session.step({ pixels: new ort.Tensor('float32', b.pixels, b.dims), target: b.target }));
    times.push(performance.now() - t0);
  }
  await session._train.release?.();
  return { losses, times };
}

/** The digits MLP (Gemm, Relu) or CNN (NCHW in ONNX; NHWC here, Flatten in NCHW order). */
function forward(tf, kind, p, x) {
  if (kind === 'mlp') {
    const h = tf.relu(tf.add(tf.matMul(x, p['fc1.weight']), p['fc1.bias']));
    return tf.add(tf.matMul(h, p['fc2.weight']), p['fc2.bias']);
  }
  let y = tf.transpose(x, [0, 2, 3, 1]); // NCHW -> NHWC
  for (const conv of ['conv1', 'conv2']) {
    const w = tf.transpose(p[`${conv}.weight`], [2, 3, 1, 0]); // [O, I, kh, kw] -> [kh, kw, I, O]
    y = tf.relu(tf.add(tf.conv2d(y, w, 1, 'same'), p[`${conv}.bias`]));
    y = tf.maxPool(y, 2, 2, 'valid');
  }
  const flat = tf.reshape(tf.transpose(y, [0, 3, 1, 2]), [x.shape[0], -1]);
  const h = tf.relu(tf.add(tf.matMul(flat, p['fc1.weight']), p['fc1.bias']));
  return tf.add(tf.matMul(h, p['fc2.weight']), p['fc2.bias']);
}

export async function runTfjs({ tf, kind, state, data, expected, steps, hyper }) {
  const names = Object.keys(state.tensors).filter((n) => !n.includes('/')); // parameters, not exp_avg/...
  const params = {};
  const m = {};
  const v = {};
  for (const n of names) {
    const t = state.tensors[n];
    params[n] = tf.variable(tf.tensor(t.data, t.dims, 'float32'), true, n);
    m[n] = tf.zeros(t.dims);
    v[n] = tf.zeros(t.dims);
  }
  const losses = [];
  const times = [];
  try {
    const [b1, b2] = hyper.betas;
    const { eps, weight_decay: wd } = hyper;
    const lr = expected.lr;
    for (let k = 0; k < steps; k++) {
      const b = batchAt(data, k, expected.batch_size);
      const t0 = performance.now();
      const x = tf.tensor(b.pixels, b.dims, 'float32');
      const y = tf.oneHot(tf.tensor1d(Int32Array.from(b.target, Number), 'int32'), 10);
      const { value, grads } = tf.variableGrads(() =>
        tf.neg(tf.mean(tf.sum(tf.mul(tf.logSoftmax(forward(tf, kind, params, x)), y), 1))),
      );
      const t = k + 1;
      const stepSize = -lr / (1 - b1 ** t); // scalars in double, as numpy and onnxgrad's step
      const sqrtBias2 = Math.sqrt(1 - b2 ** t);
      tf.tidy(() => {
        for (const n of names) {
          const g = grads[n];
          const p = tf.mul(params[n], 1 - lr * wd);
          const m1 = tf.add(m[n], tf.mul(tf.sub(g, m[n]), 1 - b1));
          const v1 = tf.add(tf.mul(v[n], b2), tf.mul(tf.mul(g, g), 1 - b2));
          const denom = tf.add(tf.div(tf.sqrt(v1), sqrtBias2), eps);
          params[n].assign(tf.add(p, tf.mul(tf.div(m1, denom), stepSize)));
          tf.dispose([m[n], v[n]]);
          m[n] = tf.keep(m1);
          v[n] = tf.keep(v1);
        }
      });
      losses.push((await value.data())[0]);
      times.push(performance.now() - t0);
      tf.dispose([x, y, value, ...Object.values(grads)]);
    }
  } finally { // a failed run (a kernel the backend lacks) must not leave its variables registered
    tf.dispose([...Object.values(params), ...Object.values(m), ...Object.values(v)]);
  }
  return { losses, times };
}

// What the artifacts TrainingSession refuses or guards against, each as an Error that says what went
// wrong (issue 38, and 37/39 for the JavaScript side): steps called concurrently, a learning rate
// that is not a finite number >= 0, a batch with a NaN (the update is skipped and counted), class
// labels out of range, unknown batch inputs, a truncated state file, a manifest that does not fit
// the folder's files, manifest paths out of the folder, a state that does not fit the manifest.
// Uses the MLP fixture of make_fixture.py ($ONNXGRAD_JS_FIXTURE or test/fixture).
import assert from 'node:assert/strict';
import { cpSync, existsSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { MAX_CONSECUTIVE_SKIPS, loadTrainingFolder, ort, readSafetensors, writeSafetensors } from '../src/node.js';

const ROOT = process.env.ONNXGRAD_JS_FIXTURE ?? fileURLToPath(new URL('./fixture/', import.meta.url));
const FOLDER = join(ROOT, 'artifacts');
const OPTIONS = { sessionOptions: { intraOpNumThreads: 1 } };
const N = 32;
let data;
let scratch;

before(async () => {
  if (!existsSync(join(FOLDER, 'manifest.json'))) throw new Error(`no fixture in ${ROOT}: run python js/test/make_fixture.py ${ROOT}`);
  data = readSafetensors(await readFile(join(ROOT, 'digits.safetensors'))).tensors;
  scratch = mkdtempSync(join(tmpdir(), 'onnxgrad-checks-'));
});

after(() => rmSync(scratch, { recursive: true, force: true }));

/** Batch `k` of the digits: N consecutive rows. */
function batch(k) {
  const start = k * N;
  return {
    pixels: new ort.Tensor('float32', data.pixels.data.slice(start * 64, (start + N) * 64), [N, 64]),
    target: data.target.data.slice(start, start + N),
  };
}

/** A copy of the fixture folder in the scratch folder, `edit(dir)` applied; its path. */
let copies = 0;
function copyFolder(edit) {
  const dir = join(scratch, `folder${copies++}`);
  cpSync(FOLDER, dir, { recursive: true });
  edit(dir);
  return dir;
}

const manifestOf = (dir) => JSON.parse(readFileSync(join(dir, 'manifest.json'), 'utf8'));
const writeManifest = (dir, m) => writeFileSync(join(dir, 'manifest.json'), JSON.stringify(m));
const values = (tensors) => Object.fromEntries(Object.entries(tensors).map(([k, t]) => [k, Array.from(t.data)]));

test('concurrent steps run one after the other: the same as awaited one by one', async () => {
  const together = await loadTrainingFolder(FOLDER, OPTIONS);
  const oneByOne = await loadTrainingFolder(FOLDER, OPTIONS);
  const losses = await Promise.all([0, 1, 2, 3].map((i) => together.step(batch(i))));
  const expected = [];
  for (const i of [0, 1, 2, 3]) expected.push(await oneByOne.step(batch(i)));
  assert.deepEqual(losses, expected);
  assert.equal(together.iterations, 4);
  assert.equal(readSafetensors(together.exportState()).metadata.step, '4');
  assert.deepEqual(values(together.carried), values(oneByOne.carried));
  // a forEach(async ...) loop, then evaluate: it sees every step called before it
  [4, 5].forEach(async (i) => together.step(batch(i)));
  const { loss } = await together.evaluate(batch(0));
  for (const i of [4, 5]) await oneByOne.step(batch(i));
  assert.equal(loss, (await oneByOne.evaluate(batch(0))).loss);
  assert.equal(together.iterations, 6);
  // a failed call does not stop the ones after it
  const [bad, good] = await Promise.allSettled([together.step({ pixels: 1 }), together.step(batch(6))]);
  assert.equal(bad.status, 'rejected');
  assert.equal(good.value, await oneByOne.step(batch(6)));
  await together.release();
  await oneByOne.release();
});

const LR_MESSAGE = 'a finite number (a negative rate climbs the loss, an infinite or NaN one makes every parameter NaN)';

test('lr must be a finite number >= 0, given or from a schedule', async () => {
  for (const lr of [-0.01, NaN, Infinity]) {
    await assert.rejects(loadTrainingFolder(FOLDER, { ...OPTIONS, lr }), { message: `lr must be >= 0, got ${lr}: ${LR_MESSAGE}` });
  }
  await assert.rejects(loadTrainingFolder(FOLDER, { ...OPTIONS, lr: '0.01' }), { message: 'lr must be a number >= 0, got "0.01"' });
  const session = await loadTrainingFolder(FOLDER, { ...OPTIONS, lr: (step) => (step < 1 ? 0.01 : undefined) });
  const before = session.carried['fc1.weight'];
  await session.step(batch(0));
  await assert.rejects(session.step(batch(1)), {
    message: "lr must be a number >= 0, got undefined (the schedule's value at step 1)",
  });
  assert.equal(session.iterations, 1);
  assert.notEqual(session.carried['fc1.weight'], before);
  assert.ok(Array.from(session.carried['fc1.weight'].data).every(Number.isFinite));
  await assert.rejects(loadTrainingFolder(FOLDER, { ...OPTIONS, lr: () => NaN }), {
    message: `lr must be >= 0, got NaN (the schedule's value at step 0): ${LR_MESSAGE}`,
  });
  await session.release();
});

test('a batch with a NaN: the update is skipped and counted; an error at maxConsecutiveSkips in a row', async () => {
  assert.equal(MAX_CONSECUTIVE_SKIPS, 5);
  const session = await loadTrainingFolder(FOLDER, OPTIONS);
  await session.step(batch(0));
  const kept = values(session.carried);
  const poisoned = batch(1);
  poisoned.pixels.data[5] = NaN;
  assert.ok(Number.isNaN(await session.step(poisoned)));
  assert.equal(session.iterations, 1);
  assert.equal(session.skippedSteps, 1);
  assert.deepEqual(values(session.carried), kept, 'no update on a NaN loss');
  assert.ok(Number.isFinite(await session.step(batch(1))));
  assert.equal(session.iterations, 2);
  assert.equal(session.consecutiveSkips, 0);
  for (let k = 1; k < MAX_CONSECUTIVE_SKIPS; k++) assert.ok(Number.isNaN(await session.step(poisoned)));
  await assert.rejects(session.step(poisoned), {
    message:
      'the loss is NaN at update 2: the update was skipped, the parameters and optimizer state are unchanged (5 ' +
      'skipped in a row, the limit maxConsecutiveSkips=5). Check the batches for NaN and infinite values, or lower ' +
      'the learning rate',
  });
  assert.equal(session.skippedSteps, 6);
  assert.ok(Array.from(session.carried['fc1.weight'].data).every(Number.isFinite));
  const strict = await loadTrainingFolder(FOLDER, { ...OPTIONS, maxConsecutiveSkips: 1 });
  await assert.rejects(strict.step(poisoned), /\(1 skipped in a row, the limit maxConsecutiveSkips=1\)/);
  for (const limit of [0, 1.5, '5']) {
    await assert.rejects(loadTrainingFolder(FOLDER, { ...OPTIONS, maxConsecutiveSkips: limit }), {
      message: `maxConsecutiveSkips must be an integer >= 1, got ${typeof limit === 'string' ? `"${limit}"` : limit}`,
    });
  }
  await session.release();
  await strict.release();
});

test('class labels outside [0, C) are refused before the run, naming the value and its row', async () => {
  const session = await loadTrainingFolder(FOLDER, OPTIONS);
  for (const label of [10, -1]) {
    const b = batch(0);
    b.target[3] = BigInt(label);
    b.target[7] = 12n;
    const message =
      `batch input target holds class ${label} at row 3: class labels must lie in [0, 10); only ignore_index -100 ` +
      'may lie outside (2 such label(s))';
    await assert.rejects(session.step(b), { message });
    await assert.rejects(session.evaluate(b), { message });
  }
  assert.equal(session.iterations, 0);
  const b = batch(0);
  b.target[3] = -100n; // ignore_index: accepted
  assert.ok(Number.isFinite(await session.step(b)));
  await session.release();
});

/** Protobuf bytes of field `field` (length-delimited) holding `payload`. */
function lengthDelimited(field, payload) {
  const out = [field * 8 + 2];
  for (let n = payload.length; ; n = Math.floor(n / 128)) {
    out.push(n < 128 ? n : (n % 128) | 128);
    if (n < 128) break;
  }
  return Buffer.concat([Buffer.from(out), payload]);
}

test("the step graph's loss description (onnxgrad.loss metadata) says which labels to refuse", async () => {
  // what Python's add_loss records: the target's name, the class count (null: symbolic), the ignore_index
  const described = (spec) =>
    copyFolder((d) => {
      const entry = Buffer.concat([lengthDelimited(1, Buffer.from('onnxgrad.loss')), lengthDelimited(2, Buffer.from(JSON.stringify(spec)))]);
      const path = join(d, 'train_step.onnx');
      writeFileSync(path, Buffer.concat([readFileSync(path), lengthDelimited(14, entry)])); // ModelProto.metadata_props
    });
  const spec = { kind: 'cross_entropy', loss: 'loss', target: 'target', weight: null, reduction: 'mean', classes: 4, ignore_index: -1 };
  const session = await loadTrainingFolder(described(spec), OPTIONS);
  const b = batch(0);
  b.target.fill(1n);
  b.target[2] = -100n;
  await assert.rejects(session.step(b), {
    message: 'batch input target holds class -100 at row 2: class labels must lie in [0, 4); only ignore_index -1 may lie outside (1 such label(s))',
  });
  b.target[2] = -1n;
  b.target[5] = 4n;
  await assert.rejects(session.step(b), { message: /^batch input target holds class 4 at row 5: class labels must lie in \[0, 4\)/ });
  b.target[5] = 3n;
  b.target[2] = 1n; // (the graph itself ignores -100 only: the description above is made up)
  assert.ok(Number.isFinite(await session.step(b)));
  await session.release();
  const symbolic = await loadTrainingFolder(described({ ...spec, classes: null, ignore_index: null }), OPTIONS);
  b.target[5] = 50n; // the class count is unknown here: only negative labels are refused
  b.target[2] = 1n;
  assert.equal(typeof (await symbolic.step(b)), 'number');
  b.target[2] = -100n;
  await assert.rejects(symbolic.step(b), {
    message: 'batch input target holds class -100 at row 2: class labels must lie in [0, C) (1 such label(s))',
  });
  await symbolic.release();
});

test('unknown batch inputs are refused (the Python runner\'s rule)', async () => {
  const session = await loadTrainingFolder(FOLDER, OPTIONS);
  await assert.rejects(session.step({ ...batch(0), weights: new Float32Array(N) }), {
    message: 'unknown batch input(s) weights; this run takes pixels, target',
  });
  await assert.rejects(session.predict({ pixels: batch(0).pixels, pixel: batch(0).pixels }), {
    message: 'unknown batch input(s) pixel; this run takes pixels',
  });
  // the folder's target passed to predict is not unknown: a whole batch predicts
  const { logits } = await session.predict(batch(0));
  assert.deepEqual(logits.dims, [N, 10]);
  assert.equal(session.iterations, 0);
  await session.release();
});

test('a truncated state file: the error names the tensor and the file', async () => {
  const dir = copyFolder((d) => {
    const bytes = readFileSync(join(d, 'state.safetensors'));
    writeFileSync(join(d, 'state.safetensors'), bytes.subarray(0, bytes.length - 1));
  });
  await assert.rejects(loadTrainingFolder(dir, OPTIONS), (error) => {
    assert.match(error.message, /^state\.safetensors: tensor '[^']+' lies outside the file \(bytes \d+ to \d+ of \d+ after the header: truncated\?\)$/);
    return true;
  });
  assert.throws(() => readSafetensors(new Uint8Array([2, 0, 0, 0, 0, 0, 0, 0, 91, 93]), 'x.safetensors'), {
    message: 'x.safetensors is not a safetensors file: the header is not a JSON object',
  });
});

test('a manifest that does not fit the folder\'s files is refused when loading', async () => {
  // an SGD-like manifest (no exp_avg for fc1.weight) beside an AdamW step graph
  const dir = copyFolder((d) => {
    const m = manifestOf(d);
    delete m.train_step.feedback['next/exp_avg/fc1.weight'];
    m.train_step.inputs = m.train_step.inputs.filter((s) => s.name !== 'exp_avg/fc1.weight');
    m.train_step.outputs = m.train_step.outputs.filter((s) => s.name !== 'next/exp_avg/fc1.weight');
    m.optimizer_state = m.optimizer_state.filter((s) => s.name !== 'exp_avg/fc1.weight');
    writeManifest(d, m);
    const { tensors, metadata } = readSafetensors(readFileSync(join(d, 'state.safetensors')));
    delete tensors['exp_avg/fc1.weight'];
    writeFileSync(join(d, 'state.safetensors'), writeSafetensors(tensors, metadata));
  });
  await assert.rejects(loadTrainingFolder(dir, OPTIONS), {
    message:
      'train_step.onnx does not fit manifest.json: the model takes exp_avg/fc1.weight, which the manifest does not ' +
      'list (was the manifest copied from another folder?)',
  });
  // the CNN's manifest in the MLP's folder: the manifest is blamed (Python's rule), not the state
  const cnn = copyFolder((d) => cpSync(join(ROOT, 'cnn', 'artifacts', 'manifest.json'), join(d, 'manifest.json')));
  await assert.rejects(loadTrainingFolder(cnn, OPTIONS), /^Error: train_step\.onnx does not fit manifest\.json: .*\(was the manifest copied from another folder\?\)$/);
});

test('manifest paths stay inside the folder: no .., no absolute path, no link out', async () => {
  for (const path of ['../artifacts/train_step.onnx', '/etc/passwd', 'a//b.onnx', 'https://example.com/x.onnx']) {
    const dir = copyFolder((d) => writeManifest(d, { ...manifestOf(d), files: { ...manifestOf(d).files, train_step: path } }));
    await assert.rejects(loadTrainingFolder(dir, OPTIONS), {
      message: `manifest.json: files.train_step is ${JSON.stringify(path)}: a file of the folder must be a relative path inside it (no '..', no absolute path or URL)`,
    });
  }
  // a symbolic link, even to a file inside the folder (it could be changed to point out)
  const outside = join(scratch, 'outside.onnx');
  cpSync(join(FOLDER, 'train_step.onnx'), outside);
  for (const target of [outside, 'real.onnx']) {
    const linked = copyFolder((d) => {
      cpSync(join(d, 'train_step.onnx'), join(d, 'real.onnx'));
      rmSync(join(d, 'train_step.onnx'));
      symlinkSync(target, join(d, 'train_step.onnx'));
    });
    await assert.rejects(loadTrainingFolder(linked, OPTIONS), {
      message: `${join(linked, 'train_step.onnx')} is a symbolic link: refused, copy the file instead`,
    });
  }
  // a folder on the path that links out of the folder
  const sub = copyFolder((d) => {
    symlinkSync(scratch, join(d, 'sub'));
    writeManifest(d, { ...manifestOf(d), files: { ...manifestOf(d).files, train_step: 'sub/outside.onnx' } });
  });
  await assert.rejects(loadTrainingFolder(sub, OPTIONS), {
    message: `${join(sub, 'sub', 'outside.onnx')} leads to ${outside}, outside the folder ${sub}: a folder's files must lie inside it`,
  });
});

const STEP_RANGE = "not a whole number from 0 to 2**53 - 1 (JavaScript's exact integers) in decimal digits without leading zeros";

test('a state that does not fit the manifest is refused where it is read', async () => {
  const { tensors } = readSafetensors(await readFile(join(FOLDER, 'state.safetensors')));
  const cases = [
    [{ step: '-1' }, tensors, `the state option: its step (the updates already made) is "-1", ${STEP_RANGE}`],
    [{ step: 'nan' }, tensors, `the state option: its step (the updates already made) is "nan", ${STEP_RANGE}`],
    [{ step: String(2 ** 60) }, tensors, `the state option: its step (the updates already made) is "${2 ** 60}", ${STEP_RANGE}`],
    [
      { step: '0' },
      { ...tensors, extra: { type: 'float32', dims: [1], data: new Float32Array(1) } },
      'the state option holds extra, which the folder does not carry (the state of another folder?)',
    ],
    [
      { step: '0' },
      { ...tensors, 'fc1.bias': { type: 'float32', dims: [16], data: new Float32Array(16) } },
      "the state option: tensor 'fc1.bias' is float32 [16], the manifest says float32 [32]",
    ],
    [
      { step: '0' },
      { ...tensors, 'fc1.bias': { type: 'float64', dims: [32], data: new Float64Array(32) } },
      "the state option: tensor 'fc1.bias' is float64 [32], the manifest says float32 [32]",
    ],
    [
      { step: '0' },
      { ...tensors, 'exp_avg/fc2.bias': { type: 'float32', dims: [10], data: Float32Array.of(0, 0, Infinity, 0, 0, 0, 0, 0, 0, 0) } },
      "the state option: tensor 'exp_avg/fc2.bias' holds Infinity at index 2: a state must be finite",
    ],
  ];
  for (const [metadata, state, message] of cases) {
    await assert.rejects(loadTrainingFolder(FOLDER, { ...OPTIONS, state: writeSafetensors(state, metadata) }), { message });
  }
  const session = await loadTrainingFolder(FOLDER, { ...OPTIONS, state: writeSafetensors(tensors, { step: '7' }) });
  assert.equal(session.iterations, 7);
  await session.release();
});

test('a manifest that is not JSON, or lacks what the session reads, is a clear error', async () => {
  const broken = copyFolder((d) => writeFileSync(join(d, 'manifest.json'), '{"format": "onnxgrad.artifacts",'));
  await assert.rejects(loadTrainingFolder(broken, OPTIONS), /^Error: manifest\.json is not JSON: /);
  const partial = copyFolder((d) => {
    const m = manifestOf(d);
    delete m.eval_step;
    delete m.train_step.feedback;
    writeManifest(d, m);
  });
  await assert.rejects(loadTrainingFolder(partial, OPTIONS), { message: 'manifest.json lacks eval_step, train_step.feedback' });
});

// ---- the rules the Python runner holds (tests/artifacts/test_runner_inputs.py), one each ------------
test('a rate beyond float32 or a non-number is refused, as check_lr refuses it', async () => {
  await assert.rejects(loadTrainingFolder(FOLDER, { ...OPTIONS, lr: 1e39 }), {
    message: "lr must be at most 3.4028234663852886e+38 (float32's largest value), got 1e+39: a larger rate overflows the float32 update (every parameter inf or NaN)",
  });
  for (const lr of [true, '0.01']) {
    await assert.rejects(loadTrainingFolder(FOLDER, { ...OPTIONS, lr }), { message: `lr must be a number >= 0, got ${JSON.stringify(lr)}` });
  }
  const session = await loadTrainingFolder(FOLDER, { ...OPTIONS, lr: (step) => (step === 0 ? 0.01 : 1e39) });
  await session.step(batch(0));
  await assert.rejects(session.step(batch(1)), /^Error: lr must be at most 3\.4028234663852886e\+38 .*got 1e\+39 \(the schedule's value at step 1\)/);
  assert.equal(session.iterations, 1);
  await session.release();
  const bad = copyFolder((d) => writeManifest(d, { ...manifestOf(d), lr: { ...manifestOf(d).lr, default: 'fast' } }));
  await assert.rejects(loadTrainingFolder(bad, OPTIONS), { message: 'manifest.json is corrupt: lr.default is not a number' });
});

test('a state without its step, with a leading zero, a negative second moment or overlapping bytes is refused', async () => {
  const { tensors } = readSafetensors(await readFile(join(FOLDER, 'state.safetensors')));
  const missing = "the state option does not record its step (the updates already made: 'step' in its __metadata__)";
  for (const metadata of [undefined, { format: 'onnxgrad.artifacts' }]) {
    await assert.rejects(loadTrainingFolder(FOLDER, { ...OPTIONS, state: writeSafetensors(tensors, metadata) }), (e) => e.message.startsWith(missing));
  }
  await assert.rejects(loadTrainingFolder(FOLDER, { ...OPTIONS, state: writeSafetensors(tensors, { step: '007' }) }), {
    message: `the state option: its step (the updates already made) is "007", ${STEP_RANGE}`,
  });
  const sq = tensors['exp_avg_sq/fc2.bias'];
  const negative = { ...tensors, 'exp_avg_sq/fc2.bias': { ...sq, data: sq.data.map((v, i) => (i === 1 ? -1 : v)) } };
  await assert.rejects(loadTrainingFolder(FOLDER, { ...OPTIONS, state: writeSafetensors(negative, { step: '3' }) }), {
    message: "the state option: tensor 'exp_avg_sq/fc2.bias' holds 1 negative values, which a second moment (a mean of squares) never holds: a state that would make its parameter NaN",
  });
  const m = tensors['exp_avg/fc2.bias']; // a first moment may be negative
  const fine = { ...tensors, 'exp_avg/fc2.bias': { ...m, data: m.data.map(() => -1) } };
  const session = await loadTrainingFolder(FOLDER, { ...OPTIONS, state: writeSafetensors(fine, { step: '3' }) });
  await session.release();
  // safetensors bytes: trailing bytes, then two tensors sharing bytes (the length kept)
  const bytes = writeSafetensors(tensors, { step: '0' });
  const longer = new Uint8Array(bytes.length + 16);
  longer.set(bytes);
  await assert.rejects(loadTrainingFolder(FOLDER, { ...OPTIONS, state: longer }), { message: 'the state option has 16 bytes after its last tensor: not a safetensors file' });
  const n = Number(new DataView(bytes.buffer).getBigUint64(0, true));
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + n)));
  header['exp_avg_sq/fc2.bias'].data_offsets = [...header['exp_avg/fc2.bias'].data_offsets];
  const text = new TextEncoder().encode(JSON.stringify(header));
  const overlapping = new Uint8Array(8 + text.length + bytes.length - 8 - n);
  new DataView(overlapping.buffer).setBigUint64(0, BigInt(text.length), true);
  overlapping.set(text, 8);
  overlapping.set(bytes.subarray(8 + n), 8 + text.length);
  await assert.rejects(loadTrainingFolder(FOLDER, { ...OPTIONS, state: overlapping }), /^Error: the state option: tensor '.*' \(bytes \d+ to \d+\) (overlaps the tensor before it|leaves bytes)/);
});

test('a step count that cannot advance is refused, and the state still exports', async () => {
  const { tensors } = readSafetensors(await readFile(join(FOLDER, 'state.safetensors')));
  const last = String(Number.MAX_SAFE_INTEGER - 1);
  const session = await loadTrainingFolder(FOLDER, { ...OPTIONS, state: writeSafetensors(tensors, { step: last }) });
  await session.step(batch(0));
  assert.equal(session.iterations, Number.MAX_SAFE_INTEGER);
  await assert.rejects(session.step(batch(1)), /^Error: the step count is 9007199254740991, the largest JavaScript counts exactly/);
  assert.equal(session.iterations, Number.MAX_SAFE_INTEGER);
  const again = await loadTrainingFolder(FOLDER, { ...OPTIONS, state: session.exportState() });
  assert.equal(again.iterations, Number.MAX_SAFE_INTEGER);
  await Promise.all([session.release(), again.release()]);
});

test('the manifest is checked against the step graph: version, optimizer, batch dtypes, every file', async () => {
  const edited = (change) =>
    copyFolder((d) => {
      const m = manifestOf(d);
      change(m);
      writeManifest(d, m);
    });
  await assert.rejects(loadTrainingFolder(edited((m) => (m.version = 2)), OPTIONS), {
    message: 'manifest.json is corrupt: its version is 2; this onnxgrad reads version 1',
  });
  for (const change of [(m) => (m.optimizer.betas = [1.5, 0.999]), (m) => (m.optimizer.name = 'sgd'), (m) => (m.optimizer.name = 'adam')]) {
    await assert.rejects(loadTrainingFolder(edited(change), OPTIONS), /^Error: train_step\.onnx does not fit manifest\.json: the step updates with \{"name":"adamw".*\(was the manifest copied from another folder\?\)$/);
  }
  await assert.rejects(loadTrainingFolder(edited((m) => (m.batch.find((s) => s.name === 'target').dtype = 'int32')), OPTIONS), {
    message: 'train_step.onnx does not fit manifest.json: batch input target is int64, the manifest says int32',
  });
  await assert.rejects(loadTrainingFolder(edited((m) => (m.parameters.find((s) => s.name === 'fc1.bias').shape = [31])), OPTIONS), {
    message: 'train_step.onnx does not fit manifest.json: input fc1.bias is float32 [32], the manifest says float32 [31]',
  });
  await assert.rejects(loadTrainingFolder(edited((m) => (m.files.manifest = '../other/manifest.json')), OPTIONS), {
    message: `manifest.json: files.manifest is "../other/manifest.json": a file of the folder must be a relative path inside it (no '..', no absolute path or URL)`,
  });
});

test('a missing folder or file, or a folder named as a file, says so in Python\'s words', async () => {
  const nowhere = join(scratch, 'nowhere');
  await assert.rejects(loadTrainingFolder(nowhere, OPTIONS), { message: `the artifacts folder ${JSON.stringify(nowhere)} does not exist` });
  const noState = copyFolder((d) => rmSync(join(d, 'state.safetensors')));
  await assert.rejects(loadTrainingFolder(noState, OPTIONS), { message: `"state.safetensors" does not exist in ${JSON.stringify(noState)} as a file` });
  const dot = copyFolder((d) => writeManifest(d, { ...manifestOf(d), files: { ...manifestOf(d).files, state: '.' } }));
  await assert.rejects(loadTrainingFolder(dot, OPTIONS), { message: `"." does not exist in ${JSON.stringify(dot)} as a file` });
});

test('a batch the loss counts no row of is a skipped step, as in Python', async () => {
  const session = await loadTrainingFolder(FOLDER, OPTIONS);
  const before = values(session.carried);
  const empty = { pixels: new ort.Tensor('float32', new Float32Array(0), [0, 64]), target: new BigInt64Array(0) };
  const ignored = { ...batch(0), target: new BigInt64Array(N).fill(-100n) }; // the fixture's ignore_index
  for (let k = 0; k < 2 * MAX_CONSECUTIVE_SKIPS; k++) {
    for (const b of [empty, ignored]) assert.ok(Number.isNaN(await session.step(b)));
  }
  assert.equal(session.iterations, 0);
  assert.equal(session.consecutiveSkips, 0);
  assert.equal(session.skippedSteps, 4 * MAX_CONSECUTIVE_SKIPS);
  assert.deepEqual(values(session.carried), before);
  const partly = { ...batch(0), target: batch(0).target.map((v, i) => (i % 2 ? -100n : v)) };
  assert.ok(Number.isFinite(await session.step(partly)));
  assert.equal(session.iterations, 1);
  await session.release();
});

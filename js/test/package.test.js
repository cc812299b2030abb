// The package as another project gets it: `npm pack`, the tarball installed into a fresh temporary
// project with nothing copied from this repository (no .npmrc), then onnxruntime-node from the
// registry as its peer (ONNXRUNTIME_NODE_INSTALL=skip, as the README says: no download from
// outside the registry), a few training steps through the package's names (js/consumer/usage.mjs)
// against the Python runner's losses, and `tsc --noEmit` of js/consumer/usage.ts through the
// declarations of package.json `exports`. Needs the registry (or an npm cache holding
// onnxruntime-node) and the fixture of make_fixture.py. ONNXGRAD_JS_KEEP=1 keeps the project.
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { cpSync, existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';

const run = promisify(execFile);
const PACKAGE = fileURLToPath(new URL('..', import.meta.url));
const CONSUMER = fileURLToPath(new URL('../consumer/', import.meta.url));
const FIXTURE = process.env.ONNXGRAD_JS_FIXTURE ?? fileURLToPath(new URL('./fixture/', import.meta.url));
const TSC = join(PACKAGE, 'node_modules', 'typescript', 'bin', 'tsc');
const ORT_VERSION = JSON.parse(readFileSync(join(PACKAGE, 'node_modules', 'onnxruntime-node', 'package.json'), 'utf8')).version;
const STEPS = 5;
const RTOL = 1e-4;

// What `npm test` or this repository's .npmrc would pass down: the consumer gets none of it.
const INHERITED = /^(npm_(package|lifecycle|config_(local_prefix|prefix|onnxruntime))|ONNXRUNTIME_NODE_INSTALL)/i;
const cleanEnv = Object.fromEntries(Object.entries(process.env).filter(([k]) => !INHERITED.test(k)));

let project;
let packed;

/** Runs `command args` in the consumer project; resolves to {stdout, stderr}, with both in the error. */
async function sh(command, args, env = {}) {
  try {
    return await run(command, args, { cwd: project, env: { ...cleanEnv, ...env }, maxBuffer: 1 << 24 });
  } catch (error) {
    throw new Error(`${command} ${args.join(' ')} failed (${error.code}):\n${error.stdout}\n${error.stderr}`);
  }
}

before(async () => {
  if (!existsSync(join(FIXTURE, 'expected.json'))) throw new Error(`no fixture in ${FIXTURE}: run python js/test/make_fixture.py ${FIXTURE}`);
  project = mkdtempSync(join(tmpdir(), 'onnxgrad-consumer-'));
  const { stdout } = await run('npm', ['pack', '--json', '--pack-destination', project], { cwd: PACKAGE, env: cleanEnv });
  [packed] = JSON.parse(stdout);
  writeFileSync(join(project, 'package.json'), JSON.stringify({ name: 'consumer', private: true, type: 'module' }));
  for (const file of ['usage.mjs', 'usage.ts', 'tsconfig.json', 'tsconfig.bundler.json']) cpSync(join(CONSUMER, file), join(project, file));
});

after(() => {
  if (project && !process.env.ONNXGRAD_JS_KEEP) rmSync(project, { recursive: true, force: true });
});

test('the tarball holds the sources, README and package.json, and a declaration for each entry point', () => {
  const files = packed.files.map((f) => f.path).sort();
  const sources = readdirSync(join(PACKAGE, 'src')).map((f) => `src/${f}`);
  assert.deepEqual(files, ['README.md', 'package.json', ...sources].sort());
  const { exports } = JSON.parse(readFileSync(join(PACKAGE, 'package.json'), 'utf8'));
  for (const [entry, target] of Object.entries(exports)) {
    if (entry === './package.json') continue;
    assert.deepEqual(Object.keys(target), ['types', 'default'], `${entry}: types first, then default`);
    assert.ok(files.includes(target.types.replace('./', '')), `${entry}: ${target.types} is not in the tarball`);
    assert.ok(files.includes(target.default.replace('./', '')), `${entry}: ${target.default} is not in the tarball`);
  }
  assert.ok('./node' in exports && '.' in exports);
});

test('a fresh project installs the tarball, then onnxruntime-node, trains and type-checks', { timeout: 600_000 }, async (t) => {
  const modules = join(project, 'node_modules');
  await t.test('the tarball alone brings no runtime: the browser entry loads, the Node entry names its peer', async () => {
    await sh('npm', ['install', '--no-audit', '--no-fund', join(project, packed.filename)]);
    assert.ok(existsSync(join(modules, 'onnxgrad-artifacts', 'src', 'index.d.ts')));
    assert.ok(!existsSync(join(modules, 'onnxruntime-node')), 'onnxruntime-node installed with the package');
    assert.ok(!existsSync(join(modules, 'onnxruntime-web')), 'onnxruntime-web installed with the package');
    const names = "const m = await import('onnxgrad-artifacts'); console.log(Object.keys(m).join(' '))";
    const { stdout } = await sh('node', ['--input-type=module', '-e', names]);
    for (const name of ['FORMAT', 'TrainingSession', 'readSafetensors', 'writeSafetensors']) {
      assert.ok(stdout.trim().split(' ').includes(name), `onnxgrad-artifacts exports ${stdout.trim()}, not ${name}`);
    }
    await assert.rejects(
      sh('node', ['--input-type=module', '-e', "await import('onnxgrad-artifacts/node')"]),
      new RegExp(
        'onnxgrad-artifacts/node needs onnxruntime-node, a peer dependency: install it next to onnxgrad-artifacts ' +
          '\\(ONNXRUNTIME_NODE_INSTALL=skip npm install onnxruntime-node\\)',
      ),
    );
  });

  await t.test('onnxruntime-node from the registry, its optional download skipped', async () => {
    const args = ['install', '--no-audit', '--no-fund', '--prefer-offline', `onnxruntime-node@${ORT_VERSION}`];
    await sh('npm', args, { ONNXRUNTIME_NODE_INSTALL: 'skip' });
    const installed = JSON.parse(readFileSync(join(modules, 'onnxruntime-node', 'package.json'), 'utf8'));
    assert.equal(installed.version, ORT_VERSION);
  });

  await t.test(`${STEPS} steps through the installed package give the Python runner's losses`, async () => {
    const { stdout } = await sh('node', ['usage.mjs', FIXTURE, String(STEPS)]);
    const result = JSON.parse(stdout.trim().split('\n').at(-1));
    assert.equal(fileURLToPath(result.resolved), join(modules, 'onnxgrad-artifacts', 'src', 'node.js'));
    const expected = JSON.parse(readFileSync(join(FIXTURE, 'expected.json'), 'utf8')).losses.slice(0, STEPS);
    assert.equal(result.losses.length, STEPS);
    result.losses.forEach((loss, k) => {
      assert.ok(Math.abs(loss - expected[k]) <= 1e-6 + RTOL * Math.abs(expected[k]), `step ${k}: loss ${loss}, Python ${expected[k]}`);
    });
    assert.equal(result.genericLoss, result.losses[0]);
    assert.equal(
      result.shapeError,
      'batch input pixels has shape [2016] (a flat array), the model expects [N, 64]: 2016 values are not a whole number of 64-value rows',
    );
  });

  for (const config of ['tsconfig.json', 'tsconfig.bundler.json']) {
    await t.test(`tsc --noEmit -p ${config} compiles usage.ts against the declarations`, async () => {
      await sh(process.execPath, [TSC, '--noEmit', '-p', config]);
    });
  }
});

// Node entry point: TrainingSession on onnxruntime-node, files read from a folder.
// onnxruntime-node is a peer dependency: the project that uses this entry installs it (see README).
import { lstat, readFile, realpath, stat } from 'node:fs/promises';
import { join, relative, isAbsolute, sep } from 'node:path';
import { TrainingSession } from './index.js';

const ort = await import('onnxruntime-node').catch((error) => {
  if (error?.code === 'ERR_MODULE_NOT_FOUND' && String(error.message).includes("'onnxruntime-node'")) {
    throw new Error(
      "onnxgrad-artifacts/node needs onnxruntime-node, a peer dependency: install it next to onnxgrad-artifacts " +
        '(ONNXRUNTIME_NODE_INSTALL=skip npm install onnxruntime-node); in the browser, import onnxgrad-artifacts ' +
        'with onnxruntime-web instead',
      { cause: error },
    );
  }
  throw error;
});

export * from './index.js';
export { ort };

/**
 * The bytes of the file `name` of the folder `dir`, held to the Python runner's rules (those of a
 * model's external data): a regular file, not a symbolic link (even to a file inside the folder: it
 * could be changed to point out), inside the folder once links in its path are resolved.
 */
async function readInside(dir, name) {
  const path = join(dir, name);
  const missing = () => new Error(`${JSON.stringify(name)} does not exist in ${JSON.stringify(dir)} as a file`); // Python's words
  const info = await lstat(path).catch((error) => {
    throw error?.code === 'ENOENT' || error?.code === 'ENOTDIR' ? missing() : error;
  });
  if (info.isSymbolicLink()) throw new Error(`${path} is a symbolic link: refused, copy the file instead`);
  if (!info.isFile()) throw missing(); // a folder ('.'), a device, a pipe
  const [root, target] = await Promise.all([realpath(dir), realpath(path)]);
  const rel = relative(root, target);
  if (!rel || rel === '..' || rel.startsWith(`..${sep}`) || isAbsolute(rel)) {
    throw new Error(`${path} leads to ${target}, outside the folder ${dir}: a folder's files must lie inside it`);
  }
  return readFile(target);
}

/** A TrainingSession on the artifacts folder `dir` (written by `onnxgrad artifacts`). */
export async function loadTrainingFolder(dir, options = {}) {
  const info = await stat(dir).catch(() => null);
  if (!info?.isDirectory()) throw new Error(`the artifacts folder ${JSON.stringify(dir)} does not exist`);
  return TrainingSession.create(ort, (name) => readInside(dir, name), options);
}

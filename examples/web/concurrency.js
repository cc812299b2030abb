// Steps called at once run one after the other (the TrainingSession queues them): four steps under
// Promise.all and the same four awaited one by one, each on a fresh session, end with the same losses,
// parameters, optimizer state and step count. Runs in the browser (main.js) and in Node
// (test-web.mjs); check() is test-web.mjs's verdict on the result.
import { readSafetensors } from '../../js/src/index.js';

/** `create()` gives a fresh session, `batchAt(k)` batch k: {losses, sequential, same, iterations, step}. */
export async function concurrentSteps(create, batchAt) {
  const together = await create();
  const oneByOne = await create();
  const losses = await Promise.all([0, 1, 2, 3].map((k) => together.step(batchAt(k))));
  const sequential = [];
  for (const k of [0, 1, 2, 3]) sequential.push(await oneByOne.step(batchAt(k)));
  const same = Object.entries(oneByOne.carried).every(([name, t]) => {
    const other = together.carried[name].data;
    return t.data.length === other.length && t.data.every((v, i) => Object.is(v, other[i]));
  });
  const { step } = readSafetensors(together.exportState()).metadata;
  const result = { losses, sequential, same, iterations: together.iterations, step };
  await together.release();
  await oneByOne.release();
  return result;
}

/** An Error unless the concurrent steps equal the sequential ones; logs the verdict. */
export function check(result, where) {
  const { losses, sequential, same, iterations, step } = result;
  if (losses.some((l, k) => l !== sequential[k]) || !same || iterations !== 4 || step !== '4') {
    throw new Error(`${where}: 4 concurrent steps differ from 4 sequential ones: ${JSON.stringify(result)}`);
  }
  console.log(`${where}: 4 steps under Promise.all equal 4 steps awaited one by one (losses, state, step 4)`);
}

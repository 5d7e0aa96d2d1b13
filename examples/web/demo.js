// The demo's training run, without the page: the digits data, the batches, the accuracy.
// The page (main.js) and the browser test's Node run (test/browser.mjs) both train with it,
// so the two runs see the same batches in the same order (python/trainops/demos/serve.py's
// `batch` takes the same slices for the Python reference).

/** The digits served under `base` (`digits.json` + `digits.bin`, serve.py's write_data). */
export async function loadData(base) {
  const get = async (name) => {
    const r = await fetch(new URL(name, base));
    if (!r.ok) throw new Error(`${new URL(name, base)}: HTTP ${r.status}`);
    return r;
  };
  const meta = await (await get("digits.json")).json();
  const bytes = await (await get("digits.bin")).arrayBuffer();
  const pixels = meta.shape.reduce((a, b) => a * b, 1);
  const o = meta.offsets;
  return {
    meta, pixels,
    xTrain: new Float32Array(bytes, o.x_train, meta.train * pixels),
    xTest: new Float32Array(bytes, o.x_test, meta.test * pixels),
    order: new Uint16Array(bytes, o.order, meta.order),
    tTrain: new Uint8Array(bytes, o.t_train, meta.train),
    tTest: new Uint8Array(bytes, o.t_test, meta.test),
  };
}

/** Step `step`'s batch (1-based): the images order[(step - 1) * batch ...] (serve.py's
 * `order`: `python -m trainops demo`'s shuffles), the order repeating when outrun. */
export function batchAt(data, step) {
  const { batch } = data.meta;
  const x = new Float32Array(batch * data.pixels);
  const t = new BigInt64Array(batch);
  const start = ((step - 1) * batch) % data.order.length;
  for (let i = 0; i < batch; i++) {
    const k = data.order[start + i];
    x.set(data.xTrain.subarray(k * data.pixels, (k + 1) * data.pixels), i * data.pixels);
    t[i] = BigInt(data.tTrain[k]);
  }
  return { x, t };
}

/** ort.Tensor feeds of `images` (Float32Array of n images) and optional int64 labels. */
export function feeds(ort, data, x, t) {
  const n = x.length / data.pixels;
  const f = { x: new ort.Tensor("float32", x, [n, ...data.meta.shape]) };
  if (t) f.t = new ort.Tensor("int64", t, [n]);
  return f;
}

/** The predicted class of each row of `logits` (an ort.Tensor [n, classes]). */
export function argmax(logits) {
  const [n, c] = logits.dims;
  const out = new Uint8Array(n);
  for (let i = 0; i < n; i++) {
    let best = 0;
    for (let j = 1; j < c; j++) if (logits.data[i * c + j] > logits.data[i * c + best]) best = j;
    out[i] = best;
  }
  return out;
}

/** Test accuracy of `trainer` on the held-out digits (eval.onnx, labels not fed). */
export async function testAccuracy(ort, trainer, data) {
  const out = await trainer.eval(feeds(ort, data, data.xTest));
  const pred = argmax(out.logits);
  let right = 0;
  for (let i = 0; i < pred.length; i++) right += pred[i] === data.tTest[i] ? 1 : 0;
  return right / pred.length;
}

/**
 * Train `steps` steps from the artifacts at `base + "artifacts/"` on the digits at
 * `base + "data/"`; `onStep(step, loss)` after each step, `onAccuracy(step, acc)` every
 * `every` steps (and at the first and last), `shouldStop()` checked before each step.
 * @returns {Promise<{trainer, data, losses: number[], accuracies: [number, number][]}>}
 */
export async function train({ ort, Trainer, base, executionProviders, steps, every = 25,
                             onStep = () => {}, onAccuracy = () => {}, shouldStop = () => false,
                             trainer = null, data = null, first = 1 }) {
  data ??= await loadData(new URL("data/", base));
  trainer ??= await Trainer.fromArtifacts(new URL("artifacts/", base).href,
                                          { ort, executionProviders, intraOpNumThreads: 1 });
  const losses = [];
  const accuracies = [];
  const last = first + steps - 1;
  for (let step = first; step <= last; step++) {
    if (shouldStop()) break;
    const { x, t } = batchAt(data, step);
    const loss = await trainer.step(feeds(ort, data, x, t));
    losses.push(loss);
    await onStep(step, loss);
    if (every && (step === 1 || step % every === 0 || step === last)) {
      const acc = await testAccuracy(ort, trainer, data);
      accuracies.push([step, acc]);
      await onAccuracy(step, acc);
    }
  }
  return { trainer, data, losses, accuracies };
}

// onnxruntime-web's WASM backend (run in Node.js, one thread) on the demo CNN against Python's
// portable Trainer on the CPU EP: the 20 losses within a stated bound, not bit for bit: the
// WASM build's MLAS kernels (128-bit SIMD) block and order the convolutions' and products'
// sums differently from the x86 build's AVX ones. Writes the losses to
// .reference/demo_cnn_wasm_losses.json for the browser test (examples/web) to compare with.
import { test } from "node:test";
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import path from "node:path";
import * as ort from "onnxruntime-web";
import { Trainer } from "../src/index.js";
import { REFERENCE, RELATIVE_BOUND, artifacts, batches, pythonRun, requireReference } from "./helpers.mjs";

requireReference();

test("onnxruntime-web (WASM) trains the demo CNN as Python does, within the bound", async () => {
  const ref = pythonRun("demo_cnn");
  const data = batches(ort, "demo_cnn");
  const trainer = await Trainer.fromArtifacts(artifacts("demo_cnn"), { ort, executionProviders: ["wasm"], intraOpNumThreads: 1 });
  const losses = [];
  for (const feeds of data) losses.push(await trainer.step(feeds));
  const abs = losses.map((l, i) => Math.abs(l - ref.losses[i]));
  const rel = abs.map((d, i) => d / Math.abs(ref.losses[i]));
  const maxAbs = Math.max(...abs);
  const maxRel = Math.max(...rel);
  writeFileSync(path.join(REFERENCE, "demo_cnn_wasm_losses.json"), JSON.stringify({
    what: "the demo CNN (trainops.demos.train.cnn_model(0)), Adam(lr=0.01), portable artifacts, " +
      "20 steps on the first 20 batches of 64 of `python -m trainops demo` (digits(4096, seed=0), " +
      "numpy default_rng(2).permutation(4096)); losses of onnxruntime-web's WASM backend in Node.js " +
      "(one thread) and of Python's portable Trainer (CPU EP, one thread)",
    onnxruntime_web: ort.env.versions.web,
    wasm: losses, python: ref.losses, max_abs_diff: maxAbs, max_rel_diff: maxRel, relative_bound: RELATIVE_BOUND,
  }, null, 1) + "\n");
  console.log(`# WASM vs Python, demo CNN, 20 steps: max |diff| ${maxAbs.toExponential(2)}, max relative ${maxRel.toExponential(2)} (bound ${RELATIVE_BOUND})`);
  rel.forEach((r, i) => assert.ok(r <= RELATIVE_BOUND, `step ${i}: wasm ${losses[i]}, Python ${ref.losses[i]}`));
  assert.ok(losses.slice(-5).reduce((a, b) => a + b) < 0.75 * 5 * losses[0], "the loss falls");
  assert.equal(trainer.T, 21n);
});

// onnxruntime-node's WebGPU EP (bundled on Linux x64) where a WebGPU adapter exists: scripts/test_js
// sets TRAINOPS_JS_WEBGPU=1 when Mesa's lavapipe from scripts/webgpu_env is there (a software
// Vulkan driver: no GPU needed). The demo CNN's 20 losses against Python's portable Trainer
// (CPU EP) within the bound of helpers.mjs (RELATIVE_BOUND); the states kept in GPU buffers between steps
// (statesOnGpu) give the same bits as the states fed from the CPU (the same kernels), and
// eval.onnx runs on them.
import { test } from "node:test";
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import path from "node:path";
import * as ort from "onnxruntime-node";
import { Trainer } from "../src/index.js";
import { REFERENCE, RELATIVE_BOUND, artifacts, batches, pythonRun, f32bits, requireReference } from "./helpers.mjs";

requireReference();
const skip = process.env.TRAINOPS_JS_WEBGPU === "1" ? false :
  "TRAINOPS_JS_WEBGPU is not 1 (scripts/test_js sets it where scripts/webgpu_env's lavapipe is)";

async function run(statesOnGpu) {
  const trainer = await Trainer.fromArtifacts(artifacts("demo_cnn"), { ort, executionProviders: ["webgpu"], statesOnGpu });
  const data = batches(ort, "demo_cnn");
  const losses = [];
  for (const feeds of data) losses.push(await trainer.step(feeds));
  return { trainer, losses, evalLoss: (await trainer.eval(data[0])).loss.data[0] };
}

test("onnxruntime-node's WebGPU EP trains the demo CNN as Python does, within the bound", { skip }, async () => {
  const ref = pythonRun("demo_cnn");
  const cpu = await run(false);
  assert.equal(cpu.trainer.statesOnGpu, false, "not by default on onnxruntime-node");
  const rel = cpu.losses.map((l, i) => Math.abs(l - ref.losses[i]) / Math.abs(ref.losses[i]));
  const maxRel = Math.max(...rel);
  writeFileSync(path.join(REFERENCE, "demo_cnn_webgpu_node_losses.json"), JSON.stringify({
    what: "demo_cnn_wasm_losses.json's run on onnxruntime-node's WebGPU EP (states fed from the CPU)",
    onnxruntime_node: ort.env.versions.node, webgpu: cpu.losses, python: ref.losses, max_rel_diff: maxRel,
    relative_bound: RELATIVE_BOUND }, null, 1) + "\n");
  console.log(`# WebGPU (onnxruntime-node) vs Python, demo CNN, 20 steps: max relative ${maxRel.toExponential(2)} (bound ${RELATIVE_BOUND})`);
  rel.forEach((r, i) => assert.ok(r <= RELATIVE_BOUND, `step ${i}: webgpu ${cpu.losses[i]}, Python ${ref.losses[i]}`));

  const gpu = await run(true);
  assert.equal(gpu.trainer.statesOnGpu, true);
  assert.equal(gpu.trainer.state.get("conv1.w").location, "gpu-buffer");
  assert.deepEqual(gpu.losses.map(f32bits), cpu.losses.map(f32bits), "states in GPU buffers: the same bits");
  assert.equal(f32bits(gpu.evalLoss), f32bits(cpu.evalLoss));
  assert.throws(() => gpu.trainer.getParameters(), /Trainer\.getParameters: the state "conv1\.w" is in GPU memory: await trainer\.download\(\) first/);
  await assert.rejects(gpu.trainer.download(), /Trainer\.download: onnxruntime-node 1\.\d+\.\d+ cannot read a GPU tensor back/);
});

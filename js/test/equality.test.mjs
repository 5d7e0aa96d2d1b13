// onnxruntime-node on the CPU, one thread, against Python's portable Trainer (the same
// onnxruntime version, one thread; make_reference.py): the 20 losses, T, the skipped count and
// the checkpoints after 10 and 20 steps, every bit; and checkpoints crossing between the two
// both ways (Python's after 10 steps resumed here; this trainer's resumed by Python's
// Trainer.from_artifacts), the resumed runs equal bit for bit.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, writeFileSync, mkdtempSync, cpSync, rmSync, readdirSync } from "node:fs";
import { execFileSync } from "node:child_process";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import * as ort from "onnxruntime-node";
import { Trainer, readSafetensors } from "../src/index.js";
import { CASES, REFERENCE, artifacts, batches, file, pythonRun, f32bits, differingTensors, requireReference } from "./helpers.mjs";

requireReference();
const versions = JSON.parse(readFileSync(path.join(REFERENCE, "versions.json"), "utf8"));
const OPTIONS = { ort, executionProviders: ["cpu"], intraOpNumThreads: 1 };
const read = (f) => new Uint8Array(readFileSync(f));
// Dropout masks come from onnxruntime's Dropout kernel, seeded per session and run: a resumed
// run (a new session) draws other masks than the uninterrupted one (docs/artifacts.md).
const RESUMES_AS_UNINTERRUPTED = (name) => name !== "dropout";

test("the reference was made with this onnxruntime-node's version", () => {
  assert.equal(ort.env.versions.node, versions.onnxruntime);
});

for (const name of CASES) {
  test(`${name}: 20 steps equal Python's portable Trainer bit for bit`, async () => {
    const ref = pythonRun(name);
    const data = batches(ort, name);
    const trainer = await Trainer.fromArtifacts(artifacts(name), OPTIONS);
    for (let i = 0; i < data.length; i++) {
      const loss = await trainer.step(data[i]);
      assert.equal(f32bits(loss), ref.loss_bits[i], `step ${i}: loss ${loss}, Python's ${ref.losses[i]}`);
      if (i === 9) assert.deepEqual(trainer.saveCheckpoint(), read(file(name, "after10.safetensors")));
    }
    assert.equal(trainer.T, BigInt(ref.T));
    assert.equal(trainer.skipped, BigInt(ref.skipped));
    const mine = trainer.saveCheckpoint();
    const python = read(file(name, "after20.safetensors"));
    assert.deepEqual(differingTensors(mine, python), []);
    assert.deepEqual(readSafetensors(mine).metadata, readSafetensors(python).metadata);
    assert.deepEqual(mine, python, "the checkpoint files, byte for byte");
    if (name === "mixed") assert.ok(ref.skipped > 0 && ref.skipped < 20, "steps were skipped");
    await trainer.release();
  });

  test(`${name}: a checkpoint crosses between Python and JavaScript both ways`, async (t) => {
    const python = process.env.TRAINOPS_JS_PYTHON;
    const data = batches(ort, name);
    const ref = pythonRun(name);
    // Python's checkpoint after 10 steps, resumed here (files given as a map of bytes)
    const dir = artifacts(name);
    const files = Object.fromEntries(readdirSync(dir).map((f) => [f, read(path.join(dir, f))]));
    files["checkpoint.safetensors"] = read(file(name, "after10.safetensors"));
    const resumed = await Trainer.fromArtifacts(files, OPTIONS);
    const meta = readSafetensors(files["checkpoint.safetensors"]).metadata;
    assert.equal(resumed.T, 11n - BigInt(meta.skipped));
    assert.equal(resumed.skipped, BigInt(meta.skipped));
    const losses = [];
    for (let i = 10; i < 20; i++) losses.push(await resumed.step(data[i]));
    const jsResumed = resumed.saveCheckpoint();
    if (RESUMES_AS_UNINTERRUPTED(name)) {
      assert.deepEqual(losses.map(f32bits), ref.loss_bits.slice(10));
      assert.deepEqual(jsResumed, read(file(name, "after20.safetensors")));
    }
    if (!python) {
      t.skip("TRAINOPS_JS_PYTHON is not set: the Python half (scripts/test_js sets it)");
      return;
    }
    // this trainer's own checkpoint after 10 steps, resumed by Python's Trainer.from_artifacts
    const mine = await Trainer.fromArtifacts(dir, OPTIONS);
    for (let i = 0; i < 10; i++) await mine.step(data[i]);
    const tmp = mkdtempSync(path.join(tmpdir(), "trainops-js-"));
    try {
      cpSync(dir, path.join(tmp, "artifacts"), { recursive: true });
      writeFileSync(path.join(tmp, "artifacts", "checkpoint.safetensors"), mine.saveCheckpoint());
      execFileSync(python, [fileURLToPath(new URL("make_reference.py", import.meta.url)), "resume", path.join(tmp, "artifacts"),
        file(name, "batches.safetensors"), "10", "10", path.join(tmp, "out")], { stdio: ["ignore", "inherit", "inherit"] });
      const py = JSON.parse(readFileSync(path.join(tmp, "out", "python.json"), "utf8"));
      assert.deepEqual(py.loss_bits, losses.map(f32bits), "Python resumed this trainer's checkpoint as this trainer resumed Python's");
      assert.deepEqual(read(path.join(tmp, "out", "checkpoint.safetensors")), jsResumed);
    } finally {
      rmSync(tmp, { recursive: true, force: true });
    }
  });
}

// The trainer's API beyond the steps: where the artifacts come from (a folder, a file: URL,
// an http: URL through fetch, a map of bytes), eval.onnx, get/setParameters, and what it
// refuses (a manifest that is not portable, a missing file, a wrong feed, a corrupt
// checkpoint), each with an error naming the file or the feed and the key, and nothing
// half-applied: a refused step leaves the trainer as it was.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { createServer } from "node:http";
import { pathToFileURL } from "node:url";
import path from "node:path";
import * as ort from "onnxruntime-node";
import { Trainer, ArtifactsError, readSafetensors, writeSafetensors } from "../src/index.js";
import { REFERENCE, artifacts, batches, pythonRun, f32bits, requireReference } from "./helpers.mjs";

requireReference();
const OPTIONS = { ort, executionProviders: ["cpu"], intraOpNumThreads: 1 };
const filesOf = (dir) => Object.fromEntries(readdirSync(dir).map((f) => [f, new Uint8Array(readFileSync(path.join(dir, f)))]));
const manifestWith = (files, change) => {
  const m = JSON.parse(new TextDecoder().decode(files["manifest.json"]));
  change(m);
  return { ...files, "manifest.json": new TextEncoder().encode(JSON.stringify(m)) };
};

async function firstLosses(source, n = 3, name = "mlp") {
  const trainer = await Trainer.fromArtifacts(source, OPTIONS);
  const data = batches(ort, name);
  const out = [];
  for (let i = 0; i < n; i++) out.push(f32bits(await trainer.step(data[i])));
  return out;
}

test("the artifacts from a folder, a file: URL, an http: URL and a map of bytes train alike", async () => {
  const want = pythonRun("mlp").loss_bits.slice(0, 3);
  assert.deepEqual(await firstLosses(artifacts("mlp")), want);
  assert.deepEqual(await firstLosses(pathToFileURL(artifacts("mlp") + "/")), want);
  const files = filesOf(artifacts("mlp"));
  assert.deepEqual(await firstLosses(files), want);
  assert.deepEqual(await firstLosses(new Map(Object.entries(files).map(([k, v]) => [k, v.buffer.slice(v.byteOffset, v.byteOffset + v.byteLength)]))), want);
  const server = createServer((req, res) => {
    const name = decodeURIComponent(req.url.slice("/run/".length));
    if (!req.url.startsWith("/run/") || !Object.hasOwn(files, name)) { res.writeHead(404).end(); return; }
    res.writeHead(200).end(files[name]);
  });
  await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
  try {
    const base = `http://127.0.0.1:${server.address().port}/run`;
    assert.deepEqual(await firstLosses(base), want);
    await assert.rejects(Trainer.fromArtifacts(`http://127.0.0.1:${server.address().port}/nothing/`, OPTIONS).then(() => {}),
      (e) => e instanceof ArtifactsError && /\/nothing\/manifest\.json: cannot fetch it \(HTTP 404\)/.test(e.message));
  } finally {
    server.close();
  }
});

test("artifacts that are not portable are refused, naming manifest.json and the keys", async () => {
  await assert.rejects(Trainer.fromArtifacts(path.join(REFERENCE, "mlp", "library_artifacts"), OPTIONS), (e) => {
    assert.ok(e instanceof ArtifactsError, e);
    assert.match(e.message, /library_artifacts\/manifest\.json is not a portable trainops artifacts manifest/);
    assert.match(e.message, /- portable: expected true \(artifacts of save_artifacts\(dir, portable=True\).*got undefined/);
    assert.match(e.message, /- custom_ops: expected \[\].*got \["ai\.onnx\.preview\.training::Adam"/);
    return true;
  });
  const files = filesOf(artifacts("mlp"));
  await assert.rejects(Trainer.fromArtifacts(manifestWith(files, (m) => { m.portable = "yes"; }), OPTIONS),
    /manifest\.json is not a portable trainops artifacts manifest:\n {2}- portable: expected true .*got "yes"/);
  await assert.rejects(Trainer.fromArtifacts(manifestWith(files, (m) => { m.models.training = "../training.onnx"; m.states[0].dtype = "complex64"; }), OPTIONS),
    (e) => /models\.training: expected a file name in the folder/.test(e.message) && /states\[0\]\.dtype/.test(e.message));
  await assert.rejects(Trainer.fromArtifacts(manifestWith(files, (m) => { m.states[0].output = "nowhere"; }), OPTIONS),
    /manifest\.json does not match its training model:\n {2}- states\[0\]\.output: "nowhere" is not an output of training\.onnx/);
  await assert.rejects(Trainer.fromArtifacts({ ...files, "manifest.json": new TextEncoder().encode("{nope") }, OPTIONS),
    /manifest\.json is not a trainops artifacts manifest:\n {2}- expected a JSON object in UTF-8/);
});

test("a missing file is named", async () => {
  const files = filesOf(artifacts("mlp"));
  delete files["training.onnx"];
  await assert.rejects(Trainer.fromArtifacts(files, OPTIONS), (e) => e instanceof ArtifactsError && /^training\.onnx: not in the map of artifact files/.test(e.message));
  await assert.rejects(Trainer.fromArtifacts(path.join(REFERENCE, "no-such-folder"), OPTIONS), /no-such-folder\/manifest\.json: cannot read it \(ENOENT\)/);
  await assert.rejects(Trainer.fromArtifacts(artifacts("mlp"), {}), /options\.ort must be the onnxruntime module/);
});

test("a corrupt checkpoint is refused, naming the file and what is wrong", async () => {
  const files = filesOf(artifacts("mlp"));
  const ck = files["checkpoint.safetensors"];
  await assert.rejects(Trainer.fromArtifacts({ ...files, "checkpoint.safetensors": ck.slice(0, 100) }, OPTIONS),
    /checkpoint\.safetensors is not a valid safetensors file/);
  const { tensors, metadata } = readSafetensors(ck);
  tensors.delete("fc0.w");
  tensors.set("stray", { dtype: "F32", shape: [1], data: new Uint8Array(4) });
  const bad = writeSafetensors(tensors, { ...metadata, step: "+3" });
  await assert.rejects(Trainer.fromArtifacts({ ...files, "checkpoint.safetensors": bad }, OPTIONS), (e) => {
    assert.match(e.message, /^checkpoint\.safetensors is not a checkpoint of these artifacts:/);
    assert.match(e.message, /- metadata "step": expected a decimal integer in \[1, 2\^63-1\], got "\+3"/);
    assert.match(e.message, /- the state "fc0\.w" is missing/);
    assert.match(e.message, /- the tensor "stray" is no state of the manifest/);
    return true;
  });
});

test("wrong feeds are refused by name, and the refused step changes nothing", async () => {
  const trainer = await Trainer.fromArtifacts(artifacts("mlp"), OPTIONS);
  const data = batches(ort, "mlp");
  const { x, t } = data[0];
  await assert.rejects(trainer.step({ x, labels: t }),
    /Trainer\.step: \n {2}- feed "labels" is not a data input \(expected \["x","t"\]\)\n {2}- feed "t" is missing/);
  await assert.rejects(trainer.step({ x, t: new ort.Tensor("float32", new Float32Array(16), [16]) }),
    /Trainer\.step: feed "t": dtype float32, expected int64/);
  await assert.rejects(trainer.step({ x: new ort.Tensor("float32", new Float32Array(16 * 7), [16, 7]), t }),
    /Trainer\.step: feed "x": shape \[16,7\], expected \["N",8\] \(dimension 1\)/);
  await assert.rejects(trainer.step({ x, t: new ort.Tensor("int64", new BigInt64Array(15), [15]) }),
    /feed "t": dimension 0 \(N\) is 15, another feed's N is 16/);
  await assert.rejects(trainer.step({ x: [1, 2], t }), /feed "x": expected an ort\.Tensor/);
  assert.equal(trainer.T, 1n);
  const ref = pythonRun("mlp");
  for (let i = 0; i < 3; i++) assert.equal(f32bits(await trainer.step(data[i])), ref.loss_bits[i]);
});

test("eval.onnx's loss is the next step's loss; left-out labels give the outputs without the loss", async () => {
  const mlp = await Trainer.fromArtifacts(artifacts("mlp"), OPTIONS);
  const data = batches(ort, "mlp");
  for (let i = 0; i < 3; i++) {
    const out = await mlp.eval(data[i]);
    assert.equal(f32bits(out.loss.data[0]), f32bits(await mlp.step(data[i])), `step ${i}`);
  }
  const cnn = await Trainer.fromArtifacts(artifacts("demo_cnn"), OPTIONS);
  const cdata = batches(ort, "demo_cnn");
  await cnn.step(cdata[0]);
  const both = await cnn.eval(cdata[1]);
  const predict = await cnn.eval({ x: cdata[1].x });
  assert.deepEqual(Object.keys(predict), ["logits"]);
  assert.deepEqual(predict.logits.dims, [64, 10]);
  assert.deepEqual(predict.logits.data, both.logits.data);
  await assert.rejects(cnn.eval({ x: cdata[1].x, y: cdata[1].t }), /Trainer\.eval: feed "y" is not a data input/);
});

test("setParameters(getParameters()) changes nothing (float16 copies included); wrong input is refused", async () => {
  for (const name of ["mlp", "mixed"]) {
    const trainer = await Trainer.fromArtifacts(artifacts(name), OPTIONS);
    const data = batches(ort, name);
    const ref = pythonRun(name);
    for (let i = 0; i < 20; i++) {
      trainer.setParameters(trainer.getParameters());
      assert.equal(f32bits(await trainer.step(data[i])), ref.loss_bits[i], `${name} step ${i}`);
    }
    const flat = trainer.getParameters();
    const m = trainer.manifest;
    const total = m.states.filter((s) => m.parameters.includes(s.input)).reduce((n, s) => n + s.shape.reduce((a, b) => a * b, 1), 0);
    assert.equal(flat.length, total);
    assert.throws(() => trainer.setParameters(flat.subarray(1)), new RegExp(`Trainer\\.setParameters: ${total - 1} values, expected ${total}`));
    assert.throws(() => trainer.setParameters(Array.from(flat)), /expected a Float32Array/);
  }
});

test("steps and evals called without awaiting the previous one run in turn", async () => {
  const trainer = await Trainer.fromArtifacts(artifacts("mlp"), OPTIONS);
  const data = batches(ort, "mlp");
  const ref = pythonRun("mlp");
  const calls = [trainer.step(data[0]), trainer.eval(data[1]), trainer.step(data[1]),
    trainer.step({ x: data[2].x }), trainer.step(data[2])];
  const [a, e, b, refused, c] = await Promise.allSettled(calls);
  assert.deepEqual([a, b, c].map((r) => f32bits(r.value)), ref.loss_bits.slice(0, 3));
  assert.equal(f32bits(e.value.loss.data[0]), ref.loss_bits[1], "eval ran on the states after step 0");
  assert.match(refused.reason.message, /feed "t" is missing/);
  assert.equal(trainer.T, 4n);
});

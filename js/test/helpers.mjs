// What the tests share: the reference folder (js/.reference, made by make_reference.py), its
// batches as ort.Tensor feeds, and bitwise comparisons.
import { readFileSync, existsSync } from "node:fs";
import { fileURLToPath } from "node:url";
import path from "node:path";
import { readSafetensors } from "../src/index.js";

export const REFERENCE = process.env.TRAINOPS_JS_REFERENCE ??
  fileURLToPath(new URL("../.reference/", import.meta.url));
export const CASES = ["mlp", "dropout", "mixed", "demo_cnn"];

export function requireReference() {
  if (!existsSync(path.join(REFERENCE, "versions.json"))) {
    throw new Error(`${REFERENCE}: no reference: run scripts/test_js (or js/test/make_reference.py ${REFERENCE})`);
  }
}

// The bound on |loss - loss_python| / |loss_python| at each of the 20 steps of a run whose
// kernels order their sums otherwise (onnxruntime-web's WASM, a WebGPU EP). Not derived
// from an error analysis of 20 Adam steps (the two runs' parameters drift apart and the drift
// compounds through the steps in a way no simple bound captures). For one forward pass: a
// float32 sum of n terms in another order may move by gamma(n) = n u / (1 - n u) of the sum
// of its terms' magnitudes (Higham; u = 2^-24), about 4.3e-6 for the CNN's longest sums (72
// products in conv2). 1e-4 is 430 times the measured worst (2.3e-7, about 4 u, on
// onnxruntime-web 1.30.0): it holds for any summation order and still catches a wrong step
// (a missed or doubled update moves a loss by 1e-2 or more).
export const RELATIVE_BOUND = 1e-4;

export const artifacts = (name) => path.join(REFERENCE, name, "artifacts");
export const file = (name, f) => path.join(REFERENCE, name, f);
export const pythonRun = (name) => JSON.parse(readFileSync(file(name, "python.json"), "utf8"));

const TYPES = { F32: ["float32", Float32Array], I64: ["int64", BigInt64Array] };

/** The case's batches: [{x, t}] of ort.Tensor. */
export function batches(ort, name) {
  const { tensors } = readSafetensors(new Uint8Array(readFileSync(file(name, "batches.safetensors"))));
  const out = [];
  for (let i = 0; tensors.has(`x${i}`); i++) {
    const feeds = {};
    for (const k of ["x", "t"]) {
      const t = tensors.get(`${k}${i}`);
      const [type, Arr] = TYPES[t.dtype];
      feeds[k] = new ort.Tensor(type, new Arr(t.data.buffer, t.data.byteOffset, t.data.byteLength / Arr.BYTES_PER_ELEMENT), t.shape);
    }
    out.push(feeds);
  }
  return out;
}

/** The float32 bits of a number (a loss). */
export function f32bits(x) {
  return new Uint32Array(Float32Array.of(x).buffer)[0];
}

/** Byte equality of two views (typed arrays over any buffer). */
export function sameBytes(a, b) {
  const x = new Uint8Array(a.buffer, a.byteOffset, a.byteLength);
  const y = new Uint8Array(b.buffer, b.byteOffset, b.byteLength);
  return x.length === y.length && x.every((v, i) => v === y[i]);
}

/** The names of the tensors that differ between two safetensors files (bytes, dtype or shape). */
export function differingTensors(a, b) {
  const x = readSafetensors(a).tensors;
  const y = readSafetensors(b).tensors;
  const names = new Set([...x.keys(), ...y.keys()]);
  return [...names].filter((n) => !x.has(n) || !y.has(n) || x.get(n).dtype !== y.get(n).dtype ||
    JSON.stringify(x.get(n).shape) !== JSON.stringify(y.get(n).shape) || !sameBytes(x.get(n).data, y.get(n).data));
}

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

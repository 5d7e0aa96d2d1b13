// Reading portable trainops artifacts (docs/artifacts.md): where the files come from (a
// folder, a URL, a map of bytes), the manifest's checks, the checkpoint's states checked
// against it, and the training session's names against the manifest. Each refusal is an
// ArtifactsError naming the file and the key.

import { readSafetensors, NUMPY_TO_SAFETENSORS } from "./safetensors.js";

export const MANIFEST = "manifest.json";
export const MODEL_KEY = "trainops/model"; // the source model's bytes in the checkpoint: kept as read

// manifest dtype (numpy's name) -> [onnxruntime tensor type, typed array]
export const DTYPES = {
  float32: ["float32", Float32Array], float64: ["float64", Float64Array],
  float16: ["float16", Uint16Array], int64: ["int64", BigInt64Array],
  int32: ["int32", Int32Array], int16: ["int16", Int16Array], int8: ["int8", Int8Array],
  uint64: ["uint64", BigUint64Array], uint32: ["uint32", Uint32Array],
  uint16: ["uint16", Uint16Array], uint8: ["uint8", Uint8Array], bool: ["bool", Uint8Array],
};

/** A manifest or checkpoint this reader refuses; the message names the file and the key. */
export class ArtifactsError extends Error {
  constructor(message) {
    super(message);
    this.name = "ArtifactsError";
  }
}

// --- where the files come from ------------------------------------------------------------

const isNode = typeof process !== "undefined" && !!process.versions?.node;

function toBytes(value, name) {
  if (value instanceof Uint8Array) return value;
  if (value instanceof ArrayBuffer) return new Uint8Array(value);
  if (ArrayBuffer.isView(value)) return new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
  throw new TypeError(`Trainer.fromArtifacts: file ${JSON.stringify(name)} of the map is a ` +
    `${value === null ? "null" : typeof value}, expected a Uint8Array or an ArrayBuffer`);
}

/** A reader `name -> Promise<Uint8Array>` over a folder path, a base URL or a map of bytes. */
export function opener(source) {
  if (source instanceof Map || (source && typeof source === "object" && !(source instanceof URL))) {
    const get = (n) => (source instanceof Map ? source.get(n) : Object.hasOwn(source, n) ? source[n] : undefined);
    return {
      where: (n) => n,
      read: async (n) => {
        const v = get(n);
        if (v === undefined) throw new ArtifactsError(`${n}: not in the map of artifact files given to Trainer.fromArtifacts (it has ${JSON.stringify([...(source instanceof Map ? source.keys() : Object.keys(source))])})`);
        return toBytes(v, n);
      },
    };
  }
  if (typeof source !== "string" && !(source instanceof URL)) {
    throw new TypeError("Trainer.fromArtifacts: source must be a folder path, a base URL or a map of file names to bytes");
  }
  const text = String(source);
  const scheme = /^([a-z][a-z0-9+.-]*):\/\//i.exec(text)?.[1]?.toLowerCase();
  if (isNode && (scheme === undefined || scheme === "file")) {
    return {
      where: (n) => (scheme ? new URL(n, text.endsWith("/") ? text : text + "/").href : joinPath(text, n)),
      read: async (n) => {
        const fs = await import("node:fs/promises");
        const path = scheme ? new URL(n, text.endsWith("/") ? text : text + "/") : joinPath(text, n);
        try {
          return new Uint8Array(await fs.readFile(path));
        } catch (e) {
          throw new ArtifactsError(`${String(path)}: cannot read it (${e.code ?? e.message})`);
        }
      },
    };
  }
  const base = text.endsWith("/") ? text : text + "/";
  return {
    where: (n) => base + n,
    read: async (n) => {
      let response;
      try {
        response = await fetch(base + n);
      } catch (e) {
        throw new ArtifactsError(`${base + n}: cannot fetch it (${e.message})`);
      }
      if (!response.ok) throw new ArtifactsError(`${base + n}: cannot fetch it (HTTP ${response.status})`);
      return new Uint8Array(await response.arrayBuffer());
    },
  };
}

function joinPath(dir, name) {
  return dir.endsWith("/") || dir.endsWith("\\") ? dir + name : dir + "/" + name;
}

// --- the manifest -------------------------------------------------------------------------

export const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const isBareName = (v) => typeof v === "string" && v !== "" && v !== "." && v !== ".." &&
  !v.includes("/") && !v.includes("\\");

/** Every problem of a manifest this trainer would refuse (empty: none), each naming its key. */
export function manifestProblems(m) {
  const problems = [];
  const need = (ok, key, expected, value) => {
    if (!ok) problems.push(`${key}: expected ${expected}, got ${JSON.stringify(value)}`);
    return ok;
  };
  if (!isObject(m)) return ["expected a JSON object"];
  need(m.format === "trainops-artifacts", "format", '"trainops-artifacts"', m.format);
  need(m.format_version === 1, "format_version", "1", m.format_version);
  need(m.portable === true, "portable", "true (artifacts of save_artifacts(dir, portable=True): " +
    "only standard ONNX ops, which onnxruntime-web and onnxruntime-node run without trainops' " +
    "custom-op library)", m.portable);
  need(Array.isArray(m.custom_ops) && m.custom_ops.length === 0, "custom_ops",
    "[] (no op of trainops' custom-op library)", m.custom_ops);
  if (need(isObject(m.models), "models", "an object", m.models)) {
    need(isBareName(m.models.training), "models.training", "a file name in the folder", m.models.training);
    need(m.models.eval === undefined || isBareName(m.models.eval), "models.eval", "a file name in the folder", m.models.eval);
  }
  need(isBareName(m.checkpoint), "checkpoint", "a file name in the folder", m.checkpoint);
  const named = (v, key) => isObject(v) && need(typeof v.name === "string", `${key}.name`, "a string", v.name);
  const typed = (v, key) => need(v.dtype in DTYPES, `${key}.dtype`, `one of ${Object.keys(DTYPES).join(", ")}`, v.dtype);
  const shaped = (v, key, symbolic) => need(Array.isArray(v.shape) && v.shape.every((d) =>
    (Number.isSafeInteger(d) && d >= 0) || (symbolic && (d === null || typeof d === "string"))),
  `${key}.shape`, symbolic ? "a list of sizes, names or null" : "a list of sizes", v.shape);
  if (need(Array.isArray(m.data_inputs), "data_inputs", "a list", m.data_inputs)) {
    m.data_inputs.forEach((d, i) => named(d, `data_inputs[${i}]`) && typed(d, `data_inputs[${i}]`) && shaped(d, `data_inputs[${i}]`, true));
  }
  if (need(isObject(m.loss), "loss", "an object", m.loss)) {
    need(typeof m.loss.training_output === "string", "loss.training_output", "a string", m.loss.training_output);
    typed(m.loss, "loss");
  }
  if (need(isObject(m.learning_rate), "learning_rate", "an object", m.learning_rate)) {
    need(typeof m.learning_rate.input === "string", "learning_rate.input", "a string", m.learning_rate.input);
    need(["float32", "float64", "float16"].includes(m.learning_rate.dtype), "learning_rate.dtype", "float32, float64 or float16", m.learning_rate.dtype);
  }
  if (need(isObject(m.step), "step", "an object", m.step)) {
    need(typeof m.step.input === "string", "step.input", "a string", m.step.input);
    need(m.step.dtype === "int64", "step.dtype", '"int64"', m.step.dtype);
    need(m.step.skip_output === null || typeof m.step.skip_output === "string", "step.skip_output", "null or a string", m.step.skip_output);
  }
  if (need(Array.isArray(m.states), "states", "a list", m.states)) {
    m.states.forEach((s, i) => {
      const key = `states[${i}]`;
      if (!need(isObject(s), key, "an object", s)) return;
      need(typeof s.input === "string", `${key}.input`, "a string", s.input);
      need(typeof s.output === "string", `${key}.output`, "a string", s.output);
      typed(s, key) && shaped(s, key, false);
    });
  }
  if (need(Array.isArray(m.extra_outputs), "extra_outputs", "a list", m.extra_outputs)) {
    m.extra_outputs.forEach((o, i) => named(o, `extra_outputs[${i}]`));
  }
  if (need(Array.isArray(m.parameters), "parameters", "a list", m.parameters) && Array.isArray(m.states)) {
    const params = new Set(m.states.filter((s) => s?.kind === "param").map((s) => s.input));
    m.parameters.forEach((p, i) => need(params.has(p), `parameters[${i}]`, 'the input of a state of kind "param"', p));
  }
  return problems;
}

export function refuse(file, what, problems) {
  return new ArtifactsError(`${file} ${what}:\n` + problems.map((p) => `  - ${p}`).join("\n"));
}

// --- tensors --------------------------------------------------------------------------------

export const product = (shape) => shape.reduce((a, b) => a * b, 1);

/** A typed array over a copy of `bytes` (aligned) for the manifest dtype. */
function typedArray(dtype, bytes) {
  const Arr = DTYPES[dtype][1];
  const copy = bytes.slice();
  return new Arr(copy.buffer, 0, copy.byteLength / Arr.BYTES_PER_ELEMENT);
}

export function bytesOf(data) {
  return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
}

const sameShape = (a, b) => a.length === b.length && a.every((d, i) => d === b[i]);

export async function createSession(ort, bytes, options, file) {
  try {
    return await ort.InferenceSession.create(bytes, options);
  } catch (e) {
    throw new ArtifactsError(`${file}: onnxruntime cannot load it: ${e.message}`);
  }
}

/** The manifest's names against the training session's inputs and outputs. */
export function checkSession(session, m, tfile, mfile) {
  const inputs = new Set(session.inputNames);
  const outputs = new Set(session.outputNames);
  const bound = [...m.data_inputs.map((d, i) => [`data_inputs[${i}].name`, d.name]),
    ["learning_rate.input", m.learning_rate.input], ["step.input", m.step.input],
    ...m.states.map((s, i) => [`states[${i}].input`, s.input])];
  const problems = bound.filter(([, n]) => !inputs.has(n)).map(([k, n]) => `${k}: ${JSON.stringify(n)} is not an input of ${tfile}`);
  const names = new Set(bound.map(([, n]) => n));
  for (const n of inputs) if (!names.has(n)) problems.push(`data_inputs: the input ${JSON.stringify(n)} of ${tfile} is not bound`);
  const outs = [...m.states.map((s, i) => [`states[${i}].output`, s.output]), ["loss.training_output", m.loss.training_output],
    ...m.extra_outputs.map((o, i) => [`extra_outputs[${i}].name`, o.name])];
  for (const [k, n] of outs) if (!outputs.has(n)) problems.push(`${k}: ${JSON.stringify(n)} is not an output of ${tfile}`);
  if (problems.length) throw refuse(mfile, "does not match its training model", problems);
}

const DIGITS = /^[0-9]+$/;
const DECIMAL = /^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?$/;
const METADATA_KEYS = ["format", "format_version", "step", "learning_rate", "loss_scale", "seed", "skipped", "config", "model_sha256"];

/** The checkpoint's states (ort.Tensor by input name), other tensors and metadata, checked
 * against the manifest. */
export function readCheckpoint(bytes, file, m, ort) {
  let read;
  try {
    read = readSafetensors(bytes, file);
  } catch (e) {
    throw new ArtifactsError(e.message);
  }
  const { tensors, metadata } = read;
  const problems = METADATA_KEYS.filter((k) => !(k in metadata)).map((k) => `metadata ${JSON.stringify(k)} is missing`);
  if (!problems.length) {
    if (metadata.format !== "trainops-checkpoint") problems.push(`metadata "format": expected "trainops-checkpoint", got ${JSON.stringify(metadata.format)}`);
    if (metadata.format_version !== "1") problems.push(`metadata "format_version": expected "1", got ${JSON.stringify(metadata.format_version)}`);
    const int = (k, low) => {
      const v = metadata[k];
      if (!DIGITS.test(v) || BigInt(v) < low || BigInt(v) > 2n ** 63n - 1n) problems.push(`metadata ${JSON.stringify(k)}: expected a decimal integer in [${low}, 2^63-1], got ${JSON.stringify(v)}`);
    };
    int("step", 1n);
    int("skipped", 0n);
    const lr = metadata.learning_rate;
    if (!DECIMAL.test(lr) || !Number.isFinite(Number(lr)) || Number(lr) < 0) problems.push(`metadata "learning_rate": expected a finite decimal float >= 0, got ${JSON.stringify(lr)}`);
  }
  const state = new Map();
  const names = new Set(m.states.map((s) => s.input));
  for (const s of m.states) {
    const t = tensors.get(s.input);
    if (!t) { problems.push(`the state ${JSON.stringify(s.input)} is missing`); continue; }
    if (t.dtype !== NUMPY_TO_SAFETENSORS[s.dtype] || !sameShape(t.shape, s.shape)) {
      problems.push(`the state ${JSON.stringify(s.input)} is ${t.dtype} ${JSON.stringify(t.shape)}, the manifest's ${NUMPY_TO_SAFETENSORS[s.dtype]} ${JSON.stringify(s.shape)}`);
      continue;
    }
    state.set(s.input, new ort.Tensor(DTYPES[s.dtype][0], typedArray(s.dtype, t.data), s.shape));
  }
  const other = new Map();
  for (const [name, t] of tensors) {
    if (names.has(name)) continue;
    if (name === MODEL_KEY) other.set(name, t);
    else problems.push(`the tensor ${JSON.stringify(name)} is no state of the manifest`);
  }
  if (problems.length) throw refuse(file, "is not a checkpoint of these artifacts", problems);
  return { state, other, metadata };
}

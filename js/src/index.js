// trainops for JavaScript: trains from trainops' portable training artifacts
// (docs/artifacts.md, written by Python's `trainer.save_artifacts(dir, portable=True)`) on
// stock onnxruntime-web or onnxruntime-node. training.onnx holds the whole step (forward,
// loss, backward, optimizer update) in standard ONNX ops, so this file only binds: it feeds
// the data, the learning rate, T and every state, and each step's new states become the
// next step's inputs. The onnxruntime module is passed in (`{ ort }`): no dependency.

import { readSafetensors, writeSafetensors, NUMPY_TO_SAFETENSORS } from "./safetensors.js";
import { pythonFloatRepr, float32ToFloat16Bits, float16BitsToNumber } from "./numbers.js";

export { readSafetensors, writeSafetensors, SafetensorsError } from "./safetensors.js";
export { pythonFloatRepr, float32ToFloat16Bits, float16BitsToNumber } from "./numbers.js";

const MANIFEST = "manifest.json";
const MODEL_KEY = "trainops/model"; // the source model's bytes in the checkpoint: kept as read

// manifest dtype (numpy's name) -> [onnxruntime tensor type, typed array]
const DTYPES = {
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
function opener(source) {
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

const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const isBareName = (v) => typeof v === "string" && v !== "" && v !== "." && v !== ".." &&
  !v.includes("/") && !v.includes("\\");

/** Every problem of a manifest this trainer would refuse (empty: none), each naming its key. */
function manifestProblems(m) {
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

function refuse(file, what, problems) {
  return new ArtifactsError(`${file} ${what}:\n` + problems.map((p) => `  - ${p}`).join("\n"));
}

// --- tensors --------------------------------------------------------------------------------

const product = (shape) => shape.reduce((a, b) => a * b, 1);

/** A typed array over a copy of `bytes` (aligned) for the manifest dtype. */
function typedArray(dtype, bytes) {
  const Arr = DTYPES[dtype][1];
  const copy = bytes.slice();
  return new Arr(copy.buffer, 0, copy.byteLength / Arr.BYTES_PER_ELEMENT);
}

function bytesOf(data) {
  return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
}

const sameShape = (a, b) => a.length === b.length && a.every((d, i) => d === b[i]);

// --- the trainer ----------------------------------------------------------------------------

/** A training loop over portable trainops artifacts. Make one with Trainer.fromArtifacts. */
export class Trainer {
  /** @private use Trainer.fromArtifacts */
  constructor(init) {
    Object.assign(this, init);
  }

  /**
   * A trainer resuming from the artifacts in `source`: a folder path (Node.js), a base URL
   * (fetch), or a map (a Map or an object) of file names to their bytes.
   * @param {string | URL | Map<string, Uint8Array|ArrayBuffer> | Record<string, Uint8Array|ArrayBuffer>} source
   * @param {{ort: object, executionProviders?: any[], intraOpNumThreads?: number,
   *          sessionOptions?: object, statesOnGpu?: boolean}} options
   */
  static async fromArtifacts(source, options = {}) {
    const { ort, executionProviders, intraOpNumThreads, sessionOptions = {} } = options;
    if (!ort || typeof ort.InferenceSession?.create !== "function" || typeof ort.Tensor !== "function") {
      throw new TypeError('Trainer.fromArtifacts: options.ort must be the onnxruntime module (import * as ort from "onnxruntime-web" or "onnxruntime-node")');
    }
    const files = opener(source);
    const mfile = files.where(MANIFEST);
    let manifest;
    try {
      manifest = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(await files.read(MANIFEST)));
    } catch (e) {
      if (e instanceof ArtifactsError) throw e;
      throw refuse(mfile, "is not a trainops artifacts manifest", [`expected a JSON object in UTF-8: ${e.message}`]);
    }
    const problems = manifestProblems(manifest);
    if (problems.length) throw refuse(mfile, "is not a portable trainops artifacts manifest", problems);

    const cfile = files.where(manifest.checkpoint);
    const { state, other, metadata } = readCheckpoint(await files.read(manifest.checkpoint), cfile, manifest, ort);

    // WebGPU: the new states stay in GPU buffers between steps (the loss and the extra
    // outputs come back to the CPU); elsewhere every output comes back as CPU data.
    const providers = (executionProviders ?? []).map((p) => (typeof p === "string" ? p : p?.name));
    const statesOnGpu = options.statesOnGpu ?? providers.includes("webgpu");
    const base = { ...sessionOptions };
    if (executionProviders !== undefined) base.executionProviders = executionProviders;
    if (intraOpNumThreads !== undefined) {
      base.intraOpNumThreads = intraOpNumThreads;
      base.interOpNumThreads = 1;
      // onnxruntime-web takes its WASM thread count from ort.env (read when it starts).
      if (ort.env?.wasm) ort.env.wasm.numThreads = intraOpNumThreads;
    }
    // ONNX Runtime's memory pattern off, as trainops' Python sessions (see runtime.py there).
    base.enableMemPattern = false;
    const trainingOptions = { ...base };
    if (statesOnGpu) {
      trainingOptions.preferredOutputLocation = Object.fromEntries(
        manifest.states.map((s) => [s.output, "gpu-buffer"]));
    }
    const tfile = files.where(manifest.models.training);
    const training = await createSession(ort, await files.read(manifest.models.training), trainingOptions, tfile);
    checkSession(training, manifest, tfile, mfile);

    const t = new Trainer({
      ort, manifest, files, metadata, other, state, training, statesOnGpu,
      evalOptions: base, evalSession: null,
      T: BigInt(metadata.step), skipped: BigInt(metadata.skipped),
      learningRate: Number(metadata.learning_rate), lastOutputs: null,
    });
    return t;
  }

  /**
   * One training step on `feeds` (an ort.Tensor for every data input of the manifest).
   * @returns {Promise<number>} the loss before the update
   */
  async step(feeds) {
    const m = this.manifest;
    const { ort } = this;
    const inputs = { ...this.checkFeeds(feeds, m.data_inputs, "Trainer.step") };
    const lrType = m.learning_rate.dtype;
    const lr = lrType === "float16" ? Uint16Array.of(float32ToFloat16Bits(this.learningRate))
      : new DTYPES[lrType][1]([this.learningRate]);
    inputs[m.learning_rate.input] = new ort.Tensor(DTYPES[lrType][0], lr, [1]);
    inputs[m.step.input] = new ort.Tensor("int64", BigInt64Array.of(this.T), [1]);
    for (const s of m.states) inputs[s.input] = this.state.get(s.input);
    const fetches = [m.loss.training_output, ...m.states.map((s) => s.output), ...m.extra_outputs.map((o) => o.name)];
    const out = await this.training.run(inputs, fetches);
    for (const s of m.states) {
      const old = this.state.get(s.input);
      this.state.set(s.input, out[s.output]);
      if (old.location === "gpu-buffer") old.dispose();
    }
    const skip = m.step.skip_output;
    if (skip === null || out[skip].data[0]) this.T += 1n;
    else this.skipped += 1n;
    return scalar(out[m.loss.training_output], m.loss.dtype);
  }

  /**
   * eval.onnx on `feeds` (the data inputs; the parameters are the trainer's): the source
   * model in inference mode (Dropout passes through), no update. A data input left out (the
   * labels, to predict) is fed zeros of the batch's size, and the loss is then not returned.
   * @returns {Promise<Record<string, any>>} eval.onnx's outputs by name (ort.Tensor)
   */
  async eval(feeds) {
    const m = this.manifest;
    if (!m.models.eval) throw new ArtifactsError(`${this.files.where(MANIFEST)}: models.eval: the artifacts have no eval model`);
    if (!this.evalSession) {
      const efile = this.files.where(m.models.eval);
      this.evalSession = await createSession(this.ort, await this.files.read(m.models.eval), this.evalOptions, efile);
    }
    const given = m.data_inputs.filter((d) => feeds && Object.hasOwn(feeds, d.name));
    const inputs = { ...this.checkFeeds(feeds, given, "Trainer.eval") };
    const sizes = {};
    for (const d of given) d.shape.forEach((s, i) => { if (typeof s === "string") sizes[s] = inputs[d.name].dims[i]; });
    const missing = m.data_inputs.filter((d) => !given.includes(d));
    for (const d of missing) {
      const shape = d.shape.map((s) => (typeof s === "number" ? s : sizes[s]));
      if (shape.some((s) => s === undefined)) {
        throw new Error(`Trainer.eval: the data input ${JSON.stringify(d.name)} (shape ${JSON.stringify(d.shape)}) is missing and its size cannot be told from the other feeds`);
      }
      inputs[d.name] = new this.ort.Tensor(DTYPES[d.dtype][0], new DTYPES[d.dtype][1](product(shape)), shape);
    }
    const names = m.eval_inputs ?? [...m.data_inputs.map((d) => d.name), ...m.parameters];
    for (const n of names) if (!(n in inputs)) inputs[n] = this.state.get(n);
    const out = await this.evalSession.run(inputs);
    if (missing.length && m.loss.eval_output in out) delete out[m.loss.eval_output];
    return out;
  }

  /** Check `feeds` against the manifest's data inputs `wanted`; returns them. */
  checkFeeds(feeds, wanted, what) {
    if (!isObject(feeds)) throw new TypeError(`${what}: feeds must be an object of ort.Tensor by input name`);
    const problems = [];
    const names = new Set(wanted.map((d) => d.name));
    const all = new Set(this.manifest.data_inputs.map((d) => d.name));
    for (const k of Object.keys(feeds)) {
      if (!all.has(k)) problems.push(`feed ${JSON.stringify(k)} is not a data input (expected ${JSON.stringify([...all])})`);
    }
    const out = {};
    const sizes = {};
    for (const d of wanted) {
      const v = feeds[d.name];
      if (v === undefined) { problems.push(`feed ${JSON.stringify(d.name)} is missing`); continue; }
      if (!(v instanceof this.ort.Tensor)) { problems.push(`feed ${JSON.stringify(d.name)}: expected an ort.Tensor (of the ort module given to fromArtifacts)`); continue; }
      if (v.type !== DTYPES[d.dtype][0]) problems.push(`feed ${JSON.stringify(d.name)}: dtype ${v.type}, expected ${DTYPES[d.dtype][0]}`);
      const dims = v.dims;
      if (dims.length !== d.shape.length) {
        problems.push(`feed ${JSON.stringify(d.name)}: shape [${dims}], expected ${d.shape.length} dimensions ${JSON.stringify(d.shape)}`);
      } else {
        d.shape.forEach((s, i) => {
          if (typeof s === "number" && dims[i] !== s) problems.push(`feed ${JSON.stringify(d.name)}: shape [${dims}], expected ${JSON.stringify(d.shape)} (dimension ${i})`);
          if (typeof s === "string") {
            if (s in sizes && sizes[s] !== dims[i]) problems.push(`feed ${JSON.stringify(d.name)}: dimension ${i} (${s}) is ${dims[i]}, another feed's ${s} is ${sizes[s]}`);
            sizes[s] = dims[i];
          }
        });
      }
      out[d.name] = v;
    }
    if (problems.length) throw new Error(`${what}: ` + (problems.length === 1 ? problems[0] : "\n" + problems.map((p) => `  - ${p}`).join("\n")));
    return out;
  }

  /** Copies every state held on a GPU back to the CPU (WebGPU); getParameters and
   * saveCheckpoint need it after steps with statesOnGpu. */
  async download() {
    for (const [name, t] of this.state) {
      if (t.location === "cpu" || t.location === undefined) continue;
      const data = await t.getData(true); // releases the GPU buffer
      this.state.set(name, new this.ort.Tensor(t.type, data, t.dims));
    }
  }

  cpuData(name, what) {
    const t = this.state.get(name);
    if (t.location !== undefined && t.location !== "cpu") {
      throw new Error(`Trainer.${what}: the state ${JSON.stringify(name)} is in GPU memory: await trainer.download() first`);
    }
    return t.data;
  }

  /** The checkpoint (safetensors, docs/artifacts.md): every state by its input name, the
   * source model as read, the metadata with this trainer's step, skipped count, learning
   * rate and loss scale. Python's Trainer.from_artifacts / Trainer.load resume from it.
   * @returns {Uint8Array} */
  saveCheckpoint() {
    const tensors = new Map(this.other);
    for (const s of this.manifest.states) {
      tensors.set(s.input, { dtype: NUMPY_TO_SAFETENSORS[s.dtype], shape: s.shape, data: bytesOf(this.cpuData(s.input, "saveCheckpoint")) });
    }
    const metadata = { ...this.metadata, step: String(this.T), learning_rate: pythonFloatRepr(this.learningRate), skipped: String(this.skipped) };
    const scale = this.manifest.states.find((s) => s.input === "trainops/loss_scale");
    if (scale) metadata.loss_scale = pythonFloatRepr(scalar(this.state.get(scale.input), scale.dtype));
    return writeSafetensors(tensors, metadata);
  }

  /** The parameters (manifest.parameters, in order), one after the other in one Float32Array.
   * @returns {Float32Array} */
  getParameters() {
    const params = this.paramStates("getParameters");
    const flat = new Float32Array(params.reduce((n, s) => n + product(s.shape), 0));
    let at = 0;
    for (const s of params) {
      const d = this.cpuData(s.input, "getParameters");
      flat.set(d, at);
      at += d.length;
    }
    return flat;
  }

  /** Replace the parameters by `flat` (getParameters' layout); the optimizer state stays.
   * Under mixed_float16 their float16 copies are set too (rounded to nearest even).
   * @param {Float32Array} flat */
  setParameters(flat) {
    const params = this.paramStates("setParameters");
    const total = params.reduce((n, s) => n + product(s.shape), 0);
    if (!(flat instanceof Float32Array)) throw new TypeError("Trainer.setParameters: expected a Float32Array (getParameters' layout)");
    if (flat.length !== total) throw new Error(`Trainer.setParameters: ${flat.length} values, expected ${total} (the parameters ${JSON.stringify(this.manifest.parameters)})`);
    const copies = new Map(this.manifest.states.filter((s) => s.kind === "fp16_copy").map((s) => [s.param, s]));
    let at = 0;
    for (const s of params) {
      const n = product(s.shape);
      const part = flat.slice(at, at + n);
      at += n;
      const old = this.state.get(s.input);
      this.state.set(s.input, new this.ort.Tensor("float32", part, s.shape));
      if (old.location === "gpu-buffer") old.dispose();
      const c = copies.get(s.param ?? s.input);
      if (c) {
        const h = new Uint16Array(n);
        for (let i = 0; i < n; i++) h[i] = float32ToFloat16Bits(part[i]);
        const oldc = this.state.get(c.input);
        this.state.set(c.input, new this.ort.Tensor("float16", h, c.shape));
        if (oldc.location === "gpu-buffer") oldc.dispose();
      }
    }
  }

  paramStates(what) {
    const byInput = new Map(this.manifest.states.map((s) => [s.input, s]));
    const params = this.manifest.parameters.map((p) => byInput.get(p));
    const other = params.filter((s) => s.dtype !== "float32");
    if (other.length) throw new Error(`Trainer.${what}: the parameters ${JSON.stringify(other.map((s) => s.input))} are ${other[0].dtype}, not float32`);
    return params;
  }

  /** Frees the sessions. */
  async release() {
    await this.training.release?.();
    await this.evalSession?.release?.();
  }
}

function scalar(tensor, dtype) {
  const v = tensor.data[0];
  if (dtype === "float16") return float16BitsToNumber(v);
  return Number(v);
}

async function createSession(ort, bytes, options, file) {
  try {
    return await ort.InferenceSession.create(bytes, options);
  } catch (e) {
    throw new ArtifactsError(`${file}: onnxruntime cannot load it: ${e.message}`);
  }
}

/** The manifest's names against the training session's inputs and outputs. */
function checkSession(session, m, tfile, mfile) {
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
function readCheckpoint(bytes, file, m, ort) {
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

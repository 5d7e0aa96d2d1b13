// trainops for JavaScript: trains from trainops' portable training artifacts
// (docs/artifacts.md, written by Python's `trainer.save_artifacts(dir, portable=True)`) on
// stock onnxruntime-web or onnxruntime-node. training.onnx holds the whole step (forward,
// loss, backward, optimizer update) in standard ONNX ops, so this file only binds: it feeds
// the data, the learning rate, T and every state, and each step's new states become the
// next step's inputs. The onnxruntime module is passed in (`{ ort }`): no dependency.

import { writeSafetensors, NUMPY_TO_SAFETENSORS } from "./safetensors.js";
import { pythonFloatRepr, float32ToFloat16Bits, float16BitsToNumber } from "./numbers.js";
import { ArtifactsError, DTYPES, MANIFEST, bytesOf, checkSession, createSession, isObject, manifestProblems,
  opener, product, readCheckpoint, refuse } from "./artifacts.js";

export { ArtifactsError } from "./artifacts.js";
export { readSafetensors, writeSafetensors, SafetensorsError } from "./safetensors.js";
export { pythonFloatRepr, float32ToFloat16Bits, float16BitsToNumber } from "./numbers.js";

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
    // Not by default on onnxruntime-node: its GPU tensors cannot be read back (download).
    const statesOnGpu = options.statesOnGpu ?? (providers.includes("webgpu") && !onnxruntimeNode(ort));
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

    return new Trainer({
      ort, manifest, files, metadata, other, state, training, statesOnGpu,
      evalOptions: base, evalSession: null, pending: Promise.resolve(),
      T: BigInt(metadata.step), skipped: BigInt(metadata.skipped),
      learningRate: Number(metadata.learning_rate),
    });
  }

  /** Runs `fn` after every step, eval and download called before it has finished: calls
   * made without awaiting the previous one run in turn, each on the states the previous left. */
  serial(fn) {
    const run = this.pending.then(fn, fn);
    this.pending = run.catch(() => {});
    return run;
  }

  /**
   * One training step on `feeds` (an ort.Tensor for every data input of the manifest).
   * @returns {Promise<number>} the loss before the update
   */
  step(feeds) {
    return this.serial(() => this.stepNow(feeds));
  }

  async stepNow(feeds) {
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
  eval(feeds) {
    return this.serial(() => this.evalNow(feeds));
  }

  async evalNow(feeds) {
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
  download() {
    return this.serial(() => this.downloadNow());
  }

  async downloadNow() {
    for (const [name, t] of this.state) {
      if (t.location === "cpu" || t.location === undefined) continue;
      if (onnxruntimeNode(this.ort)) {
        // measured on onnxruntime-node 1.30.0's WebGPU EP: getData of an output in a GPU
        // buffer ends the process (an uncaught C++ exception), so it is not called
        throw new Error(`Trainer.download: onnxruntime-node ${this.ort.env.versions.node} cannot read a GPU ` +
          "tensor back (its getData aborts the process): use statesOnGpu: false there");
      }
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

/** Whether `ort` is onnxruntime-node (its env names its version under "node"). */
function onnxruntimeNode(ort) {
  return !!ort.env?.versions?.node;
}

function scalar(tensor, dtype) {
  const v = tensor.data[0];
  if (dtype === "float16") return float16BitsToNumber(v);
  return Number(v);
}


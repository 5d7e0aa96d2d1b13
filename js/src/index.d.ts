// Types of the trainops package (src/index.js). The onnxruntime module is passed in at run
// time, so its types are described structurally here: onnxruntime-web's and
// onnxruntime-node's `Tensor` both fit.

/** An onnxruntime tensor (ort.Tensor of onnxruntime-web or onnxruntime-node). */
export interface OrtTensor {
  readonly type: string;
  readonly dims: readonly number[];
  readonly data: unknown;
  readonly location?: string;
  getData?(releaseData?: boolean): Promise<unknown>;
  dispose?(): void;
}

/** The onnxruntime module: `import * as ort from "onnxruntime-web"` (or "onnxruntime-node"). */
export interface OrtModule {
  InferenceSession: { create(model: Uint8Array, options?: object): Promise<unknown> };
  Tensor: new (type: any, data: any, dims?: readonly number[]) => OrtTensor;
  env?: any;
}

/** Where the artifacts are: a folder path (Node.js), a base URL (fetch), or the files' bytes by name. */
export type ArtifactsSource =
  | string
  | URL
  | Map<string, Uint8Array | ArrayBuffer>
  | Record<string, Uint8Array | ArrayBuffer>;

export interface TrainerOptions {
  /** The onnxruntime module. */
  ort: OrtModule;
  /** Passed to the sessions as is: ["cpu"] (Node), ["wasm"], ["webgpu", "wasm"] (browser). */
  executionProviders?: any[];
  /** Intra-op threads of the sessions (onnxruntime-web: ort.env.wasm.numThreads is set too). */
  intraOpNumThreads?: number;
  /** Other session options, given to both sessions. */
  sessionOptions?: object;
  /** Keep the states in GPU buffers between steps (default: when executionProviders has "webgpu"). */
  statesOnGpu?: boolean;
}

/** A manifest, checkpoint or model file this reader refuses; the message names the file and the key. */
export class ArtifactsError extends Error {}

/** A file that is not a valid safetensors file. */
export class SafetensorsError extends Error {}

/** A training loop over portable trainops artifacts (`trainer.save_artifacts(dir, portable=True)`). */
export class Trainer {
  private constructor();
  /** A trainer resuming from the artifacts (manifest.json, training.onnx, eval.onnx, checkpoint.safetensors). */
  static fromArtifacts(source: ArtifactsSource, options: TrainerOptions): Promise<Trainer>;
  /** The parsed manifest.json. */
  readonly manifest: any;
  /** The checkpoint's metadata as read (strings). */
  readonly metadata: Record<string, string>;
  /** T of the next step (skipped steps do not count). */
  T: bigint;
  /** Steps skipped for non-finite gradients (mixed_float16). */
  skipped: bigint;
  /** Whether the states stay in GPU buffers between steps (TrainerOptions.statesOnGpu). */
  readonly statesOnGpu: boolean;
  /** The learning rate fed to the next step (from the checkpoint's metadata). */
  learningRate: number;
  /** One step on a batch (an ort.Tensor for every data input); the loss before the update. */
  step(feeds: Record<string, OrtTensor>): Promise<number>;
  /** eval.onnx (inference mode) with the trainer's parameters: its outputs by name. A data
   *  input left out is fed zeros of the batch's size, and the loss is then not returned. */
  eval(feeds: Record<string, OrtTensor>): Promise<Record<string, OrtTensor>>;
  /** The checkpoint in trainops' safetensors format (Python's Trainer.from_artifacts resumes from it). */
  saveCheckpoint(): Uint8Array;
  /** Every parameter (manifest order), one after the other. */
  getParameters(): Float32Array;
  /** Replace the parameters (getParameters' layout); the optimizer state stays. */
  setParameters(flat: Float32Array): void;
  /** Copy states held in GPU buffers (statesOnGpu) back to the CPU, before getParameters or saveCheckpoint. */
  download(): Promise<void>;
  /** Free the sessions. */
  release(): Promise<void>;
}

export interface SafetensorsTensor {
  /** safetensors' dtype name: F32, F16, I64, U32, U8, BOOL, ... */
  dtype: string;
  shape: number[];
  data: Uint8Array;
}

export function readSafetensors(bytes: Uint8Array, file?: string): {
  tensors: Map<string, SafetensorsTensor>;
  metadata: Record<string, string>;
};
export function writeSafetensors(tensors: Map<string, SafetensorsTensor>, metadata: Record<string, string>): Uint8Array;
/** Python's repr of a float ("0.001", "8192.0", "1e-05"). */
export function pythonFloatRepr(x: number): string;
/** float32 -> float16 bits, rounded to nearest even. */
export function float32ToFloat16Bits(x: number): number;
export function float16BitsToNumber(bits: number): number;

// The safetensors file format (8-byte little-endian header length, a JSON header, the tensors'
// bytes), read and written the way trainops' Python writer lays it out
// (python/trainops/train/checkpoint_file.py: tensors by dtype, largest first, then by name;
// the header as Python's json.dumps(..., separators=(",", ":")) with ASCII escapes, padded
// with spaces to a multiple of 8 bytes), so a checkpoint saved here is byte for byte the one
// Python saves from the same state.

/** safetensors dtype -> bytes per element. */
export const DTYPE_SIZES = {
  BOOL: 1, U8: 1, I8: 1, I16: 2, U16: 2, F16: 2, BF16: 2, I32: 4, U32: 4, F32: 4, F64: 8,
  I64: 8, U64: 8,
};

// safetensors' Dtype enum order: its writer puts the later (larger) dtypes first.
const ORDER = ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64",
  "I64", "U64"];

/** numpy dtype names (the manifest's) <-> safetensors dtype names. */
export const NUMPY_TO_SAFETENSORS = {
  float32: "F32", float64: "F64", float16: "F16", bfloat16: "BF16", int64: "I64",
  int32: "I32", int16: "I16", int8: "I8", uint64: "U64", uint32: "U32", uint16: "U16",
  uint8: "U8", bool: "BOOL",
};

/** Thrown for a file that is not a valid safetensors file (the message names the file). */
export class SafetensorsError extends Error {
  constructor(message) {
    super(message);
    this.name = "SafetensorsError";
  }
}

/**
 * Read a safetensors file.
 * @param {Uint8Array} bytes the file
 * @param {string} [file] its name, for the errors
 * @returns {{tensors: Map<string, {dtype: string, shape: number[], data: Uint8Array}>,
 *            metadata: Record<string, string>}} each tensor's bytes copied (aligned)
 */
export function readSafetensors(bytes, file = "safetensors file") {
  const bad = (why) => new SafetensorsError(`${file} is not a valid safetensors file: ${why}`);
  if (!(bytes instanceof Uint8Array)) throw new TypeError(`readSafetensors: ${file}: expected a Uint8Array`);
  if (bytes.length < 8) throw bad(`${bytes.length} bytes, fewer than the 8 of the header length`);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const n = view.getBigUint64(0, true);
  if (n > BigInt(bytes.length - 8)) throw bad(`header length ${n} runs past the end (${bytes.length} bytes)`);
  let header;
  try {
    header = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(bytes.subarray(8, 8 + Number(n))));
  } catch (e) {
    throw bad(`header: ${e.message}`);
  }
  if (header === null || typeof header !== "object" || Array.isArray(header)) throw bad("header is not a JSON object");
  const start = 8 + Number(n);
  const size = bytes.length - start;
  const metadata = header.__metadata__ ?? {};
  if (typeof metadata !== "object" || Array.isArray(metadata) ||
      Object.values(metadata).some((v) => typeof v !== "string")) {
    throw bad("__metadata__ is not an object of strings");
  }
  const tensors = new Map();
  for (const [name, entry] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    const { dtype, shape, data_offsets: offsets } = entry ?? {};
    if (!(dtype in DTYPE_SIZES)) throw bad(`tensor ${JSON.stringify(name)}: unknown dtype ${JSON.stringify(dtype)}`);
    if (!Array.isArray(shape) || !shape.every((d) => Number.isSafeInteger(d) && d >= 0)) {
      throw bad(`tensor ${JSON.stringify(name)}: shape ${JSON.stringify(shape)} is not a list of sizes`);
    }
    if (!Array.isArray(offsets) || offsets.length !== 2 || !offsets.every(Number.isSafeInteger) ||
        offsets[0] < 0 || offsets[1] < offsets[0] || offsets[1] > size) {
      throw bad(`tensor ${JSON.stringify(name)}: data_offsets ${JSON.stringify(offsets)} outside the ${size} data bytes`);
    }
    const count = shape.reduce((a, b) => a * b, 1);
    if (count * DTYPE_SIZES[dtype] !== offsets[1] - offsets[0]) {
      throw bad(`tensor ${JSON.stringify(name)}: ${offsets[1] - offsets[0]} bytes for shape ${JSON.stringify(shape)} of ${dtype}`);
    }
    tensors.set(name, { dtype, shape, data: bytes.slice(start + offsets[0], start + offsets[1]) });
  }
  return { tensors, metadata: { ...metadata } };
}

// Python compares strings by code point; JavaScript's < by UTF-16 unit (they differ only past
// U+FFFF).
function comparePython(a, b) {
  const x = Array.from(a, (c) => c.codePointAt(0));
  const y = Array.from(b, (c) => c.codePointAt(0));
  for (let i = 0; i < Math.min(x.length, y.length); i++) if (x[i] !== y[i]) return x[i] - y[i];
  return x.length - y.length;
}

// JSON.stringify, then every non-ASCII UTF-16 unit as \uXXXX: Python's json.dumps with
// ensure_ascii (lone surrogates JSON.stringify has already escaped the same way).
function pythonJson(value) {
  return JSON.stringify(value).replace(/[\u0080-\uffff]/g,
    (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"));
}

/**
 * Write a safetensors file.
 * @param {Map<string, {dtype: string, shape: number[], data: Uint8Array}>} tensors
 *   dtype: safetensors' name (F32, I64, ...)
 * @param {Record<string, string>} metadata
 * @returns {Uint8Array}
 */
export function writeSafetensors(tensors, metadata) {
  const names = [...tensors.keys()].sort((a, b) => {
    const da = ORDER.indexOf(tensors.get(a).dtype);
    const db = ORDER.indexOf(tensors.get(b).dtype);
    return da !== db ? db - da : comparePython(a, b);
  });
  if (names.includes("__metadata__")) throw new TypeError("writeSafetensors: a tensor may not be named __metadata__");
  // Written entry by entry: a JavaScript object would put integer-like names ("0") first.
  const entries = Object.keys(metadata).length ? [pythonJson("__metadata__") + ":" + pythonJson(metadata)] : [];
  let offset = 0;
  for (const name of names) {
    const t = tensors.get(name);
    if (!(t.dtype in DTYPE_SIZES)) throw new TypeError(`writeSafetensors: tensor ${JSON.stringify(name)}: unknown dtype ${t.dtype}`);
    const entry = { dtype: t.dtype, shape: t.shape, data_offsets: [offset, offset + t.data.byteLength] };
    entries.push(pythonJson(name) + ":" + pythonJson(entry));
    offset += t.data.byteLength;
  }
  const text = new TextEncoder().encode("{" + entries.join(",") + "}");
  const padded = text.length + ((8 - (text.length % 8)) % 8);
  const out = new Uint8Array(8 + padded + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(padded), true);
  out.set(text, 8);
  out.fill(0x20, 8 + text.length, 8 + padded);
  let at = 8 + padded;
  for (const name of names) {
    const d = tensors.get(name).data;
    out.set(new Uint8Array(d.buffer, d.byteOffset, d.byteLength), at);
    at += d.byteLength;
  }
  return out;
}

// Number formats the checkpoint metadata and the float16 states need.

/**
 * Python's repr of a float (a JavaScript number is an IEEE double, as Python's float): the
 * shortest digits that read back to the same double, in fixed notation when the decimal
 * exponent is in [-4, 16) ("0.001", "8192.0"), else scientific with at least two exponent
 * digits ("1e-05", "1e+16"); "nan", "inf", "-inf".
 * @param {number} x
 * @returns {string}
 */
export function pythonFloatRepr(x) {
  if (Number.isNaN(x)) return "nan";
  if (x === Infinity) return "inf";
  if (x === -Infinity) return "-inf";
  if (x === 0) return Object.is(x, -0) ? "-0.0" : "0.0";
  // toExponential() without digits: as many as needed to tell the double apart (shortest).
  const [mantissa, exp] = Math.abs(x).toExponential().split("e");
  const digits = mantissa.replace(".", "");
  const e = Number(exp);
  const sign = x < 0 ? "-" : "";
  if (e >= -4 && e < 16) {
    if (e < 0) return `${sign}0.${"0".repeat(-e - 1)}${digits}`;
    const int = digits.length > e + 1 ? digits.slice(0, e + 1) : digits.padEnd(e + 1, "0");
    const frac = digits.length > e + 1 ? digits.slice(e + 1) : "0";
    return `${sign}${int}.${frac}`;
  }
  const m = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
  return `${sign}${m}e${e < 0 ? "-" : "+"}${String(Math.abs(e)).padStart(2, "0")}`;
}

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/**
 * The float16 bits of a float32 value, rounded to nearest even (ONNX Cast, numpy astype).
 * @param {number} value
 * @returns {number} the 16 bits
 */
export function float32ToFloat16Bits(value) {
  f32[0] = value;
  const x = u32[0];
  const sign = (x >>> 16) & 0x8000;
  const exp = (x >>> 23) & 0xff;
  let mant = x & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 | (mant >>> 13) : 0); // inf, nan (quiet)
  const e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00; // overflow: inf
  if (e <= 0) { // subnormal half (or zero)
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    const half = mant >>> shift;
    const rest = mant & ((1 << shift) - 1);
    const mid = 1 << (shift - 1);
    return sign | (half + (rest > mid || (rest === mid && (half & 1)) ? 1 : 0));
  }
  const half = (e << 10) | (mant >>> 13);
  const rest = mant & 0x1fff;
  // a carry out of the mantissa rounds up into the exponent (to inf at the top): still right
  return sign | (half + (rest > 0x1000 || (rest === 0x1000 && (half & 1)) ? 1 : 0));
}

/**
 * The float32 value of float16 bits.
 * @param {number} h
 * @returns {number}
 */
export function float16BitsToNumber(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >>> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0) return sign * mant * 2 ** -24;
  if (exp === 0x1f) return mant ? NaN : sign * Infinity;
  return sign * (1 + mant / 1024) * 2 ** (exp - 15);
}

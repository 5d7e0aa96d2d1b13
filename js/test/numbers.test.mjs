// The number formats of the checkpoint against Python's own: repr of a float (the metadata's
// learning_rate and loss_scale) and numpy's float32 -> float16 rounding (the float16 copies
// setParameters writes under mixed_float16). The values come from make_reference.py.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import path from "node:path";
import { pythonFloatRepr, float32ToFloat16Bits, float16BitsToNumber } from "../src/index.js";
import { REFERENCE, requireReference } from "./helpers.mjs";

requireReference();
const ref = JSON.parse(readFileSync(path.join(REFERENCE, "numbers.json"), "utf8"));

test("pythonFloatRepr is Python's repr for doubles of every magnitude", () => {
  ref.doubles.forEach((v, i) => {
    const x = typeof v === "string" ? Number(v.replace("inf", "Infinity")) : v;
    assert.equal(pythonFloatRepr(x), ref.reprs[i], `double ${i}`);
  });
});

test("float32ToFloat16Bits rounds as numpy (to nearest even; overflow to inf)", () => {
  const f = new Float32Array(new Uint32Array(ref.float32_bits).buffer);
  f.forEach((x, i) => assert.equal(float32ToFloat16Bits(x), ref.float16_bits[i], `float32 ${x}`));
  assert.ok(Number.isNaN(float16BitsToNumber(float32ToFloat16Bits(NaN))));
});

test("float16BitsToNumber inverts every finite float16", () => {
  for (let h = 0; h < 0x10000; h++) {
    if ((h & 0x7c00) === 0x7c00 && (h & 0x3ff)) continue; // nan
    assert.equal(float32ToFloat16Bits(float16BitsToNumber(h)), h, `bits ${h}`);
  }
});

// trainops' CUDA kernels. Compiled to PTX by scripts/make_ptx (NVRTC, --fmad=false,
// -prec-div=true -prec-sqrt=true), so every multiply and add rounds on its own, as in the CPU
// scalar reference (crates/trainops-kernels/src/optim/*/reference.rs): the same operations in
// the same order give the same bits. Per-call coefficients (adjusted rates, 1 - alpha, ...)
// are computed on the host in double and rounded to float exactly as the reference does, and
// passed as arguments. Launch: 256 threads per block, a grid-stride loop over n.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

#define GRID_STRIDE(i, n) \
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

// 16-bit values as the CPU converts them: float16 -> float exactly, float -> float16 rounded to
// nearest even (PTX cvt, IEEE), bfloat16 -> float exactly (the top half of the float's bits).
__device__ __forceinline__ float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
  u32 b = __float_as_uint(f);
  // NaN as the CPU's `half` crate (and x86 F16C) make it: sign, quiet bit, top payload bits
  // (PTX cvt would give the canonical NaN).
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (u16)(((b >> 16) & 0x8000u) | 0x7E00u | ((b & 0x7FFFFFu) >> 13));
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// float -> bfloat16 as the CPU's `half` crate rounds (bf16::from_f32): NaN keeps its top bits
// with the quiet bit set; otherwise round to nearest, ties to even.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u32 b = __float_as_uint(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((b >> 16) | 0x0040u);
  if ((b & 0x8000u) != 0 && (b & 0x17FFFu) != 0) return (u16)((b >> 16) + 1);
  return (u16)(b >> 16);
}

// Element i of a tensor of type dtype as float: 0 float32, 1 float16, 2 bfloat16.
__device__ __forceinline__ float load_f32(const void* p, int dtype, u64 i) {
  if (dtype == 1) return f16_to_f32(((const u16*)p)[i]);
  if (dtype == 2) return __uint_as_float((u32)((const u16*)p)[i] << 16);
  return ((const float*)p)[i];
}

// One element of ONNX Adam (crates/trainops-kernels/src/optim/adam/mod.rs `update`), gradient gi.
__device__ __forceinline__ void adam_element(float* x, float* v, float* h, u64 i, float gi, float norm, float alpha,
                                             float one_minus_alpha, float beta, float one_minus_beta,
                                             float epsilon, float r_adjusted, float one_minus_post) {
  float xi = x[i], vi = v[i], hi = h[i];
  float gr = __fadd_rn(__fmul_rn(norm, xi), gi);
  float v_new = __fadd_rn(__fmul_rn(alpha, vi), __fmul_rn(one_minus_alpha, gr));
  float h_new = __fadd_rn(__fmul_rn(beta, hi), __fmul_rn(one_minus_beta, __fmul_rn(gr, gr)));
  float h_sqrt = __fadd_rn(__fsqrt_rn(h_new), epsilon);
  float x_new = __fsub_rn(xi, __fmul_rn(r_adjusted, __fdiv_rn(v_new, h_sqrt)));
  x[i] = __fmul_rn(one_minus_post, x_new);
  v[i] = v_new;
  h[i] = h_new;
}

// ONNX Adam, float32; the coefficients are the CPU reference's c(...) values.
extern "C" __global__ void trainops_adam_f32(float* x, const float* g, float* v, float* h, u64 n,
                                             float norm, float alpha, float one_minus_alpha, float beta,
                                             float one_minus_beta, float epsilon, float r_adjusted,
                                             float one_minus_post) {
  GRID_STRIDE(i, n) {
    adam_element(x, v, h, i, g[i], norm, alpha, one_minus_alpha, beta, one_minus_beta, epsilon, r_adjusted,
                 one_minus_post);
  }
}

// One element of torch.optim.AdamW (crates/trainops-kernels/src/optim/adamw/mod.rs `moments`,
// `apply`, `keep_max`), gradient gi; vmax null without amsgrad. flags: bit 0 maximize, bit 1
// lerp from the end (g + lerp * (g - m), else m + lerp * (g - m)). torch's lerp and addcmul
// are fused multiply-adds (Rust's mul_add): __fmaf_rn, one rounding, as there.
__device__ __forceinline__ void adamw_element(float* x, float* m, float* v, float* vmax, u64 i, float gi, float decay,
                                              float lerp, float beta2, float one_minus_beta2, float bc2_sqrt,
                                              float epsilon, float step_size, int flags) {
  float g = (flags & 1) ? -gi : gi;
  float xi = __fmul_rn(x[i], decay);
  float mi = m[i], vi = v[i];
  float base = (flags & 2) ? g : mi;
  float m_new = __fmaf_rn(lerp, __fsub_rn(g, mi), base);
  float v_new = __fmaf_rn(__fmul_rn(one_minus_beta2, g), g, __fmul_rn(vi, beta2));
  float s = v_new;
  if (vmax) {
    float a = vmax[i];
    s = (a > v_new || a != a) ? a : v_new;
    vmax[i] = s;
  }
  float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(s), bc2_sqrt), epsilon);
  x[i] = __fsub_rn(xi, __fdiv_rn(__fmul_rn(step_size, m_new), denom));
  m[i] = m_new;
  v[i] = v_new;
}

// AdamW, float32, streams X, M, V; the coefficients are AdamWCoeffs::<f32>'s.
extern "C" __global__ void trainops_adamw_f32(float* x, const float* g, float* m, float* v, u64 n, float decay,
                                              float lerp, float beta2, float one_minus_beta2, float bc2_sqrt,
                                              float epsilon, float step_size, int flags) {
  GRID_STRIDE(i, n) {
    adamw_element(x, m, v, (float*)0, i, g[i], decay, lerp, beta2, one_minus_beta2, bc2_sqrt, epsilon, step_size,
                  flags);
  }
}

// AdamW with amsgrad, float32, streams X, M, V, Vmax.
extern "C" __global__ void trainops_adamw_amsgrad_f32(float* x, const float* g, float* m, float* v, float* vmax,
                                                      u64 n, float decay, float lerp, float beta2,
                                                      float one_minus_beta2, float bc2_sqrt, float epsilon,
                                                      float step_size, int flags) {
  GRID_STRIDE(i, n) {
    adamw_element(x, m, v, vmax, i, g[i], decay, lerp, beta2, one_minus_beta2, bc2_sqrt, epsilon, step_size, flags);
  }
}

// ONNX Adagrad, float32; r_adjusted = R / (1 + T * decay_factor).
extern "C" __global__ void trainops_adagrad_f32(float* x, const float* g, float* h, u64 n, float norm,
                                                float epsilon, float r_adjusted) {
  GRID_STRIDE(i, n) {
    float xi = x[i], gi = g[i], hi = h[i];
    float gr = __fadd_rn(__fmul_rn(norm, xi), gi);
    float h_new = __fadd_rn(hi, __fmul_rn(gr, gr));
    float h_sqrt = __fadd_rn(__fsqrt_rn(h_new), epsilon);
    x[i] = __fsub_rn(xi, __fdiv_rn(__fmul_rn(r_adjusted, gr), h_sqrt));
    h[i] = h_new;
  }
}

// ONNX Momentum, float32; nesterov != 0 for mode "nesterov"; beta_adjusted = T > 0 ? beta : 1.
extern "C" __global__ void trainops_momentum_f32(float* x, const float* g, float* v, u64 n, float norm,
                                                 float alpha, float beta_adjusted, float r, int nesterov) {
  GRID_STRIDE(i, n) {
    float xi = x[i], gi = g[i], vi = v[i];
    float gr = __fadd_rn(__fmul_rn(norm, xi), gi);
    float v_new = __fadd_rn(__fmul_rn(alpha, vi), __fmul_rn(beta_adjusted, gr));
    float step = nesterov ? __fadd_rn(gr, __fmul_rn(alpha, v_new)) : v_new;
    x[i] = __fsub_rn(xi, __fmul_rn(r, step));
    v[i] = v_new;
  }
}

// Philox4x32-10 (Random123): the block of counter (s0 + b, carried through 128 bits; s0 least
// significant word) under key (k0, k1), written to w.
__device__ __forceinline__ void philox_block(u32 s0, u32 s1, u32 s2, u32 s3, u32 k0, u32 k1, u64 b, u32 w[4]) {
  u64 lo = ((u64)s1 << 32) | s0;
  u64 hi = ((u64)s3 << 32) | s2;
  u64 sum = lo + b;
  hi += (sum < lo) ? 1ull : 0ull;
  u32 c0 = (u32)sum, c1 = (u32)(sum >> 32), c2 = (u32)hi, c3 = (u32)(hi >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    u32 n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
  }
  w[0] = c0; w[1] = c1; w[2] = c2; w[3] = c3;
}

// Output word i is word i % 4 of philox(C + i / 4, K), C the 128-bit counter state[0..4]
// (state[0] least significant), K = (state[4], state[5]). One thread per 4-word block; the last
// block writes only the words that exist.
extern "C" __global__ void trainops_philox(u32* out, u64 n, const u32* state) {
  u64 blocks = (n + 3) / 4;
  GRID_STRIDE(b, blocks) {
    u32 words[4];
    philox_block(state[0], state[1], state[2], state[3], state[4], state[5], b, words);
    u64 base = b * 4;
    for (int w = 0; w < 4 && base + w < n; ++w) out[base + w] = words[w];
  }
}

// The same words, with the state given by value (the host read it: a CPU input of the op).
extern "C" __global__ void trainops_philox_words(u32* out, u64 n, u32 s0, u32 s1, u32 s2, u32 s3, u32 k0,
                                                 u32 k1) {
  u64 blocks = (n + 3) / 4;
  GRID_STRIDE(b, blocks) {
    u32 words[4];
    philox_block(s0, s1, s2, s3, k0, k1, b, words);
    u64 base = b * 4;
    for (int w = 0; w < 4 && base + w < n; ++w) out[base + w] = words[w];
  }
}

// PhiloxDropout on float32 (crates/trainops-kernels/src/random/dropout.rs): element i is kept
// when (word(i) & 0x7FFFFF) >= keep_from, out[i] = (data[i] * scale) * (keep ? 1 : 0); mask
// (null when not wanted) gets keep. Inference mode is keep_from 0, scale 1. data may be out.
extern "C" __global__ void trainops_dropout_f32(const float* data, float* out, unsigned char* mask, u64 n, u32 s0,
                                                u32 s1, u32 s2, u32 s3, u32 k0, u32 k1, u32 keep_from,
                                                float scale) {
  u64 blocks = (n + 3) / 4;
  GRID_STRIDE(b, blocks) {
    u32 words[4];
    philox_block(s0, s1, s2, s3, k0, k1, b, words);
    u64 base = b * 4;
    for (int w = 0; w < 4 && base + w < n; ++w) {
      u64 i = base + w;
      bool keep = (words[w] & 0x7FFFFFu) >= keep_from;
      out[i] = __fmul_rn(__fmul_rn(data[i], scale), keep ? 1.0f : 0.0f);
      if (mask) mask[i] = keep ? 1 : 0;
    }
  }
}

// PhiloxUniform (crates/trainops-kernels/src/random/uniform.rs `reference`) over `words` words:
// dtype 0 float32, 1 float16, 2 bfloat16: element i from word i, u = bitcast<float>(0x3F800000 |
// (word & mask) << shift) - 1 (exact), then u * range + low in float32, rounded once to the
// 16-bit type; dtype 3 float64: element i from words 2i, 2i+1, u = bitcast<double>(0x3FF... |
// (word0 & 0xFFFFF) << 32 | word1) - 1, then u * range64 + low64 in float64 (words is even).
// range, range64 = high - low computed by the host in each type.
extern "C" __global__ void trainops_uniform(void* out, int dtype, u64 words, u32 s0, u32 s1, u32 s2, u32 s3,
                                            u32 k0, u32 k1, u32 mask, u32 shift, float range, float low,
                                            double range64, double low64) {
  u64 blocks = (words + 3) / 4;
  GRID_STRIDE(b, blocks) {
    u32 w[4];
    philox_block(s0, s1, s2, s3, k0, k1, b, w);
    u64 base = b * 4;
    if (dtype == 3) {
      for (int k = 0; k + 1 < 4 && base + k + 1 < words; k += 2) {
        u64 bits = 0x3FF0000000000000ull | ((u64)(w[k] & 0xFFFFFu) << 32) | (u64)w[k + 1];
        double u = __dsub_rn(__longlong_as_double((long long)bits), 1.0);
        ((double*)out)[(base + k) / 2] = __dadd_rn(__dmul_rn(u, range64), low64);
      }
      continue;
    }
    for (int k = 0; k < 4 && base + k < words; ++k) {
      float u = __fsub_rn(__uint_as_float(0x3F800000u | ((w[k] & mask) << shift)), 1.0f);
      float v = __fadd_rn(__fmul_rn(u, range), low);
      u64 i = base + k;
      if (dtype == 0) {
        ((float*)out)[i] = v;
      } else if (dtype == 1) {
        ((u16*)out)[i] = f32_to_f16(v);
      } else {
        ((u16*)out)[i] = f32_to_bf16(v);
      }
    }
  }
}

// PhiloxNormal (crates/trainops-kernels/src/random/normal.rs: TensorFlow's BoxMullerFloat and
// BoxMullerDouble, the transcendental functions in float64) over n elements. dtype 0 float32,
// 1 float16, 2 bfloat16: elements 2j, 2j+1 from words 2j, 2j+1 (one 4-word block: four
// elements), u1 = max(u(word0), 1e-7f), v1 = float(2pi * double(u(word1))), r =
// sqrt(-2 ln double(u1)), (z0, z1) = float(r sin v1), float(r cos v1), then z * scale + mean in
// float32, rounded once to the 16-bit type; dtype 3 float64: elements 2b, 2b+1 from the block's
// four words, u1 = max(u64(w0, w1), 1e-7), v1 = 2pi * u64(w2, w3), z * scale64 + mean64.
// CUDA's log (1 ulp), sin and cos (2 ulp) are not the CPU's libm: the float64 z may differ in
// its last bits, which the rounding to float32 hides except near a rounding boundary (docs/gpu.md).
__device__ __forceinline__ void box_muller(double u1, double v1, double* z0, double* z1) {
  double r = __dsqrt_rn(__dmul_rn(-2.0, log(u1)));
  double s, c;
  sincos(v1, &s, &c);
  *z0 = __dmul_rn(r, s);
  *z1 = __dmul_rn(r, c);
}

extern "C" __global__ void trainops_normal(void* out, int dtype, u64 n, u32 s0, u32 s1, u32 s2, u32 s3, u32 k0,
                                           u32 k1, float mean, float scale, double mean64, double scale64) {
  const double two_pi = __longlong_as_double(0x401921FB54442D18ll);  // 2 * PI, as f64 2.0 * PI
  u64 blocks = dtype == 3 ? (n + 1) / 2 : (n + 3) / 4;
  GRID_STRIDE(b, blocks) {
    u32 w[4];
    philox_block(s0, s1, s2, s3, k0, k1, b, w);
    if (dtype == 3) {
      u64 b0 = 0x3FF0000000000000ull | ((u64)(w[0] & 0xFFFFFu) << 32) | (u64)w[1];
      u64 b1 = 0x3FF0000000000000ull | ((u64)(w[2] & 0xFFFFFu) << 32) | (u64)w[3];
      double u1 = fmax(__dsub_rn(__longlong_as_double((long long)b0), 1.0), 1.0e-7);
      double v1 = __dmul_rn(two_pi, __dsub_rn(__longlong_as_double((long long)b1), 1.0));
      double z[2];
      box_muller(u1, v1, &z[0], &z[1]);
      for (int k = 0; k < 2 && 2 * b + k < n; ++k) {
        ((double*)out)[2 * b + k] = __dadd_rn(__dmul_rn(z[k], scale64), mean64);
      }
      continue;
    }
    for (int p = 0; p < 2; ++p) {
      u64 base = 4 * b + 2 * p;
      if (base >= n) break;
      float u1 = fmaxf(__fsub_rn(__uint_as_float(0x3F800000u | (w[2 * p] & 0x7FFFFFu)), 1.0f), 1.0e-7f);
      float u2 = __fsub_rn(__uint_as_float(0x3F800000u | (w[2 * p + 1] & 0x7FFFFFu)), 1.0f);
      float v1 = __double2float_rn(__dmul_rn(two_pi, (double)u2));
      double z[2];
      box_muller((double)u1, (double)v1, &z[0], &z[1]);
      for (int k = 0; k < 2 && base + k < n; ++k) {
        float v = __fadd_rn(__fmul_rn(__double2float_rn(z[k]), scale), mean);
        u64 i = base + k;
        if (dtype == 0) {
          ((float*)out)[i] = v;
        } else if (dtype == 1) {
          ((u16*)out)[i] = f32_to_f16(v);
        } else {
          ((u16*)out)[i] = f32_to_bf16(v);
        }
      }
    }
  }
}

// A Philox op's state_out, computed on the host, written on the op's stream (one thread).
extern "C" __global__ void trainops_store_state(u32* out, u32 s0, u32 s1, u32 s2, u32 s3, u32 k0, u32 k1) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  out[0] = s0; out[1] = s1; out[2] = s2; out[3] = s3; out[4] = k0; out[5] = k1;
}

// A one-byte flag (a bool output) set to v, on the op's stream before the checks.
extern "C" __global__ void trainops_set_flag(unsigned char* flag, unsigned char v) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *flag = v;
}

// AllFinite and MixedPrecisionAdam's verdict (crates/trainops-kernels/src/loss_scale/finite.rs):
// *flag = 0 when any element (dtype 0 float32, 1 float16, 2 bfloat16, 3 float64), divided by
// *scale in float32 when scale is not null, is Inf or NaN. Every thread that finds one stores
// the same byte; the host set *flag = 1 first on the same stream.
extern "C" __global__ void trainops_finite(const void* g, int dtype, u64 n, const float* scale, unsigned char* flag) {
  GRID_STRIDE(i, n) {
    bool ok;
    if (dtype == 3) {
      ok = isfinite(((const double*)g)[i]);
    } else {
      float gi = load_f32(g, dtype, i);
      ok = isfinite(scale ? __fdiv_rn(gi, *scale) : gi);
    }
    if (!ok) *flag = 0;
  }
}

// MixedPrecisionAdam, float32 master weights, gradient of type gtype (as load_f32): Adam on
// g / *scale (crates/trainops-kernels/src/optim/adam/mod.rs `update` with a loss scale), every
// element skipped when *finite is 0 (the verdict of trainops_finite over every gradient of the
// node, on the same stream: no host synchronisation). x, v, h are the outputs, already holding
// the inputs.
extern "C" __global__ void trainops_mp_adam(float* x, const void* g, int gtype, float* v, float* h, u64 n,
                                            const float* scale, const unsigned char* finite, float norm, float alpha,
                                            float one_minus_alpha, float beta, float one_minus_beta, float epsilon,
                                            float r_adjusted, float one_minus_post) {
  if (!*finite) return;
  float s = *scale;
  GRID_STRIDE(i, n) {
    adam_element(x, v, h, i, __fdiv_rn(load_f32(g, gtype, i), s), norm, alpha, one_minus_alpha, beta,
                 one_minus_beta, epsilon, r_adjusted, one_minus_post);
  }
}

// MixedPrecisionAdam's float16 copies: out[i] = x[i] rounded to float16 (nearest even).
extern "C" __global__ void trainops_cast_f16(const float* x, u16* out, u64 n) {
  GRID_STRIDE(i, n) { out[i] = f32_to_f16(x[i]); }
}

// MixedPrecisionAdam's bfloat16 copies (f32_to_bf16).
extern "C" __global__ void trainops_cast_bf16(const float* x, u16* out, u64 n) {
  GRID_STRIDE(i, n) { out[i] = f32_to_bf16(x[i]); }
}

// DynamicLossScale (crates/trainops-kernels/src/loss_scale/rule.rs `LossScaleRule::next`), one
// thread: the inputs are read before any output is written (outputs may alias them).
extern "C" __global__ void trainops_loss_scale(const float* scale, const long long* good_steps,
                                               const unsigned char* finite, float* new_scale,
                                               long long* new_good_steps, long long growth_interval,
                                               float growth_factor, float backoff_factor, float min_scale) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  float s = *scale;
  long long good = *good_steps;
  bool ok = *finite != 0;
  float out_scale;
  long long out_good;
  if (!ok) {
    // Rust's f32::max: the other operand when one is NaN, as fmaxf.
    out_scale = fmaxf(__fmul_rn(s, backoff_factor), min_scale);
    out_good = 0;
  } else {
    long long steps = good == 0x7FFFFFFFFFFFFFFFll ? good : good + 1;  // saturating_add(1)
    if (steps == growth_interval) {
      float grown = __fmul_rn(s, growth_factor);
      out_scale = isfinite(grown) ? grown : s;
      out_good = 0;
    } else {
      out_scale = s;
      out_good = steps;
    }
  }
  *new_scale = out_scale;
  *new_good_steps = out_good;
}

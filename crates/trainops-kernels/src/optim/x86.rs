//! What the optimizers' x86 kernels share: the stream pointers of one chunk ([`Ptrs`]), the
//! scalar tail ([`tail`]), the vector operation sets (`ps512`, `pd512`, `ps256`, `pd256`),
//! the 16-bit loads and stores (`f16x16`, `bf16x16`) and [`simd_kernels!`], which names an
//! optimizer's kernels and writes its `try_simd` dispatch.
//!
//! An optimizer's `x86.rs` writes only its lane body (a macro, expanded inside each
//! `#[target_feature]` kernel, doing the reference's operations in the reference's order,
//! with a fused multiply-add exactly where the reference has one: only AdamW, after
//! PyTorch) and instantiates `simd_kernels!`. Every IEEE operation rounds the
//! same in a vector lane as in a scalar register, and the 16-bit conversions round to nearest
//! even exactly as `half` does, so every kernel is bitwise equal to the scalar reference.

use core::arch::x86_64::*;

use half::{bf16, f16};

use super::Param;
use crate::Element;

/// Read and write pointers of one chunk's `N` streams (weights first) and its gradient: a
/// stream's source may equal its destination (in place), and then every element is read
/// before it is written.
pub struct Ptrs<X, G, const N: usize> {
    /// `(source, destination)` of each stream.
    pub s: [(*const X, *mut X); N],
    /// Gradient (read only).
    pub g: *const G,
}

impl<X: Element, G: Element, const N: usize> Ptrs<X, G, N> {
    /// The pointers of `p`'s streams and gradient.
    pub fn of(p: &mut Param<'_, X, G, N>) -> Self {
        Ptrs { s: core::array::from_fn(|k| p.streams[k].as_ptrs()), g: p.g.as_ptr() }
    }
}

impl<X, G, const N: usize> Ptrs<X, G, N> {
    /// The same addresses as pointers to `U` and `H` (a pointer cast; reading them is the
    /// kernel's business, under its safety contract).
    pub fn cast<U, H>(self) -> Ptrs<U, H, N> {
        Ptrs { s: self.s.map(|(s, d)| (s.cast::<U>(), d.cast::<U>())), g: self.g.cast() }
    }
}

/// The scalar tail `[from, n)` with the portable `update` (bitwise what the lanes compute).
///
/// # Safety
/// Every pointer of `p` is valid for `n` reads (and writes, for the destinations); sources
/// equal their destinations or do not overlap them.
#[inline(always)]
pub unsafe fn tail<X: Element, G: Element<C = X::C>, const N: usize>(
    p: &Ptrs<X, G, N>,
    from: usize,
    n: usize,
    update: impl Fn([X::C; N], X::C) -> [X::C; N],
) {
    for i in from..n {
        // SAFETY: i < n, and the caller guarantees n valid elements behind each pointer;
        // every stream's element is read before any is written.
        unsafe {
            let new = update(core::array::from_fn(|k| p.s[k].0.add(i).read().load()), p.g.add(i).read().load());
            for (k, v) in new.into_iter().enumerate() {
                p.s[k].1.add(i).write(X::store(v));
            }
        }
    }
}

/// The vector operations of one register width and element type, one name each, so that a
/// kernel names its set once.
pub mod ps512 {
    pub use core::arch::x86_64::{
        _mm512_add_ps as add, _mm512_div_ps as div, _mm512_fmadd_ps as fmadd, _mm512_loadu_ps as load,
        _mm512_mul_ps as mul, _mm512_set1_ps as set1, _mm512_sqrt_ps as sqrt, _mm512_storeu_ps as store,
        _mm512_sub_ps as sub,
    };

    /// The bits of `a` xor `b` (a sign flip with `b = -0.0`).
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub fn xor(a: core::arch::x86_64::__m512, b: core::arch::x86_64::__m512) -> core::arch::x86_64::__m512 {
        use core::arch::x86_64::*;
        _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)))
    }

    /// Per lane `a` where `a > b` or `a` is NaN, else `b` (selection only: bits kept).
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub fn keep_max(a: core::arch::x86_64::__m512, b: core::arch::x86_64::__m512) -> core::arch::x86_64::__m512 {
        use core::arch::x86_64::*;
        let take_a = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b) | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, a);
        _mm512_mask_blend_ps(take_a, b, a)
    }
}
/// See [`ps512`].
pub mod pd512 {
    pub use core::arch::x86_64::{
        _mm512_add_pd as add, _mm512_div_pd as div, _mm512_fmadd_pd as fmadd, _mm512_loadu_pd as load,
        _mm512_mul_pd as mul, _mm512_set1_pd as set1, _mm512_sqrt_pd as sqrt, _mm512_storeu_pd as store,
        _mm512_sub_pd as sub,
    };

    /// The bits of `a` xor `b` (a sign flip with `b = -0.0`).
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub fn xor(a: core::arch::x86_64::__m512d, b: core::arch::x86_64::__m512d) -> core::arch::x86_64::__m512d {
        use core::arch::x86_64::*;
        _mm512_castsi512_pd(_mm512_xor_si512(_mm512_castpd_si512(a), _mm512_castpd_si512(b)))
    }

    /// See [`super::ps512::keep_max`].
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub fn keep_max(a: core::arch::x86_64::__m512d, b: core::arch::x86_64::__m512d) -> core::arch::x86_64::__m512d {
        use core::arch::x86_64::*;
        let take_a = _mm512_cmp_pd_mask::<_CMP_GT_OQ>(a, b) | _mm512_cmp_pd_mask::<_CMP_UNORD_Q>(a, a);
        _mm512_mask_blend_pd(take_a, b, a)
    }
}
/// See [`ps512`].
pub mod ps256 {
    pub use core::arch::x86_64::{
        _mm256_add_ps as add, _mm256_div_ps as div, _mm256_fmadd_ps as fmadd, _mm256_loadu_ps as load,
        _mm256_mul_ps as mul, _mm256_set1_ps as set1, _mm256_sqrt_ps as sqrt, _mm256_storeu_ps as store,
        _mm256_sub_ps as sub, _mm256_xor_ps as xor,
    };

    /// See [`super::ps512::keep_max`].
    #[target_feature(enable = "avx2")]
    #[inline]
    pub fn keep_max(a: core::arch::x86_64::__m256, b: core::arch::x86_64::__m256) -> core::arch::x86_64::__m256 {
        use core::arch::x86_64::*;
        let take_a = _mm256_or_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(a, b), _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a));
        _mm256_blendv_ps(b, a, take_a)
    }
}
/// See [`ps512`].
pub mod pd256 {
    pub use core::arch::x86_64::{
        _mm256_add_pd as add, _mm256_div_pd as div, _mm256_fmadd_pd as fmadd, _mm256_loadu_pd as load,
        _mm256_mul_pd as mul, _mm256_set1_pd as set1, _mm256_sqrt_pd as sqrt, _mm256_storeu_pd as store,
        _mm256_sub_pd as sub, _mm256_xor_pd as xor,
    };

    /// See [`super::ps512::keep_max`].
    #[target_feature(enable = "avx2")]
    #[inline]
    pub fn keep_max(a: core::arch::x86_64::__m256d, b: core::arch::x86_64::__m256d) -> core::arch::x86_64::__m256d {
        use core::arch::x86_64::*;
        let take_a = _mm256_or_pd(_mm256_cmp_pd::<_CMP_GT_OQ>(a, b), _mm256_cmp_pd::<_CMP_UNORD_Q>(a, a));
        _mm256_blendv_pd(b, a, take_a)
    }
}

/// How far ahead of a stream's current element [`prefetch`] asks for its cache line, in
/// bytes. Adam's divide and square root hold the out-of-order window long enough that the
/// hardware prefetchers alone leave its loads waiting on memory: with 16-bit streams, where
/// each step moves half the bytes for the same arithmetic, that cost 0.75-0.81x float32
/// Adam's bytes per second on an Intel Xeon (Sapphire Rapids), and 0.85-0.96x with the hint.
/// 1-2 KiB ahead measured best there (256: 0.83, 4096: 0.83-0.90).
pub const PREFETCH_AHEAD: usize = 1024;

/// Asks for the cache line [`PREFETCH_AHEAD`] bytes past `p` into L1: a hint, which never
/// faults at any address (so past a buffer's end too) and changes no result.
#[inline(always)]
pub fn prefetch<T>(p: *const T) {
    // SAFETY: `prefetcht0` reads nothing architecturally and never faults; the address is
    // made with wrapping arithmetic, so no out-of-bounds pointer is formed by `add`.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>().wrapping_add(PREFETCH_AHEAD)) }
}

/// Stores 32 bytes at `p` (unaligned) as a plain `vmovdqu`. Written as assembly so that the
/// compiler cannot fold the narrowing before it into the store: `vpmovdw` and `vcvtps2ph`
/// with a memory operand are several times slower than in a register on AMD Zen 4 (the
/// bfloat16 kernels measured 2x slower in cache with the folded form).
///
/// # Safety
/// `p` is valid for 32 bytes of writes.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_ymm(p: *mut __m256i, v: __m256i) {
    // SAFETY: `p` is valid for 32 bytes (caller); `vmovdqu` needs no alignment, touches no
    // flags and no other memory, and AVX is implied by this function's AVX-512F.
    unsafe {
        core::arch::asm!("vmovdqu ymmword ptr [{p}], {v}", p = in(reg) p, v = in(ymm_reg) v, options(nostack, preserves_flags));
    }
}

/// 16 float16 values widened to and narrowed from `f32` lanes (AVX-512F's conversions:
/// widening is exact and narrowing rounds to nearest even, like `half`'s).
pub mod f16x16 {
    use super::*;

    /// 16 float16 values at `p` as `f32` lanes.
    ///
    /// # Safety
    /// `p` is valid for 16 reads.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn load(p: *const f16) -> __m512 {
        // SAFETY: 16 two-byte values at `p` (caller); unaligned loads are allowed.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }

    /// The 16 lanes of `v` rounded to float16 (nearest even) at `p`.
    ///
    /// # Safety
    /// `p` is valid for 16 writes.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn store(p: *mut f16, v: __m512) {
        let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
        // SAFETY: 16 two-byte values at `p` (caller).
        unsafe { store_ymm(p.cast(), h) }
    }
}

/// 16 bfloat16 values widened to and narrowed from `f32` lanes, with AVX-512F integer
/// operations: widening moves the bits to the high half (exact; a signalling NaN stays signalling, where
/// `half` quiets it, but every kernel's first use of a loaded value is an IEEE operation,
/// which quiets it the same way, so the results agree: the harness's signalling-NaN case); narrowing rounds to nearest
/// even and quiets NaN (keeping its sign and high payload) exactly as `half::bf16::from_f32`.
/// (CPUs with AVX512_BF16 use [`bf16x16_native`], which falls back to this narrowing for
/// vectors holding a subnormal: `vcvtneps2bf16` flushes subnormal inputs to zero.)
pub mod bf16x16 {
    use super::*;

    /// 16 bfloat16 values at `p` as `f32` lanes.
    ///
    /// # Safety
    /// `p` is valid for 16 reads.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn load(p: *const bf16) -> __m512 {
        // SAFETY: 16 two-byte values at `p` (caller); unaligned loads are allowed.
        unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())))) }
    }

    /// The 16 lanes of `v` rounded to bfloat16 (nearest even) at `p`.
    ///
    /// # Safety
    /// `p` is valid for 16 writes.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn store(p: *mut bf16, v: __m512) {
        let b = _mm512_castps_si512(v);
        let high = _mm512_srli_epi32::<16>(b);
        // bits + 0x7FFF + (bit 16): carries into the high half exactly when the low half is
        // above one half, or equal to it with an odd high half.
        let bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
        let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        let words = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
        // SAFETY: 16 two-byte values at `p` (caller).
        unsafe { store_ymm(p.cast(), words) }
    }
}

/// bfloat16 loads and stores for CPUs with AVX512_BF16 (and the AVX512BW/DQ/VL that every
/// such CPU has; [`crate::simd::Avx512Bf16`] proves all of them). Narrowing is
/// `vcvtneps2bf16`: round to nearest even and NaN quieted as `half` does, one instruction,
/// except that it reads subnormal inputs as zero; a vector holding any subnormal (one
/// `vfpclassps` test) goes through [`bf16x16::store`] instead. Widening is one zero-masked
/// `vpermw` that puts each 16-bit word in the high half of its 32-bit lane (the same bits as
/// [`bf16x16::load`], one operation fewer: on Intel cores the 512-bit vector operations
/// share two ports, and bfloat16 Adam issues 4 widenings and 3 narrowings per 16 elements).
pub mod bf16x16_native {
    use super::*;

    /// Word `2k + 1` of the widened vector is word `k` of the loaded 16 (the even words
    /// are zeroed by the mask).
    const WIDEN: [u16; 32] = {
        let mut idx = [0u16; 32];
        let mut j = 0;
        while j < 32 {
            idx[j] = (j / 2) as u16;
            j += 1;
        }
        idx
    };

    /// 16 bfloat16 values at `p` as `f32` lanes (exact; bits as [`bf16x16::load`]).
    ///
    /// # Safety
    /// `p` is valid for 16 reads.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    pub unsafe fn load(p: *const bf16) -> __m512 {
        // SAFETY: 16 two-byte values at `p` (caller); unaligned loads are allowed; `WIDEN`
        // is 64 bytes.
        unsafe {
            let w = _mm512_castsi256_si512(_mm256_loadu_si256(p.cast()));
            let idx = _mm512_loadu_si512(WIDEN.as_ptr().cast());
            let odd: __mmask32 = 0xAAAA_AAAA;
            let out: __m512i;
            // Assembly, because the compiler rewrites the zero-masked `vpermw` as an
            // unmasked one and a `vpandq`: one more operation on the busy ports.
            core::arch::asm!(
                "vpermw {out} {{{k}}}{{z}}, {idx}, {w}",
                out = out(zmm_reg) out, k = in(kreg) odd, idx = in(zmm_reg) idx, w = in(zmm_reg) w,
                options(pure, nomem, nostack, preserves_flags)
            );
            _mm512_castsi512_ps(out)
        }
    }

    /// The 16 lanes of `v` rounded to bfloat16 (nearest even) at `p`.
    ///
    /// # Safety
    /// `p` is valid for 16 writes.
    #[target_feature(enable = "avx512f,avx512bf16,avx512dq")]
    #[inline]
    pub unsafe fn store(p: *mut bf16, v: __m512) {
        // 0x20: the denormal class, either sign.
        if _mm512_fpclass_ps_mask::<0x20>(v) != 0 {
            // SAFETY: as for this function.
            return unsafe { bf16x16::store(p, v) };
        }
        // SAFETY: `__m256bh` and `__m256i` are both 32 bytes of plain bits.
        let words: __m256i = unsafe { core::mem::transmute(_mm512_cvtneps_pbh(v)) };
        // SAFETY: 16 two-byte values at `p` (caller).
        unsafe { store_ymm(p.cast(), words) }
    }
}

/// An optimizer's x86 kernels and their dispatch. Given the optimizer's lane-body macro
/// (`$lanes!(c, p, n, LANES, set, load_x, store_x, load_g)`), its coefficient type, its stream
/// count, its scalar update (`|c, streams, g| -> streams`) and the kernels' names, it writes
/// each `#[target_feature]` kernel and `try_simd`, which runs the kernel of a level for the
/// weight and gradient types (matched by `TypeId`) or hands the chunk back.
///
/// Kernels: `f32`, `f64` on AVX-512F and AVX2; float16 / bfloat16 weights (and state) with
/// gradients of the same type, and `f32` weights with 16-bit gradients, on AVX-512F.
macro_rules! simd_kernels {
    (
        $lanes:ident, $coeffs:ident, $n:literal, $update:expr,
        [$f32_512:ident, $f16_512:ident, $bf16_512:ident, $bf16_512bf16:ident, $f32_f16_512:ident,
         $f32_bf16_512:ident, $f64_512:ident, $f32_256:ident, $f64_256:ident $(,)?]
    ) => {
        /// Runs the SIMD kernel of `level` for weights `X` and gradients `G` on `p`, or hands
        /// `p` back when there is none (a scalar level, 16-bit types on AVX2, other pairs).
        pub(crate) fn try_simd<'a, X: $crate::Element, G: $crate::Element<C = X::C>>(
            level: $crate::simd::Level,
            c: &$coeffs<X::C>,
            mut p: $crate::optim::Param<'a, X, G, $n>,
        ) -> Result<(), $crate::optim::Param<'a, X, G, $n>> {
            use core::any::{Any, TypeId};
            use $crate::simd::Isa;
            let pair = (TypeId::of::<X>(), TypeId::of::<G>());
            let (f32_, f64_) = (TypeId::of::<f32>(), TypeId::of::<f64>());
            let (f16_, bf16_) = (TypeId::of::<half::f16>(), TypeId::of::<half::bf16>());
            let n = p.g.len();
            let ptrs = $crate::optim::x86::Ptrs::of(&mut p);
            let c: &dyn Any = c;
            let c32 = || c.downcast_ref::<$coeffs<f32>>().expect("16- and 32-bit weights compute in f32");
            let c64 = || c.downcast_ref::<$coeffs<f64>>().expect("the compute type of f64 weights is f64");
            // Every arm: the token proves the kernel's instruction set; the TypeIds prove
            // that `X` and `G` are the kernel's types, so the cast pointers are the streams'
            // own; each stream and the gradient hold `n` elements (`Optimizer::param`
            // checked), and an InOut's source is its destination or does not overlap it.
            match level.isa() {
                Some(Isa::Avx512(t)) if pair == (f32_, f32_) => {
                    // SAFETY: as said above the match, for this kernel's types and set.
                    unsafe { $f32_512(t, c32(), ptrs.cast(), n) }
                }
                Some(Isa::Avx512(t)) if pair == (f16_, f16_) => {
                    // SAFETY: as said above the match, for this kernel's types and set.
                    unsafe { $f16_512(t, c32(), ptrs.cast(), n) }
                }
                Some(Isa::Avx512(t)) if pair == (bf16_, bf16_) => match t.with_bf16() {
                    // SAFETY: as said above the match, for this kernel's types and set.
                    Some(tb) => unsafe { $bf16_512bf16(tb, c32(), ptrs.cast(), n) },
                    // SAFETY: as said above the match, for this kernel's types and set.
                    None => unsafe { $bf16_512(t, c32(), ptrs.cast(), n) },
                },
                Some(Isa::Avx512(t)) if pair == (f32_, f16_) => {
                    // SAFETY: as said above the match, for this kernel's types and set.
                    unsafe { $f32_f16_512(t, c32(), ptrs.cast(), n) }
                }
                Some(Isa::Avx512(t)) if pair == (f32_, bf16_) => {
                    // SAFETY: as said above the match, for this kernel's types and set.
                    unsafe { $f32_bf16_512(t, c32(), ptrs.cast(), n) }
                }
                Some(Isa::Avx512(t)) if pair == (f64_, f64_) => {
                    // SAFETY: as said above the match, for this kernel's types and set.
                    unsafe { $f64_512(t, c64(), ptrs.cast(), n) }
                }
                Some(Isa::Avx2(t)) if pair == (f32_, f32_) => {
                    // SAFETY: as said above the match, for this kernel's types and set.
                    unsafe { $f32_256(t, c32(), ptrs.cast(), n) }
                }
                Some(Isa::Avx2(t)) if pair == (f64_, f64_) => {
                    // SAFETY: as said above the match, for this kernel's types and set.
                    unsafe { $f64_256(t, c64(), ptrs.cast(), n) }
                }
                _ => return Err(p),
            }
            Ok(())
        }

        /// `f32`, 16 lanes.
        ///
        /// # Safety
        /// Every pointer of `p` is valid for `n` reads (and writes, for the destinations);
        /// sources equal their destinations or do not overlap them.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn $f32_512(
            _: $crate::simd::Avx512,
            c: &$coeffs<f32>,
            p: $crate::optim::x86::Ptrs<f32, f32, $n>,
            n: usize,
        ) {
            $lanes!(c, p, n, 16, ps512, ps512::load, ps512::store, ps512::load);
            // SAFETY: the caller's guarantee covers the tail.
            unsafe { $crate::optim::x86::tail(&p, n - n % 16, n, |s, g| $update(c, s, g)) }
        }

        /// float16 weights, state and gradients, computed in `f32`, 16 lanes.
        ///
        /// # Safety
        /// As for the `f32` kernel.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn $f16_512(
            _: $crate::simd::Avx512,
            c: &$coeffs<f32>,
            p: $crate::optim::x86::Ptrs<half::f16, half::f16, $n>,
            n: usize,
        ) {
            $lanes!(c, p, n, 16, ps512, f16x16::load, f16x16::store, f16x16::load);
            // SAFETY: the caller's guarantee covers the tail.
            unsafe { $crate::optim::x86::tail(&p, n - n % 16, n, |s, g| $update(c, s, g)) }
        }

        /// bfloat16 weights, state and gradients, computed in `f32`, 16 lanes.
        ///
        /// # Safety
        /// As for the `f32` kernel.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn $bf16_512(
            _: $crate::simd::Avx512,
            c: &$coeffs<f32>,
            p: $crate::optim::x86::Ptrs<half::bf16, half::bf16, $n>,
            n: usize,
        ) {
            $lanes!(c, p, n, 16, ps512, bf16x16::load, bf16x16::store, bf16x16::load);
            // SAFETY: the caller's guarantee covers the tail.
            unsafe { $crate::optim::x86::tail(&p, n - n % 16, n, |s, g| $update(c, s, g)) }
        }

        /// bfloat16 weights, state and gradients with AVX512_BF16's narrowing, 16 lanes.
        ///
        /// # Safety
        /// As for the `f32` kernel.
        #[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512dq,avx512vl")]
        pub unsafe fn $bf16_512bf16(
            _: $crate::simd::Avx512Bf16,
            c: &$coeffs<f32>,
            p: $crate::optim::x86::Ptrs<half::bf16, half::bf16, $n>,
            n: usize,
        ) {
            $lanes!(c, p, n, 16, ps512, bf16x16_native::load, bf16x16_native::store, bf16x16_native::load);
            // SAFETY: the caller's guarantee covers the tail.
            unsafe { $crate::optim::x86::tail(&p, n - n % 16, n, |s, g| $update(c, s, g)) }
        }

        /// `f32` weights with float16 gradients, 16 lanes.
        ///
        /// # Safety
        /// As for the `f32` kernel.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn $f32_f16_512(
            _: $crate::simd::Avx512,
            c: &$coeffs<f32>,
            p: $crate::optim::x86::Ptrs<f32, half::f16, $n>,
            n: usize,
        ) {
            $lanes!(c, p, n, 16, ps512, ps512::load, ps512::store, f16x16::load);
            // SAFETY: the caller's guarantee covers the tail.
            unsafe { $crate::optim::x86::tail(&p, n - n % 16, n, |s, g| $update(c, s, g)) }
        }

        /// `f32` weights with bfloat16 gradients, 16 lanes.
        ///
        /// # Safety
        /// As for the `f32` kernel.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn $f32_bf16_512(
            _: $crate::simd::Avx512,
            c: &$coeffs<f32>,
            p: $crate::optim::x86::Ptrs<f32, half::bf16, $n>,
            n: usize,
        ) {
            $lanes!(c, p, n, 16, ps512, ps512::load, ps512::store, bf16x16::load);
            // SAFETY: the caller's guarantee covers the tail.
            unsafe { $crate::optim::x86::tail(&p, n - n % 16, n, |s, g| $update(c, s, g)) }
        }

        /// `f64`, 8 lanes.
        ///
        /// # Safety
        /// As for the `f32` kernel.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn $f64_512(
            _: $crate::simd::Avx512,
            c: &$coeffs<f64>,
            p: $crate::optim::x86::Ptrs<f64, f64, $n>,
            n: usize,
        ) {
            $lanes!(c, p, n, 8, pd512, pd512::load, pd512::store, pd512::load);
            // SAFETY: the caller's guarantee covers the tail.
            unsafe { $crate::optim::x86::tail(&p, n - n % 8, n, |s, g| $update(c, s, g)) }
        }

        /// `f32`, 8 lanes.
        ///
        /// # Safety
        /// As for the AVX-512 `f32` kernel.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn $f32_256(
            _: $crate::simd::Avx2,
            c: &$coeffs<f32>,
            p: $crate::optim::x86::Ptrs<f32, f32, $n>,
            n: usize,
        ) {
            $lanes!(c, p, n, 8, ps256, ps256::load, ps256::store, ps256::load);
            // SAFETY: the caller's guarantee covers the tail.
            unsafe { $crate::optim::x86::tail(&p, n - n % 8, n, |s, g| $update(c, s, g)) }
        }

        /// `f64`, 4 lanes.
        ///
        /// # Safety
        /// As for the AVX-512 `f32` kernel.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn $f64_256(
            _: $crate::simd::Avx2,
            c: &$coeffs<f64>,
            p: $crate::optim::x86::Ptrs<f64, f64, $n>,
            n: usize,
        ) {
            $lanes!(c, p, n, 4, pd256, pd256::load, pd256::store, pd256::load);
            // SAFETY: the caller's guarantee covers the tail.
            unsafe { $crate::optim::x86::tail(&p, n - n % 4, n, |s, g| $update(c, s, g)) }
        }
    };
}
pub(crate) use simd_kernels;

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::{bf16x16, f16x16};
    use crate::simd::{Isa, Level};
    use crate::test_util::uniform;

    /// Bit patterns: every special class, ties and near-ties at both 16-bit widths, then
    /// random words.
    fn patterns() -> Vec<u32> {
        let mut v = vec![
            0,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0000,
            0xFFC0_0001,
            0x7F80_0001,
            0xFF80_FFFF,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
            0x0000_0001,
            0x807F_FFFF,
            0x0080_0000,
            0x0000_8000,
            0x0001_8000,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_8001,
            0x3F80_7FFF,
            0x3380_0000,
            0x3380_0001,
            0x4780_0000,
            0x477F_F000,
            0x477F_EFFF,
            0x3300_0000,
            0x387F_E000,
            0x3880_1000,
            0x3880_3000,
        ];
        let mut rnd = uniform(5);
        v.extend((0..1 << 16).map(|_| ((rnd() + 0.5) * 4_294_967_296.0) as u32));
        // Every bfloat16 and float16 rounding neighbourhood of random high halves.
        v.extend((0..1 << 14).flat_map(|k| {
            let hi = (k as u32).wrapping_mul(0x9E37) << 16;
            [hi | 0x7FFF, hi | 0x8000, hi | 0x8001, hi | 0x1000, hi | 0x0FFF]
        }));
        v.extend((0..1 << 16).map(|k: u32| 0x3000_0000 + (k << 11)));
        while v.len() % 16 != 0 {
            v.push(0);
        }
        v
    }

    #[test]
    fn sixteen_bit_stores_round_as_half_does() {
        let Some(Isa::Avx512(_)) = Level::Avx512.isa() else { return };
        let words = patterns();
        let xs: Vec<f32> = words.iter().map(|&w| f32::from_bits(w)).collect();
        let (mut h, mut b) = (vec![f16::ZERO; xs.len()], vec![bf16::ZERO; xs.len()]);
        for i in (0..xs.len()).step_by(16) {
            // SAFETY: AVX-512F is available (the token above), and 16 elements from `i`
            // are in bounds of each buffer (lengths are multiples of 16).
            unsafe {
                let v = core::arch::x86_64::_mm512_loadu_ps(xs.as_ptr().add(i));
                f16x16::store(h.as_mut_ptr().add(i), v);
                bf16x16::store(b.as_mut_ptr().add(i), v);
            }
        }
        for (i, &x) in xs.iter().enumerate() {
            assert_eq!(h[i].to_bits(), f16::from_f32(x).to_bits(), "f16 of {:#010x}", words[i]);
            assert_eq!(b[i].to_bits(), bf16::from_f32(x).to_bits(), "bf16 of {:#010x}", words[i]);
        }
        let Some(Isa::Avx512(t)) = Level::Avx512.isa() else { return };
        let Some(_) = t.with_bf16() else { return };
        // One subnormal in a vector of 16, and vectors with none (the fast path).
        let mut n = vec![bf16::ZERO; xs.len()];
        for i in (0..xs.len()).step_by(16) {
            // SAFETY: AVX-512F and AVX512_BF16 are available (the token above), and 16
            // elements from `i` are in bounds of each buffer.
            unsafe { native_store(n.as_mut_ptr().add(i), xs.as_ptr().add(i)) };
        }
        for (i, &x) in xs.iter().enumerate() {
            assert_eq!(n[i].to_bits(), bf16::from_f32(x).to_bits(), "native bf16 of {:#010x}", words[i]);
        }
    }

    /// [`bf16x16_native::store`] of 16 `f32` at `x`.
    ///
    /// # Safety
    /// AVX512_BF16 is available; 16 elements at `p` and `x`.
    #[target_feature(enable = "avx512f,avx512bf16,avx512dq")]
    unsafe fn native_store(p: *mut bf16, x: *const f32) {
        // SAFETY: as for this function.
        unsafe { super::bf16x16_native::store(p, core::arch::x86_64::_mm512_loadu_ps(x)) }
    }

    #[test]
    fn sixteen_bit_loads_widen_every_value_as_half_does() {
        let Some(Isa::Avx512(_)) = Level::Avx512.isa() else { return };
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let (h, b): (Vec<f16>, Vec<bf16>) = all.iter().map(|&w| (f16::from_bits(w), bf16::from_bits(w))).unzip();
        let (mut hw, mut bw) = (vec![0f32; all.len()], vec![0f32; all.len()]);
        for i in (0..all.len()).step_by(16) {
            // SAFETY: AVX-512F is available (the token above), and 16 elements from `i`
            // are in bounds of each buffer (65536 is a multiple of 16).
            unsafe {
                core::arch::x86_64::_mm512_storeu_ps(hw.as_mut_ptr().add(i), f16x16::load(h.as_ptr().add(i)));
                core::arch::x86_64::_mm512_storeu_ps(bw.as_mut_ptr().add(i), bf16x16::load(b.as_ptr().add(i)));
            }
        }
        for i in 0..all.len() {
            assert_eq!(hw[i].to_bits(), h[i].to_f32().to_bits(), "f16 {:#06x}", all[i]);
            // bfloat16: exact, signalling NaN left signalling (`half` quiets it).
            let quiet = if bw[i].is_nan() { 0x0040_0000 } else { 0 };
            assert_eq!(bw[i].to_bits() | quiet, b[i].to_f32().to_bits(), "bf16 {:#06x}", all[i]);
            assert_eq!(bw[i].to_bits(), u32::from(all[i]) << 16);
        }
        // AVX512_BF16's path widens with `vpermw`: the same bits for every word.
        let Some(Isa::Avx512(t)) = Level::Avx512.isa() else { return };
        let Some(_) = t.with_bf16() else { return };
        let mut nw = vec![0f32; all.len()];
        for i in (0..all.len()).step_by(16) {
            // SAFETY: AVX512_BF16 and BW are available (the token above), and 16 elements
            // from `i` are in bounds of each buffer.
            unsafe { native_load(nw.as_mut_ptr().add(i), b.as_ptr().add(i)) };
        }
        for i in 0..all.len() {
            assert_eq!(nw[i].to_bits(), u32::from(all[i]) << 16, "native bf16 {:#06x}", all[i]);
        }
    }

    /// [`bf16x16_native::load`] of 16 bfloat16 at `p` into `x`.
    ///
    /// # Safety
    /// AVX512_BF16 (and so BW) is available; 16 elements at `p` and `x`.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn native_load(x: *mut f32, p: *const bf16) {
        // SAFETY: as for this function.
        unsafe { core::arch::x86_64::_mm512_storeu_ps(x, super::bf16x16_native::load(p)) }
    }
}

//! The Philox-stream ops on a CUDA device: the host half of a call ([`StreamPlan`]: the
//! dimensions, the state from the host input, the state after the call, the dropout's
//! threshold and scale), made with the CPU kernels' own functions, so the device draws the
//! words the CPU would and `state_out` is the CPU's. The device kernels (`trainops.cu`:
//! `trainops_philox_words`, `trainops_dropout_f32`) then do one thread per 4-word block `b`
//! of counter `state + b`.

use trainops_kernels::random::dropout::{keep_from, scale_f32};
use trainops_kernels::random::philox::{advance, blocks_for};

use super::state::{read_state, OutputShape};
use crate::error::{Error, Result};
#[cfg(test)]
use crate::ffi::device::launch_shape;
use crate::ffi::device::{NormalArgs, PlanFn, StreamPlan, UniformArgs};
use crate::ffi::{Context, DType};
use crate::ops::io;

/// The plan of a `Philox` node with output shape `shape` (attribute or host `shape` input).
pub fn philox(shape: OutputShape) -> PlanFn {
    Box::new(move |ctx: &Context<'_>| {
        let (state, _) = read_state(ctx, "Philox")?;
        let (dims, count) = shape.dims(ctx)?;
        Ok(StreamPlan { dims, state, next: advance(&state, blocks_for(count)), dropout: None })
    })
}

/// The plan of a `PhiloxUniform` node with output shape `shape` and type `dtype`: one word an
/// element, two for float64 (as `uniform::words_for`).
pub fn uniform(shape: OutputShape, dtype: DType) -> PlanFn {
    let per = if dtype == DType::Double { 2 } else { 1 };
    Box::new(move |ctx: &Context<'_>| {
        let (state, _) = read_state(ctx, "PhiloxUniform")?;
        let (dims, count) = shape.dims(ctx)?;
        Ok(StreamPlan { dims, state, next: advance(&state, blocks_for(count * per)), dropout: None })
    })
}

/// `trainops_uniform`'s arguments for output type `dtype` and the node's `low`, `high`: the
/// word bits of each type's uniform (`trainops_kernels::random::convert`'s `F32_BITS`,
/// `F16_BITS`, `BF16_BITS`) and the range in each compute type, as `uniform::fill` makes it.
pub fn uniform_args(dtype: DType, low: f32, high: f32) -> UniformArgs {
    let (code, mask, shift) = match dtype {
        DType::Float16 => (1, 0x03FF, 13),
        DType::BFloat16 => (2, 0x007F, 16),
        DType::Double => (3, 0, 0),
        _ => (0, 0x007F_FFFF, 0),
    };
    UniformArgs {
        dtype: code,
        mask,
        shift,
        range: high - low,
        low,
        range64: f64::from(high) - f64::from(low),
        low64: f64::from(low),
    }
}

/// The plan of a `PhiloxNormal` node with output shape `shape` and type `dtype`: two words a
/// pair of elements, four for float64 (as `normal::words_for`).
pub fn normal(shape: OutputShape, dtype: DType) -> PlanFn {
    let per_pair = if dtype == DType::Double { 4 } else { 2 };
    Box::new(move |ctx: &Context<'_>| {
        let (state, _) = read_state(ctx, "PhiloxNormal")?;
        let (dims, count) = shape.dims(ctx)?;
        let words = per_pair * count.div_ceil(2);
        Ok(StreamPlan { dims, state, next: advance(&state, blocks_for(words)), dropout: None })
    })
}

/// `trainops_normal`'s arguments for output type `dtype` and the node's `mean`, `scale` (in
/// float64 as `normal::fill` widens them for a float64 output).
pub fn normal_args(dtype: DType, mean: f32, scale: f32) -> NormalArgs {
    let code = match dtype {
        DType::Float16 => 1,
        DType::BFloat16 => 2,
        DType::Double => 3,
        _ => 0,
    };
    NormalArgs { dtype: code, mean, scale, mean64: f64::from(mean), scale64: f64::from(scale) }
}

const DROPOUT: &str = "PhiloxDropout";

fn optional(ctx: &Context<'_>, index: usize) -> Result<Option<crate::ffi::Tensor>> {
    if ctx.input_count()? > index {
        ctx.input(index)
    } else {
        Ok(None)
    }
}

/// The plan of a `PhiloxDropout` node: float32 data on the device; `ratio` (default 0.5),
/// `training_mode` (default false) and `state` are host inputs, checked as the CPU kernel
/// checks them.
pub fn dropout() -> PlanFn {
    Box::new(|ctx: &Context<'_>| {
        let data = io::required(ctx, DROPOUT, 0, "data")?;
        if data.dtype != DType::Float {
            return Err(Error::input(DROPOUT, 0, "data", "tensor(float) on the CUDA device", data.dtype.name()));
        }
        let ratio = match optional(ctx, 1)? {
            Some(_) => io::scalar_float(ctx, DROPOUT, 1, "ratio")?,
            None => 0.5,
        };
        let training = match optional(ctx, 2)? {
            Some(t) => t.read_bool().ok_or_else(|| {
                let got = format!("{} with shape {:?}", t.dtype.name(), t.shape);
                Error::input(DROPOUT, 2, "training_mode", "a tensor(bool) with exactly one element", got)
            })?,
            None => false,
        };
        let t = io::exact(ctx, DROPOUT, 3, "state", &[DType::Uint32], 6, " [c0, c1, c2, c3, k0, k1]")?;
        // SAFETY: six aligned uint32 elements in host memory (a CPU input), read only.
        let state: [u32; 6] = unsafe { t.slice::<u32>() }.try_into().expect("six words");
        if training && !(0.0..1.0).contains(&ratio) {
            return Err(Error::input(DROPOUT, 1, "ratio", "a value in [0, 1) in training mode", format!("{ratio}")));
        }
        Ok(plan_dropout(data.shape.clone(), data.numel, state, ratio, training))
    })
}

/// The dropout plan of `numel` elements: the CPU's threshold, scale and next state.
pub fn plan_dropout(dims: Vec<i64>, numel: usize, state: [u32; 6], ratio: f64, training: bool) -> StreamPlan {
    if training {
        let next = advance(&state, blocks_for(numel));
        StreamPlan { dims, state, next, dropout: Some((keep_from(ratio), scale_f32(ratio))) }
    } else {
        StreamPlan { dims, state, next: state, dropout: None }
    }
}

#[cfg(test)]
mod tests {
    use trainops_kernels::random::dropout::{self, Data};
    use trainops_kernels::random::philox::{self, reference};
    use trainops_kernels::{InOut, Sequential as Serial};

    use super::*;

    /// The device kernels' loops, transcribed: thread `x` of the grid takes blocks
    /// `x, x + stride, ...`; block `b` is `philox(counter + b)` (128-bit carry), and writes
    /// the words `4b..4b+4` that exist. Returns every word, and asserts each block is drawn
    /// exactly once.
    fn emulate(state: &[u32; 6], words: usize) -> Vec<u32> {
        let (blocks, grid) = launch_shape(words);
        let stride = u64::from(grid) * 256;
        let mut out = vec![0u32; words];
        let mut seen = vec![0u8; blocks as usize];
        for x in 0..stride.min(blocks.max(1) + 300) {
            let mut b = x;
            while b < blocks {
                seen[b as usize] += 1;
                let c = philox::counter_of(state).wrapping_add(u128::from(b));
                let w = reference::block(
                    [c as u32, (c >> 32) as u32, (c >> 64) as u32, (c >> 96) as u32],
                    [state[4], state[5]],
                );
                for (k, v) in w.iter().enumerate() {
                    if let Some(slot) = out.get_mut(b as usize * 4 + k) {
                        *slot = *v;
                    }
                }
                b += stride;
            }
        }
        assert!(seen.iter().all(|&s| s == 1), "a block drawn twice or never");
        out
    }

    const LENGTHS: [usize; 9] = [0, 1, 3, 4, 5, 255, 1024, 1027, 70_001];
    // A counter that carries through three words within the first blocks.
    const STATE: [u32; 6] = [0xFFFF_FFFE, 0xFFFF_FFFF, 0xFFFF_FFFF, 7, 0x1234_5678, 0x9ABC_DEF0];

    #[test]
    fn philox_words_and_next_state_are_the_cpus() {
        for n in LENGTHS {
            let mut cpu = vec![0u32; n];
            let next = philox::fill(&STATE, &mut cpu, &Serial);
            assert_eq!(emulate(&STATE, n), cpu, "n = {n}");
            assert_eq!(advance(&STATE, blocks_for(n)), next, "n = {n}");
        }
    }

    #[test]
    fn dropout_plan_and_elements_are_the_cpus() {
        for (n, ratio) in LENGTHS.iter().zip([0.0, 0.1, 0.25, 0.5, 0.9, 0.3, 0.75, 1e-9, 0.5]) {
            let n = *n;
            let data: Vec<f32> = (0..n).map(|i| (i as f32 - 7.5) * 0.37).collect();
            let mut cpu = vec![0f32; n];
            let mut mask = vec![false; n];
            let next = dropout::fill(
                &STATE,
                ratio,
                Data::F32(InOut::split(&data, &mut cpu).unwrap()),
                Some(&mut mask),
                &Serial,
            )
            .unwrap();
            let plan = plan_dropout(vec![n as i64], n, STATE, ratio, true);
            assert_eq!(plan.next, next, "n = {n}");
            let (from, scale) = plan.dropout.unwrap();
            let words = emulate(&STATE, n);
            for i in 0..n {
                let keep = words[i] & 0x7F_FFFF >= from;
                let v = (data[i] * scale) * if keep { 1.0 } else { 0.0 };
                assert_eq!((v.to_bits(), keep), (cpu[i].to_bits(), mask[i]), "n = {n}, i = {i}");
            }
        }
        let off = plan_dropout(vec![3], 3, STATE, 0.5, false);
        assert_eq!((off.next, off.dropout), (STATE, None));
    }

    /// trainops_uniform's element arithmetic on the emulated words, against the CPU op's
    /// `uniform::fill`, for the four output types (float64: two words an element).
    #[test]
    fn uniform_plan_and_elements_are_the_cpus() {
        use half::{bf16, f16};
        use trainops_kernels::random::draw::Output;
        use trainops_kernels::random::uniform;

        let (low, high) = (-1.75f32, 3.5f32);
        for n in LENGTHS {
            let f32_of = |w: u32, a: &UniformArgs| {
                let u = f32::from_bits(0x3F80_0000 | (w & a.mask) << a.shift) - 1.0;
                u * a.range + a.low
            };
            let a = uniform_args(DType::Float, low, high);
            let words = emulate(&STATE, n);
            let mut cpu = vec![0f32; n];
            let next = uniform::fill(&STATE, low, high, Output::F32(&mut cpu), &Serial);
            let dev: Vec<u32> = words.iter().map(|&w| f32_of(w, &a).to_bits()).collect();
            assert_eq!(dev, cpu.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "float32 n = {n}");
            assert_eq!(advance(&STATE, blocks_for(n)), next);

            let a = uniform_args(DType::Float16, low, high);
            let mut cpu = vec![f16::ZERO; n];
            uniform::fill(&STATE, low, high, Output::F16(&mut cpu), &Serial);
            let dev: Vec<u16> = words.iter().map(|&w| f16::from_f32(f32_of(w, &a)).to_bits()).collect();
            assert_eq!(dev, cpu.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "float16 n = {n}");

            let a = uniform_args(DType::BFloat16, low, high);
            let mut cpu = vec![bf16::ZERO; n];
            uniform::fill(&STATE, low, high, Output::BF16(&mut cpu), &Serial);
            let dev: Vec<u16> = words.iter().map(|&w| bf16::from_f32(f32_of(w, &a)).to_bits()).collect();
            assert_eq!(dev, cpu.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "bfloat16 n = {n}");

            let a = uniform_args(DType::Double, low, high);
            let words = emulate(&STATE, 2 * n);
            let mut cpu = vec![0f64; n];
            let next = uniform::fill(&STATE, low, high, Output::F64(&mut cpu), &Serial);
            let dev: Vec<u64> = words
                .chunks_exact(2)
                .map(|w| {
                    let u = f64::from_bits(0x3FF0_0000_0000_0000 | u64::from(w[0] & 0xF_FFFF) << 32 | u64::from(w[1]));
                    ((u - 1.0) * a.range64 + a.low64).to_bits()
                })
                .collect();
            assert_eq!(dev, cpu.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "float64 n = {n}");
            assert_eq!(advance(&STATE, blocks_for(2 * n)), next);
        }
    }

    /// trainops_normal's layout and arithmetic on the emulated words (with this CPU's libm in
    /// place of CUDA's), against the CPU op's `normal::fill` and the plan's next state.
    #[test]
    fn normal_plan_and_elements_are_the_cpus() {
        use half::{bf16, f16};
        use trainops_kernels::random::draw::Output;
        use trainops_kernels::random::normal;

        let u = |w: u32| f32::from_bits(0x3F80_0000 | (w & 0x7F_FFFF)) - 1.0;
        let u64_of =
            |a: u32, b: u32| f64::from_bits(0x3FF0_0000_0000_0000 | u64::from(a & 0xF_FFFF) << 32 | u64::from(b)) - 1.0;
        let bm = |u1: f64, v1: f64| {
            let r = (-2.0 * u1.ln()).sqrt();
            [r * v1.sin(), r * v1.cos()]
        };
        let two_pi = f64::from_bits(0x4019_21FB_5444_2D18);
        for (mean, scale) in [(0.0f32, 1.0f32), (-1.25, 3.5)] {
            for n in LENGTHS {
                let a = normal_args(DType::Float, mean, scale);
                let words = emulate(&STATE, 2 * n.div_ceil(2));
                let dev: Vec<f32> = words
                    .chunks_exact(2)
                    .flat_map(|w| {
                        let u1 = u(w[0]).max(1.0e-7);
                        let v1 = (two_pi * f64::from(u(w[1]))) as f32;
                        bm(f64::from(u1), f64::from(v1)).map(|z| (z as f32) * a.scale + a.mean)
                    })
                    .take(n)
                    .collect();
                let mut cpu = vec![0f32; n];
                let next = normal::fill(&STATE, mean, scale, Output::F32(&mut cpu), &Serial);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&dev), bits(&cpu), "float32 n = {n}");
                assert_eq!(advance(&STATE, blocks_for(2 * n.div_ceil(2))), next);
                let mut h = vec![f16::ZERO; n];
                normal::fill(&STATE, mean, scale, Output::F16(&mut h), &Serial);
                assert!(h.iter().zip(&dev).all(|(h, d)| h.to_bits() == f16::from_f32(*d).to_bits()), "float16 n = {n}");
                let mut b = vec![bf16::ZERO; n];
                normal::fill(&STATE, mean, scale, Output::BF16(&mut b), &Serial);
                assert!(
                    b.iter().zip(&dev).all(|(b, d)| b.to_bits() == bf16::from_f32(*d).to_bits()),
                    "bfloat16 n = {n}"
                );

                let a = normal_args(DType::Double, mean, scale);
                let words = emulate(&STATE, 4 * n.div_ceil(2));
                let dev: Vec<u64> = words
                    .chunks_exact(4)
                    .flat_map(|w| {
                        let u1 = u64_of(w[0], w[1]).max(1.0e-7);
                        bm(u1, two_pi * u64_of(w[2], w[3])).map(|z| (z * a.scale64 + a.mean64).to_bits())
                    })
                    .take(n)
                    .collect();
                let mut cpu = vec![0f64; n];
                let next = normal::fill(&STATE, mean, scale, Output::F64(&mut cpu), &Serial);
                assert_eq!(dev, cpu.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "float64 n = {n}");
                assert_eq!(advance(&STATE, blocks_for(4 * n.div_ceil(2))), next);
            }
        }
    }

    #[test]
    fn launch_shapes() {
        assert_eq!(launch_shape(0), (0, 1));
        assert_eq!(launch_shape(1), (1, 1));
        assert_eq!(launch_shape(1024), (256, 1));
        assert_eq!(launch_shape(1025), (257, 2));
        assert_eq!(launch_shape(usize::MAX / 2).1, 65_535 * 8);
    }
}

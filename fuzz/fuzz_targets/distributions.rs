//! PhiloxUniform, PhiloxNormal and PhiloxDropout's kernels on arbitrary states, lengths,
//! attributes, ratios and data: the words each consumes (`Words::of`, `Words::after`)
//! against u128 arithmetic done here; dropout's integer keep threshold (`keep_from`) against
//! the contract's float64 comparison; and `fill` at every SIMD level the CPU has, serial and
//! split into chunks run in any order, against the kernels' scalar references (bit for bit
//! for uniform and dropout, NaN as any NaN; every level bitwise equal for normal, whose values
//! are the float64 formula within the contract's tolerance), with the next state of the words
//! used.
#![no_main]

use half::{bf16, f16};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use trainops_kernels::random::draw::{f32_of, Output, Words};
use trainops_kernels::random::philox::{self, Level};
use trainops_kernels::random::{dropout, normal, uniform};
use trainops_kernels::{InOut, Parallelism, Sequential};

mod common;
use common::{counter, near_carry, Scrambled};

#[derive(Debug, Arbitrary)]
struct Case {
    state: [u32; 6],
    /// Set the counter near a carry or the wrap.
    near: Option<(u8, u16)>,
    /// Elements: mostly small, one case in eight past the threaded split (those cost a
    /// thousand small ones).
    len: u16,
    long: u8,
    /// An element count for the words arithmetic (at most 2^31 for the distributions, as the
    /// ops allow; dropout's data has no limit).
    count: u64,
    a: f32,
    b: f32,
    ratio: f64,
    word: u32,
    kind: u8,
    order: u8,
    data: Vec<f32>,
}

const MAX_ELEMENTS: u64 = 1 << 31;

/// Words the contract says `n` elements use, computed here in u128.
fn contract_words(words: Words, n: u128) -> u128 {
    match words {
        Words::One => n,
        Words::Two => 2 * n,
        Words::PairsOfTwo => 2 * n.div_ceil(2),
        Words::PairsOfFour => 4 * n.div_ceil(2),
    }
}

fn pools(order: u8) -> [Box<dyn Parallelism>; 2] {
    [Box::new(Sequential), Box::new(Scrambled(order))]
}

fn bits<T: Copy>(v: &[T], f: impl Fn(T) -> u64) -> Vec<u64> {
    v.iter().map(|&x| f(x)).collect()
}

fn uniform_case(levels: &[Level], state: &[u32; 6], len: usize, low: f32, high: f32, order: u8, kind: u8) {
    macro_rules! check {
        ($t:ty, $variant:ident, $words:expr, $zero:expr, $bits:expr) => {{
            let mut want = vec![$zero; len];
            let next = uniform::reference(state, low, high, Output::$variant(&mut want));
            let used = contract_words($words, len as u128);
            assert_eq!(
                counter(&next),
                counter(state).wrapping_add(used.div_ceil(4)),
                "uniform {}: next state",
                stringify!($t)
            );
            assert_eq!(next[4..], state[4..], "the key changed");
            for &level in levels {
                for par in pools(order) {
                    let mut got = vec![$zero; len];
                    let st = uniform::fill_with(level, state, low, high, Output::$variant(&mut got), &*par);
                    assert_eq!(st, next, "{level:?}: next state");
                    // NaN is compared as NaN: with both low and high NaN, which payload the
                    // sum keeps is the compiler's choice (a finding: it differed between the
                    // SIMD loops' scalar tails and the reference; README, Robustness).
                    let (g, w) = (bits::<$t>(&got, $bits), bits::<$t>(&want, $bits));
                    if let Some(i) = (0..len).find(|&i| g[i] != w[i] && !(got[i].is_nan() && want[i].is_nan())) {
                        panic!(
                            "{level:?}: uniform {} element {i} of {len}: {:#x}, the reference {:#x} (low {:#x}, high {:#x})",
                            stringify!($t),
                            g[i],
                            w[i],
                            low.to_bits(),
                            high.to_bits()
                        );
                    }
                }
            }
        }};
    }
    match kind % 4 {
        0 => check!(f32, F32, Words::One, 0f32, |x: f32| u64::from(x.to_bits())),
        1 => check!(f64, F64, Words::Two, 0f64, |x: f64| x.to_bits()),
        2 => check!(f16, F16, Words::One, f16::ZERO, |x: f16| u64::from(x.to_bits())),
        _ => check!(bf16, BF16, Words::One, bf16::ZERO, |x: bf16| u64::from(x.to_bits())),
    }
}

fn normal_case(levels: &[Level], state: &[u32; 6], len: usize, order: u8, double: bool) {
    let (z, next) = normal::reference_z(state, len, double);
    let words = if double { Words::PairsOfFour } else { Words::PairsOfTwo };
    assert_eq!(counter(&next), counter(state).wrapping_add(contract_words(words, len as u128).div_ceil(4)));
    let mut first: Option<Vec<u64>> = None;
    for &level in levels {
        for par in pools(order) {
            let (got, st) = if double {
                let mut o = vec![0f64; len];
                let st = normal::fill_with(level, state, 0.0, 1.0, Output::F64(&mut o), &*par);
                (o, st)
            } else {
                let mut o = vec![0f32; len];
                let st = normal::fill_with(level, state, 0.0, 1.0, Output::F32(&mut o), &*par);
                (o.into_iter().map(f64::from).collect(), st)
            };
            assert_eq!(st, next, "{level:?}: normal next state");
            let tol = if double { 1e-12 } else { 4e-6 };
            for (i, (&g, &w)) in got.iter().zip(&z).enumerate() {
                // r = |z| at most sqrt(-2 ln 1e-7) < 5.7: the contract's tolerance scaled by it.
                assert!((g - w).abs() <= tol * 5.7, "{level:?}: normal element {i}: {g} vs {w}");
            }
            let b: Vec<u64> = got.iter().map(|x| x.to_bits()).collect();
            match &first {
                None => first = Some(b),
                Some(f) => assert!(*f == b, "{level:?}: normal differs between levels or task orders"),
            }
        }
    }
}

fn dropout_case(levels: &[Level], state: &[u32; 6], data: &[f32], ratio: f64, order: u8, double: bool) {
    let n = data.len();
    let (keep, next) = dropout::reference_keep(state, ratio, n);
    assert_eq!(counter(&next), counter(state).wrapping_add((n as u128).div_ceil(4)));
    let want32: Vec<u32> = {
        let scale = 1.0f32 / (1.0f32 - ratio as f32);
        data.iter().zip(&keep).map(|(&d, &k)| ((d * scale) * f32::from(u8::from(k))).to_bits()).collect()
    };
    let want64: Vec<u64> = {
        let scale = 1.0 / (1.0 - ratio);
        data.iter().zip(&keep).map(|(&d, &k)| ((f64::from(d) * scale) * f64::from(u8::from(k))).to_bits()).collect()
    };
    for &level in levels {
        for par in pools(order) {
            for in_place in [false, true] {
                let mut mask = vec![false; n];
                let st = if double {
                    let src: Vec<f64> = data.iter().map(|&d| f64::from(d)).collect();
                    let mut dst = src.clone();
                    let io = if in_place { InOut::in_place(&mut dst) } else { InOut::split(&src, &mut dst).unwrap() };
                    let st = dropout::fill_with(level, state, ratio, dropout::Data::F64(io), Some(&mut mask), &*par)
                        .unwrap();
                    assert!(
                        dst.iter().map(|x| x.to_bits()).eq(want64.iter().copied()),
                        "{level:?}: dropout f64 differs"
                    );
                    st
                } else {
                    let mut dst = data.to_vec();
                    let io = if in_place { InOut::in_place(&mut dst) } else { InOut::split(data, &mut dst).unwrap() };
                    let st = dropout::fill_with(level, state, ratio, dropout::Data::F32(io), Some(&mut mask), &*par)
                        .unwrap();
                    assert!(
                        dst.iter().map(|x| x.to_bits()).eq(want32.iter().copied()),
                        "{level:?}: dropout f32 differs"
                    );
                    st
                };
                assert_eq!(st, next, "{level:?}: dropout next state");
                assert!(mask == keep, "{level:?}: dropout mask differs");
            }
        }
    }
}

fuzz_target!(|case: Case| {
    let state = near_carry(case.state, case.near);

    // Words used and the next state, for any count the ops allow.
    let count = case.count % (MAX_ELEMENTS + 1);
    for words in [Words::One, Words::Two, Words::PairsOfTwo, Words::PairsOfFour] {
        let want = contract_words(words, u128::from(count));
        assert_eq!(words.of(count as usize) as u128, want, "{words:?} of {count}");
        let after = words.after(&state, count as usize);
        assert_eq!(counter(&after), counter(&state).wrapping_add(want.div_ceil(4)), "{words:?}: next state");
        assert_eq!(after[4..], state[4..], "the key changed");
    }
    // Dropout's data has no element limit: one word per element, any usize.
    let any = case.count as usize;
    assert_eq!(counter(&Words::One.after(&state, any)), counter(&state).wrapping_add((any as u128).div_ceil(4)));

    // keep_from: the integer threshold is the float64 comparison, for any ratio in [0, 1)
    // (the op refuses others in training mode) and for every float32 ratio there.
    for ratio in [case.ratio, f64::from(case.a)] {
        if (0.0..1.0).contains(&ratio) {
            let from = dropout::keep_from(ratio);
            assert!(from <= 1 << 23);
            let x = case.word;
            assert_eq!(x & dropout::MANTISSA >= from, f64::from(f32_of(x)) >= ratio, "ratio {ratio}, word {x:#x}");
        }
    }

    let levels = philox::available_levels();
    let long = case.long % 8 == 0;
    let len = if long { philox::SERIAL_BELOW + usize::from(case.len) } else { usize::from(case.len % 512) };
    match case.kind % 3 {
        0 => uniform_case(&levels, &state, len, case.a, case.b, case.order, case.kind / 3),
        1 => normal_case(&levels, &state, len, case.order, case.kind & 8 != 0),
        _ => {
            let ratio = if (0.0..1.0).contains(&case.ratio) { case.ratio } else { f64::from(case.a.abs().fract()) };
            let ratio = f64::from(ratio as f32); // the op's ratio input is float32
            if (0.0..1.0).contains(&ratio) {
                let mut data = case.data.clone();
                data.truncate(if long { data.len() } else { 600 });
                if long {
                    data.resize(len, case.b);
                }
                dropout_case(&levels, &state, &data, ratio, case.order, case.kind & 8 != 0);
            }
        }
    }
});

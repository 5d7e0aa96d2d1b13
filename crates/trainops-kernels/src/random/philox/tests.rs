use proptest::prelude::*;

use super::*;
use crate::{RayonPool, Sequential};

/// Edge lengths around every block and batch size.
const LENGTHS: [usize; 21] = [0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000];
/// Three whole chunks and an odd tail that is not a whole block.
const LARGE: usize = 3 * CHUNK + 37;

/// Random123 `kat_vectors`: counter, key, block.
const KAT: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
    ([0; 4], [0; 2], [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]),
    ([u32::MAX; 4], [u32::MAX; 2], [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]),
    (
        [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
        [0xa409_3822, 0x299f_31d0],
        [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
    ),
];

fn state(counter: [u32; 4], key: [u32; 2]) -> [u32; 6] {
    [counter[0], counter[1], counter[2], counter[3], key[0], key[1]]
}

/// `fill_with` into a buffer of stale words (the result must not depend on them).
fn fast(level: Level, s: &[u32; 6], len: usize, par: &dyn Parallelism) -> (Vec<u32>, [u32; 6]) {
    let mut out = vec![0xDEAD_BEEF; len];
    let next = fill_with(level, s, &mut out, par);
    (out, next)
}

fn slow(s: &[u32; 6], len: usize) -> (Vec<u32>, [u32; 6]) {
    let mut out = vec![0; len];
    let next = reference::fill(s, &mut out);
    (out, next)
}

/// Every level against the reference, on the calling thread.
fn check_levels(s: &[u32; 6], len: usize) {
    let expected = slow(s, len);
    for level in available_levels() {
        assert_eq!(fast(level, s, len, &Sequential), expected, "{level:?}, state {s:08x?}, len {len}");
    }
}

#[test]
fn reference_block_matches_known_answers() {
    for (counter, key, expected) in KAT {
        assert_eq!(reference::block(counter, key), expected);
    }
}

#[test]
fn every_level_matches_known_answers() {
    for (counter, key, expected) in KAT {
        for level in available_levels() {
            let (out, next) = fast(level, &state(counter, key), 4, &Sequential);
            assert_eq!(out, expected, "{level:?}");
            assert_eq!(next, advance(&state(counter, key), 1));
        }
    }
}

#[test]
fn four_outputs_use_one_block() {
    let (out, next) = slow(&[0; 6], 4);
    assert_eq!(out, KAT[0].2);
    assert_eq!(next, [1, 0, 0, 0, 0, 0]);
    check_levels(&[0; 6], 4);
}

#[test]
fn five_outputs_start_a_second_block() {
    let (out, next) = slow(&[0; 6], 5);
    assert_eq!(out[..4], KAT[0].2);
    assert_eq!(out[4], reference::block([1, 0, 0, 0], [0, 0])[0]);
    assert_eq!(next, [2, 0, 0, 0, 0, 0]);
    check_levels(&[0; 6], 5);
}

#[test]
fn zero_outputs_keep_the_state() {
    let s = [1, 2, 3, 4, 5, 6];
    for level in available_levels() {
        assert_eq!(fast(level, &s, 0, &Sequential), (vec![], s));
    }
}

#[test]
fn counter_arithmetic_carries_and_wraps() {
    let key = [0x1234_5678, 0x9abc_def0];
    let s = |c: [u32; 4]| state(c, key);
    assert_eq!(counter_of(&s([1, 2, 3, 4])), 4 << 96 | 3 << 64 | 2 << 32 | 1);
    assert_eq!(advance(&s([u32::MAX, 0, 0, 0]), 1), s([0, 1, 0, 0]));
    assert_eq!(advance(&s([u32::MAX, u32::MAX, 0, 0]), 1), s([0, 0, 1, 0]));
    assert_eq!(advance(&s([u32::MAX, u32::MAX, u32::MAX, 0]), 1), s([0, 0, 0, 1]));
    assert_eq!(advance(&s([u32::MAX; 4]), 1), s([0; 4]));
    assert_eq!(advance(&s([u32::MAX; 4]), 3), s([2, 0, 0, 0]));
    assert_eq!(advance(&s([5, 0, 0, 0]), u128::MAX), s([4, 0, 0, 0]));
    assert_eq!(advance(&s([7, 0, 9, 0]), 1 << 64), s([7, 0, 10, 0]));
    assert_eq!(with_counter(&s([0; 4]), u128::MAX), s([u32::MAX; 4]));
    for len in [0, 1, 3, 4, 5, 8] {
        assert_eq!(blocks_for(len), len.div_ceil(4) as u128);
    }
}

#[test]
fn counters_near_word_boundaries_carry() {
    let key = [0x0bad_cafe, 0xfeed_f00d];
    for boundary in [1u128 << 32, 1 << 64, 1 << 96, 0] {
        // `boundary - back` is just below 2^32, 2^64, 2^96 or 2^128 (which wraps to 0).
        for back in [1u128, 2, 3, 5, 8, 9, 15, 16, 17, 40, 55, 56, 57, 100, 113] {
            let s = with_counter(&state([0; 4], key), boundary.wrapping_sub(back));
            for len in [1, 4, 5, 33, 64, 65, 129, 200, 229, 460] {
                check_levels(&s, len);
            }
        }
    }
    // The block after 2^128 - 1 is that of counter 0, and the state wraps.
    let s = state([u32::MAX; 4], key);
    let (out, next) = slow(&s, 8);
    assert_eq!(out[4..], reference::block([0; 4], key));
    assert_eq!(next, state([1, 0, 0, 0], key));
    check_levels(&s, 8);
}

#[test]
fn consecutive_calls_continue_the_stream() {
    let s = [0xffff_fff0, 7, 0, u32::MAX, 42, 43];
    for level in available_levels() {
        let (whole, end) = fast(level, &s, 4 * 50, &Sequential);
        let (first, mid) = fast(level, &s, 4 * 13, &Sequential);
        let (second, end2) = fast(level, &mid, 4 * 37, &Sequential);
        assert_eq!([first, second].concat(), whole, "{level:?}");
        assert_eq!(end2, end);
    }
}

#[test]
fn detected_level_is_available_and_used_by_fill() {
    let level = detected();
    assert!(available_levels().contains(&level));
    assert_eq!(available_levels()[0], Level::Scalar);
    let s = [9, 8, 7, 6, 5, 4];
    let mut out = vec![0; 333];
    let next = fill(&s, &mut out, &Sequential);
    assert_eq!((out, next), slow(&s, 333));
}

/// The DirectML documentation advances counter 0x48656c6c_6f46726f_6d536561_74746c65 by
/// 324,855 and shows a low word of 0x746f776e, which is the counter minus 324,855; the sum
/// has low word 0x7479615c.
#[test]
fn directml_example_erratum() {
    let counter: u128 = 0x4865_6c6c_6f46_726f_6d53_6561_7474_6c65;
    let s = with_counter(&[0, 0, 0, 0, 1, 2], counter);
    assert_eq!(s[..4], [0x7474_6c65, 0x6d53_6561, 0x6f46_726f, 0x4865_6c6c]);
    let next = advance(&s, 324_855);
    assert_eq!(next, [0x7479_615c, 0x6d53_6561, 0x6f46_726f, 0x4865_6c6c, 1, 2]);
    assert_eq!(counter.wrapping_sub(324_855) as u32, 0x746f_776e);
    // 324,855 blocks are what an output of 4 * 324,855 - 3 ..= 4 * 324,855 words uses.
    assert_eq!(blocks_for(4 * 324_855 - 3), 324_855);
    assert_eq!(blocks_for(4 * 324_855), 324_855);
}

#[test]
fn large_outputs_split_over_threads_are_bitwise_the_reference() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
    // A random-looking state, and one whose low word carries inside the second chunk.
    let carry_in_chunk_1 = u32::MAX - (CHUNK / 4) as u32 - 5;
    for s in [[0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344, 3, 4], [carry_in_chunk_1, u32::MAX, 0, 0, 3, 4]] {
        let expected = slow(&s, LARGE);
        for level in available_levels() {
            for (name, par) in [
                ("sequential", &Sequential as &dyn Parallelism),
                ("4 threads", &RayonPool(Some(&pool))),
                ("global", &RayonPool(None)),
            ] {
                assert_eq!(fast(level, &s, LARGE, par), expected, "{level:?}, {name}");
            }
        }
    }
}

/// Outputs large enough for streaming stores, starting at every kind of offset from a cache
/// line (none; whole blocks, which stream after a head piece; part of a block, which keeps
/// the normal stores), with a tail that is not a whole batch, are bitwise the reference on
/// every level, on one thread and on a pool, and stale words never leak through.
#[test]
fn streamed_outputs_at_any_alignment_are_bitwise_the_reference() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    let len = STREAM_BYTES / 4 + 4 * 56 + 37;
    let s = [u32::MAX - 70_000, 7, 0, 0, 9, 10];
    let expected = slow(&s, len);
    let mut buf = vec![0u32; len + 32];
    let base = buf.as_ptr().align_offset(64);
    for offset in [0, 1, 2, 4, 8, 12, 15] {
        assert!(!streams(Isa::Scalar, &buf[base + offset..base + offset + len]));
        for level in available_levels() {
            for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
                let out = &mut buf[base + offset..base + offset + len];
                out.fill(0xDEAD_BEEF);
                let next = fill_with(level, &s, out, par);
                assert!((next, &*out) == (expected.1, &expected.0[..]), "{level:?} offset {offset}");
            }
            if level != Level::Scalar {
                let out = &buf[base + offset..base + offset + len];
                assert_eq!(streams(level.isa().unwrap(), out), offset % 4 == 0, "offset {offset}");
            }
        }
    }
    // Just below the threshold: the normal stores.
    assert!(!streams(detected().isa().unwrap(), &buf[base..base + STREAM_BYTES / 4 - 1]));
}

/// Random states, some with a counter just below a word boundary.
fn states() -> impl Strategy<Value = [u32; 6]> {
    let near = |hi: u128| (0u128..64).prop_map(move |back| hi.wrapping_sub(back + 1));
    let counter = prop_oneof![any::<u128>(), near(1 << 32), near(1 << 64), near(1 << 96), near(0)];
    (counter, any::<[u32; 2]>()).prop_map(|(c, k)| with_counter(&[0, 0, 0, 0, k[0], k[1]], c))
}

proptest! {
    #[test]
    fn every_level_is_the_reference_on_edge_lengths(s in states()) {
        for len in LENGTHS {
            let expected = slow(&s, len);
            for level in available_levels() {
                prop_assert_eq!(fast(level, &s, len, &Sequential), expected.clone(), "{:?} len {}", level, len);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]
    #[test]
    fn large_random_states_are_the_reference_on_one_and_many_threads(s in states()) {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let expected = slow(&s, LARGE);
        for level in available_levels() {
            prop_assert_eq!(fast(level, &s, LARGE, &Sequential), expected.clone(), "{:?}", level);
            prop_assert_eq!(fast(level, &s, LARGE, &RayonPool(Some(&pool))), expected.clone(), "{:?}", level);
        }
    }
}

/// Throughput per level on a 1 MiB output, best of 5 runs of 60 calls (the machine may be
/// shared): `cargo test --release -p trainops-kernels philox -- --ignored --nocapture`.
#[test]
#[ignore]
fn throughput() {
    use std::time::Instant;
    const WORDS: usize = 1 << 18;
    const CALLS: usize = 60;
    let mut out = vec![0u32; WORDS];
    let s = [1, 2, 3, 4, 5, 6];
    let rate = |par: &dyn Parallelism, level: Level, out: &mut [u32]| {
        fill_with(level, &s, out, par);
        let best = (0..5)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..CALLS {
                    fill_with(level, &s, std::hint::black_box(&mut *out), par);
                }
                start.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        (CALLS * WORDS * 4) as f64 / best / 1e9
    };
    let threads = rayon::current_num_threads();
    for level in available_levels() {
        let one = rate(&Sequential, level, &mut out);
        let all = rate(&RayonPool(None), level, &mut out);
        println!("philox {level:?}: {one:.2} GB/s on 1 thread, {all:.2} GB/s on {threads} rayon threads (1 MiB)");
    }
}

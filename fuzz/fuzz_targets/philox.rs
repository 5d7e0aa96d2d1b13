//! Philox counter arithmetic and `fill` on arbitrary states and lengths: `counter_of`,
//! `with_counter`, `advance` and `blocks_for` against u128 arithmetic done here, and `fill`
//! at every SIMD level the CPU has, serial and split into chunks run in any order, against
//! the scalar reference.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use trainops_kernels::random::philox::{self, advance, blocks_for, counter_of, fill_with, reference, with_counter};
use trainops_kernels::{Parallelism, Sequential};

mod common;
use common::{counter, near_carry, Scrambled};

#[derive(Debug, Arbitrary)]
struct Case {
    state: [u32; 6],
    /// Set the counter near a carry or the wrap.
    near: Option<(u8, u16)>,
    blocks: u128,
    big_len: usize,
    /// Output words: mostly small, sometimes past the threaded split.
    len: u16,
    long: bool,
    order: u8,
}

fuzz_target!(|case: Case| {
    let state = near_carry(case.state, case.near);
    let c = counter(&state);
    assert_eq!(counter_of(&state), c);
    assert_eq!(with_counter(&state, c), state);
    let moved = advance(&state, case.blocks);
    assert_eq!(counter_of(&moved), c.wrapping_add(case.blocks));
    assert_eq!(moved[4..], state[4..], "the key changed");
    let wc = with_counter(&state, case.blocks);
    assert_eq!(counter_of(&wc), case.blocks);
    assert_eq!(blocks_for(case.big_len), (case.big_len as u128).div_ceil(4));

    let len = if case.long { philox::SERIAL_BELOW + usize::from(case.len) } else { usize::from(case.len % 1024) };
    let mut want = vec![0u32; len];
    let next = reference::fill(&state, &mut want);
    assert_eq!(counter_of(&next), c.wrapping_add(blocks_for(len)));
    for level in philox::available_levels() {
        for par in [&Sequential as &dyn Parallelism, &Scrambled(case.order)] {
            let mut got = vec![0u32; len];
            assert_eq!(fill_with(level, &state, &mut got, par), next, "{level:?}: next state");
            assert!(got == want, "{level:?}: output differs from the reference (len {len})");
        }
    }
});

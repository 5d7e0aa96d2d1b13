//! What several fuzz targets share (included with `mod common;`).

use trainops_kernels::random::philox::with_counter;
use trainops_kernels::Parallelism;

/// Runs the tasks on this thread in a scrambled order (results must not depend on it).
pub struct Scrambled(pub u8);

impl Parallelism for Scrambled {
    fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let step = [1, 3, 5, 7][usize::from(self.0 % 4)];
        let mut order: Vec<usize> = (0..tasks).collect();
        if self.0 & 4 != 0 {
            order.reverse();
        }
        if tasks.is_multiple_of(step) {
            order.iter().for_each(|&i| f(i));
        } else {
            // `step` is prime and does not divide `tasks`: striding visits every task once.
            (0..tasks).for_each(|i| f(order[(i * step) % tasks]));
        }
    }
}

/// The 128-bit counter of a state, computed here.
pub fn counter(state: &[u32; 6]) -> u128 {
    u128::from(state[0]) | (u128::from(state[1]) << 32) | (u128::from(state[2]) << 64) | (u128::from(state[3]) << 96)
}

/// `state`, or with `near = (word, below)` its counter set `below` short of a 32-, 64-, 96- or
/// 128-bit carry (the wrap).
pub fn near_carry(state: [u32; 6], near: Option<(u8, u16)>) -> [u32; 6] {
    match near {
        Some((word, below)) => {
            let bit = 32 * (u32::from(word % 4) + 1);
            let c = if bit == 128 { 0u128 } else { 1u128 << bit }.wrapping_sub(u128::from(below));
            with_counter(&state, c)
        }
        None => state,
    }
}

//! What several fuzz targets share (included with `mod common;`).

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

//! The 8-bit optimizers (`optim::quantized`) against their memory ceiling
//! (`ceiling::ceiling_8bit`: the same 16 bytes per parameter with f32 G, `x += g`, codes
//! `+= 1`), and Adam with float32 state against its own (`MemoryCeiling`, 3 streams, 28
//! bytes), interleaved in one process: in place, N parameters (default 16e6), on a rayon
//! pool of 2 threads (default), at the detected level (or `scalar`/`avx2`/`avx512` as the
//! fourth argument, for the 8-bit rows and their ceiling). A row's ratio is the median
//! over rounds of its GB/s divided by its ceiling's in the same round.
//!
//! `cargo bench -p trainops-kernels --bench optim8bit -- [N] [THREADS] [ROUNDS] [LEVEL]`

use std::hint::black_box;

mod common;
mod optim_rows;
use optim_rows::{adam_f32_rows, args, measure, print_table, Row};

use trainops_kernels::ceiling::ceiling_8bit;
use trainops_kernels::optim::adam::{Adam, AdamAttrs};
use trainops_kernels::optim::quantized::adamw::{AdamWAttrs, AdamWCoeffs, Rule};
use trainops_kernels::optim::quantized::{blocks, reference, step_with, Param8bit, Quantized};
use trainops_kernels::optim::Optimizer;
use trainops_kernels::{InOut, Level, RayonPool};

/// One tensor's weights, gradient and 8-bit state.
struct State {
    x: Vec<f32>,
    g: Vec<f32>,
    mq: Vec<u8>,
    ma: Vec<f32>,
    vq: Vec<u8>,
    va: Vec<f32>,
}

impl State {
    fn new(n: usize) -> Self {
        let m: Vec<f32> = (0..n).map(|i| 1e-3 * ((i % 97) as f32 - 48.0)).collect();
        let v: Vec<f32> = (0..n).map(|i| 1e-6 * (i % 89) as f32).collect();
        let (mq, ma) = reference::quantize(&reference::dynamic_map(true), &m);
        let (vq, va) = reference::quantize(&reference::dynamic_map(false), &v);
        let g = (0..n).map(|i| 1e-3 * ((i % 13) as f32 - 6.0)).collect();
        State { x: vec![0.5; n], g, mq, ma, vq, va }
    }

    fn param(&mut self) -> Param8bit<'_, f32> {
        let m = Quantized { codes: InOut::in_place(&mut self.mq), absmax: InOut::in_place(&mut self.ma) };
        let v = Quantized { codes: InOut::in_place(&mut self.vq), absmax: InOut::in_place(&mut self.va) };
        Param8bit::new(InOut::in_place(&mut self.x), &self.g, m, v).expect("lengths")
    }
}

fn row_8bit<'a, R: Rule>(name: &str, n: usize, level: Level, rule: R) -> Row<'a> {
    let mut s = State::new(n);
    (name.into(), 16.0, Some(0), Box::new(move |par| step_with(level, &rule, vec![s.param()], par)))
}

fn main() {
    let cli = args();
    let (n, threads, _, level) = cli;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("rayon pool");
    let par = RayonPool(Some(&pool));
    let mut ceiling = State::new(n);
    let adam = Adam::coeffs::<f32>(&AdamAttrs::default(), 1e-3, 5);
    let adamw = AdamWCoeffs::new(&AdamWAttrs::default(), 1e-3, 5);
    let mut rows: Vec<Row<'_>> = vec![
        (
            "ceiling, 8-bit state (f32 X, G)".into(),
            16.0,
            None,
            Box::new(|par| ceiling_8bit(level, vec![ceiling.param()], par)),
        ),
        row_8bit("Adam8bit", n, level, adam),
        row_8bit("AdamW8bit", n, level, adamw),
    ];
    rows.extend(adam_f32_rows(n, adam, 3));
    let measured = measure(&mut rows, &par, n, cli.2);
    black_box(blocks(n));
    print_table(&rows, &measured, 4, cli);
}

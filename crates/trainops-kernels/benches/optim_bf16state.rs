//! The bfloat16-state optimizers (`optim::bf16state`) against their memory ceiling (the same
//! 20 bytes per parameter: f32 X read and written, f32 G read, both bf16 moments read and
//! written; `x += g`, moments' bits `+= 1`, loops compiled with AVX2 where the CPU has it),
//! and Adam with float32 state (28 bytes) as the peer, interleaved in one process: in place,
//! N parameters (default 16e6), on a rayon pool of 2 threads (default), at the detected
//! level (or `scalar`/`avx2`/`avx512` as the fourth argument, for the bf16 rows). A row's
//! ratio is the median over rounds of its GB/s divided by its ceiling's in the same round.
//!
//! `cargo bench -p trainops-kernels --bench optim_bf16state -- [N] [THREADS] [ROUNDS] [LEVEL]`

mod common;
mod optim_rows;
use optim_rows::{adam_f32_rows, args, measure, print_table, Row};

use half::bf16;
use trainops_kernels::optim::adam::{Adam, AdamAttrs};
use trainops_kernels::optim::adamw::{AdamWAttrs, AdamWCoeffs};
use trainops_kernels::optim::bf16state::{step_with, ParamBf16, Rule, Stochastic};
use trainops_kernels::optim::Optimizer;
use trainops_kernels::stream::Access;
use trainops_kernels::{run_chunked, InOut, Level, Parallelism, RayonPool};

/// One tensor's weights, gradient and bfloat16 moments.
struct State {
    x: Vec<f32>,
    g: Vec<f32>,
    m: Vec<bf16>,
    v: Vec<bf16>,
}

impl State {
    fn new(n: usize) -> Self {
        let m = (0..n).map(|i| bf16::from_f32(1e-3 * ((i % 97) as f32 - 48.0))).collect();
        let v = (0..n).map(|i| bf16::from_f32(1e-6 * (i % 89) as f32)).collect();
        let g = (0..n).map(|i| 1e-3 * ((i % 13) as f32 - 6.0)).collect();
        State { x: vec![0.5; n], g, m, v }
    }

    fn param(&mut self) -> ParamBf16<'_, f32> {
        let (x, m, v) = (InOut::in_place(&mut self.x), InOut::in_place(&mut self.m), InOut::in_place(&mut self.v));
        ParamBf16::new(x, &self.g, m, v, 0).expect("lengths")
    }
}

/// The ceiling's loops on one task.
#[inline(always)]
fn ceiling_loops(p: ParamBf16<'_, f32>) {
    let ParamBf16 { mut x, g, mut m, mut v, .. } = p;
    if let Access::InPlace(x) = x.access() {
        x.iter_mut().zip(g).for_each(|(x, g)| *x += g);
    }
    for s in [&mut m, &mut v] {
        if let Access::InPlace(s) = s.access() {
            s.iter_mut().for_each(|b| *b = bf16::from_bits(b.to_bits().wrapping_add(1)));
        }
    }
}

#[target_feature(enable = "avx2")]
fn ceiling_avx2(p: ParamBf16<'_, f32>) {
    ceiling_loops(p);
}

fn ceiling(params: Vec<ParamBf16<'_, f32>>, par: &dyn Parallelism) {
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    run_chunked(params, par, trainops_kernels::parallel::CHUNK, trainops_kernels::parallel::SERIAL_BELOW, |p| {
        if avx2 {
            // SAFETY: AVX2 was detected on this CPU.
            unsafe { ceiling_avx2(p) }
        } else {
            ceiling_loops(p)
        }
    });
}

fn row<'a, R: Rule>(name: &str, n: usize, level: Level, rule: R) -> Row<'a> {
    let mut s = State::new(n);
    let bits = Stochastic::new(1234, 5);
    (name.into(), 20.0, Some(0), Box::new(move |par| step_with(level, &rule, &bits, vec![s.param()], par)))
}

fn main() {
    let cli = args();
    let (n, threads, rounds, level) = cli;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("rayon pool");
    let par = RayonPool(Some(&pool));
    let adam = Adam::coeffs::<f32>(&AdamAttrs::default(), 1e-3, 5);
    let adamw = AdamWCoeffs::<f32>::new(&AdamWAttrs::default(), 1e-3, 5);
    let mut c = State::new(n);
    let mut rows: Vec<Row<'_>> = vec![
        ("ceiling, bf16 state (f32 X, G)".into(), 20.0, None, Box::new(move |par| ceiling(vec![c.param()], par))),
        row("AdamBf16State", n, level, adam),
        row("AdamWBf16State", n, level, adamw),
    ];
    rows.extend(adam_f32_rows(n, adam, 3));
    let measured = measure(&mut rows, &par, n, rounds);
    print_table(&rows, &measured, 4, cli);
}

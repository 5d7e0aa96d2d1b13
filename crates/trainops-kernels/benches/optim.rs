//! Every optimizer and weight type against its own memory ceiling, interleaved in one
//! process: in place, N parameters (default 16e6), on a rayon pool of 2 threads (default).
//! Each round runs every row once, in turn, starting at a different row each round; a row's ratio is the median over rounds of its
//! GB/s divided by its ceiling's GB/s in the same round, so a shared machine's load drifts
//! out of the ratio. The host load (`/proc/loadavg`, and the share of CPU time the whole
//! machine spent busy during the run, from `/proc/stat`) is printed with the table.
//!
//! `cargo bench -p trainops-kernels --bench optim -- [N] [THREADS] [ROUNDS]`
//!
//! Bytes per parameter are the bytes each step must move: 4 per f32 element read or
//! written. Adam f32: x, g, v, h read, x, v, h written = 28 (AdamW's x, g, m, v the same); Adagrad and Momentum 20; with
//! 16-bit X, state and G half that (14 and 10). MixedPrecisionAdam (f32 X, V, H; 16-bit G)
//! reads G twice, since the finiteness verdict over every gradient precedes every write:
//! 2 + 2 + 24 = 28 (f32 G: 32). The ceilings (`MemoryCeiling`, `s += g` per stream) move
//! f32 data with the same reads and writes per element as the row: 3 streams for Adam's
//! rows, 2 for Adagrad's and Momentum's; 16-bit rows are held to the f32 ceiling of their
//! stream count in GB/s (the memory does not care about the element width, and a 16-bit
//! ceiling would measure conversions rather than memory).

use std::hint::black_box;

mod common;
mod optim_rows;
use common::{loadavg, median};
use optim_rows::{measure, Measured, Row};

use half::{bf16, f16};
use trainops_kernels::ceiling::MemoryCeiling;
use trainops_kernels::loss_scale::all_finite;
use trainops_kernels::optim::adagrad::{Adagrad, AdagradAttrs};
use trainops_kernels::optim::adam::{Adam, AdamAttrs};
use trainops_kernels::optim::adamw::{AdamW, AdamWAttrs};
use trainops_kernels::optim::momentum::{Momentum, MomentumAttrs, MomentumMode};
use trainops_kernels::optim::Optimizer;
use trainops_kernels::{Compute, Element, InOut, Parallelism, RayonPool};

/// One tensor's buffers: weights, state streams, gradient.
struct Bufs<X, G> {
    s: Vec<Vec<X>>,
    g: Vec<G>,
}

impl<X: Element, G: Element<C = X::C>> Bufs<X, G> {
    fn new(n: usize, streams: usize) -> Self {
        let f = |v: f64| X::store(X::C::from_f64(v));
        let mut s = vec![vec![f(0.5); n]];
        s.extend((1..streams).map(|_| vec![f(0.01); n]));
        Bufs { s, g: vec![G::store(G::C::from_f64(1e-3)); n] }
    }

    /// One in-place step of `O` with coefficients `c` over `N` streams.
    fn step<O: Optimizer<N>, const N: usize>(&mut self, c: &O::Coeffs<X::C>, par: &dyn Parallelism) {
        let mut it = self.s.iter_mut();
        let streams: [InOut<'_, X>; N] = core::array::from_fn(|_| InOut::in_place(it.next().expect("N streams")));
        O::step(c, vec![O::param(streams, &self.g).expect("equal lengths")], par);
    }
}

fn adam_row<'a, X: Element, G: Element<C = X::C>>(name: &str, n: usize, bytes: f64, ceil: usize) -> Row<'a> {
    let mut b = Bufs::<X, G>::new(n, 3);
    let c = Adam::coeffs::<X::C>(&AdamAttrs::default(), 1e-3, 5);
    (name.into(), bytes, Some(ceil), Box::new(move |par| b.step::<Adam, 3>(&c, par)))
}

fn adamw_row<'a, X: Element, G: Element<C = X::C>>(name: &str, n: usize, bytes: f64, ceil: usize) -> Row<'a> {
    let mut b = Bufs::<X, G>::new(n, 3);
    let c = <AdamW as Optimizer<3>>::coeffs::<X::C>(&AdamWAttrs::default(), 1e-3, 5);
    (name.into(), bytes, Some(ceil), Box::new(move |par| b.step::<AdamW, 3>(&c, par)))
}

fn adagrad_row<'a, X: Element, G: Element<C = X::C>>(name: &str, n: usize, bytes: f64, ceil: usize) -> Row<'a> {
    let mut b = Bufs::<X, G>::new(n, 2);
    let c = Adagrad::coeffs::<X::C>(&AdagradAttrs::default(), 1e-2, 5);
    (name.into(), bytes, Some(ceil), Box::new(move |par| b.step::<Adagrad, 2>(&c, par)))
}

fn momentum_row<'a, X: Element, G: Element<C = X::C>>(
    name: &str,
    n: usize,
    bytes: f64,
    ceil: usize,
    mode: MomentumMode,
) -> Row<'a> {
    let mut b = Bufs::<X, G>::new(n, 2);
    let a = MomentumAttrs { alpha: 0.9, beta: 0.1, mode, norm_coefficient: 0.0 };
    let c = Momentum::coeffs::<X::C>(&a, 1e-2, 5);
    (name.into(), bytes, Some(ceil), Box::new(move |par| b.step::<Momentum, 2>(&c, par)))
}

/// MixedPrecisionAdam's kernel work: the finiteness verdict over `G / scale`, then Adam on
/// `G / scale` (the op's compute, without onnxruntime).
fn mixed_row<'a, G: Element<C = f32>>(name: &str, n: usize, bytes: f64, ceil: usize) -> Row<'a> {
    let mut b = Bufs::<f32, G>::new(n, 3);
    let scale = 1024.0f32;
    let c = Adam::coeffs::<f32>(&AdamAttrs::default(), 1e-3, 5).with_loss_scale(scale);
    let step = move |par: &dyn Parallelism| {
        if all_finite(&[&b.g[..]], Some(scale), par) {
            b.step::<Adam, 3>(&c, par);
        }
    };
    (name.into(), bytes, Some(ceil), Box::new(step))
}

fn ceiling_row<'a, const N: usize>(name: &str, n: usize) -> Row<'a>
where
    MemoryCeiling: Optimizer<N, Coeffs<f32> = trainops_kernels::ceiling::CeilingCoeffs<f32>>,
{
    let mut b = Bufs::<f32, f32>::new(n, N);
    (
        name.into(),
        (4 * (2 * N + 1)) as f64,
        None,
        Box::new(move |par| b.step::<MemoryCeiling, N>(&Default::default(), par)),
    )
}

fn main() {
    let args: Vec<f64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let n = args.first().map_or(16_000_000, |&v| v as usize);
    let threads = args.get(1).map_or(2, |&v| v as usize);
    let rounds = args.get(2).map_or(15, |&v| v as usize);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("rayon pool");
    let par = RayonPool(Some(&pool));
    use MomentumMode::{Nesterov, Standard};
    let mut rows: Vec<Row<'_>> = vec![
        ceiling_row::<3>("ceiling, 3 streams (f32)", n),
        ceiling_row::<2>("ceiling, 2 streams (f32)", n),
        adam_row::<f32, f32>("Adam f32", n, 28.0, 0),
        adagrad_row::<f32, f32>("Adagrad f32", n, 20.0, 1),
        momentum_row::<f32, f32>("Momentum f32", n, 20.0, 1, Standard),
        momentum_row::<f32, f32>("Momentum nesterov f32", n, 20.0, 1, Nesterov),
        adam_row::<bf16, bf16>("Adam bf16 X/G/V/H", n, 14.0, 0),
        adam_row::<f16, f16>("Adam f16 X/G/V/H", n, 14.0, 0),
        adagrad_row::<bf16, bf16>("Adagrad bf16", n, 10.0, 1),
        adagrad_row::<f16, f16>("Adagrad f16", n, 10.0, 1),
        momentum_row::<bf16, bf16>("Momentum bf16", n, 10.0, 1, Standard),
        momentum_row::<f16, f16>("Momentum f16", n, 10.0, 1, Standard),
        adam_row::<f32, f16>("Adam f32, f16 G", n, 26.0, 0),
        mixed_row::<f16>("MixedPrecisionAdam f32, f16 G (2 passes over G)", n, 28.0, 0),
        mixed_row::<bf16>("MixedPrecisionAdam f32, bf16 G (2 passes over G)", n, 28.0, 0),
        mixed_row::<f32>("MixedPrecisionAdam f32, f32 G (2 passes over G)", n, 32.0, 0),
        adamw_row::<f32, f32>("AdamW f32", n, 28.0, 0),
        adamw_row::<bf16, bf16>("AdamW bf16 X/G/M/V", n, 14.0, 0),
    ];
    let Measured { gbs, load0, busy, .. } = measure(&mut rows, &par, n, rounds);
    black_box(&rows.len());
    println!("n = {n}, {threads} threads, {rounds} interleaved rounds, in place");
    println!(
        "host: loadavg {load0} before, {} after; machine busy {:.0}% of CPU time during the run",
        loadavg(),
        busy * 100.0
    );
    println!(
        "(a quiet run keeps the machine near {:.0}% busy: this benchmark's {threads} threads)",
        100.0 * threads.min(2) as f64 / 2.0
    );
    println!("| row | B/param | GB/s (median) | of its ceiling (median of per-round ratios) | of Adam f32 |");
    println!("|---|---:|---:|---:|---:|");
    let adam = median(gbs[2].clone());
    for (k, (name, bytes, ceil, _)) in rows.iter().enumerate() {
        let m = median(gbs[k].clone());
        let ratio = match ceil {
            Some(c) => format!("{:.2}", median(gbs[k].iter().zip(&gbs[*c]).map(|(a, b)| a / b).collect())),
            None => "ceiling".into(),
        };
        println!("| {name} | {bytes} | {m:.1} | {ratio} | {:.2} |", m / adam);
    }
}

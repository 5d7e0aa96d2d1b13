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
use std::time::Instant;

mod common;
use common::{busy_share, cpu_jiffies, loadavg, median};

use trainops_kernels::ceiling::{ceiling_8bit, MemoryCeiling};
use trainops_kernels::optim::adam::{Adam, AdamAttrs};
use trainops_kernels::optim::quantized::adamw::{AdamWAttrs, AdamWCoeffs, Rule};
use trainops_kernels::optim::quantized::{blocks, reference, step_with, Param8bit, Quantized};
use trainops_kernels::optim::Optimizer;
use trainops_kernels::{InOut, Level, Parallelism, RayonPool};

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

type Row<'a> = (String, f64, Option<usize>, Box<dyn FnMut(&dyn Parallelism) + 'a>);

fn row_8bit<'a, R: Rule>(name: &str, n: usize, level: Level, rule: R) -> Row<'a> {
    let mut s = State::new(n);
    (name.into(), 16.0, Some(0), Box::new(move |par| step_with(level, &rule, vec![s.param()], par)))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let num = |k: usize, d: f64| args.get(k).and_then(|a| a.parse::<f64>().ok()).unwrap_or(d);
    let n = num(0, 16e6) as usize;
    let threads = num(1, 2.0) as usize;
    let rounds = num(2, 15.0) as usize;
    let level = match args.get(3).map(String::as_str) {
        Some("scalar") => Level::Scalar,
        Some("avx2") => Level::Avx2,
        Some("avx512") => Level::Avx512,
        _ => trainops_kernels::simd::detected(),
    };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("rayon pool");
    let par = RayonPool(Some(&pool));
    let mut ceiling = State::new(n);
    let (mut x, mut v, mut h, g) = (vec![0.5f32; n], vec![0.01f32; n], vec![0.01f32; n], vec![1e-3f32; n]);
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
    let mut c3 = (vec![0.5f32; n], vec![0.01f32; n], vec![0.01f32; n], vec![1e-3f32; n]);
    rows.push((
        "ceiling, 3 streams (f32)".into(),
        28.0,
        None,
        Box::new(move |par| {
            let s = [InOut::in_place(&mut c3.0), InOut::in_place(&mut c3.1), InOut::in_place(&mut c3.2)];
            MemoryCeiling::step(&Default::default(), vec![MemoryCeiling::param(s, &c3.3).expect("lengths")], par);
        }),
    ));
    rows.push((
        "Adam f32 state".into(),
        28.0,
        Some(3),
        Box::new(move |par| {
            let s = [InOut::in_place(&mut x), InOut::in_place(&mut v), InOut::in_place(&mut h)];
            Adam::step(&adam, vec![Adam::param(s, &g).expect("lengths")], par);
        }),
    ));
    for (_, _, _, f) in rows.iter_mut() {
        f(&par);
    }
    let (load0, jiffies0) = (loadavg(), cpu_jiffies());
    let mut gbs: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
    let len = rows.len();
    let mut secs: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
    for r in 0..rounds {
        for k in (0..len).map(|j| (j + r) % len) {
            let (_, bytes, _, f) = &mut rows[k];
            let t = Instant::now();
            f(&par);
            let dt = t.elapsed().as_secs_f64();
            gbs[k].push(*bytes * n as f64 / dt / 1e9);
            secs[k].push(dt);
        }
    }
    let busy = busy_share(jiffies0, cpu_jiffies());
    black_box(blocks(n));
    println!("n = {n}, {threads} threads, {rounds} interleaved rounds, in place, level {level:?}");
    println!("host: loadavg {load0} before, {} after; machine busy {:.0}% during the run", loadavg(), busy * 100.0);
    println!(
        "| row | B/param | GB/s (median) | of its ceiling (median of per-round ratios) | step time / Adam f32's |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (k, (name, bytes, ceil, _)) in rows.iter().enumerate() {
        let m = median(gbs[k].clone());
        let ratio = match ceil {
            Some(c) => format!("{:.2}", median(gbs[k].iter().zip(&gbs[*c]).map(|(a, b)| a / b).collect())),
            None => "ceiling".into(),
        };
        let vs_adam = median(secs[k].iter().zip(&secs[4]).map(|(a, b)| a / b).collect());
        println!("| {name} | {bytes} | {m:.1} | {ratio} | {vs_adam:.2} |");
    }
}

//! What the optimizer benchmarks (`optim`, `optim8bit`, `optim_bf16state`) share: their rows,
//! the interleaved rounds that time them, and (for the low-memory-state ones) the command
//! line, Adam's float32 peer rows and the table.

// Each benchmark uses a part of this module.
#![allow(dead_code)]

use std::time::Instant;

use super::common::{busy_share, cpu_jiffies, loadavg, median};
use trainops_kernels::ceiling::MemoryCeiling;
use trainops_kernels::optim::adam::Adam;
use trainops_kernels::optim::Optimizer;
use trainops_kernels::{InOut, Level, Parallelism};

/// A row: its name, bytes per parameter, index of its ceiling row (`None`: it is one), and
/// one step.
pub type Row<'a> = (String, f64, Option<usize>, Box<dyn FnMut(&dyn Parallelism) + 'a>);

/// The timings of interleaved rounds over some rows, and the host's load around them.
pub struct Measured {
    /// Per row, its GB/s in each round.
    pub gbs: Vec<Vec<f64>>,
    /// Per row, its step time in seconds in each round.
    pub secs: Vec<Vec<f64>>,
    /// `/proc/loadavg` before the rounds.
    pub load0: String,
    /// The share of CPU time the whole machine spent busy during the rounds.
    pub busy: f64,
}

/// Runs every row once to warm it, then `rounds` rounds of every row, in turn, each round
/// starting at another row; `n` parameters per step.
pub fn measure(rows: &mut [Row<'_>], par: &dyn Parallelism, n: usize, rounds: usize) -> Measured {
    for (_, _, _, f) in rows.iter_mut() {
        f(par); // warm: pages touched, caches and pool started
    }
    let (load0, jiffies0) = (loadavg(), cpu_jiffies());
    let len = rows.len();
    let (mut gbs, mut secs) = (vec![Vec::new(); len], vec![Vec::new(); len]);
    for r in 0..rounds {
        // Each round starts at another row: the first row of a round measured slower
        // (whatever ran before it), and rotating spreads that over every row.
        for k in (0..len).map(|j| (j + r) % len) {
            let (_, bytes, _, f) = &mut rows[k];
            let t = Instant::now();
            f(par);
            let dt = t.elapsed().as_secs_f64();
            gbs[k].push(*bytes * n as f64 / dt / 1e9);
            secs[k].push(dt);
        }
    }
    let busy = busy_share(jiffies0, cpu_jiffies());
    Measured { gbs, secs, load0, busy }
}

/// The command line `[N] [THREADS] [ROUNDS] [LEVEL]`: parameters (default 16e6), threads
/// (2), rounds (15) and the SIMD level (`scalar`, `avx2`, `avx512`; default the detected one).
pub fn args() -> (usize, usize, usize, Level) {
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
    (n, threads, rounds, level)
}

/// Adam with float32 state (28 bytes per parameter) and its ceiling, `MemoryCeiling` over 3
/// streams: two rows, to push after rows `0..ceiling`, so that the ceiling's index is `ceiling`.
pub fn adam_f32_rows<'a>(n: usize, adam: <Adam as Optimizer<3>>::Coeffs<f32>, ceiling: usize) -> [Row<'a>; 2] {
    let mut c3 = (vec![0.5f32; n], vec![0.01f32; n], vec![0.01f32; n], vec![1e-3f32; n]);
    let (mut x, mut v, mut h, g) = (vec![0.5f32; n], vec![0.01f32; n], vec![0.01f32; n], vec![1e-3f32; n]);
    [
        (
            "ceiling, 3 streams (f32)".into(),
            28.0,
            None,
            Box::new(move |par| {
                let s = [InOut::in_place(&mut c3.0), InOut::in_place(&mut c3.1), InOut::in_place(&mut c3.2)];
                MemoryCeiling::step(&Default::default(), vec![MemoryCeiling::param(s, &c3.3).expect("lengths")], par);
            }),
        ),
        (
            "Adam f32 state".into(),
            28.0,
            Some(ceiling),
            Box::new(move |par| {
                let s = [InOut::in_place(&mut x), InOut::in_place(&mut v), InOut::in_place(&mut h)];
                Adam::step(&adam, vec![Adam::param(s, &g).expect("lengths")], par);
            }),
        ),
    ]
}

/// Prints the run's settings, the host's load and the table: each row's GB/s, its ratio to
/// its ceiling and its step time over row `adam`'s (Adam with float32 state).
pub fn print_table(
    rows: &[Row<'_>],
    m: &Measured,
    adam: usize,
    (n, threads, rounds, level): (usize, usize, usize, Level),
) {
    let Measured { gbs, secs, load0, busy } = m;
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
        let vs_adam = median(secs[k].iter().zip(&secs[adam]).map(|(a, b)| a / b).collect());
        println!("| {name} | {bytes} | {m:.1} | {ratio} | {vs_adam:.2} |");
    }
}

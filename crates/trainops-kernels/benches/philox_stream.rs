//! Philox fills with normal and with streaming (non-temporal) stores against the write-only
//! yardstick (`ceiling::stream_fill`: zeros with non-temporal stores), interleaved in one
//! process, per output size and thread count: each round runs every row once (starting at a
//! different row each round) and a row's ratio is the median over rounds of its GB/s over the
//! yardstick's in the same round. The sizes bracket `philox::STREAM_BYTES`; the host's load
//! is printed with the table.
//!
//! `cargo bench -p trainops-kernels --bench philox_stream -- [ROUNDS]`; with `uniform` among
//! the arguments the rows are `PhiloxUniform`'s float32 fills instead (the distributions
//! share Philox's threshold), at 4, 16 and 64 MiB.

use std::time::Instant;

mod common;
use common::{busy_share, cpu_jiffies, loadavg, median};

use trainops_kernels::ceiling::stream_fill;
use trainops_kernels::random::draw::Output;
use trainops_kernels::random::philox::{detected, fill_stores, Level, Stores, STREAM_BYTES};
use trainops_kernels::random::uniform;
use trainops_kernels::{Parallelism, RayonPool, Sequential};

/// One measured fill.
type Row<'a> = &'a dyn Fn(&mut [u32]);

fn main() {
    let rounds = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(15usize);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("rayon pool");
    let two = RayonPool(Some(&pool));
    let state = [0x0123_4567, 0x89AB_CDEF, 0, 0, 0xDEAD_BEEF, 0x1234_5678];
    let level = detected();
    let uniform = std::env::args().any(|a| a == "uniform");
    let what = if uniform { "PhiloxUniform float32" } else { "Philox" };
    println!("{what} {level:?}, {rounds} interleaved rounds; streaming from {} MiB up", STREAM_BYTES >> 20);
    println!("| size | threads | normal stores GB/s | streaming GB/s | auto GB/s | NT fill GB/s | auto / NT fill | streaming / normal |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let jiffies0 = cpu_jiffies();
    let load0 = loadavg();
    let sizes: &[usize] = if uniform { &[4, 16, 64] } else { &[1, 2, 4, 8, 16, 64] };
    for &mib in sizes {
        let words = (mib << 20) / 4;
        let mut out = vec![1u32; words];
        for (threads, par) in [(1, &Sequential as &dyn Parallelism), (2, &two)] {
            let fill = |stores: Stores, o: &mut [u32]| fill_as(uniform, level, stores, &state, o, par);
            let rows: [Row<'_>; 4] =
                [&|o| fill(Stores::Normal, o), &|o| fill(Stores::Streaming, o), &|o| fill(Stores::Auto, o), &|o| {
                    stream_fill(o, par)
                }];
            let reps = (64 / mib).max(1);
            let mut gbs = vec![Vec::new(); rows.len()];
            for f in &rows {
                f(&mut out);
            }
            for r in 0..rounds {
                for k in (0..rows.len()).map(|j| (j + r) % rows.len()) {
                    let t = Instant::now();
                    for _ in 0..reps {
                        rows[k](std::hint::black_box(&mut out));
                    }
                    gbs[k].push((reps * words * 4) as f64 / t.elapsed().as_secs_f64() / 1e9);
                }
            }
            let m: Vec<f64> = gbs.iter().map(|g| median(g.clone())).collect();
            let ratio = |a: usize, b: usize| median(gbs[a].iter().zip(&gbs[b]).map(|(x, y)| x / y).collect());
            println!(
                "| {mib} MiB | {threads} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} |",
                m[0],
                m[1],
                m[2],
                m[3],
                ratio(2, 3),
                ratio(1, 0)
            );
        }
    }
    println!(
        "host: loadavg {load0} before, {} after; machine busy {:.0}% of CPU time during the run",
        loadavg(),
        100.0 * busy_share(jiffies0, cpu_jiffies())
    );
}

/// One fill of `out` under `stores`: Philox's words, or (`uniform`) `PhiloxUniform`'s float32
/// values in `[0, 1)` written over the same bytes.
fn fill_as(uniform: bool, level: Level, stores: Stores, state: &[u32; 6], out: &mut [u32], par: &dyn Parallelism) {
    if uniform {
        // SAFETY: f32 and u32 have the same size and alignment, and every bit pattern is a
        // valid f32; the borrow of `out` is held for the view's lifetime.
        let view = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<f32>(), out.len()) };
        uniform::fill_stores(level, stores, state, 0.0, 1.0, Output::F32(view), par);
    } else {
        fill_stores(level, stores, state, out, par);
    }
}

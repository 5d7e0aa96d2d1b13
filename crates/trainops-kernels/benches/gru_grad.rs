//! GRU backward through time (`grad::rnn::gru_grad_with`, gates recomputed or given) and the
//! forward keeping the gates (`grad::rnn::forward::gru_train_with`) at the `gru` training
//! bench's sizes (seq 16, batch 64, input 32, hidden 64, dX not wanted), both
//! `linear_before_reset`, on one thread and on a 2-thread rayon pool.
//!
//! `cargo bench -p trainops-kernels --bench gru_grad`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use trainops_kernels::grad::rnn::forward::{gru_train_with, GruTrainIn, GruTrainOut, GruTrainScratch};
use trainops_kernels::grad::rnn::{gru_grad_with, Direction, GruGradIn, GruGradOut, GruScratch, GruShape};
use trainops_kernels::{Parallelism, RayonPool, Sequential};

fn gru_grad(c: &mut Criterion) {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("rayon pool");
    for lbr in [true, false] {
        let sh = GruShape {
            seq: 16,
            batch: 64,
            input: 32,
            hidden: 64,
            direction: Direction::Forward,
            linear_before_reset: lbr,
        };
        let [lx, lw, lr, lb, lh, ly] = sh.lens();
        // Any values in the gates' working range (the time does not depend on them).
        let data =
            |n: usize, s: f32| (0..n).map(|k| s * ((k * 7919 % 1000) as f32 / 500.0 - 1.0)).collect::<Vec<f32>>();
        let (x, w, r, b, dyh) = (data(lx, 1.0), data(lw, 0.2), data(lr, 0.2), data(lb, 0.1), data(lh, 1.0));
        let (mut y, mut yh, mut gates) = (vec![0.0; ly], vec![0.0; lh], vec![0.0; sh.gates_len()]);
        let mut fwd_scratch = GruTrainScratch::default();
        let fin = GruTrainIn { x: &x, w: &w, r: &r, b: Some(&b), initial_h: None };
        let o = GruTrainOut { y: &mut y, y_h: Some(&mut yh), gates: &mut gates };
        gru_train_with(&sh, &fin, o, &Sequential, &mut fwd_scratch).expect("sizes");
        let (mut dw, mut dr, mut db, mut dh0) = (vec![0.0; lw], vec![0.0; lr], vec![0.0; lb], vec![0.0; lh]);
        let mut scratch = GruScratch::default();
        let two = RayonPool(Some(&pool));
        let lbr = u8::from(lbr);
        for (name, par) in [("1 thread", &Sequential as &dyn Parallelism), ("2 threads", &two)] {
            c.bench_function(&format!("gru_train/lbr{lbr}/{name}"), |bench| {
                bench.iter(|| {
                    let o = GruTrainOut { y: &mut y, y_h: Some(&mut yh), gates: &mut gates };
                    gru_train_with(&sh, black_box(&fin), o, par, &mut fwd_scratch).expect("sizes");
                })
            });
            for saved in [false, true] {
                let i = GruGradIn {
                    x: &x,
                    w: &w,
                    r: &r,
                    b: Some(&b),
                    initial_h: None,
                    y: &y,
                    dy: None,
                    dy_h: Some(&dyh),
                    gates: saved.then_some(&gates[..]),
                };
                let what = if saved { "saved gates" } else { "recomputed" };
                c.bench_function(&format!("gru_grad/lbr{lbr}/{what}/{name}"), |bench| {
                    bench.iter(|| {
                        let o = GruGradOut {
                            dx: None,
                            dw: Some(&mut dw),
                            dr: Some(&mut dr),
                            db: Some(&mut db),
                            dh0: Some(&mut dh0),
                        };
                        gru_grad_with(&sh, black_box(&i), o, par, &mut scratch).expect("sizes");
                    })
                });
            }
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = gru_grad
}
criterion_main!(benches);

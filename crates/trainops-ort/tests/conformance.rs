//! ONNX's own training-domain node tests (`models/onnx-node`, copied out of the onnx
//! package by `scripts/export_conformance.py`), run in ONNX Runtime with libtrainops, from
//! Rust. Tolerances are onnx's for these cases: rtol 1e-3, atol 1e-7.

mod common;

use std::path::Path;

use common::*;

const RTOL: f64 = 1e-3;
const ATOL: f64 = 1e-7;

fn data_files(dir: &Path, prefix: &str) -> Vec<Named> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(prefix)))
        .collect();
    // input_0.pb, input_1.pb, ..., input_10.pb: order by the number.
    files.sort_by_key(|p| {
        let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        stem.rsplit('_').next().and_then(|n| n.parse::<usize>().ok()).unwrap_or(usize::MAX)
    });
    files.iter().map(|p| read_tensor(p)).collect()
}

/// Runs one case; returns the number of output elements compared.
fn run_case(name: &str) -> usize {
    let dir = repo_root().join("models/onnx-node").join(name);
    let mut session = session(&dir.join("model.onnx"), 1).unwrap_or_else(|e| panic!("{name}: session: {e}"));
    let data = dir.join("test_data_set_0");
    let inputs = data_files(&data, "input_");
    let expected = data_files(&data, "output_");
    assert!(!inputs.is_empty() && !expected.is_empty(), "{name}: no test data in {}", data.display());
    let feeds: Vec<(String, ort::session::SessionInputValue<'_>)> =
        inputs.iter().map(|t| (t.name.clone(), to_value(t).into())).collect();
    let outputs = session.run(feeds).unwrap_or_else(|e| panic!("{name}: run: {e}"));
    let mut compared = 0;
    for want in &expected {
        let (dims, got) = read_value(&outputs[want.name.as_str()]);
        assert_eq!(dims, want.dims, "{name}: {} shape", want.name);
        let want_vals: Vec<f64> = match &want.data {
            Data::F32(v) => v.iter().map(|&x| f64::from(x)).collect(),
            Data::F64(v) => v.clone(),
            Data::I64(_) => panic!("{name}: integer output"),
        };
        for (i, (g, w)) in got.iter().zip(&want_vals).enumerate() {
            assert!((g - w).abs() <= ATOL + RTOL * w.abs(), "{name}: {}[{i}] = {g}, expected {w}", want.name);
        }
        compared += got.len();
    }
    compared
}

#[test]
fn test_adam() {
    assert_eq!(run_case("test_adam"), 6);
}

#[test]
fn test_adam_multiple() {
    // X1 has 1 element and X2 has 2: three outputs of each.
    assert_eq!(run_case("test_adam_multiple"), 9);
}

#[test]
fn test_adagrad() {
    assert_eq!(run_case("test_adagrad"), 2);
}

#[test]
fn test_adagrad_multiple() {
    // X1 has 1 element and X2 has 2: three outputs of each of X_new, H_new.
    assert_eq!(run_case("test_adagrad_multiple"), 6);
}

#[test]
fn test_momentum() {
    assert_eq!(run_case("test_momentum"), 4);
}

#[test]
fn test_momentum_multiple() {
    assert_eq!(run_case("test_momentum_multiple"), 6);
}

#[test]
fn test_nesterov_momentum() {
    assert_eq!(run_case("test_nesterov_momentum"), 4);
}

/// The exported cases carry the onnx version they came from.
#[test]
fn cases_record_their_onnx_version() {
    let version = std::fs::read_to_string(repo_root().join("models/onnx-node/VERSION")).expect("VERSION");
    assert!(version.contains("onnx"), "{version}");
}

//! The Trainer against a hand-written reference: artifacts of a least-squares model whose
//! update is plain ONNX (`W -= lr * T * grad`, applied only while the loss is below a
//! threshold: the skip output), checked against the same arithmetic in f64. Needs ONNX
//! Runtime (`$ORT_DYLIB_PATH`); without it every test returns early saying so. The
//! bit-for-bit comparison with the Python Trainer is tests/test_rust_trainer.py.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use onnx_protobuf::{
    attribute_proto::AttributeType, tensor_proto::DataType, tensor_shape_proto, type_proto, AttributeProto, GraphProto,
    Message, ModelProto, NodeProto, OperatorSetIdProto, TensorProto, TensorShapeProto, TypeProto, ValueInfoProto,
};
use trainops_trainer::{checkpoint, Batch, Error, HostTensor, Trainer, TrainerOptions};

const N: usize = 4;
const X: [[f32; 2]; N] = [[1.0, 2.0], [0.5, -1.0], [-1.5, 0.25], [2.0, 1.0]];
const Y: [f32; N] = [1.0, -0.5, 0.75, 2.5];

/// True (and a note on stderr) when ONNX Runtime is not available.
fn no_ort() -> bool {
    if std::env::var_os("ORT_DYLIB_PATH").is_none() {
        eprintln!("skipped: ORT_DYLIB_PATH is not set (the onnxruntime wheel's libonnxruntime.so.*)");
        return true;
    }
    false
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("trainops-trainer-it-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn value_info(name: &str, elem: DataType, dims: &[Result<i64, &str>]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| {
            let mut x = tensor_shape_proto::Dimension::new();
            x.value = Some(match d {
                Ok(v) => tensor_shape_proto::dimension::Value::DimValue(*v),
                Err(s) => tensor_shape_proto::dimension::Value::DimParam(s.to_string()),
            });
            x
        })
        .collect();
    let mut t = type_proto::Tensor::new();
    t.elem_type = elem as i32;
    t.shape = Some(TensorShapeProto { dim, ..Default::default() }).into();
    let tp = TypeProto { value: Some(type_proto::Value::TensorType(t)), ..Default::default() };
    ValueInfoProto { name: name.into(), type_: Some(tp).into(), ..Default::default() }
}

fn node(op: &str, inputs: &[&str], output: &str, attrs: Vec<AttributeProto>) -> NodeProto {
    NodeProto {
        op_type: op.into(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![output.into()],
        attribute: attrs,
        ..Default::default()
    }
}

fn int_attr(name: &str, i: i64) -> AttributeProto {
    AttributeProto { name: name.into(), type_: AttributeType::INT.into(), i, ..Default::default() }
}

fn scalar(name: &str, v: f32) -> TensorProto {
    TensorProto { name: name.into(), data_type: DataType::FLOAT as i32, float_data: vec![v], ..Default::default() }
}

fn save_model(
    path: &Path,
    nodes: Vec<NodeProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
    inits: Vec<TensorProto>,
) {
    let graph = GraphProto {
        node: nodes,
        input: inputs,
        output: outputs,
        initializer: inits,
        name: "g".into(),
        ..Default::default()
    };
    let model = ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto { domain: String::new(), version: 17, ..Default::default() }],
        graph: Some(graph).into(),
        ..Default::default()
    };
    std::fs::write(path, model.write_to_bytes().unwrap()).unwrap();
}

fn forward() -> Vec<NodeProto> {
    vec![
        node("MatMul", &["x", "W"], "pred", vec![]),
        node("Sub", &["pred", "y"], "d", vec![]),
        node("Mul", &["d", "d"], "sq", vec![]),
        node("ReduceMean", &["sq"], "loss", vec![int_attr("keepdims", 0)]),
    ]
}

/// Writes artifacts of the least-squares model into `dir`: W starts at `w0`, the step
/// applies only while loss < `threshold`; checkpoint metadata step `t0`, lr `lr`.
fn write_artifacts(dir: &Path, w0: [f32; 2], threshold: f32, t0: u64, lr: f64) {
    let data =
        || vec![value_info("x", DataType::FLOAT, &[Err("N"), Ok(2)]), value_info("y", DataType::FLOAT, &[Err("N")])];
    let w = || value_info("W", DataType::FLOAT, &[Ok(2)]);
    let loss = || value_info("loss", DataType::FLOAT, &[]);
    // grad = (2/N) d @ x; W' = ok ? W - lr * T * grad : W
    let mut nodes = forward();
    nodes.extend([
        node("MatMul", &["d", "x"], "g0", vec![]),
        node("Mul", &["g0", "two_over_n"], "grad", vec![]),
        node("Cast", &["trainops/T"], "Tf", vec![int_attr("to", DataType::FLOAT as i64)]),
        node("Mul", &["trainops/lr", "Tf"], "rate", vec![]),
        node("Mul", &["rate", "grad"], "delta", vec![]),
        node("Sub", &["W", "delta"], "W1", vec![]),
        node("Less", &["loss", "threshold"], "ok", vec![]),
        node("Where", &["ok", "W1", "W"], "trainops/new/W", vec![]),
    ]);
    let mut inputs = data();
    inputs.extend([
        w(),
        value_info("trainops/lr", DataType::FLOAT, &[Ok(1)]),
        value_info("trainops/T", DataType::INT64, &[Ok(1)]),
    ]);
    let outputs =
        vec![loss(), value_info("trainops/new/W", DataType::FLOAT, &[Ok(2)]), value_info("ok", DataType::BOOL, &[])];
    let inits = vec![scalar("two_over_n", 2.0 / N as f32), scalar("threshold", threshold)];
    save_model(&dir.join("training.onnx"), nodes, inputs, outputs, inits);
    let mut inputs = data();
    inputs.push(w());
    save_model(&dir.join("eval.onnx"), forward(), inputs, vec![loss()], vec![]);

    let manifest = serde_json::json!({
        "format": "trainops-artifacts", "format_version": 1, "producer": "test",
        "min_onnxruntime": "1.17.0", "custom_op_library": "libtrainops.so", "custom_ops": [],
        "models": {"training": "training.onnx", "eval": "eval.onnx", "inference": "eval.onnx"},
        "checkpoint": "checkpoint.safetensors",
        "data_inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 2]},
                        {"name": "y", "dtype": "float32", "shape": ["N"]}],
        "loss": {"training_output": "loss", "eval_output": "loss", "dtype": "float32", "shape": []},
        "learning_rate": {"input": "trainops/lr", "dtype": "float32"},
        "step": {"input": "trainops/T", "dtype": "int64", "skip_output": "ok"},
        "states": [{"input": "W", "output": "trainops/new/W", "kind": "param", "dtype": "float32", "shape": [2]}],
        "extra_outputs": [{"name": "ok", "dtype": "bool", "shape": []}],
        "parameters": ["W"], "eval_inputs": ["x", "y", "W"],
        "options": {"loss": "loss", "optimizer": {"type": "Momentum", "lr": 0.01}, "params": ["W"],
                    "policy": "float32", "key_seed": 5}
    });
    std::fs::write(dir.join("manifest.json"), manifest.to_string()).unwrap();
    let w = HostTensor::from_vec(vec![2], w0.to_vec()).unwrap();
    let model = HostTensor::from_vec(vec![MODEL.len()], MODEL.to_vec()).unwrap();
    checkpoint::write(&dir.join("checkpoint.safetensors"), [("W", &w), ("trainops/model", &model)], &metadata(t0, lr))
        .unwrap();
}

/// The checkpoint's source model: a ModelProto (ir_version 8, a graph named "g"); the
/// readers check its wire format and its hash, not what it computes.
const MODEL: [u8; 7] = [0x08, 0x08, 0x3a, 0x03, 0x12, 0x01, b'g'];
const CONFIG: &str =
    r#"{"loss": "loss", "optimizer": {"type": "Momentum", "lr": 0.01}, "params": ["W"], "policy": "float32"}"#;

fn metadata(t0: u64, lr: f64) -> HashMap<String, String> {
    [
        ("format", "trainops-checkpoint".to_string()),
        ("format_version", "1".into()),
        ("step", t0.to_string()),
        ("learning_rate", trainops_trainer::python_repr(lr)),
        ("loss_scale", String::new()),
        ("seed", "5".into()),
        ("skipped", "0".into()),
        ("config", CONFIG.into()),
        ("model_sha256", checkpoint::sha256_hex(&MODEL)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn batch() -> Batch {
    let mut b = Batch::new();
    b.insert("x".into(), HostTensor::from_vec(vec![N, 2], X.iter().flatten().copied().collect()).unwrap());
    b.insert("y".into(), HostTensor::from_vec(vec![N], Y.to_vec()).unwrap());
    b
}

/// The reference in f64: (loss, gradient) at `w`.
fn reference(w: [f64; 2]) -> (f64, [f64; 2]) {
    let mut loss = 0.0;
    let mut g = [0.0; 2];
    for (x, y) in X.iter().zip(Y) {
        let d = x[0] as f64 * w[0] + x[1] as f64 * w[1] - y as f64;
        loss += d * d / N as f64;
        g[0] += 2.0 * d * x[0] as f64 / N as f64;
        g[1] += 2.0 * d * x[1] as f64 / N as f64;
    }
    (loss, g)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * (1.0 + b.abs())
}

#[test]
fn steps_update_in_place_and_follow_the_reference() {
    if no_ort() {
        return;
    }
    let dir = scratch("steps");
    let lr = 0.01;
    write_artifacts(&dir, [0.5, -0.25], 1e9, 3, lr);
    let mut tr = Trainer::from_artifacts(&dir).unwrap();
    assert_eq!((tr.next_step(), tr.step_count(), tr.learning_rate()), (3, 2, lr));
    let mut w = [0.5f64, -0.25];
    let mut t = 3.0;
    for _ in 0..5 {
        let (loss, g) = reference(w);
        let got = tr.step(&batch()).unwrap();
        assert!(close(got, loss), "loss {got} vs reference {loss}");
        w = [w[0] - lr * t * g[0], w[1] - lr * t * g[1]];
        t += 1.0;
        let have = tr.parameters().unwrap()[0].1.to_vec::<f32>().unwrap();
        assert!(close(have[0] as f64, w[0]) && close(have[1] as f64, w[1]), "{have:?} vs {w:?}");
    }
    assert_eq!((tr.next_step(), tr.skipped()), (8, 0));
    // eval: the current parameters' loss, no update.
    let e = tr.eval(&batch()).unwrap();
    assert!(close(e, reference(w).0), "eval {e}");
    assert_eq!(tr.eval(&batch()).unwrap(), e);
    assert_eq!(tr.next_step(), 8);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_skipped_step_changes_nothing_but_the_skipped_count() {
    if no_ort() {
        return;
    }
    let dir = scratch("skip");
    // Loss at w0 is above the threshold: every step is skipped.
    write_artifacts(&dir, [3.0, 3.0], 1.0, 1, 0.1);
    let mut tr = Trainer::from_artifacts(&dir).unwrap();
    let before = tr.state("W").unwrap();
    for k in 1..=3 {
        let loss = tr.step(&batch()).unwrap();
        assert!(close(loss, reference([3.0, 3.0]).0));
        assert_eq!((tr.next_step(), tr.skipped()), (1, k));
    }
    assert_eq!(tr.state("W").unwrap(), before);
    let path = dir.join("after.safetensors");
    tr.save(&path).unwrap();
    let saved = checkpoint::read(&path).unwrap();
    assert_eq!(saved.metadata["skipped"], "3");
    assert_eq!(saved.metadata["step"], "1");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn save_and_resume_continue_bit_for_bit() {
    if no_ort() {
        return;
    }
    let dir = scratch("resume");
    write_artifacts(&dir, [0.5, -0.25], 1e9, 1, 0.01);
    let mut a = Trainer::from_artifacts(&dir).unwrap();
    a.step(&batch()).unwrap();
    a.set_learning_rate(0.003).unwrap();
    a.step(&batch()).unwrap();
    let path = dir.join("mid.safetensors");
    a.save(&path).unwrap();
    let saved = checkpoint::read(&path).unwrap();
    let want = {
        let mut m = metadata(3, 0.003);
        m.insert("learning_rate".into(), "0.003".into());
        m
    };
    assert_eq!(saved.metadata, want);
    assert_eq!(saved.tensors["trainops/model"].to_vec::<u8>().unwrap(), MODEL.to_vec());
    let mut b =
        Trainer::from_artifacts_with(&dir, TrainerOptions { checkpoint: Some(path), ..Default::default() }).unwrap();
    assert_eq!((b.next_step(), b.learning_rate()), (3, 0.003));
    assert_eq!(b.state("W").unwrap(), a.state("W").unwrap());
    for _ in 0..3 {
        assert_eq!(a.step(&batch()).unwrap().to_bits(), b.step(&batch()).unwrap().to_bits());
    }
    assert_eq!(b.state("W").unwrap(), a.state("W").unwrap());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_batches_and_checkpoints_are_named() {
    if no_ort() {
        return;
    }
    let dir = scratch("errors");
    write_artifacts(&dir, [0.5, -0.25], 1e9, 1, 0.01);
    let mut tr = Trainer::from_artifacts(&dir).unwrap();
    let mut b = batch();
    b.remove("y");
    let e = tr.step(&b).unwrap_err();
    assert!(matches!(&e, Error::MissingInput { name, .. } if name == "y"), "{e}");
    let mut b = batch();
    b.insert("y".into(), HostTensor::from_vec(vec![N], vec![1.0f64; N]).unwrap());
    assert_eq!(tr.step(&b).unwrap_err().to_string(), "Trainer::step: input \"y\": expected float32, got float64");
    let mut b = batch();
    b.insert("x".into(), HostTensor::from_vec(vec![N, 3], vec![1.0f32; 3 * N]).unwrap());
    assert_eq!(tr.step(&b).unwrap_err().to_string(), "Trainer::step: input \"x\": expected shape [?, 2], got [4, 3]");
    let mut b = batch();
    b.insert("z".into(), HostTensor::from_vec(vec![1], vec![1.0f32]).unwrap());
    assert!(matches!(tr.step(&b).unwrap_err(), Error::UnknownInput { name, .. } if name == "z"));
    assert!(tr.set_learning_rate(f64::NAN).is_err());
    assert!(tr.set_learning_rate(-1.0).is_err());
    assert_eq!(tr.next_step(), 1, "failed steps do not count");

    // Metadata without "seed": named (the metadata is checked first, as in Python).
    let model = HostTensor::from_vec(vec![MODEL.len()], MODEL.to_vec()).unwrap();
    let w = HostTensor::from_vec(vec![3], vec![0.0f32; 3]).unwrap();
    let mut m = metadata(1, 0.01);
    m.remove("seed");
    let bad = dir.join("bad.safetensors");
    checkpoint::write(&bad, [("W", &w), ("trainops/model", &model)], &m).unwrap();
    let with = |path: &Path| TrainerOptions { checkpoint: Some(path.to_path_buf()), ..Default::default() };
    let e = Trainer::from_artifacts_with(&dir, with(&bad)).unwrap_err();
    let Error::Checkpoint { problems, path } = &e else { panic!("{e}") };
    assert_eq!((problems, path), (&vec!["metadata \"seed\" is missing".to_string()], &bad));
    // W of the wrong shape and a stray tensor: both in one error.
    let stray = HostTensor::from_vec(vec![1], vec![0u8]).unwrap();
    checkpoint::write(&bad, [("W", &w), ("trainops/model", &model), ("stray", &stray)], &metadata(1, 0.01)).unwrap();
    let e = Trainer::from_artifacts_with(&dir, with(&bad)).unwrap_err();
    let Error::Checkpoint { problems, .. } = &e else { panic!("{e}") };
    assert_eq!(
        problems,
        &vec![
            "state \"W\": expected float32 [2], got float32 [3]".to_string(),
            "tensors [\"stray\"] are not states of the training model".into()
        ]
    );
    // A step at the largest int64: loads, but cannot advance (T would wrap around).
    let w = HostTensor::from_vec(vec![2], vec![0.5f32, -0.25]).unwrap();
    checkpoint::write(&bad, [("W", &w), ("trainops/model", &model)], &metadata(i64::MAX as u64, 0.01)).unwrap();
    let mut last = Trainer::from_artifacts_with(&dir, with(&bad)).unwrap();
    let e = last.step(&batch()).unwrap_err().to_string();
    assert_eq!(e, "Trainer::step: T = 9223372036854775807 cannot advance past int64");
    assert_eq!(last.next_step(), i64::MAX as u64);
    std::fs::remove_dir_all(dir).unwrap();
}

//! `manifest.json` of the training artifacts (format version 1): what the training model's
//! inputs and outputs are and how to bind them. Every manifest is validated against
//! `docs/manifest.schema.json` ([`crate::schema`]), then checked for what the schema cannot
//! express ([`Manifest::problems`]: a name bound twice, the skip output, the parameters)
//! and, once the session exists, against the training model's inputs and outputs
//! ([`Manifest::model_problems`]): the Python reader's checks, with the same messages.
//! Keys the schema allows but this reader does not use are ignored.

use std::path::Path;
use std::sync::OnceLock;

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::schema::{show, Validator};
use crate::tensor::DType;

/// The `format` a manifest must have.
pub const FORMAT: &str = "trainops-artifacts";
/// The `format_version` this crate reads.
pub const FORMAT_VERSION: u64 = 1;

/// The parsed `manifest.json`.
#[derive(Debug, Clone, Deserialize)]
pub struct Manifest {
    /// `"trainops-artifacts"`.
    pub format: String,
    /// `1`.
    pub format_version: u64,
    /// Who wrote the artifacts (`"trainops <version>"`).
    pub producer: String,
    /// The oldest ONNX Runtime the models need.
    pub min_onnxruntime: Option<String>,
    /// The custom-op library's file name (`libtrainops.so`).
    pub custom_op_library: Option<String>,
    /// The custom ops the models use (`"domain::Op"`); empty: no library needed.
    pub custom_ops: Vec<String>,
    /// The model files: bare file names in the artifacts folder.
    pub models: Models,
    /// The checkpoint file: a bare file name in the artifacts folder.
    pub checkpoint: String,
    /// The inputs fed on every step.
    pub data_inputs: Vec<TensorSpec>,
    /// The loss outputs.
    pub loss: Loss,
    /// The learning-rate input.
    pub learning_rate: LearningRate,
    /// The step input `T`.
    pub step: Step,
    /// Every in-place state of the training model.
    pub states: Vec<State>,
    /// Other outputs of the training model (bound to buffers too).
    pub extra_outputs: Vec<TensorSpec>,
    /// The trained parameters (state input names), in order.
    pub parameters: Vec<String>,
    /// The eval model's inputs: the data inputs, then the parameters.
    pub eval_inputs: Vec<String>,
    /// How trainops built the step (`loss`, `optimizer`, `params`, `policy`, `key_seed`):
    /// checked against the checkpoint's `config` and `seed`.
    pub options: Value,
}

/// `models`: bare file names in the artifacts folder.
#[derive(Debug, Clone, Deserialize)]
pub struct Models {
    /// One training step (forward, loss, backward, update).
    pub training: String,
    /// Forward and loss, no update.
    pub eval: Option<String>,
    /// The original model with the weights (not used by the trainer).
    pub inference: Option<String>,
}

/// A named tensor's dtype and shape.
#[derive(Debug, Clone, Deserialize)]
pub struct TensorSpec {
    /// The graph input or output name.
    pub name: String,
    /// Its numpy dtype name.
    pub dtype: String,
    /// Its dimensions: a number, or anything else (`null`, a symbol such as `"N"`) for a
    /// dynamic one; `None` when the rank is unknown.
    #[serde(default)]
    pub shape: Option<Vec<Value>>,
}

/// `loss`: the loss outputs of the training and eval models.
#[derive(Debug, Clone, Deserialize)]
pub struct Loss {
    /// The training model's loss output.
    pub training_output: String,
    /// The eval model's loss output.
    pub eval_output: Option<String>,
    /// The loss's numpy dtype.
    pub dtype: String,
    /// Its static shape.
    #[serde(deserialize_with = "static_shape")]
    pub shape: Vec<usize>,
}

/// `learning_rate`: fed with shape `[1]` on every step.
#[derive(Debug, Clone, Deserialize)]
pub struct LearningRate {
    /// The input name.
    pub input: String,
    /// Its numpy dtype name.
    pub dtype: String,
}

/// `step`: the update count `T`, int64 of shape `[1]`.
#[derive(Debug, Clone, Deserialize)]
pub struct Step {
    /// The input name.
    pub input: String,
    /// Its numpy dtype name (`int64`).
    pub dtype: String,
    /// A bool output saying whether the step was applied (`T` advances only then), or
    /// `None` (`T` always advances).
    pub skip_output: Option<String>,
}

/// One in-place state: its input and its output are bound to one buffer.
#[derive(Debug, Clone, Deserialize)]
pub struct State {
    /// The graph input (and the checkpoint's tensor name).
    pub input: String,
    /// The graph output holding its new value.
    pub output: String,
    /// `param`, `optimizer`, `loss_scale`, `fp16_copy`, `rng`, `bn_stat`.
    pub kind: String,
    /// Its numpy dtype name.
    pub dtype: String,
    /// Its dimensions (static).
    #[serde(deserialize_with = "static_shape")]
    pub shape: Vec<usize>,
    /// The parameter it belongs to (optimizer state, float16 copy), if any.
    #[serde(default)]
    pub param: Option<String>,
    /// Its name within the kind (`V`, `H`, `scale`, `good_steps`), if any.
    #[serde(default)]
    pub slot: Option<String>,
}

/// A dimension the schema accepted (an integer >= 0, `2.0` included) as a `usize`.
fn dim(v: &Value) -> Option<usize> {
    v.as_u64()
        .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 2f64.powi(64)).map(|f| f as u64))
        .and_then(|d| usize::try_from(d).ok())
}

fn static_shape<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<usize>, D::Error> {
    let values = Vec::<Value>::deserialize(d)?;
    values
        .iter()
        .map(|v| dim(v).ok_or_else(|| serde::de::Error::custom(format!("dimension {v} does not fit a usize"))))
        .collect()
}

impl TensorSpec {
    /// The dimensions, `None` for a dynamic one; `None` overall when the rank is unknown.
    pub fn dims(&self) -> Option<Vec<Option<usize>>> {
        self.shape.as_ref().map(|s| s.iter().map(dim).collect())
    }
}

/// The dtype named `name` in the manifest at `path` (`what`: its key).
pub(crate) fn dtype(path: &Path, what: &str, name: &str) -> Result<DType> {
    DType::from_numpy_name(name).ok_or_else(|| Error::Manifest {
        path: path.to_path_buf(),
        problems: vec![format!(
            "{what}: dtype {name:?} is not supported by this reader (expected one of float32, float64, float16, \
             bfloat16, int64, int32, int16, int8, uint64, uint32, uint16, uint8, bool)"
        )],
    })
}

fn validator() -> &'static Validator {
    static V: OnceLock<Validator> = OnceLock::new();
    V.get_or_init(Validator::manifest)
}

impl Manifest {
    /// Reads and checks `path`: a regular file of UTF-8 JSON, valid against the schema,
    /// with none of [`Manifest::problems`]. [`Error::Manifest`] lists every problem, each
    /// with its key and what was expected.
    pub fn read(path: &Path) -> Result<Manifest> {
        crate::checkpoint::refuse_special(path)?;
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let text = String::from_utf8(bytes).map_err(|e| Error::Manifest {
            path: path.to_path_buf(),
            problems: vec![format!("expected a JSON object in UTF-8: {e}")],
        })?;
        Self::parse(&text, path)
    }

    /// Parses and checks the manifest `text` (`path`: for the messages).
    pub fn parse(text: &str, path: &Path) -> Result<Manifest> {
        let bad = |problems: Vec<String>| Error::Manifest { path: path.to_path_buf(), problems };
        let value: Value =
            serde_json::from_str(text).map_err(|e| bad(vec![format!("expected a JSON object in UTF-8: {e}")]))?;
        let problems = validator().problems(&value);
        if !problems.is_empty() {
            return Err(bad(problems));
        }
        let m: Manifest = serde_json::from_value(value).map_err(|e| bad(vec![e.to_string()]))?;
        let problems = m.problems();
        if !problems.is_empty() {
            return Err(bad(problems));
        }
        Ok(m)
    }

    /// `(key, name)` of every training-model input the manifest binds.
    pub fn bound_inputs(&self) -> Vec<(String, &str)> {
        let mut out: Vec<(String, &str)> = self
            .data_inputs
            .iter()
            .enumerate()
            .map(|(i, d)| (format!("data_inputs[{i}].name"), d.name.as_str()))
            .collect();
        out.push(("learning_rate.input".into(), &self.learning_rate.input));
        out.push(("step.input".into(), &self.step.input));
        out.extend(self.states.iter().enumerate().map(|(i, s)| (format!("states[{i}].input"), s.input.as_str())));
        out
    }

    /// `(key, name)` of every training-model output the manifest binds.
    pub fn bound_outputs(&self) -> Vec<(String, &str)> {
        let mut out: Vec<(String, &str)> =
            self.states.iter().enumerate().map(|(i, s)| (format!("states[{i}].output"), s.output.as_str())).collect();
        out.push(("loss.training_output".into(), &self.loss.training_output));
        out.extend(
            self.extra_outputs.iter().enumerate().map(|(i, o)| (format!("extra_outputs[{i}].name"), o.name.as_str())),
        );
        out
    }

    /// What a manifest valid against the schema may still get wrong (empty: nothing): a
    /// name bound twice (two states, or a state and a data input, on one input; two
    /// states, a state and the loss or an extra output on one output), `step.skip_output`
    /// that is no bool extra output, a parameter that is no state of kind `param`. The
    /// Python reader's `manifest_problems`, with the same messages.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for (named, what) in
            [(self.bound_inputs(), "an input is bound once"), (self.bound_outputs(), "an output has one buffer")]
        {
            let mut seen: std::collections::HashMap<&str, String> = std::collections::HashMap::new();
            for (key, name) in named {
                match seen.get(name) {
                    Some(other) => problems.push(format!("{key}: {} is also {other} ({what})", quoted(name))),
                    None => {
                        seen.insert(name, key);
                    }
                }
            }
        }
        if let Some(skip) = &self.step.skip_output {
            match self.extra_outputs.iter().position(|o| &o.name == skip) {
                None => problems.push(format!(
                    "step.skip_output: {} is not the name of an extra_outputs entry (expected a bool extra output)",
                    quoted(skip)
                )),
                Some(i) if self.extra_outputs[i].dtype != "bool" => problems.push(format!(
                    "step.skip_output: {} is extra_outputs[{i}], of dtype {} (expected bool)",
                    quoted(skip),
                    self.extra_outputs[i].dtype
                )),
                Some(_) => {}
            }
        }
        for (i, p) in self.parameters.iter().enumerate() {
            if !self.states.iter().any(|s| s.kind == "param" && &s.input == p) {
                problems.push(format!("parameters[{i}]: {} is not the input of a state of kind \"param\"", quoted(p)));
            }
        }
        problems
    }

    /// The manifest against its training model's `inputs` (initializers excluded) and
    /// `outputs`: every name it binds exists there, every model input is bound.
    pub fn model_problems(&self, inputs: &[&str], outputs: &[&str]) -> Vec<String> {
        let file = &self.models.training;
        let mut problems: Vec<String> = self
            .bound_inputs()
            .into_iter()
            .filter(|(_, name)| !inputs.contains(name))
            .map(|(key, name)| format!("{key}: {} is not an input of {file}", quoted(name)))
            .collect();
        let bound: Vec<&str> = self.bound_inputs().into_iter().map(|(_, n)| n).collect();
        problems.extend(inputs.iter().filter(|n| !bound.contains(n)).map(|n| {
            format!(
                "data_inputs: the input {} of {file} is not bound (neither a data input, a state, the learning rate \
                 nor the step)",
                quoted(n)
            )
        }));
        problems.extend(
            self.bound_outputs()
                .into_iter()
                .filter(|(_, name)| !outputs.contains(name))
                .map(|(key, name)| format!("{key}: {} is not an output of {file}", quoted(name))),
        );
        problems
    }

    /// The manifest's `options` against the checkpoint's `config` and `seed` (both record
    /// how the step was built; they must agree): the Python reader's `options_problems`.
    pub fn options_problems(&self, config: &Value, seed: &str) -> Vec<String> {
        let mut problems = Vec::new();
        // A trainops.losses loss is an object in the config and its output's name in options.
        let loss_object = config.get("loss").is_some_and(Value::is_object);
        for k in ["loss", "optimizer", "params", "policy"] {
            if k == "loss" && loss_object {
                continue;
            }
            let (have, want) = (config.get(k).unwrap_or(&Value::Null), self.options.get(k).unwrap_or(&Value::Null));
            if !json_equal(have, want) {
                problems.push(format!(
                    "config {k:?}: the checkpoint has {}, the manifest's options.{k} {}",
                    show(have),
                    show(want)
                ));
            }
        }
        let key_seed = self.options.get("key_seed").unwrap_or(&Value::Null);
        if let Ok(s) = seed.parse::<u64>() {
            if !json_equal(key_seed, &Value::from(s)) {
                problems.push(format!("seed {seed}: the manifest's options.key_seed is {key_seed}"));
            }
        }
        problems
    }

    /// The state whose input is `name`.
    pub fn state(&self, name: &str) -> Option<&State> {
        self.states.iter().find(|s| s.input == name)
    }
}

/// JSON equality: numbers by value (`1 == 1.0`, an integer beyond 2^53 against a float
/// exactly), `true` never equal to `1`, objects by keys.
fn json_equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let int = |n: &serde_json::Number| n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from));
            // A float with no fraction and |f| < 2^100 converts to i128 exactly.
            let same = |i: i128, f: f64| f.fract() == 0.0 && f.abs() < 1e30 && f as i128 == i;
            match (int(x), int(y)) {
                (Some(i), Some(j)) => i == j,
                (Some(i), None) => y.as_f64().is_some_and(|f| same(i, f)),
                (None, Some(j)) => x.as_f64().is_some_and(|f| same(j, f)),
                (None, None) => x.as_f64() == y.as_f64(),
            }
        }
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(a, b)| json_equal(a, b)),
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| json_equal(v, w)))
        }
        _ => a == b,
    }
}

fn quoted(name: &str) -> String {
    show(&Value::String(name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const EXAMPLE: &str = r#"{
      "format": "trainops-artifacts", "format_version": 1, "producer": "trainops 0.1.0",
      "min_onnxruntime": "1.17.0", "custom_op_library": "libtrainops.so",
      "custom_ops": ["ai.onnx.preview.training::Adam"],
      "models": {"training": "training.onnx", "eval": "eval.onnx", "inference": "inference.onnx"},
      "checkpoint": "checkpoint.safetensors",
      "data_inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 1, 8, 8.0]}],
      "loss": {"training_output": "loss", "eval_output": "loss", "dtype": "float32", "shape": []},
      "learning_rate": {"input": "trainops/lr", "dtype": "float32"},
      "step": {"input": "trainops/T", "dtype": "int64", "skip_output": "trainops/finite"},
      "states": [
        {"input": "W", "output": "trainops/new/W", "kind": "param", "param": "W", "slot": null, "dtype": "float32", "shape": [4, 1]},
        {"input": "trainops/V/W", "output": "trainops/new/V/W", "kind": "optimizer", "dtype": "float32", "shape": [4, 1.0], "future": 1}
      ],
      "extra_outputs": [{"name": "trainops/finite", "dtype": "bool", "shape": []}],
      "parameters": ["W"], "eval_inputs": ["x", "W"],
      "options": {"loss": "loss", "optimizer": {"type": "Adam", "lr": 0.01}, "params": ["W"], "policy": "float32", "key_seed": 7}
    }"#;

    fn problems(text: &str) -> Vec<String> {
        match Manifest::parse(text, Path::new("m.json")) {
            Err(Error::Manifest { problems, .. }) => problems,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn reads_the_contract_example() {
        let m = Manifest::parse(EXAMPLE, Path::new("manifest.json")).unwrap();
        assert_eq!(m.data_inputs[0].dims(), Some(vec![None, Some(1), Some(8), Some(8)]));
        assert_eq!(m.states[1].shape, vec![4, 1]);
        assert_eq!(m.step.skip_output.as_deref(), Some("trainops/finite"));
        assert_eq!(m.state("W").unwrap().kind, "param");
        assert_eq!(m.extra_outputs[0].dims(), Some(vec![]));
        assert!(m
            .model_problems(
                &["x", "trainops/lr", "trainops/T", "W", "trainops/V/W"],
                &["loss", "trainops/new/W", "trainops/new/V/W", "trainops/finite"]
            )
            .is_empty());
    }

    #[test]
    fn rejects_what_the_schema_refuses() {
        assert_eq!(
            problems(&EXAMPLE.replace("\"format_version\": 1", "\"format_version\": 2")),
            vec!["format_version: expected 1, got 2"]
        );
        assert_eq!(
            problems(&EXAMPLE.replace("\"bool\"", "\"complex64\"")),
            vec![
            "extra_outputs[0].dtype: expected one of \"float32\", \"float64\", \"float16\", \"bfloat16\", \"int64\", \
             \"int32\", \"uint64\", \"uint32\", \"bool\", \"int8\", \"uint8\", got \"complex64\""
        ]
        );
        assert_eq!(
            problems(&EXAMPLE.replace("\"shape\": [4, 1]}", "\"shape\": \"W\"}")),
            vec!["states[0].shape: expected an array, each item an integer >= 0, got \"W\""]
        );
        let file = "a bare file name inside the artifacts folder (no '/', '\\' or NUL, and not '.' or '..')";
        for bad in ["../x.safetensors", "/abs/x", "..", ".", "a\\\\b", "nul\\u0000"] {
            let text = EXAMPLE.replace("\"checkpoint.safetensors\"", &format!("\"{bad}\""));
            let p = problems(&text);
            assert_eq!(p.len(), 1, "{bad}: {p:?}");
            assert!(p[0].starts_with(&format!("checkpoint: expected {file}, got ")), "{p:?}");
        }
        assert!(problems(&EXAMPLE.replace("\"training.onnx\"", "\"../run/training.onnx\""))[0]
            .starts_with("models.training: expected a bare file name"));
        let e = Manifest::parse("{", Path::new("m.json")).unwrap_err().to_string();
        assert!(e.starts_with("manifest m.json: expected a JSON object in UTF-8: EOF while parsing"), "{e}");
        // Every missing key and the wrong type, each named.
        let p = problems(r#"{"format": "trainops-artifacts", "format_version": 1, "states": "W"}"#);
        assert_eq!(p.len(), 15, "{p:#?}");
        assert!(
            p.contains(&"states: expected a non-empty array, each item an object, got \"W\"".to_string()),
            "{p:#?}"
        );
        assert!(p.contains(&"loss: required key is missing (expected an object)".to_string()), "{p:#?}");
    }

    #[test]
    fn rejects_what_the_schema_cannot_express() {
        // One output bound to two states.
        assert_eq!(
            problems(&EXAMPLE.replace("trainops/new/V/W", "trainops/new/W")),
            vec!["states[1].output: \"trainops/new/W\" is also states[0].output (an output has one buffer)"]
        );
        // The loss on a state's output.
        assert_eq!(
            problems(&EXAMPLE.replace("\"training_output\": \"loss\"", "\"training_output\": \"trainops/new/W\"")),
            vec!["loss.training_output: \"trainops/new/W\" is also states[0].output (an output has one buffer)"]
        );
        // A data input that is also a state.
        assert_eq!(
            problems(&EXAMPLE.replace("{\"name\": \"x\"", "{\"name\": \"W\"")),
            vec!["states[0].input: \"W\" is also data_inputs[0].name (an input is bound once)"]
        );
        assert_eq!(
            problems(&EXAMPLE.replace("\"skip_output\": \"trainops/finite\"", "\"skip_output\": \"ok\"")),
            vec!["step.skip_output: \"ok\" is not the name of an extra_outputs entry (expected a bool extra output)"]
        );
        assert_eq!(
            problems(&EXAMPLE.replace(
                "{\"name\": \"trainops/finite\", \"dtype\": \"bool\"",
                "{\"name\": \"trainops/finite\", \"dtype\": \"float32\""
            )),
            vec!["step.skip_output: \"trainops/finite\" is extra_outputs[0], of dtype float32 (expected bool)"]
        );
        assert_eq!(
            problems(&EXAMPLE.replace("\"parameters\": [\"W\"]", "\"parameters\": [\"trainops/V/W\"]")),
            vec!["parameters[0]: \"trainops/V/W\" is not the input of a state of kind \"param\""]
        );
        let m = Manifest::parse(EXAMPLE, Path::new("m.json")).unwrap();
        assert_eq!(m.model_problems(&["x", "y", "trainops/lr", "W", "trainops/V/W"], &["loss", "trainops/new/W", "trainops/finite"]), vec![
            "step.input: \"trainops/T\" is not an input of training.onnx",
            "data_inputs: the input \"y\" of training.onnx is not bound (neither a data input, a state, the learning rate nor the step)",
            "states[1].output: \"trainops/new/V/W\" is not an output of training.onnx",
        ]);
    }

    #[test]
    fn json_numbers_compare_by_value() {
        assert!(json_equal(&json!(1), &json!(1.0)));
        assert!(json_equal(&json!({"a": [7]}), &json!({"a": [7.0]})));
        assert!(!json_equal(&json!(true), &json!(1)));
        assert!(!json_equal(&json!(0.5), &json!(0)));
        let big: Value = serde_json::from_str("18446744073709551616").unwrap(); // 2^64 as f64
        assert!(!json_equal(&big, &json!(u64::MAX)));
        // 2^53 + 1: no float is it
        assert!(json_equal(&json!(9007199254740993u64), &json!(9007199254740993u64)));
        assert!(!json_equal(&json!(9007199254740993u64), &json!(9007199254740992.0)));
    }

    #[test]
    fn options_must_match_the_checkpoint() {
        let m = Manifest::parse(EXAMPLE, Path::new("m.json")).unwrap();
        let config = serde_json::json!({"loss": "loss", "optimizer": {"type": "Adam", "lr": 0.01}, "params": ["W"], "policy": "float32"});
        assert!(m.options_problems(&config, "7").is_empty());
        let other = serde_json::json!({"loss": "loss", "optimizer": {"type": "Adam", "lr": 0.02}, "params": ["W"], "policy": "float32"});
        assert_eq!(m.options_problems(&other, "8"), vec![
            "config \"optimizer\": the checkpoint has {\"lr\":0.02,\"type\":\"Adam\"}, the manifest's options.optimizer {\"lr\":0.01,\"type\":\"Adam\"}",
            "seed 8: the manifest's options.key_seed is 7",
        ]);
    }
}

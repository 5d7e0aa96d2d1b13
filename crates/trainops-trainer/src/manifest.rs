//! `manifest.json` of the training artifacts (format version 1): what the training model's
//! inputs and outputs are and how to bind them. Unknown fields are ignored (a later minor
//! addition does not break this reader); a different `format` or `format_version` is an
//! error.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};
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
    #[serde(default)]
    pub producer: String,
    /// The oldest ONNX Runtime the models need.
    #[serde(default)]
    pub min_onnxruntime: Option<String>,
    /// The custom-op library's file name (`libtrainops.so`).
    #[serde(default)]
    pub custom_op_library: Option<String>,
    /// The custom ops the models use (`"domain::Op"`); empty: no library needed.
    #[serde(default)]
    pub custom_ops: Vec<String>,
    /// The model files, relative to the artifacts folder.
    pub models: Models,
    /// The checkpoint file, relative to the artifacts folder.
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
    #[serde(default)]
    pub extra_outputs: Vec<TensorSpec>,
    /// The trained parameters (state input names), in order.
    pub parameters: Vec<String>,
}

/// `models`: file names relative to the artifacts folder.
#[derive(Debug, Clone, Deserialize)]
pub struct Models {
    /// One training step (forward, loss, backward, update).
    pub training: String,
    /// Forward and loss, no update.
    #[serde(default)]
    pub eval: Option<String>,
    /// The original model with the weights (not used by the trainer).
    #[serde(default)]
    pub inference: Option<String>,
}

/// A named tensor's dtype and shape.
#[derive(Debug, Clone, Deserialize)]
pub struct TensorSpec {
    /// The graph input or output name.
    pub name: String,
    /// Its numpy dtype name.
    pub dtype: String,
    /// Its dimensions: a number, or anything else (`null`, a symbol such as `"N"`, a
    /// negative number) for a dynamic one.
    #[serde(default)]
    pub shape: Option<Vec<serde_json::Value>>,
}

/// `loss`: the loss outputs of the training and eval models.
#[derive(Debug, Clone, Deserialize)]
pub struct Loss {
    /// The training model's loss output.
    pub training_output: String,
    /// The eval model's loss output.
    #[serde(default)]
    pub eval_output: Option<String>,
    /// The loss's numpy dtype.
    pub dtype: String,
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
    #[serde(default = "int64")]
    pub dtype: String,
    /// A bool output saying whether the step was applied (`T` advances only then), or
    /// `None` (`T` always advances).
    #[serde(default)]
    pub skip_output: Option<String>,
}

fn int64() -> String {
    "int64".into()
}

/// One in-place state: its input and its output are bound to one buffer.
#[derive(Debug, Clone, Deserialize)]
pub struct State {
    /// The graph input (and the checkpoint's tensor name).
    pub input: String,
    /// The graph output holding its new value.
    pub output: String,
    /// `param`, `optimizer`, `loss_scale`, `fp16_copy`, `rng`, ...
    pub kind: String,
    /// Its numpy dtype name.
    pub dtype: String,
    /// Its dimensions (static).
    pub shape: Vec<usize>,
    /// The parameter it belongs to (optimizer state, float16 copy), if any.
    #[serde(default)]
    pub param: Option<String>,
    /// Its name within the kind (`V`, `H`, `scale`, `good_steps`), if any.
    #[serde(default)]
    pub slot: Option<String>,
}

impl TensorSpec {
    /// The dimensions, `None` for a dynamic one; `None` overall when the rank is unknown.
    pub fn dims(&self) -> Option<Vec<Option<usize>>> {
        self.shape.as_ref().map(|s| s.iter().map(|d| d.as_i64().and_then(|v| usize::try_from(v).ok())).collect())
    }
}

/// The dtype named `name` in the manifest at `path` (`what`: where it appears).
pub(crate) fn dtype(path: &Path, what: &str, name: &str) -> Result<DType> {
    DType::from_numpy_name(name).ok_or_else(|| Error::Manifest {
        path: path.to_path_buf(),
        message: format!(
            "{what}: dtype {name:?} is not supported (expected one of float32, \
                          float64, float16, bfloat16, int64, int32, int16, int8, uint64, \
                          uint32, uint16, uint8, bool)"
        ),
    })
}

impl Manifest {
    /// Reads and checks `path` (`format`, `format_version`, every dtype known, every
    /// parameter a state, the step input int64).
    pub fn read(path: &Path) -> Result<Manifest> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(&text, path)
    }

    /// Parses and checks the manifest `text` (`path`: for the messages).
    pub fn parse(text: &str, path: &Path) -> Result<Manifest> {
        let bad = |message: String| Error::Manifest { path: path.to_path_buf(), message };
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        if value.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(bad(format!(
                "format: expected {FORMAT:?}, got {}",
                value.get("format").map_or("nothing".into(), |f| f.to_string())
            )));
        }
        let version = value.get("format_version").and_then(|v| v.as_u64());
        if version != Some(FORMAT_VERSION) {
            return Err(bad(format!(
                "format_version: this reader reads version {FORMAT_VERSION}, got {}",
                value.get("format_version").map_or("nothing".into(), |f| f.to_string())
            )));
        }
        let m: Manifest = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        for t in m.data_inputs.iter().chain(&m.extra_outputs) {
            dtype(path, &format!("tensor {:?}", t.name), &t.dtype)?;
        }
        for s in &m.states {
            dtype(path, &format!("state {:?}", s.input), &s.dtype)?;
        }
        dtype(path, "loss", &m.loss.dtype)?;
        dtype(path, "learning_rate", &m.learning_rate.dtype)?;
        if m.step.dtype != "int64" {
            return Err(bad(format!("step: expected dtype \"int64\", got {:?}", m.step.dtype)));
        }
        let missing: Vec<&String> = m.parameters.iter().filter(|p| !m.states.iter().any(|s| &s.input == *p)).collect();
        if !missing.is_empty() {
            return Err(bad(format!("parameters {missing:?} are not states")));
        }
        Ok(m)
    }

    /// The state whose input is `name`.
    pub fn state(&self, name: &str) -> Option<&State> {
        self.states.iter().find(|s| s.input == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"{
      "format": "trainops-artifacts", "format_version": 1, "producer": "trainops 0.1.0",
      "min_onnxruntime": "1.17.0", "custom_op_library": "libtrainops.so",
      "custom_ops": ["ai.onnx.preview.training::Adam"],
      "models": {"training": "training.onnx", "eval": "eval.onnx", "inference": "inference.onnx"},
      "checkpoint": "checkpoint.safetensors",
      "data_inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 1, 8, 8]}],
      "loss": {"training_output": "loss", "eval_output": "loss", "dtype": "float32"},
      "learning_rate": {"input": "trainops/lr", "dtype": "float32"},
      "step": {"input": "trainops/T", "dtype": "int64", "skip_output": null},
      "states": [
        {"input": "W", "output": "trainops/new/W", "kind": "param", "dtype": "float32", "shape": [4, 1]},
        {"input": "trainops/V/W", "output": "trainops/new/V/W", "kind": "optimizer", "dtype": "float32", "shape": [4, 1], "future": 1}
      ],
      "extra_outputs": [{"name": "trainops/finite", "dtype": "bool", "shape": []}],
      "parameters": ["W"]
    }"#;

    #[test]
    fn reads_the_contract_example() {
        let m = Manifest::parse(EXAMPLE, Path::new("manifest.json")).unwrap();
        assert_eq!(m.data_inputs[0].dims(), Some(vec![None, Some(1), Some(8), Some(8)]));
        assert_eq!(m.states[1].shape, vec![4, 1]);
        assert_eq!(m.step.skip_output, None);
        assert_eq!(m.state("W").unwrap().kind, "param");
        assert_eq!(m.extra_outputs[0].dims(), Some(vec![]));
    }

    #[test]
    fn rejects_what_it_cannot_read() {
        let p = Path::new("m.json");
        let e = Manifest::parse(&EXAMPLE.replace("\"format_version\": 1", "\"format_version\": 2"), p);
        assert!(e.unwrap_err().to_string().contains("reads version 1, got 2"));
        let e = Manifest::parse(&EXAMPLE.replace("trainops-artifacts", "other"), p);
        assert!(e.unwrap_err().to_string().contains("format: expected \"trainops-artifacts\""));
        let e = Manifest::parse(&EXAMPLE.replace("\"bool\"", "\"complex64\""), p);
        assert!(e.unwrap_err().to_string().contains("tensor \"trainops/finite\": dtype \"complex64\""));
        let e = Manifest::parse(&EXAMPLE.replace("\"parameters\": [\"W\"]", "\"parameters\": [\"Q\"]"), p);
        assert!(e.unwrap_err().to_string().contains("parameters [\"Q\"] are not states"));
        let e = Manifest::parse("{", p);
        assert!(e.unwrap_err().to_string().starts_with("manifest m.json: not JSON"));
    }
}

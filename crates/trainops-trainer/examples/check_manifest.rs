//! Validates manifests against `manifest.schema.json` as the trainer does, without ONNX
//! Runtime: one JSON text per line of stdin, one line of stdout each, the JSON array of
//! the schema's problems (empty: valid). `tests/test_reader_contract.py` compares these
//! with the Python package's, manifest by manifest.
//!
//! ```text
//! cargo run -p trainops-trainer --example check_manifest < manifests.jsonl
//! ```

use std::io::{BufRead, Write};
use std::process::ExitCode;

use trainops_trainer::schema::Validator;

fn main() -> ExitCode {
    let validator = Validator::manifest();
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for (i, line) in std::io::stdin().lock().lines().enumerate() {
        let value = line.map_err(|e| e.to_string()).and_then(|l| serde_json::from_str(&l).map_err(|e| e.to_string()));
        let value: serde_json::Value = match value {
            Ok(v) => v,
            Err(e) => {
                eprintln!("check_manifest: line {}: {e}", i + 1);
                return ExitCode::from(2);
            }
        };
        let text = serde_json::to_string(&validator.problems(&value)).expect("strings serialize");
        if writeln!(out, "{text}").is_err() {
            return ExitCode::from(2);
        }
    }
    if out.flush().is_err() {
        return ExitCode::from(2);
    }
    ExitCode::SUCCESS
}

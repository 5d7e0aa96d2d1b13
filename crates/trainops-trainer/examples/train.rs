//! Trains from training artifacts and prints each step's loss.
//!
//! ```text
//! cargo run --release -p trainops-trainer --example train -- \
//!     ARTIFACTS_DIR BATCHES.safetensors STEPS [--checkpoint CKPT] [--save CKPT] \
//!     [--offset K] [--threads N] [--library libtrainops.so]
//! ```
//!
//! Step `i` (0-based) feeds batch `(K + i) % n` of the batches file (its tensors
//! `<input>/<batch>`). Each loss is printed on its own line as C's `%.9g` (`%.17g` for a
//! float64 loss), which round-trips the value: Python's `"%.9g" % loss` prints the same
//! line exactly when the two losses are bit-identical. `--checkpoint` starts from another
//! checkpoint than the artifacts' own; `--save` writes one after the last step.
//! ONNX Runtime comes from `$ORT_DYLIB_PATH`, libtrainops.so from `$TRAINOPS_LIBRARY` (or
//! `--library`).

use std::path::PathBuf;
use std::process::ExitCode;

use trainops_trainer::{format_g, read_batches, Trainer, TrainerOptions};

const USAGE: &str = "usage: train ARTIFACTS_DIR BATCHES.safetensors STEPS [--checkpoint CKPT] \
                     [--save CKPT] [--offset K] [--threads N] [--library PATH]";

struct Args {
    dir: PathBuf,
    batches: PathBuf,
    steps: usize,
    offset: usize,
    save: Option<PathBuf>,
    options: TrainerOptions,
}

fn parse() -> Result<Args, String> {
    let mut positional = Vec::new();
    let mut options = TrainerOptions::default();
    let (mut save, mut offset) = (None, 0);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value\n{USAGE}"));
        match a.as_str() {
            "--checkpoint" => options.checkpoint = Some(value("--checkpoint")?.into()),
            "--save" => save = Some(PathBuf::from(value("--save")?)),
            "--library" => options.library = Some(value("--library")?.into()),
            "--offset" => offset = value("--offset")?.parse().map_err(|e| format!("--offset: {e}"))?,
            "--threads" => options.threads = Some(value("--threads")?.parse().map_err(|e| format!("--threads: {e}"))?),
            "-h" | "--help" => return Err(USAGE.into()),
            _ if a.starts_with("--") => return Err(format!("unknown option {a}\n{USAGE}")),
            _ => positional.push(a),
        }
    }
    let [dir, batches, steps] = <[String; 3]>::try_from(positional).map_err(|_| USAGE.to_string())?;
    let steps = steps.parse().map_err(|e| format!("STEPS {steps:?}: {e}"))?;
    Ok(Args { dir: dir.into(), batches: batches.into(), steps, offset, save, options })
}

fn run(args: Args) -> trainops_trainer::Result<()> {
    let batches = read_batches(&args.batches)?;
    let mut trainer = Trainer::from_artifacts_with(&args.dir, args.options)?;
    let digits = if trainer.manifest().loss.dtype == "float64" { 17 } else { 9 };
    for i in 0..args.steps {
        let loss = trainer.step(&batches[(args.offset + i) % batches.len()])?;
        println!("{}", format_g(loss, digits));
    }
    if let Some(path) = &args.save {
        trainer.save(path)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train: {e}");
            ExitCode::FAILURE
        }
    }
}

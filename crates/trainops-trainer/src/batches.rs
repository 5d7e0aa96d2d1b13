//! Batches files: one safetensors file holding `n` batches, the tensor of data input
//! `<input>` of batch `i` named `<input>/<i>` (`x/0`, `t/0`, `x/1`, ...).

use std::collections::BTreeMap;
use std::path::Path;

use crate::checkpoint;
use crate::error::{Error, Result};
use crate::trainer::Batch;

/// The batches in the safetensors file at `path`, in order: every tensor named
/// `<input>/<i>` (the input name may itself contain `/`: the index is after the last one),
/// `i` from 0 to `n - 1` with every input present in every batch. [`Error::Checkpoint`]
/// listing every problem otherwise.
pub fn read_batches(path: impl AsRef<Path>) -> Result<Vec<Batch>> {
    let path = path.as_ref();
    let file = checkpoint::read(path)?;
    let mut by_index: BTreeMap<usize, Batch> = BTreeMap::new();
    let mut problems = Vec::new();
    for (name, t) in file.tensors {
        match name.rsplit_once('/').and_then(|(input, i)| Some((input, i.parse::<usize>().ok()?))) {
            Some((input, i)) => {
                by_index.entry(i).or_default().insert(input.to_string(), t);
            }
            None => problems.push(format!("tensor {name:?} is not named <input>/<batch index>")),
        }
    }
    let n = by_index.len();
    if n == 0 && problems.is_empty() {
        problems.push("no batches".into());
    }
    if let Some((&last, _)) = by_index.last_key_value() {
        if last + 1 != n {
            let have: Vec<usize> = by_index.keys().copied().collect();
            problems.push(format!("batch indices must be 0..{n}, got {have:?}"));
        }
    }
    let inputs: Vec<String> = by_index
        .values()
        .flat_map(|b| b.keys().cloned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    for (i, b) in &by_index {
        for input in &inputs {
            if !b.contains_key(input) {
                problems.push(format!("batch {i} has no {input:?} (tensor \"{input}/{i}\")"));
            }
        }
    }
    if !problems.is_empty() {
        return Err(Error::Checkpoint { path: path.to_path_buf(), problems });
    }
    Ok(by_index.into_values().collect())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::tensor::HostTensor;

    #[test]
    fn reads_indexed_batches_and_names_gaps() {
        let dir = std::env::temp_dir().join(format!("trainops-batches-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("b.safetensors");
        let x = |v: f32| HostTensor::from_vec(vec![1], vec![v]).unwrap();
        let tensors = [("in/x/0", x(0.0)), ("in/x/1", x(1.0)), ("t/0", x(2.0)), ("t/1", x(3.0))];
        checkpoint::write(&path, tensors.iter().map(|(k, v)| (*k, v)), &HashMap::new()).unwrap();
        let b = read_batches(&path).unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(b[1]["in/x"], x(1.0));
        assert_eq!(b[0]["t"], x(2.0));

        let tensors = [("x/0", x(0.0)), ("x/2", x(1.0)), ("t/0", x(2.0)), ("bad", x(3.0))];
        checkpoint::write(&path, tensors.iter().map(|(k, v)| (*k, v)), &HashMap::new()).unwrap();
        let e = read_batches(&path).unwrap_err().to_string();
        assert!(e.contains("\"bad\" is not named"), "{e}");
        assert!(e.contains("batch indices must be 0..2, got [0, 2]"), "{e}");
        assert!(e.contains("batch 2 has no \"t\""), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}

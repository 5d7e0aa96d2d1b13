//! safetensors files: checkpoints (tensors keyed by state input name, with the metadata of
//! the artifacts contract) and batches, read whole; written atomically.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{SafeTensors, TensorView};

use crate::error::{Error, Result};
use crate::tensor::{DType, HostTensor};

/// The checkpoint metadata's `format`.
pub const FORMAT: &str = "trainops-checkpoint";
/// The checkpoint metadata's `format_version`.
pub const FORMAT_VERSION: &str = "1";
/// Every metadata key a checkpoint must have.
pub const METADATA_KEYS: [&str; 9] =
    ["format", "format_version", "step", "learning_rate", "loss_scale", "seed", "skipped", "config", "model_sha256"];

/// The tensors and the metadata of a safetensors file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Safetensors {
    /// The tensors by name.
    pub tensors: BTreeMap<String, HostTensor>,
    /// The metadata (`__metadata__`), empty when the file has none.
    pub metadata: HashMap<String, String>,
}

fn invalid(path: &Path, problem: String) -> Error {
    Error::Checkpoint { path: path.to_path_buf(), problems: vec![problem] }
}

/// Reads the safetensors file at `path`. [`Error::Checkpoint`] when it is not one, or
/// holds tensors of a dtype this crate does not handle (all of them listed).
pub fn read(path: &Path) -> Result<Safetensors> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let (_, header) =
        SafeTensors::read_metadata(&bytes).map_err(|e| invalid(path, format!("not a safetensors file ({e})")))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| invalid(path, format!("not a safetensors file ({e})")))?;
    let mut out = Safetensors {
        metadata: header.metadata().clone().unwrap_or_default().into_iter().collect(),
        ..Default::default()
    };
    let mut problems = Vec::new();
    for (name, view) in file.iter() {
        match DType::from_safetensors(view.dtype()) {
            Some(d) => {
                let t = HostTensor::new(d, view.shape().to_vec(), view.data().to_vec())?;
                out.tensors.insert(name.to_string(), t);
            }
            None => problems.push(format!("tensor {name:?}: dtype {:?} is not supported", view.dtype())),
        }
    }
    if !problems.is_empty() {
        return Err(Error::Checkpoint { path: path.to_path_buf(), problems });
    }
    Ok(out)
}

/// The problems of a checkpoint's metadata (empty: none): every key of [`METADATA_KEYS`]
/// present, `format`/`format_version` this format's, `step` an integer >= 1, `skipped` an
/// integer >= 0, `learning_rate` a finite float >= 0, `loss_scale` a float or `""`.
pub fn check_metadata(m: &HashMap<String, String>) -> Vec<String> {
    let mut problems: Vec<String> =
        METADATA_KEYS.iter().filter(|k| !m.contains_key(**k)).map(|k| format!("metadata {k:?} is missing")).collect();
    if !problems.is_empty() {
        return problems;
    }
    if m["format"] != FORMAT {
        problems.push(format!("metadata \"format\": expected {FORMAT:?}, got {:?}", m["format"]));
    }
    if m["format_version"] != FORMAT_VERSION {
        problems.push(format!(
            "metadata \"format_version\": this reader reads version {FORMAT_VERSION:?}, got {:?}",
            m["format_version"]
        ));
    }
    match m["step"].parse::<u64>() {
        Ok(s) if s >= 1 => {}
        _ => problems.push(format!("metadata \"step\": expected an integer >= 1, got {:?}", m["step"])),
    }
    if m["skipped"].parse::<u64>().is_err() {
        problems.push(format!("metadata \"skipped\": expected an integer >= 0, got {:?}", m["skipped"]));
    }
    match m["learning_rate"].parse::<f64>() {
        Ok(lr) if lr.is_finite() && lr >= 0.0 => {}
        _ => problems
            .push(format!("metadata \"learning_rate\": expected a finite float >= 0, got {:?}", m["learning_rate"])),
    }
    if !m["loss_scale"].is_empty() && m["loss_scale"].parse::<f64>().is_err() {
        problems.push(format!("metadata \"loss_scale\": expected a float or \"\", got {:?}", m["loss_scale"]));
    }
    problems
}

/// Writes `tensors` and `metadata` as a safetensors file at `path`, atomically: into a
/// temporary file in the same folder, fsync'ed, renamed over `path`, then the folder
/// fsync'ed. On failure `path` keeps its previous content and no temporary file remains.
pub fn write<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (&'a str, &'a HostTensor)>,
    metadata: &HashMap<String, String>,
) -> Result<()> {
    let views = tensors
        .into_iter()
        .map(|(name, t)| {
            let v = TensorView::new(t.dtype().to_safetensors(), t.shape().to_vec(), t.bytes())
                .expect("a HostTensor's bytes match its shape");
            (name, v)
        })
        .collect::<Vec<_>>();
    let bytes = safetensors::tensor::serialize(views, Some(metadata.clone()))
        .map_err(|e| invalid(path, format!("cannot serialize ({e})")))?;
    write_atomic(path, &bytes)
}

fn temp_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    path.with_file_name(format!(".{name}.{}.{nanos:08x}.tmp", std::process::id()))
}

/// `bytes` to `path` through a temporary file, fsync and rename.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(path);
    let result = (|| {
        let mut f = File::options().write(true).create_new(true).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(path, e));
    }
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    // Makes the rename durable; a platform without directory handles skips it.
    if let Ok(dir) = File::open(folder) {
        let _ = dir.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("trainops-trainer-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn metadata() -> HashMap<String, String> {
        [
            ("format", FORMAT),
            ("format_version", "1"),
            ("step", "3"),
            ("learning_rate", "0.001"),
            ("loss_scale", ""),
            ("seed", "7"),
            ("skipped", "0"),
            ("config", "{}"),
            ("model_sha256", "00"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    #[test]
    fn round_trip_every_dtype() {
        let dir = scratch("rt");
        let path = dir.join("c.safetensors");
        let mut tensors = BTreeMap::new();
        tensors.insert("w".to_string(), HostTensor::from_vec(vec![2, 1], vec![1.5f32, -2.0]).unwrap());
        tensors.insert("t".to_string(), HostTensor::from_vec(vec![], vec![7i64]).unwrap());
        tensors.insert("b".to_string(), HostTensor::from_vec(vec![2], vec![true, false]).unwrap());
        tensors.insert("h".to_string(), HostTensor::from_vec(vec![1], vec![half::bf16::from_f32(3.0)]).unwrap());
        tensors.insert("u".to_string(), HostTensor::from_vec(vec![0, 3], Vec::<u32>::new()).unwrap());
        write(&path, tensors.iter().map(|(k, v)| (k.as_str(), v)), &metadata()).unwrap();
        let back = read(&path).unwrap();
        assert_eq!(back.tensors, tensors);
        assert_eq!(back.metadata, metadata());
        assert!(check_metadata(&back.metadata).is_empty());
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(leftovers, vec![std::ffi::OsString::from("c.safetensors")]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_the_target_and_no_temporary_file() {
        let dir = scratch("fail");
        // The rename cannot replace a non-empty directory: the write fails at the end.
        let target = dir.join("sub");
        std::fs::create_dir_all(target.join("x")).unwrap();
        let e = write_atomic(&target, b"new").unwrap_err();
        assert!(e.to_string().contains("sub"), "{e}");
        assert!(target.join("x").is_dir());
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("sub")]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn bad_files_and_metadata_are_named() {
        let dir = scratch("bad");
        let path = dir.join("x.safetensors");
        std::fs::write(&path, b"not safetensors").unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("x.safetensors") && e.contains("not a safetensors file"), "{e}");
        let mut m = metadata();
        m.remove("seed");
        assert_eq!(check_metadata(&m), vec!["metadata \"seed\" is missing"]);
        let mut m = metadata();
        m.insert("step".into(), "0".into());
        m.insert("learning_rate".into(), "nan".into());
        let p = check_metadata(&m);
        assert_eq!(p.len(), 2, "{p:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}

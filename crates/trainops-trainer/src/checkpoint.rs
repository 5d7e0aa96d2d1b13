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

/// [`Error::Io`] naming `path` when it exists and is not a regular file once its
/// symlinks are resolved (reading a FIFO would wait for a writer forever).
pub(crate) fn refuse_special(path: &Path) -> Result<()> {
    match std::fs::metadata(path).ok().and_then(|m| not_regular(&m.file_type())) {
        Some((kind, _)) => Err(Error::io(path, std::io::Error::new(kind, "not a regular file"))),
        None => Ok(()),
    }
}

/// Reads the safetensors file at `path`. [`Error::Checkpoint`] when it is not one, or
/// holds tensors of a dtype this crate does not handle (all of them listed).
pub fn read(path: &Path) -> Result<Safetensors> {
    refuse_special(path)?;
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

/// The largest `step` and `skipped` (`T` is fed as an int64).
pub const INT64_MAX: u64 = i64::MAX as u64;
/// What a checkpoint's config may name as its optimizer (`trainops.optim.from_dict`).
pub const OPTIMIZER_TYPES: [&str; 4] = ["Adam", "AdamW", "Adagrad", "Momentum"];
/// What a checkpoint's config may name as its schedule (`trainops.schedules`).
pub const SCHEDULE_TYPES: [&str; 7] =
    ["Constant", "Cosine", "Exponential", "LinearWarmup", "OneCycle", "Step", "callable"];
/// The precision policies.
pub const POLICIES: [&str; 3] = ["float32", "float64", "mixed_float16"];
/// The BatchNormalization modes.
pub const BATCHNORM: [&str; 2] = ["train", "frozen"];

/// A metadata value as the messages show it (Python's `repr`), cut at 80 characters.
fn shown(text: &str) -> String {
    if text.chars().count() <= 77 {
        format!("{text:?}")
    } else {
        format!("{:?}...", text.chars().take(77).collect::<String>())
    }
}

/// The decimal integer grammar of the metadata: ASCII digits only (no sign, space,
/// underscore or digits of other scripts), as the Python reader.
fn digits(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit())
}

/// The decimal float grammar: an optional sign, digits with an optional fraction (or a
/// fraction alone), an optional exponent. Python's `float()` and Rust's `parse::<f64>`
/// give the same (correctly rounded) value for every such text.
fn decimal(text: &str) -> bool {
    let b = text.as_bytes();
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let int_start = i;
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    let int_digits = i - int_start;
    let mut frac_digits = 0;
    if i < b.len() && b[i] == b'.' {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        frac_digits = i - start;
    }
    if int_digits == 0 && frac_digits == 0 {
        return false;
    }
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        i += 1;
        if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
            i += 1;
        }
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == start {
            return false;
        }
    }
    i == b.len()
}

fn finite_at_least(v: &serde_json::Value, low: f64, strict: bool) -> bool {
    // JSON numbers: serde_json refuses NaN, Infinity and out-of-range exponents itself
    v.as_f64().is_some_and(|x| x.is_finite() && if strict { x > low } else { x >= low })
}

/// The problems of a checkpoint's `config` (empty: none), each naming its key: `loss` a
/// non-empty string or an object; `optimizer` an object of a known `type` with a finite
/// `lr` >= 0; `params` an array of strings; `policy` a known policy; when present,
/// `batchnorm` train/frozen, `clip_grad_norm` null or a finite number > 0, `accumulate`
/// an integer >= 1, `schedule` null or an object of a known `type`. The Python reader's
/// `check_config` checks the same.
pub fn check_config(config: &serde_json::Value) -> Vec<String> {
    use serde_json::Value;
    let Some(c) = config.as_object() else {
        let kind = match config {
            Value::Array(_) => "list",
            Value::String(_) => "str",
            Value::Number(n) if n.is_f64() => "float",
            Value::Number(_) => "int",
            Value::Bool(_) => "bool",
            _ => "NoneType",
        };
        return vec![format!("metadata \"config\": expected a JSON object, got {kind}")];
    };
    let mut problems: Vec<String> = ["loss", "optimizer", "params", "policy"]
        .iter()
        .filter(|k| !c.contains_key(**k))
        .map(|k| format!("config {k:?} is missing"))
        .collect();
    let bad = |problems: &mut Vec<String>, key: &str, expected: &str| {
        problems.push(format!("config {key:?}: expected {expected}, got {}", crate::schema::show(&c[key])));
    };
    let in_list = |v: Option<&Value>, list: &[&str]| v.and_then(Value::as_str).is_some_and(|s| list.contains(&s));
    let got = |v: Option<&Value>| v.map_or("null".into(), crate::schema::show);
    if let Some(loss) = c.get("loss") {
        if !(loss.is_object() || loss.as_str().is_some_and(|s| !s.is_empty())) {
            let what = "a non-empty string (an output name) or an object (a trainops.losses loss)";
            bad(&mut problems, "loss", what);
        }
    }
    if let Some(opt) = c.get("optimizer") {
        match opt.as_object() {
            None => bad(&mut problems, "optimizer", "an object"),
            Some(o) => {
                if !in_list(o.get("type"), &OPTIMIZER_TYPES) {
                    problems.push(format!(
                        "config \"optimizer\" \"type\": expected one of {OPTIMIZER_TYPES:?}, got {}",
                        got(o.get("type"))
                    ));
                }
                if !o.get("lr").is_some_and(|lr| finite_at_least(lr, 0.0, false)) {
                    problems.push(format!(
                        "config \"optimizer\" \"lr\": expected a finite number >= 0, got {}",
                        got(o.get("lr"))
                    ));
                }
            }
        }
    }
    if let Some(p) = c.get("params") {
        if !p.as_array().is_some_and(|a| a.iter().all(Value::is_string)) {
            bad(&mut problems, "params", "an array of strings");
        }
    }
    if c.contains_key("policy") && !in_list(c.get("policy"), &POLICIES) {
        bad(&mut problems, "policy", &format!("one of {POLICIES:?}"));
    }
    if c.contains_key("batchnorm") && !in_list(c.get("batchnorm"), &BATCHNORM) {
        bad(&mut problems, "batchnorm", &format!("one of {BATCHNORM:?}"));
    }
    if c.get("clip_grad_norm").is_some_and(|v| !v.is_null() && !finite_at_least(v, 0.0, true)) {
        bad(&mut problems, "clip_grad_norm", "null or a finite number > 0");
    }
    // an integer literal (not 2.0, not true) >= 1
    if c.get("accumulate").is_some_and(|v| v.as_u64().is_none_or(|a| a < 1)) {
        bad(&mut problems, "accumulate", "an integer >= 1");
    }
    if c.get("schedule").is_some_and(|v| !(v.is_null() || v.is_object() && in_list(v.get("type"), &SCHEDULE_TYPES))) {
        bad(&mut problems, "schedule", &format!("null or an object whose \"type\" is one of {SCHEDULE_TYPES:?}"));
    }
    problems
}

/// The problems of a checkpoint's metadata (empty: none), the Python reader's
/// `check_metadata`: every key of [`METADATA_KEYS`] present, `format`/`format_version`
/// this format's, `step` a decimal integer in [1, 2^63-1], `skipped` one in [0, 2^63-1],
/// `seed` one in [0, 2^64-1], `learning_rate` a decimal float, finite and >= 0,
/// `loss_scale` a decimal float, `inf`, `-inf`, `nan` or `""`, `config` a JSON object
/// ([`check_config`]), `model_sha256` 64 lowercase hex digits.
pub fn check_metadata(m: &HashMap<String, String>) -> Vec<String> {
    let mut problems: Vec<String> =
        METADATA_KEYS.iter().filter(|k| !m.contains_key(**k)).map(|k| format!("metadata {k:?} is missing")).collect();
    if !problems.is_empty() {
        return problems;
    }
    if m["format"] != FORMAT {
        problems.push(format!("metadata \"format\": expected {FORMAT:?}, got {}", shown(&m["format"])));
    }
    if m["format_version"] != FORMAT_VERSION {
        problems.push(format!(
            "metadata \"format_version\": this reader reads version {FORMAT_VERSION:?}, got {}",
            shown(&m["format_version"])
        ));
    }
    let mut integer = |key: &str, low: u64, high: u64| {
        let text = &m[key];
        if !digits(text) {
            problems.push(format!(
                "metadata {key:?}: expected a decimal integer in [{low}, {high}] (ASCII digits only), got {}",
                shown(text)
            ));
        } else if !text.parse::<u64>().is_ok_and(|v| (low..=high).contains(&v)) {
            let cut = if text.len() <= 40 { text.clone() } else { format!("{}...", &text[..37]) };
            problems.push(format!("metadata {key:?}: {cut} is out of range [{low}, {high}]"));
        }
    };
    integer("step", 1, INT64_MAX);
    integer("skipped", 0, INT64_MAX);
    integer("seed", 0, u64::MAX);
    let lr = &m["learning_rate"];
    if !(decimal(lr) && lr.parse::<f64>().is_ok_and(|x| x.is_finite() && x >= 0.0)) {
        problems
            .push(format!("metadata \"learning_rate\": expected a decimal float, finite and >= 0, got {}", shown(lr)));
    }
    let scale = &m["loss_scale"];
    if !scale.is_empty() && !decimal(scale) && !["inf", "-inf", "nan"].contains(&scale.as_str()) {
        problems.push(format!(
            "metadata \"loss_scale\": expected a decimal float (or inf, -inf, nan) or \"\", got {}",
            shown(scale)
        ));
    }
    match serde_json::from_str::<serde_json::Value>(&m["config"]) {
        Ok(config) => problems.extend(check_config(&config)),
        Err(e) => problems.push(format!("metadata \"config\": expected a JSON object ({e})")),
    }
    let h = &m["model_sha256"];
    if !(h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))) {
        problems.push(format!("metadata \"model_sha256\": expected 64 lowercase hex digits, got {}", shown(h)));
    }
    problems
}

/// The checkpoint tensor holding the source model's serialized bytes.
pub const MODEL_KEY: &str = "trainops/model";

/// The lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    format!("{:x}", sha2::Sha256::digest(bytes))
}

/// The problems of the source model tensor [`MODEL_KEY`] (its metadata already checked):
/// present, uint8 of one dimension, hashing to `model_sha256`, an ONNX ModelProto in the
/// protobuf wire format with a graph (every field's tag and length, and the graph's own
/// fields; the Python reader parses it with onnx).
pub fn check_model(tensors: &BTreeMap<String, HostTensor>, metadata: &HashMap<String, String>) -> Vec<String> {
    let Some(model) = tensors.get(MODEL_KEY) else {
        return vec![format!(
            "tensor {MODEL_KEY:?} (the source model) is missing: load it into a Trainer of its model with \
             trainer.load_state(path) in Python"
        )];
    };
    if model.dtype() != DType::U8 || model.shape().len() != 1 {
        return vec![format!(
            "tensor {MODEL_KEY:?}: expected uint8 of one dimension, got {} {:?}",
            model.dtype(),
            model.shape()
        )];
    }
    if sha256_hex(model.bytes()) != metadata["model_sha256"] {
        return vec![format!(
            "tensor {MODEL_KEY:?}: its sha256 is not model_sha256 {} (the file is corrupt)",
            metadata["model_sha256"]
        )];
    }
    match protobuf_fields(model.bytes()) {
        Err(e) => vec![format!("tensor {MODEL_KEY:?}: not a serialized ONNX model ({e})")],
        Ok(fields) => {
            let graphs: Vec<&[u8]> = fields.iter().filter(|f| f.0 == 7 && f.1 == 2).map(|f| f.2).collect();
            if graphs.is_empty() {
                return vec![format!("tensor {MODEL_KEY:?}: not a serialized ONNX model (it has no graph)")];
            }
            match graphs.iter().try_for_each(|g| protobuf_fields(g).map(drop)) {
                Err(e) => vec![format!("tensor {MODEL_KEY:?}: not a serialized ONNX model (its graph: {e})")],
                Ok(()) => Vec::new(),
            }
        }
    }
}

fn varint(b: &[u8], i: &mut usize) -> std::result::Result<u64, String> {
    let mut v = 0u64;
    for k in 0..10 {
        let byte = *b.get(*i).ok_or("truncated varint")?;
        *i += 1;
        v |= u64::from(byte & 0x7f) << (7 * k);
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("varint longer than 10 bytes".into())
}

/// One protobuf field: its number, its wire type, its bytes (a length-delimited field's
/// payload; the encoded value otherwise).
type Field<'a> = (u64, u64, &'a [u8]);

/// The fields `(number, wire type, payload of a length-delimited field)` of one protobuf
/// message, checking the wire format: tags, varints, fixed widths, lengths, groups.
fn protobuf_fields(b: &[u8]) -> std::result::Result<Vec<Field<'_>>, String> {
    fn skip<'a>(
        b: &'a [u8],
        i: &mut usize,
        end_group: Option<u64>,
        out: &mut Vec<Field<'a>>,
    ) -> std::result::Result<(), String> {
        while *i < b.len() {
            let tag = varint(b, i)?;
            let (field, wire) = (tag >> 3, tag & 7);
            if field == 0 || field > (1 << 29) - 1 {
                return Err(format!("field number {field} at byte {i}"));
            }
            let start = *i;
            match wire {
                0 => drop(varint(b, i)?),
                1 | 5 => {
                    let n = if wire == 1 { 8 } else { 4 };
                    if b.len() - *i < n {
                        return Err(format!("field {field}: truncated fixed{}", n * 8));
                    }
                    *i += n;
                }
                2 => {
                    let n = varint(b, i)?;
                    if n > (b.len() - *i) as u64 {
                        return Err(format!("field {field}: length {n} beyond the end (truncated)"));
                    }
                    *i += n as usize;
                    out.push((field, wire, &b[*i - n as usize..*i]));
                    continue;
                }
                3 => skip(b, i, Some(field), &mut Vec::new())?,
                4 if end_group == Some(field) => return Ok(()),
                _ => return Err(format!("field {field}: wire type {wire}")),
            }
            out.push((field, wire, &b[start..*i]));
        }
        match end_group {
            Some(f) => Err(format!("group {f} is not closed (truncated)")),
            None => Ok(()),
        }
    }
    let mut out = Vec::new();
    skip(b, &mut 0, None, &mut out)?;
    Ok(out)
}

/// Writes `tensors` and `metadata` as a safetensors file at `path`, atomically: the
/// target is `path` with its symlinks resolved, a special file (a directory, a FIFO, a
/// device) is refused ([`Error::Io`]), the bytes go into a temporary file
/// `.<name>.<hex>.tmp` beside it (locked while written; interrupted saves' leftovers are
/// removed first), fsync'ed and renamed over the target. On failure the target keeps its
/// previous content, no temporary file remains, and [`Error::Io`] names `path` with the
/// system's error (a full disk, a file-size limit).
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

/// The file a save to `path` writes (its symlinks resolved) and whether it exists;
/// [`Error::Io`] naming `path` when it exists and is not a regular file (a directory, a
/// FIFO, a device, a socket: renaming over it would replace it).
fn resolve_target(path: &Path) -> Result<(PathBuf, Option<std::fs::Permissions>)> {
    // Resolve the folder, then the file itself if it is a symlink (possibly dangling).
    let mut target = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&target) {
            Ok(m) if m.file_type().is_symlink() => {
                let link = std::fs::read_link(&target).map_err(|e| Error::io(path, e))?;
                target = match target.parent() {
                    Some(p) => p.join(link),
                    None => link,
                };
            }
            Ok(m) => {
                let Some((kind, what)) = not_regular(&m.file_type()) else {
                    return Ok((target, Some(m.permissions())));
                };
                let via =
                    if target != path { format!(" (through the symlink {})", path.display()) } else { String::new() };
                let message = format!(
                    "{}{via} is {what}, not a regular file: a save would replace it; save to a regular file",
                    target.display()
                );
                return Err(Error::io(path, std::io::Error::new(kind, message)));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((target, None)),
            Err(e) => return Err(Error::io(path, e)),
        }
    }
    Err(Error::io(path, std::io::Error::new(std::io::ErrorKind::InvalidInput, "too many levels of symbolic links")))
}

/// The error kind and the words of a file of type `ft` that is not a regular file
/// (`IsADirectory` for a directory, `InvalidInput` for the others), `None` for a regular
/// file: the one check of saves ([`resolve_target`]) and reads ([`refuse_special`]).
fn not_regular(ft: &std::fs::FileType) -> Option<(std::io::ErrorKind, &'static str)> {
    if ft.is_file() {
        None
    } else if ft.is_dir() {
        Some((std::io::ErrorKind::IsADirectory, "a directory"))
    } else {
        Some((std::io::ErrorKind::InvalidInput, special_kind(ft)))
    }
}

/// What a file that is neither regular nor a directory is, in words.
#[cfg(unix)]
fn special_kind(ft: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

#[cfg(not(unix))]
fn special_kind(_: &std::fs::FileType) -> &'static str {
    "not a regular file"
}

/// Whether the file `f` still has a name (false: removed since it was opened).
#[cfg(unix)]
fn has_a_name(f: &File) -> std::io::Result<bool> {
    Ok(std::os::unix::fs::MetadataExt::nlink(&f.metadata()?) > 0)
}

#[cfg(not(unix))]
fn has_a_name(_: &File) -> std::io::Result<bool> {
    Ok(true)
}

/// `.<name>.<12 hex digits>.tmp`: the temporary name of a save of `name` (the Python
/// writer's, `trainops/train/atomic.py`).
fn temp_name(name: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u32(std::process::id());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    format!(".{name}.{:012x}.tmp", h.finish() & 0xffff_ffff_ffff)
}

/// Whether `file` (in a folder) is a temporary file of a save of `name`: the Python
/// writer's `.<name>.<hex>.tmp` or this crate's earlier `.<name>.<pid>.<hex>.tmp`.
fn is_temp_of(file: &str, name: &str) -> bool {
    let Some(tail) = file.strip_prefix(&format!(".{name}.")).and_then(|t| t.strip_suffix(".tmp")) else {
        return false;
    };
    let hex = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    match tail.split_once('.') {
        None => hex(tail),
        Some((a, b)) => hex(a) && hex(b),
    }
}

/// Removes the temporary files earlier saves of `folder/name` left behind (interrupted:
/// nobody holds their lock); one still being written is locked and stays.
fn remove_leftovers(folder: &Path, name: &str) {
    let Ok(entries) = std::fs::read_dir(folder) else { return };
    for e in entries.flatten() {
        let file = e.file_name();
        if !file.to_str().is_some_and(|f| is_temp_of(f, name)) || !e.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        if let Ok(f) = File::open(e.path()) {
            if f.try_lock().is_ok() {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// `bytes` to `path`, atomically: the target is `path` with its symlinks resolved (a
/// special file is refused: [`Error::Io`]), written into a temporary file in its folder
/// (`.<name>.<hex>.tmp`, created new and held under an exclusive lock while written),
/// fsync'ed, given the replaced file's permissions, renamed over the target, then the
/// folder fsync'ed. Temporary files of interrupted saves (nobody holds their lock) are
/// removed first. On failure the target keeps its previous content, no temporary file
/// remains, and the error names `path` with the operating system's error (a full disk,
/// a file-size limit).
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let (target, permissions) = resolve_target(path)?;
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let folder = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    remove_leftovers(&folder, &name);
    let (tmp, mut f) = loop {
        let tmp = folder.join(temp_name(&name));
        let f = File::options().write(true).create_new(true).open(&tmp).map_err(|e| Error::io(path, e))?;
        f.lock().map_err(|e| Error::io(path, e))?;
        // Another save's clean-up may have removed it between its creation and the lock.
        if has_a_name(&f).map_err(|e| Error::io(path, e))? {
            break (tmp, f);
        }
    };
    let result = (|| {
        f.write_all(bytes)?;
        f.sync_all()?;
        if let Some(p) = permissions {
            f.set_permissions(p)?;
        }
        std::fs::rename(&tmp, &target)
    })();
    drop(f);
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(path, e));
    }
    // Makes the rename durable; a platform without directory handles skips it.
    if let Ok(dir) = File::open(&folder) {
        let _ = dir.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("trainops-trainer-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut n: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        n.sort();
        n
    }

    const CONFIG: &str =
        r#"{"loss": "loss", "optimizer": {"type": "Adam", "lr": 0.001}, "params": ["w"], "policy": "float32"}"#;

    fn metadata() -> HashMap<String, String> {
        [
            ("format", FORMAT),
            ("format_version", "1"),
            ("step", "3"),
            ("learning_rate", "0.001"),
            ("loss_scale", ""),
            ("seed", "7"),
            ("skipped", "0"),
            ("config", CONFIG),
            ("model_sha256", &"0".repeat(64)),
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
        assert_eq!(check_metadata(&back.metadata), Vec::<String>::new());
        assert_eq!(names(&dir), vec!["c.safetensors"]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_the_target_and_no_temporary_file() {
        let dir = scratch("fail");
        // A file in a folder that does not exist: the temporary file cannot be created.
        let e = write_atomic(&dir.join("nope").join("c"), b"new").unwrap_err();
        assert!(matches!(&e, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound), "{e}");
        assert!(e.to_string().contains("nope/c"), "{e}");
        assert!(names(&dir).is_empty());
        // A full disk or a file-size limit: tests/test_persistence.py runs the example
        // under RLIMIT_FSIZE.
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn special_files_are_refused_and_symlinks_written_through() {
        use std::os::unix::fs::{symlink, FileTypeExt, PermissionsExt};
        let dir = scratch("special");
        std::fs::create_dir(dir.join("sub")).unwrap();
        let e = write_atomic(&dir.join("sub"), b"x").unwrap_err();
        let Error::Io { path, source } = &e else { panic!("{e}") };
        assert_eq!((path.as_path(), source.kind()), (dir.join("sub").as_path(), std::io::ErrorKind::IsADirectory));
        assert!(e.to_string().contains("is a directory, not a regular file"), "{e}");
        assert!(dir.join("sub").is_dir());
        // A FIFO (made by the mkfifo command, where there is one): refused without opening it.
        if std::process::Command::new("mkfifo").arg(dir.join("fifo")).status().is_ok_and(|s| s.success()) {
            symlink("fifo", dir.join("to-fifo")).unwrap();
            for name in ["fifo", "to-fifo"] {
                let e = write_atomic(&dir.join(name), b"x").unwrap_err();
                let Error::Io { source, .. } = &e else { panic!("{e}") };
                assert_eq!(source.kind(), std::io::ErrorKind::InvalidInput, "{e}");
                assert!(e.to_string().contains("is a FIFO, not a regular file"), "{e}");
            }
            assert!(std::fs::metadata(dir.join("fifo")).unwrap().file_type().is_fifo());
            assert!(std::fs::symlink_metadata(dir.join("to-fifo")).unwrap().file_type().is_symlink());
        }
        // Through a symlink: the file it points to is replaced, the link stays, the
        // replaced file's permissions are kept; a dangling link creates its target.
        std::fs::write(dir.join("real"), b"old").unwrap();
        std::fs::set_permissions(dir.join("real"), std::fs::Permissions::from_mode(0o640)).unwrap();
        symlink("real", dir.join("link")).unwrap();
        write_atomic(&dir.join("link"), b"new").unwrap();
        assert!(std::fs::symlink_metadata(dir.join("link")).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(dir.join("real")).unwrap(), b"new");
        assert_eq!(std::fs::metadata(dir.join("real")).unwrap().permissions().mode() & 0o777, 0o640);
        symlink("later", dir.join("dangling")).unwrap();
        write_atomic(&dir.join("dangling"), b"made").unwrap();
        assert_eq!(std::fs::read(dir.join("later")).unwrap(), b"made");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn leftover_temporary_files_are_removed_unless_held() {
        let dir = scratch("leftovers");
        for f in [".c.0123456789ab.tmp", ".c.123.0badcafe.tmp", ".c.held000000ff.tmp", ".c.xyz.tmp", ".d.0123.tmp"] {
            std::fs::write(dir.join(f), b"partial").unwrap();
        }
        std::fs::write(dir.join(".c.00000000beef.tmp"), b"being written").unwrap();
        let held = File::open(dir.join(".c.00000000beef.tmp")).unwrap();
        held.lock().unwrap(); // another save, still writing
        write_atomic(&dir.join("c"), b"new").unwrap();
        assert_eq!(names(&dir), vec![".c.00000000beef.tmp", ".c.held000000ff.tmp", ".c.xyz.tmp", ".d.0123.tmp", "c"]);
        drop(held);
        write_atomic(&dir.join("c"), b"newer").unwrap();
        assert_eq!(names(&dir), vec![".c.held000000ff.tmp", ".c.xyz.tmp", ".d.0123.tmp", "c"]);
        assert!(is_temp_of(&temp_name("c"), "c"));
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
        assert_eq!(
            check_metadata(&m),
            vec![
                "metadata \"step\": 0 is out of range [1, 9223372036854775807]",
                "metadata \"learning_rate\": expected a decimal float, finite and >= 0, got \"nan\""
            ]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn integers_are_ascii_digits_in_range() {
        for (step, ok) in [
            ("3", true),
            ("007", true),
            ("9223372036854775807", true),
            ("9223372036854775808", false),
            ("18446744073709551615", false),
            ("99999999999999999999999", false),
            ("0", false),
            ("3_0", false),
            (" 3", false),
            ("3 ", false),
            ("+3", false),
            ("-3", false),
            ("\u{663}", false), // ARABIC-INDIC DIGIT THREE
            ("", false),
        ] {
            let mut m = metadata();
            m.insert("step".into(), step.into());
            assert_eq!(check_metadata(&m).is_empty(), ok, "{step:?}: {:?}", check_metadata(&m));
        }
        let mut m = metadata();
        m.insert("seed".into(), u64::MAX.to_string());
        m.insert("skipped".into(), i64::MAX.to_string());
        assert!(check_metadata(&m).is_empty());
        m.insert("seed".into(), "-5x".into());
        assert_eq!(
            check_metadata(&m),
            vec!["metadata \"seed\": expected a decimal integer in [0, 18446744073709551615] (ASCII digits only), got \"-5x\""]
        );
    }

    #[test]
    fn floats_are_decimal() {
        for (text, ok) in
            [("0.001", true), ("1e-3", true), ("1E+03", true), (".5", true), ("5.", true), ("+0.5", true), ("0", true)]
        {
            assert_eq!(decimal(text), ok, "{text}");
        }
        for text in ["", ".", "e3", "1e", "1e+", "inf", "nan", "1_0", " 1", "1 ", "0x10", "1.2.3", "--1"] {
            assert!(!decimal(text), "{text}");
        }
        let mut m = metadata();
        for scale in ["inf", "-inf", "nan", "32768.0", ""] {
            m.insert("loss_scale".into(), scale.into());
            assert!(check_metadata(&m).is_empty(), "{scale}");
        }
        m.insert("loss_scale".into(), "Infinity".into());
        assert_eq!(check_metadata(&m).len(), 1);
        m.insert("loss_scale".into(), String::new());
        m.insert("learning_rate".into(), "-0.5".into());
        assert_eq!(check_metadata(&m).len(), 1);
    }

    #[test]
    fn configs_that_cannot_build_a_trainer_are_named() {
        let check = |text: &str| check_config(&serde_json::from_str(text).unwrap());
        assert!(check(CONFIG).is_empty());
        let with = |extra: &str| {
            check(&CONFIG.replace("\"policy\": \"float32\"}", &format!("\"policy\": \"float32\", {extra}}}")))
        };
        assert_eq!(with("\"accumulate\": 0"), vec!["config \"accumulate\": expected an integer >= 1, got 0"]);
        assert_eq!(with("\"accumulate\": 2.0"), vec!["config \"accumulate\": expected an integer >= 1, got 2.0"]);
        assert!(with("\"accumulate\": 4").is_empty());
        assert_eq!(
            with("\"clip_grad_norm\": 0"),
            vec!["config \"clip_grad_norm\": expected null or a finite number > 0, got 0"]
        );
        assert!(with("\"clip_grad_norm\": null, \"schedule\": {\"type\": \"Cosine\"}").is_empty());
        assert_eq!(with("\"schedule\": {\"type\": \"Sine\"}").len(), 1);
        assert_eq!(
            check(&CONFIG.replace("float32", "bf16")),
            vec!["config \"policy\": expected one of [\"float32\", \"float64\", \"mixed_float16\"], got \"bf16\""]
        );
        assert_eq!(
            check(&CONFIG.replace("0.001", "-1")),
            vec!["config \"optimizer\" \"lr\": expected a finite number >= 0, got -1"]
        );
        assert_eq!(check("[1]"), vec!["metadata \"config\": expected a JSON object, got list"]);
        assert_eq!(check("{}").len(), 4);
        let mut m = metadata();
        m.insert("config".into(), "{{{".into());
        assert!(check_metadata(&m)[0].starts_with("metadata \"config\": expected a JSON object (key must be a string"));
    }

    #[test]
    fn the_model_is_checked() {
        // A ModelProto: ir_version 8 (field 1), graph (field 7) { name (field 2) "g" }
        let model: Vec<u8> = vec![0x08, 0x08, 0x3a, 0x03, 0x12, 0x01, b'g'];
        let tensors = |b: &[u8]| {
            let mut t = BTreeMap::new();
            t.insert(MODEL_KEY.to_string(), HostTensor::from_vec(vec![b.len()], b.to_vec()).unwrap());
            t
        };
        let meta = |b: &[u8]| {
            let mut m = metadata();
            m.insert("model_sha256".into(), sha256_hex(b));
            m
        };
        assert_eq!(check_model(&tensors(&model), &meta(&model)), Vec::<String>::new());
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        let cut = &model[..5]; // the graph's length runs past the end
        assert_eq!(
            check_model(&tensors(cut), &meta(cut)),
            vec![
                "tensor \"trainops/model\": not a serialized ONNX model (field 7: length 3 beyond the end (truncated))"
            ]
        );
        let no_graph = &model[..2];
        assert_eq!(
            check_model(&tensors(no_graph), &meta(no_graph)),
            vec!["tensor \"trainops/model\": not a serialized ONNX model (it has no graph)"]
        );
        let bad_graph: Vec<u8> = vec![0x3a, 0x02, 0x12, 0x05];
        assert_eq!(check_model(&tensors(&bad_graph), &meta(&bad_graph)).len(), 1);
        assert_eq!(
            check_model(&tensors(&model), &metadata()),
            vec![format!(
                "tensor \"trainops/model\": its sha256 is not model_sha256 {} (the file is corrupt)",
                "0".repeat(64)
            )]
        );
        assert_eq!(check_model(&BTreeMap::new(), &metadata()).len(), 1);
        // groups (wire types 3/4) and fixed widths are skipped as protobuf parsers do
        assert!(protobuf_fields(&[0x1b, 0x08, 0x01, 0x1c, 0x0d, 1, 2, 3, 4, 0x09, 1, 2, 3, 4, 5, 6, 7, 8]).is_ok());
        assert!(protobuf_fields(&[0x1b, 0x08, 0x01]).is_err());
        assert!(protobuf_fields(&[0x0d, 1, 2]).is_err());
        assert!(protobuf_fields(&[0x0e]).is_err());
    }
}

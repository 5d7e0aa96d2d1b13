//! [`Trainer`]: the training loop of the artifacts contract over one ONNX Runtime session.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use ort::memory::Allocator;
use ort::session::{IoBinding, Session};
use ort::value::{DynTensor, Tensor};

use crate::checkpoint;
use crate::error::{Error, Result};
use crate::format::python_repr;
use crate::manifest::{self, Manifest, TensorSpec};
use crate::runtime;
use crate::tensor::{with_element, DType, HostTensor};

pub use crate::checkpoint::MODEL_KEY;

/// One batch: a tensor per data input, by input name.
pub type Batch = BTreeMap<String, HostTensor>;

/// How [`Trainer::from_artifacts_with`] finds its libraries and state.
#[derive(Debug, Clone, Default)]
pub struct TrainerOptions {
    /// The trainops custom-op library; `None`: `$TRAINOPS_LIBRARY`, else the manifest's
    /// `custom_op_library` in the artifacts folder.
    pub library: Option<PathBuf>,
    /// ONNX Runtime's shared library; `None`: `$ORT_DYLIB_PATH`, else `libonnxruntime.so`
    /// on the loader's path (see [`runtime::environment`]).
    pub onnxruntime: Option<PathBuf>,
    /// Intra-op threads; `None`: ONNX Runtime's choice (as the Python Trainer's default).
    pub threads: Option<usize>,
    /// The checkpoint to start from; `None`: the artifacts' own (`manifest.checkpoint`).
    pub checkpoint: Option<PathBuf>,
}

/// A buffer bound to the session: a state (its input and output), or an output.
struct Buffer {
    name: String,
    dtype: DType,
    value: DynTensor,
}

/// Trains from training artifacts: every state lives in one ONNX Runtime buffer, bound as
/// both the state's input and its output, so each [`step`](Trainer::step) is one run that
/// updates the weights and the optimizer state in place.
///
/// ```no_run
/// use trainops_trainer::{Batch, HostTensor, Trainer};
///
/// # fn main() -> trainops_trainer::Result<()> {
/// let mut trainer = Trainer::from_artifacts("artifacts")?;
/// let mut batch = Batch::new();
/// batch.insert("x".into(), HostTensor::from_vec(vec![8, 1, 8, 8], vec![0.5f32; 512])?);
/// batch.insert("t".into(), HostTensor::from_vec(vec![8], vec![3i64; 8])?);
/// let loss = trainer.step(&batch)?; // the loss before this update
/// println!("step {}: {loss}", trainer.step_count());
/// trainer.save("artifacts/checkpoint.safetensors")?;
/// # Ok(())
/// # }
/// ```
pub struct Trainer {
    dir: PathBuf,
    manifest: Manifest,
    options: TrainerOptions,
    library: Option<PathBuf>,
    session: Session,
    binding: IoBinding,
    states: Vec<Buffer>,
    loss: Buffer,
    skip: Option<usize>,
    outputs: Vec<Buffer>,
    data: Vec<(TensorSpec, DType)>,
    lr_dtype: DType,
    learning_rate: f64,
    t: u64,
    skipped: u64,
    metadata: HashMap<String, String>,
    passthrough: BTreeMap<String, HostTensor>,
    eval: Option<(Session, Buffer)>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("dir", &self.dir)
            .field("states", &self.states.len())
            .field("learning_rate", &self.learning_rate)
            .field("step", &self.t)
            .field("skipped", &self.skipped)
            .finish_non_exhaustive()
    }
}

fn check_lr(lr: f64, what: &str) -> Result<f64> {
    if lr.is_finite() && lr >= 0.0 {
        Ok(lr)
    } else {
        Err(Error::Invalid(format!("{what}: the learning rate must be a finite float >= 0, got {lr}")))
    }
}

/// A tensor of `dtype` and `shape` allocated by ONNX Runtime (can be bound as an output).
fn allocate(dtype: DType, shape: &[i64]) -> Result<DynTensor> {
    Ok(DynTensor::new(&Allocator::default(), dtype.to_ort(), shape.to_vec())?)
}

/// The output `name` of `session` as a bound buffer: its static shape, `dtype`.
fn output_buffer(session: &Session, model: &Path, name: &str, dtype: DType) -> Result<Buffer> {
    let outlet = session
        .outputs()
        .iter()
        .find(|o| o.name() == name)
        .ok_or_else(|| Error::Invalid(format!("{}: the model has no output {name:?}", model.display())))?;
    let shape = outlet.dtype().tensor_shape().map(|s| s.to_vec()).unwrap_or_default();
    if outlet.dtype().tensor_shape().is_none() || shape.iter().any(|&d| d < 0) {
        return Err(Error::Invalid(format!(
            "{}: output {name:?} must have a static shape, has {shape:?}",
            model.display()
        )));
    }
    if let Some(t) = outlet.dtype().tensor_type() {
        if DType::from_ort(t) != Some(dtype) {
            return Err(Error::Invalid(format!(
                "{}: output {name:?} is {t:?}, the manifest says {dtype}",
                model.display()
            )));
        }
    }
    Ok(Buffer { name: name.to_string(), dtype, value: allocate(dtype, &shape)? })
}

/// The first element of `b` as f64 (float and integer dtypes; bool as 0/1).
fn first(b: &Buffer) -> Result<f64> {
    with_element!(b.dtype, T => {
        let (_, v) = b.value.try_extract_tensor::<T>()?;
        let x = v.first().copied().ok_or_else(|| Error::Invalid(format!("output {:?} is empty", b.name)))?;
        Ok(ToF64::to_f64(x))
    })
}

trait ToF64 {
    fn to_f64(self) -> f64;
}
macro_rules! to_f64 {
    ($($t:ty),*) => { $(impl ToF64 for $t { fn to_f64(self) -> f64 { self as f64 } })* };
}
to_f64!(f32, f64, i64, i32, i16, i8, u64, u32, u16, u8);
impl ToF64 for half::f16 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}
impl ToF64 for half::bf16 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}
impl ToF64 for bool {
    fn to_f64(self) -> f64 {
        f64::from(u8::from(self))
    }
}

/// Checks `batch` against the data inputs `data` and binds each to `binding`.
fn bind_batch(what: &'static str, binding: &mut IoBinding, data: &[(TensorSpec, DType)], batch: &Batch) -> Result<()> {
    let names = || data.iter().map(|(s, _)| s.name.clone()).collect::<Vec<_>>();
    if let Some(extra) = batch.keys().find(|k| !data.iter().any(|(s, _)| &s.name == *k)) {
        return Err(Error::UnknownInput { what, name: extra.clone(), expected: names() });
    }
    let mut values = Vec::with_capacity(data.len());
    for (spec, dtype) in data {
        let t = batch.get(&spec.name).ok_or_else(|| Error::MissingInput {
            what,
            name: spec.name.clone(),
            expected: names(),
        })?;
        if t.dtype() != *dtype {
            return Err(Error::DType {
                what: format!("{what}: input {:?}", spec.name),
                expected: *dtype,
                got: t.dtype(),
            });
        }
        if let Some(dims) = spec.dims() {
            let fits =
                dims.len() == t.shape().len() && dims.iter().zip(t.shape()).all(|(d, &g)| d.is_none_or(|d| d == g));
            if !fits {
                return Err(Error::Shape {
                    what: format!("{what}: input {:?}", spec.name),
                    expected: dims,
                    got: t.shape().to_vec(),
                });
            }
        }
        values.push((spec.name.as_str(), t.to_ort_input()?));
    }
    for (name, value) in values {
        binding.bind_input(name, &value)?;
    }
    Ok(())
}

/// A `[1]` tensor of `dtype` holding `x` (rounded to nearest, as numpy's `astype`).
fn scalar_input(dtype: DType, x: f64) -> Result<DynTensor> {
    let shape = vec![1i64];
    Ok(match dtype {
        DType::F32 => Tensor::from_array((shape, vec![x as f32]))?.upcast(),
        DType::F64 => Tensor::from_array((shape, vec![x]))?.upcast(),
        DType::F16 => Tensor::from_array((shape, vec![half::f16::from_f64(x)]))?.upcast(),
        DType::BF16 => Tensor::from_array((shape, vec![half::bf16::from_f64(x)]))?.upcast(),
        other => {
            return Err(Error::Invalid(format!(
                "the learning rate's dtype must be a float type, the manifest says {other}"
            )))
        }
    })
}

impl Trainer {
    /// Loads the training artifacts in `dir` (`manifest.json`, the training model, the
    /// checkpoint) with the default [`TrainerOptions`].
    pub fn from_artifacts(dir: impl AsRef<Path>) -> Result<Trainer> {
        Self::from_artifacts_with(dir, TrainerOptions::default())
    }

    /// Loads the training artifacts in `dir` with `options`: reads and checks the manifest
    /// and the checkpoint (every state present with the manifest's dtype and shape, no
    /// unknown tensor, the metadata well formed: one [`Error::Checkpoint`] listing every
    /// problem), creates the session with the custom-op library registered and binds every
    /// state's input and output to one buffer holding the checkpoint's value.
    pub fn from_artifacts_with(dir: impl AsRef<Path>, options: TrainerOptions) -> Result<Trainer> {
        let dir = dir.as_ref().to_path_buf();
        let mpath = dir.join("manifest.json");
        let manifest = Manifest::read(&mpath)?;
        let ckpath = options.checkpoint.clone().unwrap_or_else(|| dir.join(&manifest.checkpoint));
        let ck = checkpoint::read(&ckpath)?;
        let (states, passthrough) = check_checkpoint(&manifest, &mpath, &ckpath, ck.tensors, &ck.metadata)?;
        let metadata = ck.metadata;

        let env = runtime::environment(options.onnxruntime.as_deref())?;
        let fallback = manifest.custom_op_library.as_ref().map(|f| dir.join(f));
        let library = runtime::find_library(options.library.as_deref(), fallback.as_deref());
        if library.is_none() && !manifest.custom_ops.is_empty() {
            return Err(Error::Library {
                what: "the trainops custom-op library",
                path: fallback.unwrap_or_default(),
                message: format!(
                    "not found, and the model uses {:?}: pass it in TrainerOptions::library or set {}",
                    manifest.custom_ops,
                    runtime::TRAINOPS_LIBRARY
                ),
            });
        }
        let builder = match &library {
            Some(lib) => runtime::session_builder(env, lib, options.threads)?,
            None => runtime::plain_builder(env, options.threads)?,
        };
        let model = dir.join(&manifest.models.training);
        checkpoint::refuse_special(&model)?; // ONNX Runtime would wait on a FIFO
        let session = builder
            .clone()
            .commit_from_file(&model)
            .map_err(|e| Error::Invalid(format!("{}: ONNX Runtime cannot create its session: {e}", model.display())))?;
        let inputs: Vec<&str> = session.inputs().iter().map(|i| i.name()).collect();
        let outputs: Vec<&str> = session.outputs().iter().map(|o| o.name()).collect();
        let problems = manifest.model_problems(&inputs, &outputs);
        if !problems.is_empty() {
            return Err(Error::Manifest { path: mpath, problems });
        }
        let mut binding = session.create_binding()?;
        let mut buffers = Vec::with_capacity(states.len());
        for (spec, t) in manifest.states.iter().zip(states) {
            let mut value = t.to_ort()?;
            binding.bind_input(spec.input.as_str(), &value)?;
            binding.bind_output(spec.output.as_str(), &mut value)?;
            buffers.push(Buffer { name: spec.input.clone(), dtype: t.dtype(), value });
        }
        let loss_dtype = manifest::dtype(&mpath, "loss", &manifest.loss.dtype)?;
        let mut loss = output_buffer(&session, &model, &manifest.loss.training_output, loss_dtype)?;
        binding.bind_output(loss.name.as_str(), &mut loss.value)?;
        // The manifest's checks made the skip output one of the extra outputs, of dtype bool.
        let mut outputs = Vec::with_capacity(manifest.extra_outputs.len());
        for e in &manifest.extra_outputs {
            let dtype = manifest::dtype(&mpath, &format!("extra output {:?}", e.name), &e.dtype)?;
            let mut b = output_buffer(&session, &model, &e.name, dtype)?;
            binding.bind_output(b.name.as_str(), &mut b.value)?;
            outputs.push(b);
        }
        let skip = manifest
            .step
            .skip_output
            .as_ref()
            .map(|s| outputs.iter().position(|b| &b.name == s).expect("the manifest's checks: an extra output"));
        let mut data = Vec::with_capacity(manifest.data_inputs.len());
        for d in &manifest.data_inputs {
            data.push((d.clone(), manifest::dtype(&mpath, &format!("tensor {:?}", d.name), &d.dtype)?));
        }
        let lr_dtype = manifest::dtype(&mpath, "learning_rate", &manifest.learning_rate.dtype)?;
        let learning_rate = metadata["learning_rate"].parse().expect("checked");
        let t = metadata["step"].parse().expect("checked: 1 ..= 2^63-1");
        let skipped = metadata["skipped"].parse().expect("checked");
        Ok(Trainer {
            dir,
            manifest,
            options,
            library,
            session,
            binding,
            states: buffers,
            loss,
            skip,
            outputs,
            data,
            lr_dtype,
            learning_rate,
            t,
            skipped,
            metadata,
            passthrough,
            eval: None,
        })
    }

    /// One training step on `batch` (every data input of the manifest, with its dtype and
    /// shape): forward, loss, backward and the update, in one run, the states updated in
    /// place. Returns the loss before the update (as `f64`: exact for a float32 or float16
    /// loss). `T` advances unless the step was skipped (the manifest's
    /// `step.skip_output` false: non-finite gradients under mixed precision; then
    /// [`skipped`](Trainer::skipped) counts it).
    ///
    /// Errors: [`Error::MissingInput`], [`Error::UnknownInput`], [`Error::DType`],
    /// [`Error::Shape`] for a batch that does not fit (nothing has run), [`Error::Ort`] when
    /// a node fails (`T` stays).
    pub fn step(&mut self, batch: &Batch) -> Result<f64> {
        let t = i64::try_from(self.t)
            .ok()
            .filter(|&t| t < i64::MAX)
            .ok_or_else(|| Error::Invalid(format!("Trainer::step: T = {} cannot advance past int64", self.t)))?;
        bind_batch("Trainer::step", &mut self.binding, &self.data, batch)?;
        let lr = scalar_input(self.lr_dtype, self.learning_rate)?;
        self.binding.bind_input(self.manifest.learning_rate.input.as_str(), &lr)?;
        let t = Tensor::from_array((vec![1i64], vec![t]))?;
        self.binding.bind_input(self.manifest.step.input.as_str(), &t)?;
        drop(self.session.run_binding(&self.binding)?);
        let loss = first(&self.loss)?;
        let applied = match self.skip {
            Some(k) => first(&self.outputs[k])? != 0.0,
            None => true,
        };
        if applied {
            self.t += 1;
        } else {
            self.skipped += 1;
        }
        Ok(loss)
    }

    /// The loss of the eval model (`models.eval`: forward and loss, no update) on `batch`
    /// with the current parameters. Its session is created on the first call; the state
    /// buffers are bound as its inputs (no copy).
    pub fn eval(&mut self, batch: &Batch) -> Result<f64> {
        if self.eval.is_none() {
            self.eval = Some(self.eval_session()?);
        }
        let (session, loss) = self.eval.as_mut().expect("created above");
        let mut binding = session.create_binding()?;
        let names: Vec<String> = session.inputs().iter().map(|i| i.name().to_string()).collect();
        let data: Vec<(TensorSpec, DType)> =
            self.data.iter().filter(|(s, _)| names.contains(&s.name)).cloned().collect();
        bind_batch("Trainer::eval", &mut binding, &data, batch)?;
        for name in &names {
            if data.iter().any(|(s, _)| &s.name == name) {
                continue;
            }
            let state = self.states.iter().find(|b| &b.name == name).ok_or_else(|| {
                Error::Invalid(format!("eval model: input {name:?} is neither a data input nor a state"))
            })?;
            binding.bind_input(name.as_str(), &state.value)?;
        }
        binding.bind_output(loss.name.as_str(), &mut loss.value)?;
        drop(session.run_binding(&binding)?);
        first(loss)
    }

    fn eval_session(&self) -> Result<(Session, Buffer)> {
        let mpath = self.dir.join("manifest.json");
        let file = self.manifest.models.eval.as_ref().ok_or_else(|| Error::Manifest {
            path: mpath.clone(),
            problems: vec!["models.eval: the artifacts have no eval model".into()],
        })?;
        let model = self.dir.join(file);
        checkpoint::refuse_special(&model)?;
        let env = runtime::environment(self.options.onnxruntime.as_deref())?;
        let builder = match &self.library {
            Some(lib) => runtime::session_builder(env, lib, self.options.threads)?,
            None => runtime::plain_builder(env, self.options.threads)?,
        };
        let session = builder
            .clone()
            .commit_from_file(&model)
            .map_err(|e| Error::Invalid(format!("{}: ONNX Runtime cannot create its session: {e}", model.display())))?;
        let out = self.manifest.loss.eval_output.clone().unwrap_or_else(|| self.manifest.loss.training_output.clone());
        let dtype = manifest::dtype(&mpath, "loss", &self.manifest.loss.dtype)?;
        let loss = output_buffer(&session, &model, &out, dtype)?;
        Ok((session, loss))
    }

    /// The trained parameters (copies), in the manifest's order, by name.
    pub fn parameters(&self) -> Result<Vec<(String, HostTensor)>> {
        self.manifest.parameters.iter().map(|p| Ok((p.clone(), self.state(p)?))).collect()
    }

    /// A copy of the state whose training-model input is `name` (a parameter, an optimizer
    /// moment `trainops/V/W`, the loss scale, ...).
    pub fn state(&self, name: &str) -> Result<HostTensor> {
        let b =
            self.states.iter().find(|b| b.name == name).ok_or_else(|| {
                Error::Invalid(format!("Trainer::state: {name:?} is not a state of the training model"))
            })?;
        HostTensor::from_ort(&b.value, b.dtype)
    }

    /// Writes a checkpoint of the current state to `path`: every state by its input name,
    /// the tensors the loaded checkpoint had besides (the source model), and the metadata
    /// of the contract (`step`, `learning_rate`, `loss_scale`, `skipped` current; `seed`,
    /// `config`, `model_sha256` as loaded). Atomic: temporary file, fsync, rename.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let states = self
            .states
            .iter()
            .map(|b| Ok((b.name.as_str(), HostTensor::from_ort(&b.value, b.dtype)?)))
            .collect::<Result<Vec<_>>>()?;
        let mut metadata = self.metadata.clone();
        metadata.insert("step".into(), self.t.to_string());
        metadata.insert("learning_rate".into(), python_repr(self.learning_rate));
        metadata.insert("skipped".into(), self.skipped.to_string());
        metadata.insert("loss_scale".into(), self.loss_scale()?.map(python_repr).unwrap_or_default());
        // The source model is written from where it is kept, not copied per save.
        let tensors = states.iter().map(|(k, v)| (*k, v)).chain(self.passthrough.iter().map(|(k, v)| (k.as_str(), v)));
        checkpoint::write(path.as_ref(), tensors, &metadata)
    }

    /// The dynamic loss scale (mixed precision: the `loss_scale` state of slot `scale`),
    /// or `None`.
    pub fn loss_scale(&self) -> Result<Option<f64>> {
        let spec = self.manifest.states.iter().find(|s| {
            s.kind == "loss_scale" && (s.slot.as_deref() == Some("scale") || s.input == "trainops/loss_scale")
        });
        match spec.and_then(|s| self.states.iter().find(|b| b.name == s.input)) {
            Some(b) => Ok(Some(first(b)?)),
            None => Ok(None),
        }
    }

    /// Sets the learning rate of the next steps (fed as the manifest's
    /// `learning_rate.dtype`). [`Error::Invalid`] unless finite and >= 0.
    pub fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        self.learning_rate = check_lr(lr, "Trainer::set_learning_rate")?;
        Ok(())
    }

    /// The learning rate of the next steps.
    pub fn learning_rate(&self) -> f64 {
        self.learning_rate
    }

    /// The updates applied so far (`T - 1`; skipped steps do not count).
    pub fn step_count(&self) -> u64 {
        self.t - 1
    }

    /// `T` of the next step (the checkpoint's `step`).
    pub fn next_step(&self) -> u64 {
        self.t
    }

    /// Steps skipped for non-finite gradients (mixed precision).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// The artifacts' manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The checkpoint metadata as loaded (`seed`, `config`, `model_sha256`, ...).
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// The custom-op library registered, if any.
    pub fn library(&self) -> Option<&Path> {
        self.library.as_deref()
    }
}

/// The checkpoint's state tensors in the manifest's order, and the other tensors kept
/// (the source model); every problem in one [`Error::Checkpoint`]: the Python reader's
/// checks (`docs/artifacts.md`, the reader contract): the metadata and the config, the
/// source model (present, hashing to `model_sha256`, an ONNX model), the manifest's
/// options, every state present with the manifest's dtype and shape, no other tensor, the
/// `loss_scale` metadata equal to the loss scale state.
fn check_checkpoint(
    m: &Manifest,
    mpath: &Path,
    ckpath: &Path,
    mut tensors: BTreeMap<String, HostTensor>,
    metadata: &HashMap<String, String>,
) -> Result<(Vec<HostTensor>, BTreeMap<String, HostTensor>)> {
    let mut problems = checkpoint::check_metadata(metadata);
    if problems.is_empty() {
        problems = checkpoint::check_model(&tensors, metadata);
    }
    if !problems.is_empty() {
        return Err(Error::Checkpoint { path: ckpath.to_path_buf(), problems });
    }
    let config: serde_json::Value = serde_json::from_str(&metadata["config"]).expect("checked");
    let mut problems = m.options_problems(&config, &metadata["seed"]);
    if !problems.is_empty() {
        return Err(Error::Checkpoint { path: ckpath.to_path_buf(), problems });
    }
    // The loss scale metadata against its tensor, before the states are taken out of
    // `tensors`; reported after their problems.
    let have = &metadata["loss_scale"];
    let scale_problem = match (m.state(LOSS_SCALE), tensors.get(LOSS_SCALE)) {
        (None, _) if !have.is_empty() => Some(format!("loss_scale {have}: this trainer has none")),
        (Some(spec), Some(t)) if t.shape() == spec.shape.as_slice() && t.dtype().numpy_name() == spec.dtype => {
            let want = match t.dtype() {
                DType::F32 => t.to_vec::<f32>()?.first().map(|&x| python_repr(f64::from(x))),
                DType::F64 => t.to_vec::<f64>()?.first().map(|&x| python_repr(x)),
                _ => None,
            };
            want.filter(|w| w != have)
                .map(|want| format!("loss_scale {have:?} disagrees with the tensor {LOSS_SCALE:?} ({want})"))
        }
        _ => None,
    };
    let mut states = Vec::with_capacity(m.states.len());
    for s in &m.states {
        let want = manifest::dtype(mpath, &format!("state {:?}", s.input), &s.dtype)?;
        match tensors.remove(&s.input) {
            None => problems.push(format!("state {:?} ({want} {:?}) is missing", s.input, s.shape)),
            Some(t) if t.dtype() != want || t.shape() != s.shape.as_slice() => problems.push(format!(
                "state {:?}: expected {want} {:?}, got {} {:?}",
                s.input,
                s.shape,
                t.dtype(),
                t.shape()
            )),
            Some(t) => states.push(t),
        }
    }
    let unknown: Vec<&String> = tensors.keys().filter(|k| k.as_str() != MODEL_KEY).collect();
    if !unknown.is_empty() {
        problems.push(format!("tensors {unknown:?} are not states of the training model"));
    }
    problems.extend(scale_problem);
    if problems.is_empty() {
        Ok((states, tensors))
    } else {
        Err(Error::Checkpoint { path: ckpath.to_path_buf(), problems })
    }
}

/// The loss scale state's input name (mixed precision).
const LOSS_SCALE: &str = "trainops/loss_scale";

//! Distributions from Philox's stream (`com.trainops`, since version 1), with Philox's state
//! and shape handling ([`super::state`]):
//!
//! - `PhiloxUniform(state, shape?) -> (output, state_out?)`, attributes `shape`, `dtype`,
//!   `low`, `high`;
//! - `PhiloxNormal(state, shape?) -> (output, state_out?)`, attributes `shape`, `dtype`,
//!   `mean`, `scale`;
//! - `PhiloxDropout(data, ratio?, training_mode?, state) -> (output, mask?, state_out?)`:
//!   ONNX `Dropout` with its keep decisions from Philox.
//!
//! `dtype` is a TensorProto type: FLOAT (1, the default), DOUBLE (11), FLOAT16 (10) or
//! BFLOAT16 (16). `state_out` is the state advanced past exactly the words consumed; it may
//! be bound to the `state` buffer (the state is copied out before anything is written).

use half::{bf16, f16};
use trainops_kernels::random::draw::Output;
use trainops_kernels::random::{dropout, normal, uniform};
use trainops_kernels::InOut;

use super::state::{self, OutputShape, Outputs};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature, Tensor};
use crate::ops::io;

static DIST_INPUTS: [Formal; 2] = [Formal::One(Some(DType::Uint32)), Formal::Optional(Some(DType::Int64))];

/// The output types the distributions produce, by TensorProto number.
fn dtype_attr(info: &KernelInfo<'_>, op: &'static str) -> Result<DType> {
    match info.i64_opt("dtype")?.unwrap_or(1) {
        1 => Ok(DType::Float),
        11 => Ok(DType::Double),
        10 => Ok(DType::Float16),
        16 => Ok(DType::BFloat16),
        other => Err(Error::Attribute {
            op,
            name: "dtype",
            what: format!("expected 1 (float), 11 (double), 10 (float16) or 16 (bfloat16), got {other}"),
        }),
    }
}

/// Which distribution a node draws.
#[derive(Clone, Copy)]
enum Dist {
    /// `u * (high - low) + low`.
    Uniform { low: f32, high: f32 },
    /// `z * scale + mean`.
    Normal { mean: f32, scale: f32 },
}

/// Which op: the attributes it reads.
#[derive(Clone, Copy)]
enum Kind {
    Uniform,
    Normal,
}

/// `PhiloxUniform` or `PhiloxNormal` for one output type.
///
/// Each op is registered once per output type, under the same name: ONNX Runtime then makes
/// one schema whose output may be any of the four types and picks the kernel by the node's
/// output type, which the inference callback sets from the `dtype` attribute. (An output of
/// undeclared type is no way out: ONNX Runtime 1.17 types it like an input, and 1.31 accepts
/// it only with an inference callback.)
pub struct DistOp {
    signature: &'static Signature,
    kind: Kind,
    dtype: DType,
}

macro_rules! dist_ops {
    ($($op:ident, $sig:ident, $name:literal, $kind:ident, $dtype:ident;)*) => {$(
        static $sig: Signature = Signature {
            name: $name,
            inputs: &DIST_INPUTS,
            outputs: &[Formal::One(Some(DType::$dtype)), Formal::Optional(Some(DType::Uint32))],
        };
        #[doc = concat!("`com.trainops::", stringify!($kind), "` with ", stringify!($dtype), " output.")]
        pub static $op: DistOp = DistOp { signature: &$sig, kind: Kind::$kind, dtype: DType::$dtype };
    )*};
}

dist_ops! {
    UNIFORM_F32, UNIFORM_F32_SIG, c"PhiloxUniform", Uniform, Float;
    UNIFORM_F64, UNIFORM_F64_SIG, c"PhiloxUniform", Uniform, Double;
    UNIFORM_F16, UNIFORM_F16_SIG, c"PhiloxUniform", Uniform, Float16;
    UNIFORM_BF16, UNIFORM_BF16_SIG, c"PhiloxUniform", Uniform, BFloat16;
    NORMAL_F32, NORMAL_F32_SIG, c"PhiloxNormal", Normal, Float;
    NORMAL_F64, NORMAL_F64_SIG, c"PhiloxNormal", Normal, Double;
    NORMAL_F16, NORMAL_F16_SIG, c"PhiloxNormal", Normal, Float16;
    NORMAL_BF16, NORMAL_BF16_SIG, c"PhiloxNormal", Normal, BFloat16;
}

/// The last registration of each op: an output of any type, so that a node whose `dtype` is
/// none of the four (with its output declared of that type) still finds a kernel, whose
/// creation fails naming the attribute, instead of ONNX Runtime's "Type (tensor(int32)) of
/// output arg ... does not match expected type". Registered after the four, so a node of a
/// valid type always gets its own kernel first.
pub struct BadDtype {
    signature: &'static Signature,
}

static UNIFORM_ANY_SIG: Signature = Signature {
    name: c"PhiloxUniform",
    inputs: &DIST_INPUTS,
    outputs: &[Formal::One(None), Formal::Optional(Some(DType::Uint32))],
};
static NORMAL_ANY_SIG: Signature = Signature {
    name: c"PhiloxNormal",
    inputs: &DIST_INPUTS,
    outputs: &[Formal::One(None), Formal::Optional(Some(DType::Uint32))],
};
/// `PhiloxUniform` of an output type it does not produce.
pub static UNIFORM_ANY: BadDtype = BadDtype { signature: &UNIFORM_ANY_SIG };
/// `PhiloxNormal` of an output type it does not produce.
pub static NORMAL_ANY: BadDtype = BadDtype { signature: &NORMAL_ANY_SIG };

impl OpSpec for BadDtype {
    fn signature(&self) -> &Signature {
        self.signature
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let op = self.op();
        let dtype = dtype_attr(info, op)?;
        let what = format!("{} does not match the type of the node's output", dtype.name());
        Err(Error::Attribute { op, name: "dtype", what })
    }

    fn device_op(&'static self, info: &KernelInfo<'_>) -> Result<Option<crate::ffi::device::DeviceOp>> {
        // The CUDA registrations of PhiloxUniform and PhiloxNormal cover this one too: the
        // same error.
        self.create(info).map(|_| None)
    }

    fn infers_output_types(&self) -> bool {
        true
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        infer_dist(self.op(), ctx)
    }
}

/// Every registration of the two ops, for the catalogue: the four output types of each, then
/// its [`BadDtype`].
pub static DIST_OPS: [&dyn OpSpec; 10] = [
    &UNIFORM_F32,
    &UNIFORM_F64,
    &UNIFORM_F16,
    &UNIFORM_BF16,
    &UNIFORM_ANY,
    &NORMAL_F32,
    &NORMAL_F64,
    &NORMAL_F16,
    &NORMAL_BF16,
    &NORMAL_ANY,
];

/// The longest `shape` input whose length shape inference turns into the output's rank.
const MAX_INFERRED_RANK: i64 = 1024;

/// Output 0's type from the `dtype` attribute and its dimensions from the `shape` attribute
/// (or, as unknowns, from the length of the `shape` input); `state_out` like `state`.
fn infer_dist(op: &'static str, ctx: &mut ShapeInfer<'_>) -> Result<()> {
    let dtype = match ctx.attr_i64(c"dtype").unwrap_or(1) {
        1 => DType::Float,
        11 => DType::Double,
        10 => DType::Float16,
        16 => DType::BFloat16,
        // Any other value: the output's element type is set to "undefined", which ONNX Runtime
        // takes as "not inferred" and so keeps the type the model declares (float, int32, ...):
        // the node then reaches the kernel of that type, or [`BadDtype`] for a type no kernel
        // produces, and kernel creation names the attribute. (Leaving the type unset instead
        // lets the runtime type the output like the first registration, float, and fail with
        // "Type (tensor(int32)) of output arg ... does not match expected type".)
        _ => DType::Other(0),
    };
    let dims: Option<Vec<Option<i64>>> = match ctx.attr_i64s(c"shape") {
        Some(d) => Some(d.into_iter().map(Some).collect()),
        None => match ctx.input(1) {
            // The output's rank is the input's declared length, whatever the model says: a
            // vector of that many unknowns once aborted the process (a failed allocation)
            // for a length of 2^40. Longer than MAX_INFERRED_RANK, or of unknown length, the
            // rank is unknown.
            Some((_, shape)) if shape.len() == 1 && (0..=MAX_INFERRED_RANK).contains(&shape[0]) => {
                Some(vec![None; shape[0] as usize])
            }
            _ => None,
        },
    };
    match dims {
        Some(dims) => ctx.set_output(0, dtype, Some(&dims))?,
        // Of unknown rank, a float output is left to the runtime (it types it like the
        // first registration, float); another type only this inference can tell, and the C
        // API declares it with no dimensions (see `ShapeInfer::set_output_type`).
        None if dtype == DType::Float => {}
        None => ctx.set_output_type(0, dtype)?,
    }
    state::infer(op, ctx)
}

impl OpSpec for DistOp {
    fn signature(&self) -> &Signature {
        self.signature
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let op = self.op();
        let dist = match self.kind {
            Kind::Uniform => Dist::Uniform { low: info.f32_or("low", 0.0)?, high: info.f32_or("high", 1.0)? },
            Kind::Normal => Dist::Normal { mean: info.f32_or("mean", 0.0)?, scale: info.f32_or("scale", 1.0)? },
        };
        let dtype = dtype_attr(info, op)?;
        if dtype != self.dtype {
            let what = format!("{} does not match the output's type {}", dtype.name(), self.dtype.name());
            return Err(Error::Attribute { op, name: "dtype", what });
        }
        Ok(Box::new(DistKernel { op, shape: OutputShape::from_node(op, info)?, dtype, dist }))
    }

    fn device_op(&'static self, info: &KernelInfo<'_>) -> Result<Option<crate::ffi::device::DeviceOp>> {
        use crate::ffi::device::DeviceOp;

        let dtype = dtype_attr(info, self.op())?;
        if dtype != self.dtype {
            let what = format!("{} does not match the output's type {}", dtype.name(), self.dtype.name());
            return Err(Error::Attribute { op: self.op(), name: "dtype", what });
        }
        let shape = OutputShape::from_node(self.op(), info)?;
        Ok(Some(match self.kind {
            Kind::Uniform => {
                let (low, high) = (info.f32_or("low", 0.0)?, info.f32_or("high", 1.0)?);
                DeviceOp::Uniform(super::device::uniform(shape, dtype), super::device::uniform_args(dtype, low, high))
            }
            // The float64 transcendental functions are CUDA's, not the CPU's libm: the values
            // agree to the bound of docs/gpu.md (bitwise for float32 but near a rounding edge).
            Kind::Normal => {
                let (mean, scale) = (info.f32_or("mean", 0.0)?, info.f32_or("scale", 1.0)?);
                DeviceOp::Normal(super::device::normal(shape, dtype), super::device::normal_args(dtype, mean, scale))
            }
        }))
    }

    fn infers_output_types(&self) -> bool {
        true
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        infer_dist(self.op(), ctx)
    }
}

/// The kernel of one PhiloxUniform or PhiloxNormal node.
struct DistKernel {
    op: &'static str,
    shape: OutputShape,
    dtype: DType,
    dist: Dist,
}

/// Outputs bound to overlapping memory have no defined result.
fn disjoint(op: &'static str, named: &[(&str, &Tensor)]) -> Result<()> {
    for (i, (na, a)) in named.iter().enumerate() {
        for (nb, b) in &named[i + 1..] {
            let (x, y) = (a.bytes(), b.bytes());
            if !x.is_empty() && !y.is_empty() && x.start < y.end && y.start < x.end {
                return Err(Error::Aliasing { op, what: format!("{na} and {nb} are bound to overlapping memory") });
            }
        }
    }
    Ok(())
}

impl Kernel for DistKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let op = self.op;
        let (state, state_t) = state::read_state(ctx, op)?;
        let (dims, _) = self.shape.dims(ctx)?;
        let outputs = Outputs::new(ctx, op, self.dtype, &dims, &state_t)?;
        let out = &outputs.output;
        // SAFETY: the output's type, size and alignment are checked; the state was copied
        // out, so no other view of any buffer is alive; output and state_out do not overlap.
        let output = unsafe {
            match self.dtype {
                DType::Float => Output::F32(out.slice_mut::<f32>()),
                DType::Double => Output::F64(out.slice_mut::<f64>()),
                DType::Float16 => Output::F16(out.slice_mut::<f16>()),
                _ => Output::BF16(out.slice_mut::<bf16>()),
            }
        };
        let pool = OrtPool::new(ctx);
        let next = match self.dist {
            Dist::Uniform { low, high } => uniform::fill(&state, low, high, output, &pool),
            Dist::Normal { mean, scale } => normal::fill(&state, mean, scale, output, &pool),
        };
        outputs.write_state(&next);
        Ok(())
    }
}

/// `com.trainops::PhiloxDropout` (since version 1).
pub struct PhiloxDropout;

const DROPOUT: &str = "PhiloxDropout";

static DROPOUT_INPUTS: [Formal; 4] = [
    Formal::One(None),
    // float only: ONNX Runtime infers the output's type from the one input of undeclared type.
    Formal::Optional(Some(DType::Float)),
    Formal::Optional(Some(DType::Bool)),
    Formal::One(Some(DType::Uint32)),
];
static DROPOUT_OUTPUTS: [Formal; 3] =
    [Formal::One(None), Formal::Optional(Some(DType::Bool)), Formal::Optional(Some(DType::Uint32))];

impl OpSpec for PhiloxDropout {
    fn signature(&self) -> &Signature {
        static SIGNATURE: Signature =
            Signature { name: c"PhiloxDropout", inputs: &DROPOUT_INPUTS, outputs: &DROPOUT_OUTPUTS };
        &SIGNATURE
    }

    fn create(&'static self, _info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(DropoutKernel))
    }

    fn device_op(&'static self, _info: &KernelInfo<'_>) -> Result<Option<crate::ffi::device::DeviceOp>> {
        Ok(Some(crate::ffi::device::DeviceOp::Dropout(super::device::dropout())))
    }
}

struct DropoutKernel;

/// Optional input `index`, `None` when the node leaves it out.
fn optional_input(ctx: &Context<'_>, index: usize) -> Result<Option<Tensor>> {
    if ctx.input_count()? > index {
        ctx.input(index)
    } else {
        Ok(None)
    }
}

impl Kernel for DropoutKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let op = DROPOUT;
        let data = io::required(ctx, op, 0, "data")?;
        if !matches!(data.dtype, DType::Float | DType::Double | DType::Float16 | DType::BFloat16) {
            let expected = "a tensor(float), tensor(double), tensor(float16) or tensor(bfloat16)";
            return Err(Error::input(op, 0, "data", expected, data.dtype.name()));
        }
        if !data.aligned() {
            return Err(Error::input(op, 0, "data", "an aligned buffer", "a misaligned one"));
        }
        let ratio = match optional_input(ctx, 1)? {
            Some(_) => io::scalar_float(ctx, op, 1, "ratio")?,
            None => 0.5,
        };
        let training = match optional_input(ctx, 2)? {
            Some(t) => t.read_bool().ok_or_else(|| {
                let got = format!("{} with shape {:?}", t.dtype.name(), t.shape);
                Error::input(op, 2, "training_mode", "a tensor(bool) with exactly one element", got)
            })?,
            None => false,
        };
        let state_t = io::exact(ctx, op, 3, "state", &[DType::Uint32], 6, " [c0, c1, c2, c3, k0, k1]")?;
        // SAFETY: six aligned uint32 elements, checked; copied out before any output view.
        let state: [u32; 6] = unsafe { state_t.slice::<u32>() }.try_into().expect("six words");
        if training && !(0.0..1.0).contains(&ratio) {
            return Err(Error::input(op, 1, "ratio", "a value in [0, 1) in training mode", format!("{ratio}")));
        }
        let out = io::output(ctx, op, 0, "output", data.dtype, &data.shape)?;
        let mask = io::optional_output(ctx, op, 1, "mask", DType::Bool, &data.shape)?;
        let state_out = io::optional_output(ctx, op, 2, "state_out", DType::Uint32, &state_t.shape)?;
        let mut named = vec![("output 0 (output)", &out)];
        if let Some(m) = &mask {
            named.push(("output 1 (mask)", m));
        }
        if let Some(s) = &state_out {
            named.push(("output 2 (state_out)", s));
        }
        disjoint(op, &named)?;
        // The data may be the output's own buffer (in place); any other overlap of the data
        // with an output has no defined result.
        let (d, o) = (data.bytes(), out.bytes());
        let in_place = !d.is_empty() && d == o;
        let mut others: Vec<(&str, &Tensor)> = named[1..].to_vec();
        if !in_place {
            others.push(("output 0 (output)", &out));
        }
        for (name, t) in others {
            let b = t.bytes();
            if !d.is_empty() && !b.is_empty() && d.start < b.end && b.start < d.end {
                return Err(Error::Aliasing {
                    op,
                    what: format!("input 0 (data) and {name} are bound to overlapping memory"),
                });
            }
        }
        // SAFETY: types, sizes and alignment are checked above; the data is either exactly
        // the output's buffer (one mutable view, `InOut::in_place`) or disjoint from every
        // output; the outputs are pairwise disjoint; ratio, training_mode and state were
        // copied out.
        let (stream, mask_slice) = unsafe {
            let stream = match (data.dtype, in_place) {
                (DType::Float, true) => dropout::Data::F32(InOut::in_place(out.slice_mut())),
                (DType::Float, false) => dropout::Data::F32(split(data.slice(), out.slice_mut())?),
                (DType::Double, true) => dropout::Data::F64(InOut::in_place(out.slice_mut())),
                (DType::Double, false) => dropout::Data::F64(split(data.slice(), out.slice_mut())?),
                (DType::Float16, true) => dropout::Data::F16(InOut::in_place(out.slice_mut())),
                (DType::Float16, false) => dropout::Data::F16(split(data.slice(), out.slice_mut())?),
                (_, true) => dropout::Data::BF16(InOut::in_place(out.slice_mut())),
                (_, false) => dropout::Data::BF16(split(data.slice(), out.slice_mut())?),
            };
            (stream, mask.as_ref().map(|m| m.slice_mut::<bool>()))
        };
        let next = if training {
            dropout::fill(&state, ratio, stream, mask_slice, &OrtPool::new(ctx)).map_err(|e| kernel_error(op, e))?
        } else {
            dropout::pass_through(stream, mask_slice).map_err(|e| kernel_error(op, e))?;
            state
        };
        if let Some(s) = state_out {
            // SAFETY: six aligned uint32 elements, checked; disjoint from every other buffer
            // in use, and the state input was copied out (it may be this very buffer).
            unsafe { s.slice_mut::<u32>() }.copy_from_slice(&next);
        }
        Ok(())
    }
}

fn split<'a, T: Copy>(src: &'a [T], dst: &'a mut [T]) -> Result<InOut<'a, T>> {
    InOut::split(src, dst).map_err(|e| kernel_error(DROPOUT, e))
}

fn kernel_error(op: &'static str, e: trainops_kernels::KernelError) -> Error {
    Error::Runtime { op, call: "kernel", message: e.to_string() }
}

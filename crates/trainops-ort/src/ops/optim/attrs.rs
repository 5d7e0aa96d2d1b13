//! The one reader of every optimizer op's attributes, and its checks.
//!
//! Each attribute type of the family (`AdamAttrs` for Adam, Adam8bit, AdamBf16State and
//! MixedPrecisionAdam; torch's `AdamWAttrs` for AdamW, AdamW8bit and AdamWBf16State;
//! Adagrad's; Momentum's; MemoryCeiling's none) implements [`FromNode`]: a table of its float
//! attributes (name, default or required, allowed range) and 0/1 flags, and a `build` from
//! the values once checked. [`read`] is the only way an op gets its attributes, so a new
//! variant cannot skip the checks: it names its type, and the type's table is checked. Every
//! error names the op actually run, the attribute and what was expected.
//!
//! The ranges: torch's for AdamW (`0 <= beta < 1`, `epsilon >= 0`, `weight_decay >= 0`;
//! out of them the bias correction divides by zero or the update runs the wrong way: beta1
//! = 1 turned every weight NaN after one step); for ONNX's Adam the same on its `alpha`,
//! `beta` and `epsilon`, its L2 coefficients `>= 0`, all finite; Adagrad's and Momentum's
//! finite. NaN is never in range.

use trainops_kernels::optim::adagrad::AdagradAttrs;
use trainops_kernels::optim::adam::AdamAttrs;
use trainops_kernels::optim::adamw::{as_written, AdamWAttrs};
use trainops_kernels::optim::momentum::{MomentumAttrs, MomentumMode};
use trainops_kernels::optim::quantized::adamw::AdamWAttrs as AdamW8bitAttrs;

use crate::error::{Error, Result};
use crate::ffi::KernelInfo;

/// The values a float attribute may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Range {
    /// `0 <= v < 1` (a moment's decay).
    Unit,
    /// `v >= 0`, infinity included (torch's check of AdamW's `eps` and `weight_decay`).
    NonNegative,
    /// `0 <= v < inf`.
    FiniteNonNegative,
    /// Any finite value.
    Finite,
}

impl Range {
    fn holds(self, v: f64) -> bool {
        match self {
            Self::Unit => (0.0..1.0).contains(&v),
            Self::NonNegative => v >= 0.0,
            Self::FiniteNonNegative => v >= 0.0 && v.is_finite(),
            Self::Finite => v.is_finite(),
        }
    }

    fn words(self) -> &'static str {
        match self {
            Self::Unit => "a value in [0, 1)",
            Self::NonNegative => "a value >= 0",
            Self::FiniteNonNegative => "a finite value >= 0",
            Self::Finite => "a finite value",
        }
    }
}

/// One float attribute: its name, its default (`None`: required, as ONNX's Momentum has
/// them) and its range.
#[derive(Debug, Clone, Copy)]
pub struct Float {
    /// The attribute's name.
    pub name: &'static str,
    /// Its default; `None` when the node must set it.
    pub default: Option<f32>,
    /// The values it may take.
    pub range: Range,
}

/// An attribute type's table.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// The float attributes, in the order [`Values::floats`] holds them.
    pub floats: &'static [Float],
    /// The 0/1 int attributes (absent: 0), in the order [`Values::flags`] holds them.
    pub flags: &'static [&'static str],
    /// 0/1 int attributes that must be 0 (absent or 0), with the reason given when 1.
    pub unsupported: &'static [(&'static str, &'static str)],
    /// Words after the range in a message, e.g. ` (as torch.optim.AdamW)`.
    pub source: &'static str,
}

/// A node's attributes of a [`Spec`], checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Values {
    /// The float attributes, in the spec's order, as the node holds them (float32).
    pub floats: Vec<f32>,
    /// The flags, in the spec's order.
    pub flags: Vec<bool>,
}

/// An attribute type of the optimizer family, read from a node only through [`read`].
pub trait FromNode: Sized {
    /// Its float attributes and flags, with defaults and ranges.
    const SPEC: Spec;
    /// The value from the checked attributes; any other attribute (Momentum's `mode`) is
    /// read from `info` here, its errors naming `op`.
    fn build(op: &'static str, info: &KernelInfo<'_>, values: &Values) -> Result<Self>;
}

/// The attributes of op `op`'s node as `A`, every one checked against `A`'s table: a
/// wrong-typed, missing (when required) or out-of-range one is an error naming `op` and the
/// attribute, with the range expected.
pub fn read<A: FromNode>(op: &'static str, info: &KernelInfo<'_>) -> Result<A> {
    let spec = &A::SPEC;
    let mut floats = Vec::with_capacity(spec.floats.len());
    for f in spec.floats {
        let v = match (info.f32_opt(f.name)?, f.default) {
            (Some(v), _) => v,
            (None, Some(d)) => d,
            (None, None) => return Err(missing(op, f.name, "a float")),
        };
        check_float(op, f, spec.source, v)?;
        floats.push(v);
    }
    let mut flags = Vec::with_capacity(spec.flags.len());
    for &name in spec.flags {
        flags.push(flag(op, name, info.i64_opt(name)?)?);
    }
    for &(name, why) in spec.unsupported {
        if flag(op, name, info.i64_opt(name)?)? {
            return Err(Error::Attribute { op, name, what: why.to_owned() });
        }
    }
    A::build(op, info, &Values { floats, flags })
}

/// `v` checked against `f`'s range; the error prints it as written (float32's shortest
/// decimal, as Python prints it).
fn check_float(op: &'static str, f: &Float, source: &str, v: f32) -> Result<()> {
    if f.range.holds(f64::from(v)) {
        return Ok(());
    }
    Err(Error::Attribute { op, name: f.name, what: format!("expected {}{source}, got {v}", f.range.words()) })
}

/// A 0/1 int attribute (absent: 0).
pub fn flag(op: &'static str, name: &'static str, v: Option<i64>) -> Result<bool> {
    match v {
        None | Some(0) => Ok(false),
        Some(1) => Ok(true),
        Some(v) => Err(Error::Attribute { op, name, what: format!("expected 0 or 1, got {v}") }),
    }
}

/// The error for a required attribute the node does not set.
pub fn missing(op: &'static str, name: &'static str, kind: &str) -> Error {
    Error::Attribute {
        op,
        name,
        what: format!("required, but the node has no '{name}' attribute (ONNX gives it no default; expected {kind})"),
    }
}

const ADAM_DEFAULT: AdamAttrs = AdamAttrs::DEFAULT;

/// ONNX's Adam: alpha and beta are torch's beta1 and beta2 (alpha = 1 makes the bias
/// correction `1 - alpha^T` zero), the L2 coefficients weight decays.
impl FromNode for AdamAttrs {
    const SPEC: Spec = Spec {
        floats: &[
            Float { name: "alpha", default: Some(ADAM_DEFAULT.alpha), range: Range::Unit },
            Float { name: "beta", default: Some(ADAM_DEFAULT.beta), range: Range::Unit },
            Float { name: "epsilon", default: Some(ADAM_DEFAULT.epsilon), range: Range::FiniteNonNegative },
            Float {
                name: "norm_coefficient",
                default: Some(ADAM_DEFAULT.norm_coefficient),
                range: Range::FiniteNonNegative,
            },
            Float {
                name: "norm_coefficient_post",
                default: Some(ADAM_DEFAULT.norm_coefficient_post),
                range: Range::FiniteNonNegative,
            },
        ],
        flags: &[],
        unsupported: &[],
        source: "",
    };

    fn build(_: &'static str, _: &KernelInfo<'_>, v: &Values) -> Result<Self> {
        let f = &v.floats;
        Ok(AdamAttrs { alpha: f[0], beta: f[1], epsilon: f[2], norm_coefficient: f[3], norm_coefficient_post: f[4] })
    }
}

/// torch.optim.AdamW's attributes, names, defaults (the float32 ones every AdamW variant
/// reads) and ranges (`amsgrad` is read by the op: it picks AdamW's layout, and the variants
/// without it refuse it through their own spec).
const ADAMW_FLOATS: &[Float] = {
    let d = AdamW8bitAttrs::DEFAULT;
    &[
        Float { name: "beta1", default: Some(d.beta1), range: Range::Unit },
        Float { name: "beta2", default: Some(d.beta2), range: Range::Unit },
        Float { name: "epsilon", default: Some(d.epsilon), range: Range::NonNegative },
        Float { name: "weight_decay", default: Some(d.weight_decay), range: Range::NonNegative },
    ]
};
const TORCH: &str = " (as torch.optim.AdamW)";

/// `com.trainops::AdamW` (and AdamWBf16State, whose spec refuses amsgrad: see
/// [`AdamWNoAmsgrad`]): the floats as the decimals they were written as.
impl FromNode for AdamWAttrs {
    const SPEC: Spec = Spec { floats: ADAMW_FLOATS, flags: &["maximize"], unsupported: &[], source: TORCH };

    fn build(_: &'static str, _: &KernelInfo<'_>, v: &Values) -> Result<Self> {
        let f = &v.floats;
        Ok(AdamWAttrs {
            beta1: as_written(f[0]),
            beta2: as_written(f[1]),
            epsilon: as_written(f[2]),
            weight_decay: as_written(f[3]),
            maximize: v.flags[0],
        })
    }
}

/// AdamW's attributes for a variant with no amsgrad (AdamWBf16State): AdamW's table, and
/// `amsgrad` must be 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWNoAmsgrad(pub AdamWAttrs);

impl FromNode for AdamWNoAmsgrad {
    const SPEC: Spec = Spec {
        unsupported: &[("amsgrad", "amsgrad is not supported with bfloat16 state (use com.trainops::AdamW)")],
        ..AdamWAttrs::SPEC
    };

    fn build(op: &'static str, info: &KernelInfo<'_>, v: &Values) -> Result<Self> {
        AdamWAttrs::build(op, info, v).map(Self)
    }
}

/// AdamW8bit: AdamW's table, no amsgrad; the float32 values as the node holds them (the
/// 8-bit kernel computes in float32).
impl FromNode for AdamW8bitAttrs {
    const SPEC: Spec = Spec {
        unsupported: &[("amsgrad", "amsgrad is not supported with 8-bit state (use com.trainops::AdamW)")],
        ..AdamWAttrs::SPEC
    };

    fn build(_: &'static str, _: &KernelInfo<'_>, v: &Values) -> Result<Self> {
        let f = &v.floats;
        Ok(AdamW8bitAttrs { beta1: f[0], beta2: f[1], epsilon: f[2], weight_decay: f[3], maximize: v.flags[0] })
    }
}

/// ONNX's Adagrad, with ONNX's defaults.
impl FromNode for AdagradAttrs {
    const SPEC: Spec = Spec {
        floats: &[
            Float { name: "decay_factor", default: Some(AdagradAttrs::DEFAULT.decay_factor), range: Range::Finite },
            Float { name: "epsilon", default: Some(AdagradAttrs::DEFAULT.epsilon), range: Range::Finite },
            Float {
                name: "norm_coefficient",
                default: Some(AdagradAttrs::DEFAULT.norm_coefficient),
                range: Range::Finite,
            },
        ],
        flags: &[],
        unsupported: &[],
        source: "",
    };

    fn build(_: &'static str, _: &KernelInfo<'_>, v: &Values) -> Result<Self> {
        let f = &v.floats;
        Ok(AdagradAttrs { decay_factor: f[0], epsilon: f[1], norm_coefficient: f[2] })
    }
}

/// ONNX's Momentum: every attribute required (ONNX gives none a default).
impl FromNode for MomentumAttrs {
    const SPEC: Spec = Spec {
        floats: &[
            Float { name: "alpha", default: None, range: Range::Finite },
            Float { name: "beta", default: None, range: Range::Finite },
            Float { name: "norm_coefficient", default: None, range: Range::Finite },
        ],
        flags: &[],
        unsupported: &[],
        source: "",
    };

    fn build(op: &'static str, info: &KernelInfo<'_>, v: &Values) -> Result<Self> {
        let mode_name = info.string_opt("mode")?.ok_or_else(|| missing(op, "mode", "a string"))?;
        let mode = MomentumMode::from_onnx(&mode_name).ok_or_else(|| Error::Attribute {
            op,
            name: "mode",
            what: format!("expected \"standard\" or \"nesterov\", got {mode_name:?}"),
        })?;
        let f = &v.floats;
        Ok(MomentumAttrs { alpha: f[0], beta: f[1], mode, norm_coefficient: f[2] })
    }
}

/// MemoryCeiling (a yardstick): no attributes of the family.
impl FromNode for () {
    const SPEC: Spec = Spec { floats: &[], flags: &[], unsupported: &[], source: "" };

    fn build(_: &'static str, _: &KernelInfo<'_>, _: &Values) -> Result<Self> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn float(spec: &Spec, name: &str) -> Float {
        *spec.floats.iter().find(|f| f.name == name).unwrap_or_else(|| panic!("no {name}"))
    }

    fn refused(op: &'static str, spec: &Spec, name: &str, v: f32) -> String {
        check_float(op, &float(spec, name), spec.source, v).unwrap_err().to_string()
    }

    /// float32 AdamW's documented messages, and every AdamW variant's table is AdamW's
    /// (AdamW8bit once checked nothing: beta1 = 1 made every weight NaN).
    #[test]
    fn adamw_variants_share_torchs_ranges_and_messages() {
        for (op, spec) in
            [("AdamW", AdamWAttrs::SPEC), ("AdamW8bit", AdamW8bitAttrs::SPEC), ("AdamWBf16State", AdamWNoAmsgrad::SPEC)]
        {
            assert_eq!(
                refused(op, &spec, "beta1", 1.0),
                format!("{op}: attribute 'beta1': expected a value in [0, 1) (as torch.optim.AdamW), got 1")
            );
            assert_eq!(
                refused(op, &spec, "beta2", 1.5),
                format!("{op}: attribute 'beta2': expected a value in [0, 1) (as torch.optim.AdamW), got 1.5")
            );
            assert!(refused(op, &spec, "beta1", -0.1).ends_with("got -0.1"));
            assert!(refused(op, &spec, "beta1", f32::NAN).ends_with("got NaN"));
            assert_eq!(
                refused(op, &spec, "epsilon", -1e-8),
                format!("{op}: attribute 'epsilon': expected a value >= 0 (as torch.optim.AdamW), got -0.00000001")
            );
            assert!(refused(op, &spec, "weight_decay", -0.01).contains("'weight_decay': expected a value >= 0"));
            // torch's ranges: 0 and infinity are in, as torch accepts them.
            for (name, v) in [("beta1", 0.0), ("beta2", 0.99999994), ("epsilon", 0.0), ("weight_decay", f32::INFINITY)]
            {
                check_float(op, &float(&spec, name), spec.source, v).unwrap();
            }
            assert_eq!(spec.flags, ["maximize"]);
        }
        assert!(AdamWAttrs::SPEC.unsupported.is_empty());
        assert_eq!(AdamW8bitAttrs::SPEC.unsupported[0].0, "amsgrad");
        assert_eq!(AdamWNoAmsgrad::SPEC.unsupported[0].0, "amsgrad");
    }

    #[test]
    fn onnx_optimizers_refuse_what_breaks_their_math() {
        let s = AdamAttrs::SPEC;
        assert_eq!(
            refused("Adam8bit", &s, "alpha", 1.0),
            "Adam8bit: attribute 'alpha': expected a value in [0, 1), got 1"
        );
        assert!(refused("Adam", &s, "beta", 1.5).ends_with("expected a value in [0, 1), got 1.5"));
        assert!(refused("Adam", &s, "epsilon", f32::INFINITY).ends_with("expected a finite value >= 0, got inf"));
        assert!(refused("Adam", &s, "norm_coefficient_post", -0.5).contains("'norm_coefficient_post'"));
        let s = AdagradAttrs::SPEC;
        assert_eq!(
            refused("Adagrad", &s, "decay_factor", f32::NAN),
            "Adagrad: attribute 'decay_factor': expected a finite value, got NaN"
        );
        let s = MomentumAttrs::SPEC;
        assert!(s.floats.iter().all(|f| f.default.is_none()));
        assert!(refused("Momentum", &s, "beta", f32::NEG_INFINITY).ends_with("got -inf"));
        // ONNX's defaults are in range.
        for spec in [AdamAttrs::SPEC, AdagradAttrs::SPEC, AdamWAttrs::SPEC] {
            for f in spec.floats {
                assert!(f.range.holds(f64::from(f.default.unwrap())), "{}", f.name);
            }
        }
        assert_eq!(AdamAttrs::SPEC.floats.len(), 5);
        assert_eq!(ADAM_DEFAULT, AdamAttrs::default());
    }

    #[test]
    fn flags_are_zero_or_one() {
        assert!(!flag("AdamW", "amsgrad", None).unwrap());
        assert!(flag("AdamW", "amsgrad", Some(1)).unwrap());
        let msg = flag("AdamW", "maximize", Some(2)).unwrap_err().to_string();
        assert_eq!(msg, "AdamW: attribute 'maximize': expected 0 or 1, got 2");
        let msg = missing("Momentum", "mode", "a string").to_string();
        assert!(msg.starts_with("Momentum: attribute 'mode': required"), "{msg}");
    }
}

//! The op catalogue, in family folders: [`optim`] (Adam, Adagrad, Momentum, AdamW, and the generic
//! run path they share), [`loss_scale`] (MixedPrecisionAdam, DynamicLossScale, AllFinite),
//! [`random`] (Philox, PhiloxUniform, PhiloxNormal, PhiloxDropout, and the state and shape
//! handling they share), [`grad`] (backward kernels: ReluGrad, LeakyReluGrad, GeluGrad,
//! MaxPoolGrad, MaxPoolGradFromInput), [`bench`]
//! (MemoryCeiling); [`io`] is the one input reader and output check.
//! handling they share), [`bench`]
//! (MemoryCeiling); [`grad`] (ConvWeightGrad, ConvInputGrad, GatherGrad, BiasGrad, BlockedMatMul: backward kernels); [`io`] is the one input reader and output check.

pub mod bench;
pub mod grad;
pub mod io;
pub mod loss_scale;
pub mod optim;
pub mod random;

use core::ffi::CStr;

use crate::ffi::device::DeviceSupport;
use crate::ffi::{DType, Domain, OpSpec};
use crate::ops::optim::layout::Layout;

/// Every op the library registers, by domain.
pub fn catalogue() -> Vec<Domain> {
    let ops = |list: &[&'static dyn OpSpec]| list.to_vec();
    vec![
        Domain {
            name: c"ai.onnx.preview.training",
            ops: ops(&[&optim::adam::ADAM, &optim::adagrad::ADAGRAD, &optim::momentum::MOMENTUM]),
        },
        Domain {
            name: c"com.trainops",
            ops: [
                &random::philox::Philox as &'static dyn OpSpec,
                &random::distributions::PhiloxDropout,
                &optim::adamw::ADAMW,
                &loss_scale::mixed_precision_adam::MixedPrecisionAdam,
                &loss_scale::dynamic_loss_scale::DynamicLossScale,
                &loss_scale::all_finite::AllFinite,
                &optim::quantized::ADAM_8BIT,
                &optim::quantized::ADAMW_8BIT,
                &optim::bf16state::ADAM_BF16_STATE,
                &optim::bf16state::ADAMW_BF16_STATE,
                &grad::norm::LayerNormGrad,
                &grad::softmax::SOFTMAX_GRAD,
                &grad::softmax::LOG_SOFTMAX_GRAD,
                &grad::softmax::SoftmaxCrossEntropyLossGrad,
                &grad::softmax::SoftmaxCrossEntropy,
                &grad::activation::RELU_GRAD,
                &grad::activation::LEAKY_RELU_GRAD,
                &grad::activation::GELU_GRAD,
                &grad::activation::HARD_SIGMOID_GRAD,
                &grad::activation::HARD_SWISH_GRAD,
                &grad::activation::SILU_GRAD,
                &grad::pool::MaxPoolGrad,
                &grad::pool::MaxPoolGradFromInput,
                &grad::batchnorm::BatchNormTrainGrad,
                &grad::batchnorm::BatchNormTrain,
                &grad::rnn::GruGrad,
                &grad::gru_train::GruTrain,
                &grad::lstm::LstmTrain,
                &grad::lstm::LstmGrad,
                &grad::conv::ConvWeightGrad,
                &grad::conv::ConvInputGrad,
                &grad::gather::GatherGrad,
                &grad::bias::BiasGrad,
                &grad::matmul::BlockedMatMul,
                &grad::depthwise::DepthwiseConv,
                &grad::depthwise::DepthwiseConvGrad,
            ]
            .into_iter()
            // PhiloxUniform and PhiloxNormal, once per output type (see `distributions`).
            .chain(random::distributions::DIST_OPS.iter().copied())
            .collect(),
        },
        Domain { name: c"com.trainops.bench", ops: ops(&[&bench::MEMORY_CEILING]) },
    ]
}

/// The ops with device kernels in the plugin EP (`TrainopsExecutionProvider`), what their
/// device kernels take, and which inputs stay in host memory (R and T of the optimizers, the
/// shape of Philox). The EP claims a node of these ops when every other input has one of the
/// listed types, and leaves any other node, and every op not listed, on its CPU kernel.
pub fn device_support(domain: &CStr, op: &CStr) -> Option<DeviceSupport> {
    const SCALARS: &[usize] = &[0, 1];
    let support = |host_inputs, types, cuda| Some(DeviceSupport { host_inputs, types, cuda });
    match (domain.to_bytes(), op.to_bytes()) {
        (b"ai.onnx.preview.training", b"Adam" | b"Adagrad" | b"Momentum") => support(SCALARS, &[DType::Float], true),
        (b"com.trainops", b"AdamW") => support(SCALARS, &[DType::Float], true),
        // The state (and the shape, the ratio, training_mode) are host inputs: the host plans
        // the call with the CPU's functions (`random::device`), the device draws the words.
        (b"com.trainops", b"Philox") => support(&[0, 1], &[DType::Uint32], true),
        (b"com.trainops", b"PhiloxDropout") => support(&[1, 2, 3], &[DType::Float], true),
        // Every output type: the host plans the words, `trainops_uniform` converts them.
        (b"com.trainops", b"PhiloxUniform") => support(&[0, 1], &[DType::Uint32], true),
        // The same, `trainops_normal` (Box-Muller in float64 on the device).
        (b"com.trainops", b"PhiloxNormal") => support(&[0, 1], &[DType::Uint32], true),
        // The mixed-precision ops keep loss_scale, the verdicts and the scale state on the
        // device (`ffi::ep::mixed`); only R and T of MixedPrecisionAdam are host inputs.
        (b"com.trainops", b"MixedPrecisionAdam") => support(SCALARS, &[DType::Float, DType::Float16], true),
        (b"com.trainops", b"AllFinite") => support(&[], &[DType::Float, DType::Float16], true),
        (b"com.trainops", b"DynamicLossScale") => support(&[], &[DType::Float, DType::Int64, DType::Bool], true),
        _ => None,
    }
}

/// The layouts of every optimizer-shaped op of the catalogue (the fuzz targets check them all
/// through `trainops::fuzzing`): an optimizer added to the catalogue is added here too.
pub fn layouts() -> [&'static Layout; 7] {
    [
        &optim::adam::ADAM.layout,
        &optim::adamw::ADAMW.plain.layout,
        &optim::adamw::ADAMW.amsgrad.layout,
        &optim::adagrad::ADAGRAD.layout,
        &optim::momentum::MOMENTUM.layout,
        &loss_scale::mixed_precision_adam::LAYOUT,
        &bench::MEMORY_CEILING.three.layout,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The registration table of the CUDA door: which ops get a `CUDAExecutionProvider`
    /// overload (those with `cuda: true`), and which of their inputs stay in host memory.
    #[test]
    fn cuda_overloads_and_host_inputs() {
        let mut wired = Vec::new();
        for d in catalogue() {
            for spec in &d.ops {
                if let Some(s) = device_support(d.name, spec.name()).filter(|s| s.cuda) {
                    let name = spec.name().to_str().unwrap();
                    wired.push((d.name.to_str().unwrap().to_string(), name, s.host_inputs.to_vec()));
                    assert!(s.host_inputs.iter().all(|&i| i < spec.inputs().len()), "{name}");
                }
            }
        }
        let t = "ai.onnx.preview.training".to_string();
        let c = "com.trainops".to_string();
        assert_eq!(
            wired,
            vec![
                (t.clone(), "Adam", vec![0, 1]),
                (t.clone(), "Adagrad", vec![0, 1]),
                (t, "Momentum", vec![0, 1]),
                (c.clone(), "Philox", vec![0, 1]),
                (c.clone(), "PhiloxDropout", vec![1, 2, 3]),
                (c.clone(), "AdamW", vec![0, 1]),
                (c.clone(), "MixedPrecisionAdam", vec![0, 1]),
                (c.clone(), "DynamicLossScale", vec![]),
                (c.clone(), "AllFinite", vec![]),
            ]
            .into_iter()
            // PhiloxUniform: its four output types and the registration of any other type.
            .chain(std::iter::repeat_n((c.clone(), "PhiloxUniform", vec![0, 1]), 5))
            .chain(std::iter::repeat_n((c, "PhiloxNormal", vec![0, 1]), 5))
            .collect::<Vec<_>>()
        );
        // Not wired: the benchmark op.
        assert!(device_support(c"com.trainops.bench", c"MemoryCeiling").is_none());
    }
}

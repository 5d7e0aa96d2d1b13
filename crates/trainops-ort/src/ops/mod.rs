//! The op catalogue, in family folders: [`optim`] (Adam, Adagrad, Momentum, and the generic
//! run path they share), [`loss_scale`] (MixedPrecisionAdam, DynamicLossScale, AllFinite),
//! [`random`] (Philox, PhiloxUniform, PhiloxNormal, PhiloxDropout, and the state and shape
//! handling they share), [`bench`]
//! (MemoryCeiling); [`io`] is the one input reader and output check.

pub mod bench;
pub mod io;
pub mod loss_scale;
pub mod optim;
pub mod random;

use crate::ffi::{Domain, OpSpec};
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
                &loss_scale::mixed_precision_adam::MixedPrecisionAdam,
                &loss_scale::dynamic_loss_scale::DynamicLossScale,
                &loss_scale::all_finite::AllFinite,
            ]
            .into_iter()
            // PhiloxUniform and PhiloxNormal, once per output type (see `distributions`).
            .chain(random::distributions::DIST_OPS.iter().map(|op| *op as &'static dyn OpSpec))
            .collect(),
        },
        Domain { name: c"com.trainops.bench", ops: ops(&[&bench::MEMORY_CEILING]) },
    ]
}

/// The layouts of every optimizer-shaped op of the catalogue (the fuzz targets check them all
/// through `trainops::fuzzing`): an optimizer added to the catalogue is added here too.
pub fn layouts() -> [&'static Layout; 5] {
    [
        &optim::adam::ADAM.layout,
        &optim::adagrad::ADAGRAD.layout,
        &optim::momentum::MOMENTUM.layout,
        &loss_scale::mixed_precision_adam::LAYOUT,
        &bench::MEMORY_CEILING.layout,
    ]
}

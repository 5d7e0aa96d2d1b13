//! The convolution's gradients (ONNX `Conv`, float32, N-d, groups, strides, dilations,
//! explicit pads), for `Y[n, m, o] = sum_{c, k} W[m, c, k] * X[n, g*C/G + c, o*s + k*d - p]`
//! (`g = m / (M/G)`, `c < C/G`, positions outside the input read 0):
//!
//! - [`weight_grad`]: `dW[m, c, k] = sum_{n, o} dY[n, m, o] * X[n, g*C/G + c, o*s + k*d - p]`,
//!   as one product `dW_g [M/G x K] = dY_g [M/G x N*P] * col_g^T [N*P x K]` whose reduction
//!   runs over every sample's output positions (`col` the [`im2col`](super::im2col)
//!   matrix, `K = C/G * prod(kernel)`, `P = prod(output)`), on `fma_chain`: every
//!   element of `dW` is one chain of fused multiply-adds, sample 0's positions first (or,
//!   where the blocks of `dW` make one task, one chain per part of the samples, four parts
//!   added in order), so the result is the same bits at every SIMD level
//!   ([`weight_grad_at`]) and thread count.
//!   `dY` is packed once into the product's panels and shared; the column matrix is
//!   lowered a block of 256 positions at a time straight into panels (AVX-512 gathers), or
//!   at the AVX-512 level, where the output channels come in whole panels of 32, read in
//!   place from the padded input (`dW_g^T = col_g * dY_g^T`, the same chains).
//! - [`input_grad`]: `dX[n, g*C/G + c, i] = sum_{m in g, k, o: o*s + k*d - p = i} W[m, c, k]
//!   * dY[n, m, o]`, as `col = W_g^T [K x M/G] * dY_{n,g} [M/G x P]`, then col2im (the
//!   product on the `gemm` crate).
//!
//! Consecutive samples share one column matrix (side by side) until it has 256 columns, so
//! small grids make few large products. Threads: the weight gradient is cut into blocks of
//! `dW`'s columns (rows of `col`, whole tiles of 32) per group, and where those are too
//! few into blocks of its rows (output channels, whole panels of 8) as well, each task
//! running its block's chains over every sample, and where that makes one task (a stem
//! convolution) into four parts of the samples; the input gradient into chunks of samples. The cut
//! depends on the shapes only, so results do not depend on the thread count. Against the
//! float64 [`reference`](mod@reference), each result is within `terms * f32::EPSILON *
//! sum |terms|` (float32 sums of `terms` products, any order).

use core::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use super::im2col::Windows;
use crate::error::KernelError;
use crate::parallel::{for_each_item, Parallelism};
use crate::shape;
use crate::simd::{detected, Isa, Level};
use fma_chain::{Out, Panels, Rows, Transposed, MR, NR};

#[path = "fma_chain.rs"]
pub(crate) mod fma_chain;

/// A convolution's attributes, resolved (no `auto_pad`): one entry per spatial dimension,
/// `pads` the beginnings then the ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvGeometry {
    /// Kernel spatial shape.
    pub kernel: Vec<usize>,
    /// Strides (each at least 1).
    pub strides: Vec<usize>,
    /// Dilations (each at least 1).
    pub dilations: Vec<usize>,
    /// Pads: `[begin_0, .., begin_{d-1}, end_0, .., end_{d-1}]`.
    pub pads: Vec<usize>,
    /// Groups (at least 1).
    pub group: usize,
}

/// Why a convolution's attributes or shapes were refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConvError {
    /// Attribute `name` is malformed, out of range, or its arithmetic overflows.
    Attribute {
        /// The attribute (`kernel_shape`, `strides`, `dilations`, `pads`, `group`).
        name: &'static str,
        /// What is wrong, with the values.
        what: String,
    },
    /// The tensor shapes do not fit the attributes (ranks, group, a kernel larger than the
    /// padded input, a size no tensor can have).
    Shape(String),
}

impl core::fmt::Display for ConvError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Attribute { name, what } => write!(f, "attribute '{name}': {what}"),
            Self::Shape(what) => f.write_str(what),
        }
    }
}

impl std::error::Error for ConvError {}

fn attribute(name: &'static str, what: String) -> ConvError {
    ConvError::Attribute { name, what }
}

impl ConvGeometry {
    /// Checks the lists' lengths against the kernel's rank and that strides, dilations,
    /// kernel sizes and the group are positive and every value at most `2^63 - 1`; the error
    /// names the attribute at fault.
    pub fn check(&self) -> Result<(), ConvError> {
        let d = self.kernel.len();
        if d == 0 {
            return Err(attribute("kernel_shape", "must have at least one spatial dimension".into()));
        }
        for (name, list, want) in
            [("strides", &self.strides, d), ("dilations", &self.dilations, d), ("pads", &self.pads, 2 * d)]
        {
            if list.len() != want {
                return Err(attribute(name, format!("must have {want} values for a {d}-d kernel, got {list:?}")));
            }
        }
        for (name, list) in [("kernel_shape", &self.kernel), ("strides", &self.strides), ("dilations", &self.dilations)]
        {
            if list.contains(&0) {
                return Err(attribute(name, format!("must be positive, got {list:?}")));
            }
        }
        for (name, list) in [
            ("kernel_shape", &self.kernel),
            ("strides", &self.strides),
            ("dilations", &self.dilations),
            ("pads", &self.pads),
        ] {
            if list.iter().any(|&v| v > shape::MAX_DIM) {
                return Err(attribute(name, format!("values must be at most 2^63 - 1, got {list:?}")));
            }
        }
        if self.group == 0 || self.group > shape::MAX_DIM {
            return Err(attribute("group", format!("must be in [1, 2^63 - 1], got {}", self.group)));
        }
        Ok(())
    }

    /// The output spatial shape over input spatial shape `input` (of the kernel's rank; the
    /// geometry [checked](Self::check)), every step overflow-checked: the padded input and
    /// the dilated kernel must fit in `2^63 - 1`, and the dilated kernel in the padded input.
    pub fn output_spatial(&self, input: &[usize]) -> Result<Vec<usize>, ConvError> {
        let d = self.kernel.len();
        if input.len() != d {
            return Err(ConvError::Shape(format!(
                "the input has {} spatial dimensions, the kernel {d} (kernel_shape {:?})",
                input.len(),
                self.kernel
            )));
        }
        (0..d)
            .map(|j| {
                let (pb, pe) = (self.pads[j], self.pads[j + d]);
                let padded = input[j].checked_add(pb).and_then(|v| v.checked_add(pe)).filter(|&v| v <= shape::MAX_DIM);
                let padded = padded.ok_or_else(|| {
                    let what =
                        format!("dimension {j}: the input ({}) padded by {pb} + {pe} exceeds 2^63 - 1", input[j]);
                    attribute("pads", what)
                })?;
                let (k, dil) = (self.kernel[j], self.dilations[j]);
                let window = (k - 1).checked_mul(dil).filter(|&v| v < shape::MAX_DIM).ok_or_else(|| {
                    let what = format!("dimension {j}: the dilated kernel (({k} - 1) * {dil} + 1) exceeds 2^63 - 1");
                    attribute("dilations", what)
                })? + 1;
                let span = padded.checked_sub(window).ok_or_else(|| {
                    ConvError::Shape(format!(
                        "the kernel {:?} (dilations {:?}) does not fit the input {input:?} padded by {:?}: \
                         dimension {j} spans {window} elements, the padded input {padded}",
                        self.kernel, self.dilations, self.pads
                    ))
                })?;
                Ok(span / self.strides[j] + 1)
            })
            .collect()
    }
}

/// The tensor shapes of one convolution, checked against its geometry: `X [batch, channels,
/// input..]`, `W [out_channels, channels / group, kernel..]`, `dY [batch, out_channels,
/// output..]`. Making one allocates nothing sized by the attributes (the windows' tables are
/// built by the first kernel call, once the buffers they must fit have been checked, and kept
/// for the calls after it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvDims {
    batch: usize,
    channels: usize,
    out_channels: usize,
    geo: ConvGeometry,
    input: Vec<usize>,
    output: Vec<usize>,
    input_len: usize,
    output_len: usize,
    kernel_len: usize,
    windows: BuiltOnce,
}

/// [`Windows`] built on first use and kept: a cache, no part of what the dims are (dims
/// compare equal whether or not either has built its tables).
#[derive(Debug, Clone, Default)]
struct BuiltOnce(OnceLock<Arc<Windows>>);

impl PartialEq for BuiltOnce {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for BuiltOnce {}

/// Columns a column matrix may have beyond `output_len` (samples side by side, row padding).
const SLACK_COLUMNS: usize = TARGET_COLUMNS + ROW_PAD;

impl ConvDims {
    /// The shapes of a convolution of `geo` over `batch` samples of `channels` input
    /// channels on grid `input`, with `out_channels` filters. The error says what does not
    /// fit (an attribute, channel counts not divisible by the group, a kernel larger than
    /// the padded input, a rank other than the kernel's, a size past the address space).
    pub fn new(
        geo: &ConvGeometry,
        batch: usize,
        channels: usize,
        out_channels: usize,
        input: &[usize],
    ) -> Result<Self, ConvError> {
        geo.check()?;
        let output = geo.output_spatial(input)?;
        if !channels.is_multiple_of(geo.group) || !out_channels.is_multiple_of(geo.group) {
            return Err(ConvError::Shape(format!(
                "group {} must divide the input channels ({channels}) and the output channels ({out_channels})",
                geo.group
            )));
        }
        let too_big = |e: KernelError| ConvError::Shape(e.to_string());
        let kernel_len = shape::product("kernel_shape", &geo.kernel)
            .map_err(|e| attribute("kernel_shape", format!("{e} (the kernel's element count)")))?;
        let input_len = shape::count("the input grid", input).map_err(too_big)?;
        let output_len = shape::product("the output grid", &output).map_err(too_big)?;
        let dims = Self {
            batch,
            channels,
            out_channels,
            geo: geo.clone(),
            input: input.to_vec(),
            output,
            input_len,
            output_len,
            kernel_len,
            windows: BuiltOnce::default(),
        };
        // Every tensor's element count, and the column matrix (K rows of at most
        // output_len + SLACK_COLUMNS), must be sizes.
        for (what, s) in [("X", dims.x_shape()), ("dY", dims.y_shape()), ("W", dims.w_shape())] {
            shape::count(what, &s).map_err(too_big)?;
            shape::to_i64(what, &s).map_err(too_big)?;
        }
        let k = shape::mul("the column matrix's rows", dims.cg(), kernel_len).map_err(too_big)?;
        let cols = shape::add("the column matrix's columns", output_len, SLACK_COLUMNS).map_err(too_big)?;
        shape::mul("the column matrix", k, cols).map_err(too_big)?;
        Ok(dims)
    }

    /// `X`'s shape.
    pub fn x_shape(&self) -> Vec<usize> {
        [self.batch, self.channels].into_iter().chain(self.input.iter().copied()).collect()
    }

    /// `dY`'s (and `Y`'s) shape.
    pub fn y_shape(&self) -> Vec<usize> {
        [self.batch, self.out_channels].into_iter().chain(self.output.iter().copied()).collect()
    }

    /// `W`'s (and `dW`'s) shape.
    pub fn w_shape(&self) -> Vec<usize> {
        [self.out_channels, self.channels / self.geo.group].into_iter().chain(self.geo.kernel.iter().copied()).collect()
    }

    /// The windows of this convolution over one input grid, with their tables: built by the
    /// first call (allocated fallibly: an error, never an abort, when they cannot be had) and
    /// shared by the calls after it.
    pub fn windows(&self) -> Result<Arc<Windows>, KernelError> {
        if let Some(w) = self.windows.0.get() {
            return Ok(Arc::clone(w));
        }
        let d = self.input.len();
        let g = &self.geo;
        let w = Arc::new(Windows::new(&self.input, &self.output, &g.kernel, &g.strides, &g.dilations, &g.pads[..d])?);
        Ok(Arc::clone(self.windows.0.get_or_init(|| w)))
    }

    fn cg(&self) -> usize {
        self.channels / self.geo.group
    }

    fn mg(&self) -> usize {
        self.out_channels / self.geo.group
    }

    /// Rows of one group's column matrix (`C/G * prod(kernel)`).
    fn k(&self) -> usize {
        self.cg() * self.kernel_len
    }
}

/// `got` elements for a tensor of dimensions `dims`, else an error naming `what`.
fn check_len(what: &'static str, got: usize, dims: &[usize]) -> Result<(), KernelError> {
    let expected = shape::count(what, dims)?;
    if got == expected {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch { what, got, expected })
    }
}

/// Below this many multiply-adds a weight gradient runs as one block per group.
const SPLIT_ABOVE: usize = 1 << 20;
/// Most blocks per group of a split weight gradient (each streams all of `dY`'s panels).
/// Blocks are whole tiles (of 32 columns) spread evenly: resnet18's layer1 (18 tiles) was
/// cut into 9 blocks of 2 tiles, 5 against 4 on two threads (1.37x the one-thread speed);
/// 16 blocks of 1 or 2 tiles balance them.
const MAX_BLOCKS: usize = 16;

/// Tasks per group a split weight gradient aims at. Where `dW` has too few column tiles
/// (a pointwise convolution of 16-96 input channels has 1-3 of them, and two tiles of 32
/// and 8 columns are one task of 4/5 of the work), its rows (output channels) are cut
/// too, in blocks of at least [`MIN_ROW_PANELS`] panels of `MR`.
const TARGET_TASKS: usize = 8;
/// Panels of `MR` rows a row block has at least: each row block lowers its own copy of the
/// columns, which costs about what 8 to 16 rows of the product do.
const MIN_ROW_PANELS: usize = 8;

/// True when the weight gradient is large enough to be cut into blocks.
fn split(dims: &ConvDims) -> bool {
    let work = dims.batch.saturating_mul(dims.mg()).saturating_mul(dims.k()).saturating_mul(dims.output_len);
    work >= SPLIT_ABOVE
}

/// Parts of the samples a weight gradient of one task is cut into ([`sample_parts`]).
const SAMPLE_PARTS: usize = 4;

/// The samples of a weight gradient's reduction, cut into [`SAMPLE_PARTS`] consecutive
/// parts of whole sample chunks where its column and row blocks make one task per group
/// (`tasks`): a stem convolution of 3 input channels and 16 or 32 output channels has one
/// column tile and too few rows to cut, so its lowering of the columns (27 rows of gathers
/// for 16 or 32 output channels) ran on one thread, and no faster on two. Each part's block
/// is its own fused chain per element over its samples, and the parts' blocks are added
/// in order: a function of the shapes only. (Cutting wherever the blocks made fewer than
/// [`TARGET_TASKS`], 8 parts, cost 6-8% at one thread on those stems and made resnet18's
/// 7x7 stem, 5 column blocks, slower at two.)
fn sample_parts(dims: &ConvDims, tasks: usize) -> Vec<Range<usize>> {
    let chunk = samples_per_chunk(dims);
    let chunks = dims.batch.div_ceil(chunk).max(1);
    let count = if split(dims) && tasks == 1 { SAMPLE_PARTS.min(chunks) } else { 1 };
    even(chunks, count).into_iter().map(|r| r.start * chunk..(r.end * chunk).min(dims.batch)).collect()
}

/// The column blocks of one group's `dW_g` (a function of the shapes only): whole tiles
/// of the product (fma_chain::NR columns), the first blocks one tile longer where they
/// cannot all be equal; the last tile may be partial.
fn blocks(dims: &ConvDims) -> Vec<Range<usize>> {
    let k = dims.k();
    let tiles = k.div_ceil(NR);
    let count = if split(dims) { tiles.clamp(1, MAX_BLOCKS) } else { 1 };
    even(tiles, count).into_iter().map(|t| t.start * NR..(t.end * NR).min(k)).filter(|r| !r.is_empty()).collect()
}

/// The row blocks of one group's `dW_g`, as ranges of its panels of `MR` output channels,
/// given `columns` column blocks (a function of the shapes only): one block unless the
/// columns make fewer than [`TARGET_TASKS`] tasks and there are panels enough.
fn row_blocks(dims: &ConvDims, columns: usize) -> Vec<Range<usize>> {
    let mt = dims.mg().div_ceil(MR);
    let wanted = TARGET_TASKS.div_ceil(columns.max(1));
    let count = if split(dims) { wanted.min(mt / MIN_ROW_PANELS).max(1) } else { 1 };
    even(mt, count)
}

/// `0..units` cut into `count` consecutive ranges whose lengths differ by at most one (the
/// longer first).
fn even(units: usize, count: usize) -> Vec<Range<usize>> {
    let count = count.clamp(1, units.max(1));
    let (each, longer) = (units / count, units % count);
    let mut start = 0;
    (0..count)
        .map(|b| {
            let end = start + each + usize::from(b < longer);
            let r = start..end;
            start = end;
            r
        })
        .collect()
}

/// Columns of one GEMM: consecutive samples sit side by side in the column matrix until it
/// has at least this many (small grids would otherwise make many tiny products).
const TARGET_COLUMNS: usize = 256;

/// Elements between the end of one row of a column matrix and the start of the next: rows a
/// power of two apart (a 32x32 grid: 4 KiB) alias in the cache when the GEMM packs the
/// matrix column by column.
const ROW_PAD: usize = 16;

/// Samples per column matrix (a function of the shapes only).
fn samples_per_chunk(dims: &ConvDims) -> usize {
    TARGET_COLUMNS.div_ceil(dims.output_len.max(1)).clamp(1, dims.batch.max(1))
}

/// Group `g` of `dY` for samples `n0 .. n0 + nc` as one `[M/G x nc*P]` matrix, gathered
/// into `buf` with rows [`ROW_PAD`] apart beyond their length (a view of `dy` itself would
/// put them `P` apart: 4 KiB for a 32x32 grid, aliasing in the cache).
fn dy_block<'a>(
    dims: &ConvDims,
    dy: &[f32],
    g: usize,
    n0: usize,
    nc: usize,
    buf: &'a mut Vec<f32>,
) -> (&'a [f32], usize) {
    let (mg, p, m_all) = (dims.mg(), dims.output_len, dims.out_channels);
    let cols = nc * p;
    let ld = cols + ROW_PAD;
    buf.resize(mg * ld, 0.0);
    for m in 0..mg {
        for s in 0..nc {
            let src = ((n0 + s) * m_all + g * mg + m) * p;
            buf[m * ld + s * p..m * ld + (s + 1) * p].copy_from_slice(&dy[src..src + p]);
        }
    }
    (buf, ld)
}

/// The first error of a kernel's tasks (tasks cannot return one).
struct FirstError(Mutex<Option<KernelError>>);

impl FirstError {
    fn new() -> Self {
        Self(Mutex::new(None))
    }

    fn set(&self, e: KernelError) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
    }

    fn into_result(self) -> Result<(), KernelError> {
        match self.0.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Working buffers a kernel's tasks hand on to the tasks after them: a task takes a set
/// (empty the first time), sizes it and gives it back, so that a call allocates and
/// zero-fills one set per task running at once instead of one per task (a 32x32 grid's
/// column matrix is 576 KiB per sample). What a task finds in them is stale: every element
/// it reads it has written first.
struct Spares<T>(Mutex<Vec<T>>);

impl<T: Default> Spares<T> {
    fn new() -> Self {
        Self(Mutex::new(Vec::new()))
    }

    fn take(&self) -> T {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).pop().unwrap_or_default()
    }

    fn give(&self, set: T) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(set);
    }
}

/// `dW` (`W`'s shape) from `x` (`X`) and `dy` (`dY`), all row-major; threads from `par`.
/// The buffers' lengths are checked first; the windows' tables and the column matrices are
/// allocated after that, fallibly.
pub fn weight_grad(
    dims: &ConvDims,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    weight_grad_at(detected(), dims, x, dy, dw, par)
}

/// [`weight_grad`] at SIMD level `level` (scalar where the CPU lacks it): the same bits at
/// every level.
pub fn weight_grad_at(
    level: Level,
    dims: &ConvDims,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    check_len("X", x.len(), &dims.x_shape())?;
    check_len("dY", dy.len(), &dims.y_shape())?;
    check_len("dW", dw.len(), &dims.w_shape())?;
    if dw.is_empty() {
        return Ok(());
    }
    if x.is_empty() || dy.is_empty() {
        // No samples, or an input grid of no element (every window reads padding).
        dw.fill(0.0);
        return Ok(());
    }
    let isa = level.isa().unwrap_or(Isa::Scalar);
    let windows = dims.windows()?;
    let (cg, mg, k) = (dims.cg(), dims.mg(), dims.k());
    let (p, il) = (dims.output_len, dims.input_len);
    let chunk = samples_per_chunk(dims);
    let mt = mg.div_ceil(MR);
    let ranges = blocks(dims);
    let panels = row_blocks(dims, ranges.len());
    let parts = sample_parts(dims, panels.len() * ranges.len());
    let padded = windows.pads_a_copy();
    let in_place = reads_in_place(isa, padded, mg, &panels);
    // dY packed once, shared by every task: per group, panels of `width` output channels
    // over every sample's output positions, q-major: the product's left operand (MR
    // channels, broadcast), or its right one (NR channels) where the column matrix is read
    // in place.
    let width = if in_place { NR } else { MR };
    let wt = mg.div_ceil(width);
    let panel_len = shape::mul("ConvWeightGrad's packed dY", dims.batch * p, width)?;
    let groups = dims.geo.group;
    let mut dyp = shape::zeroed::<f32>("ConvWeightGrad's packed dY", groups * wt * panel_len)?;
    let items: Vec<(usize, &mut [f32])> = dyp.chunks_mut(panel_len).enumerate().collect();
    for_each_item(par, items, |(idx, panel)| {
        let m0 = (idx / wt) * mg + (idx % wt) * width;
        let valid = width.min(mg - (idx % wt) * width);
        let mut rows: [&[f32]; NR] = [&[]; NR];
        for n in 0..dims.batch {
            for (i, row) in rows[..valid].iter_mut().enumerate() {
                *row = &dy[(n * dims.out_channels + m0 + i) * p..][..p];
            }
            fma_chain::pack_panel_at(isa, &rows[..valid], width, p, &mut panel[n * p * width..]);
        }
    });
    // The sample parts of a block innermost, in order, so that their partial blocks are
    // added in that order below.
    let mut tasks: Vec<WeightTask> = Vec::new();
    for g in 0..groups {
        for pr in &panels {
            for r in &ranges {
                tasks.extend(parts.iter().map(|s| (g, pr.clone(), r.clone(), s.clone())));
            }
        }
    }
    let results: Vec<Mutex<Vec<f32>>> = tasks.iter().map(|_| Mutex::new(Vec::new())).collect();
    // Read in place with the samples whole, each task writes its block straight into dW:
    // per output channel, the piece of its row under the task's columns (the blocks make
    // the rows' pieces in order). This skips a block per task and the copy into dW (on
    // layer4, dW is 9.4 MB and its reduction only 128 steps: the blocks' fresh pages and
    // the copy took a third of the time).
    let direct = in_place && parts.len() == 1;
    let mut cut: Vec<Vec<&mut [f32]>> = tasks.iter().map(|_| Vec::new()).collect();
    if direct {
        for (at, row) in dw.chunks_exact_mut(k).enumerate() {
            let (g, m) = (at / mg, at % mg);
            let pr = panels.iter().position(|pr| pr.contains(&(m / MR))).expect("the row blocks cover every channel");
            let mut rest = row;
            for (r, range) in ranges.iter().enumerate() {
                let (piece, tail) = rest.split_at_mut(range.len());
                rest = tail;
                cut[(g * panels.len() + pr) * ranges.len() + r].push(piece);
            }
        }
    }
    let pieces: Vec<Mutex<Vec<&mut [f32]>>> = cut.into_iter().map(Mutex::new).collect();
    let failed = FirstError::new();
    // The column matrix (only without the padded copy), the padded input and the right
    // operand's panels of a task.
    let spares = Spares::<[Vec<f32>; 3]>::new();
    let run = |t: usize| {
        let (g, panel_rows, rows, samples) = &tasks[t];
        if in_place {
            let task = (*g, panel_rows, rows, samples);
            let block = if direct {
                let mut cols = core::mem::take(&mut *pieces[t].lock().unwrap_or_else(|e| e.into_inner()));
                in_place_block(isa, dims, &windows, x, (&dyp, panel_len), task, &mut cols).map(|()| Vec::new())
            } else {
                // A sample part's block, in the lowered path's layout, added below.
                let ldt = rows.len().div_ceil(NR) * NR;
                shape::zeroed::<f32>("ConvWeightGrad's dW block", panel_rows.len() * MR * ldt).and_then(|mut block| {
                    let mut cols: Vec<&mut [f32]> = block.chunks_exact_mut(ldt).map(|r| &mut r[..rows.len()]).collect();
                    in_place_block(isa, dims, &windows, x, (&dyp, panel_len), task, &mut cols)?;
                    Ok(block)
                })
            };
            match block {
                Ok(block) => *results[t].lock().unwrap_or_else(|e| e.into_inner()) = block,
                Err(e) => failed.set(e),
            }
            return;
        }
        let pt = panel_rows.len();
        let nb = rows.len();
        let rt = nb.div_ceil(NR);
        let ldc = rt * NR;
        // dW_g's columns `rows` of the output channels in panels `panel_rows` (`[pt*MR x
        // nb]`, rows ldc apart) = dY_g * cols^T, both
        // operands contiguous along the reduction (every sample's output positions, in
        // order): the column matrix is lowered KC positions at a time straight into the
        // panels of `fma_chain`, whose every element is one fused chain over the whole
        // reduction. Every element of the block is written by the first product (`first`).
        let mut acc = match shape::zeroed::<f32>("ConvWeightGrad's dW block", pt * MR * ldc) {
            Ok(acc) => acc,
            Err(e) => return failed.set(e),
        };
        let [mut col, mut xp, mut bp] = spares.take();
        if let Err(e) = shape::resize(&mut bp, rt * KC * NR, "ConvWeightGrad's packed columns") {
            return failed.set(e);
        }
        if !padded {
            if let Err(e) = shape::resize(&mut col, nb * (chunk * p + ROW_PAD), "ConvWeightGrad's column matrix") {
                return failed.set(e);
            }
        }
        // The channels these rows read (row r is channel r / kernel_len of the group).
        let kl = dims.kernel_len;
        let (c0, c1) = (rows.start / kl, rows.end.div_ceil(kl));
        let mut first = true;
        let mut runs = Vec::new();
        for n0 in samples.clone().step_by(chunk) {
            let nc = chunk.min(samples.end - n0);
            let cols = nc * p;
            let ld = cols + ROW_PAD;
            xp.clear();
            for s in 0..nc {
                let start = ((n0 + s) * dims.channels + g * cg + c0) * il;
                if let Err(e) = windows.pad_into(&x[start..start + (c1 - c0) * il], &mut xp) {
                    return failed.set(e);
                }
            }
            if !padded {
                windows.im2col(&xp, nc, c0, rows.clone(), &mut col, ld);
            }
            for q0 in (0..cols).step_by(KC) {
                let kc = KC.min(cols - q0);
                let b = &mut bp[..rt * kc * NR];
                if padded {
                    windows.column_runs(xp.len() / nc, (q0, kc), &mut runs);
                    windows.im2col_panels(isa, &xp, (c0, rows.clone()), &runs, NR, b);
                } else {
                    for (t, panel) in b.chunks_exact_mut(kc * NR).enumerate() {
                        let src: Vec<&[f32]> =
                            (t * NR..nb.min((t + 1) * NR)).map(|i| &col[i * ld + q0..][..kc]).collect();
                        fma_chain::pack_panel(&src, NR, kc, panel);
                    }
                }
                let a = Panels {
                    data: &dyp,
                    mt: pt,
                    stride: panel_len,
                    offset: (g * mt + panel_rows.start) * panel_len + (n0 * p + q0) * MR,
                    step: MR,
                };
                fma_chain::product(isa, kc, a, b, Out { data: &mut acc, ld: ldc, first });
                first = false;
            }
        }
        spares.give([col, xp, bp]);
        *results[t].lock().unwrap_or_else(|e| e.into_inner()) = acc;
    };
    if tasks.len() == 1 {
        run(0);
    } else {
        par.run(tasks.len(), &run);
    }
    failed.into_result()?;
    if direct {
        return Ok(());
    }
    for ((g, panel_rows, rows, samples), block) in tasks.iter().zip(results) {
        let block = block.into_inner().unwrap_or_else(|e| e.into_inner());
        let ldc = rows.len().div_ceil(NR) * NR;
        let m0 = panel_rows.start * MR;
        for m in m0..mg.min(panel_rows.end * MR) {
            let dst = &mut dw[(g * mg + m) * k + rows.start..][..rows.len()];
            let src = &block[(m - m0) * ldc..][..rows.len()];
            if samples.start == 0 {
                dst.copy_from_slice(src);
            } else {
                // A later part of the samples: its partial sums added, parts in order.
                dst.iter_mut().zip(src).for_each(|(d, &v)| *d += v);
            }
        }
    }
    Ok(())
}

/// One task of a weight gradient: (group, panels of `MR` rows, columns of `dW_g`, samples).
type WeightTask = (usize, Range<usize>, Range<usize>, Range<usize>);

/// Whether a weight gradient reads its column matrix in place from the padded input
/// ([`fma_chain::product_rows`]) rather than lowering it into panels: at the AVX-512 level
/// (the lowering's gathers cost a fifth of resnet18's layer1 weight gradient, 64 output
/// channels, where each lowered element meets only 64 rows of dY), from the padded copy,
/// and where every row block is whole panels of [`NR`] output channels (dY is then the
/// right operand, [`NR`] channels a panel; a partial panel would spend lanes on nothing).
/// The same chains either way, so the same bits.
fn reads_in_place(isa: Isa, padded: bool, mg: usize, panels: &[Range<usize>]) -> bool {
    matches!(isa, Isa::Avx512(_)) && in_place_shapes(padded, mg, panels)
}

/// The shapes' half of [`reads_in_place`].
fn in_place_shapes(padded: bool, mg: usize, panels: &[Range<usize>]) -> bool {
    padded && mg.is_multiple_of(NR) && panels.iter().all(|pr| (pr.start * MR).is_multiple_of(NR))
}

/// One task's block of dW_g (the task's output channels, panels `panel_rows` of [`MR`], by
/// `rows` of dW_g's columns) into `out`, one slice of `rows.len()` per channel, computed as
/// its transpose with the column matrix read in place from each chunk's padded input:
/// `dW_g^T = cols * dY_g^T`, every element the same chain over the samples' output
/// positions as the lowered path's. `dyp`: dY packed in panels of [`NR`] channels,
/// `panel_len` apart.
fn in_place_block(
    isa: Isa,
    dims: &ConvDims,
    windows: &Windows,
    x: &[f32],
    (dyp, panel_len): (&[f32], usize),
    (g, panel_rows, rows, samples): (usize, &Range<usize>, &Range<usize>, &Range<usize>),
    out: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    let (cg, mg, p, il, kl) = (dims.cg(), dims.mg(), dims.output_len, dims.input_len, dims.kernel_len);
    let (ch0, ch1) = (panel_rows.start * MR, mg.min(panel_rows.end * MR));
    let (bt, ap) = ((ch1 - ch0) / NR, rows.len().div_ceil(MR));
    let ldc = bt * NR;
    let chunk = samples_per_chunk(dims);
    // The chains between blocks of the reduction, K-major (none when one block holds it
    // all, as on small grids).
    let steps = samples.clone().step_by(chunk).map(|n0| (chunk.min(samples.end - n0) * p).div_ceil(KC)).sum::<usize>();
    let held = if steps > 1 { ap * MR * ldc } else { 0 };
    let mut acc = shape::zeroed::<f32>("ConvWeightGrad's dW block", held)?;
    let (c0, c1) = (rows.start / kl, rows.end.div_ceil(kl));
    // Each panel's rows' places in a chunk's padded channels (rows past the block's end
    // read its first row: their results are thrown away).
    let bases: Vec<[usize; MR]> = (0..ap)
        .map(|a| {
            core::array::from_fn(|i| {
                let r = rows.start + a * MR + i;
                windows.row_offset(if r < rows.end { r } else { rows.start }, c0)
            })
        })
        .collect();
    let (mut xp, mut runs) = (Vec::new(), Vec::new());
    assert!(out.len() == ch1 - ch0 && out.iter().all(|c| c.len() == rows.len()), "ConvWeightGrad: a task's output");
    let mut first = true;
    for n0 in samples.clone().step_by(chunk) {
        let nc = chunk.min(samples.end - n0);
        xp.clear();
        for s in 0..nc {
            let start = ((n0 + s) * dims.channels + g * cg + c0) * il;
            windows.pad_into(&x[start..start + (c1 - c0) * il], &mut xp)?;
        }
        let per_sample = xp.len() / nc;
        for q0 in (0..nc * p).step_by(KC) {
            let kc = KC.min(nc * p - q0);
            windows.column_runs(per_sample, (q0, kc), &mut runs);
            let a = Rows { data: &xp, bases: &bases, runs: &runs, step: windows.last_stride() };
            // The last block of the reduction stores its chains transposed into `out`.
            let last = n0 + nc == samples.end && q0 + kc == nc * p;
            for tb in 0..bt {
                let panel = (g * mg.div_ceil(NR) + ch0 / NR + tb) * panel_len;
                let b = &dyp[panel + (n0 * p + q0) * NR..][..kc * NR];
                let to = last.then(|| Transposed { cols: &mut out[tb * NR..(tb + 1) * NR] });
                let held = if acc.is_empty() { &mut [][..] } else { &mut acc[tb * NR..] };
                fma_chain::product_rows(isa, a, b, Out { data: held, ld: ldc, first }, to);
            }
            first = false;
        }
    }
    Ok(())
}

/// Steps of the reduction (output positions) packed at a time: the right operand's panel
/// (`KC x NR`, 32 KiB) stays in the L1 cache while the left operand's panels stream past.
const KC: usize = 256;

/// `dX` (`X`'s shape) from `dy` (`dY`) and `w` (`W`), all row-major; threads from `par`.
/// The buffers' lengths are checked first; the windows' tables and the column matrices are
/// allocated after that, fallibly.
pub fn input_grad(
    dims: &ConvDims,
    dy: &[f32],
    w: &[f32],
    dx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    input_grad_at(detected(), dims, dy, w, dx, par)
}

/// [`input_grad`] at SIMD level `level` (scalar where the CPU lacks it): the same bits at
/// every level.
pub fn input_grad_at(
    level: Level,
    dims: &ConvDims,
    dy: &[f32],
    w: &[f32],
    dx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    check_len("dY", dy.len(), &dims.y_shape())?;
    check_len("W", w.len(), &dims.w_shape())?;
    check_len("dX", dx.len(), &dims.x_shape())?;
    if dx.is_empty() {
        return Ok(());
    }
    if dy.is_empty() || w.is_empty() {
        dx.fill(0.0);
        return Ok(());
    }
    let isa = level.isa().unwrap_or(Isa::Scalar);
    let windows = dims.windows()?;
    let (mg, k) = (dims.mg(), dims.k());
    let (p, il) = (dims.output_len, dims.input_len);
    let sample = dims.channels * il;
    let chunk = samples_per_chunk(dims);
    let groups = dims.geo.group;
    // The left operand, W_g^T: W's rows already hold MR consecutive columns of the column
    // matrix for each output channel (a panel's step is a row of W), so with few output
    // positions W is read in place, all but its last K % MR columns, packed (read in
    // place they would run past W's end). With many, every element of W serves enough
    // positions to repay a packed copy, whose steps are contiguous: resnet18's layer4 at
    // 128 positions, 85 -> 126 GFLOP/s in place; layer2 at 2048, 147 packed, 112 in place.
    let (kt, kfull, rem) = (k.div_ceil(MR), k / MR, k % MR);
    let pack_all = dims.batch * p >= PACK_W_FROM;
    let (first_packed, packed_cols) = if pack_all { (0, kt) } else { (kfull, usize::from(rem > 0)) };
    let panel_len = shape::mul("ConvInputGrad's packed W", mg, MR)?;
    let wlen = shape::mul("ConvInputGrad's packed W", groups * packed_cols, panel_len)?;
    let mut wp = shape::zeroed::<f32>("ConvInputGrad's packed W", wlen)?;
    for (idx, panel) in wp.chunks_exact_mut(panel_len).enumerate() {
        let (g, k0) = (idx / packed_cols, (first_packed + idx % packed_cols) * MR);
        for (m, lanes) in panel.chunks_exact_mut(MR).enumerate() {
            copy_lanes::<MR>(lanes, &w[(g * mg + m) * k + k0..], MR.min(k - k0));
        }
    }
    let failed = FirstError::new();
    // The column matrix (every element written by the first product before col2im reads
    // it), the dY block and the right operand's panels of an item.
    let spares = Spares::<[Vec<f32>; 3]>::new();
    // One item per chunk of samples and block of a group's input channels: their dX, one
    // slice per sample. A block's rows of the column matrix are whole panels of MR rows
    // around its channels' rows (a panel two blocks share is computed by both, the same
    // bits): each dX element still sums its channel's rows in order.
    let blocks = channel_blocks(dims);
    let mut items: Vec<InputGradItem<'_>> = Vec::new();
    for (chunk_index, dxc) in dx.chunks_mut(chunk * sample).enumerate() {
        let first = items.len();
        for g in 0..groups {
            items.extend(blocks.iter().map(|b| (chunk_index, g, b.clone(), Vec::new())));
        }
        for sample_dx in dxc.chunks_mut(sample) {
            let mut rest = sample_dx;
            for item in &mut items[first..] {
                let (piece, tail) = rest.split_at_mut(item.2.len() * il);
                item.3.push(piece);
                rest = tail;
            }
        }
    }
    for_each_item(par, items, |(chunk_index, g, Range { start: c0, end: c1 }, mut dxs)| {
        let (n0, nc) = (chunk_index * chunk, dxs.len());
        let cols = nc * p;
        let rt = cols.div_ceil(NR);
        let ldc = rt * NR;
        // The panels of K's rows (c, kernel position) that hold channels c0..c1.
        let (pa, pb) = ((c0 * dims.kernel_len) / MR, (c1 * dims.kernel_len).div_ceil(MR).min(kt));
        let [mut col, mut buf, mut bp] = spares.take();
        if let Err(e) = shape::resize(&mut col, (pb - pa) * MR * ldc, "ConvInputGrad's column matrix") {
            return failed.set(e);
        }
        if let Err(e) = shape::resize(&mut bp, rt * KC.min(mg) * NR, "ConvInputGrad's packed dY") {
            return failed.set(e);
        }
        // col = W_g^T dY_g: every element one fused chain over the output channels,
        // packed KC channels at a time (rows of the dY block, cut into NR columns).
        let (block, ld) = dy_block(dims, dy, g, n0, nc, &mut buf);
        let in_place = pa..pb.min(first_packed);
        let packed = pa.max(first_packed)..pb;
        for m0 in (0..mg).step_by(KC) {
            let kc = KC.min(mg - m0);
            let b = &mut bp[..rt * kc * NR];
            for (j, panel) in b.chunks_exact_mut(kc * NR).enumerate() {
                let (q0, valid) = (j * NR, NR.min(cols - j * NR));
                for (m, lanes) in panel.chunks_exact_mut(NR).enumerate() {
                    copy_lanes::<NR>(lanes, &block[(m0 + m) * ld + q0..], valid);
                }
            }
            let first = m0 == 0;
            if !in_place.is_empty() {
                let offset = (g * mg + m0) * k + in_place.start * MR;
                let a = Panels { data: w, mt: in_place.len(), stride: MR, offset, step: k };
                fma_chain::product(isa, kc, a, b, Out { data: &mut col, ld: ldc, first });
            }
            if !packed.is_empty() {
                let offset = (g * packed_cols + packed.start - first_packed) * panel_len + m0 * MR;
                let a = Panels { data: &wp, mt: packed.len(), stride: panel_len, offset, step: MR };
                let c = Out { data: &mut col[(packed.start - pa) * MR * ldc..], ld: ldc, first };
                fma_chain::product(isa, kc, a, b, c);
            }
        }
        let rows = &col[(c0 * dims.kernel_len - pa * MR) * ldc..];
        for (s, d) in dxs.iter_mut().enumerate() {
            d.fill(0.0);
            windows.col2im_add(rows, ldc, s * p, d);
        }
        spares.give([col, buf, bp]);
    });
    failed.into_result()
}

/// One task of the input gradient: (chunk of samples, group, block of the group's input
/// channels, that block's dX in each sample of the chunk).
type InputGradItem<'a> = (usize, usize, Range<usize>, Vec<&'a mut [f32]>);

/// Channels per block of a group's input channels for the input gradient (a function of
/// the shapes only): one block unless the chunks of samples make fewer than
/// [`TARGET_TASKS`] tasks; each block at least [`MIN_ROW_PANELS`] panels of the column
/// matrix's rows (each block packs dY's panels again).
fn channel_blocks(dims: &ConvDims) -> Vec<Range<usize>> {
    let (cg, kl) = (dims.cg(), dims.kernel_len.max(1));
    let chunks = dims.batch.div_ceil(samples_per_chunk(dims)) * dims.geo.group;
    let work = dims.batch.saturating_mul(dims.mg()).saturating_mul(dims.k()).saturating_mul(dims.output_len);
    let most = (cg * kl) / (MIN_ROW_PANELS * MR);
    let count = if work >= SPLIT_ABOVE { TARGET_TASKS.div_ceil(chunks.max(1)).min(most).max(1) } else { 1 };
    even(cg, count)
}

/// Output positions (samples x grid) from which the input gradient packs all of `W`.
const PACK_W_FROM: usize = 512;

/// `dst[..valid] = src[..valid]` (`dst` a panel row of `W` lanes): whole rows in
/// fixed-size moves (a `memcpy` call per 8 or 32 elements cost more than the copy).
fn copy_lanes<const W: usize>(dst: &mut [f32], src: &[f32], valid: usize) {
    match (<&mut [f32; W]>::try_from(&mut dst[..]), src.get(..W)) {
        (Ok(d), Some(s)) if valid == W => d.copy_from_slice(s),
        _ => dst[..valid].copy_from_slice(&src[..valid]),
    }
}

/// The specification as written: the six loops of the convolution's adjoint, in float64.
/// Each function returns the gradient and, per element, the sum of the absolute values of
/// its terms (for error bounds); tests only.
pub mod reference {
    use super::ConvDims;

    /// `(flat X index, flat W index, flat Y index)` of every term `W * X -> Y` of the
    /// convolution, padding excluded.
    fn terms(dims: &ConvDims, mut f: impl FnMut(usize, usize, usize)) {
        let win = dims.windows().expect("test shapes are small");
        let d = win.input().len();
        let (cg, mg) = (dims.cg(), dims.mg());
        let (p, il, kl) = (win.output_len(), win.input_len(), win.kernel_len());
        let unravel = |mut flat: usize, shape: &[usize]| {
            let mut idx = vec![0usize; shape.len()];
            for j in (0..shape.len()).rev() {
                idx[j] = flat % shape[j];
                flat /= shape[j];
            }
            idx
        };
        for n in 0..dims.batch {
            for m in 0..dims.out_channels {
                let g = m / mg;
                for op in 0..p {
                    let o = unravel(op, win.output());
                    for c in 0..cg {
                        for kk in 0..kl {
                            let kc = unravel(kk, win.kernel());
                            let mut flat = 0usize;
                            let mut inside = true;
                            for j in 0..d {
                                let i = (o[j] * win.strides()[j] + kc[j] * win.dilations()[j]) as isize
                                    - win.pads_begin()[j] as isize;
                                inside &= i >= 0 && i < win.input()[j] as isize;
                                flat = flat * win.input()[j] + i.max(0) as usize;
                            }
                            if inside {
                                let xi = (n * dims.channels + g * cg + c) * il + flat;
                                let wi = (m * cg + c) * kl + kk;
                                let yi = (n * dims.out_channels + m) * p + op;
                                f(xi, wi, yi);
                            }
                        }
                    }
                }
            }
        }
    }

    /// `dW` and its terms' absolute sums.
    pub fn weight_grad(dims: &ConvDims, x: &[f32], dy: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let len = dims.w_shape().iter().product();
        let (mut dw, mut mag) = (vec![0f64; len], vec![0f64; len]);
        terms(dims, |xi, wi, yi| {
            let t = f64::from(dy[yi]) * f64::from(x[xi]);
            dw[wi] += t;
            mag[wi] += t.abs();
        });
        (dw, mag)
    }

    /// `dX` and its terms' absolute sums.
    pub fn input_grad(dims: &ConvDims, dy: &[f32], w: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let len = dims.x_shape().iter().product();
        let (mut dx, mut mag) = (vec![0f64; len], vec![0f64; len]);
        terms(dims, |xi, wi, yi| {
            let t = f64::from(w[wi]) * f64::from(dy[yi]);
            dx[xi] += t;
            mag[xi] += t.abs();
        });
        (dx, mag)
    }

    /// The forward convolution `Y` (no bias), for adjoint checks.
    pub fn forward(dims: &ConvDims, x: &[f32], w: &[f32]) -> Vec<f64> {
        let mut y = vec![0f64; dims.y_shape().iter().product()];
        terms(dims, |xi, wi, yi| y[yi] += f64::from(w[wi]) * f64::from(x[xi]));
        y
    }
}

#[cfg(test)]
#[path = "conv_tests.rs"]
mod tests;

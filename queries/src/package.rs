//! The application package (`model.ipuexe`): everything a device needs to run a workload, and
//! nothing of the workload graph that a device may use to compute.
//!
//! A package holds, per tile, a memory image (initial segments, load-time zero fill, the
//! allocation map) whose code allocation is the tile's program: vertex records per compute
//! set and exchange tables (`image.rs`), which the device decodes from tile memory; the step
//! list and the phases' compiler figures; and the host tables that say where the host writes inputs
//! and weights and reads outputs and checkpoints. The workload text travels along so that a
//! package can be run and verified on its own: the runtime makes the input data from it and
//! the verifier computes the host reference from it, but the simulator never reads it.
//!
//! File layout: a 96-byte header (magic, format version, rkyv flags, payload length, blake3 of
//! the payload, target digest), then the rkyv payload, whose root sits at its end.

use crate::hash::Digest;
use crate::ir::DType;

pub const PACKAGE_MAGIC: [u8; 8] = *b"IPUQPKG\0";
/// Bump when the layout of anything below changes, or of the tile images it carries (v11: vertex
/// state shared by repeated compute sets, `image::encode_vertex_state`).
pub const PACKAGE_FORMAT_VERSION: u32 = 11;
/// rkyv's format flags this build writes (little endian, aligned, 32-bit offsets).
pub const RKYV_FLAGS: u32 = 0x0000_0001;
pub const HEADER_BYTES: usize = 96;

#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Package {
    /// "ipuq 0.1.0+<sources digest>": the compiler build that wrote it (`fingerprint.rs`).
    pub compiler: String,
    pub target_toml: String,
    pub target_digest: Digest,
    pub workload_name: String,
    pub workload_toml: String,
    pub tiles: Vec<TileImage>,
    /// Segment contents that tiles share (`TileImage::shared`): stored once in the package.
    pub shared_segments: Vec<Vec<u8>>,
    /// The BSP sequence the device executes.
    pub steps: Vec<Step>,
    /// The exchange phases the program has, with the compiler's figures for reports. Their
    /// tables are in the tile images only (`image.rs`): the device decodes them from there.
    pub phases: Vec<PhaseSummary>,
    pub host: HostTables,
    /// Interned labels for allocations (value names, "code", ...), for error messages.
    pub labels: Vec<String>,
    pub summary: Summary,
}

/// Compile-time facts the reports print beside the measured ones.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Summary {
    /// Operations that compute (views excluded).
    pub operations: u32,
    /// Tiles that run at least one vertex.
    pub active_tiles: u32,
    /// Floating-point operations of all matrix products (2 M K N summed).
    pub gemm_flops: u64,
    /// The compiler's own estimate of the run, from the target's cost formulas.
    pub estimated_cycles: u64,
    pub estimated_exchange_cycles: u64,
    pub logical_shards: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Step {
    /// Every tile runs its vertex calls of compute set `index`.
    Compute { index: u32 },
    /// Global sync, then exchange phase `phase`.
    Exchange { phase: u32 },
}

#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct TileImage {
    pub tile: u32,
    /// Bytes written at load time (code, vertex state, exchange tables, constants).
    pub segments: Vec<Segment>,
    /// Bytes written at load time from `Package::shared_segments` (after `segments`).
    pub shared: Vec<SharedSegment>,
    /// Ranges cleared to zero at load time.
    pub zero_fill: Vec<AddressRange>,
    /// Every allocated range; a vertex or exchange access outside them is an error. The one
    /// `Code` allocation holds the tile's program (runtime header, vertex state, exchange
    /// tables: `image.rs`), which the device decodes from the loaded bytes.
    pub allocations: Vec<Allocation>,
}

/// An exchange phase of the program: its index, and the compiler's horizon and endpoint bound
/// (reported; the device recomputes the horizon from the decoded tables).
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct PhaseSummary {
    pub index: u32,
    pub horizon: u32,
    pub endpoint_lower_bound: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Segment {
    pub address: u32,
    pub bytes: Vec<u8>,
}

/// `Package::shared_segments[index]`, written at `address`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct SharedSegment {
    pub address: u32,
    pub index: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct AddressRange {
    pub start: u32,
    pub end: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum AllocationKind {
    /// Code, vertex state and exchange tables: must lie below the instruction fetch limit.
    Code,
    /// Tensor data (f16 or f32), in either region.
    Data,
    /// AMP fp32 partials: interleaved memory, 16-byte aligned.
    Partials,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Allocation {
    pub start: u32,
    pub end: u32,
    pub kind: AllocationKind,
    /// Index into `Package::labels`.
    pub label: u32,
    /// The program steps (indices into `Package::steps`) over which the allocation is live,
    /// inclusive: written first at `first_step` (0 for host-written data), read last at
    /// `last_step` (`steps.len()` when the host reads it after the run). The device refills
    /// its bytes with NaN when its lifetime starts and rejects accesses outside it.
    pub first_step: u32,
    pub last_step: u32,
}

impl Allocation {
    /// Live at program step `step`.
    pub fn live_at(&self, step: u32) -> bool {
        self.first_step <= step && step <= self.last_step
    }
}

/// One tile's calls of one compute set (decoded from, or encoded into, its vertex state).
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ComputeSet {
    pub index: u32,
    pub calls: Vec<VertexCall>,
}

/// A 2-D strided operand: `rows` x `cols` elements, row r at `address + r * row_stride * bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Operand {
    pub address: u32,
    /// Elements between the starts of consecutive rows.
    pub row_stride: u32,
}

/// How an epilogue addend lines up with the rows x cols block a call writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Broadcast {
    /// One row of `cols` elements added to every row: a bias of a product in normal orientation.
    Row,
    /// One element per row, added across its row: a bias of a swapped product (Cᵀ = Bᵀ·Aᵀ).
    Column,
    /// A whole rows x cols block with its own row stride (an added host tensor).
    Full,
    /// One fp32 factor per row, multiplying its row (not added): the row reciprocals of a
    /// softmax whose normalisation is deferred to the product that consumes it. The operand is
    /// `rows` rows of one element each at its row stride (each factor in its own aligned slot).
    RowScale,
}

/// An epilogue addend (f16): what a product or the reduction finishing it adds to its fp32
/// result before rounding it to f16, so no separate add pass runs; with `Broadcast::RowScale`
/// an fp32 factor per row that multiplies the result instead (no separate normalise pass).
#[derive(Clone, Copy, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Addend<O> {
    pub operand: O,
    pub broadcast: Broadcast,
}

impl Broadcast {
    /// The addend's extent (rows, cols) for a call writing `rows` x `cols`.
    pub fn extent(self, rows: u32, cols: u32) -> (u32, u32) {
        match self {
            Broadcast::Row => (1, cols),
            Broadcast::Column => (1, rows),
            Broadcast::RowScale => (rows, 1),
            Broadcast::Full => (rows, cols),
        }
    }

    /// Bytes of one operand element: a row scale's factors are fp32, addends f16.
    pub fn element_bytes(self) -> u32 {
        match self {
            Broadcast::RowScale => 4,
            Broadcast::Row | Broadcast::Column | Broadcast::Full => 2,
        }
    }
}

/// One vertex (codelet) call. Every kernel works on `rows` x `cols` 2-D strided operands.
/// The compiler builds the same calls over address-free operands (`lower::Loc`) and maps them
/// to `Operand`s once storage is placed.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum VertexCall<O = Operand> {
    /// C[m x n] = A[m x k] . B[k x n] (or B given as [n x k] when `b_transposed`), f16 inputs,
    /// fp32 accumulation; C is f16, or fp32 partials when `partials`.
    /// `a_panel` = 0: A is row-major with `a.row_stride`. `a_panel` = w > 0: A is stored as
    /// ceil(k / w) contiguous panels of m rows x w columns (row stride `a.row_stride` >= w),
    /// panel p at `a.address + p * m * a.row_stride * 2`: the AMP's input-channel grouping, which
    /// lets a gathered block arrive in long contiguous runs. `c_panel` = w > 0: C is stored the
    /// same way, ceil(n / w) panels of m rows x w columns (the AMP's output-channel groups),
    /// panel p at `c.address + p * m * c.row_stride * element bytes`.
    /// `add`: an epilogue addend (a bias) added to the fp32 result before it is rounded to f16;
    /// never with `partials` (the reduction that finishes such a product adds it instead).
    MatMul { m: u32, k: u32, n: u32, a: O, a_panel: u32, b: O, b_transposed: bool, c: O, c_panel: u32, partials: bool, add: Option<Addend<O>> },
    /// out (f16) = sum of fp32 partial blocks, rows x cols each, plus the epilogue addend `add`.
    Reduce { rows: u32, cols: u32, parts: Vec<O>, out: O, add: Option<Addend<O>> },
    /// GELU (tanh approximation), f16.
    Gelu { rows: u32, cols: u32, input: O, output: O },
    /// output = input * factor, f16.
    Scale { rows: u32, cols: u32, factor: f32, input: O, output: O },
    /// output = a + b, f16.
    Add { rows: u32, cols: u32, a: O, b: O, output: O },
    /// Softmax over each row of `input * scale`, f16 in and out, fp32 arithmetic; the scaled
    /// input is rounded to f16 first, as a separate f16 scale pass would (`scale` = 1: plain).
    /// `input_panel` = 0: the input is row-major with `input.row_stride`. `input_panel` = w > 0:
    /// the input is stored as ceil(cols / w) contiguous panels of rows x w elements (row stride
    /// `input.row_stride` >= w), panel p at `input.address + p * rows * input.row_stride * 2`,
    /// as a panelled matrix-product operand is, except that a last panel narrower than w has
    /// its width rounded up to 4 elements as its row stride: rows gathered from cells w
    /// columns wide (and a narrower last cell) then arrive as one contiguous run per cell. The
    /// output is row-major.
    /// `reciprocals`: the normalisation is deferred to the consumer. The output then holds the
    /// unnormalised exp(x - max) and `reciprocals` (`rows` rows of one fp32 element at its row
    /// stride) 1 / sum per row; the exponential pass accumulates the sums, so no separate sum
    /// pass runs.
    Softmax { rows: u32, cols: u32, scale: f32, input: O, input_panel: u32, output: O, reciprocals: Option<O> },
    /// GELU, exact (erf), f16.
    GeluErf { rows: u32, cols: u32, input: O, output: O },
    /// output = input + bias, f16; `bias` is one row of `cols` elements added to every row.
    BiasAdd { rows: u32, cols: u32, input: O, bias: O, output: O },
    /// LayerNorm of each row of `cols` elements, f16 in and out, fp32 statistics:
    /// `(x - mean) / sqrt(var + eps) * gamma + beta`; `gamma` and `beta` are one row each.
    LayerNorm { rows: u32, cols: u32, eps: f32, input: O, gamma: O, beta: O, output: O },
    /// Local copy of rows x cols elements of `dtype`, 64 bits at a time: every row of both
    /// operands starts on the target's data alignment.
    Copy { rows: u32, cols: u32, dtype: DType, input: O, output: O },
    /// Local copy of rows x cols elements of `dtype`, one 32-bit word at a time: for blocks
    /// whose rows start on a word but not on the data alignment (an attention head 2 mod 4
    /// f16 elements wide inside a row). Each row of both operands starts on a 4-byte boundary
    /// and holds whole words.
    CopyWords { rows: u32, cols: u32, dtype: DType, input: O, output: O },
    /// Local copy of rows x cols f16 elements, one element at a time: for blocks whose rows
    /// start or end inside a 32-bit word (an attention head of an odd width inside a row, or
    /// taken from the words the exchange moved into a staging buffer).
    CopyHalves { rows: u32, cols: u32, input: O, output: O },
    /// Local transpose, f16: `input` is rows x cols (row stride `input.row_stride`), `output`
    /// cols x rows (row stride `output.row_stride`), output[c][r] = input[r][c].
    Transpose { rows: u32, cols: u32, input: O, output: O },
    /// The statistics of each row of one segment of a LayerNorm's input (`rows` x `cols` f16,
    /// some of the rows' columns): `statistics` gets `rows` rows of four fp32 elements at its
    /// row stride: the segment's element count, its mean and its sum of squared deviations
    /// from that mean (two passes in fp32, as `LayerNorm`'s), and 0. The statistics of a row's
    /// segments, merged, are the row's (`LayerNormSegment`).
    LayerNormStatistics { rows: u32, cols: u32, input: O, statistics: O },
    /// LayerNorm of segment `segment` of each row from the statistics of all `segments` segments
    /// of those rows: its own in `statistics` (`rows` rows of 4 fp32 elements at the row
    /// stride, as `LayerNormStatistics` writes them) and the others' in `others`: `segments - 1`
    /// blocks of `rows` such rows in segment order without this one, block q at
    /// `others.address + q * rows * others.row_stride * 4` (two operands, so that the tile
    /// receives the others' statistics into another buffer than the one it sends its own
    /// from). They are merged in segment order (the pairwise update of Chan, Golub and
    /// LeVeque: counts add, means combine by weight, the sums of squared deviations add with
    /// n_a n_b / n (mean_b - mean_a)^2), then this segment's `cols` columns are normalised:
    /// `(x - mean) / sqrt(var + eps) * gamma + beta`, `gamma` and `beta` this segment's columns.
    LayerNormSegment { rows: u32, cols: u32, segments: u32, segment: u32, eps: f32, input: O, statistics: O, others: O, gamma: O, beta: O, output: O },
}

impl<O> VertexCall<O> {
    /// The same call over other operands (placement turns `Loc`s into `Operand`s).
    pub fn map<P>(&self, mut f: impl FnMut(&O) -> P) -> VertexCall<P> {
        match self {
            VertexCall::MatMul { m, k, n, a, a_panel, b, b_transposed, c, c_panel, partials, add } => {
                let (a, b, c) = (f(a), f(b), f(c));
                let add = add.as_ref().map(|x| Addend { operand: f(&x.operand), broadcast: x.broadcast });
                VertexCall::MatMul { m: *m, k: *k, n: *n, a, a_panel: *a_panel, b, b_transposed: *b_transposed, c, c_panel: *c_panel, partials: *partials, add }
            }
            VertexCall::Reduce { rows, cols, parts, out, add } => {
                let parts = parts.iter().map(&mut f).collect();
                let out = f(out);
                let add = add.as_ref().map(|x| Addend { operand: f(&x.operand), broadcast: x.broadcast });
                VertexCall::Reduce { rows: *rows, cols: *cols, parts, out, add }
            }
            VertexCall::Gelu { rows, cols, input, output } => VertexCall::Gelu { rows: *rows, cols: *cols, input: f(input), output: f(output) },
            VertexCall::Scale { rows, cols, factor, input, output } => VertexCall::Scale { rows: *rows, cols: *cols, factor: *factor, input: f(input), output: f(output) },
            VertexCall::Add { rows, cols, a, b, output } => VertexCall::Add { rows: *rows, cols: *cols, a: f(a), b: f(b), output: f(output) },
            VertexCall::Softmax { rows, cols, scale, input, input_panel, output, reciprocals } => {
                let (input, output) = (f(input), f(output));
                VertexCall::Softmax { rows: *rows, cols: *cols, scale: *scale, input, input_panel: *input_panel, output, reciprocals: reciprocals.as_ref().map(&mut f) }
            }
            VertexCall::GeluErf { rows, cols, input, output } => VertexCall::GeluErf { rows: *rows, cols: *cols, input: f(input), output: f(output) },
            VertexCall::BiasAdd { rows, cols, input, bias, output } => VertexCall::BiasAdd { rows: *rows, cols: *cols, input: f(input), bias: f(bias), output: f(output) },
            VertexCall::LayerNorm { rows, cols, eps, input, gamma, beta, output } => {
                VertexCall::LayerNorm { rows: *rows, cols: *cols, eps: *eps, input: f(input), gamma: f(gamma), beta: f(beta), output: f(output) }
            }
            VertexCall::LayerNormStatistics { rows, cols, input, statistics } => VertexCall::LayerNormStatistics { rows: *rows, cols: *cols, input: f(input), statistics: f(statistics) },
            VertexCall::LayerNormSegment { rows, cols, segments, segment, eps, input, statistics, others, gamma, beta, output } => {
                let (input, statistics, others, gamma, beta, output) = (f(input), f(statistics), f(others), f(gamma), f(beta), f(output));
                VertexCall::LayerNormSegment { rows: *rows, cols: *cols, segments: *segments, segment: *segment, eps: *eps, input, statistics, others, gamma, beta, output }
            }
            VertexCall::Copy { rows, cols, dtype, input, output } => VertexCall::Copy { rows: *rows, cols: *cols, dtype: *dtype, input: f(input), output: f(output) },
            VertexCall::CopyWords { rows, cols, dtype, input, output } => VertexCall::CopyWords { rows: *rows, cols: *cols, dtype: *dtype, input: f(input), output: f(output) },
            VertexCall::CopyHalves { rows, cols, input, output } => VertexCall::CopyHalves { rows: *rows, cols: *cols, input: f(input), output: f(output) },
            VertexCall::Transpose { rows, cols, input, output } => VertexCall::Transpose { rows: *rows, cols: *cols, input: f(input), output: f(output) },
        }
    }

    /// The vertex's name, as the simulator's errors and `ipuq inspect` print it.
    pub fn kind_name(&self) -> &'static str {
        match self {
            VertexCall::MatMul { .. } => "MatMul",
            VertexCall::Reduce { .. } => "Reduce",
            VertexCall::Gelu { .. } => "Gelu",
            VertexCall::Scale { .. } => "Scale",
            VertexCall::Add { .. } => "Add",
            VertexCall::Softmax { .. } => "Softmax",
            VertexCall::GeluErf { .. } => "GeluErf",
            VertexCall::BiasAdd { .. } => "BiasAdd",
            VertexCall::LayerNorm { .. } => "LayerNorm",
            VertexCall::LayerNormStatistics { .. } => "LayerNormStatistics",
            VertexCall::LayerNormSegment { .. } => "LayerNormSegment",
            VertexCall::Copy { .. } => "Copy",
            VertexCall::CopyWords { .. } => "CopyWords",
            VertexCall::CopyHalves { .. } => "CopyHalves",
            VertexCall::Transpose { .. } => "Transpose",
        }
    }

    /// Every operand the call reads or writes.
    pub fn operands(&self) -> Vec<&O> {
        match self {
            VertexCall::MatMul { a, b, c, add, .. } => [a, b, c].into_iter().chain(add.as_ref().map(|x| &x.operand)).collect(),
            VertexCall::Reduce { parts, out, add, .. } => parts.iter().chain([out]).chain(add.as_ref().map(|x| &x.operand)).collect(),
            VertexCall::Gelu { input, output, .. } | VertexCall::Scale { input, output, .. } | VertexCall::Copy { input, output, .. } | VertexCall::CopyWords { input, output, .. } | VertexCall::CopyHalves { input, output, .. } | VertexCall::Transpose { input, output, .. } => vec![input, output],
            VertexCall::Softmax { input, output, reciprocals, .. } => [input, output].into_iter().chain(reciprocals.as_ref()).collect(),
            VertexCall::Add { a, b, output, .. } => vec![a, b, output],
            VertexCall::GeluErf { input, output, .. } => vec![input, output],
            VertexCall::BiasAdd { input, bias, output, .. } => vec![input, bias, output],
            VertexCall::LayerNorm { input, gamma, beta, output, .. } => vec![input, gamma, beta, output],
            VertexCall::LayerNormStatistics { input, statistics, .. } => vec![input, statistics],
            VertexCall::LayerNormSegment { input, statistics, others, gamma, beta, output, .. } => vec![input, statistics, others, gamma, beta, output],
        }
    }
}

#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ExchangePhase {
    pub index: u32,
    /// Per-tile tables, sorted by tile; tiles with nothing to do are absent.
    pub tiles: Vec<TileExchange>,
    /// The compiler's horizon (the device recomputes it from the tables).
    pub horizon: u32,
    pub endpoint_lower_bound: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct TileExchange {
    pub tile: u32,
    /// Sorted by cycle.
    pub sends: Vec<SendEntry>,
    /// Sorted by cycle.
    pub receives: Vec<ReceiveEntry>,
}

/// Send `words` 32-bit words from `address` on consecutive cycles starting at `cycle`.
/// Paired: two words per cycle (`words` even, 8-byte aligned) using this tile's and its
/// supertile partner's send ports, for `words / 2` cycles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct SendEntry {
    pub cycle: u32,
    pub address: u32,
    pub words: u32,
    pub paired: bool,
}

/// Point the incoming mux at `source` from `cycle` (the arrival cycle: the source's send cycle
/// plus the route delay) and store `words` words at `address`. Paired: two words per cycle,
/// occupying the partner's receive port too unless the partner receives the same words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ReceiveEntry {
    pub cycle: u32,
    pub source: u32,
    pub address: u32,
    pub words: u32,
    pub paired: bool,
}

#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct HostTables {
    /// Written by the "initialize" call, in this order.
    pub inputs: Vec<HostTensor>,
    /// Exchange phases (indices into `Package::exchanges`) the "initialize" call runs after
    /// the host writes: weights cross the host link once and are replicated on the device.
    pub initialize: Vec<u32>,
    /// Read after the "run" call.
    pub outputs: Vec<HostTensor>,
    /// Intermediate values that can be read right after the step that completes them.
    pub checkpoints: Vec<Checkpoint>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum HostRole {
    Input,
    Weight,
    Output,
    Intermediate,
}

/// A tensor as the host sees it: where each run of its elements (row-major logical order)
/// lives. An input element may live on several tiles (replicas); each is written.
/// The compiler builds the same tables over address-free segments (`lower::LSegment`).
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct HostTensor<S = HostSegment> {
    pub name: String,
    pub shape: Vec<u32>,
    pub dtype: DType,
    pub role: HostRole,
    pub segments: Vec<S>,
}

impl<S> HostTensor<S> {
    /// The same tensor over other segments (placement turns `LSegment`s into `HostSegment`s).
    pub fn map<T>(&self, f: impl FnMut(&S) -> T) -> HostTensor<T> {
        HostTensor { name: self.name.clone(), shape: self.shape.clone(), dtype: self.dtype, role: self.role, segments: self.segments.iter().map(f).collect() }
    }
}

/// `rows` runs of `count` logical elements: run r starts at flat index
/// `element + r * element_stride`, its elements lie `element_step` apart in the host's
/// row-major tensor (1: consecutive), and the run is stored contiguously at
/// `address + r * address_stride` on `tile`. A column block of a row-major tensor is one
/// segment, not one per row; a block of a transposed view is one too (step = the base
/// tensor's columns): the host transposes it as it streams, so tile memory gets whole rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct HostSegment {
    pub tile: u32,
    pub address: u32,
    pub element: u32,
    pub count: u32,
    pub rows: u32,
    pub element_stride: u32,
    pub address_stride: u32,
    pub element_step: u32,
}

impl HostSegment {
    /// Flat index of the `i`-th element of run `r`.
    pub fn element_at(&self, r: u32, i: u32) -> u64 {
        self.element as u64 + r as u64 * self.element_stride as u64 + i as u64 * self.element_step as u64
    }

    /// Whether this one-row segment holds flat index `index`, and at which position.
    pub fn position_of(&self, index: u64) -> Option<u32> {
        let start = self.element as u64;
        let step = self.element_step.max(1) as u64;
        if index < start || (index - start) % step != 0 || (index - start) / step >= self.count as u64 {
            return None;
        }
        Some(((index - start) / step) as u32)
    }
}

impl HostTensor {
    /// Every run of every segment as a one-row segment, in segment order.
    pub fn runs(&self) -> Vec<HostSegment> {
        let mut out = Vec::with_capacity(self.segments.len());
        for s in &self.segments {
            for r in 0..s.rows {
                out.push(HostSegment {
                    tile: s.tile,
                    address: s.address + r * s.address_stride,
                    element: s.element + r * s.element_stride,
                    count: s.count,
                    rows: 1,
                    element_stride: 0,
                    address_stride: 0,
                    element_step: s.element_step,
                });
            }
        }
        out
    }

    /// Elements written or read in all, replicas included.
    pub fn streamed_elements(&self) -> u64 {
        self.segments.iter().map(|s| s.count as u64 * s.rows as u64).sum()
    }
}

#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Checkpoint<S = HostSegment> {
    /// Index of the operation (in workload order) that produced the value.
    pub operation: u32,
    /// Index into `Package::steps`: the value is complete after this step.
    pub after_step: u32,
    pub tensor: HostTensor<S>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PackageError {
    #[error("{origin}: not an ipuq package (bad magic)")]
    BadMagic { origin: String },
    #[error("{origin}: package format v{found}, this ipuq reads v{expected}")]
    Version { origin: String, found: u32, expected: u32 },
    #[error("{origin}: package written with rkyv flags {found:#x}, this ipuq uses {expected:#x}")]
    Flags { origin: String, found: u32, expected: u32 },
    #[error("{origin}: truncated package: {message}")]
    Truncated { origin: String, message: String },
    #[error("{origin}: damaged package: payload checksum mismatch")]
    Checksum { origin: String },
    #[error("{origin}: damaged package: {message}")]
    Decode { origin: String, message: String },
    #[error("{origin}: package was compiled for target {found}, not {expected}")]
    Target { origin: String, found: String, expected: String },
}

impl Package {
    /// Serialise with header; deterministic for equal packages.
    pub fn to_bytes(&self) -> Vec<u8> {
        let payload = rkyv::to_bytes::<rkyv::rancor::Error>(self).expect("rkyv serialisation of a package cannot fail");
        Package::frame(&payload, &self.target_digest.0)
    }

    /// The package file around an archived payload: magic, format version, archive flags,
    /// payload length and checksum, target digest, padding to the header size, payload. Fuzz
    /// harnesses frame mutated payloads with it so they reach the decoder.
    pub fn frame(payload: &[u8], target_digest: &[u8; 32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
        out.extend_from_slice(&Package::header(payload, target_digest));
        out.extend_from_slice(payload);
        out
    }

    /// The header `frame` puts before `payload`.
    pub fn header(payload: &[u8], target_digest: &[u8; 32]) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        let checksum = blake3::hash(payload);
        let fields: [&[u8]; 6] = [&PACKAGE_MAGIC, &PACKAGE_FORMAT_VERSION.to_le_bytes(), &RKYV_FLAGS.to_le_bytes(), &(payload.len() as u64).to_le_bytes(), checksum.as_bytes(), target_digest];
        let mut at = 0;
        for field in fields {
            out[at..at + field.len()].copy_from_slice(field);
            at += field.len();
        }
        out
    }

    /// This package's archived payload, serialised into `payload` (emptied first, its
    /// capacity kept: a process that writes package after package, `ipuq watch`, writes each
    /// into memory it already has, instead of faulting in fresh pages for a buffer and for the
    /// framed copy), and the header that goes before it. Header then payload are the bytes
    /// `to_bytes` gives.
    pub fn serialize_into(&self, payload: &mut rkyv::util::AlignedVec) -> [u8; HEADER_BYTES] {
        let mut buffer = std::mem::replace(payload, rkyv::util::AlignedVec::new());
        buffer.clear();
        *payload = rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(self, buffer).expect("rkyv serialisation of a package cannot fail");
        Package::header(payload, &self.target_digest.0)
    }

    /// Check header, length and checksum, validate the archive, and decode.
    pub fn from_bytes(bytes: &[u8], origin: &str) -> Result<Package, PackageError> {
        let origin_s = || origin.to_string();
        if bytes.len() < 8 || bytes[..8] != PACKAGE_MAGIC {
            return Err(PackageError::BadMagic { origin: origin_s() });
        }
        if bytes.len() < HEADER_BYTES {
            return Err(PackageError::Truncated { origin: origin_s(), message: format!("{} bytes, shorter than the {HEADER_BYTES}-byte header", bytes.len()) });
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let version = u32_at(8);
        if version != PACKAGE_FORMAT_VERSION {
            return Err(PackageError::Version { origin: origin_s(), found: version, expected: PACKAGE_FORMAT_VERSION });
        }
        let flags = u32_at(12);
        if flags != RKYV_FLAGS {
            return Err(PackageError::Flags { origin: origin_s(), found: flags, expected: RKYV_FLAGS });
        }
        let length = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
        let payload = &bytes[HEADER_BYTES..];
        if payload.len() != length {
            return Err(PackageError::Truncated { origin: origin_s(), message: format!("header says {length} payload bytes, file has {}", payload.len()) });
        }
        if blake3::hash(payload).as_bytes()[..] != bytes[24..56] {
            return Err(PackageError::Checksum { origin: origin_s() });
        }
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(payload.len());
        aligned.extend_from_slice(payload);
        let package = rkyv::from_bytes::<Package, rkyv::rancor::Error>(&aligned)
            .map_err(|e| PackageError::Decode { origin: origin_s(), message: e.to_string() })?;
        if package.target_digest.0[..] != bytes[56..88] {
            return Err(PackageError::Decode { origin: origin_s(), message: "header and payload disagree on the target".into() });
        }
        Ok(package)
    }

    pub fn tile_count(&self) -> u32 {
        self.tiles.len() as u32
    }
}

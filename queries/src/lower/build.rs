//! The lowering builder: plans each operation in program order, gathers operand blocks onto
//! the tiles that need them (host segments, exchange transfers, local copies or aliases), and
//! records the BSP steps, vertex calls and buffer lifetimes.
//!
//! This file is long (about 2000 lines) because gathering, planning glue and step bookkeeping
//! share one builder state; each part is a method with one job.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Arc;

use tracing::debug;

use super::grid::{block_elements_stored, offset_in_block, row_stride, split, Grid, ViewChain};
use super::chunked::Chunked;
use super::orient::Oriented;
use super::peaks::{PeakCache, Watch};
use super::candidates;
use super::plan::{column_reduction, MatMulPlan, MatMulProblem};
use super::{BufferDecl, Call, LCheckpoint, LHostTensor, LSegment, LStep, Loc, Lowered, OperationPlan, Transfer};
use crate::cost;
use crate::ir::{split3, DType, Graph, OpKind, Producer, Role, Value, ValueId};
use crate::package::{Addend, AllocationKind, Broadcast, HostRole};
use crate::target::Target;

/// Bytes per tile the planner leaves for code, vertex state and exchange tables.
pub const CODE_RESERVE_BYTES: u64 = 48 * 1024;

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum LowerError {
    #[error("operation '{operation}': no {kind} plan fits in tile memory ({budget} bytes per tile) on {tiles} tiles{}", .least.map_or(String::new(), |n| format!("; the smallest needs {n} bytes per tile")))]
    NoPlan { operation: String, kind: String, budget: u64, tiles: u32, least: Option<u64> },
    #[error("operation '{operation}': moving value '{value}' needs sub-word transfers (element offset {offset} of a {dtype} row); ipuq moves whole 32-bit words")]
    SubWord { operation: String, value: String, offset: u32, dtype: &'static str },
    #[error("output '{output}' is a view of input '{input}': no operation computes it")]
    OutputIsInput { output: String, input: String },
    #[error("operation '{operation}': {message}")]
    Unsupported { operation: String, message: String },
    #[error("operation '{operation}': plan constraint cannot be honoured: {reason}")]
    Constraint { operation: String, reason: String },
    #[error("the host writes {host} bytes of weights and inputs before the run (one copy of each; the largest, '{largest}', {largest_bytes} bytes), but every one of the {tiles} tiles holds at most {per_tile} bytes of them, in the memory the loader writes ({base:#x} to {limit:#x}) less its {header}-byte runtime header: {room} bytes on the chip, {short} bytes too few: no program fits; weights this large need streaming from the host during the run, which ipuq does not do")]
    HostBytes { host: u64, largest: String, largest_bytes: u64, tiles: u32, per_tile: u32, base: u32, limit: u32, header: u32, room: u64, short: u64 },
}

/// An add folded into a product's epilogue (see `elementwise::folded_add`): the add's
/// operation index, the host tensor added, and how it lines up with the product's output.
#[derive(Clone, Copy)]
struct Epilogue {
    add: usize,
    addend: ValueId,
    broadcast: Broadcast,
}

/// A place in tile memory before addresses exist: (buffer, byte offset).
type Place = (u32, u32);

#[derive(Clone)]
struct Stored {
    grid: Grid,
    dtype: DType,
}

/// An operand block held on one tile: a buffer and the block of the viewed value it stores.
/// `panel` = 0: row-major (last axis padded); `panel` = w: each leading index holds
/// ceil(cols / w) contiguous panels of rows x w (see `VertexCall::MatMul`).
/// `tight_last`: a last panel narrower than w is stored with its own row stride (its width
/// rounded up to whole 8-byte rows) instead of w, as a softmax input is (see
/// `VertexCall::Softmax`), so that the rows of a narrower source cell arrive as one run too.
struct Held {
    buffer: u32,
    block: Vec<(u32, u32)>,
    dtype: DType,
    panel: u32,
    tight_last: bool,
}

impl Held {
    fn plain(buffer: u32, block: Vec<(u32, u32)>, dtype: DType) -> Held {
        Held { buffer, block, dtype, panel: 0, tight_last: false }
    }

    /// Row stride (elements) of the last panel of a panelled block.
    fn last_panel_stride(&self) -> u32 {
        let cols = self.block[self.block.len() - 1];
        let rest = (cols.1 - cols.0) % self.panel.max(1);
        if self.tight_last && rest > 0 {
            row_stride(rest, self.dtype)
        } else {
            self.panel
        }
    }

    fn loc(&self, index: &[u32]) -> Loc {
        let rank = self.block.len();
        let cols = self.block[rank - 1];
        if self.panel == 0 {
            return Loc { buffer: self.buffer, offset: offset_in_block(&self.block, index, self.dtype), row_stride: row_stride(cols.1 - cols.0, self.dtype), dtype_bytes: self.dtype.bytes() };
        }
        let w = self.panel;
        let rows = self.block[rank - 2].1 - self.block[rank - 2].0;
        let r = index[rank - 2] - self.block[rank - 2].0;
        let batch = if rank == 3 { index[0] - self.block[0].0 } else { 0 };
        // Whole panels and the last one's width; the panel holding the column, and the column in it.
        let (full, rest) = ((cols.1 - cols.0) / w, (cols.1 - cols.0) % w);
        let (panel, c) = ((index[rank - 1] - cols.0) / w, (index[rank - 1] - cols.0) % w);
        let last = match rest {
            0 => 0,
            rest if self.tight_last => row_stride(rest, self.dtype),
            _ => w,
        };
        let per_batch = full * rows * w + rows * last;
        let stride = if panel == full { last } else { w };
        let offset = batch * per_batch + panel * rows * w + r * stride + c;
        Loc { buffer: self.buffer, offset, row_stride: w, dtype_bytes: self.dtype.bytes() }
    }

    fn stored_elements(&self) -> u64 {
        if self.panel == 0 {
            return block_elements_stored(&self.block, self.dtype);
        }
        let rank = self.block.len();
        let lead: u64 = self.block[..rank - 1].iter().map(|r| (r.1 - r.0) as u64).product();
        let cols = self.block[rank - 1].1 - self.block[rank - 1].0;
        let last = if cols % self.panel > 0 { self.last_panel_stride() } else { 0 };
        lead * (cols / self.panel * self.panel + last) as u64
    }

    /// Whether column `c` (absolute) ends a stored row: the block's end or a panel's end.
    fn row_ends_at(&self, c: u32) -> bool {
        let cols = self.block[self.block.len() - 1];
        c == cols.1 || (self.panel > 0 && (c - cols.0).is_multiple_of(self.panel))
    }
}

#[derive(Clone)]
struct LocalCopy {
    rows: u32,
    cols: u32,
    src: Loc,
    dst: Loc,
    /// How it moves: 64 bits at a time, one 32-bit word at a time (`CopyWords`: a row starts
    /// on a word but not on the data alignment), or one f16 element at a time (`CopyHalves`:
    /// a row starts or ends inside a word).
    granule: Granule,
}

/// What a local copy moves at a time, coarsest first (`LocalCopy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Granule {
    Doubles,
    Words,
    Halves,
}

impl Granule {
    /// The coarsest granule a copy of `len` bytes between byte offsets `src` and `dst` can
    /// use (`align`: the data alignment), if any: halves need 2-byte elements.
    fn of(src: u32, dst: u32, len: u32, align: u32, element_bytes: u32) -> Option<Granule> {
        let all = |m: u32| src.is_multiple_of(m) && dst.is_multiple_of(m) && len.is_multiple_of(m.min(4));
        if src.is_multiple_of(align) && dst.is_multiple_of(align) {
            Some(Granule::Doubles)
        } else if all(4) {
            Some(Granule::Words)
        } else if element_bytes == 2 {
            Some(Granule::Halves)
        } else {
            None
        }
    }
}

struct Builder<'a> {
    graph: &'a Graph,
    target: &'a Target,
    labels: Labels,
    buffers: Buffers,
    steps: Vec<LStep>,
    compute_sets: Vec<Arc<Vec<(u32, Call)>>>,
    phases: Vec<Arc<Vec<Transfer>>>,
    phase_plans: Vec<u32>,
    stored: BTreeMap<ValueId, Arc<Stored>>,
    host: BTreeMap<ValueId, Arc<LHostTensor>>,
    /// Word moves of the exchange phase being gathered.
    pending: Moves,
    copies: Vec<LocalCopy>,
    plans: Plans,
    checkpoints: Vec<Arc<LCheckpoint>>,
    gemm_flops: u64,
    operation_name: String,
    /// Keep each matrix-product weight block once on a home tile and multicast it to the other
    /// row partitions when needed, instead of having the host write every replica, for the
    /// products whose original operation index is at least this (0: every product; usize::MAX:
    /// none, every weight replicated). Chosen when replicated weights, all resident from the
    /// start, would not fit: the earlier products' weights stay replicated (a mixed program).
    home_from: usize,
    /// Spreads home tiles of successive operations over the row partitions.
    home_rotation: usize,
    /// Home tiles follow the weight's place in the program's repeating period of weights
    /// (`aligned_home_slot`), so that repeated blocks multicast from the same tiles and share
    /// exchange patterns; else they rotate with every weight (less memory on the fullest tile).
    home_aligned: bool,
    /// With homes not aligned: each weight block rotates with the repetition of the program's
    /// period its weight belongs to (`period_home_slot`), so a block of the r-th repeat sits
    /// r row partitions on from the first repeat's: homes spread over the row partitions as
    /// the repeats go, and repeats a whole number of row partitions apart share their
    /// multicast patterns (and so their schedules and exchange tables). Else each block goes
    /// to the least-loaded tile of its row partitions.
    home_period: bool,
    /// With `home_period`: the row partition each weight block's first repeat is homed on
    /// (keyed by the weight's slot, its product's row partitions and cells, and the cell), so
    /// later repeats of the block rotate on from it.
    home_bases: Arc<BTreeMap<(usize, usize, usize, usize), usize>>,
    /// With rotating homes (not `home_aligned`): the bytes of weight blocks homed on each tile
    /// so far (indexed by tile, grown as needed), so each block goes to the least-loaded tile
    /// of its row partitions (`home_weight`).
    home_load: Arc<Vec<u64>>,
    /// The most replicas a replicated rank-2 weight may have: a normal product's B block is
    /// replicated on its row partitions, a swapped product's A block (the weight) on its
    /// column partitions (u32::MAX: no cap). Chosen when replicated weights at the planner's
    /// own partitions do not fit: fewer replicas, every weight still resident where it is read
    /// (`Partial::replication_capped`).
    replication_cap: u32,
    /// The most bytes a matrix product's A block or B block may take on a tile (u64::MAX: no
    /// cap). Set only by the planner's last resort (`fit_block_capped` in `search.rs`,
    /// `Partial::block_capped`), when no program of the beam fits in any weight arrangement.
    block_cap: u64,
    /// Per operation index: bytes per tile that other operations keep live while it runs
    /// (total, and in interleaved memory), from an earlier lowering of the whole program.
    reserves: &'a [Reserve],
    /// Per operation: the original operation it computes; stored swapped value -> its view.
    origin: &'a [u32],
    checkpoint_value: &'a BTreeMap<ValueId, ValueId>,
    row_read: &'a std::collections::BTreeSet<ValueId>,
    /// The operation being lowered, and the owner of each buffer.
    operation_index: usize,
    owners: Owners,
    /// Per operation index: the first and last step it uses.
    spans: BTreeMap<u32, (u32, u32)>,
    interleaved_weights: std::collections::BTreeSet<u32>,
    /// Blocks of computed values already gathered by exchange onto a tile: a later consumer
    /// of the same block there (Q, K and V of one LayerNorm output) reads that buffer instead
    /// of receiving the words again. Values are never overwritten, so the buffer stays valid;
    /// its lifetime grows to the last reader.
    gathered: Gathered,
    /// The pieces of stored blocks gathered since the last value was stored, by block: the
    /// tiles of a product that share an operand block gather the same pieces, found once
    /// (mapping every row through the value's views to its source cells) and laid again onto
    /// each tile's buffer.
    block_pieces: std::collections::HashMap<PieceKey, Arc<Vec<GatherPiece>>>,
    /// Buffers the host writes (each at least once; see `peaks`), and what the peak cache of
    /// the prefix being extended watches.
    host_marks: HostMarks,
    watch: Watch,
    peaks: Option<Arc<PeakCache>>,
}

/// A sibling product for `Builder::matmul_group`: (operation, A, B, B given as [N, K], the
/// product's value, its folded add).
type GroupMember = (usize, ValueId, ValueId, bool, ValueId, Option<Epilogue>);

/// A matrix product's work item on one tile: (tile, batch, row, column and inner pieces, A's
/// block held, B's, the output or partials block, its epilogue addend, its row scale).
type WorkItem = (u32, usize, usize, usize, usize, Held, Held, Held, Option<Addend<Loc>>, Option<Held>);

/// A matrix product planned, its operands gathered and its outputs allocated
/// (`Builder::matmul_prepare`): what emitting its calls and its reduction reads.
struct PreparedProduct {
    index: usize,
    product: ValueId,
    output: ValueId,
    fold: Option<Epilogue>,
    row_scale: Option<ValueId>,
    plan: MatMulPlan,
    matching_plans: u32,
    b_transposed: bool,
    a_rank3: bool,
    b_rank3: bool,
    /// A's batches per B batch (grouped heads).
    group: u32,
    m_align: u32,
    by_columns: bool,
    out_name: String,
    original_name: String,
    /// The constraint and replication cap as the plan line shows them.
    described: String,
    operation_index: usize,
    operation_name: String,
    work: Vec<WorkItem>,
}

/// A reduction whose partial transfers are pending: (cell key in the reduced value's order,
/// owner tile, rows, columns, the partials, output buffer, addend) per call, and the reduced
/// value's cuts.
struct PendingReduction {
    #[allow(clippy::type_complexity)]
    reductions: Vec<((u64, u64, u64), u32, u32, u32, Vec<Loc>, u32, Option<Addend<Loc>>)>,
    cuts: Vec<Vec<u32>>,
}

/// A source cell `gather` met: (cell, its block as held there, its tile).
type SourceCell = (usize, Held, u32);

/// One piece of a gathered block of a stored value, as the block's layout places it (the same
/// for every tile that gathers that block): where it is read (the source cell's tile and
/// operand), where it lands in the block (`dst`, buffer left 0), its elements, the base
/// element it starts at (for error messages), whether it ends its rows, and the words it moves
/// by exchange.
#[derive(Clone, Copy, Debug)]
struct GatherPiece {
    src_tile: u32,
    src: Loc,
    dst: Loc,
    elements: u32,
    element: u32,
    ends_rows: bool,
    words: u32,
}

/// (value, block, panel width, tight last panel) of a block whose pieces
/// `Builder::block_pieces` holds.
type PieceKey = (ValueId, Vec<(u32, u32)>, u32, bool);

/// (tile, block, panel width, prefers interleaved memory, tight last panel) of a gathered
/// block of a value.
type GatherKey = (u32, Vec<(u32, u32)>, u32, bool, bool);

/// Per value: its gathered blocks and (buffer, dtype, panel width) of each. Shared by a
/// lowered prefix and its extensions until one gathers a block of that value (a prefix is
/// copied once per extension the search makes; most values gather no more blocks later).
type Gathered = BTreeMap<ValueId, Arc<BTreeMap<GatherKey, (u32, DType, u32)>>>;

/// A lowering's buffers, buffer owners, labels and operation plans: shared chunk by chunk
/// between a prefix and its extensions (`Chunked`).
pub type Buffers = Chunked<BufferDecl, 9>;
type Owners = Chunked<u32, 10>;
type Labels = Chunked<String, 5>;
type Plans = Chunked<OperationPlan, 4>;
type HostMarks = Chunked<u32, 10>;

/// Bytes per tile that other operations keep live while an operation runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Reserve {
    pub total: u64,
    pub interleaved: u64,
}

/// A lowering with what the whole-program search needs to judge it.
pub struct Attempt {
    pub lowered: Lowered,
    /// The operation index that created each buffer.
    pub owners: Vec<u32>,
    /// Per operation index: (first step, last step).
    pub spans: BTreeMap<u32, (u32, u32)>,
    /// Operation indices of matrix products planned with their weights in interleaved memory.
    pub interleaved_weights: std::collections::BTreeSet<u32>,
}

pub fn lower_with(oriented: &Oriented, target: &Target, home_weights: bool, reserves: &[Reserve]) -> Result<Attempt, LowerError> {
    lower_from(Partial::new(home_weights), oriented, target, reserves)
}

/// `lower_with` the weights of the products from original operation `from` on kept on (aligned)
/// home tiles, the earlier ones replicated (`Partial::homing_from`).
pub fn lower_homing_from(oriented: &Oriented, target: &Target, from: usize, reserves: &[Reserve]) -> Result<Attempt, LowerError> {
    lower_from(Partial::homing_from(from), oriented, target, reserves)
}

/// How a plan's `constraint` names the replication cap it was planned under (`replicas_at_most=4`).
pub const REPLICAS_AT_MOST: &str = "replicas_at_most=";

/// `lower_with` every product's operand blocks at most `bytes` on a tile
/// (`Partial::block_capped`), weights replicated or (`home`) on home tiles, aligned to the
/// program's period or (not `aligned`) rotating with every weight.
pub fn lower_block_capped(oriented: &Oriented, target: &Target, home: bool, aligned: bool, bytes: u64, reserves: &[Reserve]) -> Result<Attempt, LowerError> {
    let partial = if home && !aligned { Partial::rotated_homes() } else { Partial::new(home) };
    lower_from(partial.block_capped(bytes), oriented, target, reserves)
}

/// `lower_with` every weight replicated on at most `cap` tiles (`Partial::replication_capped`).
pub fn lower_replication_capped(oriented: &Oriented, target: &Target, cap: u32, reserves: &[Reserve]) -> Result<Attempt, LowerError> {
    lower_from(Partial::replication_capped(cap), oriented, target, reserves)
}

/// `lower_with` home-tile weights that rotate with every weight (`Partial::rotated_homes`).
pub fn lower_with_rotated_homes(oriented: &Oriented, target: &Target, reserves: &[Reserve]) -> Result<Attempt, LowerError> {
    lower_from(Partial::rotated_homes(), oriented, target, reserves)
}

/// `lower_with` home-tile weights that rotate with the repeats of the program's period
/// (`Partial::period_homes`).
pub fn lower_with_period_homes(oriented: &Oriented, target: &Target, reserves: &[Reserve]) -> Result<Attempt, LowerError> {
    lower_from(Partial::period_homes(), oriented, target, reserves)
}

fn lower_from(start: Partial, oriented: &Oriented, target: &Target, reserves: &[Reserve]) -> Result<Attempt, LowerError> {
    let partial = extend(start, oriented, target, reserves, oriented.graph.operations.len())?;
    complete(partial, oriented, target, reserves)
}

/// The home slot of a weight in a program of repeated blocks: its place among the rank-2
/// weights (in declaration order) modulo the shortest period of their (shape, dtype)
/// sequence, so that the same weight of every repeated block gets the same home tiles (and
/// the blocks' multicast phases the same pattern, scheduled once). None for a value that is
/// not such a weight.
pub(crate) fn aligned_home_slot(graph: &Graph, weight: ValueId) -> Option<usize> {
    period_home_slot(graph, weight).map(|(slot, _, _)| slot)
}

/// A weight's home slot (`aligned_home_slot`), which repeat of the period it belongs to (0
/// for the first block's weights), and how many repeats the slot has.
pub(crate) fn period_home_slot(graph: &Graph, weight: ValueId) -> Option<(usize, usize, usize)> {
    let (position, period, n) = weight_period(graph, weight)?;
    let slot = position % period;
    Some((slot, position / period, (n - slot).div_ceil(period)))
}

/// Whether the program's rank-2 weights repeat their period at least twice (a program of
/// repeated blocks), where homes rotating with the repeats differ from aligned ones.
pub(crate) fn weights_repeat(graph: &Graph) -> bool {
    graph.values.iter().position(|v| v.is_matrix_weight()).and_then(|first| weight_period(graph, ValueId(first as u32))).is_some_and(|(_, period, n)| n >= 2 * period)
}

/// A rank-2 weight's place among them (declaration order), the shortest period of their
/// (shape, dtype) sequence, and how many there are.
fn weight_period(graph: &Graph, weight: ValueId) -> Option<(usize, usize, usize)> {
    let weights: Vec<(usize, &Value)> = graph
        .values
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_matrix_weight())
        .collect();
    let position = weights.iter().position(|(i, _)| *i == weight.0 as usize)?;
    let same = |a: &Value, b: &Value| a.shape == b.shape && a.dtype == b.dtype;
    let n = weights.len();
    let period = (1..=n).find(|&p| (0..n - p).all(|i| same(weights[i].1, weights[i + p].1))).unwrap_or(n.max(1));
    Some((position, period, n))
}

/// A lowering in progress between two operations: the builder's own state, so that the
/// search (`search.rs`) can extend one lowered prefix of a program in several ways. Extending
/// a prefix gives exactly what lowering the whole program at once gives (`lower_with` is
/// `extend` to the end, then `complete`).
#[derive(Clone)]
pub struct Partial {
    labels: Labels,
    buffers: Buffers,
    steps: Vec<LStep>,
    compute_sets: Vec<Arc<Vec<(u32, Call)>>>,
    phases: Vec<Arc<Vec<Transfer>>>,
    phase_plans: Vec<u32>,
    stored: BTreeMap<ValueId, Arc<Stored>>,
    host: BTreeMap<ValueId, Arc<LHostTensor>>,
    pending: Moves,
    copies: Vec<LocalCopy>,
    plans: Plans,
    checkpoints: Vec<Arc<LCheckpoint>>,
    gemm_flops: u64,
    home_from: usize,
    home_rotation: usize,
    home_aligned: bool,
    home_period: bool,
    home_bases: Arc<BTreeMap<(usize, usize, usize, usize), usize>>,
    home_load: Arc<Vec<u64>>,
    replication_cap: u32,
    block_cap: u64,
    owners: Owners,
    spans: BTreeMap<u32, (u32, u32)>,
    interleaved_weights: std::collections::BTreeSet<u32>,
    gathered: Gathered,
    host_marks: HostMarks,
    watch: Watch,
    /// The peak live bytes per tile as last scored (`Partial::peaks`).
    peaks: Option<Arc<PeakCache>>,
    /// Operations of the oriented graph lowered so far (a prefix of them).
    lowered: usize,
}

impl Partial {
    pub fn new(home_weights: bool) -> Partial {
        Partial {
            labels: ["code".to_string()].into_iter().collect(),
            buffers: Chunked::default(),
            steps: Vec::new(),
            compute_sets: Vec::new(),
            phases: Vec::new(),
            phase_plans: Vec::new(),
            stored: BTreeMap::new(),
            host: BTreeMap::new(),
            pending: Moves::default(),
            copies: Vec::new(),
            plans: Chunked::default(),
            checkpoints: Vec::new(),
            gemm_flops: 0,
            home_from: if home_weights { 0 } else { usize::MAX },
            home_rotation: 0,
            home_aligned: true,
            home_period: false,
            home_bases: Arc::new(BTreeMap::new()),
            home_load: Arc::new(Vec::new()),
            replication_cap: u32::MAX,
            block_cap: u64::MAX,
            owners: Chunked::default(),
            spans: BTreeMap::new(),
            interleaved_weights: Default::default(),
            gathered: BTreeMap::new(),
            host_marks: Chunked::default(),
            watch: Watch::default(),
            peaks: None,
            lowered: 0,
        }
    }

    /// Operations of the oriented graph lowered so far.
    pub fn lowered_operations(&self) -> usize {
        self.lowered
    }

    /// The exchange phases lowered so far (tests: which allocations a finished program shares;
    /// the capped program's lowering beside the beam hands them on as it goes).
    pub(crate) fn phase_lists(&self) -> &[Arc<Vec<Transfer>>] {
        &self.phases
    }

    /// Whether every matrix-product weight is kept once on a home tile (else some or all are
    /// replicated).
    pub fn home_weights(&self) -> bool {
        self.home_from == 0
    }

    /// The original operation index from which products keep their weights on home tiles
    /// (0: all; usize::MAX: none).
    pub fn home_from(&self) -> usize {
        self.home_from
    }

    /// A program whose products from original operation `from` on keep their weights on
    /// (aligned) home tiles, the earlier ones replicated: a mixed program.
    pub fn homing_from(from: usize) -> Partial {
        Partial { home_from: from, ..Partial::new(false) }
    }

    /// This prefix, its later products (from original operation `from` on) keeping their
    /// weights on home tiles: a replicated prefix extended as a mixed program.
    pub fn home_later(self, from: usize) -> Partial {
        Partial { home_from: self.home_from.min(from), ..self }
    }

    /// A program with home-tile weights rotating with every weight (not aligned to the
    /// program's period): the fallback when aligned homes do not fit.
    pub fn rotated_homes() -> Partial {
        Partial { home_aligned: false, ..Partial::new(true) }
    }

    /// A program with home-tile weights rotating with the repeats of the program's period
    /// (`home_period`): tried between aligned and rotated homes in a program of repeated
    /// blocks, whose repeats then share multicast patterns while their homes spread.
    pub fn period_homes() -> Partial {
        Partial { home_aligned: false, home_period: true, ..Partial::new(true) }
    }

    /// A program with every weight replicated, each rank-2 weight block on at most `cap`
    /// tiles (`Builder::replication_cap`): the products plan with at most `cap` row partitions
    /// (column partitions when swapped), so the weights of a program whose replicas at the
    /// planner's own partitions do not fit may still all be resident where they are read.
    pub fn replication_capped(cap: u32) -> Partial {
        Partial { replication_cap: cap.max(1), ..Partial::new(false) }
    }

    /// This program with every matrix product planned so that its A block and its B block
    /// each take at most `bytes` on a tile (`Builder::block_cap`): smaller blocks, more
    /// partitions, for programs whose placement fails under blocks that fill a region.
    pub fn block_capped(self, bytes: u64) -> Partial {
        Partial { block_cap: bytes, ..self }
    }

    pub fn plans(&self) -> impl Iterator<Item = &OperationPlan> + '_ {
        self.plans.iter()
    }

    pub fn buffers(&self) -> &Buffers {
        &self.buffers
    }

    /// Per buffer: whether the host writes it (resident from the start of the run once the
    /// program is complete).
    pub fn host_flags(&self) -> Vec<bool> {
        let mut host = vec![false; self.buffers.len()];
        for b in self.host.values().flat_map(|t| t.segments.iter().map(|s| s.buffer)) {
            if let Some(h) = host.get_mut(b as usize) {
                *h = true;
            }
        }
        host
    }

    /// The peak (standard, interleaved, total) live bytes on any tile (host-written buffers
    /// live from the start, as in the finished program), from the peaks last scored of the
    /// prefix this one extends where they still hold (`peaks`); kept for the extensions.
    pub fn peaks(&mut self, tiles: u32) -> (u64, u64, u64) {
        self.peaks_lagging(tiles, super::peaks::LAG)
    }

    /// `peaks`, the cache's boundary `lag` steps before the last.
    pub(crate) fn peaks_lagging(&mut self, tiles: u32, lag: u32) -> (u64, u64, u64) {
        let (peaks, cache) = super::peaks::update(&self.buffers, &self.host_marks, self.watch, self.steps.len(), self.peaks.as_deref(), tiles, lag);
        self.watch = cache.watch();
        self.peaks = Some(Arc::new(cache));
        peaks
    }
}

/// Whether a prefix of `end` operations lowered over `from` extends exactly over `to`: the
/// same operations, values and origins there, and the same answers to the questions about the
/// whole graph the lowering asks of them (scales folded into a softmax, consumers that need
/// whole rows, swapped values' checkpoint names).
pub fn prefix_compatible(from: &Oriented, to: &Oriented, end: usize) -> bool {
    let (f, t) = (&from.graph, &to.graph);
    if end > f.operations.len() || end > t.operations.len() || f.operations[..end] != t.operations[..end] || from.origin[..end] != to.origin[..end] {
        return false;
    }
    // A deferred softmax's reciprocals (the value after its output) belong to its prefix too.
    let reciprocals = |g: &Graph| -> Vec<Option<ValueId>> { (0..end).map(|i| reciprocals_of(g, i)).collect() };
    if reciprocals(f) != reciprocals(t) {
        return false;
    }
    let used = f.operations[..end].iter().flat_map(|o| o.inputs.iter().chain([&o.output])).map(|v| v.0 as usize + 1).chain(reciprocals(f).into_iter().flatten().map(|v| v.0 as usize + 1)).max().unwrap_or(0);
    if used > f.values.len() || used > t.values.len() || f.values[..used] != t.values[..used] {
        return false;
    }
    let prefix = |g: &Graph| -> Vec<(usize, (usize, u64))> { folded_scales(g).into_iter().filter(|(j, (i, _))| *j < end || *i < end).map(|(j, (i, x))| (j, (i, x.to_bits()))).collect() };
    if prefix(f) != prefix(t) {
        return false;
    }
    f.operations[..end].iter().all(|o| {
        row_consumers(f, o.output) == row_consumers(t, o.output)
            && from.checkpoint_value.get(&o.output) == to.checkpoint_value.get(&o.output)
            && f.outputs.contains(&o.output) == t.outputs.contains(&o.output)
    })
}

/// Whether a prefix of `end` operations lowers exactly alike over `old` and `new`, two
/// orientations of two (possibly different) graphs: the plan beam resuming across builds
/// (`search.rs`) reuses what a previous build of another graph decided for this prefix only
/// when this holds.
///
/// [`prefix_compatible`] compares what a prefix reads of its own operations and values (the
/// operations, values and origins up to there, deferred softmaxes' reciprocals, scales folded
/// into a softmax, consumers that need whole rows, checkpoint names, graph outputs among the
/// prefix's values), but it was written for two orientations of one graph, so it takes the
/// graph's other facts as shared. Across graphs this also compares every fact of the whole
/// graph the lowering of a prefix reads (`extend` and the Builder's operations; the plan,
/// candidate, grid and elementwise helpers they call read shapes and the target only):
/// - the aligned home slot (`aligned_home_slot`: the period of the rank-2 weights over all
///   weights of the graph) of every rank-2 weight among the prefix's values;
/// - the user plan constraint each prefix operation looks up by its (checkpoint) name in
///   `graph.file.constraints`, and those names;
/// - the adds folded into a product's epilogue (`elementwise::folded_adds`, which reads the
///   add's readers and the graph outputs) whose product or add lies in the prefix, with each
///   such add operation, its output value, whether that needs whole rows and is a graph output;
/// - checkpoint views of every value of the prefix (not only the operations' outputs).
///
/// The graph's name enters no label or plan (only error messages, and a beam that noted an
/// error is not resumed); `Builder::finish` (graph outputs, host tensors by name) runs on the
/// whole program, never on a reused prefix.
pub fn prefix_identical_across_graphs(old: &Oriented, new: &Oriented, end: usize) -> bool {
    if !prefix_compatible(old, new, end) {
        return false;
    }
    let (f, t) = (&old.graph, &new.graph);
    // The values the prefix reads or writes (as prefix_compatible counts them): equal in both.
    let used = f.operations[..end].iter().flat_map(|o| o.inputs.iter().chain([&o.output])).map(|v| v.0 as usize + 1).chain((0..end).filter_map(|i| reciprocals_of(f, i)).map(|v| v.0 as usize + 1)).max().unwrap_or(0);
    for (i, v) in f.values[..used].iter().enumerate() {
        let id = ValueId(i as u32);
        if v.is_matrix_weight() && aligned_home_slot(f, id) != aligned_home_slot(t, id) {
            return false;
        }
        let named = |o: &Oriented| o.checkpoint_value.get(&id).map(|&c| (c, o.graph.values.get(c.0 as usize).map(|v| v.name.clone())));
        if named(old) != named(new) || old.row_read.contains(&id) != new.row_read.contains(&id) {
            return false;
        }
    }
    // The constraint each operation of the prefix looks up, by its original (checkpoint) name.
    let constraint = |o: &Oriented, output: ValueId| {
        let name = o.graph.value(o.checkpoint_value.get(&output).copied().unwrap_or(output)).name.clone();
        let found = o.graph.file.constraints.iter().find(|c| c.operation == name).cloned();
        (name, found)
    };
    if f.operations[..end].iter().any(|o| constraint(old, o.output) != constraint(new, o.output)) {
        return false;
    }
    let adds = |g: &Graph| -> Vec<(usize, super::elementwise::Fold)> { super::elementwise::folded_adds(g).into_iter().filter(|(p, a)| *p < end || a.add < end).collect() };
    let (fa, ta) = (adds(f), adds(t));
    if fa != ta {
        return false;
    }
    fa.iter().all(|(_, a)| {
        let (Some(x), Some(y)) = (f.operations.get(a.add), t.operations.get(a.add)) else { return false };
        x == y && f.values.get(x.output.0 as usize) == t.values.get(y.output.0 as usize) && row_consumers(f, x.output) == row_consumers(t, y.output) && f.outputs.contains(&x.output) == t.outputs.contains(&y.output)
    })
}

/// Lower the operations of `oriented` from where `partial` stopped up to `end` (exclusive).
pub fn extend(partial: Partial, oriented: &Oriented, target: &Target, reserves: &[Reserve], end: usize) -> Result<Partial, LowerError> {
    let graph = &oriented.graph;
    let start = partial.lowered;
    let mut b = Builder::resume(partial, oriented, target, reserves);
    let folded = folded_scales(graph);
    let adds = super::elementwise::folded_adds(graph);
    let groups = super::orient::sibling_groups(graph);
    let fold_of = |index: usize| {
        adds.get(&index).map(|f| {
            // A bias of a swapped product (stored transposed) is one element per row.
            let broadcast = match (f.bias, oriented.checkpoint_value.contains_key(&graph.operations[index].output)) {
                (false, _) => Broadcast::Full,
                (true, false) => Broadcast::Row,
                (true, true) => Broadcast::Column,
            };
            Epilogue { add: f.add, addend: f.addend, broadcast }
        })
    };
    for (index, operation) in graph.operations.iter().enumerate().take(end).skip(start) {
        if operation.kind.is_view() || folded.values().any(|f| f.0 == index) || adds.values().any(|f| f.add == index) {
            continue;
        }
        // A sibling product lowered with the first of its group is stored already.
        if matches!(operation.kind, OpKind::MatMul { .. }) && b.stored.contains_key(&fold_of(index).map_or(operation.output, |f| graph.operations[f.add].output)) {
            continue;
        }
        b.operation_name = graph.value(operation.output).name.clone();
        b.operation_index = index;
        let first_step = b.steps.len() as u32;
        match &operation.kind {
            OpKind::MatMul { .. } if groups.contains_key(&index) => {
                let members: Vec<GroupMember> = groups[&index]
                    .iter()
                    .map(|&i| {
                        let o = &graph.operations[i];
                        let OpKind::MatMul { transpose_b } = o.kind else { unreachable!("sibling groups hold products") };
                        (i, o.inputs[0], o.inputs[1], transpose_b, o.output, fold_of(i))
                    })
                    .collect();
                if b.matmul_group(&members)? {
                    let last_step = (b.steps.len() as u32).saturating_sub(1);
                    for &(i, ..) in &members[1..] {
                        b.spans.insert(i as u32, (first_step.min(last_step), last_step));
                    }
                }
            }
            OpKind::MatMul { transpose_b } => {
                let fold = fold_of(index);
                b.matmul(index, operation.inputs[0], operation.inputs[1], *transpose_b, operation.output, fold, operation.inputs.get(2).copied())?
            }
            OpKind::TransposeCopy => b.transpose_copy(index, operation.inputs[0], operation.output)?,
            OpKind::Softmax if folded.contains_key(&index) => {
                let (scale_op, factor) = folded[&index];
                let input = graph.operations[scale_op].inputs[0];
                b.elementwise_scaled(index, OpKind::Softmax, &[input], operation.output, factor as f32, reciprocals_of(graph, index))?
            }
            kind => b.elementwise_scaled(index, kind.clone(), &operation.inputs, operation.output, 1.0, reciprocals_of(graph, index))?,
        }
        let last_step = (b.steps.len() as u32).saturating_sub(1);
        b.spans.insert(index as u32, (first_step.min(last_step), last_step));
    }
    Ok(b.suspend(end.max(start)))
}

/// Finish a lowering whose every operation is lowered: outputs, host tables, the program.
pub fn complete(partial: Partial, oriented: &Oriented, target: &Target, reserves: &[Reserve]) -> Result<Attempt, LowerError> {
    Builder::resume(partial, oriented, target, reserves).finish()
}

impl<'a> Builder<'a> {
    fn resume(p: Partial, oriented: &'a Oriented, target: &'a Target, reserves: &'a [Reserve]) -> Builder<'a> {
        Builder {
            graph: &oriented.graph,
            target,
            labels: p.labels,
            buffers: p.buffers,
            steps: p.steps,
            compute_sets: p.compute_sets,
            phases: p.phases,
            phase_plans: p.phase_plans,
            stored: p.stored,
            host: p.host,
            pending: p.pending,
            copies: p.copies,
            plans: p.plans,
            checkpoints: p.checkpoints,
            gemm_flops: p.gemm_flops,
            operation_name: String::new(),
            home_from: p.home_from,
            home_rotation: p.home_rotation,
            home_aligned: p.home_aligned,
            home_period: p.home_period,
            home_bases: p.home_bases,
            home_load: p.home_load,
            replication_cap: p.replication_cap,
            block_cap: p.block_cap,
            reserves,
            origin: &oriented.origin,
            checkpoint_value: &oriented.checkpoint_value,
            row_read: &oriented.row_read,
            operation_index: 0,
            owners: p.owners,
            spans: p.spans,
            interleaved_weights: p.interleaved_weights,
            gathered: p.gathered,
            block_pieces: std::collections::HashMap::new(),
            host_marks: p.host_marks,
            watch: p.watch,
            peaks: p.peaks,
        }
    }

    fn suspend(self, lowered: usize) -> Partial {
        Partial {
            labels: self.labels,
            buffers: self.buffers,
            steps: self.steps,
            compute_sets: self.compute_sets,
            phases: self.phases,
            phase_plans: self.phase_plans,
            stored: self.stored,
            host: self.host,
            // Every operation closes its moves; what is left is an empty table.
            pending: if self.pending.is_empty() { Moves::default() } else { self.pending },
            copies: self.copies,
            plans: self.plans,
            checkpoints: self.checkpoints,
            gemm_flops: self.gemm_flops,
            home_from: self.home_from,
            home_rotation: self.home_rotation,
            home_aligned: self.home_aligned,
            home_period: self.home_period,
            home_bases: self.home_bases,
            home_load: self.home_load,
            replication_cap: self.replication_cap,
            block_cap: self.block_cap,
            owners: self.owners,
            spans: self.spans,
            interleaved_weights: self.interleaved_weights,
            gathered: self.gathered,
            host_marks: self.host_marks,
            watch: self.watch,
            peaks: self.peaks,
            lowered,
        }
    }
}

impl<'a> Builder<'a> {
    fn label(&mut self, name: &str) -> u32 {
        // Labels are distinct; a buffer mostly takes a recent one.
        if let Some(i) = (0..self.labels.len()).rev().find(|&i| self.labels[i] == name) {
            return i as u32;
        }
        self.labels.push(name.to_string());
        (self.labels.len() - 1) as u32
    }

    fn buffer(&mut self, tile: u32, bytes: u64, kind: AllocationKind, prefer_interleaved: bool, label: &str) -> u32 {
        let label = self.label(label);
        self.buffers.push(BufferDecl { tile, bytes: bytes.div_ceil(8) as u32 * 8, kind, prefer_interleaved, label, first_step: u32::MAX, last_step: 0 });
        self.owners.push(self.operation_index as u32);
        (self.buffers.len() - 1) as u32
    }

    fn touch(&mut self, buffer: u32, step: u32) {
        touch(&mut self.buffers, &mut self.watch, buffer, step);
    }

    /// Note that the host writes `buffer` (see `peaks`).
    fn mark_host(&mut self, buffer: u32) {
        if self.host_marks.last() != Some(&buffer) {
            self.host_marks.push(buffer);
        }
    }

    fn reserve(&self) -> Reserve {
        self.reserves.get(self.operation_index).copied().unwrap_or_default()
    }

    /// Bytes per tile this operation may use: tile memory less the code reserve and what other
    /// operations keep live meanwhile.
    fn budget(&self) -> u64 {
        ((self.target.memory.loader_limit - self.target.memory.base) as u64 - CODE_RESERVE_BYTES).saturating_sub(self.reserve().total)
    }

    /// Standard bytes per tile this operation may use beside code and other operations' demand.
    fn standard_budget(&self) -> u64 {
        let r = self.reserve();
        ((self.target.memory.interleaved_start - self.target.memory.base) as u64 - CODE_RESERVE_BYTES).saturating_sub(r.total.saturating_sub(r.interleaved))
    }

    /// Interleaved bytes per tile this operation may use beside other operations' demand there.
    fn interleaved_budget(&self) -> u64 {
        ((self.target.memory.loader_limit - self.target.memory.interleaved_start) as u64).saturating_sub(self.reserve().interleaved)
    }

    /// Gather `block` of `value` (in the value's own index space) onto `tile`.
    fn gather(&mut self, value: ValueId, tile: u32, block: &[(u32, u32)], prefer_interleaved: bool, panel: u32, tight_last: bool) -> Result<Held, LowerError> {
        let chain = ViewChain::resolve(self.graph, value);
        let dtype = self.graph.value(value).dtype;
        let base = self.graph.value(chain.base);
        let is_stored = self.stored.contains_key(&chain.base);
        if let Some(stored) = self.stored.get(&chain.base) {
            if chain.is_identity() {
                if let Some(cell) = stored.grid.cell_holding(block).filter(|&cell| stored.grid.tiles[cell] == tile) {
                    return Ok(Held::plain(stored.grid.buffers[cell], stored.grid.cell_block(cell), dtype));
                }
            }
        }
        // Panels only pay where the block arrives by exchange; the host writes any layout.
        let panel = if is_stored { panel } else { 0 };
        let tight_last = tight_last && panel > 0;
        let key: GatherKey = (tile, block.to_vec(), panel, prefer_interleaved, tight_last);
        if is_stored {
            if let Some(&(buffer, dtype, panel)) = self.gathered.get(&value).and_then(|g| g.get(&key)) {
                return Ok(Held { buffer, block: block.to_vec(), dtype, panel, tight_last });
            }
        }
        let graph = self.graph;
        let name = &graph.value(value).name;
        let mut held = Held { buffer: u32::MAX, block: block.to_vec(), dtype, panel, tight_last };
        let buffer = self.buffer(tile, held.stored_elements() * dtype.bytes() as u64, AllocationKind::Data, prefer_interleaved, name);
        held.buffer = buffer;
        if !is_stored && chain.is_matrix_transpose() {
            // The host writes a transposed block: each row of it is one strided segment
            // (consecutive columns are base elements a base row apart).
            let Producer::Tensor { role, .. } = base.producer else { unreachable!("only host tensors are not stored") };
            let base_cols = chain.base_shape[1];
            let entry = self.host_tensor(chain.base, base, role, dtype);
            // One segment: row r of the block is base column r, read `base_cols` apart and
            // written contiguously (the host transposes as it streams).
            let (r0, r1) = block[0];
            let (c0, c1) = block[1];
            let offset = held.loc(&[r0, c0]).offset * dtype.bytes();
            let offset_stride = if r1 - r0 > 1 { (held.loc(&[r0 + 1, c0]).offset - held.loc(&[r0, c0]).offset) * dtype.bytes() } else { 0 };
            let element_stride = if r1 - r0 > 1 { 1 } else { 0 };
            entry.segments.push(LSegment { buffer, offset, element: c0 * base_cols + r0, count: c1 - c0, rows: r1 - r0, element_stride, offset_stride, element_step: base_cols });
            self.mark_host(buffer);
            return Ok(held);
        }
        if is_stored {
            let piece_key: PieceKey = (value, block.to_vec(), held.panel, held.tight_last);
            let pieces = match self.block_pieces.get(&piece_key) {
                Some(pieces) => pieces.clone(),
                None => {
                    let pieces = Arc::new(gather_pieces(&chain, &self.stored[&chain.base].grid, &held, block, dtype));
                    self.block_pieces.insert(piece_key, pieces.clone());
                    pieces
                }
            };
            let bytes = dtype.bytes();
            // Pieces that move through a staging buffer: (source buffer, first byte, words,
            // bytes skipped in the first word, elements, destination).
            let mut staged: Vec<(u32, u32, u32, u32, u32, Loc)> = Vec::new();
            for p in pieces.iter() {
                let dst = Loc { buffer, ..p.dst };
                if p.src_tile == tile {
                    // A local copy loads and stores 64 bits at a time where both ends start at
                    // the target's data alignment, else one 32-bit word at a time (slower, a
                    // `CopyWords`) where both start on a word and the piece is whole words,
                    // else one f16 element at a time (slower still, a `CopyHalves`).
                    let align = self.target.memory.data_alignment;
                    let (src_at, dst_at, len) = (p.src.offset * bytes, dst.offset * bytes, p.elements * bytes);
                    let Some(granule) = Granule::of(src_at, dst_at, len, align, bytes) else {
                        return Err(LowerError::Unsupported { operation: self.operation_name.clone(), message: format!("a local copy of value '{name}' from element {} would not start {align}-byte aligned, nor move whole 32-bit words", p.element) });
                    };
                    self.local_copy(p.elements, p.src, dst, granule);
                } else {
                    let (src_offset, dst_offset) = (p.src.offset * bytes, dst.offset * bytes);
                    if !src_offset.is_multiple_of(4) || !dst_offset.is_multiple_of(4) || (!(p.elements * bytes).is_multiple_of(4) && !p.ends_rows) {
                        // The exchange moves whole words: an f16 piece that starts or ends
                        // inside one (an attention head of an odd width) moves the words that
                        // hold it into a staging buffer, and a local copy takes it from there.
                        if bytes != 2 {
                            return Err(LowerError::SubWord { operation: self.operation_name.clone(), value: name.clone(), offset: p.element, dtype: dtype.name() });
                        }
                        let first = src_offset / 4 * 4;
                        let words = (src_offset + p.elements * bytes - first).div_ceil(4);
                        if (first + words * 4) as u64 > self.buffers[p.src.buffer as usize].bytes as u64 {
                            return Err(LowerError::SubWord { operation: self.operation_name.clone(), value: name.clone(), offset: p.element, dtype: dtype.name() });
                        }
                        staged.push((p.src.buffer, first, words, src_offset - first, p.elements, dst));
                        continue;
                    }
                    self.pending.push((p.src.buffer, src_offset), p.words, (buffer, dst_offset));
                }
            }
            if !staged.is_empty() {
                let total: u64 = staged.iter().map(|s| s.2 as u64 * 4).sum();
                let staging = self.buffer(tile, total, AllocationKind::Data, false, &format!("{name}.staged"));
                let mut at = 0u32;
                for (source, first, words, skip, elements, dst) in staged {
                    self.pending.push((source, first), words, (staging, at));
                    let src = Loc { buffer: staging, offset: (at + skip) / 2, row_stride: 0, dtype_bytes: 2 };
                    let granule = Granule::of(at + skip, dst.offset * 2, elements * 2, self.target.memory.data_alignment, 2).expect("f16 pieces copy by halves at least");
                    self.local_copy(elements, src, dst, granule);
                    at += words * 4;
                }
            }
            Arc::make_mut(self.gathered.entry(value).or_default()).insert(key, (held.buffer, held.dtype, held.panel));
            return Ok(held);
        }
        // Not stored: a host tensor, whose elements the host writes into the block (one
        // segment per piece the views map contiguously).
        let Producer::Tensor { role, .. } = &base.producer else {
            return Err(LowerError::Unsupported { operation: self.operation_name.clone(), message: format!("value '{name}' is read before it is computed") });
        };
        // The block's segments are merged as `finish` merges a tensor's (`merge_segments`)
        // before they join the tensor: every merge joins segments of one buffer, and this
        // buffer is the block's alone, so merging them now and the whole tensor again at
        // `finish` gives what merging once at `finish` gives (the merge is idempotent), and a
        // partial program holds a strided segment per block instead of one per row of every
        // replicated weight block.
        let mut segments: Vec<LSegment> = Vec::new();
        walk_block(&chain, &held, block, |index, base_index, run, _| {
            let dst_offset = held.loc(index).offset * dtype.bytes();
            let element = flatten(base_index, &chain.base_shape);
            push_segment(&mut segments, LSegment { buffer, offset: dst_offset, element: element as u32, count: run, rows: 1, element_stride: 0, offset_stride: 0, element_step: 1 }, dtype.bytes());
            run
        });
        if !segments.is_empty() {
            let entry = self.host_tensor(chain.base, base, *role, dtype);
            entry.segments.extend(merge_segments(segments, dtype));
            self.mark_host(buffer);
        }
        Ok(held)
    }

    /// Store `value` (its grid of cells). The pieces of blocks found so far are dropped: they
    /// serve the tiles of one operation's gathers, and none can then read a stale grid.
    fn store(&mut self, value: ValueId, stored: Stored) {
        self.stored.insert(value, Arc::new(stored));
        self.block_pieces.clear();
    }

    /// Whether `block` of `value` is already gathered onto `tile` (see `gathered`).
    fn already_gathered(&self, value: ValueId, tile: u32, block: &[(u32, u32)], panel: u32, prefer_interleaved: bool) -> bool {
        self.gathered.get(&value).is_some_and(|g| g.contains_key(&(tile, block.to_vec(), panel, prefer_interleaved, false)))
    }

    /// The gathered blocks of `value`, for the plan memo's key (they change what a plan costs).
    fn gathered_signature(&self, value: ValueId) -> String {
        let blocks: Vec<_> = self.gathered.get(&value).map(|g| g.keys().map(|k| (k.0, &k.1, k.2, k.3, k.4)).collect()).unwrap_or_default();
        if blocks.is_empty() {
            return String::new();
        }
        format!("{}", crate::hash::KeyHasher::new("gathered blocks").bytes(format!("{blocks:?}").as_bytes()).finish())
    }

    /// Elements (f16) a row cut of a swapped value written out transposed falls on a multiple
    /// of: its rows become columns of what is written out, which move in whole words and copy
    /// locally from the target's data alignment only.
    fn row_read_align(&self) -> u32 {
        (self.target.memory.data_alignment / 2).max(2)
    }

    fn local_copy(&mut self, cols: u32, src: Loc, dst: Loc, granule: Granule) {
        if let Some(last) = self.copies.last_mut() {
            // Rows at a pitch that is not a multiple of the data alignment alternate between
            // aligned and word-aligned starts: they merge into one copy of the finer granule (a
            // word copy moves aligned rows too, a copy of halves any rows). A copy of more rows
            // keeps its granule: the next row must not need a finer one.
            let same = last.cols == cols && last.src.buffer == src.buffer && last.dst.buffer == dst.buffer;
            if same && last.rows == 1 && src.offset > last.src.offset && dst.offset > last.dst.offset {
                last.src.row_stride = src.offset - last.src.offset;
                last.dst.row_stride = dst.offset - last.dst.offset;
                last.rows = 2;
                last.granule = last.granule.max(granule);
                let pitch = |stride: u32| stride * src.dtype_bytes;
                // Two rows at a pitch off the granule's alignment: the pitch decides.
                if !pitch(last.src.row_stride).is_multiple_of(4) || !pitch(last.dst.row_stride).is_multiple_of(4) {
                    last.granule = last.granule.max(Granule::Halves);
                } else if !pitch(last.src.row_stride).is_multiple_of(self.target.memory.data_alignment) || !pitch(last.dst.row_stride).is_multiple_of(self.target.memory.data_alignment) {
                    last.granule = last.granule.max(Granule::Words);
                }
                return;
            }
            let kept = last.granule >= granule;
            if same && kept && last.rows > 1 && src.offset == last.src.offset + last.rows * last.src.row_stride && dst.offset == last.dst.offset + last.rows * last.dst.row_stride {
                last.rows += 1;
                return;
            }
        }
        self.copies.push(LocalCopy { rows: 1, cols, src, dst, granule });
    }

    /// Close the gathers of one operation: an exchange phase if anything moves, then the
    /// compute set the operation's calls go into. Returns the compute step.
    fn open_compute(&mut self) -> u32 {
        if !self.pending.is_empty() {
            let step = self.steps.len() as u32;
            self.steps.push(LStep::Exchange(self.phases.len() as u32));
            // Sorted moves, source buffer by source buffer: one transfer per (source, words),
            // destinations in order, consecutive rows merged (`Moves::drain_into_transfers`).
            let transfers = self.pending.drain_into_transfers(|buffer| touch(&mut self.buffers, &mut self.watch, buffer, step));
            self.phases.push(Arc::new(transfers));
            // The operation being built records its plan after its phases: its index is next.
            self.phase_plans.push(self.plans.len() as u32);
            self.steps.push(LStep::Compute(self.compute_sets.len() as u32));
            self.compute_sets.push(Arc::default());
        } else if !matches!(self.steps.last(), Some(LStep::Compute(_))) {
            self.steps.push(LStep::Compute(self.compute_sets.len() as u32));
            self.compute_sets.push(Arc::default());
        }
        let step = (self.steps.len() - 1) as u32;
        for copy in std::mem::take(&mut self.copies) {
            let tile = self.buffers[copy.src.buffer as usize].tile;
            let (rows, cols) = (copy.rows, copy.cols);
            let dtype = if copy.src.dtype_bytes == 2 { DType::F16 } else { DType::F32 };
            let (input, output) = (copy.src, copy.dst);
            let call = match copy.granule {
                Granule::Doubles => Call::Copy { rows, cols, dtype, input, output },
                Granule::Words => Call::CopyWords { rows, cols, dtype, input, output },
                Granule::Halves => Call::CopyHalves { rows, cols, input, output },
            };
            self.emit(step, tile, call);
        }
        step
    }

    fn emit(&mut self, step: u32, tile: u32, call: Call) {
        for buffer in call.operands().into_iter().map(|l| l.buffer).collect::<Vec<_>>() {
            self.touch(buffer, step);
        }
        let LStep::Compute(set) = self.steps[step as usize] else { unreachable!("calls go into compute steps") };
        Arc::make_mut(&mut self.compute_sets[set as usize]).push((tile, call));
    }

    fn record(&mut self, index: usize, output: ValueId, grid: Grid, dtype: DType, step: u32, mut plan: OperationPlan) {
        let value = self.graph.value(output).clone();
        self.store(output, Stored { grid, dtype });
        // Checkpoints and plans speak of the original operation and value.
        let original = self.origin.get(index).copied().unwrap_or(index as u32);
        plan.operation = original;
        let shown = self.checkpoint_value.get(&output).copied().unwrap_or(output);
        // A softmax whose normalisation is deferred stores exp(x - max), not its value: no
        // checkpoint can be compared with the reference.
        // A transpose written out holds a value already checkpointed where its swapped
        // original was stored.
        if reciprocals_of(self.graph, index).is_none() && !matches!(self.graph.operations[index].kind, OpKind::TransposeCopy) {
            let tensor = self.host_view(shown, HostRole::Intermediate);
            self.checkpoints.push(Arc::new(LCheckpoint { operation: original, after_step: step, tensor }));
        }
        debug!(operation = plan.operation, value = %value.name, kind = %plan.kind, partitions = ?plan.partitions, tiles = plan.tiles,
            estimated_compute_cycles = plan.estimated_compute_cycles, estimated_exchange_cycles = plan.estimated_exchange_cycles,
            peak_bytes = plan.peak_bytes, "planned operation");
        self.plans.push(plan);
    }

    /// Where the host finds each element of `value` (through views): segments in logical order.
    fn host_view(&self, value: ValueId, role: HostRole) -> LHostTensor {
        let chain = ViewChain::resolve(self.graph, value);
        let v = self.graph.value(value);
        let stored = &self.stored[&chain.base];
        if chain.is_matrix_transpose() {
            // Each stored row of each cell holds part of one column of the view: one segment
            // per cell, its runs `cols` apart element by element and contiguous in memory.
            let cols = v.shape[1];
            let mut segments = Vec::new();
            for cell in 0..stored.grid.tiles.len() {
                let block = stored.grid.cell_block(cell);
                let held = Held::plain(stored.grid.buffers[cell], block.clone(), stored.dtype);
                let ((b0, b1), (t0, t1)) = (block[0], block[1]);
                let offset = held.loc(&[b0, t0]).offset * stored.dtype.bytes();
                let offset_stride = if b1 - b0 > 1 { (held.loc(&[b0 + 1, t0]).offset - held.loc(&[b0, t0]).offset) * stored.dtype.bytes() } else { 0 };
                let element_stride = if b1 - b0 > 1 { 1 } else { 0 };
                segments.push(LSegment { buffer: held.buffer, offset, element: t0 * cols + b0, count: t1 - t0, rows: b1 - b0, element_stride, offset_stride, element_step: cols });
            }
            segments.sort_by_key(|s| (s.buffer, s.offset));
            return LHostTensor { name: v.name.clone(), shape: v.shape.clone(), dtype: v.dtype, role, segments };
        }
        let shape = &v.shape;
        let rank = shape.len();
        let cols = shape[rank - 1];
        let rows: u64 = shape[..rank - 1].iter().map(|&d| d as u64).product();
        let mut segments: Vec<LSegment> = Vec::new();
        let mut index = vec![0u32; rank];
        let mut base_index: Vec<u32> = Vec::with_capacity(rank);
        // The cell that held the previous piece: it mostly holds the next one too.
        let mut current: Option<Held> = None;
        for row in 0..rows {
            let mut rest = row;
            for a in (0..rank - 1).rev() {
                index[a] = (rest % shape[a] as u64) as u32;
                rest /= shape[a] as u64;
            }
            let mut c = 0;
            while c < cols {
                index[rank - 1] = c;
                let run = chain.map_run_into(&index, cols - c, &mut base_index);
                let inside = |h: &Held| h.block.iter().zip(&base_index).all(|(r, &i)| r.0 <= i && i < r.1);
                let held = match current.take() {
                    Some(h) if inside(&h) => current.insert(h),
                    _ => {
                        let (cell, cell_block) = stored.grid.locate(&base_index);
                        current.insert(Held::plain(stored.grid.buffers[cell], cell_block, stored.dtype))
                    }
                };
                let last = held.block.len() - 1;
                let piece = run.min(held.block[last].1 - base_index[last]);
                let offset = held.loc(&base_index).offset * stored.dtype.bytes();
                push_segment(&mut segments, LSegment { buffer: held.buffer, offset, element: (row * cols as u64 + c as u64) as u32, count: piece, rows: 1, element_stride: 0, offset_stride: 0, element_step: 1 }, stored.dtype.bytes());
                c += piece;
            }
        }
        LHostTensor { name: v.name.clone(), shape: shape.clone(), dtype: v.dtype, role, segments: merge_segments(segments, v.dtype) }
    }

    /// Words `tile` must receive to hold `block` of a value seen through `chain` (0 when the
    /// host writes it, or when the block is a cell already on the tile).
    fn remote_words(&self, chain: &ViewChain, dtype: DType, tile: u32, block: &[(u32, u32)]) -> u64 {
        let Some(stored) = self.stored.get(&chain.base) else { return 0 };
        let total: u64 = block.iter().map(|r| (r.1 - r.0) as u64).product::<u64>() * dtype.bytes() as u64 / 4;
        if chain.is_identity() {
            if stored.grid.cell_holding(block).is_some_and(|cell| stored.grid.tiles[cell] == tile) {
                return 0;
            }
        }
        total
    }

    /// Gather the epilogue addend for the output block rows `rows` x columns `cols` onto `tile`.
    fn gather_addend(&mut self, fold: Option<Epilogue>, tile: u32, rows: (u32, u32), cols: (u32, u32)) -> Result<Option<Addend<Loc>>, LowerError> {
        let Some(e) = fold else { return Ok(None) };
        let (block, first) = match e.broadcast {
            Broadcast::Row => (vec![cols], vec![cols.0]),
            Broadcast::Column => (vec![rows], vec![rows.0]),
            Broadcast::Full => (vec![rows, cols], vec![rows.0, cols.0]),
            Broadcast::RowScale => return Err(LowerError::Unsupported { operation: self.operation_name.clone(), message: "a folded add cannot be a row scale".into() }),
        };
        let held = self.gather(e.addend, tile, &block, false, 0, false)?;
        Ok(Some(Addend { operand: held.loc(&first), broadcast: e.broadcast }))
    }

    /// The row scale `value` (a deferred softmax's reciprocals, one fp32 factor per row) for
    /// rows `rows` of batch `batches` (rank-3 products) gathered onto `tile`.
    fn gather_row_scale(&mut self, value: Option<ValueId>, tile: u32, batches: Option<(u32, u32)>, rows: (u32, u32)) -> Result<Option<Held>, LowerError> {
        let Some(value) = value else { return Ok(None) };
        let block = match batches {
            Some(b) => vec![b, rows, (0, 1)],
            None => vec![rows, (0, 1)],
        };
        self.gather(value, tile, &block, false, 0, false).map(Some)
    }

    /// A matrix product; `output` is the product's value, or with `fold` the folded add's.
    /// `row_scale`: the reciprocals of the softmax that produced A, whose normalisation the
    /// product's epilogue (or its reduction's) applies.
    #[allow(clippy::too_many_arguments)]
    fn matmul(&mut self, index: usize, a: ValueId, b: ValueId, b_transposed: bool, product: ValueId, fold: Option<Epilogue>, row_scale: Option<ValueId>) -> Result<(), LowerError> {
        let prepared = self.matmul_prepare(index, a, b, b_transposed, product, fold, row_scale, (0, self.target.chip.tiles), false)?;
        let step = self.matmul_emit(&prepared);
        let reduction = self.matmul_reduction(&prepared)?;
        self.matmul_finish(prepared, step, reduction)
    }

    /// Sibling products (`orient::sibling_groups`, program order): side by side on disjoint
    /// equal ranges of tiles when the plans the planner makes for those ranges are estimated
    /// faster (the slowest member's compute and exchange) than the members' plans on the whole
    /// chip one after another (their sum). Side by side, their operands arrive in one exchange
    /// phase, their calls run in one compute set, and their partials arrive and are reduced
    /// together; whether they did is returned. Else only the first is lowered here, and the
    /// others where they stand in the program, as any product.
    fn matmul_group(&mut self, members: &[GroupMember]) -> Result<bool, LowerError> {
        let chip = self.target.chip.tiles;
        let n = members.len() as u32;
        // Even shares keep supertile pairs inside a range.
        let share = (chip / n) & !1;
        let name_of = |b: &Builder, index: usize| b.graph.value(b.graph.operations[index].output).name.clone();
        let mut apart = 0u64;
        let (mut compute, mut exchange) = (0u64, 0u64);
        let mut fits = share >= 2;
        for (i, &(index, a, b, tb, product, fold)) in members.iter().enumerate() {
            self.operation_index = index;
            self.operation_name = name_of(self, index);
            let whole = self.matmul_prepare(index, a, b, tb, product, fold, None, (0, chip), true)?;
            apart += whole.plan.total();
            if fits {
                match self.matmul_prepare(index, a, b, tb, product, fold, None, (i as u32 * share, share), true) {
                    Ok(p) => {
                        compute = compute.max(p.plan.compute_cycles);
                        exchange = exchange.max(p.plan.exchange_cycles);
                    }
                    Err(_) => fits = false,
                }
            }
        }
        if !fits || compute + exchange >= apart {
            let (index, a, b, tb, product, fold) = members[0];
            self.operation_index = index;
            self.operation_name = name_of(self, index);
            self.matmul(index, a, b, tb, product, fold, None)?;
            return Ok(false);
        }
        debug!(products = n, tiles_each = share, estimated_cycles = compute + exchange, apart_estimated_cycles = apart, "sibling products side by side");
        let mut prepared = Vec::with_capacity(members.len());
        for (i, &(index, a, b, tb, product, fold)) in members.iter().enumerate() {
            self.operation_index = index;
            self.operation_name = name_of(self, index);
            prepared.push(self.matmul_prepare(index, a, b, tb, product, fold, None, (i as u32 * share, share), false)?);
        }
        let steps: Vec<u32> = prepared.iter().map(|p| self.matmul_emit(p)).collect();
        let mut reductions = Vec::with_capacity(prepared.len());
        for p in &prepared {
            self.operation_index = p.operation_index;
            self.operation_name = p.operation_name.clone();
            reductions.push(self.matmul_reduction(p)?);
        }
        for (i, ((p, step), reduction)) in prepared.into_iter().zip(steps).zip(reductions).enumerate() {
            self.operation_index = p.operation_index;
            self.operation_name = p.operation_name.clone();
            self.matmul_finish(p, step, reduction)?;
            // The group's estimate is its slowest member's, carried by the first.
            if let Some(plan) = self.plans.last_mut() {
                (plan.estimated_compute_cycles, plan.estimated_exchange_cycles) = if i == 0 { (compute, exchange) } else { (0, 0) };
            }
        }
        Ok(true)
    }

    /// Plan a matrix product on the tiles `range` (first, count), gather its operands and
    /// allocate its outputs or partials: everything before its compute set opens.
    #[allow(clippy::too_many_arguments)]
    fn matmul_prepare(&mut self, index: usize, a: ValueId, b: ValueId, b_transposed: bool, product: ValueId, fold: Option<Epilogue>, row_scale: Option<ValueId>, range: (u32, u32), plan_only: bool) -> Result<PreparedProduct, LowerError> {
        let output = fold.map_or(product, |f| self.graph.operations[f.add].output);
        if fold.is_some() && row_scale.is_some() {
            return Err(LowerError::Unsupported { operation: self.operation_name.clone(), message: "a product with both a folded add and a deferred softmax normalisation".into() });
        }
        let (av, bv) = (self.graph.value(a).clone(), self.graph.value(b).clone());
        let (batches, m, k) = split3(&av.shape);
        let (b_batches, b0, b1) = split3(&bv.shape);
        let n = if b_transposed { b0 } else { b1 };
        let group = batches / b_batches;
        let a_rank3 = av.shape.len() == 3;
        let b_rank3 = bv.shape.len() == 3;
        let whole_rows = needs_whole_rows(self.graph, output);
        let a_block = |p: &MatMulPlan, ib: usize, im: usize, ik: usize| -> Vec<(u32, u32)> {
            let mut blk = vec![(p.m_cuts[im], p.m_cuts[im + 1]), (p.k_cuts[ik], p.k_cuts[ik + 1])];
            if a_rank3 {
                blk.insert(0, (p.b_cuts[ib], p.b_cuts[ib + 1]));
            }
            blk
        };
        let b_block = |p: &MatMulPlan, ib: usize, i_n: usize, ik: usize| -> Vec<(u32, u32)> {
            let (kr, nr) = ((p.k_cuts[ik], p.k_cuts[ik + 1]), (p.n_cuts[i_n], p.n_cuts[i_n + 1]));
            let mut blk = if b_transposed { vec![nr, kr] } else { vec![kr, nr] };
            if b_rank3 {
                blk.insert(0, (p.b_cuts[ib] / group, (p.b_cuts[ib + 1] - 1) / group + 1));
            }
            blk
        };
        let coords = |p: &MatMulPlan, tile: u32| p.coords(tile);
        // Operands are resolved once: the planner asks for every tile of every candidate.
        let a_chain = ViewChain::resolve(self.graph, a);
        let a_stored = self.stored.contains_key(&a_chain.base);
        // A host input block that several tiles hold is written by the host once and copied to
        // the others by the input phase at step 0 (`host.rs`): each copy is received over the
        // exchange like a gathered operand, so the planner counts its words (pairing, which
        // can halve a phase, is not modelled, as for every gather).
        let is_input = |v: ValueId| matches!(self.graph.value(v).producer, Producer::Tensor { role: Role::Input, .. });
        let words_of = |blk: &[(u32, u32)], bytes: u32| blk.iter().map(|r| (r.1 - r.0) as u64).product::<u64>() * bytes as u64 / 4;
        let total_words = |shape: &[u32], bytes: u32| shape.iter().map(|&d| d as u64).product::<u64>() * bytes as u64 / 4;
        let a_input = !self.stored.contains_key(&a_chain.base) && is_input(a_chain.base);
        let a_total = total_words(&av.shape, av.dtype.bytes());
        // Replicated: the tiles hold more words of the operand than it has.
        let a_replicated = |p: &MatMulPlan| a_input && p.tiles() as u64 * words_of(&a_block(p, 0, 0, 0), av.dtype.bytes()) > a_total;
        // When A's producer stores cells no wider than an AMP panel (gemm_block columns), a row-major
        // A block would gather in runs of one cell row each; in panels, the rows of a cell arrive
        // as one contiguous run.
        let gemm_block = self.target.costs.gemm_block as u32;
        let narrow_cells = a_chain.is_identity()
            && self.stored.get(&a_chain.base).and_then(|s| s.grid.cuts.last()).is_some_and(|c| c.windows(2).all(|w| w[1] - w[0] <= gemm_block));
        let panel = if narrow_cells { gemm_block } else { 0 };
        let remote_a = |p: &MatMulPlan, tile: u32| {
            if a_replicated(p) {
                let (ib, im, _, ik) = coords(p, tile);
                return words_of(&a_block(p, ib, im, ik), av.dtype.bytes());
            }
            if !a_stored {
                return 0;
            }
            let (ib, im, _, ik) = coords(p, tile);
            let block = a_block(p, ib, im, ik);
            if self.already_gathered(a, tile, &block, panel, false) {
                return 0;
            }
            self.remote_words(&a_chain, av.dtype, tile, &block)
        };
        let b_chain = ViewChain::resolve(self.graph, b);
        let b_stored = self.stored.contains_key(&b_chain.base);
        let home_b = self.origin.get(self.operation_index).map_or(self.operation_index, |&o| o as usize) >= self.home_from
            && !b_rank3
            && b_chain.is_identity()
            && matches!(bv.producer, Producer::Tensor { role: Role::Weight, .. });
        let b_input = !b_stored && !home_b && is_input(b_chain.base);
        let b_total = total_words(&bv.shape, bv.dtype.bytes());
        let b_replicated = |p: &MatMulPlan| b_input && p.tiles() as u64 * words_of(&b_block(p, 0, 0, 0), bv.dtype.bytes()) > b_total;
        let remote_b = |p: &MatMulPlan, tile: u32| {
            let (ib, im, i_n, ik) = coords(p, tile);
            let block = b_block(p, ib, i_n, ik);
            if home_b {
                // Every row partition but the home one receives the block by multicast.
                let words = block.iter().map(|r| (r.1 - r.0) as u64).product::<u64>() * bv.dtype.bytes() as u64 / 4;
                return if p.pm > 1 && im != 0 { words } else { 0 };
            }
            if b_replicated(p) {
                return words_of(&block, bv.dtype.bytes());
            }
            if !b_stored {
                return 0;
            }
            self.remote_words(&b_chain, bv.dtype, tile, &block)
        };
        // Balanced splits put larger pieces first, so the first row, column and inner pieces
        // (over every batch piece) bound what any tile receives.
        let gather_bound = |p: &MatMulPlan| {
            let words = |blk: Vec<(u32, u32)>, bytes: u32| blk.iter().map(|r| (r.1 - r.0) as u64).product::<u64>() * bytes as u64 / 4;
            let nb = p.b_cuts.len() - 1;
            let a_words = if a_stored || a_replicated(p) { (0..nb).map(|ib| words(a_block(p, ib, 0, 0), av.dtype.bytes())).max().unwrap_or(0) } else { 0 };
            let b_remote = b_stored || (home_b && p.pm > 1) || b_replicated(p);
            let b_words = if b_remote { (0..nb).map(|ib| words(b_block(p, ib, 0, 0), bv.dtype.bytes())).max().unwrap_or(0) } else { 0 };
            (a_words, b_words)
        };
        let graph = self.graph;
        let original_name = graph.value(self.checkpoint_value.get(&product).copied().unwrap_or(product)).name.clone();
        let constraint = graph.file.constraints.iter().find(|c| c.operation == original_name);
        let epilogue = fold.map(|f| f.broadcast).or(row_scale.map(|_| Broadcast::RowScale));
        let m_align = if self.row_read.contains(&output) { self.row_read_align() } else { 1 };
        // A replicated weight has one replica per row partition (B) or column partition (A, a
        // swapped product's weight): the program's replication cap bounds those partitions.
        let is_weight = |base: ValueId| matches!(graph.value(base).producer, Producer::Tensor { role: Role::Weight, .. });
        let max_row_partitions = if !b_stored && !home_b && !b_rank3 && is_weight(b_chain.base) { self.replication_cap } else { u32::MAX };
        let max_column_partitions = if !a_stored && !a_rank3 && is_weight(a_chain.base) { self.replication_cap } else { u32::MAX };
        let problem = MatMulProblem { batches, m, k, n, b_transposed, whole_rows, m_align, epilogue, remote_a_words: &remote_a, remote_b_words: &remote_b, gather_bound: &gather_bound, a_gathered: a_stored || a_input, b_gathered: b_stored || home_b || b_input, a_stored, b_stored, memory_budget: self.budget(), interleaved_budget: self.interleaved_budget(), standard_budget: self.standard_budget(), constraint, max_row_partitions, max_column_partitions, max_block_bytes: self.block_cap, first_tile: range.0, tiles: range.1 };
        let layout = |chain: &ViewChain| match self.stored.get(&chain.base) {
            Some(s) => format!("{} stored {:?} {:?}", chain.signature(), s.grid.cuts, s.grid.tiles),
            None => format!("{} host", chain.signature()),
        };
        let parts = format!("{b_batches} {a_rank3} {b_rank3} {home_b} {a_input} {b_input} {:?} {:?}|A {} {}|B {}", av.dtype, bv.dtype, layout(&a_chain), self.gathered_signature(a), layout(&b_chain));
        let key = candidates::signature(self.target, &problem, &parts);
        let planned = candidates::planned(self.target, &problem, key).map_err(|no| match constraint {
            Some(_) => LowerError::Constraint { operation: original_name.clone(), reason: no.reason },
            None => LowerError::NoPlan { operation: self.operation_name.clone(), kind: "matmul".into(), budget: self.budget(), tiles: self.target.chip.tiles, least: no.least },
        })?;
        let plan = planned.plan;
        if plan_only {
            // The plan alone (`matmul_group` weighs side by side against one after another).
            return Ok(PreparedProduct { index, product, output, fold, row_scale, plan, matching_plans: planned.matching_plans, b_transposed, a_rank3, b_rank3, group, m_align, by_columns: false, out_name: String::new(), original_name, described: String::new(), operation_index: self.operation_index, operation_name: self.operation_name.clone(), work: Vec::new() });
        }
        if !plan.weights_standard {
            self.interleaved_weights.insert(self.operation_index as u32);
        }
        self.gemm_flops += 2 * batches as u64 * m as u64 * k as u64 * n as u64;
        if home_b {
            self.home_weight(b, &plan, b_transposed);
        }
        let (nb, nm, nn, nk) = (plan.b_cuts.len() - 1, plan.m_cuts.len() - 1, plan.n_cuts.len() - 1, plan.k_cuts.len() - 1);
        let out_name = self.graph.value(output).name.clone();
        // The AMP's 128-bit weight loads need a B row pitch of whole `weight_load_alignment`
        // groups: a gathered B block whose rows are narrower is stored as one panel that wide
        // (its rows padded), so that it loads as interleaved weights. 0: rows as they are.
        let align = (self.target.memory.weight_load_alignment / bv.dtype.bytes()).max(1);
        let b_pitch = |p: &MatMulPlan, i_n: usize, ik: usize| -> u32 {
            let width = if b_transposed { p.k_cuts[ik + 1] - p.k_cuts[ik] } else { p.n_cuts[i_n + 1] - p.n_cuts[i_n] };
            if p.weights_standard || width.is_multiple_of(align) { 0 } else { width.div_ceil(align) * align }
        };
        // Partials reduced by column panels are written as panels of `gemm_block` columns.
        let by_columns = column_reduction(&plan.n_cuts, nk as u32, gemm_block);
        let c_panel = if by_columns { gemm_block } else { 0 };
        // Gather operands and allocate outputs (or partials) per work item.
        let mut work = Vec::new();
        for ib in 0..nb {
            for im in 0..nm {
                for i_n in 0..nn {
                    for ik in 0..nk {
                        let tile = plan.tile_of(ib, im, i_n, ik);
                        let ha = self.gather(a, tile, &a_block(&plan, ib, im, ik), false, panel, false)?;
                        let hb = self.gather(b, tile, &b_block(&plan, ib, i_n, ik), !plan.weights_standard || constraint.is_none_or(|c| c.weight_memory.is_none()), b_pitch(&plan, i_n, ik), false)?;
                        let (br, mr, nr) = ((plan.b_cuts[ib], plan.b_cuts[ib + 1]), (plan.m_cuts[im], plan.m_cuts[im + 1]), (plan.n_cuts[i_n], plan.n_cuts[i_n + 1]));
                        let (dtype, kind) = if nk > 1 { (DType::F32, AllocationKind::Partials) } else { (DType::F16, AllocationKind::Data) };
                        let label = if nk > 1 { format!("{out_name}.partials") } else { out_name.clone() };
                        let out_block = if a_rank3 { vec![br, mr, nr] } else { vec![mr, nr] };
                        // Without partials the product's own call adds the addend.
                        let add = if nk == 1 { self.gather_addend(fold, tile, mr, nr)? } else { None };
                        let scale = if nk == 1 { self.gather_row_scale(row_scale, tile, a_rank3.then_some(br), mr)? } else { None };
                        let hc = Held { buffer: u32::MAX, block: out_block, dtype, panel: c_panel, tight_last: false };
                        let buffer = self.buffer(tile, hc.stored_elements() * dtype.bytes() as u64, kind, kind == AllocationKind::Partials, &label);
                        work.push((tile, ib, im, i_n, ik, ha, hb, Held { buffer, ..hc }, add, scale));
                    }
                }
            }
        }
        Ok(PreparedProduct { index, product, output, fold, row_scale, plan, matching_plans: planned.matching_plans, b_transposed, a_rank3, b_rank3, group, m_align, by_columns, out_name, original_name, described: {
            // The user's constraint, and the program's replication cap where it bounded this
            // plan (`replicas_at_most=N`, which a re-plan of the program reads back).
            let mut described = constraint.map(|c| c.describe()).unwrap_or_default();
            if max_row_partitions.min(max_column_partitions) < u32::MAX {
                if !described.is_empty() {
                    described.push(' ');
                }
                described += &format!("{REPLICAS_AT_MOST}{}", self.replication_cap);
            }
            described
        }, operation_index: self.operation_index, operation_name: self.operation_name.clone(), work })
    }

    /// Open (or join) the compute set of a prepared product and emit its calls.
    fn matmul_emit(&mut self, p: &PreparedProduct) -> u32 {
        let (plan, a_rank3, b_rank3, b_transposed, group) = (&p.plan, p.a_rank3, p.b_rank3, p.b_transposed, p.group);
        let nk = plan.k_cuts.len() - 1;
        let step = self.open_compute();
        for (tile, ib, im, i_n, ik, ha, hb, hc, add, scale) in &p.work {
            let (kr, nr, mr) = ((plan.k_cuts[*ik], plan.k_cuts[*ik + 1]), (plan.n_cuts[*i_n], plan.n_cuts[*i_n + 1]), (plan.m_cuts[*im], plan.m_cuts[*im + 1]));
            for batch in plan.b_cuts[*ib]..plan.b_cuts[*ib + 1] {
                let with_batch = |rank3: bool, v: Vec<u32>, bi: u32| if rank3 { [vec![bi], v].concat() } else { v };
                let a_loc = ha.loc(&with_batch(a_rank3, vec![mr.0, kr.0], batch));
                let b_first = if b_transposed { vec![nr.0, kr.0] } else { vec![kr.0, nr.0] };
                let b_loc = hb.loc(&with_batch(b_rank3, b_first, batch / group));
                let c_loc = hc.loc(&with_batch(a_rank3, vec![mr.0, nr.0], batch));
                let add = match scale {
                    Some(h) => Some(row_scale_addend(h, a_rank3.then_some((batch, batch + 1)), mr.0)),
                    None => *add,
                };
                let call = Call::MatMul { m: mr.1 - mr.0, k: kr.1 - kr.0, n: nr.1 - nr.0, a: a_loc, a_panel: ha.panel, b: b_loc, b_transposed, c: c_loc, c_panel: hc.panel, partials: nk > 1, add };
                self.emit(step, *tile, call);
            }
        }
        step
    }

    /// The reduction of a prepared product's inner partials, its transfers pending (none
    /// without inner partitions).
    fn matmul_reduction(&mut self, p: &PreparedProduct) -> Result<Option<PendingReduction>, LowerError> {
        if p.plan.k_cuts.len() == 2 {
            return Ok(None);
        }
        let partials: Vec<(u32, u32)> = p.work.iter().map(|w| (w.0, w.7.buffer)).collect();
        let reduction = if p.by_columns {
            self.reduce_by_columns(&p.plan, &partials, p.a_rank3, &p.out_name, p.fold, p.row_scale)?
        } else {
            self.reduce(&p.plan, p.m_align, &partials, p.a_rank3, &p.out_name, p.fold, p.row_scale)?
        };
        Ok(Some(reduction))
    }

    /// Emit a prepared product's reduction (opening or joining its compute set) and record the
    /// product: its output grid, plan and checkpoint.
    fn matmul_finish(&mut self, p: PreparedProduct, step: u32, reduction: Option<PendingReduction>) -> Result<(), LowerError> {
        let plan = &p.plan;
        let mut grid = Grid { cuts: Vec::new(), tiles: Vec::new(), buffers: Vec::new() };
        let final_step = match reduction {
            None => {
                grid.cuts = if p.a_rank3 { vec![plan.b_cuts.clone(), plan.m_cuts.clone(), plan.n_cuts.clone()] } else { vec![plan.m_cuts.clone(), plan.n_cuts.clone()] };
                for (tile, .., hc, _, _) in &p.work {
                    grid.tiles.push(*tile);
                    grid.buffers.push(hc.buffer);
                }
                step
            }
            Some(r) => self.emit_reduction(r, &mut grid),
        };
        let swapped = self.checkpoint_value.contains_key(&p.product);
        let op_plan = OperationPlan {
            operation: p.index as u32,
            value: p.original_name.clone(),
            kind: "matmul".into(),
            orientation: if swapped { "swapped" } else { "normal" }.into(),
            weight_memory: if plan.weights_standard { "standard" } else { "interleaved" }.into(),
            constraint: p.described.clone(),
            matching_plans: p.matching_plans,
            partitions: [plan.pb, plan.pm, plan.pn, plan.pk],
            tiles: plan.tiles(),
            estimated_compute_cycles: plan.compute_cycles,
            estimated_exchange_cycles: plan.exchange_cycles,
            peak_bytes: plan.peak_bytes,
        };
        // A folded add's value is what the product stores: the checkpoint is the add's, the
        // plan the product's.
        let index = p.index;
        self.record(p.fold.map_or(index, |f| f.add), p.output, grid, DType::F16, final_step, op_plan);
        if let Some(plan) = self.plans.last_mut() {
            plan.operation = self.origin.get(index).copied().unwrap_or(index as u32);
        }
        Ok(())
    }

    /// The host tensor of host value `id` (`base` its value), made empty on first use; shared
    /// with earlier partial programs until written (copy-on-write).
    fn host_tensor(&mut self, id: ValueId, base: &Value, role: Role, dtype: DType) -> &mut LHostTensor {
        Arc::make_mut(self.host.entry(id).or_insert_with(|| {
            Arc::new(LHostTensor {
                name: base.name.clone(),
                shape: base.shape.clone(),
                dtype,
                role: if role == Role::Weight { HostRole::Weight } else { HostRole::Input },
                segments: Vec::new(),
            })
        }))
    }

    /// Store each B block of a rank-2 weight once, on one tile of its (column, inner) group, the
    /// row partition rotating with the cell and the operation so homes spread over all tiles.
    /// The host writes each block once; the matrix product's gather multicasts it.
    fn home_weight(&mut self, weight: ValueId, plan: &MatMulPlan, b_transposed: bool) {
        let value = self.graph.value(weight).clone();
        let nm = plan.m_cuts.len() - 1;
        let cuts = if b_transposed { vec![plan.n_cuts.clone(), plan.k_cuts.clone()] } else { vec![plan.k_cuts.clone(), plan.n_cuts.clone()] };
        let mut grid = Grid { cuts, tiles: Vec::new(), buffers: Vec::new() };
        let mut segments = Vec::new();
        let cells = (grid.cuts[0].len() - 1) * (grid.cuts[1].len() - 1);
        let rotation = if self.home_aligned { aligned_home_slot(self.graph, weight).unwrap_or(self.home_rotation) } else { self.home_rotation };
        for cell in 0..cells {
            let block = grid.cell_block(cell);
            let (c0, c1) = (cell / (grid.cuts[1].len() - 1), cell % (grid.cuts[1].len() - 1));
            let (ik, i_n) = if b_transposed { (c1, c0) } else { (c0, c1) };
            let bytes = block_elements_stored(&block, value.dtype) * value.dtype.bytes() as u64;
            let first = (i_n + ik + rotation) % nm;
            let period = if self.home_period { period_home_slot(self.graph, weight) } else { None };
            let tile = if self.home_aligned {
                plan.tile_of(0, first, i_n, ik)
            } else if let Some((slot, repeat, repeats)) = period {
                // The first repeat takes the row partition that leaves the cell's tiles least
                // loaded once every repeat of the block is homed on from it (ties in rotation
                // order from `first`); the later ones rotate on from it.
                let key = (slot, nm, cells, cell);
                let base = match self.home_bases.get(&key) {
                    Some(&base) => base,
                    None => {
                        let tiles: Vec<u32> = (0..nm).map(|row| plan.tile_of(0, row, i_n, ik)).collect();
                        let left = repeats - repeat;
                        let count = |base: usize, row: usize| (0..left).filter(|r| (base + r) % nm == row).count() as u64;
                        let load = Arc::make_mut(&mut self.home_load);
                        let most = tiles.iter().max().map_or(0, |&t| t as usize);
                        if load.len() <= most {
                            load.resize(most + 1, 0);
                        }
                        let fullest = |base: usize| (0..nm).map(|row| load[tiles[row] as usize] + count(base, row) * bytes).max().unwrap_or(0);
                        let base = (0..nm).map(|d| (first + d) % nm).min_by_key(|&b| fullest(b)).unwrap_or(first);
                        for row in 0..nm {
                            load[tiles[row] as usize] += count(base, row) * bytes;
                        }
                        // Stored as the first repeat's row, whichever repeat met the cell first.
                        let first_row = (base + nm - repeat % nm) % nm;
                        Arc::make_mut(&mut self.home_bases).insert(key, first_row);
                        first_row
                    }
                };
                plan.tile_of(0, (base + repeat) % nm, i_n, ik)
            } else {
                // The least-loaded tile of the block's row partitions, ties in rotation order.
                let load = Arc::make_mut(&mut self.home_load);
                let tile = (0..nm).map(|d| plan.tile_of(0, (first + d) % nm, i_n, ik)).min_by_key(|&t| load.get(t as usize).copied().unwrap_or(0)).unwrap_or_else(|| plan.tile_of(0, first, i_n, ik));
                if load.len() <= tile as usize {
                    load.resize(tile as usize + 1, 0);
                }
                load[tile as usize] += bytes;
                tile
            };
            let buffer = self.buffer(tile, bytes, AllocationKind::Data, true, &value.name);
            let stride = row_stride(block[1].1 - block[1].0, value.dtype);
            for r in block[0].0..block[0].1 {
                segments.push(LSegment {
                    buffer,
                    offset: (r - block[0].0) * stride * value.dtype.bytes(),
                    element: r * value.shape[1] + block[1].0,
                    count: block[1].1 - block[1].0,
                    rows: 1,
                    element_stride: 0,
                    offset_stride: 0,
                    element_step: 1,
                });
            }
            grid.tiles.push(tile);
            grid.buffers.push(buffer);
        }
        self.home_rotation += 1;
        // Merged now, each block in its own buffer (as the walked blocks of `gather`).
        let segments = merge_segments(segments, value.dtype);
        let marked: Vec<u32> = segments.iter().map(|s| s.buffer).collect();
        let replaced = self.host.insert(weight, Arc::new(LHostTensor { name: value.name.clone(), shape: value.shape.clone(), dtype: value.dtype, role: HostRole::Weight, segments }));
        if replaced.is_some() {
            // The buffers of the segments replaced are no longer written by the host.
            self.host_marks = self.host.values().flat_map(|t| t.segments.iter().map(|s| s.buffer)).collect();
            self.watch.changed += 1;
        } else {
            for b in marked {
                self.mark_host(b);
            }
        }
        self.store(weight, Stored { grid, dtype: value.dtype });
    }

    /// Reduce the inner partials of each (batch, row, column) block by column panels: member j
    /// of a group owns panel j (all rows), receives the others' panel j (one contiguous run
    /// each) and sums them into f16. The value is stored in cells one panel wide.
    #[allow(clippy::too_many_arguments)]
    fn reduce_by_columns(&mut self, plan: &MatMulPlan, partials: &[(u32, u32)], rank3: bool, name: &str, fold: Option<Epilogue>, row_scale: Option<ValueId>) -> Result<PendingReduction, LowerError> {
        let (nb, nm, nn, nk) = (plan.b_cuts.len() - 1, plan.m_cuts.len() - 1, plan.n_cuts.len() - 1, plan.k_cuts.len() - 1);
        let w = self.target.costs.gemm_block as u32;
        let mut col_cuts = vec![0u32];
        for i_n in 0..nn {
            let (c0, c1) = (plan.n_cuts[i_n], plan.n_cuts[i_n + 1]);
            col_cuts.extend((1..=nk as u32).map(|j| (c0 + j * w).min(c1)));
        }
        let mut reductions = Vec::new();
        for ib in 0..nb {
            // The planner splits the inner axis only when batch pieces are one element.
            let batches = plan.b_cuts[ib + 1] - plan.b_cuts[ib];
            for im in 0..nm {
                let rows = (plan.m_cuts[im + 1] - plan.m_cuts[im]) * batches;
                for i_n in 0..nn {
                    let (c0, c1) = (plan.n_cuts[i_n], plan.n_cuts[i_n + 1]);
                    let group = &partials[((ib * nm + im) * nn + i_n) * nk..][..nk];
                    for (j, &(owner, _)) in group.iter().enumerate() {
                        let col = c0 + j as u32 * w;
                        let cols = w.min(c1 - col);
                        let parts = self.gather_partials(group, j, j as u32 * rows * w, rows, w, name);
                        let out = self.buffer(owner, rows as u64 * row_stride(cols, DType::F16) as u64 * 2, AllocationKind::Data, false, name);
                        // Folds are rank-2 only, so a batch piece is one element here.
                        let add = self.gather_addend(fold, owner, (plan.m_cuts[im], plan.m_cuts[im + 1]), (col, col + cols))?;
                        let batch = self.single_batch(plan, ib, rank3)?;
                        let add = match self.gather_row_scale(row_scale, owner, batch, (plan.m_cuts[im], plan.m_cuts[im + 1]))? {
                            Some(h) => Some(row_scale_addend(&h, batch, plan.m_cuts[im])),
                            None => add,
                        };
                        reductions.push(((ib as u64, im as u64, col as u64), owner, rows, cols, parts, out, add));
                    }
                }
            }
        }
        let cuts = if rank3 { vec![plan.b_cuts.clone(), plan.m_cuts.clone(), col_cuts] } else { vec![plan.m_cuts.clone(), col_cuts] };
        Ok(PendingReduction { reductions, cuts })
    }

    /// Open (or join) the compute set of a reduction whose transfers are pending, emit its
    /// calls, and describe the reduced value's cells in `grid`.
    fn emit_reduction(&mut self, r: PendingReduction, grid: &mut Grid) -> u32 {
        let step = self.open_compute();
        let mut cells: BTreeMap<(u64, u64, u64), (u32, u32)> = BTreeMap::new();
        for (key, owner, rows, cols, parts, out, add) in r.reductions {
            let out_loc = Loc { buffer: out, offset: 0, row_stride: row_stride(cols, DType::F16), dtype_bytes: 2 };
            self.emit(step, owner, Call::Reduce { rows, cols, parts, out: out_loc, add });
            cells.insert(key, (owner, out));
        }
        grid.cuts = r.cuts;
        for (_, (tile, buffer)) in cells {
            grid.tiles.push(tile);
            grid.buffers.push(buffer);
        }
        step
    }

    /// The batch piece `ib` of a reduced rank-3 product as a block range (a reduction's rows
    /// are one batch's: the planner splits the inner axis only when batch pieces are one
    /// element); `None` for rank-2 products.
    fn single_batch(&self, plan: &MatMulPlan, ib: usize, rank3: bool) -> Result<Option<(u32, u32)>, LowerError> {
        if !rank3 {
            return Ok(None);
        }
        let (b0, b1) = (plan.b_cuts[ib], plan.b_cuts[ib + 1]);
        if b1 - b0 != 1 {
            return Err(LowerError::Unsupported { operation: self.operation_name.clone(), message: format!("a reduction over a batch piece of {} batches", b1 - b0) });
        }
        Ok(Some((b0, b1)))
    }

    /// The fp32 partials member `j` of a reduction group sums: its own at `offset` (words) in
    /// place, every other member's same `rows` × `stride` words received into a new buffer on
    /// member j's tile (a pending transfer).
    fn gather_partials(&mut self, group: &[(u32, u32)], j: usize, offset: u32, rows: u32, stride: u32, name: &str) -> Vec<Loc> {
        let owner = group[j].0;
        let mut parts = Vec::with_capacity(group.len());
        for (i, &(_, buffer)) in group.iter().enumerate() {
            if i == j {
                parts.push(Loc { buffer, offset, row_stride: stride, dtype_bytes: 4 });
            } else {
                let words = rows * stride;
                let received = self.buffer(owner, words as u64 * 4, AllocationKind::Partials, true, &format!("{name}.partials"));
                self.pending.push((buffer, offset * 4), words, (received, 0));
                parts.push(Loc { buffer: received, offset: 0, row_stride: stride, dtype_bytes: 4 });
            }
        }
        parts
    }

    /// Reduce the inner partials of each (batch, row, column) block: member j of a group owns
    /// row chunk j, receives the others' partials for it, and sums them into f16.
    #[allow(clippy::too_many_arguments)]
    fn reduce(&mut self, plan: &MatMulPlan, m_align: u32, partials: &[(u32, u32)], rank3: bool, name: &str, fold: Option<Epilogue>, row_scale: Option<ValueId>) -> Result<PendingReduction, LowerError> {
        let (nb, nm, nn, nk) = (plan.b_cuts.len() - 1, plan.m_cuts.len() - 1, plan.n_cuts.len() - 1, plan.k_cuts.len() - 1);
        let mut row_cuts = vec![0u32];
        for im in 0..nm {
            for c in split(plan.m_cuts[im + 1] - plan.m_cuts[im], nk as u32, m_align).into_iter().skip(1) {
                row_cuts.push(plan.m_cuts[im] + c);
            }
        }
        let mut reductions = Vec::new();
        for ib in 0..nb {
            for im in 0..nm {
                let chunks = split(plan.m_cuts[im + 1] - plan.m_cuts[im], nk as u32, m_align);
                for i_n in 0..nn {
                    let cols = plan.n_cuts[i_n + 1] - plan.n_cuts[i_n];
                    let stride32 = row_stride(cols, DType::F32);
                    let group: Vec<(u32, u32)> = (0..nk).map(|ik| partials[(((ib * nm + im) * nn + i_n) * nk) + ik]).collect();
                    for j in 0..chunks.len() - 1 {
                        let (owner, _) = group[j];
                        let rows = chunks[j + 1] - chunks[j];
                        let parts = self.gather_partials(&group, j, chunks[j] * stride32, rows, stride32, name);
                        let out = self.buffer(owner, rows as u64 * row_stride(cols, DType::F16) as u64 * 2, AllocationKind::Data, false, name);
                        let row0 = plan.m_cuts[im] + chunks[j];
                        let add = self.gather_addend(fold, owner, (row0, row0 + rows), (plan.n_cuts[i_n], plan.n_cuts[i_n + 1]))?;
                        let batch = self.single_batch(plan, ib, rank3)?;
                        let add = match self.gather_row_scale(row_scale, owner, batch, (row0, row0 + rows))? {
                            Some(h) => Some(row_scale_addend(&h, batch, row0)),
                            None => add,
                        };
                        reductions.push(((ib as u64, row0 as u64, i_n as u64), owner, rows, cols, parts, out, add));
                    }
                }
            }
        }
        let cuts = if rank3 { vec![plan.b_cuts.clone(), row_cuts, plan.n_cuts.clone()] } else { vec![row_cuts, plan.n_cuts.clone()] };
        Ok(PendingReduction { reductions, cuts })
    }

    /// An elementwise operation; a softmax with `scale` != 1 reads its input scaled (a scale
    /// pass folded into it), and with `reciprocals` leaves its rows unnormalised and stores
    /// 1 / sum per row in that value (its consumer's epilogue normalises).
    fn elementwise_scaled(&mut self, index: usize, kind: OpKind, inputs: &[ValueId], output: ValueId, scale: f32, reciprocals: Option<ValueId>) -> Result<(), LowerError> {
        let out = self.graph.value(output).clone();
        let chain = ViewChain::resolve(self.graph, inputs[0]);
        if matches!(kind, OpKind::BiasAdd) && self.checkpoint_value.contains_key(&chain.base) {
            // Its bias is one element per stored row: only the product's epilogue adds it so.
            return Err(LowerError::Unsupported { operation: out.name.clone(), message: "a bias add over a swapped product lowers only folded into the product's epilogue".into() });
        }
        if let OpKind::LayerNorm { eps } = kind {
            if let Some(cuts) = self.layer_norm_cuts(&out.shape) {
                return self.layer_norm_segmented(index, eps as f32, inputs, output, cuts);
            }
        }
        let reuse = chain.is_identity()
            && self.stored.get(&chain.base).is_some_and(|s| !super::elementwise::needs_whole_rows(&kind) || s.grid.cuts.last().is_some_and(|c| c.len() == 2));
        let (cuts, tiles): (Vec<Vec<u32>>, Vec<u32>) = if reuse {
            let s = &self.stored[&chain.base];
            (s.grid.cuts.clone(), s.grid.tiles.clone())
        } else {
            let rank = out.shape.len();
            let mut cuts: Vec<Vec<u32>> = out.shape.iter().map(|&d| vec![0, d]).collect();
            let mut cells = 1u32;
            for (a, cut) in cuts.iter_mut().enumerate().take(rank.saturating_sub(1)) {
                let parts = out.shape[a].min(self.target.chip.tiles / cells).max(1);
                // A swapped value written out transposed for a reader by rows: its rows are
                // that value's columns, which move and copy from aligned offsets only.
                let align = if a + 2 == rank && self.row_read.contains(&output) { self.row_read_align() } else { 1 };
                *cut = split(out.shape[a], parts, align);
                cells *= (cut.len() - 1) as u32;
            }
            if rank == 1 {
                let align = 8 / out.dtype.bytes();
                cuts[0] = split(out.shape[0], self.target.chip.tiles.min(out.shape[0] / align).max(1), align);
                cells = (cuts[0].len() - 1) as u32;
            }
            // A value that a LayerNorm splitting its rows reads (through operations that keep
            // its layout) is stored in that LayerNorm's segments, which it then reads in place.
            if row_consumers(self.graph, output) == (false, true) {
                if let Some(segmented) = self.layer_norm_cuts(&out.shape) {
                    if segmented[..rank - 1] == cuts[..rank - 1] {
                        cells = segmented.iter().map(|c| (c.len() - 1) as u32).product();
                        cuts = segmented;
                    }
                }
            }
            (cuts, (0..cells).collect())
        };
        // A row consumer (softmax) of cells split along the rows' axis reads its input in
        // panels one cell wide: each source cell's rows then arrive as one contiguous run
        // instead of one transfer per row.
        let gemm_block = self.target.costs.gemm_block as u32;
        let panel = match self.stored.get(&chain.base).and_then(|s| s.grid.cuts.last()) {
            Some(c) if !reuse && super::elementwise::reads_panels(&kind) && chain.is_identity() && c.len() > 2 => panel_width(c, gemm_block),
            _ => 0,
        };
        let mut grid = Grid { cuts, tiles, buffers: Vec::new() };
        let mut work = Vec::new();
        for cell in 0..grid.tiles.len() {
            let tile = grid.tiles[cell];
            let block = grid.cell_block(cell);
            // A 1-D row parameter (bias, gamma, beta) is gathered as the block's columns.
            let param_block = vec![block[block.len() - 1]];
            let held: Vec<Held> = inputs
                .iter()
                .enumerate()
                .map(|(i, &v)| self.gather(v, tile, if super::elementwise::is_row_parameter(&kind, i) { &param_block } else { &block }, false, if i == 0 { panel } else { 0 }, i == 0))
                .collect::<Result<_, _>>()?;
            let buffer = self.buffer(tile, block_elements_stored(&block, out.dtype) * out.dtype.bytes() as u64, AllocationKind::Data, false, &out.name);
            grid.buffers.push(buffer);
            // The row reciprocals: one fp32 element per row of the block.
            let r_held = match reciprocals {
                Some(r) => {
                    let mut r_block = block[..block.len() - 1].to_vec();
                    r_block.push((0, 1));
                    let name = self.graph.value(r).name.clone();
                    let r_buffer = self.buffer(tile, block_elements_stored(&r_block, DType::F32) * 4, AllocationKind::Data, false, &name);
                    Some(Held::plain(r_buffer, r_block, DType::F32))
                }
                None => None,
            };
            work.push((tile, block, held, Held::plain(buffer, grid.cell_block(cell), out.dtype), r_held));
        }
        let step = self.open_compute();
        let mut peak = 0u64;
        let mut compute = 0u64;
        let mut r_buffers = Vec::new();
        for (tile, block, held, out_held, r_held) in work {
            let rank = block.len();
            let cols = block[rank - 1].1 - block[rank - 1].0;
            // One call per leading row block whose rows are contiguous in every operand.
            let outer: Vec<Vec<u32>> = if rank == 3 { (block[0].0..block[0].1).map(|b| vec![b]).collect() } else { vec![vec![]] };
            let rows = if rank >= 2 { block[rank - 2].1 - block[rank - 2].0 } else { 1 };
            for prefix in outer {
                let mut first: Vec<u32> = prefix.clone();
                first.extend(block[prefix.len()..].iter().map(|r| r.0));
                let ins: Vec<Loc> = held.iter().map(|h| if h.block.len() < first.len() { h.loc(&first[first.len() - 1..]) } else { h.loc(&first) }).collect();
                let o = out_held.loc(&first);
                let r = r_held.as_ref().map(|h| h.loc(&[&first[..first.len() - 1], &[0]].concat()));
                let Some(call) = super::elementwise::call(&kind, rows, cols, &ins, o, scale, held[0].panel, r) else {
                    return Err(LowerError::Unsupported { operation: out.name.clone(), message: format!("{} is not an elementwise operation", kind.name()) });
                };
                compute += cost::vertex_with(self.target, &call, |_| false);
                self.emit(step, tile, call);
            }
            let r_bytes = r_held.as_ref().map_or(0, |h| block_elements_stored(&h.block, DType::F32) * 4);
            peak = peak.max(block_elements_stored(&block, out.dtype) * out.dtype.bytes() as u64 * (inputs.len() as u64 + 1) + r_bytes);
            r_buffers.extend(r_held.map(|h| h.buffer));
        }
        let value = self.graph.value(self.checkpoint_value.get(&output).copied().unwrap_or(output)).name.clone();
        let plan = elementwise_plan(index, value, &kind, grid.tiles.len() as u32, compute, 0, peak);
        if let Some(r) = reciprocals {
            let mut cuts = grid.cuts[..grid.cuts.len() - 1].to_vec();
            cuts.push(vec![0, 1]);
            let r_grid = Grid { cuts, tiles: grid.tiles.clone(), buffers: r_buffers };
            self.store(r, Stored { grid: r_grid, dtype: DType::F32 });
        }
        self.record(index, output, grid, out.dtype, step, plan);
        Ok(())
    }

    /// The cuts of a LayerNorm over `shape` whose rows are split into segments on several
    /// tiles (`elementwise::layer_norm_segments`): the leading axes cut as any elementwise
    /// operation's (a batch axis of rank 3 one index a cell), the columns into segments of
    /// whole 64-bit words. `None`: whole rows.
    fn layer_norm_cuts(&self, shape: &[u32]) -> Option<Vec<Vec<u32>>> {
        let (&cols, leading) = shape.split_last()?;
        if !(1..=2).contains(&leading.len()) {
            return None;
        }
        let tiles = self.target.chip.tiles;
        let mut cuts = Vec::new();
        let mut cells = 1u32;
        for &extent in leading {
            let cut = split(extent, extent.min(tiles / cells).max(1), 1);
            cells *= (cut.len() - 1) as u32;
            cuts.push(cut);
        }
        if leading.len() == 2 && cuts[0].len() - 1 != leading[0] as usize {
            return None;
        }
        let most_rows = cuts[cuts.len() - 1].windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        let segments = super::elementwise::layer_norm_segments(self.target, cells, most_rows, cols);
        if segments < 2 {
            return None;
        }
        let col_cuts = split(cols, segments, 4);
        if col_cuts.len() <= 2 {
            return None;
        }
        cuts.push(col_cuts);
        Some(cuts)
    }

    /// A LayerNorm whose rows are split into segments (`cuts`: rows, then columns), each cell
    /// on a tile of its own: the cells compute their rows' statistics (`LayerNormStatistics`),
    /// one exchange phase brings each cell the other segments' statistics of its rows (into a
    /// buffer of their own, segment-major, so that no tile receives into the buffer it sends
    /// from: the memory-element rule), and each cell normalises its block from all of them
    /// (`LayerNormSegment`). The input is read in place when it
    /// is stored in these cells (an operation that keeps its layout stored it so), else
    /// gathered onto them.
    fn layer_norm_segmented(&mut self, index: usize, eps: f32, inputs: &[ValueId], output: ValueId, cuts: Vec<Vec<u32>>) -> Result<(), LowerError> {
        let out = self.graph.value(output).clone();
        let chain = ViewChain::resolve(self.graph, inputs[0]);
        let tiles: Vec<u32> = match self.stored.get(&chain.base) {
            Some(s) if chain.is_identity() && s.grid.cuts[..] == cuts[..] => s.grid.tiles.clone(),
            _ => (0..cuts.iter().map(|c| (c.len() - 1) as u32).product::<u32>()).collect(),
        };
        let rank = cuts.len();
        let segments = (cuts[rank - 1].len() - 1) as u32;
        let mut grid = Grid { cuts, tiles, buffers: Vec::new() };
        let statistics_name = format!("{}.statistics", out.name);
        let others_name = format!("{}.segment_statistics", out.name);
        let words_per_record = super::elementwise::STATISTICS_WORDS as u32;
        let record_bytes = words_per_record * 4;
        // Per cell: tile, block, held input, gamma and beta, output buffer, its own statistics'
        // buffer and the other segments'.
        let mut work = Vec::new();
        let mut peak = 0u64;
        for cell in 0..grid.tiles.len() {
            let tile = grid.tiles[cell];
            let block = grid.cell_block(cell);
            let param_block = vec![block[rank - 1]];
            let held: Vec<Held> = inputs
                .iter()
                .enumerate()
                .map(|(i, &v)| self.gather(v, tile, if i > 0 { &param_block } else { &block }, false, 0, i == 0))
                .collect::<Result<_, _>>()?;
            let bytes = block_elements_stored(&block, out.dtype) * out.dtype.bytes() as u64;
            let buffer = self.buffer(tile, bytes, AllocationKind::Data, false, &out.name);
            grid.buffers.push(buffer);
            // A rank-3 cell holds one batch index: its rows are those of the last leading axis.
            let rows = block[rank - 2].1 - block[rank - 2].0;
            let statistics = self.buffer(tile, (rows * record_bytes) as u64, AllocationKind::Data, false, &statistics_name);
            let others = self.buffer(tile, ((segments - 1) * rows * record_bytes) as u64, AllocationKind::Data, false, &others_name);
            peak = peak.max(bytes * (inputs.len() as u64 + 1) + (segments * rows * record_bytes) as u64);
            work.push((tile, block, held, buffer, statistics, others));
        }
        let records = |buffer: u32| Loc { buffer, offset: 0, row_stride: words_per_record, dtype_bytes: 4 };
        let step = self.open_compute();
        let mut compute = 0u64;
        let extent = |block: &[(u32, u32)], axis: usize| block[axis].1 - block[axis].0;
        for (tile, block, held, _, statistics, _) in work.iter() {
            let (rows, cols) = (extent(block, rank - 2), extent(block, rank - 1));
            let first: Vec<u32> = block.iter().map(|b| b.0).collect();
            let call = Call::LayerNormStatistics { rows, cols, input: held[0].loc(&first), statistics: records(*statistics) };
            compute += cost::vertex_with(self.target, &call, |_| false);
            self.emit(step, *tile, call);
        }
        // Each cell receives the other segments' statistics of its rows, in segment order.
        let mut words = 0u64;
        for (cell, (_, block, _, _, _, others)) in work.iter().enumerate() {
            let (row_cell, own) = (cell as u32 / segments, cell as u32 % segments);
            let rows = extent(block, rank - 2);
            for (slot, segment) in (0..segments).filter(|&p| p != own).enumerate() {
                let source = work[(row_cell * segments + segment) as usize].4;
                self.pending.push((source, 0), rows * words_per_record, (*others, slot as u32 * rows * record_bytes));
            }
            words = words.max(((segments - 1) * rows * words_per_record) as u64);
        }
        let step = self.open_compute();
        for (cell, (tile, block, held, buffer, statistics, others)) in work.into_iter().enumerate() {
            let (rows, cols) = (extent(&block, rank - 2), extent(&block, rank - 1));
            let first: Vec<u32> = block.iter().map(|b| b.0).collect();
            let call = Call::LayerNormSegment {
                rows,
                cols,
                segments,
                segment: cell as u32 % segments,
                eps,
                input: held[0].loc(&first),
                statistics: records(statistics),
                others: records(others),
                gamma: held[1].loc(&first[rank - 1..]),
                beta: held[2].loc(&first[rank - 1..]),
                output: Held::plain(buffer, block.clone(), out.dtype).loc(&first),
            };
            compute += cost::vertex_with(self.target, &call, |_| false);
            self.emit(step, tile, call);
        }
        let (_, max_delay) = self.target.delay_range();
        let exchange = self.target.exchange.sync_cycles + max_delay as u64 + words;
        let plan = elementwise_plan(index, out.name.clone(), &OpKind::LayerNorm { eps: eps as f64 }, grid.tiles.len() as u32, compute, exchange, peak);
        self.record(index, output, grid, out.dtype, step, plan);
        Ok(())
    }

    /// A swapped value written out transposed for readers that read it by rows: each cell is
    /// transposed on its own tile, in the compute set open at the time (no exchange), into a
    /// cell of the transposed grid.
    fn transpose_copy(&mut self, index: usize, input: ValueId, output: ValueId) -> Result<(), LowerError> {
        let out = self.graph.value(output).clone();
        let stored = match self.stored.get(&input) {
            Some(s) if s.grid.cuts.len() == 2 && s.dtype == DType::F16 => s.clone(),
            _ => return Err(LowerError::Unsupported { operation: out.name.clone(), message: "a transpose written out needs a stored rank-2 f16 value".into() }),
        };
        let grid = &stored.grid;
        let (nr, nc) = (grid.cuts[0].len() - 1, grid.cuts[1].len() - 1);
        let mut cells = vec![(0u32, 0u32); nr * nc];
        let step = self.open_compute();
        let mut per_tile: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
        for i in 0..nr {
            for j in 0..nc {
                let cell = i * nc + j;
                let tile = grid.tiles[cell];
                let block = grid.cell_block(cell);
                let transposed = vec![block[1], block[0]];
                let source = Held::plain(grid.buffers[cell], block.clone(), stored.dtype);
                let target = Held::plain(u32::MAX, transposed.clone(), stored.dtype);
                let bytes = target.stored_elements() * stored.dtype.bytes() as u64;
                let buffer = self.buffer(tile, bytes, AllocationKind::Data, false, &out.name);
                let call = Call::Transpose {
                    rows: block[0].1 - block[0].0,
                    cols: block[1].1 - block[1].0,
                    input: source.loc(&[block[0].0, block[1].0]),
                    output: Held { buffer, ..target }.loc(&[block[1].0, block[0].0]),
                };
                let entry = per_tile.entry(tile).or_default();
                entry.0 += cost::vertex_with(self.target, &call, |_| false);
                entry.1 += bytes + source.stored_elements() * stored.dtype.bytes() as u64;
                self.emit(step, tile, call);
                cells[j * nr + i] = (tile, buffer);
            }
        }
        let out_grid = Grid { cuts: vec![grid.cuts[1].clone(), grid.cuts[0].clone()], tiles: cells.iter().map(|c| c.0).collect(), buffers: cells.iter().map(|c| c.1).collect() };
        let plan = OperationPlan {
            operation: index as u32,
            value: out.name.clone(),
            kind: OpKind::TransposeCopy.name().into(),
            orientation: String::new(),
            weight_memory: String::new(),
            constraint: String::new(),
            matching_plans: 0,
            partitions: [(nr * nc) as u32, 1, 1, 1],
            tiles: per_tile.len() as u32,
            estimated_compute_cycles: per_tile.values().map(|p| p.0).max().unwrap_or(0),
            estimated_exchange_cycles: 0,
            peak_bytes: per_tile.values().map(|p| p.1).max().unwrap_or(0),
        };
        self.record(index, output, out_grid, stored.dtype, step, plan);
        Ok(())
    }

    fn finish(mut self) -> Result<Attempt, LowerError> {
        let end = self.steps.len() as u32;
        let mut outputs = Vec::new();
        for &output in &self.graph.outputs.clone() {
            let chain = ViewChain::resolve(self.graph, output);
            if !self.stored.contains_key(&chain.base) {
                return Err(LowerError::OutputIsInput { output: self.graph.value(output).name.clone(), input: self.graph.value(chain.base).name.clone() });
            }
            let tensor = self.host_view(output, HostRole::Output);
            for s in &tensor.segments {
                self.touch(s.buffer, end);
            }
            outputs.push(tensor);
        }
        let mut inputs: Vec<LHostTensor> = std::mem::take(&mut self.host).into_values().map(unshare).collect();
        for t in &mut inputs {
            for s in &t.segments {
                // Written only where it moves (a write copies a chunk a prefix shares).
                if self.buffers[s.buffer as usize].first_step != 0 {
                    self.buffers[s.buffer as usize].first_step = 0;
                }
            }
            t.segments = merge_segments(std::mem::take(&mut t.segments), t.dtype);
        }
        inputs.sort_by_key(|t| self.graph.find(&t.name));
        let logical_shards = self.stored.values().map(|s| s.grid.tiles.len() as u32).sum();
        let lowered = Lowered {
            tiles: self.target.chip.tiles,
            labels: self.labels.into_vec(),
            buffers: self.buffers.into_vec(),
            steps: self.steps,
            compute_sets: self.compute_sets,
            phases: self.phases,
            phase_plans: self.phase_plans,
            initialize: Vec::new(),
            inputs,
            outputs,
            checkpoints: self.checkpoints.into_iter().map(unshare).collect(),
            plans: self.plans.into_vec(),
            gemm_flops: self.gemm_flops,
            logical_shards,
            half_duplex: Vec::new(),
        };
        Ok(Attempt { lowered, owners: self.owners.into_vec(), spans: self.spans, interleaved_weights: self.interleaved_weights })
    }
}


/// The epilogue row scale held in `h` for rows from `row0` of batch `batch` (rank-3 products).
fn row_scale_addend(h: &Held, batch: Option<(u32, u32)>, row0: u32) -> Addend<Loc> {
    let first = match batch {
        Some(b) => vec![b.0, row0, 0],
        None => vec![row0, 0],
    };
    Addend { operand: h.loc(&first), broadcast: Broadcast::RowScale }
}

/// The row reciprocals of softmax operation `softmax` when its normalisation is deferred to
/// the product consuming it (`orient` adds that value): the value the operation produces
/// besides its output.
fn reciprocals_of(graph: &Graph, softmax: usize) -> Option<ValueId> {
    let output = graph.operations.get(softmax)?.output;
    graph.values.iter().enumerate().find(|(i, v)| v.producer == Producer::Operation(softmax) && *i as u32 != output.0).map(|(i, _)| ValueId(i as u32))
}

/// Scale passes folded into the softmax that consumes them: softmax operation index ->
/// (scale operation index, factor). A scale folds when its factor is positive (so the row
/// maximum commutes with it), its value is not an output, and the softmax is its only consumer.
fn folded_scales(graph: &Graph) -> BTreeMap<usize, (usize, f64)> {
    let mut out = BTreeMap::new();
    for (i, o) in graph.operations.iter().enumerate() {
        let OpKind::Scale { factor } = o.kind else { continue };
        if !(factor > 0.0) || graph.outputs.contains(&o.output) {
            continue;
        }
        let consumers: Vec<usize> = graph.operations.iter().enumerate().filter(|(_, c)| c.inputs.contains(&o.output)).map(|(j, _)| j).collect();
        if let [j] = consumers[..] {
            if matches!(graph.operations[j].kind, OpKind::Softmax) && graph.operations[j].inputs.len() == 1 {
                out.insert(j, (i, factor));
            }
        }
    }
    out
}

/// The panel width in which a consumer holds rows gathered from cells cut at `cuts` along the
/// last axis, so that each cell's rows arrive as one run: the cells' width when every cell but
/// the last has it (the last no wider) and it is a whole number of 8-byte f16 rows (the
/// stored row stride equals the width); else the AMP panel when every cell is at most that
/// wide (the 16-column cells of a column-panel reduction); else 0 (row-major).
fn panel_width(cuts: &[u32], gemm_block: u32) -> u32 {
    let widths: Vec<u32> = cuts.windows(2).map(|w| w[1] - w[0]).collect();
    let first = widths[0];
    let (body, last) = widths.split_at(widths.len() - 1);
    if first % 4 == 0 && body.iter().all(|&w| w == first) && last[0] <= first {
        first
    } else if widths.iter().all(|&w| w <= gemm_block) {
        gemm_block
    } else {
        0
    }
}

/// Whether some consumer of `value`, directly or through elementwise operations that keep its
/// layout, reads it by whole rows: a softmax, or a LayerNorm (whose segments, when it splits
/// its rows, the planner prices as such a re-gather too).
fn needs_whole_rows(graph: &Graph, value: ValueId) -> bool {
    let (softmax, layer_norm) = row_consumers(graph, value);
    softmax || layer_norm
}


/// The plan of an elementwise operation over `cells` tiles, one cell each: `compute` the
/// cycles of all its calls (the estimate is their mean per tile), `exchange` the estimate of
/// the phases of its own (a LayerNorm's statistics).
fn elementwise_plan(index: usize, value: String, kind: &OpKind, cells: u32, compute: u64, exchange: u64, peak: u64) -> OperationPlan {
    OperationPlan {
        operation: index as u32,
        value,
        kind: kind.name().into(),
        orientation: String::new(),
        weight_memory: String::new(),
        constraint: String::new(),
        matching_plans: 0,
        partitions: [cells, 1, 1, 1],
        tiles: cells,
        estimated_compute_cycles: compute / cells.max(1) as u64,
        estimated_exchange_cycles: exchange,
        peak_bytes: peak,
    }
}

/// The row consumers of `value`, directly or through elementwise operations that keep its
/// layout: (some softmax, some LayerNorm). A value only
/// LayerNorms read so is stored in their row segments (`Builder::layer_norm_cuts`).
fn row_consumers(graph: &Graph, value: ValueId) -> (bool, bool) {
    let mut found = (false, false);
    for o in graph.operations.iter().filter(|o| o.inputs.first() == Some(&value)) {
        match o.kind {
            OpKind::Softmax => found.0 = true,
            OpKind::LayerNorm { .. } => found.1 = true,
            ref kind if super::elementwise::keeps_layout(kind) => {
                let (softmax, layer_norm) = row_consumers(graph, o.output);
                found = (found.0 || softmax, found.1 || layer_norm);
            }
            _ => {}
        }
    }
    found
}

/// Walk `block` of a value (laid out as `held`) through its views, row by row in row-major
/// order (the axis before the last fastest) and along each row: `each(index, base_index, run,
/// column)` gets the view index at hand, the base index it maps to and how many elements the
/// views map contiguously from there within the panel, and returns how many it takes.
fn walk_block(chain: &ViewChain, held: &Held, block: &[(u32, u32)], mut each: impl FnMut(&[u32], &[u32], u32, u32) -> u32) {
    let rank = block.len();
    let row_count: u64 = block[..rank - 1].iter().map(|r| (r.1 - r.0) as u64).product();
    let (c0, c1) = block[rank - 1];
    // The first element of the row at hand (an odometer over the leading axes).
    let mut index: Vec<u32> = block.iter().map(|r| r.0).collect();
    // The base index of the piece at hand (`ViewChain::map_run_into`, one table reused).
    let mut mapped: Vec<u32> = Vec::with_capacity(rank);
    for row in 0..row_count {
        if row > 0 {
            for a in (0..rank - 1).rev() {
                index[a] += 1;
                if index[a] < block[a].1 {
                    break;
                }
                index[a] = block[a].0;
            }
        }
        let mut c = c0;
        while c < c1 {
            index[rank - 1] = c;
            let limit = if held.panel > 0 { (held.panel - (c - c0) % held.panel).min(c1 - c) } else { c1 - c };
            // An identity view maps each index to itself (nothing to allocate or copy).
            let taken = if chain.is_identity() {
                let run = limit.min(chain.view_shape[rank - 1] - index[rank - 1]);
                each(&index, &index, run, c)
            } else {
                let run = chain.map_run_into(&index, limit, &mut mapped);
                each(&index, &mapped, run, c)
            };
            c += taken;
        }
    }
}

/// The pieces of `block` of a stored value (laid out as `held`) from the cells of its base's
/// `grid`, in the order the gather moves them (`GatherPiece`): the same for every tile.
fn gather_pieces(chain: &ViewChain, grid: &Grid, held: &Held, block: &[(u32, u32)], dtype: DType) -> Vec<GatherPiece> {
    let rank = block.len();
    let (c0, c1) = block[rank - 1];
    // The source cells met so far (cell, block, held there, tile), in the order met, and the
    // last one used: a row's pieces mostly come from the cells the previous row's did, in the
    // same order, so the last one or the one after it holds the next piece, and the one the
    // previous row started from holds the row's first piece. Else the cell is looked up among
    // those met (`met`: (cell, its place in `sources`), sorted by cell).
    let mut source: usize = 0;
    let mut row_source: usize = 0;
    let mut sources: Vec<SourceCell> = Vec::new();
    let mut met: Vec<(usize, usize)> = Vec::new();
    let mut pieces = Vec::new();
    walk_block(chain, held, block, |index, base_index, run, c| {
        let inside = |b: &[(u32, u32)]| b.iter().zip(base_index).all(|(r, &i)| r.0 <= i && i < r.1);
        let candidates = if c == c0 { [row_source, source, source + 1] } else { [source, source + 1, row_source] };
        let guess = candidates.into_iter().find(|&at| sources.get(at).is_some_and(|s| inside(&s.1.block)));
        source = match guess {
            Some(at) => at,
            None => {
                let cell = grid.cell_of(base_index);
                match met.binary_search_by_key(&cell, |m| m.0) {
                    Ok(at) => met[at].1,
                    Err(slot) => {
                        sources.push((cell, Held::plain(grid.buffers[cell], grid.cell_block(cell), dtype), grid.tiles[cell]));
                        met.insert(slot, (cell, sources.len() - 1));
                        sources.len() - 1
                    }
                }
            }
        };
        if c == c0 {
            row_source = source;
        }
        let (_, src_held, src_tile) = &sources[source];
        let (cell_block, src_tile) = (&src_held.block, *src_tile);
        let last = cell_block.len() - 1;
        let piece = run.min(cell_block[last].1 - base_index[last]);
        let src = src_held.loc(base_index);
        let ends_rows = base_index[last] + piece == cell_block[last].1 && held.row_ends_at(c + piece);
        // A whole source row into a whole tight last panel row of the same stride moves with
        // its padding, so consecutive rows form one run.
        let whole_rows = held.tight_last && ends_rows && base_index[last] == cell_block[last].0 && (c - c0) % held.panel == 0 && src.row_stride == held.last_panel_stride() && (c - c0) / held.panel == (c1 - c0) / held.panel;
        let words = if whole_rows { (src.row_stride * dtype.bytes()).div_ceil(4) } else { (piece * dtype.bytes()).div_ceil(4) };
        pieces.push(GatherPiece { src_tile, src, dst: Loc { buffer: 0, ..held.loc(index) }, elements: piece, element: base_index[last], ends_rows, words });
        piece
    });
    pieces
}

fn flatten(index: &[u32], shape: &[u32]) -> u64 {
    index.iter().zip(shape).fold(0u64, |acc, (&i, &d)| acc * d as u64 + i as u64)
}

/// Merge one-row segments: first those contiguous both in logical elements and in memory, then
/// equal-length runs at constant element and memory strides into one strided segment.
/// Append a segment, folding single elements at a constant element and memory stride (a
/// transposed view, element by element) into the previous strided segment as they come, so
/// such views never hold one segment per element.
fn push_segment(segments: &mut Vec<LSegment>, s: LSegment, bytes: u32) {
    if s.count == 1 {
        if let Some(last) = segments.last_mut() {
            if last.buffer == s.buffer && last.count == 1 && s.count == 1 && s.element > last.element && s.offset > last.offset {
                let (de, doff) = (s.element - last.element, s.offset - last.offset);
                if last.rows == 1 && !(de == 1 && doff == bytes) {
                    last.element_stride = de;
                    last.offset_stride = doff;
                    last.rows = 2;
                    return;
                }
                if last.rows > 1 && s.element == last.element + last.rows * last.element_stride && s.offset == last.offset + last.rows * last.offset_stride {
                    last.rows += 1;
                    return;
                }
            }
        }
    }
    segments.push(s);
}

fn merge_segments(mut segments: Vec<LSegment>, dtype: DType) -> Vec<LSegment> {
    // Unstable sorts order these as stable ones do: no two segments write the same place.
    segments.sort_unstable_by_key(|s| (s.buffer, s.offset, s.element));
    let mut runs: Vec<LSegment> = Vec::with_capacity(segments.len());
    for s in segments {
        if let Some(last) = runs.last_mut() {
            let consecutive = last.element_step == 1 && s.element_step == 1;
            if consecutive && last.rows == 1 && s.rows == 1 && last.buffer == s.buffer && last.element + last.count == s.element && last.offset + last.count * dtype.bytes() == s.offset {
                last.count += s.count;
                continue;
            }
        }
        runs.push(s);
    }
    runs.sort_unstable_by_key(|s| (s.buffer, s.element, s.offset));
    let mut out: Vec<LSegment> = Vec::with_capacity(runs.len());
    for s in runs {
        if let Some(last) = out.last_mut() {
            if s.rows == 1 && last.buffer == s.buffer && last.count == s.count && last.element_step == s.element_step && s.element > last.element && s.offset > last.offset {
                if last.rows == 1 {
                    last.element_stride = s.element - last.element;
                    last.offset_stride = s.offset - last.offset;
                    last.rows = 2;
                    continue;
                }
                if s.element == last.element + last.rows * last.element_stride && s.offset == last.offset + last.rows * last.offset_stride {
                    last.rows += 1;
                    continue;
                }
            }
        }
        out.push(s);
    }
    out
}

/// Widen a buffer's lifetime to include `step`.
fn touch(buffers: &mut Buffers, watch: &mut Watch, buffer: u32, step: u32) {
    let b = &buffers[buffer as usize];
    // Written only when it widens (a write copies a chunk a prefix shares).
    if step < b.first_step || step > b.last_step {
        watch.touch(buffer, b.first_step, b.last_step, step);
        let b = &mut buffers[buffer as usize];
        b.first_step = b.first_step.min(step);
        b.last_step = b.last_step.max(step);
    }
}

/// A word move's sort key within its source buffer: (source byte offset, words, destination
/// buffer, destination byte offset), most significant first, in one u128.
fn move_key(offset: u32, words: u32, destination: Place) -> u128 {
    (offset as u128) << 96 | (words as u128) << 64 | (destination.0 as u128) << 32 | destination.1 as u128
}

/// The keys and chunks of `Moves`.
type MoveTables = (Vec<u128>, Vec<(u32, u32)>);

thread_local! {
    /// Storage a finished lowering's moves leave to the next lowering on the thread (phases
    /// gather up to millions of moves: growing a fresh table each time costs more than sorting it).
    static SPARE_MOVES: Cell<MoveTables> = const { Cell::new((Vec::new(), Vec::new())) };
    /// The bucket starts and bucketed moves of `Moves::drain_into_transfers`, kept likewise.
    static SPARE_BUCKETS: Cell<(Vec<u32>, Vec<u128>)> = const { Cell::new((Vec::new(), Vec::new())) };
}

/// Word moves of an exchange phase being gathered, in the order gathered: each move's key
/// (`move_key`), and the chunks of consecutive moves from one source buffer (source buffer,
/// first move); a gather reads the rows of one source cell after another, so chunks are long.
/// Also the lowest and highest source buffer (meaningless while there are no moves), and the
/// destination buffers, each once per stretch of consecutive moves into it.
#[derive(Clone, Default)]
struct Moves {
    keys: Vec<u128>,
    chunks: Vec<(u32, u32)>,
    low: u32,
    high: u32,
    destinations: Vec<u32>,
}

impl Drop for Moves {
    /// The tables' storage (emptied) goes to the thread's spare when it is the larger.
    fn drop(&mut self) {
        if self.keys.capacity() > 0 {
            self.keys.clear();
            self.chunks.clear();
            SPARE_MOVES.with(|spare| {
                let kept = spare.take();
                spare.set(if kept.0.capacity() >= self.keys.capacity() { kept } else { (std::mem::take(&mut self.keys), std::mem::take(&mut self.chunks)) });
            });
        }
    }
}

impl Moves {
    /// Move `words` words from `source` to `destination`.
    fn push(&mut self, source: Place, words: u32, destination: Place) {
        if self.keys.capacity() == 0 {
            (self.keys, self.chunks) = SPARE_MOVES.with(Cell::take);
        }
        match self.chunks.last() {
            None => {
                (self.low, self.high) = (source.0, source.0);
                self.chunks.push((source.0, 0));
            }
            Some(&(buffer, _)) if buffer == source.0 => {}
            Some(_) => {
                (self.low, self.high) = (self.low.min(source.0), self.high.max(source.0));
                self.chunks.push((source.0, self.keys.len() as u32));
            }
        }
        if self.destinations.last() != Some(&destination.0) {
            self.destinations.push(destination.0);
        }
        self.keys.push(move_key(source.1, words, destination));
    }

    fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The phase's transfers, and the moves emptied (their capacity serves this lowering's
    /// later phases): source buffers in order, each one's moves sorted by (source offset,
    /// words, destination); one transfer per (source, words), its destinations in order; a
    /// transfer whose source and destinations continue the previous one's (consecutive rows)
    /// extends it. `touch` sees each move's source and destination buffer (at least once).
    fn drain_into_transfers(&mut self, mut touch: impl FnMut(u32)) -> Vec<Transfer> {
        for &buffer in &self.destinations {
            touch(buffer);
        }
        self.destinations.clear();
        // Bucket the moves by source buffer (a counting sort of the chunks, each chunk's keys
        // copied whole), then sort each bucket.
        // Buckets are indexed from the lowest source buffer (a phase mostly reads the buffers
        // of a few recent operations), positions as u32 (a phase holds fewer than 2^32 moves).
        let low = self.low;
        let buffers = if self.keys.is_empty() { 0 } else { (self.high - low) as usize + 1 };
        let (mut starts, mut sorted) = SPARE_BUCKETS.with(Cell::take);
        let chunk_end = |i: usize| self.chunks.get(i + 1).map_or(self.keys.len(), |c| c.1 as usize);
        starts.clear();
        starts.resize(buffers + 1, 0);
        for (i, &(buffer, first)) in self.chunks.iter().enumerate() {
            starts[(buffer - low) as usize + 1] += (chunk_end(i) - first as usize) as u32;
        }
        for b in 0..buffers {
            starts[b + 1] += starts[b];
        }
        // Every slot below the moves' count is written once below: no need to clear it.
        if sorted.len() < self.keys.len() {
            sorted.resize(self.keys.len(), 0);
        }
        // Each chunk to its bucket's next slots (`starts[b]` advances; bucket b then ends there).
        for (i, &(buffer, first)) in self.chunks.iter().enumerate() {
            let keys = &self.keys[first as usize..chunk_end(i)];
            let at = &mut starts[(buffer - low) as usize];
            let slots = &mut sorted[*at as usize..*at as usize + keys.len()];
            // Most chunks are a move or two (a row's pieces from cells side by side).
            if let ([slot], [key]) = (&mut *slots, keys) {
                *slot = *key;
            } else {
                slots.copy_from_slice(keys);
            }
            *at += keys.len() as u32;
        }
        self.keys.clear();
        self.chunks.clear();
        let mut out: Vec<Transfer> = Vec::new();
        for bucket in 0..buffers {
            let moves = &mut sorted[if bucket == 0 { 0 } else { starts[bucket - 1] as usize }..starts[bucket] as usize];
            if moves.is_empty() {
                continue;
            }
            let buffer = low as usize + bucket;
            moves.sort_unstable();
            touch(buffer as u32);
            let mut first = 0;
            while first < moves.len() {
                let head = moves[first] >> 64;
                let (offset, words) = ((head >> 32) as u32, head as u32);
                let end = first + moves[first..].iter().take_while(|&&m| m >> 64 == head).count();
                let group = &moves[first..end];
                let destination = |m: u128| ((m >> 32) as u32, m as u32);
                first = end;
                if let Some(last) = out.last_mut() {
                    let continues = last.source.0 == buffer as u32
                        && last.source.1 + last.words * 4 == offset
                        && last.destinations.len() == group.len()
                        && last.destinations.iter().zip(group).all(|(a, &m)| a.0 == destination(m).0 && a.1 + last.words * 4 == destination(m).1);
                    if continues {
                        last.words += words;
                        continue;
                    }
                }
                out.push(Transfer { source: (buffer as u32, offset), words, destinations: group.iter().map(|&m| destination(m)).collect() });
            }
        }
        SPARE_BUCKETS.with(|spare| spare.set((starts, sorted)));
        out
    }
}

/// The value behind a shared part of a lowering in progress (copied only while a prefix that
/// another lowering extends still holds it).
fn unshare<T: Clone>(shared: Arc<T>) -> T {
    Arc::try_unwrap(shared).unwrap_or_else(|shared| (*shared).clone())
}

#[cfg(test)]
mod tests {
    use super::{merge_segments, panel_width, push_segment, Moves, Place, Transfer};
    use crate::ir::DType;
    use crate::lower::LSegment;
    use crate::exchange::synthetic::SplitMix64;

    /// `moves` pushed into `table` in order, then drained: the transfers and the buffers touched.
    fn push_and_drain(table: &mut Moves, moves: &[(Place, u32, Place)]) -> (Vec<Transfer>, std::collections::BTreeSet<u32>) {
        for &(source, words, destination) in moves {
            table.push(source, words, destination);
        }
        let mut touched = std::collections::BTreeSet::new();
        let transfers = table.drain_into_transfers(|b| {
            touched.insert(b);
        });
        (transfers, touched)
    }

    /// The plain construction of a phase's transfers: all moves sorted by (source, words,
    /// destination), one transfer per (source, words) with its destinations, then transfers
    /// whose source and destinations continue the previous one's merged.
    fn plain_transfers(moves: &[(Place, u32, Place)]) -> Vec<Transfer> {
        let mut expected: Vec<Transfer> = Vec::new();
        let mut sorted = moves.to_vec();
        sorted.sort();
        for m in &sorted {
            match expected.last_mut() {
                Some(t) if t.source == m.0 && t.words == m.1 => t.destinations.push(m.2),
                _ => expected.push(Transfer { source: m.0, words: m.1, destinations: vec![m.2] }),
            }
        }
        let mut merged: Vec<Transfer> = Vec::new();
        for t in expected {
            if let Some(last) = merged.last_mut() {
                if last.source.0 == t.source.0
                    && last.source.1 + last.words * 4 == t.source.1
                    && last.destinations.len() == t.destinations.len()
                    && last.destinations.iter().zip(&t.destinations).all(|(a, b)| a.0 == b.0 && a.1 + last.words * 4 == b.1)
                {
                    last.words += t.words;
                    continue;
                }
            }
            merged.push(t);
        }
        merged
    }

    /// Random phases as gathers make them (rows of source cells to rows of destination
    /// blocks: runs from one source buffer, rows split over cells side by side, multicast
    /// rows, some rows contiguous so that they merge) become the plain construction's
    /// transfers, table after table in one `Moves`.
    #[test]
    fn random_gathers_become_the_plain_transfers() {
        let mut rng = SplitMix64(22);
        let mut table = Moves::default();
        for round in 0..60 {
            let mut moves: Vec<(Place, u32, Place)> = Vec::new();
            let sources = rng.between(1, 12);
            let first_source = rng.between(0, 40);
            let mut destination = 100 + rng.below(50);
            for _ in 0..rng.between(1, 30) {
                // A destination block: rows whose pieces come from `cells` source buffers side
                // by side, each piece `words` long; source rows `stride` words apart.
                destination += 1;
                let rows = rng.between(1, 20);
                let cells = rng.between(1, sources.min(4));
                let words = rng.between(1, 6);
                let stride = if rng.chance(50) { words } else { words + rng.between(1, 3) };
                let first_cell = first_source + rng.below(sources);
                let row0 = rng.below(8);
                for r in 0..rows {
                    for c in 0..cells {
                        let source = (first_cell + c, (row0 + r) * stride * 4);
                        moves.push((source, words, (destination, (r * cells + c) * words * 4)));
                    }
                }
            }
            let expected = plain_transfers(&moves);
            // Gathered in this order, or rows of every destination interleaved.
            if round % 2 == 1 {
                moves.sort_by_key(|&(s, w, (d, at))| (at, s, w, d));
            }
            let (transfers, touched) = push_and_drain(&mut table, &moves);
            assert_eq!(transfers, expected, "round {round}");
            assert!(table.is_empty());
            let buffers: std::collections::BTreeSet<u32> = moves.iter().flat_map(|m| [m.0 .0, m.2 .0]).collect();
            assert_eq!(touched, buffers, "round {round}");
        }
    }

    /// A phase's moves become the transfers of the plain construction: all moves sorted by
    /// (source, words, destination), one transfer per (source, words) with its destinations,
    /// then transfers whose source and destinations continue the previous one's merged;
    /// whatever order they were gathered in, over the gathering's spread of source buffers.
    #[test]
    fn moves_become_sorted_merged_transfers() {
        // Rows of 8 words from sources 7 and 3 (and 12 words from 9), each row to one or two
        // destinations, a shared row in the middle (not merged with its neighbours), gathered
        // destination by destination, then the table twice over to check that it was emptied.
        let mut gathered: Vec<(Place, u32, Place)> = Vec::new();
        for (to, rows) in [(20u32, 0..6u32), (21, 2..3), (22, 0..4)] {
            for r in rows.clone() {
                gathered.push(((7, r * 32), 8, (to, r * 32)));
                gathered.push(((3, 64 + r * 32), 8, (to, 512 + r * 32)));
            }
            gathered.push(((9, 0), 12, (to, 1024)));
        }
        // An odd interleaving of the same moves.
        let mut shuffled = gathered.clone();
        shuffled.sort_by_key(|&((b, o), _, (t, a))| (a.wrapping_mul(2654435761) ^ o, b, t));
        for moves in [&gathered, &shuffled] {
            let merged = plain_transfers(moves);
            let mut table = Moves::default();
            for round in 0..2 {
                let (transfers, touched) = push_and_drain(&mut table, moves);
                assert_eq!(transfers, merged, "round {round}");
                assert!(table.is_empty());
                assert_eq!(touched.into_iter().collect::<Vec<_>>(), vec![3, 7, 9, 20, 21, 22]);
            }
        }
        // Rows 0-1 and 3 (of source 7) go to 20 and 22 and merge; row 2 also goes to 21.
        let mut table = Moves::default();
        for &(source, words, destination) in &gathered {
            table.push(source, words, destination);
        }
        let transfers = table.drain_into_transfers(|_| {});
        let from7: Vec<(u32, u32, usize)> = transfers.iter().filter(|t| t.source.0 == 7).map(|t| (t.source.1, t.words, t.destinations.len())).collect();
        assert_eq!(from7, vec![(0, 16, 2), (64, 8, 3), (96, 8, 2), (128, 16, 1)]);
    }

    #[test]
    fn a_row_consumer_reads_panels_one_cell_wide() {
        // The attention seed's scores: 22 cells of 32 columns and a last one of 25.
        let mut cuts: Vec<u32> = (0..23).map(|i| i * 32).collect();
        cuts.push(729);
        assert_eq!(panel_width(&cuts, 16), 32);
        // 16-column cells with a narrower last one: the AMP panel.
        assert_eq!(panel_width(&[0, 16, 32, 41], 16), 16);
        // Uneven cells no wider than the AMP panel still read in AMP panels.
        assert_eq!(panel_width(&[0, 12, 16, 30], 16), 16);
        // Uneven wide cells, or a width that is not whole 8-byte rows: row-major.
        assert_eq!(panel_width(&[0, 40, 72, 100], 16), 0);
        assert_eq!(panel_width(&[0, 18, 36, 50], 16), 0);
        // A last cell wider than the others is not a panel either.
        assert_eq!(panel_width(&[0, 32, 64, 100], 16), 0);
    }

    /// `gather` and `home_weight` merge each block's segments as they are made (each block
    /// has its buffer to itself) and `finish` merges the tensor again: this must give what one
    /// merge of every row segment gives. Merges join segments of one buffer only, and the
    /// merge is idempotent; random blocks of row runs (full-width rows contiguous in memory,
    /// padded rows, single-element columns, several blocks per tensor) check both.
    #[test]
    fn merging_each_blocks_segments_first_changes_no_tensor() {
        let mut rng = crate::exchange::synthetic::SplitMix64(0x5e55_1045);
        for case in 0..300 {
            let dtype = if case % 3 == 0 { DType::F32 } else { DType::F16 };
            let bytes = dtype.bytes();
            let cols_total = 4 + rng.below(60);
            let mut all: Vec<LSegment> = Vec::new();
            let mut blocks: Vec<Vec<LSegment>> = Vec::new();
            let mut next_buffer = 0u32;
            for _ in 0..1 + rng.below(6) {
                let buffer = next_buffer + rng.below(3);
                next_buffer = buffer + 1;
                let (r0, rows) = (rng.below(20), 1 + rng.below(12));
                let c0 = rng.below(cols_total);
                let width = 1 + rng.below(cols_total - c0);
                // Stored rows: packed, padded to an even width, or padded by one to four elements.
                let stride = match rng.below(3) {
                    0 => width,
                    1 => width.div_ceil(2) * 2,
                    _ => width + 1 + rng.below(4),
                };
                // Some blocks arrive element by element (a column run of single elements).
                let single = rng.below(5) == 0;
                let mut block = Vec::new();
                for r in 0..rows {
                    let element = (r0 + r) * cols_total + c0;
                    let offset = r * stride * bytes;
                    if single {
                        for c in 0..width {
                            let s = LSegment { buffer, offset: offset + c * bytes, element: element + c, count: 1, rows: 1, element_stride: 0, offset_stride: 0, element_step: 1 };
                            push_segment(&mut all, s, bytes);
                            push_segment(&mut block, s, bytes);
                        }
                    } else {
                        let s = LSegment { buffer, offset, element, count: width, rows: 1, element_stride: 0, offset_stride: 0, element_step: 1 };
                        push_segment(&mut all, s, bytes);
                        push_segment(&mut block, s, bytes);
                    }
                }
                blocks.push(block);
            }
            let once = merge_segments(all, dtype);
            let blockwise: Vec<LSegment> = blocks.into_iter().flat_map(|b| merge_segments(b, dtype)).collect();
            assert_eq!(merge_segments(blockwise, dtype), once, "case {case}");
            assert_eq!(merge_segments(once.clone(), dtype), once, "case {case}: idempotent");
        }
    }
}

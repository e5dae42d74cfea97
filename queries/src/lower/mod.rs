//! Lowering: from the validated graph to an address-free program of buffers, vertex calls,
//! exchange transfers and host segments (`lower_mid` plans, then the lowered graph).
//!
//! Every computed value is stored as a grid of cells, one per tile; a consumer gathers the
//! block it needs into a local buffer (by exchange, or by aliasing a local cell), and the host
//! writes inputs and weights straight into the layout their consumers want (replicas
//! included, as the seed's runtime does). Addresses are assigned later by `storage`.

pub mod build;
pub mod candidates;
pub mod chunked;
pub mod elementwise;
pub mod grid;
pub mod host;
pub mod plan;
pub mod orient;
pub mod peaks;
pub mod screen;
pub mod search;
pub mod select;

pub use build::LowerError;

/// `lower_mid`: plan every operation, whole-program feasible, and lower the program.
/// Without `select_finalist`: the finalist with the best estimate.
pub fn lower(graph: &crate::ir::Graph, target: &crate::target::Target) -> Result<Lowered, LowerError> {
    Ok(search::finalists(graph, target, 1)?.remove(0))
}

use crate::package::{AllocationKind, Checkpoint, HostTensor, VertexCall};

/// A buffer on one tile, placed later.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct BufferDecl {
    pub tile: u32,
    pub bytes: u32,
    pub kind: AllocationKind,
    /// Prefer interleaved memory (matrix-product weights, for 128-bit weight loads).
    pub prefer_interleaved: bool,
    pub label: u32,
    /// Steps (indices into `Lowered::steps`) of the first write and last read, inclusive.
    pub first_step: u32,
    pub last_step: u32,
}

/// An operand inside a buffer (element offset, row stride in elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Loc {
    pub buffer: u32,
    pub offset: u32,
    pub row_stride: u32,
    pub dtype_bytes: u32,
}

/// A vertex call over address-free operands.
pub type Call = VertexCall<Loc>;

/// A word transfer between buffers: `words` words from (buffer, byte offset) to each destination.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Transfer {
    pub source: (u32, u32),
    pub words: u32,
    pub destinations: Vec<(u32, u32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum LStep {
    Compute(u32),
    Exchange(u32),
}

/// `rows` runs of `count` logical elements: run r from flat index `element + r * element_stride`
/// (its elements `element_step` apart, 1 = consecutive) at (buffer, byte offset
/// `offset + r * offset_stride`), contiguous in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct LSegment {
    pub buffer: u32,
    pub offset: u32,
    pub element: u32,
    pub count: u32,
    pub rows: u32,
    pub element_stride: u32,
    pub offset_stride: u32,
    pub element_step: u32,
}

/// A host table over address-free segments.
pub type LHostTensor = HostTensor<LSegment>;

impl LHostTensor {
    /// Elements the host writes or reads in all, replicas included.
    pub fn streamed_elements(&self) -> u64 {
        self.segments.iter().map(|s| s.count as u64 * s.rows as u64).sum()
    }

    /// Elements of the tensor itself.
    pub fn elements(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}
/// A checkpoint over address-free segments.
pub type LCheckpoint = Checkpoint<LSegment>;

/// The plan chosen for one operation, for logs and reports.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct OperationPlan {
    /// The original operation's index and value name.
    pub operation: u32,
    pub value: String,
    pub kind: String,
    /// Matrix products: "normal" or "swapped" (Cᵀ = Bᵀ·Aᵀ); empty otherwise.
    pub orientation: String,
    /// Matrix products: where the planner expects the weights, "interleaved" or "standard".
    pub weight_memory: String,
    /// The user's constraint applied to this product (empty if none), and how many feasible
    /// candidate plans matched it.
    pub constraint: String,
    pub matching_plans: u32,
    /// (batch, row, column, inner) partitions; elementwise plans use (cells, 1, 1, 1).
    pub partitions: [u32; 4],
    pub tiles: u32,
    pub estimated_compute_cycles: u64,
    pub estimated_exchange_cycles: u64,
    pub peak_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Lowered {
    pub tiles: u32,
    pub labels: Vec<String>,
    pub buffers: Vec<BufferDecl>,
    pub steps: Vec<LStep>,
    /// Per compute set: (tile, call) in execution order per tile. Shared (`Arc`) so that the
    /// copies the search, the table screen and `select_finalist` make of a program share its
    /// compute sets and phases instead of copying them; archived as plain vectors (`Unshare`).
    #[rkyv(with = rkyv::with::Map<rkyv::with::Unshare>)]
    pub compute_sets: Vec<std::sync::Arc<Vec<(u32, Call)>>>,
    #[rkyv(with = rkyv::with::Map<rkyv::with::Unshare>)]
    pub phases: Vec<std::sync::Arc<Vec<Transfer>>>,
    /// Per exchange phase the lowering built: the index in `plans` of the operation whose
    /// gathers (or reduction) it carries. Phases added later (`host.rs`) have no entry.
    pub phase_plans: Vec<u32>,
    /// Exchange phases the `initialize` call runs after the host writes, before `run`
    /// (weight replication, `host.rs`); not steps of the run.
    pub initialize: Vec<u32>,
    pub inputs: Vec<LHostTensor>,
    pub outputs: Vec<LHostTensor>,
    pub checkpoints: Vec<LCheckpoint>,
    pub plans: Vec<OperationPlan>,
    pub gemm_flops: u64,
    pub logical_shards: u32,
    /// Per exchange phase (sorted by phase, only phases that have any): tiles whose sends and
    /// receives the phase's schedule keeps in different cycles (`PhaseRequest::half_duplex`),
    /// set by `select_finalist` where placement leaves memory-element conflicts on them.
    pub half_duplex: Vec<(u32, Vec<u32>)>,
}

impl Lowered {
    /// The operations this program computes swapped (Cᵀ = Bᵀ·Aᵀ): its orientation, as `orient`
    /// takes it.
    pub fn swapped_operations(&self) -> std::collections::BTreeSet<usize> {
        self.plans.iter().filter(|p| p.orientation == "swapped").map(|p| p.operation as usize).collect()
    }
}

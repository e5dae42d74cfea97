//! `size_tile_code`, `prepare_tile_code`, `emit_tile_code`, `build_tile_images`: turn the placed
//! program into per-tile images and programs, and assemble the package.
//!
//! Each tile's code holds its runtime header, its host-exchange records (one per host
//! segment), its vertex state (one variable-length record per call, `image.rs`) and its
//! exchange tables (compact run descriptors relative to their buffers, with per-phase bindings
//! supplying the buffers' bases, `tables.rs`), encoded
//! little-endian: the image is the program. Vertex state and tables that
//! several tiles hold are stored once in the package (`Package::shared_segments`); the rest of
//! the code reserve is a load-time zero fill, not bytes. Host-streamed inputs and weights are
//! never in an image. The package carries no structured copy of calls or tables: the
//! simulator decodes them from the loaded tile memory.
//!
//! Each tile's image is built from that tile's `TileInput` alone (`build_tile`), so the package
//! stage can key, memoize and parallelise images per tile (`pipeline::package`);
//! `assemble_package` then pools shared bytes and writes the package, serially in tile order.

use rayon::prelude::*;

use crate::cost;
use crate::db::CompileError;
use crate::image;
use crate::tables::{self, PackedPhase, PackedTile};
use crate::ir::Graph;
use crate::lower::{Call, LHostTensor, LStep, Loc, Lowered};
use crate::package::{
    AddressRange, Allocation, AllocationKind, Checkpoint, ComputeSet, HostSegment, HostTables, HostTensor, Operand, Package, PhaseSummary, Segment, SharedSegment,
    Step, Summary, TileImage, VertexCall,
};
use crate::storage::Placement;
use crate::target::Target;

/// Bytes of the per-tile runtime header and of one host-exchange record (a host segment the
/// tile streams in or out). Vertex records are variable-length (`image.rs`), exchange
/// descriptors are `tables.rs`'s.
pub const RUNTIME_HEADER_BYTES: u32 = 64;
pub const HOST_RECORD_BYTES: u32 = 32;

/// A tile's support memory, laid out from the bottom of standard memory in this order: the
/// runtime header (the "linked" part), host-exchange code, generated code (vertex state),
/// exchange tables, then the profile area (none: the simulator profiles from the host side).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SupportMemory {
    pub runtime_bytes: u32,
    pub host_code_bytes: u32,
    pub generated_code_bytes: u32,
    pub exchange_table_bytes: u32,
    pub profile_bytes: u32,
}

impl SupportMemory {
    pub fn total(&self) -> u32 {
        self.runtime_bytes + self.host_code_bytes + self.generated_code_bytes + self.exchange_table_bytes + self.profile_bytes
    }
}

/// Host segments per tile (inputs, outputs and checkpoints): one host-exchange record each.
fn host_segments_per_tile(lowered: &Lowered) -> Vec<u32> {
    let mut n = vec![0u32; lowered.tiles as usize];
    let tensors = lowered.inputs.iter().chain(lowered.outputs.iter()).chain(lowered.checkpoints.iter().map(|c| &c.tensor));
    for t in tensors {
        for s in &t.segments {
            n[lowered.buffers[s.buffer as usize].tile as usize] += 1;
        }
    }
    n
}

/// Support memory per tile, from the calls' vertex state, encoded exchange-table bytes and
/// host segments. The vertex state's size does not depend on addresses (its segments hold
/// none, and every set has a base list of its own), so this is exact before placement.
pub fn support_memory(lowered: &Lowered, table_bytes: &[u32]) -> Vec<SupportMemory> {
    // Each tile's calls per compute set, in set order, as segments (`image::segment_words`).
    let mut calls: Vec<Vec<(u32, Vec<&crate::lower::Call>)>> = vec![Vec::new(); lowered.tiles as usize];
    for (index, set) in lowered.compute_sets.iter().enumerate() {
        for (tile, call) in set.iter() {
            let sets = &mut calls[*tile as usize];
            match sets.last_mut() {
                Some((i, c)) if *i == index as u32 => c.push(call),
                _ => sets.push((index as u32, vec![call])),
            }
        }
    }
    let vertex: Vec<u32> = calls
        .iter()
        .map(|sets| {
            let segments: Vec<(Vec<u32>, u32)> = sets.iter().map(|(_, c)| image::segment_words(c.iter().copied(), |l: &crate::lower::Loc| l.row_stride)).collect();
            image::vertex_state_bytes(&segments)
        })
        .collect();
    let host = host_segments_per_tile(lowered);
    (0..lowered.tiles as usize)
        .map(|tile| SupportMemory {
            runtime_bytes: RUNTIME_HEADER_BYTES,
            host_code_bytes: host[tile] * HOST_RECORD_BYTES,
            generated_code_bytes: vertex[tile],
            exchange_table_bytes: table_bytes.get(tile).copied().unwrap_or(0),
            profile_bytes: 0,
        })
        .collect()
}

/// Bytes of code and tables per tile (the sum of its support memory).
pub fn size_tile_code(lowered: &Lowered, table_bytes: &[u32]) -> Vec<u32> {
    support_memory(lowered, table_bytes).iter().map(SupportMemory::total).collect()
}

/// The seed's support-memory line for the tile with the most support memory (lowest such
/// tile): where its code starts and ends, and the standard memory left for data above it.
pub fn log_support_memory(target: &Target, support: &[SupportMemory]) {
    let Some((tile, s)) = support.iter().enumerate().max_by_key(|(i, s)| (s.total(), std::cmp::Reverse(*i))) else { return };
    let m = &target.memory;
    let linked_end = m.base + s.runtime_bytes;
    let code_address = (linked_end + s.host_code_bytes).div_ceil(8) * 8;
    let code_end = (code_address + s.generated_code_bytes + s.exchange_table_bytes + s.profile_bytes).div_ceil(16) * 16;
    tracing::info!(
        tile,
        linked_end,
        profile_bytes = s.profile_bytes,
        exchange_table_bytes = s.exchange_table_bytes,
        host_code_bytes = s.host_code_bytes,
        generated_code_bytes = s.generated_code_bytes,
        code_address,
        standard_ranges = %format!("[({code_end}, {})]", m.interleaved_start),
        "allocated package support memory"
    );
}

fn operand(placement: &Placement, loc: &Loc) -> Operand {
    Operand { address: placement.addresses[loc.buffer as usize] + loc.offset * loc.dtype_bytes, row_stride: loc.row_stride }
}

pub(crate) fn vertex(placement: &Placement, call: &Call) -> VertexCall {
    call.map(|l| operand(placement, l))
}

fn host_tensor(placement: &Placement, lowered: &Lowered, t: &LHostTensor) -> HostTensor {
    t.map(|s| HostSegment {
        tile: lowered.buffers[s.buffer as usize].tile,
        address: placement.addresses[s.buffer as usize] + s.offset,
        element: s.element,
        count: s.count,
        rows: s.rows,
        element_stride: s.element_stride,
        address_stride: s.offset_stride,
        element_step: s.element_step,
    })
}

/// The compiler's estimate of a placed program: (cycles, exchange cycles), from the same cost
/// formulas the package's summary states (the longest tile per compute set, plus each
/// exchange phase's sync and horizon, `horizons` per phase of the program).
pub fn estimate_cycles(target: &Target, lowered: &Lowered, placement: &Placement, horizons: &[u32]) -> (u64, u64) {
    let mut set_cycles: Vec<Vec<u64>> = vec![vec![0; lowered.tiles as usize]; lowered.compute_sets.len()];
    for (index, set) in lowered.compute_sets.iter().enumerate() {
        for (tile, call) in set.iter() {
            set_cycles[index][*tile as usize] += cost::vertex(target, &vertex(placement, call));
        }
    }
    let (mut total, mut exchange) = (0u64, 0u64);
    for s in &lowered.steps {
        match s {
            LStep::Compute(i) => total += set_cycles[*i as usize].iter().copied().max().unwrap_or(0),
            LStep::Exchange(p) => {
                let c = horizons.get(*p as usize).map_or(0, |&h| cost::exchange_phase(target, h));
                total += c;
                exchange += c;
            }
        }
    }
    (total, exchange)
}

/// Everything one tile's image is made from but the tile's number, which assembly stamps into
/// the runtime header (`image::stamp_tile`). The digest of its bytes is the tile's key
/// (`pipeline::package`): tiles whose content is equal share one image entry, and an edit that
/// leaves a tile's content unchanged reuses its image.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct TileInput {
    /// Steps of the program (the runtime header records them).
    pub steps: u32,
    /// Host-exchange records, `HOST_RECORD_BYTES` each.
    pub host_records: Vec<u8>,
    /// The tile's compute sets with placed operands, in program order.
    pub sets: Vec<ComputeSet>,
    /// The tile's exchange tables as its image holds them (`tile_tables`: a binding per phase
    /// it takes part in, then the distinct base lists and segments).
    pub tables: Vec<u8>,
    /// Bindings in `tables` (phases the tile takes part in).
    pub bindings: u32,
    /// The tile's buffers as placed, in buffer order.
    pub allocations: Vec<Allocation>,
    /// The code allocation (start, end) that size_tile_code sized and placement placed.
    pub code: (u32, u32),
}

impl TileInput {
    /// The digest of the input's canonical bytes: the content part of its tile's key.
    pub fn digest(&self) -> Result<crate::hash::Digest, CompileError> {
        crate::db::digest_of(self)
    }
}

/// One tile's image as built from its `TileInput`: the code written at the code allocation's
/// start (runtime header, its tile number left for assembly to stamp, and host records), the
/// vertex state and exchange tables after it (stored once per package when tiles share them),
/// and the tile's allocations and zero fill.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct TileBody {
    pub head: Vec<u8>,
    pub vertex_state: Vec<u8>,
    pub tables: Vec<u8>,
    /// Buffers and the code allocation, by (start, end).
    pub allocations: Vec<Allocation>,
    pub zero_fill: Vec<AddressRange>,
}

/// Every tile's input, in tile order, from the placed program and the final exchange tables
/// (an error when a tile's tables do not encode).
pub fn tile_inputs(lowered: &Lowered, placement: &Placement, exchanges: &[std::sync::Arc<PackedPhase>]) -> Result<Vec<TileInput>, CompileError> {
    let tiles = lowered.tiles as usize;
    let steps = lowered.steps.len() as u32;
    let mut inputs: Vec<TileInput> = placement.code[..tiles]
        .iter()
        .map(|&code| TileInput { steps, host_records: Vec::new(), sets: Vec::new(), tables: Vec::new(), bindings: 0, allocations: Vec::new(), code })
        .collect();
    for (index, set) in lowered.compute_sets.iter().enumerate() {
        for (tile, call) in set.iter() {
            let sets = &mut inputs[*tile as usize].sets;
            if sets.last().is_none_or(|s| s.index != index as u32) {
                sets.push(ComputeSet { index: index as u32, calls: Vec::new() });
            }
            sets.last_mut().expect("a set was just pushed").calls.push(vertex(placement, call));
        }
    }
    for (i, b) in lowered.buffers.iter().enumerate() {
        let start = placement.addresses[i];
        inputs[b.tile as usize].allocations.push(Allocation { start, end: start + b.bytes, kind: b.kind, label: b.label, first_step: b.first_step, last_step: b.last_step });
    }
    // Host-exchange records: (role and tensor, address, first element, count, rows, strides, step).
    let host_tensors = lowered.inputs.iter().map(|t| (0u32, t)).chain(lowered.outputs.iter().map(|t| (1, t))).chain(lowered.checkpoints.iter().map(|c| (2, &c.tensor)));
    let mut counters = [0u32; 3];
    for (role, t) in host_tensors {
        let index = counters[role as usize];
        counters[role as usize] += 1;
        for seg in &t.segments {
            let b = seg.buffer as usize;
            let address = placement.addresses[b] + seg.offset;
            let bytes = &mut inputs[lowered.buffers[b].tile as usize].host_records;
            for w in [role << 30 | index, address, seg.element, seg.count, seg.rows, seg.element_stride, seg.offset_stride, seg.element_step] {
                bytes.extend_from_slice(&w.to_le_bytes());
            }
        }
    }
    for phase in exchanges {
        for t in &phase.tiles {
            if let Some(input) = inputs.get_mut(t.tile as usize) {
                input.bindings += 1;
            }
        }
    }
    for (input, tables) in inputs.iter_mut().zip(tile_tables(tiles, exchanges).map_err(CompileError)?) {
        input.tables = tables;
    }
    Ok(inputs)
}

/// Build one tile's image from its input; `tile` (the first tile with this content) only
/// names the tile in an error.
pub fn build_tile(tile: usize, input: &TileInput) -> Result<TileBody, CompileError> {
    let (head, vertex_state, tables) = image::encode_code(0, input.steps, &input.host_records, &input.sets, &input.tables, input.bindings);
    let (start, end) = input.code;
    let total = head.len() + vertex_state.len() + tables.len();
    if total > (end - start) as usize {
        return Err(CompileError(format!(
            "tile {tile}: code and exchange tables need {total} bytes, but size_tile_code reserved {} (the final addresses made the exchange tables less compact than sized)",
            end - start
        )));
    }
    let mut allocations = input.allocations.clone();
    allocations.push(Allocation { start, end, kind: AllocationKind::Code, label: 0, first_step: 0, last_step: u32::MAX });
    allocations.sort_by_key(|a| (a.start, a.end));
    // The reserve past the written bytes is a load-time fill, not bytes in the package.
    let written = start + total as u32;
    let zero_fill = if written < end { vec![AddressRange { start: written, end }] } else { Vec::new() };
    Ok(TileBody { head, vertex_state, tables, allocations, zero_fill })
}

/// Assemble the package from the placed program, the final exchange tables and every tile's
/// input and image (in tile order). Vertex state and tables that several tiles hold are
/// pooled here, serially in tile order, so the pool's order is the order of first use.
pub fn assemble_package(
    target: &Target,
    graph: &Graph,
    lowered: &Lowered,
    placement: &Placement,
    exchanges: &[std::sync::Arc<PackedPhase>],
    inputs: &[TileInput],
    bodies: &[&TileBody],
) -> Result<Package, CompileError> {
    let tiles = lowered.tiles as usize;
    if inputs.len() != tiles || bodies.len() != tiles {
        return Err(CompileError(format!("package assembly: {} tile inputs and {} images for {tiles} tiles", inputs.len(), bodies.len())));
    }
    let mut set_cycles: Vec<Vec<u64>> = vec![vec![0; tiles]; lowered.compute_sets.len()];
    for (tile, input) in inputs.iter().enumerate() {
        for set in &input.sets {
            for call in &set.calls {
                set_cycles[set.index as usize][tile] += cost::vertex(target, call);
            }
        }
    }
    let mut pool: std::collections::HashMap<&[u8], u32> = std::collections::HashMap::new();
    let mut shared_segments: Vec<Vec<u8>> = Vec::new();
    let mut images: Vec<TileImage> = Vec::with_capacity(tiles);
    for (tile, (input, body)) in inputs.iter().zip(bodies).enumerate() {
        let start = input.code.0;
        let mut head = body.head.clone();
        image::stamp_tile(&mut head, tile as u32);
        let mut image = TileImage { tile: tile as u32, segments: Vec::new(), shared: Vec::new(), zero_fill: body.zero_fill.clone(), allocations: body.allocations.clone() };
        // Vertex state and tables that another tile holds too are stored once.
        let mut at = start + head.len() as u32;
        for part in [&body.vertex_state, &body.tables] {
            if part.is_empty() {
                continue;
            }
            let next = shared_segments.len() as u32;
            let index = *pool.entry(part.as_slice()).or_insert(next);
            if index == next {
                shared_segments.push(part.clone());
            }
            image.shared.push(SharedSegment { address: at, index });
            at += part.len() as u32;
        }
        image.segments.push(Segment { address: start, bytes: head });
        images.push(image);
    }
    let steps: Vec<Step> = lowered.steps.iter().map(|s| match s {
        LStep::Compute(i) => Step::Compute { index: *i },
        LStep::Exchange(p) => Step::Exchange { phase: *p },
    }).collect();
    let mut estimated = 0u64;
    let mut estimated_exchange = 0u64;
    for s in &lowered.steps {
        match s {
            LStep::Compute(i) => estimated += set_cycles[*i as usize].iter().copied().max().unwrap_or(0),
            LStep::Exchange(p) => {
                let c = cost::exchange_phase(target, exchanges[*p as usize].horizon);
                estimated += c;
                estimated_exchange += c;
            }
        }
    }
    let active_tiles = inputs.iter().filter(|i| !i.sets.is_empty()).count() as u32;
    let host = HostTables {
        inputs: lowered.inputs.iter().map(|t| host_tensor(placement, lowered, t)).collect(),
        initialize: lowered.initialize.clone(),
        outputs: lowered.outputs.iter().map(|t| host_tensor(placement, lowered, t)).collect(),
        checkpoints: lowered
            .checkpoints
            .iter()
            .map(|c| Checkpoint { operation: c.operation, after_step: c.after_step, tensor: host_tensor(placement, lowered, &c.tensor) })
            .collect(),
    };
    Ok(Package {
        compiler: crate::fingerprint::compiler_id(),
        target_toml: target.canonical_toml(),
        target_digest: target.digest(),
        workload_name: graph.name.clone(),
        workload_toml: graph.canonical_toml(),
        tiles: images,
        shared_segments,
        steps,
        phases: exchanges.iter().map(|p| PhaseSummary { index: p.index, horizon: p.horizon, endpoint_lower_bound: p.endpoint_lower_bound }).collect(),
        host,
        labels: lowered.labels.clone(),
        summary: Summary {
            operations: graph.compute_operation_count() as u32,
            active_tiles,
            gemm_flops: lowered.gemm_flops,
            estimated_cycles: estimated,
            estimated_exchange_cycles: estimated_exchange,
            logical_shards: lowered.logical_shards,
        },
    })
}

/// Each tile's encoded exchange tables over all phases (bindings, base lists and shared
/// segments), encoded in parallel over tiles (plain data), in tile order; an error names the
/// tile and phase whose offsets or slots do not fit a descriptor.
pub fn tile_tables<P: std::borrow::Borrow<PackedPhase>>(tiles: usize, exchanges: &[P]) -> Result<Vec<Vec<u8>>, String> {
    let mut per_tile: Vec<Vec<(u32, &PackedTile)>> = vec![Vec::new(); tiles];
    for phase in exchanges.iter().map(|p| p.borrow()) {
        for t in &phase.tiles {
            if let Some(v) = per_tile.get_mut(t.tile as usize) {
                v.push((phase.index, t));
            }
        }
    }
    per_tile.par_iter().map(|v| if v.is_empty() { Ok(Vec::new()) } else { tables::encode_tile(v) }).collect()
}

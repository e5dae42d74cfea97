//! `size_tile_code`, `prepare_tile_code`, `emit_tile_code`, `build_tile_images`: turn the placed
//! program into per-tile images and programs, and assemble the package.
//!
//! Each tile's code segment holds its vertex state (one fixed-size record per call) and its
//! exchange tables (one record per entry), encoded little-endian, so the bytes a tile needs
//! are accounted for in its memory; the simulator executes the structured calls and tables
//! that the same package carries beside them.

use crate::cost;
use crate::ir::Graph;
use crate::lower::{Call, LHostTensor, LStep, Loc, Lowered};
use crate::package::{
    Allocation, AllocationKind, Checkpoint, ComputeSet, ExchangePhase, HostSegment, HostTables, HostTensor, Operand, Package, Segment, Step,
    Summary, TileImage, VertexCall,
};
use crate::storage::Placement;
use crate::target::Target;

/// Bytes of the per-tile runtime header, one vertex-state record, one exchange-table record.
pub const RUNTIME_HEADER_BYTES: u32 = 64;
pub const VERTEX_RECORD_BYTES: u32 = 64;
pub const EXCHANGE_RECORD_BYTES: u32 = 16;

/// Bytes of code and tables per tile, from call counts and exchange entries (no addresses).
pub fn size_tile_code(lowered: &Lowered, entries_per_tile: &[u32]) -> Vec<u32> {
    let mut calls = vec![0u32; lowered.tiles as usize];
    for set in &lowered.compute_sets {
        for (tile, _) in set {
            calls[*tile as usize] += 1;
        }
    }
    calls
        .iter()
        .zip(entries_per_tile)
        .map(|(&c, &e)| RUNTIME_HEADER_BYTES + c * VERTEX_RECORD_BYTES + e * EXCHANGE_RECORD_BYTES)
        .collect()
}

fn operand(placement: &Placement, loc: &Loc) -> Operand {
    Operand { address: placement.addresses[loc.buffer as usize] + loc.offset * loc.dtype_bytes, row_stride: loc.row_stride }
}

fn vertex(placement: &Placement, call: &Call) -> VertexCall {
    call.map(|l| operand(placement, l))
}

/// Fixed-size little-endian record of a vertex call (tag, dims, operand addresses, strides).
fn encode_call(call: &VertexCall, out: &mut Vec<u8>) {
    let mut words: Vec<u32> = Vec::with_capacity(16);
    let mut ops = |tag: u32, dims: &[u32], operands: &[&Operand]| {
        words.push(tag);
        words.extend_from_slice(dims);
        for op in operands {
            words.push(op.address);
            words.push(op.row_stride);
        }
    };
    match call {
        VertexCall::MatMul { m, k, n, a, a_panel, b, b_transposed, c, partials } => {
            ops(1, &[*m, *k, *n, *a_panel, *b_transposed as u32 | (*partials as u32) << 1], &[a, b, c])
        }
        VertexCall::Reduce { rows, cols, parts, out: o } => {
            let mut refs: Vec<&Operand> = parts.iter().take(4).collect();
            refs.push(o);
            ops(2, &[*rows, *cols, parts.len() as u32], &refs)
        }
        VertexCall::Gelu { rows, cols, input, output } => ops(3, &[*rows, *cols], &[input, output]),
        VertexCall::Scale { rows, cols, factor, input, output } => ops(4, &[*rows, *cols, factor.to_bits()], &[input, output]),
        VertexCall::Add { rows, cols, a, b, output } => ops(5, &[*rows, *cols], &[a, b, output]),
        VertexCall::Softmax { rows, cols, input, output } => ops(6, &[*rows, *cols], &[input, output]),
        VertexCall::Copy { rows, cols, dtype, input, output } => ops(7, &[*rows, *cols, dtype.bytes()], &[input, output]),
    }
    words.resize((VERTEX_RECORD_BYTES / 4) as usize, 0);
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
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
    })
}

/// Assemble the package from the placed program and the final exchange tables.
pub fn build_package(target: &Target, graph: &Graph, lowered: &Lowered, placement: &Placement, exchanges: Vec<ExchangePhase>) -> Package {
    let tiles = lowered.tiles as usize;
    let mut images: Vec<TileImage> = (0..tiles as u32)
        .map(|tile| TileImage { tile, segments: Vec::new(), zero_fill: Vec::new(), allocations: Vec::new(), compute_sets: Vec::new() })
        .collect();
    let mut set_cycles: Vec<Vec<u64>> = vec![vec![0; tiles]; lowered.compute_sets.len()];
    for (index, set) in lowered.compute_sets.iter().enumerate() {
        for (tile, call) in set {
            let image = &mut images[*tile as usize];
            if image.compute_sets.last().is_none_or(|s| s.index != index as u32) {
                image.compute_sets.push(ComputeSet { index: index as u32, calls: Vec::new() });
            }
            let v = vertex(placement, call);
            set_cycles[index][*tile as usize] += cost::vertex(target, &v);
            image.compute_sets.last_mut().unwrap().calls.push(v);
        }
    }
    for (i, b) in lowered.buffers.iter().enumerate() {
        let start = placement.addresses[i];
        images[b.tile as usize].allocations.push(Allocation { start, end: start + b.bytes, kind: b.kind, label: b.label, first_step: b.first_step, last_step: b.last_step });
    }
    let mut entries: Vec<Vec<u8>> = vec![Vec::new(); tiles];
    for phase in &exchanges {
        for t in &phase.tiles {
            let bytes = &mut entries[t.tile as usize];
            for s in &t.sends {
                for w in [s.cycle, s.address, s.words, s.paired as u32] {
                    bytes.extend_from_slice(&w.to_le_bytes());
                }
            }
            for r in &t.receives {
                for w in [r.cycle, r.address, r.words, r.source << 1 | r.paired as u32] {
                    bytes.extend_from_slice(&w.to_le_bytes());
                }
            }
        }
    }
    for (tile, image) in images.iter_mut().enumerate() {
        let (start, end) = placement.code[tile];
        let mut code = Vec::with_capacity((end - start) as usize);
        for w in [tile as u32, image.compute_sets.len() as u32, lowered.steps.len() as u32, 0] {
            code.extend_from_slice(&w.to_le_bytes());
        }
        code.resize(RUNTIME_HEADER_BYTES as usize, 0);
        for set in &image.compute_sets {
            for call in &set.calls {
                encode_call(call, &mut code);
            }
        }
        code.extend_from_slice(&entries[tile]);
        code.resize((end - start) as usize, 0);
        image.allocations.push(Allocation { start, end, kind: AllocationKind::Code, label: 0, first_step: 0, last_step: u32::MAX });
        image.allocations.sort_by_key(|a| (a.start, a.end));
        image.segments.push(Segment { address: start, bytes: code });
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
    let active_tiles = images.iter().filter(|i| !i.compute_sets.is_empty()).count() as u32;
    let host = HostTables {
        inputs: lowered.inputs.iter().map(|t| host_tensor(placement, lowered, t)).collect(),
        outputs: lowered.outputs.iter().map(|t| host_tensor(placement, lowered, t)).collect(),
        checkpoints: lowered
            .checkpoints
            .iter()
            .map(|c| Checkpoint { operation: c.operation, after_step: c.after_step, tensor: host_tensor(placement, lowered, &c.tensor) })
            .collect(),
    };
    Package {
        compiler: crate::fingerprint::compiler_id(),
        target_toml: target.canonical_toml(),
        target_digest: target.digest(),
        workload_name: graph.name.clone(),
        workload_toml: graph.canonical_toml(),
        tiles: images,
        steps,
        exchanges,
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
    }
}

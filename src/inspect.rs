//! `ipuq inspect PACKAGE`: what a package holds, read through the same checks as `ipuq run`
//! (header, checksum, archive validation), without running it; calls and exchange tables are
//! decoded from the tile images, as the device decodes them.

use std::path::Path;

use std::collections::BTreeMap;

use ipuq_queries::image;
use ipuq_queries::package::{AllocationKind, Package, Step};
use ipuq_queries::tables::PackedTile;

use crate::build::read_package;

pub fn run(path: &Path) -> Result<(), String> {
    let package = read_package(path).map_err(|e| e.to_string())?;
    print!("{}", describe(&package)?);
    Ok(())
}

/// A plain-text description: identity, program shape, memory use, exchange and host tables.
/// Calls and tables are decoded from the tile images (an error names a tile whose image does
/// not decode).
pub fn describe(p: &Package) -> Result<String, String> {
    let programs = image::decode_package(p).map_err(|e| format!("{}: {e}", p.workload_name))?;
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    line(format!("package workload={} compiler=\"{}\" target_digest={}", p.workload_name, p.compiler, p.target_digest.short()));
    let computes = p.steps.iter().filter(|s| matches!(s, Step::Compute { .. })).count();
    line(format!(
        "program tiles={} activeTiles={} steps={} computeSets={} exchangePhases={} estimatedCycles={} estimatedExchangeCycles={}",
        p.tile_count(),
        p.summary.active_tiles,
        p.steps.len(),
        computes,
        p.phases.len(),
        p.summary.estimated_cycles,
        p.summary.estimated_exchange_cycles
    ));
    let mut peak = (0u64, 0u32);
    let mut code = 0u64;
    let mut calls = 0usize;
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for (tile, program) in p.tiles.iter().zip(&programs) {
        let bytes: u64 = tile.allocations.iter().map(|a| a.end.saturating_sub(a.start) as u64).sum();
        if bytes > peak.0 {
            peak = (bytes, tile.tile);
        }
        code = code.max(tile.allocations.iter().filter(|a| a.kind == AllocationKind::Code).map(|a| a.end.saturating_sub(a.start) as u64).sum());
        calls += program.compute_sets.iter().map(|s| s.calls.len()).sum::<usize>();
        for call in program.compute_sets.iter().flat_map(|s| &s.calls) {
            *kinds.entry(call.kind_name()).or_insert(0usize) += 1;
        }
    }
    line(format!("memory largestAllocatedBytes={} onTile={} largestCodeBytes={} vertexCalls={calls}", peak.0, peak.1, code));
    // Calls per vertex kind, by name.
    line(format!("vertices {}", kinds.iter().map(|(k, n)| format!("{k}={n}")).collect::<Vec<_>>().join(" ")));
    // Exchange-table bytes per tile, as the runtime headers state them (shared copies count per tile).
    let table_bytes: Vec<(u32, u32)> = p.tiles.iter().filter_map(|t| image::header_of(&p.shared_segments, t).map(|h| (h.table_bytes, t.tile))).collect();
    let (largest, on) = table_bytes.iter().map(|&(b, t)| (b, std::cmp::Reverse(t))).max().map_or((0, 0), |(b, t)| (b, t.0));
    let total: u64 = table_bytes.iter().map(|&(b, _)| b as u64).sum();
    line(format!("exchangeTables totalBytes={total} largestBytes={largest} onTile={on}"));
    let mut per_phase: BTreeMap<u32, Vec<&PackedTile>> = BTreeMap::new();
    for program in &programs {
        for (phase, t) in &program.tables {
            per_phase.entry(*phase).or_default().push(t);
        }
    }
    for phase in &p.phases {
        let tiles = per_phase.get(&phase.index).map(Vec::as_slice).unwrap_or_default();
        let count = |runs: &mut dyn Iterator<Item = u32>| runs.fold(0u64, |a, c| a.saturating_add(c as u64));
        let sends = count(&mut tiles.iter().flat_map(|t| t.sends.iter().map(|r| r.count)));
        let receives = count(&mut tiles.iter().flat_map(|t| t.receives.iter().map(|r| r.count)));
        let send_runs: usize = tiles.iter().map(|t| t.sends.len()).sum();
        let receive_runs: usize = tiles.iter().map(|t| t.receives.len()).sum();
        line(format!(
            "exchange phase={} tiles={} sendEntries={sends} receiveEntries={receives} sendRuns={send_runs} receiveRuns={receive_runs} horizon={} endpointLowerBound={}",
            phase.index,
            tiles.len(),
            phase.horizon,
            phase.endpoint_lower_bound
        ));
    }
    let tables = [("input", &p.host.inputs), ("output", &p.host.outputs)];
    for (kind, tensors) in tables {
        for t in tensors.iter() {
            line(format!("host {kind}={} shape={:?} dtype={} role={:?} segments={} streamedElements={}", t.name, t.shape, t.dtype.name(), t.role, t.segments.len(), t.streamed_elements()));
        }
    }
    for c in &p.host.checkpoints {
        line(format!("checkpoint operation={} value={} afterStep={}", c.operation, c.tensor.name, c.after_step));
    }
    Ok(out)
}

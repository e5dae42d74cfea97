//! `ipuq inspect PACKAGE`: what a package holds, read through the same checks as `ipuq run`
//! (header, checksum, archive validation), without running it; calls and exchange tables are
//! decoded from the tile images, as the device decodes them.
//!
//! Each exchange phase also gets how busy the tiles' ports are (`port_use`): the cycles each
//! tile's receive port and send port are held, at the package's target rates and by the
//! simulator's port rules (one entry at a time; a paired entry moves two words a cycle and
//! also holds the supertile partner's port, which only paired entries of the same stream may
//! share), against the phase's horizon. A phase whose busiest port is far below its horizon
//! waits on delays or on one tile; receive cycles the run's phases leave idle (the load-time
//! phases of the "initialize" call not counted) are what a transfer moved into earlier phases
//! (a weight prefetch) could use.
//!
//! Memory is also given live (`memoryPeak`): the most bytes any tile holds at one program step,
//! each allocation counted from its first step to its last (host-written weights from the
//! start of the run to their last read, code throughout), and what holds them there, by label
//! prefix (a layer's `l3`) and the largest labels.

use std::path::Path;

use std::collections::BTreeMap;

use ipuq_queries::emit::{HOST_RECORD_BYTES, RUNTIME_HEADER_BYTES};
use ipuq_queries::image;
use ipuq_queries::package::{AllocationKind, Package, Step};
use ipuq_queries::tables::{PackedTile, MAX_PHASE_ENTRIES};
use ipuq_queries::target::Target;

use crate::build::read_package;
use crate::device::simulator::exchange::entry_cycles;

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
    // What a tile's code allocation holds, as its runtime header states it: on the tile whose
    // header states the most bytes, and the mean over the tiles (a deep stack's code grows with
    // its layers: which part grows is what a fix must shrink).
    let headers: Vec<(u32, image::Header)> = p.tiles.iter().filter_map(|t| image::header_of(&p.shared_segments, t).map(|h| (t.tile, h))).collect();
    if let Some((tile, h)) = headers.iter().max_by_key(|(t, h)| (h.end(), std::cmp::Reverse(*t))) {
        // Host-record, vertex-state and table bytes, and table bindings (the rest of the code
        // is the runtime header).
        let parts = |h: &image::Header| [h.host_records as u64 * HOST_RECORD_BYTES as u64, h.vertex_bytes as u64, h.table_bytes as u64, h.bindings as u64];
        let mut sum = [0u64; 4];
        for (_, h) in &headers {
            for (s, v) in sum.iter_mut().zip(parts(h)) {
                *s += v;
            }
        }
        let [mean_host, mean_vertex, mean_tables, mean_bindings] = sum.map(|s| s / headers.len() as u64);
        let [host, vertex, tables, bindings] = parts(h);
        line(format!(
            "code onTile={tile} headerBytes={RUNTIME_HEADER_BYTES} hostRecordBytes={host} vertexStateBytes={vertex} exchangeTableBytes={tables} tableBindings={bindings} meanHostRecordBytes={mean_host} meanVertexStateBytes={mean_vertex} meanExchangeTableBytes={mean_tables} meanTableBindings={mean_bindings}"
        ));
    }
    // The most bytes live at one step on one tile (allocations over their lifetimes, code
    // included), and what holds them: by label prefix (a layer, `l3`), then the largest labels.
    let live = live_peak(p.tiles.iter().map(|t| (t.tile, &t.allocations[..])), p.steps.len() as u32);
    if let Some(live) = live {
        let step = match p.steps.get(live.step as usize) {
            Some(Step::Compute { index }) => format!("compute:{index}"),
            Some(Step::Exchange { phase }) => format!("exchange:{phase}"),
            None => "after".to_string(),
        };
        let held = p.tiles.iter().find(|t| t.tile == live.tile).map(|t| t.allocations.iter().filter(|a| a.live_at(live.step)).map(|a| (p.labels.get(a.label as usize).map_or("?", |l| l.as_str()), a.end.saturating_sub(a.start) as u64)).collect::<Vec<_>>()).unwrap_or_default();
        let grouped = |key: &dyn Fn(&str) -> String| {
            let mut by: BTreeMap<String, u64> = BTreeMap::new();
            for &(label, bytes) in &held {
                *by.entry(key(label)).or_insert(0) += bytes;
            }
            let mut v: Vec<(String, u64)> = by.into_iter().collect();
            v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            v
        };
        let words = |v: &[(String, u64)]| v.iter().map(|(k, b)| format!("{k}={b}")).collect::<Vec<_>>().join(" ");
        line(format!("memoryPeak liveBytes={} onTile={} atStep={} step={step} allocations={}", live.bytes, live.tile, live.step, held.len()));
        line(format!("memoryPeakByPrefix {}", words(&grouped(&|l| l.split('.').next().unwrap_or(l).to_string()))));
        let largest = grouped(&|l| l.to_string());
        line(format!("memoryPeakLargest {}", words(&largest[..largest.len().min(8)])));
    }
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
    let target = Target::from_toml(&p.target_toml, "the package's target").map_err(|e| format!("{}: {e}", p.workload_name))?;
    let mut ports = Vec::with_capacity(p.phases.len());
    for phase in &p.phases {
        let tiles = per_phase.get(&phase.index).map(Vec::as_slice).unwrap_or_default();
        ports.push(port_use(&target, p.tile_count(), tiles).map_err(|e| format!("{}: exchange phase {}: {e}", p.workload_name, phase.index))?);
    }
    // Port time over the run: every tile, every exchange step (tiles a phase leaves out idle);
    // the phases the "initialize" call runs at load time are not part of it.
    let position: BTreeMap<u32, usize> = p.phases.iter().enumerate().map(|(i, ph)| (ph.index, i)).collect();
    let run: Vec<usize> = p.steps.iter().filter_map(|s| if let Step::Exchange { phase } = s { position.get(phase).copied() } else { None }).collect();
    let horizons: u64 = run.iter().map(|&i| p.phases[i].horizon as u64).sum();
    let tiles = p.tile_count() as u64;
    let receive_busy: u64 = run.iter().map(|&i| ports[i].receive.iter().sum::<u64>()).sum();
    let send_busy: u64 = run.iter().map(|&i| ports[i].send.iter().sum::<u64>()).sum();
    let idle: u64 = run.iter().map(|&i| ports[i].receive.iter().map(|&b| (p.phases[i].horizon as u64).saturating_sub(b)).sum::<u64>()).sum();
    let percent = |busy: u64| if horizons * tiles == 0 { 0.0 } else { 100.0 * busy as f64 / (horizons * tiles) as f64 };
    line(format!(
        "exchangePorts runSteps={} horizonCycles={horizons} receiveBusyPercent={:.1} sendBusyPercent={:.1} idleReceiveCyclesPerTile={}",
        run.len(),
        percent(receive_busy),
        percent(send_busy),
        idle.checked_div(tiles).unwrap_or(0)
    ));
    for (position, (phase, use_)) in p.phases.iter().zip(&ports).enumerate() {
        let tiles = per_phase.get(&phase.index).map(Vec::as_slice).unwrap_or_default();
        // When the phase runs: at steps of the run, or in the "initialize" call at load time.
        let when = if run.contains(&position) {
            "run"
        } else if p.host.initialize.contains(&phase.index) {
            "initialize"
        } else {
            "never"
        };
        let count = |runs: &mut dyn Iterator<Item = u32>| runs.fold(0u64, |a, c| a.saturating_add(c as u64));
        let sends = count(&mut tiles.iter().flat_map(|t| t.sends.iter().map(|r| r.count)));
        let receives = count(&mut tiles.iter().flat_map(|t| t.receives.iter().map(|r| r.count)));
        let send_runs: usize = tiles.iter().map(|t| t.sends.len()).sum();
        let receive_runs: usize = tiles.iter().map(|t| t.receives.len()).sum();
        let mean = |v: &[u64]| if v.is_empty() { 0 } else { v.iter().sum::<u64>().div_ceil(v.len() as u64) };
        line(format!(
            "exchange phase={} when={when} tiles={} sendEntries={sends} receiveEntries={receives} sendRuns={send_runs} receiveRuns={receive_runs} horizon={} endpointLowerBound={} receivePortBusyMean={} receivePortBusyMax={} sendPortBusyMean={} sendPortBusyMax={}",
            phase.index,
            tiles.len(),
            phase.horizon,
            phase.endpoint_lower_bound,
            mean(&use_.receive),
            use_.receive.iter().max().copied().unwrap_or(0),
            mean(&use_.send),
            use_.send.iter().max().copied().unwrap_or(0),
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

/// Cycles each tile's ports are held in one exchange phase (index: tile).
#[derive(Debug, PartialEq)]
pub struct PortUse {
    pub receive: Vec<u64>,
    pub send: Vec<u64>,
}

/// The cycles each tile's receive and send ports are held by a phase's tables: the union of the
/// tile's own entries and its supertile partner's paired entries (a paired entry holds both
/// ports; the partner's own entries of the same stream overlap it and count once), each
/// as long as the simulator holds it (`entry_cycles`). Runs are expanded
/// entry by entry, at most `MAX_PHASE_ENTRIES` for the phase, as the device expands them.
pub fn port_use(target: &Target, tile_count: u32, tiles: &[&PackedTile]) -> Result<PortUse, String> {
    let x = &target.exchange;
    let n = tile_count as usize;
    let mut receive: Vec<Vec<(u64, u64)>> = vec![Vec::new(); n];
    let mut send: Vec<Vec<(u64, u64)>> = vec![Vec::new(); n];
    let mut budget = MAX_PHASE_ENTRIES;
    for t in tiles {
        let tile = t.tile as usize;
        if tile >= n {
            return Err(format!("tile {tile} has exchange tables but the package has {n} tiles"));
        }
        let partner = tile ^ 1;
        let receives = t.receives.iter().map(|r| (false, r.cycle, r.words, r.paired, r.count, r.cycle_stride, x.receive_words_per_cycle));
        let sends = t.sends.iter().map(|r| (true, r.cycle, r.words, r.paired, r.count, r.cycle_stride, x.send_words_per_cycle));
        for (is_send, cycle, words, paired, count, stride, rate) in receives.chain(sends) {
            budget = budget.checked_sub(count as u64).ok_or_else(|| format!("tile {tile}: its runs hold more than {MAX_PHASE_ENTRIES} entries"))?;
            let ports = if is_send { &mut send } else { &mut receive };
            let d = entry_cycles(target, words, paired, rate);
            for i in 0..count as u64 {
                let start = cycle as u64 + i * stride as u64;
                ports[tile].push((start, start + d));
                if paired && partner < n {
                    ports[partner].push((start, start + d));
                }
            }
        }
    }
    let union = |mut v: Vec<(u64, u64)>| {
        v.sort_unstable();
        let (mut total, mut end) = (0u64, 0u64);
        for (a, b) in v {
            let a = a.max(end);
            if b > a {
                total += b - a;
                end = b;
            }
        }
        total
    };
    Ok(PortUse { receive: receive.into_iter().map(union).collect(), send: send.into_iter().map(union).collect() })
}

/// The most bytes live at one step on one tile, the lowest tile and step among equals.
#[derive(Debug, PartialEq)]
struct LivePeak {
    bytes: u64,
    tile: u32,
    step: u32,
}

/// [`LivePeak`] over `tiles` (tile, allocations) of a program of `steps` steps: an allocation
/// holds its bytes from its first step to its last, inclusive (`steps` itself: the host reads
/// it after the run). None without allocations.
fn live_peak<'a>(tiles: impl Iterator<Item = (u32, &'a [ipuq_queries::package::Allocation])>, steps: u32) -> Option<LivePeak> {
    let mut best: Option<LivePeak> = None;
    for (tile, allocations) in tiles {
        let mut delta = vec![0i64; steps as usize + 2];
        for a in allocations {
            let bytes = a.end.saturating_sub(a.start) as i64;
            let (first, last) = (a.first_step.min(steps), a.last_step.min(steps));
            if first > last {
                continue;
            }
            delta[first as usize] += bytes;
            delta[last as usize + 1] -= bytes;
        }
        let mut live = 0i64;
        for (step, d) in delta.iter().take(steps as usize + 1).enumerate() {
            live += d;
            let better = best.as_ref().is_none_or(|b| live as u64 > b.bytes || (live as u64 == b.bytes && (tile, step as u32) < (b.tile, b.step)));
            if live > 0 && better {
                best = Some(LivePeak { bytes: live as u64, tile, step: step as u32 });
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipuq_queries::tables::{ReceiveRun, SendRun};
    use ipuq_queries::target::fixtures;

    fn receive(cycle: u32, source: u32, words: u32, paired: bool, count: u32, cycle_stride: u32) -> ReceiveRun {
        ReceiveRun { cycle, source, slot: 0, address: 0, words, paired, count, cycle_stride, address_stride: 4 * words }
    }

    fn send(cycle: u32, words: u32, paired: bool, count: u32, cycle_stride: u32) -> SendRun {
        SendRun { cycle, slot: 0, address: 0, words, paired, count, cycle_stride, address_stride: 4 * words }
    }

    /// Bytes count over their lifetimes only: two buffers that follow each other are never
    /// live together, a host-read one lives past the last step, and equal peaks name the
    /// lowest tile and step.
    #[test]
    fn the_live_peak_counts_allocations_over_their_lifetimes() {
        use ipuq_queries::package::Allocation;
        let a = |start: u32, end: u32, first_step: u32, last_step: u32| Allocation { start, end, kind: AllocationKind::Data, label: 0, first_step, last_step };
        // Tile 0: 100 bytes at steps 0..=1 and 300 at 2..=3 reuse one range; 50 live throughout.
        let t0 = vec![a(0, 100, 0, 1), a(0, 300, 2, 3), a(400, 450, 0, 4)];
        // Tile 1: 200 and 150 together at step 3 only; 0 bytes at step 4 (the host's read).
        let t1 = vec![a(0, 200, 1, 3), a(200, 350, 3, 4)];
        let peak = live_peak([(0, &t0[..]), (1, &t1[..])].into_iter(), 4).unwrap();
        assert_eq!(peak, LivePeak { bytes: 350, tile: 0, step: 2 });
        let t1 = vec![a(0, 200, 1, 3), a(200, 351, 3, 4)];
        assert_eq!(live_peak([(0, &t0[..]), (1, &t1[..])].into_iter(), 4).unwrap(), LivePeak { bytes: 351, tile: 1, step: 3 });
        // A buffer the host reads after a 4-step run is live at step 4.
        let t2 = vec![a(0, 500, 4, 4)];
        assert_eq!(live_peak([(2, &t2[..])].into_iter(), 4).unwrap(), LivePeak { bytes: 500, tile: 2, step: 4 });
        assert_eq!(live_peak(std::iter::empty(), 4), None);
    }

    #[test]
    fn a_paired_entry_holds_the_partners_port_and_a_shared_stream_counts_once() {
        let target = Target::from_toml(fixtures::SMALL16, "small16").unwrap();
        // Tile 2 hears 8 words from tile 5 paired at cycle 10 (4 cycles at two words a cycle),
        // and tile 3, its partner, the same stream (its own entry); tile 3 also takes 3 words
        // unpaired at cycle 20, and a run of two 2-word entries 5 cycles apart from cycle 30.
        let t2 = PackedTile { tile: 2, bases: vec![], sends: vec![], receives: vec![receive(10, 5, 8, true, 1, 0)] };
        let t3 = PackedTile { tile: 3, bases: vec![], sends: vec![], receives: vec![receive(10, 5, 8, true, 1, 0), receive(20, 7, 3, false, 1, 0), receive(30, 7, 2, false, 2, 5)] };
        // Tile 5 sends the 8 words paired (holding tile 4's send port too); tile 7 sends the rest.
        let t5 = PackedTile { tile: 5, bases: vec![], sends: vec![send(4, 8, true, 1, 0)], receives: vec![] };
        let t7 = PackedTile { tile: 7, bases: vec![], sends: vec![send(14, 3, false, 1, 0), send(24, 2, false, 2, 5)], receives: vec![] };
        let u = port_use(&target, 16, &[&t2, &t3, &t5, &t7]).unwrap();
        let mut receive_expected = vec![0u64; 16];
        receive_expected[2] = 4;
        receive_expected[3] = 4 + 3 + 2 + 2;
        assert_eq!(u.receive, receive_expected);
        let mut send_expected = vec![0u64; 16];
        send_expected[4] = 4;
        send_expected[5] = 4;
        send_expected[7] = 3 + 2 + 2;
        assert_eq!(u.send, send_expected);
        // Two different paired streams into one pair take the pair's ports one after another.
        let t2b = PackedTile { tile: 2, bases: vec![], sends: vec![], receives: vec![receive(10, 5, 8, true, 1, 0)] };
        let t3b = PackedTile { tile: 3, bases: vec![], sends: vec![], receives: vec![receive(14, 9, 8, true, 1, 0)] };
        let u = port_use(&target, 16, &[&t2b, &t3b]).unwrap();
        assert_eq!((u.receive[2], u.receive[3]), (8, 8));
        // A tile past the package's is an error naming it.
        let stray = PackedTile { tile: 16, bases: vec![], sends: vec![], receives: vec![receive(0, 1, 1, false, 1, 0)] };
        assert!(port_use(&target, 16, &[&stray]).unwrap_err().contains("tile 16"));
    }
}

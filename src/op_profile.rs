//! Cycles per operation kind: a run's profile (`execution.ipuprofile`) split over the
//! operations of the package that produced it (`ipuq profile FILE --package PACKAGE`), or per
//! operation in program order (`--operations`).
//!
//! Each operation owns the program steps after the previous operation's checkpoint up to and
//! including its own (`Checkpoint::after_step`): their exchange cycles are its. A compute
//! step's cycles are split by call, since the lowering runs one operation's calls in another's
//! compute set where no exchange lies between (a product's matrix calls beside the reduction
//! of the product before it, a LayerNorm's statistics beside the residual add they read): on
//! the step's slowest tile, which sets the step's length, each call's cycles by the target's
//! formulas (`cost::vertex`, as the simulator prices it) go to the operation whose buffer the
//! call writes (its allocation's label, a value of the workload or one with a suffix such as
//! `.partials`), and the step's cycles are shared in those proportions. Copies (a gathered
//! block staged, an operand laid out in panels, a transposed write-out) and calls whose buffer
//! names no operation with a row count with the operation owning the step. Efficiency is the
//! matrix-product FLOPs of the kind over the kind's cycles at the chip's peak (all tiles).

use std::fmt;

use ipuq_queries::cost;
use ipuq_queries::image;
use ipuq_queries::ir::{split3, Graph, OpKind, Producer};
use ipuq_queries::package::{Operand, Package, Step, VertexCall};
use ipuq_queries::target::Target;

use crate::device::Timeline;

/// One operation kind's share of a run (or one operation's, named with its kind).
#[derive(Clone, Debug, PartialEq)]
pub struct KindRow {
    pub kind: String,
    pub operations: u32,
    pub compute_cycles: u64,
    pub exchange_cycles: u64,
    pub flops: u64,
}

/// The split of a run by operation kind, and the run's total.
#[derive(Clone, Debug, PartialEq)]
pub struct KindProfile {
    /// Rows by kind (most cycles first), or per operation (program order).
    pub rows: Vec<KindRow>,
    /// Whether each row is one operation.
    pub per_operation: bool,
    pub total_cycles: u64,
    pub peak_flops_per_cycle: u64,
}

/// Split `timeline` (a run of `package`) by operation kind.
pub fn by_kind(package: &Package, timeline: &Timeline) -> Result<KindProfile, String> {
    split(package, timeline, false)
}

/// Split `timeline` (a run of `package`) by operation, in program order: each row is named
/// `operation (kind)`; an operation without steps of its own (run side by side with the one
/// before it, or in its compute set: see the module note) joins that one's row, named beside
/// it (`l0.q.product + l0.k.product + l0.v.product (matmul)`).
pub fn by_operation(package: &Package, timeline: &Timeline) -> Result<KindProfile, String> {
    split(package, timeline, true)
}

fn split(package: &Package, timeline: &Timeline, per_operation: bool) -> Result<KindProfile, String> {
    if timeline.steps.len() != package.steps.len() {
        return Err(format!("the profile has {} steps, the package {}: not a run of this package", timeline.steps.len(), package.steps.len()));
    }
    if !timeline.steps.iter().map(|s| s.0).eq(package.steps.iter().copied()) {
        return Err("the profile's steps are not the package's compute sets and exchange phases: not a run of this package".into());
    }
    if !timeline.tiles.iter().copied().eq(package.tiles.iter().map(|t| t.tile)) {
        return Err(format!("the profile's {} tiles are not the package's {}: not a run of this package", timeline.tiles.len(), package.tiles.len()));
    }
    let graph = Graph::parse(&package.workload_toml, &package.workload_name).map_err(|e| e.to_string())?;
    let target = Target::from_toml(&package.target_toml, "package").map_err(|e| e.to_string())?;
    let mut checkpoints: Vec<(u32, u32)> = package.host.checkpoints.iter().map(|c| (c.after_step, c.operation)).collect();
    checkpoints.sort_unstable();
    // By kind in the order first met, or per operation in program order.
    let mut rows: Vec<KindRow> = Vec::new();
    let mut first = 0usize;
    let checkpointed: std::collections::BTreeSet<u32> = checkpoints.iter().map(|c| c.1).collect();
    // The row each compute step belongs to by checkpoints, and each operation's row.
    let mut step_row: Vec<Option<usize>> = vec![None; timeline.steps.len()];
    let mut row_of_operation: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    for (after, operation) in checkpoints {
        let op = graph.operations.get(operation as usize).ok_or_else(|| format!("checkpoint of operation {operation}, which the workload lacks"))?;
        // An add folded into a product's epilogue: its checkpoint closes the product's steps
        // (the product has none of its own), so they count as the product's.
        let folded_product = match op.kind {
            OpKind::BiasAdd | OpKind::Add => op.inputs.iter().find_map(|&v| match graph.value(v).producer {
                Producer::Operation(i) if !checkpointed.contains(&(i as u32)) && matches!(graph.operations[i].kind, OpKind::MatMul { .. }) => Some(i),
                _ => None,
            }),
            _ => None,
        };
        let op = folded_product.map_or(op, |i| &graph.operations[i]);
        // A softmax whose normalisation the product reading it applies has no checkpoint (its
        // probabilities never exist on the device): its steps close with the product's.
        let deferred_softmax = match graph.value(op.inputs[0]).producer {
            Producer::Operation(i) if matches!(op.kind, OpKind::MatMul { .. }) && !checkpointed.contains(&(i as u32)) && matches!(graph.operations[i].kind, OpKind::Softmax) => Some(i),
            _ => None,
        };
        let kind = match &op.kind {
            OpKind::Softmax => "softmax (scale folded in)".to_string(),
            OpKind::MatMul { .. } if deferred_softmax.is_some() => "softmax (normalisation deferred) + matmul".to_string(),
            k => k.name().to_string(),
        };
        let last = (after as usize + 1).min(timeline.steps.len());
        let name = &graph.value(op.output).name;
        let at = match rows.last_mut() {
            _ if !per_operation => rows.iter().position(|r| r.kind == kind),
            // No steps of its own (run side by side with the operation before, or in its
            // compute set): it joins that operation's row, named beside it. The names end at
            // the first " (" (a kind may hold parentheses of its own).
            Some(row) if first >= last => {
                row.kind = match row.kind.split_once(" (") {
                    Some((names, rest)) => format!("{names} + {name} ({rest}"),
                    None => format!("{} + {name}", row.kind),
                };
                Some(rows.len() - 1)
            }
            _ => None,
        };
        let at = at.unwrap_or_else(|| {
            let kind = if per_operation { format!("{name} ({kind})") } else { kind };
            rows.push(KindRow { kind, operations: 0, compute_cycles: 0, exchange_cycles: 0, flops: 0 });
            rows.len() - 1
        });
        let row = &mut rows[at];
        row.operations += 1;
        if let OpKind::MatMul { transpose_b } = op.kind {
            let (batches, m, k) = split3(&graph.value(op.inputs[0]).shape);
            let b = split3(&graph.value(op.inputs[1]).shape);
            let n = if transpose_b { b.1 } else { b.2 };
            row.flops += 2 * batches as u64 * m as u64 * k as u64 * n as u64;
        }
        for (s, &(step, cycles)) in timeline.steps.iter().enumerate().take(last).skip(first.min(last)) {
            match step {
                Step::Compute { .. } => step_row[s] = Some(at),
                Step::Exchange { .. } => row.exchange_cycles += cycles,
            }
        }
        // The operations whose buffers name this row: the checkpointed one, and the product
        // or softmax whose steps it closes.
        for i in [Some(operation as usize), folded_product, deferred_softmax].into_iter().flatten() {
            row_of_operation.insert(i, at);
        }
        first = first.max(last);
    }
    let programs = image::decode_package(package).map_err(|e| format!("{}: {e}", package.workload_name))?;
    for (s, row) in step_row.iter().enumerate() {
        let Some(row) = *row else { continue };
        for (at, cycles) in split_compute_step(package, &programs, timeline, &graph, &target, &row_of_operation, s, row) {
            rows[at].compute_cycles += cycles;
        }
    }
    let total_cycles = timeline.steps.iter().map(|s| s.1).sum();
    let peak = target.compute.peak_flops_per_cycle as u64 * target.chip.tiles as u64;
    if !per_operation {
        // Most cycles first; ties by kind.
        rows.sort_by(|a, b| (b.compute_cycles + b.exchange_cycles).cmp(&(a.compute_cycles + a.exchange_cycles)).then_with(|| a.kind.cmp(&b.kind)));
    }
    Ok(KindProfile { rows, per_operation, total_cycles, peak_flops_per_cycle: peak })
}

/// The buffer a call writes.
fn written(call: &VertexCall) -> Operand {
    match call {
        VertexCall::MatMul { c, .. } => *c,
        VertexCall::Reduce { out, .. } => *out,
        VertexCall::LayerNormStatistics { statistics, .. } => *statistics,
        VertexCall::Gelu { output, .. }
        | VertexCall::Scale { output, .. }
        | VertexCall::Add { output, .. }
        | VertexCall::Softmax { output, .. }
        | VertexCall::GeluErf { output, .. }
        | VertexCall::BiasAdd { output, .. }
        | VertexCall::LayerNorm { output, .. }
        | VertexCall::Copy { output, .. }
        | VertexCall::CopyWords { output, .. }
        | VertexCall::CopyHalves { output, .. }
        | VertexCall::Transpose { output, .. }
        | VertexCall::LayerNormSegment { output, .. } => *output,
    }
}

/// A call's dimensions (rows, columns, inner size or segments).
fn sizes(call: &VertexCall) -> [u32; 3] {
    match call {
        VertexCall::MatMul { m, k, n, .. } => [*m, *k, *n],
        VertexCall::Reduce { rows, cols, parts, .. } => [*rows, *cols, parts.len().try_into().unwrap_or(u32::MAX)],
        VertexCall::LayerNormSegment { rows, cols, segments, .. } => [*rows, *cols, *segments],
        VertexCall::Gelu { rows, cols, .. }
        | VertexCall::Scale { rows, cols, .. }
        | VertexCall::Add { rows, cols, .. }
        | VertexCall::Softmax { rows, cols, .. }
        | VertexCall::GeluErf { rows, cols, .. }
        | VertexCall::BiasAdd { rows, cols, .. }
        | VertexCall::LayerNorm { rows, cols, .. }
        | VertexCall::Copy { rows, cols, .. }
        | VertexCall::CopyWords { rows, cols, .. }
        | VertexCall::CopyHalves { rows, cols, .. }
        | VertexCall::Transpose { rows, cols, .. }
        | VertexCall::LayerNormStatistics { rows, cols, .. } => [*rows, *cols, 0],
    }
}

/// Compute step `s`'s cycles split over rows (module docs): on its slowest tile, each call's
/// cycles to the row of the operation whose buffer it writes (`row` where none has one), the
/// step's cycles shared in those proportions (rounded down, the remainder to the largest
/// share), so the shares add up to the step's cycles.
#[allow(clippy::too_many_arguments)]
fn split_compute_step(
    package: &Package,
    programs: &[image::TileProgram],
    timeline: &Timeline,
    graph: &Graph,
    target: &Target,
    row_of_operation: &std::collections::HashMap<usize, usize>,
    s: usize,
    row: usize,
) -> Vec<(usize, u64)> {
    let (step, cycles) = timeline.steps[s];
    let Step::Compute { index } = step else { return vec![] };
    // The slowest tile (the first of equals).
    let slowest = (0..timeline.tiles.len()).max_by_key(|&slot| (timeline.record(s, slot).compute, std::cmp::Reverse(slot)));
    let calls = slowest.and_then(|slot| Some((package.tiles.get(slot)?, programs.get(slot)?.compute_sets.iter().find(|c| c.index == index)?)));
    let mut shares: Vec<(usize, u64)> = Vec::new();
    if let Some((image, set)) = calls {
        for call in &set.calls {
            // A copy moves a block into the layout the step's operation reads (a gathered
            // block staged, an operand panel): it counts with the step's owner.
            let copy = matches!(call, VertexCall::Copy { .. } | VertexCall::CopyWords { .. } | VertexCall::CopyHalves { .. } | VertexCall::Transpose { .. });
            let address = written(call).address;
            // The buffer live at this step that holds the written address (the latest begun).
            let owner = (!copy)
                .then(|| image.allocations.iter().filter(|a| a.start <= address && address < a.end && a.live_at(s as u32)).max_by_key(|a| a.first_step))
                .flatten()
                .and_then(|a| package.labels.get(a.label as usize))
                .and_then(|label| operation_of(graph, label))
                .and_then(|op| row_of_operation.get(&op).copied())
                .unwrap_or(row);
            // A call the device ran has no dimension past a tile's bytes; one that has (a
            // package other than the run's) is not priced, its formulas' products could overflow.
            let c = if sizes(call).iter().all(|&d| d <= target.memory.size) { cost::vertex(target, call) } else { 0 };
            match shares.iter_mut().find(|x| x.0 == owner) {
                Some(x) => x.1 += c,
                None => shares.push((owner, c)),
            }
        }
    }
    let total: u64 = shares.iter().map(|x| x.1).sum();
    if total == 0 {
        return vec![(row, cycles)];
    }
    let mut split: Vec<(usize, u64)> = shares.iter().map(|&(r, c)| (r, (cycles as u128 * c as u128 / total as u128) as u64)).collect();
    let remainder = cycles - split.iter().map(|x| x.1).sum::<u64>();
    let largest = (0..shares.len()).max_by_key(|&i| (shares[i].1, std::cmp::Reverse(i))).unwrap_or(0);
    split[largest].1 += remainder;
    split
}

/// The operation producing the value an allocation label names: the label itself, or with
/// its last `.suffix`es taken off (`l0.q.partials`, `l0.ln1.statistics`).
fn operation_of(graph: &Graph, label: &str) -> Option<usize> {
    let mut name = label;
    loop {
        if let Some(v) = graph.find(name) {
            return match graph.value(v).producer {
                Producer::Operation(i) => Some(i),
                Producer::Tensor { .. } => None,
            };
        }
        name = name.rsplit_once('.')?.0;
    }
}

impl fmt::Display for KindProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let first = if self.per_operation { "operation (kind)" } else { "operation kind" };
        writeln!(f, "| {first} | operations | cycles | share | compute | exchange (sync included) | efficiency of peak |")?;
        writeln!(f, "|---|---|---|---|---|---|---|")?;
        for r in &self.rows {
            let cycles = r.compute_cycles + r.exchange_cycles;
            let share = 100.0 * cycles as f64 / self.total_cycles.max(1) as f64;
            let efficiency = if r.flops > 0 { format!("{:.1} %", 100.0 * r.flops as f64 / (cycles.max(1) as f64 * self.peak_flops_per_cycle as f64)) } else { "-".into() };
            writeln!(f, "| {} | {} | {cycles} | {share:.1} % | {} | {} | {efficiency} |", r.kind, r.operations, r.compute_cycles, r.exchange_cycles)?;
        }
        let attributed: u64 = self.rows.iter().map(|r| r.compute_cycles + r.exchange_cycles).sum();
        let flops: u64 = self.rows.iter().map(|r| r.flops).sum();
        let efficiency = 100.0 * flops as f64 / (self.total_cycles.max(1) as f64 * self.peak_flops_per_cycle as f64);
        write!(f, "| all | | {} | 100 % ({} attributed) | | | {efficiency:.1} % |", self.total_cycles, attributed)
    }
}

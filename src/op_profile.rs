//! Cycles per operation kind: a run's profile (`execution.ipuprofile`) split over the
//! operations of the package that produced it (`ipuq profile FILE --package PACKAGE`), or per
//! operation in program order (`--operations`).
//!
//! Each operation owns the program steps after the previous operation's checkpoint up to and
//! including its own (`Checkpoint::after_step`). Where the lowering put an operation's calls
//! into the compute set of the operation before it (an elementwise pass over a product's
//! output cells, no exchange between), those calls' cycles count with that earlier
//! operation: this split is by superstep, not by call. Efficiency is the matrix-product FLOPs
//! of the kind over the kind's cycles at the chip's peak (all tiles).

use std::fmt;

use ipuq_queries::ir::{split3, Graph, OpKind, Producer};
use ipuq_queries::package::{Package, Step};
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
    let graph = Graph::parse(&package.workload_toml, &package.workload_name).map_err(|e| e.to_string())?;
    let target = Target::from_toml(&package.target_toml, "package").map_err(|e| e.to_string())?;
    let mut checkpoints: Vec<(u32, u32)> = package.host.checkpoints.iter().map(|c| (c.after_step, c.operation)).collect();
    checkpoints.sort_unstable();
    // By kind in the order first met, or per operation in program order.
    let mut rows: Vec<KindRow> = Vec::new();
    let mut first = 0usize;
    let checkpointed: std::collections::BTreeSet<u32> = checkpoints.iter().map(|c| c.1).collect();
    for (after, operation) in checkpoints {
        let op = graph.operations.get(operation as usize).ok_or_else(|| format!("checkpoint of operation {operation}, which the workload lacks"))?;
        // An add folded into a product's epilogue: its checkpoint closes the product's steps
        // (the product has none of its own), so they count as the product's.
        let folded_product = match op.kind {
            OpKind::BiasAdd | OpKind::Add => op.inputs.iter().find_map(|&v| match graph.value(v).producer {
                Producer::Operation(i) if !checkpointed.contains(&(i as u32)) && matches!(graph.operations[i].kind, OpKind::MatMul { .. }) => Some(&graph.operations[i]),
                _ => None,
            }),
            _ => None,
        };
        let op = folded_product.unwrap_or(op);
        // A softmax whose normalisation the product reading it applies has no checkpoint (its
        // probabilities never exist on the device): its steps close with the product's.
        let deferred_softmax = matches!(op.kind, OpKind::MatMul { .. })
            && matches!(graph.value(op.inputs[0]).producer, Producer::Operation(i) if !checkpointed.contains(&(i as u32)) && matches!(graph.operations[i].kind, OpKind::Softmax));
        let kind = match &op.kind {
            OpKind::Softmax => "softmax (scale folded in)".to_string(),
            OpKind::MatMul { .. } if deferred_softmax => "softmax (normalisation deferred) + matmul".to_string(),
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
        for &(step, cycles) in &timeline.steps[first.min(last)..last] {
            match step {
                Step::Compute { .. } => row.compute_cycles += cycles,
                Step::Exchange { .. } => row.exchange_cycles += cycles,
            }
        }
        first = first.max(last);
    }
    let total_cycles = timeline.steps.iter().map(|s| s.1).sum();
    let peak = target.compute.peak_flops_per_cycle as u64 * target.chip.tiles as u64;
    if !per_operation {
        // Most cycles first; ties by kind.
        rows.sort_by(|a, b| (b.compute_cycles + b.exchange_cycles).cmp(&(a.compute_cycles + a.exchange_cycles)).then_with(|| a.kind.cmp(&b.kind)));
    }
    Ok(KindProfile { rows, per_operation, total_cycles, peak_flops_per_cycle: peak })
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

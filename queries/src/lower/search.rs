//! The whole-program search in `lower_mid`: orientation candidates (which rank-2 products
//! are swapped), each planned operation by operation and kept only if whole-program feasible;
//! the best K by estimated cycles are the finalists that `select_finalist` costs exactly.
//!
//! Whole-program feasibility: a program is kept only if every tile's buffers,
//! all operations together, can be placed in their regions (the same placement the pipeline
//! runs later, with the code reserve standing in for the code). When they cannot, each
//! operation is planned again with a budget that deducts what the other operations keep live
//! on a tile while it runs (host-written weights are live from the start), in total and in
//! interleaved memory, until the program fits or the budgets stop changing.

use std::collections::BTreeSet;

use rayon::prelude::*;

use tracing::{debug, info};

use super::build::{lower_with, Attempt, Reserve, CODE_RESERVE_BYTES};
use super::orient::{orient, swappable, Oriented};
use super::{LowerError, Lowered};
use crate::ir::Graph;
use crate::package::AllocationKind;
use crate::storage::place_storage;
use crate::target::Target;

/// Rounds of re-planning with updated budgets per weight arrangement.
const ROUNDS: usize = 3;

/// Finalists kept by default (`--plan-finalists`).
pub const DEFAULT_FINALISTS: usize = 4;

/// Orientation candidates: every subset when there are at most three swappable products,
/// else none swapped, all swapped, and each "all from product i on" suffix (chains of
/// products whose consumers follow their producer's orientation).
fn orientation_candidates(graph: &Graph) -> Vec<BTreeSet<usize>> {
    let ops = swappable(graph);
    // The user's orientation constraints: products that must, or must not, be swapped.
    let mut must: BTreeSet<usize> = BTreeSet::new();
    let mut must_not: BTreeSet<usize> = BTreeSet::new();
    for c in &graph.file.constraints {
        let Some(index) = graph.find(&c.operation).and_then(|v| match graph.value(v).producer {
            crate::ir::Producer::Operation(o) => Some(o),
            _ => None,
        }) else {
            continue;
        };
        match c.orientation.as_deref() {
            Some("swapped") => must.insert(index),
            Some("normal") => must_not.insert(index),
            _ => false,
        };
    }
    let mut out = candidate_sets(&ops);
    out.retain(|s| must.is_subset(s) && must_not.is_disjoint(s));
    if out.is_empty() {
        out.push(must);
    }
    out
}

fn candidate_sets(ops: &[usize]) -> Vec<BTreeSet<usize>> {
    let mut out: Vec<BTreeSet<usize>> = Vec::new();
    if ops.len() <= 3 {
        for mask in 0..(1u32 << ops.len()) {
            out.push(ops.iter().enumerate().filter(|(i, _)| mask >> i & 1 == 1).map(|(_, &o)| o).collect());
        }
    } else {
        out.push(BTreeSet::new());
        for start in 0..ops.len() {
            out.push(ops[start..].iter().copied().collect());
        }
    }
    out
}

/// The estimate the search ranks programs by: the sum of every operation's estimate.
pub fn estimated_cycles(lowered: &Lowered) -> u64 {
    lowered.plans.iter().map(|p| p.estimated_compute_cycles + p.estimated_exchange_cycles).sum()
}

/// Up to `keep` feasible programs, best estimate first (ties: fewer swapped products, then
/// candidate order). Fails with the first candidate's error when none lowers.
pub fn finalists(graph: &Graph, target: &Target, keep: usize) -> Result<Vec<Lowered>, LowerError> {
    let mut found: Vec<(bool, u64, usize, usize, Lowered)> = Vec::new();
    let mut first_error: Option<LowerError> = None;
    // Candidates lower in parallel; results are taken in candidate order.
    let candidates: Vec<(BTreeSet<usize>, Result<Oriented, String>)> = orientation_candidates(graph).into_iter().map(|s| {
        let o = orient(graph, &s);
        (s, o)
    }).collect();
    let lowered: Vec<Option<Result<(Lowered, bool), LowerError>>> = candidates.par_iter().map(|(_, o)| o.as_ref().ok().map(|o| lower_feasible(o, target))).collect();
    for (index, ((swapped, oriented), result)) in candidates.iter().zip(lowered).enumerate() {
        let Some(result) = result else {
            if let Err(message) = oriented {
                debug!(%message, "orientation candidate rejected");
            }
            continue;
        };
        match result {
            Ok((l, fits)) => found.push((!fits, estimated_cycles(&l), swapped.len(), index, l)),
            Err(e) => {
                debug!(error = %e, swapped = swapped.len(), "orientation candidate does not lower");
                // Report a constraint's reason first, else the plainest candidate's error.
                let constraint = matches!(e, LowerError::Constraint { .. });
                if constraint && !matches!(first_error, Some(LowerError::Constraint { .. })) {
                    first_error = Some(e);
                } else if first_error.is_none() {
                    first_error = Some(e);
                }
            }
        }
    }
    if found.is_empty() {
        return Err(first_error.unwrap_or_else(|| LowerError::Unsupported { operation: graph.name.clone(), message: "no orientation of the matrix products lowers".into() }));
    }
    // Programs that fit first; one that does not is kept only when none fits.
    found.sort_by_key(|f| (f.0, f.1, f.2, f.3));
    if !found[0].0 {
        found.retain(|f| !f.0);
    }
    found.truncate(keep.max(1));
    let finalists: Vec<Lowered> = found.into_iter().map(|f| f.4).collect();
    let m = &target.memory;
    for (i, l) in finalists.iter().enumerate() {
        let code = vec![CODE_RESERVE_BYTES as u32; l.tiles as usize];
        let (standard, interleaved) = match place_storage(target, l, &code) {
            Ok(p) => (
                p.peak_standard.iter().map(|&a| (a - m.base) as u64).max().unwrap_or(0),
                p.peak_interleaved.iter().map(|&a| (a - m.interleaved_start) as u64).max().unwrap_or(0),
            ),
            Err(_) => (0, 0),
        };
        let active: BTreeSet<u32> = l.plans.iter().map(|p| p.tiles).collect();
        info!(
            finalist = i,
            values = graph.values.len(),
            operations = graph.operations.len(),
            estimated_cycles = estimated_cycles(l),
            estimated_exchange_cycles = l.plans.iter().map(|p| p.estimated_exchange_cycles).sum::<u64>(),
            peak_standard_bytes = standard,
            peak_interleaved_bytes = interleaved,
            peak_total_bytes = standard + interleaved,
            active_tile_counts = ?active,
            plans = %describe(l),
            "retained operator-plan finalist"
        );
    }
    Ok(finalists)
}

/// Lower an oriented graph to a program whose buffers fit, whole-program. A program that fits
/// but whose placement pushes weights the planner costed as interleaved into standard memory
/// is planned once more with the other operations' resident bytes, so the estimate sees the
/// region pressure (and may pick plans that avoid it).
/// The flag says whether the program fits (false: nothing fit; the last attempt is returned so
/// that placement can name the buffer that overflows).
pub fn lower_feasible(oriented: &Oriented, target: &Target) -> Result<(Lowered, bool), LowerError> {
    let operations = oriented.graph.operations.len();
    let mut last: Option<Lowered> = None;
    let mut first_error: Option<LowerError> = None;
    for home_weights in [false, true] {
        let mut reserves = vec![Reserve::default(); operations];
        let mut fitting: Option<Lowered> = None;
        for round in 0..ROUNDS {
            let attempt = match lower_with(oriented, target, home_weights, &reserves) {
                Ok(a) => a,
                Err(e) => {
                    first_error.get_or_insert(e);
                    break;
                }
            };
            let code = vec![CODE_RESERVE_BYTES as u32; attempt.lowered.tiles as usize];
            let placed = place_storage(target, &attempt.lowered, &code);
            let displaced = placed.as_ref().is_ok_and(|p| weights_displaced(&attempt, &p.addresses, target));
            if placed.is_ok() && (!displaced || round + 1 == ROUNDS || fitting.is_some()) {
                return Ok((attempt.lowered, true));
            }
            let merged: Vec<Reserve> = reserves
                .iter()
                .zip(reserves_of(&attempt, operations))
                .map(|(a, b)| Reserve { total: a.total.max(b.total), interleaved: a.interleaved.max(b.interleaved) })
                .collect();
            if placed.is_ok() {
                debug!("weights costed in interleaved memory were placed in standard memory; planning again with resident bytes");
                fitting = Some(attempt.lowered);
            } else {
                debug!(home_weights, "the program does not fit; planning again with other operations' resident bytes");
                last = Some(attempt.lowered);
            }
            if merged == reserves {
                break;
            }
            reserves = merged;
        }
        if let Some(l) = fitting {
            return Ok((l, true));
        }
        if !home_weights {
            debug!("replicated weights do not fit in tile memory; keeping each weight block once on a home tile");
        }
    }
    // Nothing fits: hand on the last program so placement names the buffer that overflows.
    last.map(|l| (l, false)).ok_or_else(|| first_error.expect("an attempt either lowers or fails"))
}

/// Whether placement put weights of a product planned with interleaved weights (buffers that
/// prefer interleaved memory) into standard memory.
fn weights_displaced(attempt: &Attempt, addresses: &[u32], target: &Target) -> bool {
    attempt.lowered.buffers.iter().enumerate().any(|(i, b)| {
        b.prefer_interleaved && b.kind == AllocationKind::Data && addresses[i] < target.memory.interleaved_start && attempt.interleaved_weights.contains(&attempt.owners[i])
    })
}

/// Whether every tile's buffers can be placed, by region, beside the code reserve.
pub fn fits(lowered: &Lowered, target: &Target) -> bool {
    let code = vec![CODE_RESERVE_BYTES as u32; lowered.tiles as usize];
    place_storage(target, lowered, &code).is_ok()
}

/// Per operation index: the most bytes on any tile that other operations keep live during
/// one of its steps, in total and in the buffers that claim interleaved memory first
/// (partials, and weights that prefer it).
pub fn reserves_of(attempt: &Attempt, operations: usize) -> Vec<Reserve> {
    let l = &attempt.lowered;
    let mut per_tile: Vec<Vec<usize>> = vec![Vec::new(); l.tiles as usize];
    for (i, b) in l.buffers.iter().enumerate() {
        per_tile[b.tile as usize].push(i);
    }
    let mut out = vec![Reserve::default(); operations];
    for (&op, &(s0, s1)) in &attempt.spans {
        let mut r = Reserve::default();
        for ids in &per_tile {
            for step in s0..=s1 {
                let (mut total, mut interleaved) = (0u64, 0u64);
                for &i in ids {
                    let b = &l.buffers[i];
                    if attempt.owners[i] != op && b.first_step <= step && step <= b.last_step {
                        total += b.bytes as u64;
                        if b.kind == AllocationKind::Partials || b.prefer_interleaved {
                            interleaved += b.bytes as u64;
                        }
                    }
                }
                r.total = r.total.max(total);
                r.interleaved = r.interleaved.max(interleaved);
            }
        }
        out[op as usize] = r;
    }
    out
}

/// One line per program: each operation's value, orientation and partitions.
pub fn describe(l: &Lowered) -> String {
    l.plans
        .iter()
        .map(|p| {
            let [b, r, c, i] = p.partitions;
            if p.kind == "matmul" {
                format!("{}:{}[{b},{r},{c},{i}]{}", p.value, p.orientation, if p.weight_memory == "standard" { "/w-standard" } else { "" })
            } else {
                format!("{}:{}x{b}", p.value, p.kind)
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

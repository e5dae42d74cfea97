//! The exchange scheduler: one phase's transfers in, a validated cycle-exact schedule out.
//!
//! Pipeline of a phase, one line each:
//! 1. `problem` checks the request and normalises it (ports, delays, pairing eligibility);
//! 2. `bound` computes the endpoint lower bound (and the multicast clique bound);
//! 3. `coalesce` merges transfers with the same source, receive ports and pairing
//!    eligibility into one job: steps 4 to 6 work on jobs, and their schedule is expanded
//!    back into pieces of the request's transfers before step 7;
//! 4. constructions run side by side: `matching` (optimal blocks for bipartite phases, then
//!    timed with delays) and `greedy` (preemptive, most-loaded ports first), ordinary and paired;
//! 5. `compact` justifies each one left, right and left again, cutting pieces into shared idle
//!    time (this closes most of the gap the delays open);
//! 6. `greedy::critical_neighborhood` rebuilds the best greedy with its late transfers made
//!    more urgent, within a fixed work budget;
//! 7. `lower` patches addresses in and writes the sorted per-tile tables;
//! 8. `validate` checks the tables against the request, independently of everything above.
//!
//! The best schedule is chosen by horizon, then piece count (of jobs), then candidate order.
//! The log lines carry the seed's field names; `row_words` is defined in `lower.rs`.
//!
//! Architecture Invariant: the output depends only on the target and the request, never on
//! thread count, clocks or hash order: budgets count work, not time, and ties break by index.
//! This module does no I/O; caching the address-free `Schedule` is the caller's business,
//! keyed by [`pattern_digest`].

mod bound;
mod coalesce;
mod compact;
mod greedy;
mod lower;
mod matching;
mod moved;
mod problem;
mod serialize;
pub mod synthetic;
mod timing;
mod types;
mod validate;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod validate_tests;

use rayon::prelude::*;
use tracing::{debug, info};

use crate::package::ExchangePhase;
use crate::target::Target;

pub use lower::{check_relocated, log_validated, lower_to_tables, relative_tables, relocate, reuse, row_words, table_row_words, RelativeTables};
pub use problem::{alignment_class_of, hash_half_duplex, pattern_digest, PATTERN_DOMAIN};
pub use types::{Destination, Destinations, ExchangeError, PhaseRequest, Piece, Schedule, ScheduleKind, Transfer, ValidationError};
pub use moved::{moved_alike, TileBuffers};
pub use validate::validate;

use greedy::Pairing;
use problem::Problem;

/// Chunk sizes of the greedy constructions (words): small ones preempt, large ones keep rows
/// short. Phases above `LARGE_PHASE` jobs (after coalescing, see `coalesce.rs`: the work
/// scales with jobs) try only the middle one, without "all paired", and justify once with a
/// bounded look-back, to stay within half a second on two cores. (A greedy's justification
/// from cycle 0 costs 1.2-1.9 s per candidate on the 37,908-job re-gather of the SigLIP MLP,
/// 0.2 s bounded.) The matching's pieces are few and long (sticky), so it is always
/// justified in full: 0.15 s there, where it wins by 2 %.
const CHUNKS: [u32; 2] = [96, 256];
const LARGE_CHUNK: u32 = 192;
const LARGE_PHASE: usize = 30_000;
const EFFORT: compact::Effort = compact::Effort { passes: 2, lookback: None };
const LARGE_EFFORT: compact::Effort = compact::Effort { passes: 1, lookback: Some(2048) };
/// matching-waves runs on phases up to this many jobs, or on any phase whose delays
/// spread by at most `UNIFORM_DELAY_SPREAD` cycles (where its block order is exact). On large
/// phases with the chip's full delay spread its timing loses to the greedy and costs most.
const MATCHING_PHASE: usize = 30_000;
/// Larger pure unicast phases (a re-gather by rows, say) up to this size try the matching too
/// when the greedy ends more than `MATCHING_FALLBACK_PERCENT` above the bound: there the
/// matching reaches the bound's neighbourhood where the greedy can fall 10 % short.
const MATCHING_UNICAST_PHASE: usize = 150_000;
const MATCHING_FALLBACK_PERCENT: u64 = 2;
const UNIFORM_DELAY_SPREAD: u32 = 16;

/// The endpoint lower bound of a phase (see `bound.rs` for exactly what is counted); 0 for a
/// malformed request, whose problem `schedule_phase` names.
pub fn endpoint_lower_bound(target: &Target, phase: &PhaseRequest) -> u32 {
    match problem::prepare(target, phase) {
        Ok(problem) => bound::endpoint_bound(&problem),
        Err(_) => 0,
    }
}

/// One construction to try.
#[derive(Clone, Copy, Debug)]
enum Candidate {
    Matching,
    Greedy { pairing: Pairing, chunk: u32 },
}

struct Built {
    /// The greedy's pairing choice and chunk, for the local search to rebuild from.
    greedy: Option<(Vec<bool>, u32)>,
    kind: ScheduleKind,
    paired: bool,
    pieces: Vec<Piece>,
    horizon: u32,
}

fn build(problem: &Problem, candidate: Candidate, effort: compact::Effort) -> Option<Built> {
    let built = construct(problem, candidate, effort);
    if let Some(b) = &built {
        debug!(candidate = ?candidate, horizon = b.horizon, pieces = b.pieces.len(), "built exchange schedule candidate");
    }
    built
}

fn construct(problem: &Problem, candidate: Candidate, effort: compact::Effort) -> Option<Built> {
    let (kind, pieces, greedy) = match candidate {
        Candidate::Matching => (ScheduleKind::MatchingWaves, matching::matching_waves(problem)?, None),
        Candidate::Greedy { pairing, chunk } => {
            let choice = greedy::choose_pairing(problem, pairing);
            if pairing != Pairing::Ordinary && !choice.iter().any(|&p| p) {
                return None;
            }
            let pieces = greedy::full_duplex(problem, &choice, chunk, &[]);
            (ScheduleKind::FullDuplex, pieces, Some((choice, chunk)))
        }
    };
    let pieces = compact::justify(problem, pieces, effort);
    let horizon = timing::horizon(problem, &pieces);
    let paired = pieces.iter().any(|p| p.paired);
    Some(Built { greedy, kind, paired, pieces, horizon })
}

/// Best of several: lowest horizon, then fewest pieces, then the earlier candidate.
fn best(built: Vec<Option<Built>>) -> Option<Built> {
    built.into_iter().flatten().enumerate().min_by_key(|(i, b)| (b.horizon, b.pieces.len(), *i)).map(|(_, b)| b)
}

/// Schedule one phase: constructions, comparison of ordinary and paired, local search.
/// Half-duplex tiles (`PhaseRequest::half_duplex`) get the best schedule with the pieces they
/// would receive while sending moved after it (`serialize.rs`).
pub fn schedule_phase(target: &Target, phase: &PhaseRequest) -> Result<Schedule, ExchangeError> {
    let schedule = schedule_with(target, phase, true)?;
    if phase.half_duplex.is_empty() {
        return Ok(schedule);
    }
    let before = schedule.horizon;
    let (schedule, moved) = serialize::half_duplex(target, phase, schedule);
    info!(phase = phase.index, half_duplex_tiles = phase.half_duplex.len(), moved_pieces = moved, horizon_before = before, horizon = schedule.horizon, "kept sends and receives of half-duplex tiles apart in time");
    Ok(schedule)
}

/// `schedule_phase`, with `coalescing` off for the tests that compare against it.
fn schedule_with(target: &Target, phase: &PhaseRequest, coalescing: bool) -> Result<Schedule, ExchangeError> {
    let original = problem::prepare(target, phase)?;
    info!(
        phase = phase.index,
        transfers = phase.transfers.len(),
        maximum_identical_destinations = original.maximum_identical_destinations(),
        "prepared large physical exchange phase"
    );
    let bounds = bound::bounds(&original);
    let coalesced = if coalescing { coalesce::coalesce(&original) } else { None };
    let problem = coalesced.as_ref().unwrap_or(&original);
    debug!(phase = phase.index, transfers = phase.transfers.len(), jobs = problem.jobs.len(), "coalesced exchange transfers");
    if let Some((name, value)) = &bounds.stronger {
        info!(phase = phase.index, bound = name.as_str(), value = *value, endpoint_lower_bound = bounds.endpoint, "stronger exchange bound applies");
    }
    let mut candidates = Vec::new();
    let matching_first = problem.jobs.len() <= MATCHING_PHASE || problem.delay_spread() <= UNIFORM_DELAY_SPREAD;
    if matching_first {
        candidates.push(Candidate::Matching);
    }
    let large = problem.jobs.len() > LARGE_PHASE;
    let chunks: &[u32] = if large { &[LARGE_CHUNK] } else { &CHUNKS };
    let effort = if large { LARGE_EFFORT } else { EFFORT };
    // Counted on the request: the log reports transfers.
    let eligible = original.eligible_count();
    let pairings: &[Pairing] = match (eligible > 0, large) {
        (false, _) => &[Pairing::Ordinary],
        (true, true) => &[Pairing::Ordinary, Pairing::Balanced],
        (true, false) => &[Pairing::Ordinary, Pairing::Balanced, Pairing::All],
    };
    for &pairing in pairings {
        candidates.extend(chunks.iter().map(|&chunk| Candidate::Greedy { pairing, chunk }));
    }
    let effort_of = |c: Candidate| if matches!(c, Candidate::Matching) { EFFORT } else { effort };
    let mut built: Vec<Option<Built>> = candidates.par_iter().map(|&c| build(problem, c, effort_of(c))).collect();
    let unicast = problem.maximum_identical_destinations() <= 1;
    if !matching_first && unicast && problem.jobs.len() <= MATCHING_UNICAST_PHASE {
        let greedy = built.iter().flatten().map(|b| b.horizon as u64).min();
        if greedy.is_none_or(|h| h * 100 > bounds.endpoint as u64 * (100 + MATCHING_FALLBACK_PERCENT)) {
            built.push(build(problem, Candidate::Matching, EFFORT));
        }
    }
    let (ordinary, paired): (Vec<_>, Vec<_>) = built.into_iter().partition(|b| b.as_ref().is_none_or(|b| !b.paired));
    let ordinary = best(ordinary);
    let paired = best(paired);
    if eligible > 0 {
        let horizon = |b: &Option<Built>| b.as_ref().map_or(0, |b| b.horizon);
        info!(
            phase = phase.index,
            candidates = eligible,
            ordinary_horizon = horizon(&ordinary),
            paired_horizon = horizon(&paired),
            use_paired = horizon(&paired) != 0 && horizon(&paired) < horizon(&ordinary),
            "compared ordinary and paired exchange schedules"
        );
    }
    let chosen = best(vec![ordinary, paired]);
    let Some(chosen) = chosen else {
        // Only an empty phase has no candidate at all.
        return Ok(finish(phase, &bounds, Built { greedy: None, kind: ScheduleKind::Greedy, paired: false, pieces: greedy::in_request_order(problem), horizon: 0 }, 0, 0));
    };
    let initial = chosen.horizon;
    let floor = bounds.stronger.as_ref().map_or(bounds.endpoint, |s| s.1.max(bounds.endpoint));
    let (pieces, horizon, improvements) = match &chosen.greedy {
        Some((choice, chunk)) => {
            let better = greedy::critical_neighborhood(problem, choice, *chunk, chosen.pieces, floor, effort);
            (better.pieces, better.horizon, better.improvements)
        }
        None => (chosen.pieces, chosen.horizon, 0),
    };
    let pieces = match &coalesced {
        Some(c) => coalesce::expand(c, &pieces),
        None => pieces,
    };
    let kind = if improvements > 0 { ScheduleKind::CriticalNeighborhood } else { chosen.kind };
    let paired_used = pieces.iter().any(|p| p.paired);
    Ok(finish(phase, &bounds, Built { greedy: None, kind, paired: paired_used, pieces, horizon }, initial, improvements))
}

fn finish(phase: &PhaseRequest, bounds: &bound::Bounds, built: Built, initial: u32, improvements: u32) -> Schedule {
    let schedule = Schedule {
        pieces: std::sync::Arc::new(built.pieces),
        horizon: built.horizon,
        endpoint_lower_bound: bounds.endpoint,
        stronger_bound: bounds.stronger.clone(),
        kind: built.kind,
        initial_horizon: initial.max(built.horizon),
        neighborhood_improvements: improvements,
        paired: built.paired,
    };
    log_optimized(phase.index, schedule.initial_horizon, schedule.horizon, schedule.endpoint_lower_bound, schedule.kind, schedule.neighborhood_improvements);
    schedule
}

/// The seed's `optimized physical exchange schedule` line, for fresh and reused schedules alike.
pub(crate) fn log_optimized(phase: u32, initial: u32, selected: u32, bound: u32, kind: ScheduleKind, improvements: u32) {
    info!(
        phase,
        initial_horizon = initial,
        selected_horizon = selected,
        endpoint_lower_bound = bound,
        lower_bound_gap = selected.saturating_sub(bound),
        selected_kind = kind.name(),
        neighborhood_improvements = improvements,
        "optimized physical exchange schedule"
    );
}

/// Schedule, lower and validate one phase: what the package builder calls.
pub fn compile_phase(target: &Target, phase: &PhaseRequest) -> Result<(Schedule, ExchangePhase), ExchangeError> {
    let schedule = schedule_phase(target, phase)?;
    let tables = lower_to_tables(target, phase, &schedule);
    validate(target, phase, &tables).map_err(|source| ExchangeError::Invalid { phase: phase.index, source })?;
    Ok((schedule, tables))
}

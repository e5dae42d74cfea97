//! `select_finalist`: every finalist of the search is scheduled, sized, placed and costed
//! exactly as the later stages will (the same exchange scheduler, placement and cost formulas
//! over placed operands), and the one with the fewest cycles wins (ties: the better estimate,
//! which is the earlier finalist). A finalist whose estimate is more than
//! `EXACT_COST_MARGIN_PERCENT` above the best estimate is not costed (the estimates track the
//! exact cost within a few percent; scheduling a clearly worse program's exchanges would cost
//! as much compile time as the program it beats), and `ipuq plans` says so. Exchange phases of all finalists are scheduled in parallel
//! and collected in a fixed order, so the choice does not depend on the thread count.

use rayon::prelude::*;
use tracing::{debug, info};

use super::search::estimated_cycles;
use super::{LStep, Lowered};
use crate::cost;
use crate::emit::vertex;
use crate::exchange::{self, Schedule};
use crate::pipeline::{provisional_bases, requests};
use crate::storage::place_storage;
use crate::target::Target;

/// A finalist costed on its placed program.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Costed {
    pub finalist: u32,
    pub estimated_cycles: u64,
    /// Cycles of the placed program, as the package summary and the simulator count them.
    pub scheduled_cycles: u64,
    pub scheduled_exchange_cycles: u64,
    pub peak_standard_bytes: u64,
    pub peak_interleaved_bytes: u64,
}

/// The chosen finalist and what every finalist cost (for `ipuq plans`).
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Selection {
    pub chosen: u32,
    pub lowered: Lowered,
    pub costed: Vec<Costed>,
    /// Per finalist: why it could not be placed, if it could not.
    pub failures: Vec<(u32, String)>,
}

/// Finalists whose estimate exceeds the best estimate by more than this are not costed exactly.
pub const EXACT_COST_MARGIN_PERCENT: u64 = 5;

/// Schedule, size, place and cost each finalist; keep the cheapest. `schedule` schedules a
/// list of exchange phases (every finalist's, concatenated) and returns them in order.
///
/// `prepare` turns each finalist into the program that will run (`lower/host.rs` moves host
/// replicas to exchange phases), so the exact cost counts every phase the simulator will.
pub fn select_finalist(target: &Target, finalists: &[Lowered], prepare: impl Fn(Lowered) -> Lowered + Sync, schedule: impl FnOnce(&[exchange::PhaseRequest]) -> Result<Vec<Schedule>, String>) -> Result<Selection, String> {
    let prepared: Vec<Lowered> = finalists.par_iter().map(|l| prepare(l.clone())).collect();
    let finalists = &prepared[..];
    let estimates: Vec<u64> = finalists.iter().map(estimated_cycles).collect();
    let best_estimate = estimates.iter().copied().min().unwrap_or(0);
    let in_margin = |f: usize| estimates[f] * 100 <= best_estimate * (100 + EXACT_COST_MARGIN_PERCENT);
    let mut failures: Vec<(u32, String)> = Vec::new();
    for (f, &e) in estimates.iter().enumerate().filter(|(f, _)| !in_margin(*f)) {
        failures.push((f as u32, format!("not costed: estimate {e} is more than {EXACT_COST_MARGIN_PERCENT} % above the best, {best_estimate}")));
    }
    // Every (finalist, phase) pair is an independent scheduling job.
    let jobs: Vec<(usize, exchange::PhaseRequest)> = finalists
        .iter()
        .enumerate()
        .filter(|(f, _)| in_margin(*f))
        .flat_map(|(f, l)| {
            let provisional = provisional_bases(l);
            requests(l, |buffer, offset| provisional[buffer as usize] + offset).into_iter().map(move |r| (f, r))
        })
        .collect();
    let requests: Vec<exchange::PhaseRequest> = jobs.iter().map(|j| j.1.clone()).collect();
    let scheduled = schedule(&requests)?;
    let mut per_finalist: Vec<Vec<Schedule>> = vec![Vec::new(); finalists.len()];
    for ((f, _), s) in jobs.iter().zip(scheduled) {
        per_finalist[*f].push(s);
    }
    let costed: Vec<Result<Costed, String>> = finalists
        .par_iter()
        .enumerate()
        .map(|(f, l)| {
            if failures.iter().any(|x| x.0 == f as u32) {
                return Err("skipped".to_string());
            }
            if per_finalist[f].len() != l.phases.len() {
                return Err("exchange phases were not scheduled".to_string());
            }
            cost_placed(target, f as u32, l, &per_finalist[f])
        })
        .collect();
    let mut ok: Vec<Costed> = Vec::new();
    for (f, c) in costed.into_iter().enumerate() {
        match c {
            Ok(c) => ok.push(c),
            Err(e) if !failures.iter().any(|x| x.0 == f as u32) => failures.push((f as u32, e)),
            Err(_) => {}
        }
    }
    failures.sort();
    for (f, why) in &failures {
        debug!(finalist = f, reason = %why, "finalist cannot be placed");
    }
    let best = ok.iter().min_by_key(|c| (c.scheduled_cycles, c.estimated_cycles, c.finalist)).cloned();
    let Some(best) = best else {
        return Err(failures.first().map(|f| f.1.clone()).unwrap_or_else(|| "no finalist".into()));
    };
    for p in finalists[best.finalist as usize].plans.iter().filter(|p| !p.constraint.is_empty()) {
        info!(source_operation = %p.value, matching_plans = p.matching_plans, constraint = %p.constraint, "applied GEMM plan constraint");
    }
    info!(finalist = best.finalist, estimated_cycles = best.estimated_cycles, scheduled_cycles = best.scheduled_cycles, "selected operator-plan finalist");
    let chosen = best.finalist as usize;
    Ok(Selection { chosen: best.finalist, lowered: finalists[chosen].clone(), costed: ok, failures })
}

/// Cycles of a finalist's placed program, computed as the package summary computes them.
fn cost_placed(target: &Target, finalist: u32, l: &Lowered, schedules: &[Schedule]) -> Result<Costed, String> {
    let support = crate::sizing::support_with_tables(target, l, schedules, crate::sizing::EXCHANGE_TABLE_BUDGET_BYTES)?;
    let code: Vec<u32> = support.iter().map(|s| s.total()).collect();
    let placement = place_storage(target, l, &code).map_err(|e| e.to_string())?;
    let addresses = &placement.addresses;
    let placed = requests(l, |buffer, offset| addresses[buffer as usize] + offset);
    let mut horizons = Vec::with_capacity(placed.len());
    for (r, s) in placed.iter().zip(schedules) {
        horizons.push(exchange::reuse(target, r, s).map_err(|e| e.to_string())?.horizon);
    }
    let mut cycles = 0u64;
    let mut exchange_cycles = 0u64;
    for step in &l.steps {
        match step {
            LStep::Compute(i) => {
                let mut per_tile = vec![0u64; l.tiles as usize];
                for (tile, call) in &l.compute_sets[*i as usize] {
                    per_tile[*tile as usize] += cost::vertex(target, &vertex(&placement, call));
                }
                cycles += per_tile.into_iter().max().unwrap_or(0);
            }
            LStep::Exchange(p) => {
                let c = cost::exchange_phase(target, horizons[*p as usize]);
                cycles += c;
                exchange_cycles += c;
            }
        }
    }
    let m = &target.memory;
    Ok(Costed {
        finalist,
        estimated_cycles: estimated_cycles(l),
        scheduled_cycles: cycles,
        scheduled_exchange_cycles: exchange_cycles,
        peak_standard_bytes: placement.peak_standard.iter().map(|&p| (p - m.base) as u64).max().unwrap_or(0),
        peak_interleaved_bytes: placement.peak_interleaved.iter().map(|&p| (p - m.interleaved_start) as u64).max().unwrap_or(0),
    })
}

//! `lower_mid`'s exchange-table screen: a finalist whose exchange tables would exceed the
//! per-tile table budget is steered and lowered again here, before `select_finalist`
//! schedules, places and costs the finalists.
//!
//! A tile's table bytes are the sum over every exchange phase it takes part in (a binding per
//! phase, plus each distinct segment once), so a program of repeated layers can outgrow the
//! budget on a tile although each operation's plan alone is small: the bytes are a
//! whole-program quantity, and they depend on how the scheduler cuts and times each transfer
//! (runs form only where entries are regular in cycle and address). The screen therefore
//! computes them as `size_tile_code` will, not from a model: each phase of the program (with
//! the host pass applied as `select_finalist` prepares it, every repeated input replicated,
//! the most phases that pass can add) is scheduled by the exchange scheduler (through the
//! per-phase memo, so `select_finalist` finds these schedules done), and its tables are
//! encoded over sizing addresses in the table format (`sizing.rs`, `tables.rs`).
//!
//! Under the compiler's budget policy, a finalist over the budget that places with its tables
//! (every tile's code at its size beside the program's data, `sizing::places_with_tables`) is
//! kept as it is, and one that does not is handed on. Under a user's hard budget, the
//! operation whose phase holds most of the bytes on the overflowing tile is steered away from
//! its plan (`select::steer_away`: half the pieces along one free axis) and only that
//! finalist's program is lowered again, in its own orientation (`search::lower_feasible`,
//! which makes it fit tile memory), instead of planning the whole program again; repeated
//! until it fits or nothing is left to steer.
//! Once a finalist is kept, a later one over the budget is dropped rather than steered (each
//! steer lowers a whole program again; select_finalist would drop it unsteered). When no
//! finalist can be brought within the budget, the best one is handed on as planned
//! (`select_finalist` then reports the overflow, and may still re-plan the whole program).
//!
//! The table bytes of each finalist kept are handed to `select_finalist` (`remember`), which
//! sizes the same program over the same schedules and so need not encode its tables again.

use tracing::{debug, info};

use super::orient::orient;
use super::search::{estimated_cycles, lower_capped_alone, lower_feasible_alone, replication_cap_of};
use super::select::{steer_away, EXACT_COST_MARGIN_PERCENT};
use super::Lowered;
use crate::exchange::Schedule;
use crate::hash::Digest;
use crate::ir::Graph;
use crate::package::HostRole;
use crate::pipeline::{provisional_bases, LazyRequests};
use crate::exchange_placement::RelativeMemo;
use crate::sizing::{table_bytes_memoized, TableOverflow};
use crate::target::Target;

/// Steered lowerings the screen may make for one finalist (each halves one axis of one
/// product's plan, so this bounds the work, not the result).
pub const STEERS: usize = 8;

/// Schedules for a list of exchange phases, in order, each with its digest (the pipeline's
/// per-phase memo).
/// The phases of every program are taken in order (`pipeline::flat_phases`), their requests
/// made only for phases the memo does not hold.
pub type ScheduleFn<'a> = dyn FnMut(&[LazyRequests]) -> Result<Vec<(Schedule, Digest)>, String> + 'a;

/// Told of each finalist kept: the program as select_finalist prepares it (handed over), its
/// schedules' digests and every tile's exchange-table bytes.
pub type RememberFn<'a> = dyn FnMut(Lowered, &[Digest], &[u32]) + 'a;

/// A finalist's tables, sized: the prepared program, its schedule digests, and each tile's
/// table bytes or the first tile over the budget.
pub struct Sized {
    pub prepared: Lowered,
    pub digests: Vec<Digest>,
    pub tables: Result<Vec<u32>, TableOverflow>,
}

/// `lowered`'s exchange tables as `select_finalist` will size them: the program prepared by
/// the host pass with every repeated input replicated (the most phases the pass can add, so
/// never fewer table bytes than the link rate's choice gives), each phase scheduled over the
/// provisional addresses select_finalist uses (the same patterns, so the same memo entries),
/// the tables encoded over sizing addresses.
/// The relative tables of its phases' patterns are taken from and left in `relative`
/// (`exchange_placement::RelativeMemo`), for select_finalist's relocation of the same program.
pub fn size_tables(target: &Target, lowered: &Lowered, budget: u32, schedule: &mut ScheduleFn, relative: Option<&RelativeMemo>) -> Result<Sized, String> {
    let start = std::time::Instant::now();
    let prepared = super::host::replicate_every_input(sizing_view(lowered), target);
    let bases = provisional_bases(&prepared);
    let phases = LazyRequests::new(&prepared, &bases);
    let prepared_ms = start.elapsed().as_millis() as u64;
    let (schedules, digests): (Vec<Schedule>, Vec<Digest>) = schedule(std::slice::from_ref(&phases))?.into_iter().unzip();
    // The requests made go before the tables are sized (and end the borrow of `prepared`).
    drop(phases);
    let scheduled_ms = start.elapsed().as_millis() as u64;
    let tables = table_bytes_memoized(target, &prepared, &schedules, Some(&digests), budget, relative)?;
    debug!(prepared_ms, scheduled_ms, sized_ms = start.elapsed().as_millis() as u64, "exchange tables sized");
    Ok(Sized { prepared, digests, tables })
}

/// What the host pass and the table sizing read of a program (tiles, buffers, steps, phases
/// and their owners, host tensors), without its compute sets, checkpoints and plans, which
/// neither reads: a far smaller copy to prepare.
fn sizing_view(l: &Lowered) -> Lowered {
    Lowered {
        tiles: l.tiles,
        labels: Vec::new(),
        buffers: l.buffers.clone(),
        steps: l.steps.clone(),
        compute_sets: Vec::new(),
        phases: l.phases.clone(),
        phase_plans: l.phase_plans.clone(),
        initialize: l.initialize.clone(),
        inputs: l.inputs.clone(),
        outputs: Vec::new(),
        checkpoints: Vec::new(),
        plans: Vec::new(),
        gemm_flops: l.gemm_flops,
        logical_shards: l.logical_shards,
        half_duplex: l.half_duplex.clone(),
    }
}

/// The finalists with the best one over the table budget steered within it, and later ones
/// over it dropped (module docs), best estimate first (ties: the search's order). `graph` is
/// the graph the finalists were planned from (the user's constraints are kept when steering).
/// `relative`: see `size_tables`.
pub fn screen_tables(graph: &Graph, target: &Target, finalists: Vec<Lowered>, (budget, hard): (u32, bool), schedule: &mut ScheduleFn, remember: &mut RememberFn, relative: Option<&RelativeMemo>) -> Result<Vec<Lowered>, String> {
    let mut kept: Vec<Lowered> = Vec::with_capacity(finalists.len());
    let mut first_failure: Option<Lowered> = None;
    let mut steered_any = false;
    // select_finalist does not cost a finalist far above the best estimate (more than its
    // margin): such a finalist is handed on unsized, unless steering raised the best estimate
    // so far that it is in the margin (then it is sized after the others).
    let in_margin = |l: &Lowered, best: u64| estimated_cycles(l) * 100 <= best * (100 + EXACT_COST_MARGIN_PERCENT);
    let best_planned = finalists.first().map(estimated_cycles).unwrap_or(0);
    let mut far: Vec<(usize, Lowered)> = Vec::new();
    for (index, finalist) in finalists.into_iter().enumerate() {
        if !in_margin(&finalist, best_planned) {
            far.push((index, finalist));
            continue;
        }
        let steers = if kept.is_empty() { STEERS } else { 0 };
        match steer_within(graph, target, index, finalist, (budget, hard), steers, schedule, remember, relative)? {
            // A steered finalist may come out as one already kept.
            Ok((l, steered)) => {
                if !steered || !kept.contains(&l) {
                    kept.push(l);
                }
                steered_any |= steered;
            }
            Err(l) => {
                first_failure.get_or_insert(l);
            }
        }
    }
    // The far finalists in estimate order: each is sized when in the margin of the best
    // estimate select_finalist would get (the kept finalists' and its own).
    for (index, finalist) in far {
        let best = kept.iter().map(estimated_cycles).chain([estimated_cycles(&finalist)]).min().unwrap_or(0);
        if !in_margin(&finalist, best) {
            kept.push(finalist);
            continue;
        }
        let steers = if kept.is_empty() { STEERS } else { 0 };
        match steer_within(graph, target, index, finalist, (budget, hard), steers, schedule, remember, relative)? {
            Ok((l, steered)) => {
                kept.push(l);
                steered_any |= steered;
            }
            Err(l) => {
                first_failure.get_or_insert(l);
            }
        }
    }
    if kept.is_empty() {
        // Nothing fits the budget: hand on the best finalist, whose overflow select_finalist
        // names (and may still plan the program again around).
        kept.extend(first_failure);
    }
    if steered_any {
        kept.sort_by_key(estimated_cycles);
    }
    Ok(kept)
}

/// One finalist within the table budget, and whether it was steered (Ok), or the finalist as
/// the search planned it when at most `steers` steers cannot bring it within (Err).
#[allow(clippy::too_many_arguments)]
fn steer_within(graph: &Graph, target: &Target, index: usize, finalist: Lowered, (budget, hard): (u32, bool), steers: usize, schedule: &mut ScheduleFn, remember: &mut RememberFn, relative: Option<&RelativeMemo>) -> Result<Result<(Lowered, bool), Lowered>, String> {
    // The finalist steered so far (None: as planned).
    let mut current: Option<Lowered> = None;
    let mut steered = graph.clone();
    for round in 0..=steers {
        let l = current.as_ref().unwrap_or(&finalist);
        let start = std::time::Instant::now();
        let sized = size_tables(target, l, budget, schedule, relative)?;
        debug!(finalist = index, round, elapsed_ms = start.elapsed().as_millis() as u64, "sized the finalist's exchange tables");
        let overflow = match sized.tables {
            Ok(bytes) => {
                remember(sized.prepared, &sized.digests, &bytes);
                return Ok(Ok(match current {
                    Some(l) => (l, true),
                    None => (finalist, false),
                }));
            }
            Err(o) => o,
        };
        // Under the compiler's policy (not `hard`), a finalist over the budget that places with
        // its tables beside the program's data is kept as it is (`sizing` module docs), as
        // select_finalist keeps it; one that does not place is handed on as planned, for
        // select_finalist to name what does not fit and blame (steering tables is for a
        // user's hard budget: where memory is what runs out, as in thirteen full-size encoder
        // layers, eight steered lowerings took five minutes and did not help).
        if !hard {
            match crate::sizing::places_with_tables(target, l, &overflow.table_bytes) {
                Ok(()) => {
                    info!(finalist = index, tile = overflow.tile, exchange_table_bytes = overflow.bytes, budget = overflow.budget, "exchange tables over the budget, placed with the program's data: kept");
                    remember(sized.prepared, &sized.digests, &overflow.table_bytes);
                    return Ok(Ok(match current {
                        Some(l) => (l, true),
                        None => (finalist, false),
                    }));
                }
                Err(e) => {
                    debug!(finalist = index, %overflow, error = %e, "exchange tables over the budget do not place with the program: finalist handed on");
                    break;
                }
            }
        }
        if round == steers {
            debug!(finalist = index, %overflow, "exchange tables over the budget: finalist dropped");
            break;
        }
        // The plan blamed: the operation whose gathers (or reduction) the phase carries.
        let Some(plan) = overflow.phase.and_then(|p| sized.prepared.phase_plans.get(p as usize)).and_then(|&i| l.plans.get(i as usize)) else {
            debug!(finalist = index, %overflow, "exchange tables over the budget in a phase no operation's plan owns");
            break;
        };
        let user = steered.file.constraints.iter().find(|c| c.operation == plan.value);
        let Some(constraint) = steer_away(plan, user) else {
            debug!(finalist = index, operation = %plan.value, %overflow, "exchange tables over the budget: nothing left to steer");
            break;
        };
        let [b, r, c, i] = plan.partitions;
        info!(finalist = index, operation = %plan.value, partitions = %format!("[{b},{r},{c},{i}]"), reason = %overflow, constraint = %constraint.describe(), "exchange tables over the budget: lowering the finalist again, steered away from the plan");
        steered.file.constraints.retain(|c| c.operation != constraint.operation);
        steered.file.constraints.push(constraint);
        // The finalist's own orientation, lowered again under the constraint.
        let oriented = match orient(&steered, &l.swapped_operations()) {
            Ok(o) => o,
            Err(message) => {
                debug!(finalist = index, %message, "steered finalist cannot be oriented");
                break;
            }
        };
        let start = std::time::Instant::now();
        // A program lowered under a replication cap keeps it (`lower_capped_alone`); None:
        // the steered program does not fit.
        let lowered = match replication_cap_of(l) {
            Some(cap) => Ok(lower_capped_alone(&oriented, target, cap)),
            None => lower_feasible_alone(&oriented, target, home_from(graph, l)).map(|(next, fits)| fits.then_some(next)),
        };
        debug!(finalist = index, home_from = home_from(graph, l), elapsed_ms = start.elapsed().as_millis() as u64, "lowered the steered finalist");
        match lowered {
            Ok(Some(next)) => current = Some(next),
            Ok(None) => {
                debug!(finalist = index, "steered finalist does not fit tile memory");
                break;
            }
            Err(e) => {
                debug!(finalist = index, error = %e, "steered finalist does not lower");
                break;
            }
        }
    }
    Ok(Err(finalist))
}

/// The original operation from which a program's products keep their weight blocks once on a
/// home tile (`Partial::home_from`; usize::MAX: none, 0: all): the host writes every element
/// of those weights once (a replicated weight's replicas are written too). 0 when every weight
/// is written once; else the first product with more than one row partition whose weight is.
fn home_from(graph: &Graph, l: &Lowered) -> usize {
    let once = |t: &super::LHostTensor| t.streamed_elements() == t.elements();
    let mut weights = l.inputs.iter().filter(|t| t.role == HostRole::Weight).peekable();
    if weights.peek().is_some() && weights.all(once) {
        return 0;
    }
    l.plans
        .iter()
        .filter(|p| p.kind == "matmul" && p.partitions[1] > 1)
        .filter(|p| {
            let weight = graph.operations.get(p.operation as usize).and_then(|o| o.inputs.get(1)).map(|&w| graph.value(w).name.as_str());
            l.inputs.iter().any(|t| t.role == HostRole::Weight && Some(t.name.as_str()) == weight && once(t))
        })
        .map(|p| p.operation as usize)
        .min()
        .unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::pattern_digest;
    use crate::lower::search::finalists;
    use crate::target::fixtures;

    const MLP: &str = include_str!("../../../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");
    const ATTENTION: &str = include_str!("../../../fixtures/workloads/attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8.toml");

    fn small16() -> Target {
        Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap()
    }

    /// The exchange scheduler itself, unmemoized.
    fn schedule(target: &Target) -> impl FnMut(&[LazyRequests]) -> Result<Vec<(Schedule, Digest)>, String> + '_ {
        move |programs| {
            crate::pipeline::flat_phases(programs)
                .into_iter()
                .map(|(k, i)| {
                    let p = programs[k].get(i);
                    crate::exchange::schedule_phase(target, p).map(|s| (s, pattern_digest(p))).map_err(|e| e.to_string())
                })
                .collect()
        }
    }

    /// The most table bytes a tile of this finalist needs (sized with no budget).
    fn most_table_bytes(target: &Target, l: &Lowered) -> u32 {
        size_tables(target, l, u32::MAX, &mut schedule(target), None).unwrap().tables.unwrap().into_iter().max().unwrap()
    }

    /// The screen at this budget: the finalists it keeps, and the most table bytes a tile
    /// needs of each sizing it remembers for select_finalist.
    fn screen_remembering(graph: &Graph, target: &Target, found: &[Lowered], budget: (u32, bool)) -> (Vec<Lowered>, Vec<u32>) {
        let mut remembered: Vec<u32> = Vec::new();
        let kept = screen_tables(graph, target, found.to_vec(), budget, &mut schedule(target), &mut |_, _, b| remembered.push(b.iter().copied().max().unwrap_or(0)), None).unwrap();
        (kept, remembered)
    }

    /// Each tile's table bytes of a finalist as select_finalist prepares it at this link rate.
    fn prepared_bytes(target: &Target, l: &Lowered, link_bytes_per_second: u64) -> Vec<u32> {
        let mut at_rate = target.clone();
        at_rate.host.link_bytes_per_second = link_bytes_per_second;
        let prepared = crate::lower::host::replicate(l.clone(), &at_rate);
        let bases = provisional_bases(&prepared);
        let phases = LazyRequests::new(&prepared, &bases);
        let schedules: Vec<Schedule> = schedule(target)(std::slice::from_ref(&phases)).unwrap().into_iter().map(|s| s.0).collect();
        crate::sizing::table_bytes_checked(target, &prepared, &schedules, None, u32::MAX).unwrap().unwrap()
    }

    /// The screen's table bytes are those size_tile_code encodes for the program
    /// select_finalist prepares when the host link is slow enough that every repeated input is
    /// replicated, and bound them on every tile at any link rate (a fast link keeps inputs on
    /// the host: fewer phases, never more bytes).
    #[test]
    fn screened_bytes_bound_the_tables_of_the_prepared_program() {
        let target = small16();
        for (name, text) in [("mlp", MLP), ("attention", ATTENTION)] {
            let graph = Graph::parse(text, name).unwrap();
            for (f, l) in finalists(&graph, &target, 4).unwrap().iter().enumerate() {
                let sized = size_tables(&target, l, u32::MAX, &mut schedule(&target), None).unwrap();
                let bound = sized.tables.unwrap();
                assert!(bound.iter().any(|&b| b > 0), "{name} finalist {f}: no tables");
                assert_eq!(prepared_bytes(&target, l, 1), bound, "{name} finalist {f}");
                let fast = prepared_bytes(&target, l, u64::MAX);
                assert!(fast.iter().zip(&bound).all(|(a, b)| a <= b), "{name} finalist {f}: {fast:?} over {bound:?}");
            }
        }
    }

    /// At a user's hard budget of what the best finalist needs, the screen changes nothing;
    /// one byte under it, every finalist it keeps sizes within the budget (the best one
    /// steered, later ones over it dropped), or only the best finalist is handed on as
    /// planned, over the budget, when no steering helps; what it remembers for
    /// select_finalist is within the budget.
    #[test]
    fn finalists_over_the_table_budget_are_steered_or_dropped() {
        let target = small16();
        let graph = Graph::parse(MLP, "mlp").unwrap();
        let found = finalists(&graph, &target, 4).unwrap();
        let need = most_table_bytes(&target, &found[0]);
        let (kept, remembered) = screen_remembering(&graph, &target, &found, (need, true));
        assert_eq!(kept[0], found[0]);
        assert!(remembered.iter().all(|&b| b <= need) && remembered.contains(&need), "{remembered:?}");
        let budget = need - 1;
        let (kept, remembered) = screen_remembering(&graph, &target, &found, (budget, true));
        assert!(!kept.is_empty());
        assert!(remembered.iter().all(|&b| b <= budget), "{remembered:?}");
        let best = estimated_cycles(&kept[0]);
        let over = |l: &Lowered| size_tables(&target, l, budget, &mut schedule(&target), None).unwrap().tables.is_err();
        if kept.len() == 1 && kept[0] == found[0] {
            assert!(over(&kept[0]), "the best finalist was handed on although it fits");
        } else {
            assert!(!kept.contains(&found[0]), "the best finalist is over the budget");
            for l in kept.iter().filter(|l| estimated_cycles(l) * 100 <= best * (100 + EXACT_COST_MARGIN_PERCENT)) {
                assert!(!over(l), "a finalist over the budget was kept: {:?} {:?} {}", found.iter().map(estimated_cycles).collect::<Vec<_>>(), kept.iter().map(|k| (estimated_cycles(k), found.iter().position(|f| f == k))).collect::<Vec<_>>(), estimated_cycles(l));
            }
        }
    }

    /// Under the compiler's policy (not hard) one byte under what the best finalist needs,
    /// the finalist still places with its tables beside its data (small16 has room), so it is
    /// kept as planned, not steered, and its sizing, over the budget, goes to select_finalist.
    /// Tables as large as a tile's standard region do not place: code is fetched from there
    /// only (`places_with_tables` names the tile and the code).
    #[test]
    fn finalists_over_the_policy_budget_are_kept_where_they_place() {
        let target = small16();
        let graph = Graph::parse(MLP, "mlp").unwrap();
        let found = finalists(&graph, &target, 4).unwrap();
        let need = most_table_bytes(&target, &found[0]);
        let (kept, remembered) = screen_remembering(&graph, &target, &found, (need - 1, false));
        assert_eq!(kept[0], found[0]);
        assert!(remembered.contains(&need), "{remembered:?}");
        let over = size_tables(&target, &found[0], need - 1, &mut schedule(&target), None).unwrap().tables.unwrap_err();
        assert!(crate::sizing::places_with_tables(&target, &found[0], &over.table_bytes).is_ok());
        // (Code is fetched from below the interleaved region only: tables past it do not place.)
        let huge = vec![target.memory.interleaved_start - target.memory.base; found[0].tiles as usize];
        let error = crate::sizing::places_with_tables(&target, &found[0], &huge).unwrap_err();
        assert_eq!((error.tile, error.label.as_str(), error.region), (0, "code", "standard"), "{error}");
    }

    /// select_finalist takes the table bytes the screen found (`support_checked_known`),
    /// without sizing again: within the budget the support memory they give, over it (a
    /// finalist kept under the budget policy) the overflow at the lowest tile over it, with
    /// every tile's bytes.
    #[test]
    fn known_table_bytes_over_the_budget_give_the_overflow_without_sizing_again() {
        let target = small16();
        let graph = Graph::parse(MLP, "mlp").unwrap();
        let found = finalists(&graph, &target, 4).unwrap();
        let sized = size_tables(&target, &found[0], u32::MAX, &mut schedule(&target), None).unwrap();
        let bytes = sized.tables.unwrap();
        let need = bytes.iter().copied().max().unwrap();
        // No schedules: the known bytes are all it reads.
        let within = crate::sizing::support_checked_known(&target, &sized.prepared, &[], None, need, Some(&bytes)).unwrap().unwrap();
        let total = |s: &[crate::emit::SupportMemory]| s.iter().map(crate::emit::SupportMemory::total).collect::<Vec<u32>>();
        assert_eq!(total(&within), total(&crate::emit::support_memory(&sized.prepared, &bytes)));
        let over = crate::sizing::support_checked_known(&target, &sized.prepared, &[], None, need - 1, Some(&bytes)).unwrap().unwrap_err();
        assert_eq!((over.tile as usize, over.bytes, over.budget), (bytes.iter().position(|&b| b == need).unwrap(), need, need - 1));
        assert_eq!(*over.table_bytes, bytes);
    }
}

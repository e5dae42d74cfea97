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
use crate::exchange::Schedule;
use crate::pipeline::{provisional_bases, LazyRequests};
use crate::db::CompileError;
use crate::elements::{conflict_tiles, phase_conflicts};
use crate::exchange_placement::{checked_tables, placed_tables, relocation_memoized, Baseline, Measured, RelativeMemo};
use crate::hash::Digest;
use crate::storage::{place_storage_memoized, ExchangeRules, Placement};
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
    /// The chosen program after the host pass, where it is not `prepare` of a finalist of
    /// `lower_mid` (after a re-plan); else `None`, and the `lowered` query derives it (so the
    /// stage's entry does not hold the program a second time).
    pub lowered: Option<Lowered>,
    pub costed: Vec<Costed>,
    /// Per finalist: why it could not be placed, if it could not.
    pub failures: Vec<(u32, String)>,
    /// Constraints the pipeline added when no first-planned finalist could be placed
    /// (`operation: fields`); when any, `chosen`, `costed` and `failures` speak of the
    /// finalists of the last re-plan.
    pub steered: Vec<String>,
}

/// Why no finalist could be placed, with the plans (indices into the finalists' `plans`, by
/// finalist) of the operations whose exchanges made a finalist infeasible: tables over the
/// per-tile budget, or memory-element conflicts that exchange placement cannot remove.
#[derive(Clone, Debug)]
pub struct NoFinalist {
    pub message: String,
    /// (finalist, plan index, what went wrong, in words).
    pub blamed: Vec<(u32, u32, String)>,
    /// The first finalist that could not be placed only for memory-element conflicts left
    /// after exchange placement, where it went no further: its program as prepared, and the
    /// tiles with conflicts per phase. Naming those tiles half-duplex in its program
    /// (`Lowered::half_duplex`) removes the conflicts there (`half_duplex`).
    pub conflicted: Option<Box<Conflicted>>,
}

/// (phase, tiles), by phase.
pub type PhaseTiles = Vec<(u32, Vec<u32>)>;

/// A finalist left with memory-element conflicts (`NoFinalist::conflicted`).
#[derive(Clone, Debug)]
pub struct Conflicted {
    pub finalist: u32,
    pub program: Lowered,
    /// The tiles with conflicts per phase.
    pub tiles: PhaseTiles,
}

/// Why one finalist cannot be placed, and the plan blamed for it (if one is); for
/// memory-element conflicts, the tiles with conflicts per phase.
struct Failure {
    message: String,
    blamed: Option<u32>,
    conflicts: PhaseTiles,
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure { message, blamed: None, conflicts: Vec::new() }
    }
}

/// `program` with `tiles` (phase, tiles with conflicts) added to its half-duplex tiles, and
/// how many (phase, tile) pairs were new: its schedules keep those tiles' sends and receives
/// apart in time, so the conflicts on them cannot come back wherever placement puts the
/// buffers.
pub fn half_duplex(mut program: Lowered, tiles: &[(u32, Vec<u32>)]) -> (Lowered, usize) {
    let mut added = 0;
    for (phase, list) in tiles {
        let at = match program.half_duplex.binary_search_by_key(phase, |h| h.0) {
            Ok(at) => at,
            Err(at) => {
                program.half_duplex.insert(at, (*phase, Vec::new()));
                at
            }
        };
        let held = &mut program.half_duplex[at].1;
        for &t in list {
            if let Err(i) = held.binary_search(&t) {
                held.insert(i, t);
                added += 1;
            }
        }
    }
    (program, added)
}

/// A finalist's support memory per tile, or the tile whose exchange tables exceed the budget
/// (`sizing::support_checked`).
pub type Sizing = Result<Vec<crate::emit::SupportMemory>, crate::sizing::TableOverflow>;

/// Finalists whose estimate exceeds the best estimate by more than this are not costed exactly.
pub const EXACT_COST_MARGIN_PERCENT: u64 = 5;

/// Schedule, size, place and cost each finalist; keep the cheapest. `schedule` schedules a
/// list of exchange phases (every finalist's, concatenated) and returns them in order, each
/// with its digest.
///
/// `prepare` turns each finalist into the program that will run (`lower/host.rs` moves host
/// replicas to exchange phases), so the exact cost counts every phase the simulator will.
/// `optimize` is the exchange-placement search (`best_exchange_placement` over the lowering
/// view), for a finalist whose baseline placement has memory-element conflicts: given the
/// program, its schedules and their digests, the code bytes, the baseline placement and its
/// tables as written here (with each phase's conflicts and memory-element bound, and the relative tables they were written from; the search checks them if it keeps
/// the baseline), the placement it accepts and the conflicts left (the pipeline memoizes it,
/// so that the stage `optimize_exchange_placement` finds the chosen finalist's search done).
/// `size` is `sizing::support_checked` of a finalist over `target` (the pipeline takes the
/// table bytes `lower_mid`'s screen found when it has them), with whether the budget is a
/// user's hard one (else a finalist over it is kept where it places with its tables), and
/// `keep_sizing` is told of its support memory with the program's digest (the pipeline
/// memoizes it, so that the stage `size_tile_code` finds the chosen finalist's sizing done),
/// and `keep_placement` of each finalist's baseline placement with its program's digest and
/// code bytes (the pipeline memoizes it, so that the stage `place_storage` finds the chosen
/// finalist's placement done).
/// `optimize`, `keep_sizing` and `keep_placement` get the program's digest, from `digest`
/// (computed once per finalist costed, given the finalist's index, beside its sizing).
#[allow(clippy::too_many_arguments)] // one closure per pipeline memo it feeds
pub fn select_finalist(
    target: &Target,
    finalists: &[Lowered],
    prepare: impl Fn(Lowered) -> Lowered + Sync,
    schedule: impl FnOnce(&[LazyRequests]) -> Result<Vec<(Schedule, Digest)>, String>,
    digest: impl Fn(usize, &Lowered) -> Result<Digest, String> + Sync,
    (size, hard): (impl Fn(&Lowered, &[Schedule], &[Digest]) -> Result<Sizing, String> + Sync, bool),
    keep_sizing: impl Fn(Digest, &[Digest], &[crate::emit::SupportMemory]) + Sync,
    keep_placement: &(impl Fn(Digest, &[u32], &Placement) + Sync),
    optimize: impl Fn(&Lowered, Digest, &[Schedule], &[Digest], &[u32], &Placement, Baseline) -> Result<(Placement, u64), String> + Sync,
    relative: Option<&RelativeMemo>,
) -> Result<Selection, NoFinalist> {
    let prepared: Vec<Lowered> = finalists.par_iter().map(|l| prepare(l.clone())).collect();
    let finalists = &prepared[..];
    let estimates: Vec<u64> = finalists.iter().map(estimated_cycles).collect();
    let best_estimate = estimates.iter().copied().min().unwrap_or(0);
    let in_margin = |f: usize| estimates[f] * 100 <= best_estimate * (100 + EXACT_COST_MARGIN_PERCENT);
    let mut failures: Vec<(u32, String)> = Vec::new();
    for (f, &e) in estimates.iter().enumerate().filter(|(f, _)| !in_margin(*f)) {
        failures.push((f as u32, format!("not costed: estimate {e} is more than {EXACT_COST_MARGIN_PERCENT} % above the best, {best_estimate}")));
    }
    // Every (finalist, phase) pair is an independent scheduling job: each request, and the
    // finalist it is of.
    // (Requests are made only for the phases the schedule memo does not hold.)
    let provisional: Vec<(usize, Vec<u32>)> = (0..finalists.len()).filter(|&f| in_margin(f)).map(|f| (f, provisional_bases(&finalists[f]))).collect();
    let programs: Vec<LazyRequests> = provisional.iter().map(|(f, bases)| LazyRequests::new(&finalists[*f], bases)).collect();
    let owners: Vec<usize> = provisional.iter().zip(&programs).flat_map(|((f, _), p)| std::iter::repeat_n(*f, p.len())).collect();
    let scheduled = schedule(&programs).map_err(|message| NoFinalist { message, blamed: Vec::new(), conflicted: None })?;
    drop(programs);
    let mut per_finalist: Vec<Vec<Schedule>> = vec![Vec::new(); finalists.len()];
    let mut digests: Vec<Vec<Digest>> = vec![Vec::new(); finalists.len()];
    for (&f, (s, d)) in owners.iter().zip(scheduled) {
        per_finalist[f].push(s);
        digests[f].push(d);
    }
    let costed: Vec<Result<Costed, Failure>> = finalists
        .par_iter()
        .enumerate()
        .map(|(f, l)| {
            if failures.iter().any(|x| x.0 == f as u32) {
                return Err(Failure::from("skipped".to_string()));
            }
            if per_finalist[f].len() != l.phases.len() {
                return Err(Failure::from("exchange phases were not scheduled".to_string()));
            }
            // The program's digest (a pass over the whole program) beside its sizing.
            let span = tracing::Span::current();
            let (program, sizing) = rayon::join(
                || digest(f, l),
                || {
                    let _span = span.enter();
                    size(l, &per_finalist[f], &digests[f])
                },
            );
            let (program, sizing) = (program?, sizing?);
            // Tables over a user's hard budget make the finalist infeasible, blaming the phase
            // that holds most of them; over the compiler's budget they are code like any other,
            // kept where the program places with them (`cost_placed`, `sizing` module docs).
            let (support, over) = match sizing {
                Ok(s) => (s, None),
                Err(o) if hard => return Err(Failure { message: o.to_string(), blamed: o.phase.and_then(|p| l.phase_plans.get(p as usize).copied()), conflicts: Vec::new() }),
                Err(o) => (crate::emit::support_memory(l, &o.table_bytes), Some(o)),
            };
            keep_sizing(program, &digests[f], &support);
            cost_placed(target, f as u32, (l, program), &per_finalist[f], &digests[f], (support, over), keep_placement, &optimize, relative)
        })
        .collect();
    let mut ok: Vec<Costed> = Vec::new();
    let mut blamed: Vec<(u32, u32, String)> = Vec::new();
    let mut conflicted: Option<(u32, PhaseTiles)> = None;
    for (f, c) in costed.into_iter().enumerate() {
        match c {
            Ok(c) => ok.push(c),
            Err(e) if !failures.iter().any(|x| x.0 == f as u32) => {
                if let Some(plan) = e.blamed {
                    blamed.push((f as u32, plan, e.message.clone()));
                }
                if conflicted.is_none() && !e.conflicts.is_empty() {
                    conflicted = Some((f as u32, e.conflicts));
                }
                failures.push((f as u32, e.message));
            }
            Err(_) => {}
        }
    }
    failures.sort();
    for (f, why) in &failures {
        debug!(finalist = f, reason = %why, "finalist cannot be placed");
    }
    let best = ok.iter().min_by_key(|c| (c.scheduled_cycles, c.estimated_cycles, c.finalist)).cloned();
    let Some(best) = best else {
        let message = failures.first().map(|f| f.1.clone()).unwrap_or_else(|| "no finalist".into());
        let mut prepared = prepared;
        let conflicted = conflicted.map(|(finalist, tiles)| Box::new(Conflicted { finalist, program: prepared.swap_remove(finalist as usize), tiles }));
        return Err(NoFinalist { message, blamed, conflicted });
    };
    for p in finalists[best.finalist as usize].plans.iter().filter(|p| !p.constraint.is_empty()) {
        info!(source_operation = %p.value, matching_plans = p.matching_plans, constraint = %p.constraint, "applied GEMM plan constraint");
    }
    info!(finalist = best.finalist, estimated_cycles = best.estimated_cycles, scheduled_cycles = best.scheduled_cycles, "selected operator-plan finalist");
    // The chosen program is moved out of the prepared finalists, not copied.
    let mut prepared = prepared;
    let lowered = prepared.swap_remove(best.finalist as usize);
    Ok(Selection { chosen: best.finalist, lowered: Some(lowered), costed: ok, failures, steered: Vec::new() })
}

/// Cycles of a finalist's placed program, computed as the package summary computes them.
///
/// `support` is each tile's code, tables included, and `over` the tables' overflow of the
/// compiler's budget where they exceed it (named in a placement failure). Infeasible when the
/// program does not place with its code (blaming the product that owns the buffer that does
/// not fit), or (blaming the plan of the phase at fault, `Lowered::phase_plans`) when
/// memory-element conflicts remain after the exchange-placement stage's own search (run here
/// only where the placement has conflicts), since the device rejects a tile sending from and
/// receiving into one element in a cycle.
#[allow(clippy::too_many_arguments)]
fn cost_placed(
    target: &Target,
    finalist: u32,
    (l, program): (&Lowered, Digest),
    schedules: &[Schedule],
    digests: &[Digest],
    (support, over): (Vec<crate::emit::SupportMemory>, Option<crate::sizing::TableOverflow>),
    keep_placement: &(impl Fn(Digest, &[u32], &Placement) + Sync),
    optimize: &(impl Fn(&Lowered, Digest, &[Schedule], &[Digest], &[u32], &Placement, Baseline) -> Result<(Placement, u64), String> + Sync),
    relative: Option<&RelativeMemo>,
) -> Result<Costed, Failure> {
    let blame = |phase: u32| l.phase_plans.get(phase as usize).copied();
    let code: Vec<u32> = support.iter().map(|s| s.total()).collect();
    // A buffer that does not fit blames the product it belongs to, so that the pipeline can
    // steer that plan and plan again (eight full-size encoder layers fitted so in session 44, by
    // 2,304 bytes).
    // Tiles placed alike by a rebuilding process's previous build are taken from its memo.
    let stats_memo = relative.and_then(|m| m.for_statistics(target));
    // Where the host's bytes, one copy of each, exceed the room every tile together has beside
    // this code, the plan is not steered (`host_bytes_shortfall`).
    // (Over the compiler's table budget, the tables are code like any other: what does not
    // place blames as it would within the budget, and the message names the tables too. Blaming
    // the phase that holds most of them steered thirteen full-size layers' MLP up products
    // eight times, each lowering the whole program again, where memory was what ran out.)
    let tables = over.as_ref().map(|o| format!(" (the code beside it holds exchange tables over the compiler's {}-byte budget: {} bytes on tile {})", o.budget, o.bytes, o.tile)).unwrap_or_default();
    let placement = place_storage_memoized(target, l, &code, &ExchangeRules::default(), stats_memo.as_ref().map(|(m, scope)| (*m, scope))).map_err(|e| match host_bytes_shortfall(target, l, &code) {
        Some(short) => Failure { message: format!("{e}{tables}; {short}"), blamed: None, conflicts: Vec::new() },
        None => {
            let reserve = code_over_reserve(&code, e.tile).unwrap_or_default();
            let message = match host_bytes_on_tile(target, l, &code, e.tile) {
                Some(over) => format!("{e}{tables}{reserve}; {over}"),
                None => format!("{e}{tables}{reserve}"),
            };
            Failure { message, blamed: owner_plan(l, &e.label), conflicts: Vec::new() }
        }
    })?;
    if let Some(o) = &over {
        info!(finalist, tile = o.tile, exchange_table_bytes = o.bytes, budget = o.budget, "exchange tables over the budget, placed with the program's data: kept");
    }
    keep_placement(program, &code, &placement);
    // Phases relocate independently, from relative tables made once per distinct pattern and
    // schedule (the same phase of repeated layers shares them) and reused by the candidates of
    // the exchange-placement search. The tables are checked (schedule fit and validation)
    // where they are the placement kept: here when they have no conflicts, else by the
    // exchange-placement search when it keeps the baseline (it checks the placement it
    // accepts instead).
    // (`relative`: those lower_mid's table screen made for this program, where it sized it.)
    let relocation = relocation_memoized(target, l, schedules, digests, relative).map_err(|e| e.0)?;
    // Each phase measured (its statistics taken from the memo where a rebuilding process
    // kept them for the same tables, `Relocation::measured`); the tables are kept only where
    // no memo serves (a cold build keeps them for the check below), else written again should
    // the baseline have no conflicts.
    let memo = stats_memo.as_ref().map(|(m, scope)| (*m, scope));
    let keep = memo.is_none();
    let addresses = &placement.addresses;
    let address = |buffer: u32, offset: u32| addresses[buffer as usize] + offset;
    let span = tracing::Span::current();
    let measured: Vec<Result<Measured, CompileError>> = (0..l.phases.len())
        .into_par_iter()
        .map(|i| {
            let _span = span.enter();
            relocation.measured(target, l, schedules, i, &address, keep, memo)
        })
        .collect();
    let (mut tables, mut summary, mut stats) = (keep.then(|| Vec::with_capacity(measured.len())), Vec::with_capacity(measured.len()), Vec::with_capacity(measured.len()));
    for m in measured {
        let (phase, s, stat) = m.map_err(|e| e.0)?;
        if let (Some(tables), Some(phase)) = (tables.as_mut(), phase) {
            tables.push(phase);
        }
        summary.push(s);
        stats.push(stat);
    }
    let conflicts: u64 = stats.iter().map(|s| s.0.tile_cycles).sum();
    let horizons: Vec<u32> = summary.iter().map(|p| p.1).collect();
    if conflicts == 0 {
        let tables = match tables.take() {
            Some(tables) => tables,
            None => relocation.tables(target, l, schedules, &placement).map_err(|e| e.0)?,
        };
        checked_tables(target, l, schedules, &placement, tables).map_err(|e| e.0)?;
    } else {
        let base = Baseline { tables, summary, stats, relocation, memo: memo.map(|(m, scope)| (m, *scope)) };
        // The search starts from these tables; the conflicts it reports are those of the
        // placement it returns (summed over its phases), so only when some remain are that
        // placement's tables written again, to name the first phase at fault.
        let (optimized, left) = optimize(l, program, schedules, digests, &code, &placement, base)?;
        if left > 0 {
            let tables = placed_tables(target, l, schedules, &optimized, false).map_err(|e| e.0)?;
            if let Some((phase, c)) = tables.iter().map(|p| (p.index, phase_conflicts(target, p))).find(|(_, c)| c.tile_cycles > 0) {
                let (tile, cycle, element) = c.first.unwrap_or((0, 0, 0));
                let conflicts: PhaseTiles = tables.par_iter().map(|p| (p.index, conflict_tiles(target, p))).filter(|(_, t)| !t.is_empty()).collect();
                return Err(Failure {
                    message: format!("memory-element conflicts remain after exchange placement: exchange phase {phase}, tile {tile} sends from and receives into element {element} in cycle {cycle} ({} tile-cycles on {} tiles)", c.tile_cycles, c.tiles),
                    blamed: blame(phase),
                    conflicts,
                });
            }
        }
    }
    let mut cycles = 0u64;
    let mut exchange_cycles = 0u64;
    for step in &l.steps {
        match step {
            LStep::Compute(i) => {
                let mut per_tile = vec![0u64; l.tiles as usize];
                for (tile, call) in l.compute_sets[*i as usize].iter() {
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

/// Why steering cannot place `l` when the bytes the host writes before the run, one copy of
/// each tensor, exceed the bytes all tiles together have for data beside `code` (per tile: the
/// program's code and exchange tables, `size_tile_code`), in words; None when they do not.
///
/// No placement of a program with that much code can hold them: host-written tensors are live
/// from the first step (ipuq streams no weights during a run; a tensor some of whose buffers
/// start later is left out of the sum), and a tile's data lies between its code and the loader
/// limit. A steered plan moves work between tiles and changes the code and tables by some
/// kilobytes a tile (on 27 full-size encoder layers the first steer grew tile 0's by 16 KB,
/// and the seven after it each ended over the exchange-table budget), so for such a program
/// `select_finalist` reports the placement error with this at once instead of planning the
/// whole program again up to `REPLANS` times (twelve minutes on 27 layers, ending with an
/// exchange-table error that hid the cause; 84 s now).
fn host_bytes_shortfall(target: &Target, l: &Lowered, code: &[u32]) -> Option<String> {
    let host: u64 = written_before_run(l).map(|t| t.elements() * t.dtype.bytes() as u64).sum();
    let data: u64 = code.iter().map(|&c| room_beside(target, c)).sum();
    if host <= data {
        return None;
    }
    let (tile, most) = code.iter().enumerate().max_by_key(|(i, c)| (**c, std::cmp::Reverse(*i))).map(|(i, c)| (i, *c)).unwrap_or((0, 0));
    let short = host - data;
    Some(format!(
        "the host writes {host} bytes of weights and inputs before the run (one copy of each), but the {} tiles have {data} bytes for data beside this program's code and exchange tables ({most} bytes of them on tile {tile}, the most): {short} bytes too few ({} a tile), so no plan is steered to fit; weights this large need streaming from the host during the run, which ipuq does not do",
        code.len(),
        short.div_ceil(code.len().max(1) as u64)
    ))
}

/// What a placement error on `tile` adds where the tile's code and exchange tables (`code`, per
/// tile) outgrew the code reserve the planner sets aside on every tile (`CODE_RESERVE_BYTES`):
/// the planner laid the program's data out beside the reserve, and the bytes past it are memory
/// the data had there. Fifteen full-size encoder layers fail so on tile 2 (71,088 bytes of code
/// and tables, 21,936 past the reserve); the error named only the regions' bytes.
fn code_over_reserve(code: &[u32], tile: u32) -> Option<String> {
    let c = *code.get(tile as usize)?;
    let reserve = super::build::CODE_RESERVE_BYTES;
    (c as u64 > reserve).then(|| format!(" (the code and exchange tables beside it take {c} bytes on tile {tile}, {} more than the {reserve} the planner set aside for them on every tile)", c as u64 - reserve))
}

/// Why `tile` cannot hold `l`'s placement when the bytes the host writes there before the run
/// (buffers of host tensors live from the first step, weights kept on home tiles) alone exceed
/// what the tile has for data beside its code and exchange tables (`code`, per tile), in words
/// naming the tensors with most bytes there; None when they do not.
///
/// The placement error names the buffer that found no room, which is only the one placed last;
/// this says the tile was over before any buffer the program computes (24 full-size encoder
/// layers: tile 0 holds 603,392 host-written bytes beside 87,640 of code and tables, 53,168
/// more than its 550,224 bytes of room, as the same weight of every layer is homed there).
fn host_bytes_on_tile(target: &Target, l: &Lowered, code: &[u32], tile: u32) -> Option<String> {
    let c = *code.get(tile as usize)?;
    let room = room_beside(target, c);
    let mut by_tensor: Vec<(u64, &str)> = written_before_run(l)
        .filter_map(|t| {
            let mut buffers: Vec<u32> = t.segments.iter().map(|s| s.buffer).filter(|&b| l.buffers[b as usize].tile == tile).collect();
            buffers.sort_unstable();
            buffers.dedup();
            let bytes: u64 = buffers.iter().map(|&b| l.buffers[b as usize].bytes as u64).sum();
            (bytes > 0).then_some((bytes, t.name.as_str()))
        })
        .collect();
    let host: u64 = by_tensor.iter().map(|t| t.0).sum();
    if host <= room {
        return None;
    }
    by_tensor.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    let mut named: Vec<String> = by_tensor.iter().take(3).map(|(bytes, name)| format!("'{name}' {bytes}")).collect();
    if by_tensor.len() > named.len() {
        named.push(format!("{} more tensors", by_tensor.len() - named.len()));
    }
    Some(format!("tile {tile} holds {host} bytes the host writes before the run ({}), {} more than the {room} bytes it has for data beside its {c} bytes of code and exchange tables", named.join(", "), host - room))
}

/// The host tensors of `l` written before the run: every buffer of theirs is live from the
/// first step (a tensor some of whose buffers start later is left out).
fn written_before_run(l: &Lowered) -> impl Iterator<Item = &crate::lower::LHostTensor> {
    l.inputs.iter().filter(|t| !t.segments.is_empty() && t.segments.iter().all(|s| l.buffers.get(s.buffer as usize).is_some_and(|b| b.first_step == 0)))
}

/// The bytes a tile has for data beside `code` bytes of code and exchange tables: from where
/// its data may start to the loader limit.
fn room_beside(target: &Target, code: u32) -> u64 {
    let m = &target.memory;
    m.loader_limit.saturating_sub(crate::storage::data_start(m.base, code)) as u64
}

/// The matrix product whose buffer `label` is, as an index into the program's plans: the
/// lowering names a product's partials after the value it writes (`l0.mlp_down.partials`, the
/// bias add its epilogue folds in), and the plan after the product (`l0.mlp_down.product`) or
/// that value; None for any other buffer.
fn owner_plan(l: &Lowered, label: &str) -> Option<u32> {
    let (value, _) = label.rsplit_once('.')?;
    l.plans.iter().position(|p| p.kind == "matmul" && (p.value == value || p.value.strip_prefix(value).is_some_and(|rest| rest == ".product"))).map(|i| i as u32)
}

/// A constraint steering a matrix product away from `plan`, which made every finalist
/// infeasible: half as many pieces along the first axis the user left free, in the order
/// inner, column, row partitions (fewer pieces mean fewer partial and operand transfers per
/// tile, so smaller exchange tables and fewer buffers in flight). The user's own fields (in
/// `user`) are kept. None when no free axis has more than one piece, or for other operations.
pub fn steer_away(plan: &super::OperationPlan, user: Option<&crate::ir::PlanConstraint>) -> Option<crate::ir::PlanConstraint> {
    if plan.kind != "matmul" {
        return None;
    }
    let [_, rows, columns, inner] = plan.partitions;
    let mut c = user.cloned().unwrap_or(crate::ir::PlanConstraint {
        operation: plan.value.clone(),
        orientation: None,
        row_partitions: None,
        column_partitions: None,
        inner_partitions: None,
        weight_memory: None,
        weights: None,
    });
    let user_sets = |f: fn(&crate::ir::PlanConstraint) -> Option<u32>| user.is_some_and(|u| f(u).is_some());
    if !user_sets(|u| u.inner_partitions) && inner > 1 {
        c.inner_partitions = Some(inner / 2);
    } else if !user_sets(|u| u.column_partitions) && columns > 1 {
        c.column_partitions = Some(columns / 2);
    } else if !user_sets(|u| u.row_partitions) && rows > 1 {
        c.row_partitions = Some(rows / 2);
    } else {
        return None;
    }
    Some(c)
}

#[cfg(test)]
mod tests {
    use super::{code_over_reserve, half_duplex, host_bytes_on_tile, host_bytes_shortfall, owner_plan, steer_away};
    use crate::ir::{DType, PlanConstraint};
    use crate::lower::OperationPlan;

    fn plan(kind: &str, partitions: [u32; 4]) -> OperationPlan {
        OperationPlan {
            operation: 3,
            value: "down".into(),
            kind: kind.into(),
            orientation: "normal".into(),
            weight_memory: "interleaved".into(),
            constraint: String::new(),
            matching_plans: 0,
            partitions,
            tiles: partitions.iter().product(),
            estimated_compute_cycles: 0,
            estimated_exchange_cycles: 0,
            peak_bytes: 0,
        }
    }

    fn user(inner: Option<u32>, columns: Option<u32>) -> PlanConstraint {
        PlanConstraint { operation: "down".into(), orientation: Some("swapped".into()), row_partitions: None, column_partitions: columns, inner_partitions: inner, weight_memory: None, weights: None }
    }

    #[test]
    fn halves_the_first_free_axis_and_keeps_the_users_fields() {
        let c = steer_away(&plan("matmul", [1, 48, 2, 27]), None).expect("steered");
        assert_eq!((c.operation.as_str(), c.row_partitions, c.column_partitions, c.inner_partitions), ("down", None, None, Some(13)));
        // The user fixed the inner partitions: the columns are halved instead, orientation kept.
        let c = steer_away(&plan("matmul", [1, 48, 2, 27]), Some(&user(Some(27), None))).expect("steered");
        assert_eq!((c.orientation.as_deref(), c.column_partitions, c.inner_partitions), (Some("swapped"), Some(1), Some(27)));
        let c = steer_away(&plan("matmul", [1, 48, 1, 1]), None).expect("steered");
        assert_eq!((c.row_partitions, c.column_partitions, c.inner_partitions), (Some(24), None, None));
    }

    #[test]
    fn half_duplex_tiles_merge_by_phase_and_count_only_new_ones() {
        let empty = crate::storage::tests::partials(&[]);
        let (l, added) = half_duplex(empty, &[(14, vec![9, 3]), (2, vec![5])]);
        assert_eq!((l.half_duplex.clone(), added), (vec![(2, vec![5]), (14, vec![3, 9])], 3));
        let (l, added) = half_duplex(l, &[(14, vec![3, 4]), (7, vec![1])]);
        assert_eq!((l.half_duplex.clone(), added), (vec![(2, vec![5]), (7, vec![1]), (14, vec![3, 4, 9])], 2));
        let (_, added) = half_duplex(l, &[(2, vec![5])]);
        assert_eq!(added, 0, "tiles already half-duplex add nothing (the pipeline then steers)");
    }

    #[test]
    fn a_buffer_that_does_not_fit_blames_the_product_it_belongs_to() {
        let mut l = crate::storage::tests::partials(&[]);
        for (value, kind) in [("l0.ln2", "layer_norm"), ("l0.mlp_up.product", "matmul"), ("l0.mlp_down.product", "matmul"), ("l1.q", "matmul")] {
            l.plans.push(OperationPlan { value: value.into(), ..plan(kind, [1, 2, 3, 4]) });
        }
        assert_eq!(owner_plan(&l, "l0.mlp_down.partials"), Some(2));
        assert_eq!(owner_plan(&l, "l0.mlp_up.weight"), Some(1));
        assert_eq!(owner_plan(&l, "l1.q.partials"), Some(3));
        // Not a product's: another operation's, a value of no plan, or a name without parts.
        assert_eq!(owner_plan(&l, "l0.ln2.statistics"), None);
        assert_eq!(owner_plan(&l, "l0.mlp.partials"), None);
        assert_eq!(owner_plan(&l, "w2_3"), None);
    }

    /// Code and tables past the planner's code reserve are named with the tile and the bytes
    /// past it; at the reserve, nothing is added.
    #[test]
    fn code_past_the_planners_reserve_is_named() {
        let reserve = super::super::build::CODE_RESERVE_BYTES as u32;
        assert_eq!(code_over_reserve(&[reserve, 0], 0), None);
        assert_eq!(code_over_reserve(&[0, reserve + 21_936], 1).as_deref(), Some(" (the code and exchange tables beside it take 71088 bytes on tile 1, 21936 more than the 49152 the planner set aside for them on every tile)"));
        assert_eq!(code_over_reserve(&[reserve + 1], 3), None, "no such tile");
    }

    /// Two tiles and one host tensor of `elements` f16 values split over them, written at step
    /// `first` (0: before the run).
    fn host_program(elements: u32, first: u32) -> crate::lower::Lowered {
        let mut l = crate::storage::tests::partials(&[(elements, first, 3), (elements, first, 3)]);
        l.tiles = 2;
        l.buffers[1].tile = 1;
        let segment = |buffer: u32| crate::lower::LSegment { buffer, offset: 0, element: buffer * elements / 2, count: elements / 2, rows: 1, element_stride: 0, offset_stride: 0, element_step: 1 };
        l.inputs.push(crate::lower::LHostTensor { name: "w".into(), shape: vec![elements], dtype: DType::F16, role: crate::package::HostRole::Weight, segments: vec![segment(0), segment(1)] });
        l
    }

    /// The host's bytes against the room beside the code on every tile: equal is not short;
    /// one element more is, and says by how much; a tensor written after the first step is not
    /// counted; more code leaves less room.
    #[test]
    fn host_bytes_past_the_room_beside_the_code_are_short() {
        let target = crate::target::Target::from_toml(crate::target::fixtures::SMALL16, "small16.toml").unwrap();
        let m = &target.memory;
        let room = m.loader_limit - crate::storage::data_start(m.base, 0);
        assert_eq!(host_bytes_shortfall(&target, &host_program(room, 0), &[0, 0]), None, "two tiles hold {room} f16 values, {} bytes", 2 * room);
        let short = host_bytes_shortfall(&target, &host_program(room + 2, 0), &[0, 0]).expect("four bytes too many");
        assert!(short.starts_with(&format!("the host writes {} bytes of weights and inputs before the run (one copy of each), but the 2 tiles have {} bytes for data beside this program's code and exchange tables (0 bytes of them on tile 0, the most): 4 bytes too few (2 a tile)", 2 * room + 4, 2 * room)), "{short}");
        assert_eq!(host_bytes_shortfall(&target, &host_program(room + 2, 1), &[0, 0]), None, "written after the first step: not counted");
        let code = 64 * 1024;
        let short = host_bytes_shortfall(&target, &host_program(room, 0), &[0, code]).expect("less room beside the code");
        assert!(short.contains(&format!("({code} bytes of them on tile 1, the most)")), "{short}");
    }

    /// The host's bytes on the tile where placement failed, against that tile's room beside
    /// its code: equal fits; one element more is over, naming the tensor and the bytes; a
    /// tensor written after the first step is not counted; more code on the tile leaves less
    /// room there and none less on the other.
    #[test]
    fn host_bytes_over_one_tile_are_named() {
        let target = crate::target::Target::from_toml(crate::target::fixtures::SMALL16, "small16.toml").unwrap();
        let m = &target.memory;
        let room = m.loader_limit - crate::storage::data_start(m.base, 0);
        assert_eq!(host_bytes_on_tile(&target, &host_program(room, 0), &[0, 0], 0), None, "each tile holds {room} bytes");
        let over = host_bytes_on_tile(&target, &host_program(room + 2, 0), &[0, 0], 0).expect("two bytes too many");
        assert_eq!(over, format!("tile 0 holds {} bytes the host writes before the run ('w' {}), 2 more than the {room} bytes it has for data beside its 0 bytes of code and exchange tables", room + 2, room + 2));
        assert_eq!(host_bytes_on_tile(&target, &host_program(room + 2, 1), &[0, 0], 0), None, "written after the first step: not counted");
        let code = 64 * 1024;
        let less = m.loader_limit - crate::storage::data_start(m.base, code);
        let over = host_bytes_on_tile(&target, &host_program(room, 0), &[0, code], 1).expect("less room beside the code");
        assert!(over.starts_with(&format!("tile 1 holds {room} bytes")) && over.ends_with(&format!("{} more than the {less} bytes it has for data beside its {code} bytes of code and exchange tables", room - less)), "{over}");
        assert_eq!(host_bytes_on_tile(&target, &host_program(room, 0), &[0, code], 0), None);
        assert_eq!(host_bytes_on_tile(&target, &host_program(room, 0), &[0, code], 2), None, "no such tile");
    }

    #[test]
    fn nothing_to_steer() {
        assert!(steer_away(&plan("matmul", [4, 1, 1, 1]), None).is_none());
        assert!(steer_away(&plan("matmul", [1, 1, 8, 1]), Some(&user(None, Some(8)))).is_none());
        assert!(steer_away(&plan("softmax", [64, 1, 1, 1]), None).is_none());
    }
}

//! The pipeline: every stage in order, one line each. The driver (crate `ipuq`) calls them in
//! this order so that each phase is timed and logged as the seed's are.
//!
//! lower_mid                    search operator plans; keep K whole-program feasible finalists
//! select_finalist              schedule, place and cost each finalist exactly; keep the cheapest
//! lower_exchanges_provisional  schedule each exchange phase (address-free, cached per pattern)
//! size_tile_code               support memory per tile: runtime, host code, vertex state, tables
//! place_storage                addresses for every buffer, by region, alignment and lifetime
//! optimize_exchange_placement  move exchange buffers off memory-element conflicts, costed
//! lower_exchanges              patch final addresses into the schedules and validate them
//! build_tile_images            tile images (one memoized entry per distinct tile content) and
//!                              host tables, assembled into the package
//!
//! What each stage reads of the target (its key holds that view's digest, and the stage gets
//! only that view): lower_mid and select_finalist the lowering view (all but host), the schedules and
//! lower_exchanges the exchange view (grid, delays, pairing, port widths), place_storage the
//! memory view, build_tile_images the whole target (it embeds it). Every key also holds the
//! compiler fingerprint (`Database::key`).
//!
//! This file is long (about 930 lines) because it holds every stage's query with its key and the
//! in-process memos that hand one stage's work to the next (sizing, placement, validation), and
//! their tests; each stage's work itself lives in its own module.

use std::collections::HashMap;
use std::sync::Arc;

use rayon::prelude::*;

use crate::db::{digest_of, exchange_target, graph, lowering_target, memory_target, selection_target, target, CompileError, Database, Db, Sources, StageCache, StageResult, Staged, BEAM_TRACE_STAGE, BEAM_TRACE_VERSION};
use crate::emit::{assemble_package, build_tile, log_support_memory, tile_inputs, SupportMemory, TileBody};
use crate::exchange::{self, Destination, PhaseRequest, Schedule};
use crate::exchange_placement::{check_placement, search_exchange_placement, search_exchange_placement_from, Baseline, Tables, Validated};
use crate::hash::{Digest, KeyHasher};
use crate::lower::search;
use crate::lower::select::{select_finalist, Selection};
use crate::lower::Lowered;
use crate::phases::{combined, first_of_schedule, per_phase, per_tile};
use crate::package::{ExchangePhase, Package};
use crate::tables::PackedPhase;
use crate::storage::{place_storage, Placement};

/// The phases in order, as the driver runs and logs them.
pub const PHASES: &[&str] = &["lower_mid", "select_finalist", "lower_exchanges_provisional", "size_tile_code", "place_storage", "optimize_exchange_placement", "lower_exchanges", "build_tile_images"];

const LOWER_VERSION: u32 = 39;
const SELECT_VERSION: u32 = 29;
const SCHEDULE_VERSION: u32 = 9;
const CODE_VERSION: u32 = 15;
const PLACE_VERSION: u32 = 12;
const OPTIMIZE_PLACEMENT_VERSION: u32 = 13;
const TABLES_VERSION: u32 = 11;
const PACKAGE_VERSION: u32 = 21;

/// Run one phase by name (the driver's entry point); returns the digest of its output.
pub fn run_phase(db: &dyn Db, sources: Sources, phase: &str) -> Result<Digest, CompileError> {
    Ok(match phase {
        "lower_mid" => finalists(db, sources)?.digest,
        "select_finalist" => selection(db, sources)?.digest,
        "lower_exchanges_provisional" => schedules(db, sources)?.digest,
        "size_tile_code" => code_sizes(db, sources)?.digest,
        "place_storage" => placement(db, sources)?.digest,
        "optimize_exchange_placement" => placed(db, sources)?.digest,
        "lower_exchanges" => tables(db, sources)?.digest,
        "build_tile_images" => package(db, sources)?.digest,
        other => return Err(CompileError(format!("unknown phase '{other}'"))),
    })
}

#[salsa::tracked(returns(clone))]
pub fn finalists(db: &dyn Db, sources: Sources) -> StageResult<Vec<Lowered>> {
    let t = lowering_target(db, sources)?;
    let g = graph(db, sources)?;
    let k = db.ipuq().plan_finalists();
    let x = exchange_target(db, sources)?;
    let (budget, hard) = (db.ipuq().table_budget(), db.ipuq().table_budget_hard());
    let key = db.ipuq().key("lower_mid", LOWER_VERSION, &[t.digest, x.digest, g.digest, KeyHasher::new("plan finalists").add(&(k as u64)).finish(), KeyHasher::new("table budget").add(&budget).add(&hard).finish()]);
    let db = db.ipuq();
    db.cached("lower_mid", LOWER_VERSION, key, || {
        // The plan beam resumes from the previous build's of a workload of the same name over
        // the same lowering view and finalists (an edit of it), and leaves its own for the
        // next: the same finalists either way, only faster (`search::finalists_resuming`).
        let trace_key = db.key(BEAM_TRACE_STAGE, BEAM_TRACE_VERSION, &[t.digest, KeyHasher::new("plan finalists").add(&(k as u64)).finish(), KeyHasher::new("workload name").add(&g.value.name).finish()]);
        let previous = db.beam_trace(trace_key);
        let kept_before = previous.as_ref().and_then(|trace| db.beam_states(trace_key, trace));
        // Phases of a program the search lowers beside its beam, scheduled while it waits for
        // that program (`search::Warm`): entries the screen below finds made.
        let warmed: Arc<std::sync::Mutex<HashMap<Digest, Staged<Schedule>>>> = Arc::default();
        let warm = (!db.verifying()).then(|| warm_schedules(db, &x, &warmed));
        let (found, trace, kept) = search::finalists_keeping(&g.value, &t.value, k, previous.as_deref(), kept_before.as_deref(), warm, db.keeps_beam_states());
        // Released here, so that keeping this build's states below frees the previous build's
        // (the memo held the only other reference) before the table screen runs.
        drop(kept_before);
        db.keep_beam_trace(trace_key, trace, kept);
        let found = found.map_err(CompileError::from)?;
        // Finalists whose exchange tables would exceed the budget are steered within it (or
        // dropped) here, their phases scheduled through the memo select_finalist reads.
        // The table bytes of the finalists kept go to select_finalist (`screen_memo`). The
        // per-phase memo holds the latest call's entries only: every call of the screen starts
        // from all the entries it scheduled so far, and leaves them all for select_finalist.
        let mut memo = std::mem::take(&mut *db.schedule_memo.lock().expect("phase memo lock"));
        memo.extend(std::mem::take(&mut *warmed.lock().expect("warmed schedules lock")));
        let screened: std::cell::RefCell<HashMap<Digest, Staged<Schedule>>> = std::cell::RefCell::new(memo);
        let mut schedule = |programs: &[LazyRequests]| {
            *db.schedule_memo.lock().expect("phase memo lock") = screened.borrow().clone();
            let out = schedule_through_memo(db, &x, programs);
            screened.borrow_mut().extend(db.schedule_memo.lock().expect("phase memo lock").drain());
            out
        };
        let mut sized: Vec<Screened> = Vec::new();
        let mut remember = |prepared: Lowered, digests: &[Digest], bytes: &[u32]| {
            sized.push(Screened { lowering: t.digest, budget, prepared, schedules: digests.to_vec(), bytes: Arc::new(bytes.to_vec()) });
        };
        // A rebuilding process keeps what the previous build used (`select_finalist` drops
        // the rest once it is done); others start empty.
        if !db.keeps_beam_states() {
            db.relative_memo.clear();
        }
        // Packed sizings are kept only for a next build (a cold build would hash and copy
        // every phase's packing for nothing: four encoder layers about 0.25 s).
        db.relative_memo.keep_packings(db.keeps_beam_states());
        let kept = crate::lower::screen::screen_tables(&g.value, &t.value, found, (budget, hard), &mut schedule, &mut remember, Some(&db.relative_memo));
        *db.schedule_memo.lock().expect("phase memo lock") = screened.into_inner();
        let kept = kept.map_err(CompileError)?;
        *db.screen_memo.lock().expect("screen memo lock") = sized;
        Ok(kept)
    })
}

/// Table bytes lower_mid's screen found for a program it kept, and what they are of: the
/// lowering view (the sizing reads its delays), the budget, the program as the screen
/// prepared it, each phase's schedule. select_finalist takes them for a program whose sizing
/// reads the same (`sizing::same_sizing_input`, what `sizing::sizing_digest` digests),
/// compared in place (on a rayon worker, beside the finalist's own digest), not on
/// lower_mid's serial path.
pub(crate) struct Screened {
    lowering: Digest,
    budget: u32,
    prepared: Lowered,
    schedules: Vec<Digest>,
    bytes: Arc<Vec<u32>>,
}

impl Screened {
    /// Whether these are the bytes of `program` over these schedules, lowering view and budget.
    fn holds(&self, lowering: Digest, budget: u32, program: &Lowered, schedules: &[Digest]) -> bool {
        self.lowering == lowering && self.budget == budget && self.schedules == schedules && crate::sizing::same_sizing_input(&self.prepared, program)
    }
}

/// `search::Warm` for `finalists`: a phase's schedule, by the key `schedule_through_memo`
/// gives it, found in the memo (nothing to do), else on disk or made and stored
/// (`StageCache::cached`), into `warmed`. A phase that does not schedule is left for the
/// screen, which reports it.
fn warm_schedules(db: &Database, x: &Staged<crate::target::Target>, warmed: &Arc<std::sync::Mutex<HashMap<Digest, Staged<Schedule>>>>) -> Arc<search::Warm> {
    let (cache, memo, x, warmed): (StageCache, _, _, _) = ((**db).clone(), db.schedule_memo.clone(), x.clone(), warmed.clone());
    Arc::new(move |request: &PhaseRequest| {
        let key = cache.key("exchange_schedule", SCHEDULE_VERSION, &[x.digest, exchange::pattern_digest(request)]);
        if warmed.lock().expect("warmed schedules lock").contains_key(&key) || memo.lock().expect("phase memo lock").contains_key(&key) {
            return;
        }
        if let Ok(entry) = cache.cached("exchange_schedule", SCHEDULE_VERSION, key, || exchange::schedule_phase(&x.value, request).map_err(CompileError::from)) {
            warmed.lock().expect("warmed schedules lock").insert(key, entry);
        }
    })
}

/// Schedule exchange phases through the per-phase memo (and disk cache), keyed by the
/// exchange view and each phase's pattern; each schedule with its digest.
fn schedule_through_memo(db: &Database, x: &Staged<crate::target::Target>, programs: &[LazyRequests]) -> Result<Vec<(Schedule, Digest)>, String> {
    let phases = flat_phases(programs);
    let keys: Vec<Digest> = phases.par_iter().map(|&(k, i)| programs[k].pattern_digest(i)).collect::<Vec<_>>().iter().map(|p| db.key("exchange_schedule", SCHEDULE_VERSION, &[x.digest, *p])).collect();
    let entries = per_phase(db, "exchange_schedule", SCHEDULE_VERSION, &keys, &db.schedule_memo, |j| {
        let (k, i) = phases[j];
        exchange::schedule_phase(&x.value, programs[k].get(i)).map_err(CompileError::from)
    })
    .map_err(|e| e.0)?;
    Ok(entries.iter().map(|e| ((*e.value).clone(), e.digest)).collect())
}

/// Re-plans `selection` may make when no finalist can be placed (each steers the operations
/// blamed for it away from their plans, `lower/select.rs`).
const REPLANS: usize = 8;

/// The error of a selection whose steered re-plans did not make any program placeable: why
/// lower_mid's finalists could not be placed (`first`), then what steering tried and why its
/// last program failed (`last`), where steering ran and that differs. Twenty-four full-size
/// encoder layers had ended, after eight re-plans and ten minutes, with only the last: a table
/// 248 bytes over the budget on tile 19, where the cause was tile 0's host-written weights.
fn steering_did_not_help(first: &str, steered: &[crate::ir::PlanConstraint], last: &str) -> String {
    if steered.is_empty() || first == last {
        return last.to_string();
    }
    let plans: Vec<String> = steered.iter().map(|c| format!("{} ({})", c.operation, c.describe())).collect();
    let (what, from) = if plans.len() == 1 { ("operation", "its plan") } else { ("operations", "their plans") };
    format!("{first}; planning again with {} {what} steered away from {from} did not help: {last} (steered: {})", plans.len(), plans.join(", "))
}

/// Plan constraints in the order of their operations' names (a re-plan reads them as a set).
fn sorted_by_operation(constraints: &[crate::ir::PlanConstraint]) -> Vec<crate::ir::PlanConstraint> {
    let mut sorted = constraints.to_vec();
    sorted.sort_by(|a, b| a.operation.cmp(&b.operation));
    sorted
}

/// The constraints a re-plan runs with when `c` steers its operation: `steered` with that
/// operation's earlier constraint (if any) replaced by `c`, at the end; None where that set, in
/// any order, is one of those `tried` (sorted by operation).
fn steered_with(steered: &[crate::ir::PlanConstraint], c: &crate::ir::PlanConstraint, tried: &[Vec<crate::ir::PlanConstraint>]) -> Option<Vec<crate::ir::PlanConstraint>> {
    let mut next: Vec<crate::ir::PlanConstraint> = steered.iter().filter(|s| s.operation != c.operation).cloned().collect();
    next.push(c.clone());
    (!tried.contains(&sorted_by_operation(&next))).then_some(next)
}

/// A program `selection` made placeable with half-duplex tiles, and the memo entries of its
/// round (for the stages after selection, should it be the one chosen: its placement search,
/// sizing, baseline placement and schedules).
struct HalfDuplexed {
    selection: Selection,
    placements: HashMap<Digest, Arc<crate::exchange_placement::Searched>>,
    sizings: HashMap<Digest, Arc<Vec<crate::emit::SupportMemory>>>,
    baselines: HashMap<Digest, Arc<Placement>>,
    schedules: HashMap<Digest, Staged<Schedule>>,
}

/// Rounds of half-duplex tiles `selection` may add to a program left with memory-element
/// conflicts (each adds the tiles still in conflict).
const HALF_DUPLEX_ROUNDS: usize = 3;

/// Every finalist's exchange phases are scheduled through the per-phase memo, so the chosen
/// program's schedules stage finds them there.
///
/// When no finalist can be placed because a plan's exchanges made it infeasible (tables over
/// the per-tile budget, memory-element conflicts placement cannot remove), the operations
/// blamed are steered away from their plans by constraints (`steer_away`) and the program is
/// planned again, up to `REPLANS` times; the build fails only when that cannot help. Where
/// memory-element conflicts are all that is wrong with a finalist, the conflicting tiles are
/// also made half-duplex in their phases (`HALF_DUPLEX_ROUNDS`), and that program is kept
/// where it runs in fewer cycles than the steered one (or where steering finds none); steering
/// stops at the first steered program that needs half-duplex tiles too and runs no faster, and
/// never plans again with a set of constraints it has planned with before.
#[salsa::tracked(returns(clone))]
pub fn selection(db: &dyn Db, sources: Sources) -> StageResult<Selection> {
    // The selection view: the lowering view and the host link rate, which the host pass
    // weighs against exchange copies (other runtime constants still reach only the package).
    let t = selection_target(db, sources)?;
    let x = exchange_target(db, sources)?;
    let f = finalists(db, sources)?;
    let lt = lowering_target(db, sources)?;
    let g = graph(db, sources)?;
    let (budget, hard) = (db.ipuq().table_budget(), db.ipuq().table_budget_hard());
    // The key holds all it reads but the link rate; the rate is matched against the range of
    // rates over which the host pass decides alike (`Database::ranged`), so a link edit that
    // flips no decision selects nothing again.
    let key = db.ipuq().key("select_finalist", SELECT_VERSION, &[x.digest, f.digest, lt.digest, g.digest, KeyHasher::new("table budget").add(&budget).add(&hard).finish()]);
    let k = db.ipuq().plan_finalists();
    let db = db.ipuq();
    let range = std::sync::Mutex::new(crate::lower::host::RateRange::ALL);
    let prepare = |l: Lowered| {
        let (l, r) = crate::lower::host::replicate_in_range(l, &t.value);
        let mut range = range.lock().expect("rate range lock");
        *range = range.intersect(&r);
        l
    };
    db.ranged("select_finalist", SELECT_VERSION, key, t.value.host.link_bytes_per_second, &db.selection_memo, || {
        let schedule = |programs: &[LazyRequests]| schedule_through_memo(db, &x, programs);
        // The exchange-placement search of a finalist, over the lowering view (what the stage
        // optimize_exchange_placement runs on), remembered for that stage (the searches of the
        // last round's finalists only).
        let memo = &db.placement_memo;
        let (cache, validations): (&StageCache, &crate::phases::Memo<u32>) = (db, &db.validation_memo);
        let optimize = |l: &Lowered, program: Digest, schedules: &[Schedule], digests: &[Digest], code: &[u32], baseline: &Placement, tables: Baseline| -> Result<(Placement, u64), String> {
            let (code_digest, base) = (digest_of(&code.to_vec()).map_err(|e| e.0)?, digest_of(baseline).map_err(|e| e.0)?);
            let key = placement_search_key(lt.digest, program, digests, code_digest, base);
            let check = |placement: &Placement, tables: Tables| checked_tables_memoized((cache, validations), x.digest, &lt.value, l, (schedules, digests), placement, tables);
            let found = Arc::new(search_exchange_placement_from(&lt.value, l, schedules, code, baseline, tables, &check).map_err(|e| e.0)?);
            memo.lock().expect("placement memo lock").insert(key, found.clone());
            Ok((found.placement.clone(), found.conflicts))
        };
        // Table bytes lower_mid's screen found for the programs it kept (only when it ran in
        // this process), by what the sizing reads of the program and its schedules: they are
        // not encoded again.
        let screened = std::mem::take(&mut *db.screen_memo.lock().expect("screen memo lock"));
        let verifying = db.verifying();
        let known = |l: &Lowered, digests: &[Digest]| -> Option<Arc<Vec<u32>>> {
            if screened.is_empty() || verifying {
                return None;
            }
            let found = screened.iter().find(|s| s.holds(lt.digest, budget, l, digests)).map(|s| s.bytes.clone());
            tracing::debug!(found = found.is_some(), "exchange-table bytes from lower_mid's screen");
            found
        };
        // A finalist's support memory (its tables encoded over sizing addresses), over the
        // selection view (whose grid and delays, all sizing reads of it, are the exchange
        // view's), remembered for the stage size_tile_code (the last round's finalists only).
        let sized = &db.sizing_memo;
        let size = |l: &Lowered, schedules: &[Schedule], digests: &[Digest]| -> Result<crate::lower::select::Sizing, String> {
            let known = known(l, digests);
            crate::sizing::support_checked_known(&t.value, l, schedules, Some(digests), budget, known.as_deref().map(|v| &v[..]))
        };
        // (Over the compiler's budget too: such a finalist is kept where it places with its
        // tables.)
        let keep_sizing = |program: Digest, digests: &[Digest], support: &[crate::emit::SupportMemory]| {
            sized.lock().expect("sizing memo lock").insert(sizing_key(x.digest, program, digests, budget), Arc::new(support.to_vec()));
        };
        // A finalist's baseline placement, by what placement reads: the memory view (the
        // selection view's memory section, digested as the memory view is), the program and
        // the code bytes, remembered for the stage place_storage (the last round's finalists
        // only).
        let baselines = &db.baseline_memo;
        let memory = t.value.memory_view().view_digest("memory");
        let keep_placement = |program: Digest, code: &[u32], placement: &Placement| {
            if let Ok(code) = digest_of(&code.to_vec()) {
                baselines.lock().expect("baseline memo lock").insert(baseline_key(memory, program, code), Arc::new(placement.clone()));
            }
        };
        // Each costed finalist's program digest, by finalist (this round's): the chosen one's
        // goes with it to `lowered`, which does not serialise the program again.
        let programs: std::sync::Mutex<HashMap<usize, Digest>> = std::sync::Mutex::new(HashMap::new());
        let digest = |f: usize, l: &Lowered| {
            let d = digest_of(l).map_err(|e| e.0)?;
            programs.lock().expect("program digests lock").insert(f, d);
            Ok(d)
        };
        // The finalists of lower_mid, or of the last re-plan (not copied: select_finalist
        // prepares its own copies).
        let mut replanned: Option<Vec<Lowered>> = None;
        // The screen's relative tables serve this selection only (`RelativeMemo`): dropped
        // however it ends, but in a rebuilding process (`ipuq watch`), where those this build
        // used are kept for the next.
        struct Cleared<'a>(&'a crate::exchange_placement::RelativeMemo, bool);
        impl Drop for Cleared<'_> {
            fn drop(&mut self) {
                if self.1 {
                    self.0.keep_used();
                } else {
                    self.0.clear();
                }
            }
        }
        let _cleared = Cleared(&db.relative_memo, db.keeps_beam_states());
        let mut steered: Vec<crate::ir::PlanConstraint> = Vec::new();
        // Every set of constraints a re-plan has run with (sorted by operation): planning again
        // with one of them would give the program that failed then. (Measured with an
        // experiment that also blamed the product gathering a LayerNorm's output block:
        // fifteen full-size layers' MLP up product, blamed round after round, cycled
        // [1,4,90,4] -> [1,8,90,2] -> [1,16,90,1] -> [1,8,45,4] -> [1,8,90,2] ..., about a
        // minute a round; with this check the fourth round is not planned.)
        let mut tried: Vec<Vec<crate::ir::PlanConstraint>> = Vec::new();
        // Why lower_mid's finalists could not be placed, for the error should steering not help
        // (a steered program can fail for another reason, which would hide the cause).
        let mut first_failure: Option<String> = None;
        // The cheapest program made placeable by half-duplex tiles (below), with the memo
        // entries its round left for the later stages: taken over a steered program only where
        // it runs in fewer cycles, and where steering finds none.
        let mut half: Option<HalfDuplexed> = None;
        let chosen_cycles = |s: &Selection| s.costed.iter().find(|c| c.finalist == s.chosen).map_or(u64::MAX, |c| c.scheduled_cycles);
        let take_half = |h: HalfDuplexed| {
            *memo.lock().expect("placement memo lock") = h.placements;
            *sized.lock().expect("sizing memo lock") = h.sizings;
            *baselines.lock().expect("baseline memo lock") = h.baselines;
            // Its schedules, for the stage `schedules` (the memo holds the last round's).
            db.schedule_memo.lock().expect("phase memo lock").extend(h.schedules);
            let range = *range.lock().expect("rate range lock");
            tracing::info!(scheduled_cycles = chosen_cycles(&h.selection), "selected the program with half-duplex tiles");
            tracing::info!(lowest_link_bytes_per_second = range.low, highest_link_bytes_per_second = range.high, "the host pass decides alike over a range of host link rates: the selection holds for all of them");
            (h.selection, range)
        };
        for round in 0..=REPLANS {
            let candidates: &[Lowered] = replanned.as_deref().unwrap_or(&f.value);
            if round == 0 && db.keeps_beam_states() {
                // The last selection's entries, set aside for an edit undone (see
                // `previous_selection`), before the earlier ones (the oldest dropped); a
                // selection that left none sets nothing aside.
                let placements = std::mem::take(&mut *memo.lock().expect("placement memo lock"));
                if !placements.is_empty() {
                    let sizings = std::mem::take(&mut *sized.lock().expect("sizing memo lock"));
                    let baselines = std::mem::take(&mut *baselines.lock().expect("baseline memo lock"));
                    let mut previous = db.previous_selection.lock().expect("previous selection lock");
                    // Only the newest keeps its searches' validated tables (tens of megabytes
                    // each on a full chip): an older edit undone has lower_exchanges validate
                    // its tables, phase by phase through the validation memo.
                    if let Some(newest) = previous.front_mut() {
                        for searched in newest.placements.values_mut() {
                            if searched.validated.is_some() {
                                *searched = Arc::new(crate::exchange_placement::Searched { placement: searched.placement.clone(), conflicts: searched.conflicts, validated: None });
                            }
                        }
                    }
                    previous.push_front(crate::db::PreviousSelection { placements, sizings, baselines });
                    previous.truncate(crate::db::PREVIOUS_SELECTIONS);
                }
            }
            memo.lock().expect("placement memo lock").clear();
            sized.lock().expect("sizing memo lock").clear();
            baselines.lock().expect("baseline memo lock").clear();
            programs.lock().expect("program digests lock").clear();
            let failure = match select_finalist(&t.value, candidates, prepare, schedule, digest, (size, hard), keep_sizing, &keep_placement, optimize, Some(&db.relative_memo)) {
                Ok(mut s) => {
                    s.steered = steered.iter().map(|c| format!("{}: {}", c.operation, c.describe())).collect();
                    if let Some(h) = half.take() {
                        let (with_half, steered_cycles) = (chosen_cycles(&h.selection), chosen_cycles(&s));
                        tracing::info!(half_duplex_cycles = with_half, steered_cycles, "compared the program with half-duplex tiles and the steered one");
                        if with_half < steered_cycles {
                            return Ok(take_half(h));
                        }
                    }
                    if steered.is_empty() {
                        // The host pass of lower_mid's finalist: not stored again; `lowered`
                        // takes it from this process's memo, or derives it again.
                        if let Some(l) = s.lowered.take() {
                            let known = programs.lock().expect("program digests lock").get(&(s.chosen as usize)).copied();
                            let l = match known {
                                Some(digest) => Staged { digest, value: Arc::new(l) },
                                None => Staged::of(l)?,
                            };
                            *db.chosen_memo.lock().expect("chosen memo lock") = Some((chosen_key(f.digest, s.chosen, t.digest), l));
                        }
                    }
                    let range = *range.lock().expect("rate range lock");
                    tracing::info!(lowest_link_bytes_per_second = range.low, highest_link_bytes_per_second = range.high, "the host pass decides alike over a range of host link rates: the selection holds for all of them");
                    return Ok((s, range));
                }
                Err(e) => e,
            };
            let first_failure = &*first_failure.get_or_insert_with(|| failure.message.clone());
            let fail = |steered: &[crate::ir::PlanConstraint], last: &str| CompileError(steering_did_not_help(first_failure, steered, last));
            // Memory-element conflicts that placement cannot remove, on a finalist that fails
            // for nothing else: its schedules keep those tiles' sends and receives apart in
            // time (`Lowered::half_duplex`), a few more cycles in those phases. The tiles
            // gathered are placed again with the new schedules' table sizes, so more may turn
            // up: a few rounds. A plan is steered all the same (planning the whole program
            // again), since a steered plan can run faster still (one layer with its MLP
            // constrained to swapped: 359,677 cycles steered, 365,461 half-duplex, 360,863 the
            // program with its conflicts); the faster of the two is kept.
            let mut failure = failure;
            let mut pending = failure.conflicted.take();
            let mut rounds = 0;
            while let Some(c) = pending.take() {
                rounds += 1;
                let (program, added) = crate::lower::select::half_duplex(c.program, &c.tiles);
                if added == 0 || rounds > HALF_DUPLEX_ROUNDS {
                    break;
                }
                let phases: Vec<u32> = c.tiles.iter().map(|t| t.0).collect();
                tracing::info!(finalist = c.finalist, round = rounds, phases = ?phases, tiles = added, "memory-element conflicts remain after exchange placement: keeping these tiles' sends and receives apart in time");
                memo.lock().expect("placement memo lock").clear();
                sized.lock().expect("sizing memo lock").clear();
                baselines.lock().expect("baseline memo lock").clear();
                programs.lock().expect("program digests lock").clear();
                match select_finalist(&t.value, std::slice::from_ref(&program), |l| l, schedule, digest, (size, hard), keep_sizing, &keep_placement, optimize, Some(&db.relative_memo)) {
                    Ok(mut s) => {
                        // The program is not the host pass of a finalist: it goes with the
                        // selection (`lowered`).
                        s.chosen = c.finalist;
                        for costed in &mut s.costed {
                            costed.finalist = c.finalist;
                        }
                        s.failures.clear();
                        s.steered = steered.iter().map(|c| format!("{}: {}", c.operation, c.describe())).collect();
                        tracing::info!(round = rounds, scheduled_cycles = chosen_cycles(&s), "half-duplex tiles made the program placeable; steering a plan too, to keep the faster");
                        // A steered program that needed half-duplex tiles too and runs no
                        // faster than the one in hand ends the steering: each further steer
                        // halves another axis, away from the plans the planner prefers, and
                        // lowers the whole program again (22 BERT-large-sized layers: eight
                        // more rounds of about 75 s, each program slower than the last,
                        // 2,204,036 to 2,260,969 cycles against the first's 2,180,961).
                        if let Some(h) = half.take_if(|h| chosen_cycles(&s) >= chosen_cycles(&h.selection)) {
                            tracing::info!(round, half_duplex_cycles = chosen_cycles(&h.selection), steered_cycles = chosen_cycles(&s), "the steered program needs half-duplex tiles too and runs no faster: steering no further");
                            return Ok(take_half(h));
                        }
                        // (Faster than the one in hand, or the first.)
                        half = Some(HalfDuplexed {
                            selection: s,
                            placements: memo.lock().expect("placement memo lock").clone(),
                            sizings: sized.lock().expect("sizing memo lock").clone(),
                            baselines: baselines.lock().expect("baseline memo lock").clone(),
                            schedules: db.schedule_memo.lock().expect("phase memo lock").clone(),
                        });
                        break;
                    }
                    Err(e) => {
                        tracing::info!(round = rounds, reason = %e.message, "half-duplex tiles did not make the program placeable");
                        pending = e.conflicted.map(|mut next| {
                            next.finalist = c.finalist;
                            next
                        });
                    }
                }
            }
            // Steer the plans blamed in the best finalist (the first one blamed).
            let Some(first) = failure.blamed.first().map(|b| b.0) else {
                return match half.take() {
                    Some(h) => Ok(take_half(h)),
                    None => Err(fail(&steered, &failure.message)),
                };
            };
            let mut changed = false;
            for (finalist, plan, why) in failure.blamed.iter().filter(|b| b.0 == first) {
                let Some(p) = candidates[*finalist as usize].plans.get(*plan as usize) else { continue };
                let user = g.value.file.constraints.iter().find(|c| c.operation == p.value);
                let Some(c) = crate::lower::select::steer_away(p, user) else { continue };
                if round == REPLANS {
                    break;
                }
                let [b, r, col, i] = p.partitions;
                let Some(next) = steered_with(&steered, &c, &tried) else {
                    tracing::info!(operation = %p.value, partitions = %format!("[{b},{r},{col},{i}]"), constraint = %c.describe(), "no finalist can be placed; steering this operation so would plan again with constraints already tried: not steered");
                    continue;
                };
                tracing::info!(operation = %p.value, partitions = %format!("[{b},{r},{col},{i}]"), reason = %why, constraint = %c.describe(), "no finalist can be placed: planning the operation again, steered away from its plan");
                steered = next;
                changed = true;
            }
            if !changed {
                return match half.take() {
                    Some(h) => Ok(take_half(h)),
                    None => Err(fail(&steered, &failure.message)),
                };
            }
            tried.push(sorted_by_operation(&steered));
            let mut graph = (*g.value).clone();
            graph.file.constraints.retain(|c| !steered.iter().any(|s| s.operation == c.operation));
            graph.file.constraints.extend(steered.iter().cloned());
            // A finalist lowered under a replication cap is lowered again alone with it (the
            // whole search would end with the same program); others by the whole search.
            let again = match search::relower_capped(&graph, &lt.value, &candidates[first as usize]) {
                Some(l) => Ok(vec![l]),
                // A program with half-duplex tiles is in hand: the re-plan is worth only a
                // program that fits as planned (one that does not would need steering again,
                // away from the plans the planner prefers), and the last resort of smaller
                // operand blocks is not tried for it.
                None if half.is_some() => match search::finalists_that_fit(&graph, &lt.value, k) {
                    Ok(Some(found)) => Ok(found),
                    Ok(None) => {
                        tracing::info!(round, "the program planned again to run faster than the one with half-duplex tiles does not fit tile memory; keeping that one");
                        return Ok(take_half(half.take().expect("a program with half-duplex tiles")));
                    }
                    Err(e) => Err(CompileError::from(e)),
                },
                None => search::finalists(&graph, &lt.value, k).map_err(CompileError::from),
            };
            replanned = Some(match (again, half.take()) {
                (Ok(again), h) => {
                    half = h;
                    again
                }
                (Err(_), Some(h)) => return Ok(take_half(h)),
                (Err(e), None) => return Err(fail(&steered, &e.0)),
            });
        }
        match half.take() {
            Some(h) => Ok(take_half(h)),
            None => Err(CompileError("no finalist can be placed".into())),
        }
    })
}

/// The chosen finalist's program, as select_finalist prepared and costed it (host replicas
/// moved to exchange phases by `lower/host.rs`): what every later stage works on.
#[salsa::tracked(returns(clone))]
pub fn lowered(db: &dyn Db, sources: Sources) -> StageResult<Lowered> {
    let s = selection(db, sources)?;
    match &s.value.lowered {
        Some(l) => Staged::of(l.clone()),
        None => {
            // The program select_finalist costed: the host pass of the chosen finalist, at a
            // link rate in the range the selection holds for (the same decisions); the one
            // select_finalist prepared, when it ran in this process for these inputs.
            let f = finalists(db, sources)?;
            let t = selection_target(db, sources)?;
            let key = chosen_key(f.digest, s.value.chosen, t.digest);
            let taken = db.ipuq().chosen_memo.lock().expect("chosen memo lock").take();
            if let Some((_, l)) = taken.filter(|(k, _)| *k == key && !db.ipuq().verifying()) {
                // With the digest select_finalist computed of the same program.
                return Ok(l);
            }
            let Some(chosen) = f.value.get(s.value.chosen as usize) else { return Err(CompileError(format!("the selection chose finalist {} of {}", s.value.chosen, f.value.len()))) };
            Staged::of(crate::lower::host::replicate(chosen.clone(), &t.value))
        }
    }
}

/// Key of the chosen program select_finalist prepared: the finalists, the one chosen, and the
/// selection view its host pass read.
fn chosen_key(finalists: Digest, chosen: u32, selection_view: Digest) -> Digest {
    KeyHasher::new("ipuq chosen program v1").add(&finalists).add(&chosen).add(&selection_view).finish()
}

/// The exchange requests of every phase, with addresses from `address(buffer, offset)`
/// (phases written in parallel, collected in order).
pub fn requests(lowered: &Lowered, address: impl Fn(u32, u32) -> u32 + Sync) -> Vec<PhaseRequest> {
    (0..lowered.phases.len()).into_par_iter().map(|index| phase_request(lowered, index, &address)).collect()
}

/// Phase `index`'s exchange request, with addresses from `address(buffer, offset)`.
pub fn phase_request<F: Fn(u32, u32) -> u32 + ?Sized>(lowered: &Lowered, index: usize, address: &F) -> PhaseRequest {
    let mut request = transfers_request(index, &lowered.phases[index], |buffer| lowered.buffers[buffer as usize].tile, address);
    if let Ok(at) = lowered.half_duplex.binary_search_by_key(&(index as u32), |h| h.0) {
        request.half_duplex = lowered.half_duplex[at].1.clone();
    }
    request
}

/// The exchange request of `transfers` as phase `index`, each buffer on tile `tile(buffer)`,
/// with addresses from `address(buffer, offset)` (`phase_request`; also for the phases of a
/// program still being lowered).
pub fn transfers_request<F: Fn(u32, u32) -> u32 + ?Sized>(index: usize, transfers: &[crate::lower::Transfer], tile: impl Fn(u32) -> u32, address: &F) -> PhaseRequest {
    PhaseRequest {
        index: index as u32,
        transfers: transfers
            .iter()
            .map(|t| exchange::Transfer {
                source: tile(t.source.0),
                source_address: address(t.source.0, t.source.1),
                words: t.words,
                destinations: t.destinations.iter().map(|d| Destination { tile: tile(d.0), address: address(d.0, d.1) }).collect(),
            })
            .collect(),
        half_duplex: Vec::new(),
    }
}

/// A program's exchange requests with addresses `bases[buffer] + offset`, each made the first
/// time it is asked for. A stage whose per-phase entries are found in a memo or the cache needs
/// only their keys, and `request_digest` and `pattern_digest` stream those from the program:
/// the same digests as those of the made request, without allocating every transfer (a
/// four-block MLP's 325,000) and freeing it again.
pub struct LazyRequests<'a> {
    lowered: &'a Lowered,
    bases: &'a [u32],
    made: Vec<std::sync::OnceLock<PhaseRequest>>,
}

impl<'a> LazyRequests<'a> {
    pub fn new(lowered: &'a Lowered, bases: &'a [u32]) -> Self {
        LazyRequests { lowered, bases, made: (0..lowered.phases.len()).map(|_| std::sync::OnceLock::new()).collect() }
    }

    /// Number of phases.
    pub fn len(&self) -> usize {
        self.made.len()
    }

    /// Whether the program has no exchange phase.
    pub fn is_empty(&self) -> bool {
        self.made.is_empty()
    }

    /// Phase `i`'s request (`phase_request`), made on first use.
    pub fn get(&self, i: usize) -> &PhaseRequest {
        self.made[i].get_or_init(|| phase_request(self.lowered, i, &|buffer, offset| self.address((buffer, offset))))
    }

    fn tile(&self, buffer: u32) -> u32 {
        self.lowered.buffers[buffer as usize].tile
    }

    fn address(&self, (buffer, offset): (u32, u32)) -> u32 {
        self.bases[buffer as usize] + offset
    }

    /// `request_digest(self.get(i))`, streamed from the program.
    pub fn request_digest(&self, i: usize) -> Digest {
        let phase = &self.lowered.phases[i];
        let mut h = KeyHasher::new(REQUEST_DOMAIN);
        h.add(&(i as u32)).add(&phase.len());
        for t in phase.iter() {
            h.add(&self.tile(t.source.0)).add(&self.address(t.source)).add(&t.words).add(&t.destinations.len());
            for &d in &t.destinations {
                h.add(&self.tile(d.0)).add(&self.address(d));
            }
        }
        h.finish()
    }

    /// `exchange::pattern_digest(self.get(i))`, streamed from the program.
    pub fn pattern_digest(&self, i: usize) -> Digest {
        let phase = &self.lowered.phases[i];
        let mut h = KeyHasher::new(exchange::PATTERN_DOMAIN);
        h.add(&(phase.len() as u64));
        for t in phase.iter() {
            let class = exchange::alignment_class_of(self.address(t.source), t.destinations.iter().map(|&d| self.address(d)));
            h.add(&self.tile(t.source.0)).add(&t.words).add(&class).add(&(t.destinations.len() as u64));
            for &d in &t.destinations {
                h.add(&self.tile(d.0));
            }
        }
        if let Ok(at) = self.lowered.half_duplex.binary_search_by_key(&(i as u32), |h| h.0) {
            exchange::hash_half_duplex(&mut h, &self.lowered.half_duplex[at].1);
        }
        h.finish()
    }
}

/// Every phase of `programs` as (program, phase), programs in order, each one's phases in order.
pub fn flat_phases(programs: &[LazyRequests]) -> Vec<(usize, usize)> {
    programs.iter().enumerate().flat_map(|(k, p)| (0..p.len()).map(move |i| (k, i))).collect()
}

/// A non-overlapping provisional base address for every buffer (per tile, 16-byte aligned).
pub fn provisional_bases(lowered: &Lowered) -> Vec<u32> {
    let mut bases = ProvisionalBases::default();
    bases.extend(lowered.buffers.iter());
    bases.bases
}

/// `provisional_bases` made as buffers are declared: a buffer's base depends only on the
/// buffers declared before it, so the bases of a program's first buffers are those of any
/// program it grows into.
#[derive(Clone, Debug, Default)]
pub struct ProvisionalBases {
    /// Per buffer so far, its base.
    pub bases: Vec<u32>,
    /// Per tile, the next free byte.
    next: Vec<u64>,
}

impl ProvisionalBases {
    /// The bases of the next buffers, in declaration order.
    pub fn extend<'a>(&mut self, buffers: impl IntoIterator<Item = &'a crate::lower::BufferDecl>) {
        for b in buffers {
            let tile = b.tile as usize;
            if self.next.len() <= tile {
                self.next.resize(tile + 1, 0);
            }
            let base = self.next[tile];
            self.next[tile] = (base + b.bytes as u64).div_ceil(16) * 16;
            self.bases.push(base.min(u32::MAX as u64) as u32);
        }
    }
}

/// Every phase's schedule, with each schedule's digest (the key of its tables).
#[derive(Clone, Debug)]
pub struct Schedules {
    pub phases: Vec<Schedule>,
    pub digests: Vec<Digest>,
}

/// Schedule every phase, one entry per distinct pattern (`phases.rs`): identical patterns in
/// one build are scheduled once, in parallel, with or without a disk cache.
#[salsa::tracked(returns(clone))]
pub fn schedules(db: &dyn Db, sources: Sources) -> StageResult<Schedules> {
    let t = exchange_target(db, sources)?;
    let l = lowered(db, sources)?;
    // Provisional addresses: every buffer gets its own 16-byte aligned range in a per-tile
    // address space, so rows of different buffers never alias and alignment classes match
    // the final placement (which also aligns every buffer to at least 8 bytes).
    let provisional = provisional_bases(&l.value);
    // The other finalists select_finalist scheduled ride along (found in the memo), so the
    // memo keeps them for the next build's selection.
    let s = selection(db, sources)?;
    let f = finalists(db, sources)?;
    let full = selection_target(db, sources)?;
    // (After a re-plan, or with half-duplex tiles, the chosen program is not the host pass of
    // one of these finalists: `lowered` holds it, and the others were not scheduled.)
    let mut others: Vec<(Lowered, Vec<u32>)> = Vec::new();
    for (i, other) in f.value.iter().enumerate().filter(|_| s.value.steered.is_empty() && s.value.lowered.is_none()) {
        let skipped = s.value.failures.iter().any(|x| x.0 == i as u32 && x.1.starts_with("not costed"));
        if i as u32 != s.value.chosen && !skipped {
            let other = crate::lower::host::replicate(other.clone(), &full.value);
            let bases = provisional_bases(&other);
            others.push((other, bases));
        }
    }
    // Requests are made only for the phases whose schedule is neither in the memo nor cached.
    let programs: Vec<LazyRequests> = std::iter::once(LazyRequests::new(&l.value, &provisional)).chain(others.iter().map(|(o, b)| LazyRequests::new(o, b))).collect();
    let phases = flat_phases(&programs);
    let chosen_phases = programs[0].len();
    let db = db.ipuq();
    let patterns: Vec<Digest> = phases.par_iter().map(|&(k, i)| programs[k].pattern_digest(i)).collect();
    let keys: Vec<Digest> = patterns.iter().map(|p| db.key("exchange_schedule", SCHEDULE_VERSION, &[t.digest, *p])).collect();
    let target = &t.value;
    let mut entries = per_phase(db, "exchange_schedule", SCHEDULE_VERSION, &keys, &db.schedule_memo, |j| {
        let (k, i) = phases[j];
        exchange::schedule_phase(target, programs[k].get(i)).map_err(CompileError::from)
    })?;
    entries.truncate(chosen_phases);
    let value = Schedules { phases: entries.iter().map(|e| (*e.value).clone()).collect(), digests: entries.iter().map(|e| e.digest).collect() };
    Ok(Staged { digest: combined("ipuq schedules v2", &entries), value: Arc::new(value) })
}

/// Digest of a phase's buffers per tile (`sizing::phase_buffers`).
fn buffers_digest(buffers: &crate::tables::PhaseBuffers) -> Digest {
    let mut h = KeyHasher::new("ipuq phase buffers v1");
    h.add(&buffers.len());
    for (tile, list) in buffers {
        h.add(tile).add(&list.len());
        for (start, bytes) in list {
            h.add(start).add(bytes);
        }
    }
    h.finish()
}

/// Key domain of `request_digest` (and of `LazyRequests::request_digest`, which streams the same bytes).
const REQUEST_DOMAIN: &str = "ipuq exchange request v1";

/// Digest of a phase request with its addresses (what lower_exchanges reads of it): the
/// definition `LazyRequests::request_digest` streams (the pipeline keys phases by that one).
#[cfg(test)]
fn request_digest(request: &PhaseRequest) -> Digest {
    let mut h = KeyHasher::new(REQUEST_DOMAIN);
    h.add(&request.index).add(&request.transfers.len());
    for t in &request.transfers {
        h.add(&t.source).add(&t.source_address).add(&t.words).add(&t.destinations.len());
        for d in &t.destinations {
            h.add(&d.tile).add(&d.address);
        }
    }
    h.finish()
}

/// `exchange_placement::checked_tables` over the exchange view (`target` is a view holding its
/// grid and delays, all the checks read of it; `exchange` is its digest), remembering per
/// phase the tables that validated: a phase's key holds the exchange view, its schedule's
/// digest and its request with addresses (what its tables are written from), so an edit
/// re-validates only the phases whose addresses or schedule moved. The entry is the phase's
/// horizon; the first failing phase's error is `checked_tables`'s. Tables on demand
/// (`Tables::OnDemand`) are written only for the phases validated (and the first phases of
/// their schedules that carry them); the others are absent from the result.
fn checked_tables_memoized(
    (db, memo): (&StageCache, &crate::phases::Memo<u32>),
    exchange: Digest,
    target: &crate::target::Target,
    lowered: &Lowered,
    (schedules, digests): (&[Schedule], &[Digest]),
    placement: &Placement,
    tables: Tables,
) -> Result<Validated, CompileError> {
    let addresses = &placement.addresses;
    // Requests are made only for the phases validated (a phase found in the memo is not).
    let requests = LazyRequests::new(lowered, addresses);
    let count = match &tables {
        Tables::Written(written) => written.len(),
        Tables::OnDemand(_) => requests.len(),
    };
    if count != requests.len() || schedules.len() != requests.len() || digests.len() != requests.len() {
        return Err(CompileError(format!("{count} tables and {} schedules for {} exchange phases", schedules.len(), requests.len())));
    }
    let made: Vec<std::sync::OnceLock<Result<ExchangePhase, CompileError>>> = (0..requests.len()).map(|_| std::sync::OnceLock::new()).collect();
    let table = |i: usize| -> Result<&ExchangePhase, CompileError> {
        match &tables {
            Tables::Written(written) => Ok(&written[i]),
            Tables::OnDemand(write) => made[i].get_or_init(|| write(i)).as_ref().map_err(Clone::clone),
        }
    };
    let keys: Vec<Digest> = digests.par_iter().enumerate().map(|(i, d)| db.key("exchange_validation", TABLES_VERSION, &[exchange, *d, requests.request_digest(i)])).collect();
    // Phases of one schedule (the same phase of repeated layers): the first is validated, and
    // another that is the first moved buffer by buffer (`exchange::moved_alike`) validates
    // exactly when the first does, so it is not validated again once the first has.
    let first = first_of_schedule(digests);
    let buffers: Vec<std::sync::OnceLock<crate::tables::PhaseBuffers>> = (0..requests.len()).map(|_| std::sync::OnceLock::new()).collect();
    let buffers_of = |i: usize| buffers[i].get_or_init(|| crate::sizing::phase_buffers(lowered, i, addresses)).as_slice();
    let validate = |i: usize| {
        let t = table(i)?;
        exchange::check_relocated(target, requests.get(i), &schedules[i], t).map(|()| t.horizon).map_err(CompileError::from)
    };
    let outcomes: Vec<std::sync::OnceLock<Result<u32, CompileError>>> = (0..requests.len()).map(|_| std::sync::OnceLock::new()).collect();
    let carried = std::sync::atomic::AtomicUsize::new(0);
    per_phase(db, "exchange_validation", TABLES_VERSION, &keys, memo, |i| {
        let f = first[i];
        if f == i {
            return outcomes[i].get_or_init(|| validate(i)).clone();
        }
        let first_valid = outcomes[f].get_or_init(|| validate(f)).is_ok();
        if first_valid && exchange::moved_alike((requests.get(f), table(f)?, buffers_of(f)), (requests.get(i), table(i)?, buffers_of(i))) {
            carried.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(table(i)?.horizon);
        }
        validate(i)
    })?;
    let written_now = made.iter().filter(|m| m.get().is_some()).count();
    tracing::debug!(phases = requests.len(), carried = carried.into_inner(), written_now, "validated exchange tables (carried: the tables of a phase moved buffer by buffer from a validated one; written now: of tables on demand)");
    Ok(match tables {
        Tables::Written(written) => written.into_iter().map(Some).collect(),
        Tables::OnDemand(_) => made.into_iter().map(|m| m.into_inner().and_then(Result::ok)).collect(),
    })
}

/// `size_tile_code`: support memory per tile with each tile's compact exchange tables encoded
/// as its image will hold them (`sizing.rs`), within the per-tile table budget.
#[salsa::tracked(returns(clone))]
pub fn code_sizes(db: &dyn Db, sources: Sources) -> StageResult<Vec<u32>> {
    let t = memory_target(db, sources)?;
    let x = exchange_target(db, sources)?;
    let l = lowered(db, sources)?;
    let s = schedules(db, sources)?;
    let budget = db.ipuq().table_budget();
    let key = db.ipuq().key("size_tile_code", CODE_VERSION, &[t.digest, x.digest, l.digest, s.digest, KeyHasher::new("table budget").add(&budget).finish()]);
    let db = db.ipuq();
    db.cached("size_tile_code", CODE_VERSION, key, || {
        // select_finalist sized the chosen finalist (same exchange view, program, schedules
        // and budget: same key) unless the selection came from the cache.
        let found = selected(db, &db.sizing_memo, &sizing_key(x.digest, l.digest, &s.value.digests, budget), |p| &p.sizings);
        let support = match found {
            Some(support) => support,
            // (No budget here: select_finalist judged it, keeping a program over it only
            // where the program places with its tables.)
            None => Arc::new(crate::sizing::support_with_tables(&x.value, &l.value, &s.value.phases, Some(&s.value.digests), u32::MAX).map_err(CompileError)?),
        };
        log_support_memory(&t.value, &support);
        Ok(support.iter().map(SupportMemory::total).collect())
    })
}

#[salsa::tracked(returns(clone))]
pub fn placement(db: &dyn Db, sources: Sources) -> StageResult<Placement> {
    let t = memory_target(db, sources)?;
    let l = lowered(db, sources)?;
    let c = code_sizes(db, sources)?;
    let key = db.ipuq().key("place_storage", PLACE_VERSION, &[t.digest, l.digest, c.digest]);
    let db = db.ipuq();
    db.cached("place_storage", PLACE_VERSION, key, || {
        // select_finalist placed the chosen finalist (same memory view, program and code
        // bytes: same key) unless the selection came from the cache.
        let found = selected(db, &db.baseline_memo, &baseline_key(t.digest, l.digest, c.digest), |p| &p.baselines);
        match found {
            Some(placement) => Ok((*placement).clone()),
            None => place_storage(&t.value, &l.value, &c.value).map_err(CompileError::from),
        }
    })
}

/// What `select_finalist` left under `key` in `memo` for a later stage, else what a
/// selection before it left there (`Database::previous_selection`, read through `previous`,
/// the newest first); nothing when the cache is being verified (the stage then computes).
fn selected<V: Clone>(db: &Database, memo: &std::sync::Mutex<std::collections::HashMap<Digest, V>>, key: &Digest, previous: impl Fn(&crate::db::PreviousSelection) -> &std::collections::HashMap<Digest, V>) -> Option<V> {
    if db.verifying() {
        return None;
    }
    let current = memo.lock().expect("selection memo lock").get(key).cloned();
    current.or_else(|| db.previous_selection.lock().expect("previous selection lock").iter().find_map(|p| previous(p).get(key).cloned()))
}

/// Key of a program's baseline placement (`place_storage`): the memory view, the program and
/// the code bytes per tile (all placement reads).
fn baseline_key(memory: Digest, lowered: Digest, code: Digest) -> Digest {
    KeyHasher::new("ipuq baseline placement v1").add(&memory).add(&lowered).add(&code).finish()
}

/// `optimize_exchange_placement`: keyed by the lowering view of the target (it reads memory
/// elements, delays and costs), the lowered program, the schedules, the code sizes and the
/// placement it starts from.
#[salsa::tracked(returns(clone))]
pub fn placed(db: &dyn Db, sources: Sources) -> StageResult<Placement> {
    let t = lowering_target(db, sources)?;
    let x = exchange_target(db, sources)?;
    let l = lowered(db, sources)?;
    let s = schedules(db, sources)?;
    let c = code_sizes(db, sources)?;
    let p = placement(db, sources)?;
    let key = db.ipuq().key("optimize_exchange_placement", OPTIMIZE_PLACEMENT_VERSION, &[t.digest, l.digest, s.digest, c.digest, p.digest]);
    let db = db.ipuq();
    db.cached("optimize_exchange_placement", OPTIMIZE_PLACEMENT_VERSION, key, || {
        // select_finalist ran this search on the chosen finalist (same view, program,
        // schedules, code and baseline: same key) unless the selection came from the cache.
        let search = placement_search_key(t.digest, l.digest, &s.value.digests, c.digest, p.digest);
        let found = selected(db, &db.placement_memo, &search, |p| &p.placements);
        let searched = match found {
            Some(s) => s,
            None => Arc::new(search_exchange_placement(&t.value, &l.value, &s.value.phases, &c.value, &p.value)?),
        };
        let placement = check_placement(searched.placement.clone(), searched.conflicts)?;
        // The accepted placement's tables (or the baseline's, when select_finalist handed them
        // over), validated by the search (over the lowering view, whose grid and delays are the
        // exchange view's), for lower_exchanges.
        if let (Some(tables), false) = (&searched.validated, db.verifying()) {
            let key = validated_key(x.digest, l.digest, &s.value.digests, digest_of(&placement)?);
            *db.validated_memo.lock().expect("validated memo lock") = Some((key, tables.clone()));
        }
        Ok(placement)
    })
}

/// Key of a program's validated exchange tables: the exchange view, the program, each phase's
/// schedule and the final placement (what decides every table word).
fn validated_key(exchange: Digest, lowered: Digest, schedules: &[Digest], placement: Digest) -> Digest {
    schedules_key("ipuq validated exchange tables v1", &[exchange, lowered], schedules, &[placement])
}

/// Key of a program's support memory (`sizing::support_checked` within `budget`): the exchange
/// view (grid and delays), the program and each phase's schedule.
fn sizing_key(exchange: Digest, lowered: Digest, schedules: &[Digest], budget: u32) -> Digest {
    schedules_key("ipuq support memory sizing v1", &[exchange, lowered], schedules, &[KeyHasher::new("table budget").add(&budget).finish()])
}

/// Key of an exchange-placement search: digests of everything it reads (the lowering view of
/// the target, the program, each phase's schedule, the code bytes, the baseline placement).
fn placement_search_key(target: Digest, lowered: Digest, schedules: &[Digest], code: Digest, baseline: Digest) -> Digest {
    schedules_key("ipuq exchange placement search v1", &[target, lowered], schedules, &[code, baseline])
}

/// An in-process key over some digests, every phase's schedule digest, then some more.
fn schedules_key(domain: &str, before: &[Digest], schedules: &[Digest], after: &[Digest]) -> Digest {
    let mut h = KeyHasher::new(domain);
    for d in before {
        h.add(d);
    }
    h.add(&schedules.len());
    for d in schedules.iter().chain(after) {
        h.add(d);
    }
    h.finish()
}

/// Patch final addresses into every phase's schedule and validate the tables, per phase: a
/// phase's key holds its schedule's digest and its request with addresses, so only phases
/// whose addresses (or schedule) moved are re-validated.
#[salsa::tracked(returns(clone))]
pub fn tables(db: &dyn Db, sources: Sources) -> StageResult<Vec<Arc<PackedPhase>>> {
    let t = exchange_target(db, sources)?;
    let l = lowered(db, sources)?;
    let s = schedules(db, sources)?;
    let p = placed(db, sources)?;
    let addresses = &p.value.addresses;
    // Requests are made only for the phases written again (a phase found in the memo is not).
    let requests = LazyRequests::new(&l.value, addresses);
    let db = db.ipuq();
    let digests: Vec<Digest> = (0..requests.len()).into_par_iter().map(|i| requests.request_digest(i)).collect();
    // Each phase's buffers per tile (its tables' base slots and the bounds its runs are cut at).
    let buffers: Vec<crate::tables::PhaseBuffers> = (0..requests.len()).into_par_iter().map(|i| crate::sizing::phase_buffers(&l.value, i, addresses)).collect();
    let keys: Vec<Digest> = digests
        .iter()
        .zip(&s.value.digests)
        .zip(&buffers)
        .map(|((r, sd), b)| db.key("lower_exchanges", TABLES_VERSION, &[t.digest, *sd, *r, buffers_digest(b)]))
        .collect();
    let (target, schedules) = (&t.value, &s.value.phases);
    // Tables optimize_exchange_placement's search already validated for these addresses.
    let validated = match db.verifying() {
        true => None,
        false => {
            let key = validated_key(t.digest, l.digest, &s.value.digests, p.digest);
            db.validated_memo.lock().expect("validated memo lock").take().filter(|v| v.0 == key && v.1.len() == requests.len()).map(|v| v.1)
        }
    };
    // Phases of one schedule (the same phase of repeated layers) are packed once: the first
    // one's packing is moved to another's buffers where its validated tables are the first
    // one's moved buffer by buffer (`tables::rebased_phase`: the packing `pack_phase` gives),
    // else that phase is packed too.
    let first = first_of_schedule(&s.value.digests);
    let mut sharing = vec![0usize; first.len()];
    first.iter().for_each(|&f| sharing[f] += 1);
    let packed_first: Vec<std::sync::OnceLock<Result<PackedPhase, String>>> = (0..requests.len()).map(|_| std::sync::OnceLock::new()).collect();
    let moved = std::sync::atomic::AtomicUsize::new(0);
    // A phase whose validated tables were not written (a rebuilding process writes only
    // those its check read, `Tables::OnDemand`) is relocated and validated again here, as
    // without validated tables.
    let entries = per_phase(db, "lower_exchanges", TABLES_VERSION, &keys, &db.tables_memo, |i| match validated.as_ref().and_then(|v| Some((v, v[i].as_ref()?))) {
        Some((tables, table)) => {
            exchange::log_validated(i as u32, &schedules[i], table);
            let f = first[i];
            // A schedule of one phase is packed alone, not kept for others; so is a phase
            // whose first phase's tables were not written.
            let Some(first_table) = tables[f].as_ref().filter(|_| sharing[f] > 1) else {
                return crate::tables::pack_phase(table, &buffers[i]).map_err(CompileError);
            };
            let packed = packed_first[f].get_or_init(|| crate::tables::pack_phase(first_table, &buffers[f]));
            if f == i {
                return packed.clone().map_err(CompileError);
            }
            match packed.as_ref().ok().and_then(|p| crate::tables::rebased_phase((first_table, &buffers[f], p), table, &buffers[i])) {
                Some(p) => {
                    moved.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Ok(p)
                }
                None => crate::tables::pack_phase(table, &buffers[i]).map_err(CompileError),
            }
        }
        None => exchange::reuse(target, requests.get(i), &schedules[i]).map_err(CompileError::from).and_then(|p| crate::tables::pack_phase(&p, &buffers[i]).map_err(CompileError)),
    })?;
    tracing::debug!(phases = entries.len(), moved = moved.into_inner(), "packed exchange tables (moved: a phase of the same schedule's packing, moved to this phase's buffers)");
    Ok(Staged { digest: combined("ipuq exchange tables v3", &entries), value: Arc::new(entries.iter().map(|e| e.value.clone()).collect()) })
}

/// `build_tile_images`: every tile's image from its own input (`emit::TileInput`: its placed
/// calls, allocations, exchange tables, host records and code range), keyed by that input's
/// digest and kept in the in-process memo, so an edit rebuilds only the tiles whose content it
/// changed, and tiles with equal content are built once; the images are built in parallel
/// over plain data and assembled (shared segments pooled) serially in tile order.
#[salsa::tracked(returns(clone))]
pub fn package(db: &dyn Db, sources: Sources) -> StageResult<Package> {
    let t = target(db, sources)?;
    let g = graph(db, sources)?;
    let l = lowered(db, sources)?;
    let p = placed(db, sources)?;
    let x = tables(db, sources)?;
    // The package embeds the workload text (initialisers included): reading the input makes
    // an initialiser edit re-run this stage although the graph's structure digest backdates.
    let _ = sources.workload_text(db);
    let db = db.ipuq();
    // The seed cleared the padding of finite GEMM operands and then dropped the clears that
    // load-time SRAM initialisation made redundant. ipuq's matrix-product splits are exact
    // (no padded rows or columns), so it emits no padding clear to remove.
    tracing::info!(removed = 0u32, "eliminated finite GEMM padding clears using load-time SRAM initialization");
    let inputs = tile_inputs(&l.value, &p.value, &x.value)?;
    let digests: Vec<Digest> = inputs.par_iter().map(|i| i.digest()).collect::<Result<_, _>>()?;
    let keys: Vec<Digest> = digests.iter().map(|d| db.key("tile_image", PACKAGE_VERSION, &[*d])).collect();
    let (images, counts) = per_tile(db, "tile_image", PACKAGE_VERSION, &keys, &db.tile_memo, |i| build_tile(i, &inputs[i]))?;
    tracing::info!(tiles = counts.entries, distinct = counts.distinct, reused = counts.reused, computed = counts.computed, "built tile images");
    db.note_tile_images(counts);
    let bodies: Vec<&TileBody> = images.iter().map(|e| &*e.value).collect();
    // Not stored in the disk cache: its one copy on disk is the output file, which the
    // driver's build record (below) finds unchanged without running any stage.
    db.unstored("build_tile_images", assemble_package(&t.value, &g.value, &l.value, &p.value, &x.value, &inputs, &bodies)?)
}

/// Each phase's version constant, in phase order (the golden test records them).
pub const VERSIONS: &[(&str, u32)] = &[
    ("lower_mid", LOWER_VERSION),
    ("select_finalist", SELECT_VERSION),
    ("lower_exchanges_provisional", SCHEDULE_VERSION),
    ("size_tile_code", CODE_VERSION),
    ("place_storage", PLACE_VERSION),
    ("optimize_exchange_placement", OPTIMIZE_PLACEMENT_VERSION),
    ("lower_exchanges", TABLES_VERSION),
    ("build_tile_images", PACKAGE_VERSION),
];

/// What the driver remembers of a whole build, keyed by the compiler fingerprint and the
/// exact input texts: the package file's leading bytes (its header holds the payload's blake3
/// and length) and size, and the figures the command line prints. A no-op rebuild whose output
/// file still starts with these bytes and has this size runs no stage and writes nothing.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct BuildRecord {
    pub file_head: Vec<u8>,
    pub file_len: u64,
    pub tiles: u32,
    pub estimated_cycles: u64,
}

const BUILD_RECORD: &str = "build_record";
const BUILD_RECORD_VERSION: u32 = 1;

fn build_record_key(db: &Database, workload_text: &str, target_text: &str) -> Digest {
    let inputs = [Digest::of_bytes(workload_text.as_bytes()), Digest::of_bytes(target_text.as_bytes())];
    db.key(BUILD_RECORD, BUILD_RECORD_VERSION ^ PACKAGE_VERSION << 8, &inputs)
}

/// The record of an earlier build of exactly these inputs by this compiler, if stored.
pub fn load_build_record(db: &Database, workload_text: &str, target_text: &str) -> Option<BuildRecord> {
    if db.verifying() {
        return None;
    }
    let key = build_record_key(db, workload_text, target_text);
    let bytes = db.store()?.load(BUILD_RECORD, &key, crate::db::schema(BUILD_RECORD, BUILD_RECORD_VERSION))?;
    rkyv::from_bytes::<BuildRecord, rkyv::rancor::Error>(&bytes).ok()
}

/// Remember a build of these inputs (nothing without a disk store).
pub fn store_build_record(db: &Database, workload_text: &str, target_text: &str, record: &BuildRecord) {
    let Some(store) = db.store() else { return };
    let key = build_record_key(db, workload_text, target_text);
    if let Ok(bytes) = rkyv::to_bytes::<rkyv::rancor::Error>(record) {
        store.store(BUILD_RECORD, &key, crate::db::schema(BUILD_RECORD, BUILD_RECORD_VERSION), &bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::sources;
    use crate::target::fixtures;

    /// Where steering ran and its last program failed otherwise, the error leads with why
    /// lower_mid's finalists could not be placed and names every steered operation; with no
    /// steer, or the same failure, it is the failure alone.
    #[test]
    fn a_failed_steer_keeps_the_first_failure() {
        let steer = |operation: &str, inner| crate::ir::PlanConstraint { operation: operation.into(), orientation: None, row_partitions: None, column_partitions: None, inner_partitions: Some(inner), weight_memory: None, weights: None };
        assert_eq!(steering_did_not_help("tile 0: full", &[], "tile 0: full"), "tile 0: full");
        assert_eq!(steering_did_not_help("tile 0: full", &[steer("a", 4)], "tile 0: full"), "tile 0: full");
        assert_eq!(
            steering_did_not_help("tile 0: full", &[steer("a", 4)], "tile 3: tables"),
            "tile 0: full; planning again with 1 operation steered away from its plan did not help: tile 3: tables (steered: a (inner_partitions=4))"
        );
        assert_eq!(
            steering_did_not_help("tile 0: full", &[steer("a", 4), steer("b", 2)], "tile 3: tables"),
            "tile 0: full; planning again with 2 operations steered away from their plans did not help: tile 3: tables (steered: a (inner_partitions=4), b (inner_partitions=2))"
        );
    }

    /// A steer replaces its operation's earlier constraint and goes last; a set of constraints
    /// already planned with, in whatever order it was built, is not planned with again (a
    /// product whose steers cycle back to an earlier constraint ends the steering).
    #[test]
    fn a_set_of_constraints_already_tried_is_not_planned_again() {
        let steer = |operation: &str, inner| crate::ir::PlanConstraint { operation: operation.into(), orientation: None, row_partitions: None, column_partitions: None, inner_partitions: Some(inner), weight_memory: None, weights: None };
        let tried = vec![sorted_by_operation(&[steer("up", 2)])];
        assert_eq!(steered_with(&[], &steer("up", 2), &tried), None, "the first round's set again");
        assert_eq!(steered_with(&[steer("up", 1)], &steer("up", 2), &tried), None, "back to it from a later steer of the same product");
        assert_eq!(steered_with(&[steer("up", 2)], &steer("up", 1), &tried), Some(vec![steer("up", 1)]));
        assert_eq!(steered_with(&[steer("up", 2), steer("q", 4)], &steer("up", 1), &tried), Some(vec![steer("q", 4), steer("up", 1)]), "replaced, and last");
        let tried = vec![sorted_by_operation(&[steer("up", 2), steer("q", 4)])];
        assert_eq!(tried[0], vec![steer("q", 4), steer("up", 2)]);
        assert_eq!(steered_with(&[steer("up", 2)], &steer("q", 4), &tried), None, "the same set built in another order");
        assert_eq!(steered_with(&[steer("up", 2)], &steer("q", 2), &tried), Some(vec![steer("up", 2), steer("q", 2)]));
    }

    /// Takes the memo's entry under `key` away (it must be there) and puts `altered` under each
    /// of `keys` (none of them `key`): a stage that reads the memo must then miss.
    fn only_under_other_keys<T: Clone>(memo: &std::sync::Mutex<HashMap<Digest, Arc<T>>>, key: Digest, keys: &[Digest], altered: &T) {
        let mut memo = memo.lock().unwrap();
        assert!(memo.remove(&key).is_some());
        for &k in keys {
            assert_ne!(k, key);
            memo.insert(k, Arc::new(altered.clone()));
        }
    }

    const WORKLOAD: &str = include_str!("../../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");

    /// A built program's sizing inputs: the exchange view's digest and value, the program, its
    /// schedules, and the key `size_tile_code` looks its sizing up by.
    fn sizing_inputs(db: &Database, s: Sources) -> (Staged<crate::target::Target>, Staged<Lowered>, Staged<Schedules>, Digest) {
        let (x, l, sch) = (exchange_target(db, s).unwrap(), lowered(db, s).unwrap(), schedules(db, s).unwrap());
        let key = sizing_key(x.digest, l.digest, &sch.value.digests, db.table_budget());
        (x, l, sch, key)
    }

    #[test]
    fn sizing_digest_streams_the_bytes_it_used_to_gather() {
        // The digest as it was computed: every word gathered in one buffer, hashed with its length.
        fn gathered(l: &Lowered) -> Digest {
            let mut words: Vec<u32> = vec![l.tiles, l.buffers.len() as u32];
            for b in &l.buffers {
                words.extend([b.tile, b.bytes]);
            }
            words.push(l.phases.len() as u32);
            for phase in &l.phases {
                words.push(phase.len() as u32);
                for t in phase.iter() {
                    words.extend([t.source.0, t.source.1, t.words, t.destinations.len() as u32]);
                    for d in &t.destinations {
                        words.extend([d.0, d.1]);
                    }
                }
            }
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            KeyHasher::new("ipuq table sizing input v1").bytes(&bytes).finish()
        }
        let db = Database::default();
        let s = sources(&db, WORKLOAD.into(), "mlp.toml".into(), fixtures::SMALL16.into(), "small16".into());
        let l = lowered(&db, s).unwrap();
        let program = (*l.value).clone();
        assert_eq!(crate::sizing::sizing_digest(&program), gathered(&program));
        assert!(crate::sizing::same_sizing_input(&program, &program));
        // What sizing reads changes both the digest and the comparison; what it does not, neither.
        let mut other = program.clone();
        other.buffers[0].first_step += 1;
        other.labels.push("unread".into());
        assert_eq!(crate::sizing::sizing_digest(&other), crate::sizing::sizing_digest(&program));
        assert!(crate::sizing::same_sizing_input(&program, &other));
        let mut moved = program.clone();
        moved.buffers[0].bytes += 16;
        assert_ne!(crate::sizing::sizing_digest(&moved), crate::sizing::sizing_digest(&program));
        assert!(!crate::sizing::same_sizing_input(&program, &moved));
        let mut rerouted = program.clone();
        let phase = std::sync::Arc::make_mut(rerouted.phases.iter_mut().find(|p| !p.is_empty()).expect("an exchange phase"));
        phase[0].words += 1;
        assert_eq!(crate::sizing::sizing_digest(&rerouted), gathered(&rerouted));
        assert_ne!(crate::sizing::sizing_digest(&rerouted), crate::sizing::sizing_digest(&program));
        assert!(!crate::sizing::same_sizing_input(&program, &rerouted));
    }

    /// The digests `LazyRequests` streams from a program are those of the requests it makes,
    /// for every phase, at provisional and placed addresses, with half-duplex tiles or without;
    /// and a request is made only when asked for.
    #[test]
    fn streamed_request_digests_are_those_of_the_made_requests() {
        let db = Database::default();
        let s = sources(&db, WORKLOAD.into(), "mlp.toml".into(), fixtures::SMALL16.into(), "small16".into());
        let (l, p) = (lowered(&db, s).unwrap(), placed(&db, s).unwrap());
        let mut half = (*l.value).clone();
        let phase = half.phases.iter().position(|p| !p.is_empty()).expect("an exchange phase") as u32;
        half.half_duplex = vec![(phase, vec![0, 3])];
        let provisional = provisional_bases(&l.value);
        for (program, bases) in [(&*l.value, &provisional), (&*l.value, &p.value.addresses), (&half, &p.value.addresses)] {
            let made = requests(program, |b, o| bases[b as usize] + o);
            let lazy = LazyRequests::new(program, bases);
            assert_eq!(lazy.len(), made.len());
            assert!(made.iter().any(|r| !r.transfers.is_empty()));
            for (i, r) in made.iter().enumerate() {
                assert_eq!(lazy.request_digest(i), request_digest(r), "phase {i}");
                assert_eq!(lazy.pattern_digest(i), exchange::pattern_digest(r), "phase {i}");
            }
            assert!(lazy.made.iter().all(|m| m.get().is_none()), "digests made no request");
            for (i, r) in made.iter().enumerate() {
                assert_eq!(lazy.get(i), r);
            }
        }
        // The half-duplex tiles enter the pattern, not the request digest.
        let (plain, halved) = (LazyRequests::new(&l.value, &p.value.addresses), LazyRequests::new(&half, &p.value.addresses));
        assert_ne!(plain.pattern_digest(phase as usize), halved.pattern_digest(phase as usize));
        assert_eq!(plain.request_digest(phase as usize), halved.request_digest(phase as usize));
        // An address that moves changes the request digest, and the pattern only with its class.
        let first = l.value.phases[phase as usize][0].source.0 as usize;
        let mut moved = p.value.addresses.clone();
        moved[first] += 16;
        let shifted = LazyRequests::new(&l.value, &moved);
        assert_ne!(shifted.request_digest(phase as usize), plain.request_digest(phase as usize));
        assert_eq!(shifted.pattern_digest(phase as usize), plain.pattern_digest(phase as usize));
    }

    #[test]
    fn exchange_rules_pair_what_sorting_every_role_paired() {
        // The opposites as they were found: every (tile, role, buffer) of a phase sorted whole.
        fn sorted_whole(l: &Lowered) -> (Vec<Vec<u32>>, Vec<bool>) {
            let mut opposites: Vec<Vec<u32>> = vec![Vec::new(); l.buffers.len()];
            let mut receives = vec![false; l.buffers.len()];
            for phase in &l.phases {
                let mut roles: Vec<(u32, u8, u32)> = Vec::new();
                for t in phase.iter() {
                    roles.push((l.buffers[t.source.0 as usize].tile, 0, t.source.0));
                    for d in &t.destinations {
                        roles.push((l.buffers[d.0 as usize].tile, 1, d.0));
                        receives[d.0 as usize] = true;
                    }
                }
                roles.sort_unstable();
                roles.dedup();
                for group in roles.chunk_by(|a, b| a.0 == b.0) {
                    let (senders, receivers) = group.split_at(group.partition_point(|r| r.1 == 0));
                    for s in senders {
                        for r in receivers.iter().filter(|r| r.2 != s.2) {
                            opposites[s.2 as usize].push(r.2);
                            opposites[r.2 as usize].push(s.2);
                        }
                    }
                }
            }
            for o in &mut opposites {
                o.sort_unstable();
                o.dedup();
            }
            (opposites, receives)
        }
        let db = Database::default();
        let s = sources(&db, WORKLOAD.into(), "mlp.toml".into(), fixtures::SMALL16.into(), "small16".into());
        let l = lowered(&db, s).unwrap();
        let rules = crate::exchange_placement::exchange_rules(&l.value, 4096);
        let (opposites, receives) = sorted_whole(&l.value);
        assert!(opposites.iter().any(|o| !o.is_empty()));
        assert_eq!((&*rules.opposites, &*rules.receives, rules.receive_offset), (&opposites, &receives, 4096));
    }

    #[test]
    fn stage_digests_are_blake3_of_the_bytes_a_store_would_hold() {
        // Without a store, outputs are digested as they are serialised (`digest_of`), and the
        // chosen program's digest is select_finalist's: each must be the digest of the bytes
        // `rkyv::to_bytes` gives, which a disk store would hold.
        let db = Database::default();
        let s = sources(&db, WORKLOAD.into(), "mlp.toml".into(), fixtures::SMALL16.into(), "small16".into());
        let (f, l, sel) = (finalists(&db, s).unwrap(), lowered(&db, s).unwrap(), selection(&db, s).unwrap());
        let stored = |bytes: rkyv::util::AlignedVec| Digest::of_bytes(&bytes);
        assert_eq!(f.digest, stored(rkyv::to_bytes::<rkyv::rancor::Error>(&*f.value).unwrap()));
        assert_eq!(l.digest, stored(rkyv::to_bytes::<rkyv::rancor::Error>(&*l.value).unwrap()));
        assert_eq!(sel.digest, stored(rkyv::to_bytes::<rkyv::rancor::Error>(&*sel.value).unwrap()));
        // A value of many 64 KiB chunks, with nested vectors and padding.
        let big: Vec<(u8, Vec<u32>, String)> = (0..3000u32).map(|i| ((i % 251) as u8, (0..i % 97).map(|j| j * i).collect(), "x".repeat((i % 13) as usize))).collect();
        let stored = rkyv::to_bytes::<rkyv::rancor::Error>(&big).unwrap();
        assert!(stored.len() > 4 * 64 * 1024);
        assert_eq!(digest_of(&big).unwrap(), Digest::of_bytes(&stored));
    }

    /// In a process that builds again, the selection of an edit sets the entries the
    /// selection before it left aside (`previous_selection`, newest first), and an edit undone
    /// (selected from the selection memo, `select_finalist` not run), two edits back, takes
    /// them: an entry altered there under the undone build's key is what its stage returns.
    #[test]
    fn an_edit_undone_takes_the_placement_the_selection_before_the_edit_left() {
        use salsa::Setter;
        let mut db = Database::default().keeping_beam_states(true);
        let s = sources(&db, WORKLOAD.into(), "mlp.toml".into(), fixtures::SMALL16.into(), "small16".into());
        let (_, l, sch, sizing) = sizing_inputs(&db, s);
        let (m, c, lt, p) = (memory_target(&db, s).unwrap(), code_sizes(&db, s).unwrap(), lowering_target(&db, s).unwrap(), placement(&db, s).unwrap());
        let baseline = baseline_key(m.digest, l.digest, c.digest);
        let search = placement_search_key(lt.digest, l.digest, &sch.value.digests, c.digest, p.digest);
        let fresh = placed(&db, s).unwrap();
        assert!(db.previous_selection.lock().unwrap().is_empty(), "nothing set aside before an edit");
        let scaled = |factor: &str| WORKLOAD.replacen("op = \"gelu\"", &format!("op = \"scale\"\nfactor = {factor}"), 1);
        s.set_workload_text(&mut db).to(scaled("0.5"));
        assert_ne!(lowered(&db, s).unwrap().digest, l.digest);
        placed(&db, s).unwrap();
        s.set_workload_text(&mut db).to(scaled("0.25"));
        placed(&db, s).unwrap();
        let mut altered = (*p.value).clone();
        altered.addresses[0] += 16;
        {
            let mut previous = db.previous_selection.lock().unwrap();
            assert_eq!(previous.len(), 2, "each selection before the latest set aside");
            assert!(!previous[0].baselines.contains_key(&baseline), "the newest first");
            let first = &mut previous[1];
            assert!(first.sizings.contains_key(&sizing) && first.placements.contains_key(&search));
            assert!(first.baselines.insert(baseline, Arc::new(altered.clone())).is_some());
        }
        s.set_workload_text(&mut db).to(WORKLOAD.into());
        assert_eq!(*placement(&db, s).unwrap().value, altered);
        // As many as the selection memo holds besides the latest.
        for i in 0..crate::db::PREVIOUS_SELECTIONS + 1 {
            s.set_workload_text(&mut db).to(scaled(&format!("{}", 2 + i)));
            placed(&db, s).unwrap();
        }
        assert_eq!(db.previous_selection.lock().unwrap().len(), crate::db::PREVIOUS_SELECTIONS);
        // A database that does not build again sets nothing aside.
        let mut db = Database::default();
        let s = sources(&db, WORKLOAD.into(), "mlp.toml".into(), fixtures::SMALL16.into(), "small16".into());
        assert_eq!(placed(&db, s).unwrap().value, fresh.value);
        s.set_workload_text(&mut db).to(WORKLOAD.replacen("op = \"gelu\"", "op = \"scale\"\nfactor = 0.5", 1));
        placed(&db, s).unwrap();
        assert!(db.previous_selection.lock().unwrap().is_empty());
    }

    #[test]
    fn size_tile_code_takes_select_finalists_sizing_only_for_the_same_inputs() {
        let db = Database::default();
        let s = sources(&db, WORKLOAD.into(), "mlp.toml".into(), fixtures::SMALL16.into(), "small16".into());
        let (x, l, sch, key) = sizing_inputs(&db, s);
        // The chosen finalist's sizing is memoized under the key size_tile_code looks up, and
        // is what sizing the program again gives.
        let fresh = crate::sizing::support_with_tables(&x.value, &l.value, &sch.value.phases, None, db.table_budget()).unwrap();
        let memoized = db.sizing_memo.lock().unwrap().get(&key).cloned().expect("the chosen finalist's sizing is memoized");
        assert_eq!(*memoized, fresh);
        let totals: Vec<u32> = fresh.iter().map(SupportMemory::total).collect();

        // The stage takes the memoized sizing: an entry altered under that key is what it returns.
        let mut altered = fresh.clone();
        altered[0].runtime_bytes += 16;
        db.sizing_memo.lock().unwrap().insert(key, Arc::new(altered.clone()));
        assert_eq!(*code_sizes(&db, s).unwrap().value, altered.iter().map(SupportMemory::total).collect::<Vec<_>>());

        // Any other input misses: altered entries under keys differing in the exchange view,
        // the program, one phase's schedule or the budget are not taken.
        let db = Database::default();
        let s = sources(&db, WORKLOAD.into(), "mlp.toml".into(), fixtures::SMALL16.into(), "small16".into());
        let (x, l, sch, key) = sizing_inputs(&db, s);
        let other = Digest::of_bytes(b"another input");
        let mut one_schedule = sch.value.digests.clone();
        one_schedule[0] = other;
        let budget = db.table_budget();
        let keys = [
            sizing_key(other, l.digest, &sch.value.digests, budget),
            sizing_key(x.digest, other, &sch.value.digests, budget),
            sizing_key(x.digest, l.digest, &one_schedule, budget),
            sizing_key(x.digest, l.digest, &sch.value.digests, budget + 1),
        ];
        only_under_other_keys(&db.sizing_memo, key, &keys, &altered);
        assert_eq!(*code_sizes(&db, s).unwrap().value, totals);
    }

    #[test]
    fn place_storage_takes_select_finalists_placement_only_for_the_same_inputs() {
        // The chosen finalist's baseline placement is memoized under the key place_storage
        // looks up (the selection view's memory section digested as the memory view is), and
        // is what placing the program again gives.
        let inputs = |db: &Database, s: Sources| {
            let (m, l, c) = (memory_target(db, s).unwrap(), lowered(db, s).unwrap(), code_sizes(db, s).unwrap());
            let key = baseline_key(m.digest, l.digest, c.digest);
            (m, l, c, key)
        };
        let db = Database::default();
        let s = sources(&db, WORKLOAD.into(), "mlp.toml".into(), fixtures::SMALL16.into(), "small16".into());
        let (m, l, c, key) = inputs(&db, s);
        let fresh = place_storage(&m.value, &l.value, &c.value).unwrap();
        let memoized = db.baseline_memo.lock().unwrap().get(&key).cloned().expect("the chosen finalist's placement is memoized");
        assert_eq!(*memoized, fresh);

        // The stage takes the memoized placement: an entry altered under that key is what it returns.
        let mut altered = fresh.clone();
        altered.addresses[0] += 16;
        db.baseline_memo.lock().unwrap().insert(key, Arc::new(altered.clone()));
        assert_eq!(*placement(&db, s).unwrap().value, altered);

        // Any other input misses: altered entries under keys differing in the memory view, the
        // program or the code bytes are not taken.
        let db = Database::default();
        let s = sources(&db, WORKLOAD.into(), "mlp.toml".into(), fixtures::SMALL16.into(), "small16".into());
        let (m, l, c, key) = inputs(&db, s);
        let other = Digest::of_bytes(b"another input");
        let keys = [baseline_key(other, l.digest, c.digest), baseline_key(m.digest, other, c.digest), baseline_key(m.digest, l.digest, other)];
        only_under_other_keys(&db.baseline_memo, key, &keys, &altered);
        assert_eq!(*placement(&db, s).unwrap().value, fresh);
    }

    #[test]
    fn validations_are_remembered_per_phase_and_only_for_the_same_request_and_schedule() {
        let db = Database::default();
        let s = sources(&db, WORKLOAD.into(), "mlp.toml".into(), fixtures::SMALL16.into(), "small16".into());
        let (x, l, sch, _) = sizing_inputs(&db, s);
        let p = placed(&db, s).unwrap();
        let (phases, digests) = (&sch.value.phases, &sch.value.digests);
        let written = crate::exchange_placement::placed_tables(&x.value, &l.value, phases, &p.value, false).unwrap();
        let plain = crate::exchange_placement::checked_tables(&x.value, &l.value, phases, &p.value, written.clone()).unwrap();
        let check = |placement: &Placement, written: Vec<ExchangePhase>| checked_tables_memoized((&db, &db.validation_memo), x.digest, &x.value, &l.value, (phases, digests), placement, Tables::Written(written)).map(|v| v.into_iter().map(|t| t.expect("every phase's tables")).collect::<Vec<_>>());
        // Tables on demand: written only for the phases validated (counted).
        let writes = std::sync::atomic::AtomicUsize::new(0);
        let write = |i: usize| {
            writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(written[i].clone())
        };
        let on_demand = |placement: &Placement| checked_tables_memoized((&db, &db.validation_memo), x.digest, &x.value, &l.value, (phases, digests), placement, Tables::OnDemand(&write));
        let validated = |db: &Database| db.take_runs().iter().filter(|r| r.0 == "exchange_validation" && r.1 == crate::db::Origin::Computed).count();
        db.validation_memo.lock().unwrap().clear();
        db.take_runs();
        // First: every distinct phase validated, and the tables are checked_tables'.
        assert_eq!(check(&p.value, written.clone()).unwrap(), plain);
        assert!(validated(&db) > 0);
        // Again: every phase from the memo, the same tables.
        assert_eq!(check(&p.value, written.clone()).unwrap(), plain);
        assert_eq!(validated(&db), 0);
        // On demand, with every phase in the memo: none written, none returned.
        assert!(on_demand(&p.value).unwrap().iter().all(Option::is_none));
        assert_eq!(writes.load(std::sync::atomic::Ordering::Relaxed), 0);
        // On demand with an empty memo: the phases validated are written once each and are
        // checked_tables' (the others carried from the first phase of their schedule, which
        // is written, or not read).
        db.validation_memo.lock().unwrap().clear();
        let demanded = on_demand(&p.value).unwrap();
        assert!(validated(&db) > 0);
        assert_eq!(writes.load(std::sync::atomic::Ordering::Relaxed), demanded.iter().flatten().count());
        assert!(demanded.iter().zip(&plain).all(|(d, p)| d.as_ref().is_none_or(|d| d == p)));
        assert!(demanded.iter().any(Option::is_some));
        // A sent buffer moved by 8 bytes: the tables written for the old addresses are not
        // taken as validated for the new ones (the phases that send it are checked again).
        let first = l.value.phases.iter().flat_map(|p| p.iter()).next().expect("a transfer");
        let mut moved = (*p.value).clone();
        moved.addresses[first.source.0 as usize] += 8;
        assert!(check(&moved, written.clone()).is_err());
        db.take_runs();
        // The tables written for the new addresses: only the phases whose request changed are validated.
        let rewritten = crate::exchange_placement::placed_tables(&x.value, &l.value, phases, &moved, false).unwrap();
        let changed = requests(&l.value, |b, o| p.value.addresses[b as usize] + o).iter().zip(requests(&l.value, |b, o| moved.addresses[b as usize] + o)).filter(|(a, b)| request_digest(a) != request_digest(b)).count();
        // (Moving a buffer may make it overlap another: then the request itself is refused.)
        if check(&moved, rewritten).is_ok() {
            assert!(changed > 0 && validated(&db) <= changed, "{changed} phases changed");
        }
    }
}

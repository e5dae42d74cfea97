//! `optimize_exchange_placement`: move exchange buffers so that no tile sends from and
//! receives into the same memory element in one cycle, at the least cost.
//!
//! For every exchange phase and tile, the buffers the tile sends from and the buffers it
//! receives into are "opposites": placed in different elements they can never conflict,
//! whatever the schedule. Candidates re-run placement with that rule, receive buffers starting
//! their search at offsets of 0, 4, …, 28 KiB into their region (a tile that the rule
//! fragments so much that a buffer no longer fits is placed again, largest buffers first,
//! `storage::place_storage_with`). Each candidate (and the
//! baseline placement) is scored on the cached schedules with relocated addresses:
//! score = conflicting tile-cycles × 2^20 + the exchange cycles the memory-element bound
//! forces above the horizons (two offsets at a time, stopping once two distinct placements
//! score zero). The best candidates are finalists: the whole placed program is costed, and
//! the winner's relocated rows are validated (so the schedules are reused, not rebuilt). A finalist is accepted when it has fewer conflicts than the baseline, or as many
//! and a lower cost; among those, the least conflicts, then the least cost, win.

use std::collections::HashMap;
use std::sync::Arc;

use rayon::prelude::*;
use tracing::{debug, info, warn};

use crate::db::CompileError;
use crate::elements::{conflicts_and_bound, Conflicts};
use crate::emit::estimate_cycles;
use crate::exchange::{self, RelativeTables, Schedule};
use crate::hash::{Digest, KeyHasher};
use crate::lower::Lowered;
use crate::package::ExchangePhase;
use crate::pipeline::{phase_request, requests};
use crate::storage::{place_storage_memoized, ExchangeRules, Placement};
use crate::target::Target;

/// Receive-buffer offsets tried, in bytes from the region start (the seed's 4 KiB steps).
const OFFSET_STEP: u32 = 4096;
const OFFSETS: u32 = 8;
/// Finalists costed in full.
const FINALISTS: usize = 2;
/// Weight of one conflicting tile-cycle in the score, against one forced exchange cycle.
const CONFLICT_WEIGHT: u64 = 1 << 20;

/// Per buffer: the same-tile buffers it sends or receives against in some phase, and whether
/// it receives in any phase. The phases are read in parallel (each gives its pairs of
/// opposites and the buffers it receives into), and each buffer's opposites are sorted and
/// deduplicated, so the rules do not depend on the order the pairs are met in.
pub fn exchange_rules(lowered: &Lowered, receive_offset: u32) -> ExchangeRules {
    /// One phase's pairs of opposite buffers (both ways) and the buffers it receives into.
    type PhasePairs = (Vec<(u32, u32)>, Vec<u32>);
    let n = lowered.buffers.len();
    let per_phase: Vec<PhasePairs> = lowered
        .phases
        .par_iter()
        .map(|phase| {
            // Each buffer's roles in the phase (bit 0 sends, bit 1 receives), marked once per
            // buffer however many transfers name it, and the buffers marked, in the order met.
            let tiles = lowered.tiles as usize;
            let tile_of = |buffer: u32| (lowered.buffers[buffer as usize].tile as usize).min(tiles);
            let mut roles = vec![0u8; n];
            let mut touched: Vec<u32> = Vec::new();
            let mut mark = |buffer: u32, role: u8| {
                let r = &mut roles[buffer as usize];
                if *r == 0 {
                    touched.push(buffer);
                }
                *r |= role;
            };
            for t in phase.iter() {
                mark(t.source.0, 1);
                for d in &t.destinations {
                    mark(d.0, 2);
                }
            }
            // By tile, then buffer: on each tile every buffer it sends from against every
            // buffer it receives into (both in ascending order).
            touched.sort_unstable_by_key(|&b| (tile_of(b), b));
            let received: Vec<u32> = touched.iter().copied().filter(|&b| roles[b as usize] & 2 != 0).collect();
            let mut pairs: Vec<(u32, u32)> = Vec::new();
            for group in touched.chunk_by(|&a, &b| tile_of(a) == tile_of(b)) {
                for &s in group.iter().filter(|&&b| roles[b as usize] & 1 != 0) {
                    for &r in group.iter().filter(|&&b| roles[b as usize] & 2 != 0) {
                        if s != r {
                            pairs.push((s, r));
                            pairs.push((r, s));
                        }
                    }
                }
            }
            (pairs, received)
        })
        .collect();
    let mut opposites: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut receives = vec![false; n];
    for (pairs, received) in per_phase {
        for (buffer, opposite) in pairs {
            opposites[buffer as usize].push(opposite);
        }
        for buffer in received {
            receives[buffer as usize] = true;
        }
    }
    opposites.par_iter_mut().for_each(|o| {
        o.sort_unstable();
        o.dedup();
    });
    ExchangeRules { opposites: Arc::new(opposites), receives: Arc::new(receives), receive_offset, strict: false }
}

/// Tables of every phase under a placement (`check`: validated, as the final tables are).
/// Phases relocate independently: in parallel, taken in phase order (the first failing
/// phase's error, as in sequence).
pub fn placed_tables(target: &Target, lowered: &Lowered, schedules: &[Schedule], placement: &Placement, check: bool) -> Result<Vec<ExchangePhase>, CompileError> {
    let addresses = &placement.addresses;
    let requests = requests(lowered, |buffer, offset| addresses[buffer as usize] + offset);
    let tables: Vec<Result<ExchangePhase, CompileError>> =
        requests.par_iter().zip(schedules.par_iter()).map(|(r, s)| exchange::relocate(target, r, s, check, None).map_err(CompileError::from)).collect();
    tables.into_iter().collect()
}

/// Every phase's tables as `placed_tables(…, false)` writes them, from relative tables
/// computed once per distinct pattern and schedule (`exchange::RelativeTables`): the same
/// phase of repeated layers is sorted and joined once, and each placement only adds its
/// addresses. Phases whose relative tables would not be exact are written as before.
pub struct Relocation {
    /// Per phase: its pattern's relative tables (shared by the phases of one pattern and
    /// schedule), or `None` where the phase is written whole.
    phases: Vec<Arc<Option<RelativeTables>>>,
    /// Per phase: what its relative tables are made of (its schedule's digest and the source
    /// tile, words and destination tiles of every transfer), for `RelativeMemo`'s statistics.
    keys: Vec<Digest>,
}

/// The `Relocation` of a program's phases under their schedules (`digests`: each schedule's
/// digest). Phases are grouped by their schedule's digest and what `write_tables` reads of
/// their transfers (source tile, words, destination tiles, in order).
pub fn relocation(target: &Target, lowered: &Lowered, schedules: &[Schedule], digests: &[Digest]) -> Result<Relocation, CompileError> {
    grouped_relocation(target, lowered, schedules, digests, false, None)
}

/// `relocation`, taking the relative tables of a group from `memo` where an earlier relocation
/// made them, and leaving there those it makes.
pub fn relocation_memoized(target: &Target, lowered: &Lowered, schedules: &[Schedule], digests: &[Digest], memo: Option<&RelativeMemo>) -> Result<Relocation, CompileError> {
    grouped_relocation(target, lowered, schedules, digests, false, memo)
}

/// `relocation` for tables written under one set of addresses only: a phase alone in its
/// group is written whole (its relative tables would be used once, for no gain).
pub fn shared_relocation(target: &Target, lowered: &Lowered, schedules: &[Schedule], digests: &[Digest], memo: Option<&RelativeMemo>) -> Result<Relocation, CompileError> {
    grouped_relocation(target, lowered, schedules, digests, true, memo)
}

/// Relative tables `relocation` and `shared_relocation` made, by what they are made of (the
/// exchange view, the schedule's digest, the source tile, words and destination tiles of every
/// transfer): `select_finalist` relocating the program `lower_mid`'s table screen sized takes
/// the screen's instead of making them again. They are a function of that key, so taking them
/// changes no table. The pipeline clears it once selection is done (the largest programs'
/// relative tables hold millions of runs), but a process that builds again (`ipuq watch`)
/// keeps the entries a build used for the next (`keep_used`): an edit's unchanged phases find
/// their relative tables made.
///
/// In a process that builds again it also holds the table screen's packed sizing of each
/// phase (`sizing::sizing_tables`, `keep_packings`), by
/// everything that packing reads (`sizing::packed_key`): the target, the schedule's digest,
/// the phase's index, every transfer's tiles, addresses and words, and the phase's buffers at
/// their sizing addresses. A watch edit that leaves a phase's buffers where they were finds
/// its packing made (session 43: 21 of the four-block MLP's 22 phases after its last GELU is
/// made a scale).
///
/// There too (kept under the same switch) each placed phase's statistics, the horizon and
/// endpoint bound the phase log reads and the memory-element conflicts and bound a placement
/// is scored by (`Relocation::measured`), by everything its tables are written from: the
/// target, the relative tables' key, and the address of every transfer's source and
/// destinations. `select_finalist` scores the baseline and the exchange-placement candidates
/// of a watch edit's program on them: the phases whose buffers stay where they were (the
/// four-block MLP's edited last GELU moves none) are neither written nor measured again.
#[derive(Default)]
pub struct RelativeMemo {
    relative: std::sync::Mutex<RelativeEntries>,
    packed: std::sync::Mutex<PackedEntries>,
    stats: std::sync::Mutex<StatEntries>,
    tiles: std::sync::Mutex<TileEntries>,
    /// Whether sizings take and keep packings (`keep_packings`).
    packing: std::sync::atomic::AtomicBool,
}

/// A memo's entries by key, and the keys taken or made since it last kept the used ones.
type Entries<V> = (HashMap<Digest, V>, std::collections::HashSet<Digest>);

/// The entry under `key`, if any (marked used).
fn entry<V: Clone>(entries: &std::sync::Mutex<Entries<V>>, key: &Digest) -> Option<V> {
    let mut m = entries.lock().unwrap_or_else(|e| e.into_inner());
    let found = m.0.get(key).cloned();
    if found.is_some() {
        m.1.insert(*key);
    }
    found
}

/// Keeps `value` under `key` (marked used).
fn keep_entry<V>(entries: &std::sync::Mutex<Entries<V>>, key: Digest, value: V) {
    let mut m = entries.lock().unwrap_or_else(|e| e.into_inner());
    m.0.insert(key, value);
    m.1.insert(key);
}

/// The number of entries held.
fn entries_len<V>(entries: &std::sync::Mutex<Entries<V>>) -> usize {
    entries.lock().unwrap_or_else(|e| e.into_inner()).0.len()
}

/// The relative tables' entries.
type RelativeEntries = Entries<Arc<Option<RelativeTables>>>;

/// Packed sizings by key.
type PackedEntries = Entries<Arc<crate::tables::PackedPhase>>;

/// A placed phase's statistics by key (`Relocation::measured`).
type StatEntries = Entries<PlacedStat>;

/// Tiles' placements by key (`storage::place_storage_memoized`).
type TileEntries = Entries<crate::storage::KeptTile>;

/// What scoring a placement reads of one phase's tables: its horizon, its endpoint lower
/// bound, its memory-element conflicts and bound.
type PlacedStat = (u32, u32, PhaseStat);

impl RelativeMemo {
    /// Drops every entry.
    pub fn clear(&self) {
        fn clear<V>(entries: &std::sync::Mutex<Entries<V>>) {
            let mut m = entries.lock().unwrap_or_else(|e| e.into_inner());
            m.0.clear();
            m.1.clear();
        }
        clear(&self.relative);
        clear(&self.packed);
        clear(&self.stats);
        clear(&self.tiles);
    }

    /// Drops the entries not taken or made since the last call (or `clear`).
    pub fn keep_used(&self) {
        fn keep_used<V>(entries: &std::sync::Mutex<Entries<V>>) {
            let mut m = entries.lock().unwrap_or_else(|e| e.into_inner());
            let (values, used) = &mut *m;
            values.retain(|k, _| used.contains(k));
            used.clear();
        }
        keep_used(&self.relative);
        keep_used(&self.packed);
        keep_used(&self.stats);
        keep_used(&self.tiles);
    }

    /// A tile's placement made under `key`, if any.
    pub(crate) fn tile_placement(&self, key: &Digest) -> Option<crate::storage::KeptTile> {
        entry(&self.tiles, key)
    }

    /// Keeps a tile's placement made under `key`.
    pub(crate) fn keep_tile_placement(&self, key: Digest, kept: crate::storage::KeptTile) {
        keep_entry(&self.tiles, key, kept);
    }

    /// Tile placements held (tests).
    pub fn tiles_len(&self) -> usize {
        entries_len(&self.tiles)
    }

    /// A placed phase's statistics made under `key`, if any.
    fn stat(&self, key: &Digest) -> Option<PlacedStat> {
        entry(&self.stats, key)
    }

    /// Keeps a placed phase's statistics made under `key`.
    fn keep_stat(&self, key: Digest, stat: PlacedStat) {
        keep_entry(&self.stats, key, stat);
    }

    /// Placed phase statistics held (tests).
    pub fn stats_len(&self) -> usize {
        entries_len(&self.stats)
    }

    /// The memo with the scope its placed phase statistics are kept under (the target, all
    /// of which conflicts and tables read: its exchange rates and memory elements), where
    /// this process keeps them for a next build (`keep_packings`); None elsewhere.
    pub fn for_statistics(&self, target: &Target) -> Option<(&RelativeMemo, Digest)> {
        self.keeps_packings().then(|| (self, target.view_digest("placed phase statistics")))
    }

    /// Whether sizings take and keep packings here (set per build: only a process that builds
    /// again, `ipuq watch`, keeps them).
    pub fn keep_packings(&self, keep: bool) {
        self.packing.store(keep, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether packings are kept (`keep_packings`).
    pub(crate) fn keeps_packings(&self) -> bool {
        self.packing.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The packed sizing made under `key`, if any.
    pub(crate) fn packed(&self, key: &Digest) -> Option<Arc<crate::tables::PackedPhase>> {
        entry(&self.packed, key)
    }

    /// Keeps the packed sizing made under `key`.
    pub(crate) fn keep_packed(&self, key: Digest, packed: Arc<crate::tables::PackedPhase>) {
        keep_entry(&self.packed, key, packed);
    }

    /// Packed sizings held (tests).
    pub fn packed_len(&self) -> usize {
        entries_len(&self.packed)
    }

    fn get(&self, key: &Digest) -> Option<Arc<Option<RelativeTables>>> {
        entry(&self.relative, key)
    }

    fn insert(&self, key: Digest, tables: Arc<Option<RelativeTables>>) {
        keep_entry(&self.relative, key, tables);
    }

    /// Entries held (tests).
    pub fn len(&self) -> usize {
        entries_len(&self.relative)
    }

    /// Whether it holds none (tests).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn grouped_relocation(target: &Target, lowered: &Lowered, schedules: &[Schedule], digests: &[Digest], shared_only: bool, memo: Option<&RelativeMemo>) -> Result<Relocation, CompileError> {
    let n = lowered.phases.len();
    if schedules.len() != n || digests.len() != n {
        return Err(CompileError(format!("{} schedules and {} digests for {} exchange phases", schedules.len(), digests.len(), n)));
    }
    let tile = |buffer: u32| lowered.buffers[buffer as usize].tile;
    let keys: Vec<Digest> = lowered
        .phases
        .par_iter()
        .zip(digests.par_iter())
        .map(|(phase, schedule)| {
            let mut h = KeyHasher::new("ipuq relative exchange tables v1");
            h.add(schedule).add(&(phase.len() as u64));
            for t in phase.iter() {
                h.add(&tile(t.source.0)).add(&t.words).add(&(t.destinations.len() as u64));
                for d in &t.destinations {
                    h.add(&tile(d.0));
                }
            }
            h.finish()
        })
        .collect();
    // Each phase's group, numbered in order of first phase.
    let mut first: HashMap<Digest, usize> = HashMap::new();
    let mut representatives: Vec<usize> = Vec::new();
    let groups: Vec<usize> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            *first.entry(*k).or_insert_with(|| {
                representatives.push(i);
                representatives.len() - 1
            })
        })
        .collect();
    let mut members = vec![0usize; representatives.len()];
    for &g in &groups {
        members[g] += 1;
    }
    // A memo entry's key: the group's, under the exchange view (what relative tables read of
    // the target; the views the stages hand over differ elsewhere).
    let scope = memo.map(|_| target.exchange_view().view_digest("exchange"));
    let memo_key = |group: &Digest| KeyHasher::new("ipuq relative tables memo v1").add(&scope).add(group).finish();
    let relative: Vec<Arc<Option<RelativeTables>>> = representatives
        .par_iter()
        .zip(members.par_iter())
        .map(|(&i, &m)| {
            if shared_only && m < 2 {
                return Arc::new(None);
            }
            if let Some(hit) = memo.and_then(|memo| memo.get(&memo_key(&keys[i]))) {
                return hit;
            }
            let made = Arc::new(exchange::relative_tables(target, &phase_request(lowered, i, &|_, _| 0), &schedules[i]));
            if let Some(memo) = memo {
                memo.insert(memo_key(&keys[i]), made.clone());
            }
            made
        })
        .collect();
    debug!(phases = n, distinct = representatives.len(), "relative exchange tables per distinct pattern and schedule");
    Ok(Relocation { phases: groups.iter().map(|&g| relative[g].clone()).collect(), keys })
}


impl Relocation {
    /// `placed_tables(target, lowered, schedules, placement, false)`, the same tables (of the
    /// program and schedules this relocation was made for).
    pub fn tables(&self, target: &Target, lowered: &Lowered, schedules: &[Schedule], placement: &Placement) -> Result<Vec<ExchangePhase>, CompileError> {
        let addresses = &placement.addresses;
        self.tables_at(target, lowered, schedules, |buffer, offset| addresses[buffer as usize] + offset)
    }

    /// The tables with addresses from `address(buffer, offset)`, as the unchecked `relocate`
    /// of each phase's request with those addresses writes them.
    pub fn tables_at(&self, target: &Target, lowered: &Lowered, schedules: &[Schedule], address: impl Fn(u32, u32) -> u32 + Sync) -> Result<Vec<ExchangePhase>, CompileError> {
        if self.phases.len() != lowered.phases.len() || schedules.len() != lowered.phases.len() {
            return Err(CompileError(format!("relative tables of {} phases and {} schedules for {} exchange phases", self.phases.len(), schedules.len(), lowered.phases.len())));
        }
        let tables: Vec<Result<ExchangePhase, CompileError>> = (0..self.phases.len()).into_par_iter().map(|i| self.phase_at(target, lowered, schedules, i, &address)).collect();
        tables.into_iter().collect()
    }

    /// Phase `i`'s tables of `tables_at` (the caller checked the lengths).
    pub fn phase_at(&self, target: &Target, lowered: &Lowered, schedules: &[Schedule], i: usize, address: &(impl Fn(u32, u32) -> u32 + Sync)) -> Result<ExchangePhase, CompileError> {
        match &*self.phases[i] {
            Some(relative) => {
                let phase = &lowered.phases[i];
                Ok(relative.apply(
                    i as u32,
                    schedules[i].endpoint_lower_bound,
                    |t| {
                        let s = phase[t as usize].source;
                        address(s.0, s.1)
                    },
                    |t, d| {
                        let d = phase[t as usize].destinations[d as usize];
                        address(d.0, d.1)
                    },
                ))
            }
            None => exchange::relocate(target, &phase_request(lowered, i, address), &schedules[i], false, None).map_err(CompileError::from),
        }
    }

    /// Phase `i` under `address` as `written` measures it: its tables (written only with
    /// `keep`), summary and statistics. With a memo (and its scope, `RelativeMemo::for_statistics`),
    /// statistics made under the same key are taken instead of measured (the tables are still
    /// written where kept), and those measured are kept there.
    pub fn measured(&self, target: &Target, lowered: &Lowered, schedules: &[Schedule], i: usize, address: &(impl Fn(u32, u32) -> u32 + Sync), keep: bool, memo: Option<(&RelativeMemo, &Digest)>) -> Result<Measured, CompileError> {
        let key = memo.map(|(_, scope)| {
            let mut h = KeyHasher::new("ipuq placed phase statistics v1");
            h.add(scope).add(&self.keys[i]).add(&schedules[i].endpoint_lower_bound);
            for t in lowered.phases[i].iter() {
                h.add(&address(t.source.0, t.source.1));
                for d in &t.destinations {
                    h.add(&address(d.0, d.1));
                }
            }
            h.finish()
        });
        if let (Some((memo, _)), Some(key)) = (memo, &key) {
            if let Some((horizon, endpoint_lower_bound, stat)) = memo.stat(key) {
                let tables = if keep { Some(self.phase_at(target, lowered, schedules, i, address)?) } else { None };
                return Ok((tables, (i as u32, horizon, endpoint_lower_bound), stat));
            }
        }
        let phase = self.phase_at(target, lowered, schedules, i, address)?;
        let (summary, stat) = ((phase.index, phase.horizon, phase.endpoint_lower_bound), conflicts_and_bound(target, &phase));
        if let (Some((memo, _)), Some(key)) = (memo, key) {
            memo.keep_stat(key, (summary.1, summary.2, stat.clone()));
        }
        Ok((keep.then_some(phase), summary, stat))
    }

    /// The number of phases.
    pub fn len(&self) -> usize {
        self.phases.len()
    }

    /// Whether there are no phases.
    pub fn is_empty(&self) -> bool {
        self.phases.is_empty()
    }
}

/// `placed_tables(…, true)` for tables `placed_tables(…, false)` already wrote under this
/// placement: the same checks (schedule fit, validation) on the same tables, not written
/// again; in parallel, the first failing phase's error.
pub fn checked_tables(target: &Target, lowered: &Lowered, schedules: &[Schedule], placement: &Placement, written: Vec<ExchangePhase>) -> Result<Vec<ExchangePhase>, CompileError> {
    let addresses = &placement.addresses;
    let requests = requests(lowered, |buffer, offset| addresses[buffer as usize] + offset);
    if written.len() != requests.len() || schedules.len() != requests.len() {
        return Err(CompileError(format!("{} tables and {} schedules for {} exchange phases", written.len(), schedules.len(), requests.len())));
    }
    let tables: Vec<Result<ExchangePhase, CompileError>> = requests
        .par_iter()
        .zip(schedules.par_iter())
        .zip(written.into_par_iter())
        .map(|((r, s), t)| exchange::relocate(target, r, s, true, Some(t)).map_err(CompileError::from))
        .collect();
    tables.into_iter().collect()
}

/// A placement's tables as a check (`Check`) takes them: every phase's, written already, or
/// each phase's written when the check first reads it. A rebuilding process (`ipuq watch`,
/// `ipuq serve`) takes the second: its check finds most phases validated before (the
/// pipeline's memo) and its later stages take those phases' packed tables from their own memo,
/// so an edit writes only the tables of the phases it moved (the four-block MLP's 24 phases
/// hold 11 million table entries, which every edit wrote again until session 63).
pub enum Tables<'a> {
    Written(Vec<ExchangePhase>),
    OnDemand(&'a (dyn Fn(usize) -> Result<ExchangePhase, CompileError> + Sync)),
}

/// A placement's validated tables by phase: every phase's where they were written before the
/// check; on demand, those the check read (the later stages write the others again where they
/// need them, as without validated tables).
pub type Validated = Vec<Option<ExchangePhase>>;

/// `checked_tables` of tables written or on demand (every phase's then written), every phase's
/// validated tables.
pub fn checked_all(target: &Target, lowered: &Lowered, schedules: &[Schedule], placement: &Placement, tables: Tables) -> Result<Validated, CompileError> {
    let written = match tables {
        Tables::Written(written) => written,
        Tables::OnDemand(write) => (0..lowered.phases.len()).into_par_iter().map(write).collect::<Result<Vec<_>, _>>()?,
    };
    Ok(checked_tables(target, lowered, schedules, placement, written)?.into_iter().map(Some).collect())
}

/// Checks a placement's tables as `checked_tables` does, with the same result for the phases
/// it returns (the pipeline's remembers per phase which tables validated,
/// `pipeline::checked_tables_memoized`).
pub type Check<'a> = dyn Fn(&Placement, Tables<'_>) -> Result<Validated, CompileError> + Sync + 'a;

/// The baseline placement's tables of every phase, written unchecked by the caller
/// (`select_finalist` writes them while costing a finalist), with each phase's memory-element
/// conflicts and bound, and the relative tables they were written from: the search starts from
/// them instead of relocating the baseline again (and writes its candidates' tables from the
/// same relative tables), and checks
/// them (`checked_tables`) when it keeps the baseline, so that the placement it returns has
/// validated tables whichever it is.
pub struct Baseline<'a> {
    /// The tables, where the caller kept them (else they are written again should the
    /// baseline be kept without conflicts).
    pub tables: Option<Vec<ExchangePhase>>,
    /// Each phase's (index, horizon, endpoint lower bound).
    pub summary: Vec<PhaseSummary>,
    /// Each phase's conflicts and memory-element bound (`conflicts_and_bound`).
    pub stats: Vec<(Conflicts, u64)>,
    /// The relative tables the baseline's were written from: the candidates' are too.
    pub relocation: Relocation,
    /// Where placed phases' statistics are taken and kept, with their scope
    /// (`RelativeMemo::for_statistics`): the candidates' are measured through it.
    pub memo: Option<(&'a RelativeMemo, Digest)>,
}

/// A scored placement: conflicting tile-cycles, forced cycles and the score.
struct Scored {
    offset: Option<u32>,
    placement: Placement,
    /// The placement's relocated tables, kept only for the first offset (`written`): the
    /// others are written again should one of them be accepted.
    tables: Option<Vec<ExchangePhase>>,
    /// Per phase: what the finalists' cycles and the phase log read of the tables, and the
    /// statistics the score is made of (computed once).
    summary: Vec<PhaseSummary>,
    stats: PhaseStats,
    conflicts: u64,
    score: u64,
}

/// What `written` gives: the tables (when kept), their summary and statistics per phase.
pub type Written = (Option<Vec<ExchangePhase>>, Vec<PhaseSummary>, PhaseStats);

/// One phase as `written` measures it: its tables (when kept), summary and statistics.
pub type Measured = (Option<ExchangePhase>, PhaseSummary, PhaseStat);

/// A placement's relocated tables (kept only with `keep`), their summary and statistics, phase
/// by phase: without `keep` each phase's tables are written, measured and dropped in turn, so a
/// candidate the search does not keep never holds a whole program's tables.
/// Through `memo` (`Relocation::measured`) where the relative tables are given.
pub fn written(target: &Target, lowered: &Lowered, schedules: &[Schedule], placement: &Placement, relocation: Option<&Relocation>, keep: bool, memo: Option<(&RelativeMemo, &Digest)>) -> Result<Written, CompileError> {
    let phases = lowered.phases.len();
    if schedules.len() != phases || relocation.is_some_and(|r| r.len() != phases) {
        return Err(CompileError(format!("exchange placement search: {} schedules for {phases} exchange phases", schedules.len())));
    }
    let addresses = &placement.addresses;
    let address = |buffer: u32, offset: u32| addresses[buffer as usize] + offset;
    let measured: Vec<Result<Measured, CompileError>> = (0..phases)
        .into_par_iter()
        .map(|i| {
            // As `write_all` writes phase i.
            if let Some(r) = relocation {
                return r.measured(target, lowered, schedules, i, &address, keep, memo);
            }
            let phase = exchange::relocate(target, &phase_request(lowered, i, &address), &schedules[i], false, None).map_err(CompileError::from)?;
            let (summary, stat) = ((phase.index, phase.horizon, phase.endpoint_lower_bound), conflicts_and_bound(target, &phase));
            Ok((keep.then_some(phase), summary, stat))
        })
        .collect();
    let mut tables = keep.then(|| Vec::with_capacity(phases));
    let (mut summary, mut stats) = (Vec::with_capacity(phases), Vec::with_capacity(phases));
    for m in measured {
        let (phase, s, stat) = m?;
        if let (Some(tables), Some(phase)) = (tables.as_mut(), phase) {
            tables.push(phase);
        }
        summary.push(s);
        stats.push(stat);
    }
    Ok((tables, summary, stats))
}

/// Phase `i`'s tables under `placement`, as `write_all` writes them.
fn write_phase(target: &Target, lowered: &Lowered, schedules: &[Schedule], placement: &Placement, relocation: Option<&Relocation>, i: usize) -> Result<ExchangePhase, CompileError> {
    let addresses = &placement.addresses;
    let address = |buffer: u32, offset: u32| addresses[buffer as usize] + offset;
    match relocation {
        Some(r) => r.phase_at(target, lowered, schedules, i, &address),
        None => exchange::relocate(target, &phase_request(lowered, i, &address), &schedules[i], false, None).map_err(CompileError::from),
    }
}

/// Every phase's tables under `placement`: from the relative tables where the caller has them.
pub fn write_all(target: &Target, lowered: &Lowered, schedules: &[Schedule], placement: &Placement, relocation: Option<&Relocation>) -> Result<Vec<ExchangePhase>, CompileError> {
    match relocation {
        Some(r) => r.tables(target, lowered, schedules, placement),
        None => placed_tables(target, lowered, schedules, placement, false),
    }
}

/// Per phase: its memory-element conflicts and bound (computed once per placement, for the
/// score and for the phase log lines).
pub type PhaseStats = Vec<PhaseStat>;

/// One phase's memory-element conflicts and bound.
pub type PhaseStat = (Conflicts, u64);

fn phase_stats(target: &Target, tables: &[ExchangePhase]) -> PhaseStats {
    tables.par_iter().map(|phase| conflicts_and_bound(target, phase)).collect()
}

fn score(phases: &[PhaseSummary], stats: &PhaseStats) -> (u64, u64) {
    let mut conflicts = 0u64;
    let mut forced = 0u64;
    for (&(_, horizon, _), (c, bound)) in phases.iter().zip(stats) {
        conflicts += c.tile_cycles;
        forced += bound.saturating_sub(horizon as u64);
    }
    (conflicts, conflicts * CONFLICT_WEIGHT + forced)
}

/// The stage's verdict on the searched placement (the baseline when no candidate is
/// accepted): an error when memory-element conflicts remain, since the device rejects such a
/// package (`select_finalist` drops a finalist whose conflicts this search cannot remove, so a
/// build does not get here).
pub fn check_placement(placement: Placement, conflicts: u64) -> Result<Placement, CompileError> {
    if conflicts > 0 {
        return Err(CompileError(format!("{conflicts} memory-element conflict tile-cycles remain after exchange placement (tile memory too full to separate send and receive buffers); the device would reject the package")));
    }
    Ok(placement)
}

/// The accepted placement and the conflicting tile-cycles it leaves.
pub fn best_exchange_placement(target: &Target, lowered: &Lowered, schedules: &[Schedule], code_bytes: &[u32], baseline: &Placement) -> Result<(Placement, u64), CompileError> {
    search_exchange_placement(target, lowered, schedules, code_bytes, baseline).map(|s| (s.placement, s.conflicts))
}

/// What the search found: the accepted placement, the conflicting tile-cycles it leaves, and,
/// when a candidate was accepted, its relocated tables as validated (the stage
/// `lower_exchanges` would validate the same tables again): every phase's, or in a rebuilding
/// process those its check wrote (`Tables::OnDemand`); when the baseline is kept, its tables
/// as validated if the caller handed them over (`search_exchange_placement_from`).
pub struct Searched {
    pub placement: Placement,
    pub conflicts: u64,
    pub validated: Option<std::sync::Arc<Validated>>,
}

/// `best_exchange_placement`, keeping the accepted candidate's validated tables.
pub fn search_exchange_placement(target: &Target, lowered: &Lowered, schedules: &[Schedule], code_bytes: &[u32], baseline: &Placement) -> Result<Searched, CompileError> {
    search_from(target, lowered, schedules, code_bytes, baseline, None, &|placement, tables| checked_all(target, lowered, schedules, placement, tables))
}

/// `search_exchange_placement` from the baseline's tables as the caller wrote them (the same
/// tables `placed_tables` would write for `baseline`, see `Baseline`); when the baseline is
/// kept, they are checked here and are the validated tables of the placement returned.
/// Tables are checked by `check` (`checked_tables` or the same memoized).
pub fn search_exchange_placement_from(target: &Target, lowered: &Lowered, schedules: &[Schedule], code_bytes: &[u32], baseline: &Placement, base: Baseline<'_>, check: &Check) -> Result<Searched, CompileError> {
    search_from(target, lowered, schedules, code_bytes, baseline, Some(base), check)
}

fn search_from(target: &Target, lowered: &Lowered, schedules: &[Schedule], code_bytes: &[u32], baseline: &Placement, base: Option<Baseline<'_>>, check: &Check) -> Result<Searched, CompileError> {
    // Whether the caller handed its tables over (else they are written here, unchecked).
    let handed = base.is_some();
    let (base_tables, base_summary, base_stats, relocation, memo) = match base {
        Some(Baseline { tables, summary, stats, relocation, memo }) => {
            if summary.len() != schedules.len() || stats.len() != summary.len() || tables.as_ref().is_some_and(|t| t.len() != summary.len()) {
                return Err(CompileError(format!("exchange placement search: {} baseline phases and {} conflict counts for {} phases", summary.len(), stats.len(), schedules.len())));
            }
            (tables, summary, stats, Some(relocation), memo)
        }
        None => {
            let tables = placed_tables(target, lowered, schedules, baseline, false)?;
            let stats = phase_stats(target, &tables);
            let summary = summary(&tables);
            (Some(tables), summary, stats, None, None)
        }
    };
    let memo = memo.as_ref().map(|(m, scope)| (*m, scope));
    let (base_conflicts, base_score) = score(&base_summary, &base_stats);
    log_phases("baseline", &base_summary, &base_stats);
    info!(score = base_score, conflicts = base_conflicts, "scored baseline exchange placement");
    let (base_cycles, base_exchange) = estimate_cycles(target, lowered, baseline, &horizons(&base_summary));
    // The baseline's tables are needed again only where the baseline may be kept and checked
    // (handed over, without conflicts); elsewhere they go now, before the candidates' tables
    // are written (the largest programs' tables hold millions of runs).
    let mut base_tables = match (handed && base_conflicts == 0, base_tables) {
        (true, Some(tables)) => Some(tables),
        (true, None) => Some(write_all(target, lowered, schedules, baseline, relocation.as_ref())?),
        (false, _) => None,
    };
    // Candidates are independent: place and score them two at a time in parallel, in offset
    // order, and stop once `FINALISTS` distinct placements score zero (no conflicts and no
    // forced cycles: later offsets could differ only in cost, which the finalists compare).
    let mut scored: Vec<Scored> = Vec::new();
    // The opposites do not depend on the offset: found once, each candidate takes a copy.
    let rules = exchange_rules(lowered, 0);
    for batch in (0..OFFSETS).collect::<Vec<_>>().chunks(FINALISTS) {
        let candidates: Vec<(u32, Result<Option<Scored>, CompileError>)> = batch
            .par_iter()
            .map(|&k| {
                let offset = k * OFFSET_STEP;
                let rules = ExchangeRules { receive_offset: offset, ..rules.clone() };
                let result = match place_storage_memoized(target, lowered, code_bytes, &rules, memo) {
                    // The first offset keeps its tables: the search takes the first placements
                    // that score zero, lowest offset first, so that one is the usual winner
                    // (not in a rebuilding process, whose winner's tables are written on demand).
                    Ok(placement) => written(target, lowered, schedules, &placement, relocation.as_ref(), k == 0 && memo.is_none(), memo).map(|(tables, summary, stats)| {
                        let (conflicts, score) = score(&summary, &stats);
                        Some(Scored { offset: Some(offset), placement, tables, summary, stats, conflicts, score })
                    }),
                    Err(e) => {
                        debug!(offset, error = %e, "exchange placement candidate does not fit");
                        Ok(None)
                    }
                };
                (offset, result)
            })
            .collect();
        for (offset, result) in candidates {
            if let Some(candidate) = result? {
                info!(offset, score = candidate.score, conflicts = candidate.conflicts, "scored exchange placement");
                scored.push(candidate);
            }
        }
        let mut perfect: Vec<&Placement> = scored.iter().filter(|s| s.score == 0).map(|s| &s.placement).collect();
        perfect.dedup();
        if perfect.len() >= FINALISTS {
            break;
        }
    }
    // Identical placements need costing once: keep the first offset of each.
    scored.sort_by_key(|s| (s.score, s.offset));
    let mut finalists: Vec<Scored> = Vec::new();
    for s in scored {
        if finalists.len() < FINALISTS && !finalists.iter().any(|f| f.placement == s.placement) {
            finalists.push(s);
        }
    }
    let mut best: Option<(Scored, u64, u64)> = None;
    for f in finalists {
        let (cycles, exchange_cycles) = estimate_cycles(target, lowered, &f.placement, &horizons(&f.summary));
        let better_than_base = f.conflicts < base_conflicts || (f.conflicts == base_conflicts && cycles < base_cycles);
        let better_than_best = best.as_ref().is_none_or(|(b, c, _)| (f.conflicts, cycles) < (b.conflicts, *c));
        let accepted = better_than_base && better_than_best;
        info!(
            offset = f.offset.unwrap_or(0),
            baseline_score = base_score,
            score = f.score,
            baseline_cycles = base_cycles,
            candidate_cycles = cycles,
            baseline_conflicts = base_conflicts,
            conflicts = f.conflicts,
            accepted,
            "evaluated exchange placement finalist"
        );
        if accepted {
            best = Some((f, cycles, exchange_cycles));
        }
    }
    // The winner's relocated rows must validate (its schedules are reused as they are).
    let mut validated = None;
    let accepted_any = best.is_some();
    if let Some((f, _, _)) = best.as_mut() {
        // Its tables as scored (written unchecked under its placement), or written again the
        // same way where the candidate did not keep them (in a rebuilding process, with a memo,
        // those the check reads), checked as they are.
        let kept = f.tables.take();
        let placement = &f.placement;
        let write = |i: usize| write_phase(target, lowered, schedules, placement, relocation.as_ref(), i);
        let tables = match (kept, memo) {
            (Some(tables), _) => Tables::Written(tables),
            (None, Some(_)) => Tables::OnDemand(&write),
            (None, None) => Tables::Written(write_all(target, lowered, schedules, placement, relocation.as_ref())?),
        };
        match check(placement, tables) {
            Ok(tables) => validated = Some(std::sync::Arc::new(tables)),
            Err(e) => {
                warn!(offset = f.offset.unwrap_or(0), error = %e, "exchange placement finalist's relocated rows do not validate: keeping the baseline");
                best = None;
            }
        }
    }
    let (placement, summary, stats, conflicts, cycles, exchange_cycles) = match best {
        Some((f, c, x)) => (f.placement, f.summary, f.stats, f.conflicts, c, x),
        None => {
            // The baseline kept (no candidate accepted, or the accepted one did not
            // validate): the caller's tables are checked here, unless conflicts remain (the
            // device would reject the baseline, and `select_finalist` drops such a finalist).
            if accepted_any {
                debug!("keeping the baseline after the accepted candidate failed validation");
            }
            match base_tables.take() {
                Some(tables) => validated = Some(std::sync::Arc::new(check(baseline, Tables::Written(tables))?)),
                None => {
                    validated = None;
                    log_phases("final", &base_summary, &base_stats);
                }
            }
            (baseline.clone(), base_summary, base_stats, base_conflicts, base_cycles, base_exchange)
        }
    };
    if validated.is_some() {
        log_phases("final", &summary, &stats);
    }
    if conflicts > 0 {
        warn!(conflicts, "memory-element conflicts remain after exchange placement (tile memory too full to separate send and receive buffers)");
    }
    info!(final_cycles = cycles, final_exchange = exchange_cycles, conflicts, "costed final placed program");
    Ok(Searched { placement, conflicts, validated })
}

/// Per phase: conflicts and the memory-element bound beside the endpoint bound (the bound
/// binds where it exceeds the endpoint bound).
fn log_phases(placement: &str, phases: &[PhaseSummary], stats: &PhaseStats) {
    for (&(index, horizon, endpoint_lower_bound), (c, bound)) in phases.iter().zip(stats) {
        let bound = *bound;
        info!(
            placement,
            phase = index,
            conflicts = c.tile_cycles,
            conflict_tiles = c.tiles,
            memory_element_bound = bound,
            endpoint_lower_bound,
            binds = bound > endpoint_lower_bound as u64,
            horizon,
            "memory-element exchange bound"
        );
    }
}

/// What the phase log reads of a phase's tables: (index, horizon, endpoint lower bound).
pub type PhaseSummary = (u32, u32, u32);

fn summary(tables: &[ExchangePhase]) -> Vec<PhaseSummary> {
    tables.iter().map(|p| (p.index, p.horizon, p.endpoint_lower_bound)).collect()
}

fn horizons(phases: &[PhaseSummary]) -> Vec<u32> {
    phases.iter().map(|p| p.1).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::{Database, Sources};
    use crate::pipeline::{lowered, placement, schedules};
    use crate::target::fixtures;

    /// A workload's lowered program, schedules and baseline placement on the 16-tile target.
    fn built(text: &str) -> (Target, crate::db::Staged<Lowered>, crate::db::Staged<crate::pipeline::Schedules>, crate::db::Staged<Placement>) {
        let db = Database::default();
        let sources = Sources::new(&db, text.to_string(), "workload.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
        let target = Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap();
        (target, lowered(&db, sources).unwrap(), schedules(&db, sources).unwrap(), placement(&db, sources).unwrap())
    }

    /// The opposites and received buffers `exchange_rules` finds are those of their
    /// definition: per phase, every buffer a tile sends from against every buffer the same
    /// tile receives into (both ways, itself excepted), over the phases' union.
    #[test]
    fn exchange_rules_pair_each_tiles_senders_with_its_receivers() {
        for text in [include_str!("../../fixtures/workloads/siglip-encoder-f16-b1-t29-d64-h4-m96-l3.toml"), include_str!("../../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml")] {
            let (_, l, _, _) = built(text);
            let l = &l.value;
            let n = l.buffers.len();
            let tile = |b: u32| l.buffers[b as usize].tile.min(l.tiles);
            let mut opposites = vec![std::collections::BTreeSet::new(); n];
            let mut receives = vec![false; n];
            for phase in &l.phases {
                let sends: std::collections::BTreeSet<u32> = phase.iter().map(|t| t.source.0).collect();
                let received: std::collections::BTreeSet<u32> = phase.iter().flat_map(|t| t.destinations.iter().map(|d| d.0)).collect();
                for &r in &received {
                    receives[r as usize] = true;
                }
                for &s in &sends {
                    for &r in received.iter().filter(|&&r| r != s && tile(r) == tile(s)) {
                        opposites[s as usize].insert(r);
                        opposites[r as usize].insert(s);
                    }
                }
            }
            let rules = exchange_rules(l, 4096);
            let expected: Vec<Vec<u32>> = opposites.into_iter().map(|o| o.into_iter().collect()).collect();
            assert!(expected.iter().any(|o| !o.is_empty()));
            assert_eq!(*rules.opposites, expected);
            assert_eq!(*rules.receives, receives);
            assert_eq!(rules.receive_offset, 4096);
        }
    }

    /// Packed sizings kept for a rebuild (`keep_packings`) equal those made afresh, are taken
    /// where everything a phase's packing reads is unchanged, and are made again for the
    /// phases a moved buffer touches; a memo not asked to keep them keeps none.
    #[test]
    fn packed_sizings_kept_for_a_rebuild_equal_those_made_afresh() {
        let (target, l, s, _) = built(include_str!("../../fixtures/workloads/siglip-encoder-f16-b1-t29-d64-h4-m96-l3.toml"));
        let (phases, digests) = (&s.value.phases, Some(s.value.digests.as_slice()));
        let fresh = crate::sizing::sizing_tables(&target, &l.value, phases, digests, None).unwrap();
        let memo = RelativeMemo::default();
        assert_eq!(crate::sizing::sizing_tables(&target, &l.value, phases, digests, Some(&memo)).unwrap(), fresh);
        assert_eq!(memo.packed_len(), 0, "a cold build keeps no packings");
        memo.keep_packings(true);
        assert_eq!(crate::sizing::sizing_tables(&target, &l.value, phases, digests, Some(&memo)).unwrap(), fresh);
        let made = memo.packed_len();
        assert_eq!(made, l.value.phases.len());
        memo.keep_used();
        assert_eq!(crate::sizing::sizing_tables(&target, &l.value, phases, digests, Some(&memo)).unwrap(), fresh);
        assert_eq!(memo.packed_len(), made, "every packing taken, none made");
        // One buffer that a phase sends from grows: the buffers after it on its tile move, and
        // the phases touching them are packed again, as a fresh sizing packs them.
        let mut moved: Lowered = (*l.value).clone();
        let source = moved.phases.iter().flat_map(|p| p.iter()).map(|t| t.source.0).next().expect("a transfer");
        moved.buffers[source as usize].bytes += 64;
        let fresh_moved = crate::sizing::sizing_tables(&target, &moved, phases, digests, None).unwrap();
        assert_ne!(fresh_moved, fresh);
        assert_eq!(crate::sizing::sizing_tables(&target, &moved, phases, digests, Some(&memo)).unwrap(), fresh_moved);
        assert!(memo.packed_len() > made);
    }

    /// Relative tables taken from the memo the table screen's sizing left (the same program,
    /// schedules and exchange view) write the same tables as those made afresh, and the
    /// screen's sizing of repeated layers leaves entries there.
    #[test]
    fn relative_tables_from_the_screens_memo_write_the_same_tables() {
        let (target, l, s, p) = built(include_str!("../../fixtures/workloads/siglip-encoder-f16-b1-t29-d64-h4-m96-l3.toml"));
        let memo = RelativeMemo::default();
        // The sizing view (another view of the same target): its entries serve the selection's.
        let sized = crate::sizing::table_bytes_memoized(&target.lowering_view(), &l.value, &s.value.phases, Some(&s.value.digests), u32::MAX, Some(&memo)).unwrap().unwrap();
        assert_eq!(sized, crate::sizing::table_bytes_checked(&target, &l.value, &s.value.phases, Some(&s.value.digests), u32::MAX).unwrap().unwrap());
        assert!(!memo.is_empty(), "three layers share patterns");
        let shared = memo.len();
        let taken = relocation_memoized(&target.selection_view(), &l.value, &s.value.phases, &s.value.digests, Some(&memo)).unwrap();
        let fresh = relocation(&target, &l.value, &s.value.phases, &s.value.digests).unwrap();
        assert_eq!(taken.tables(&target, &l.value, &s.value.phases, &p.value).unwrap(), fresh.tables(&target, &l.value, &s.value.phases, &p.value).unwrap());
        assert!(memo.len() >= shared);
        // Kept for a rebuild: what was used stays, and taking it again makes nothing new.
        let used = memo.len();
        memo.keep_used();
        assert_eq!(memo.len(), used);
        let again = relocation_memoized(&target.selection_view(), &l.value, &s.value.phases, &s.value.digests, Some(&memo)).unwrap();
        assert_eq!(memo.len(), used);
        assert_eq!(again.tables(&target, &l.value, &s.value.phases, &p.value).unwrap(), fresh.tables(&target, &l.value, &s.value.phases, &p.value).unwrap());
        // Kept again (the second relocation took them all); then a build that takes none of
        // them leaves none.
        memo.keep_used();
        assert_eq!(memo.len(), used);
        memo.keep_used();
        assert!(memo.is_empty());
        memo.clear();
        assert!(memo.is_empty());
    }

    /// Placed phase statistics kept for a rebuild (`RelativeMemo::for_statistics`) score a
    /// placement exactly as measuring its tables does: taken where every address a phase's
    /// tables are written from is unchanged (its tables still written where kept), measured
    /// again where a buffer moved; a memo not asked to keep them serves none.
    #[test]
    fn placed_phase_statistics_kept_for_a_rebuild_score_as_measured() {
        let (target, l, s, p) = built(include_str!("../../fixtures/workloads/siglip-encoder-f16-b1-t29-d64-h4-m96-l3.toml"));
        let phases = &s.value.phases;
        let relocated = relocation(&target, &l.value, phases, &s.value.digests).unwrap();
        let (tables, summary, stats) = written(&target, &l.value, phases, &p.value, Some(&relocated), true, None).unwrap();
        let memo = RelativeMemo::default();
        assert!(memo.for_statistics(&target).is_none(), "a cold build keeps none");
        memo.keep_packings(true);
        let (m, scope) = memo.for_statistics(&target).expect("kept for a rebuild");
        let first = written(&target, &l.value, phases, &p.value, Some(&relocated), false, Some((m, &scope))).unwrap();
        assert_eq!((&first.1, &first.2), (&summary, &stats));
        let made = memo.stats_len();
        assert!(made > 0 && made <= phases.len());
        memo.keep_used();
        // Every phase taken: the same score, the kept tables written as before, none made.
        let again = written(&target, &l.value, phases, &p.value, Some(&relocated), true, Some((m, &scope))).unwrap();
        assert_eq!(again.0, tables);
        assert_eq!((&again.1, &again.2), (&summary, &stats));
        assert_eq!(memo.stats_len(), made);
        // The buffers a phase's tiles send from move onto ones those tiles receive into in
        // that phase (one element for both): the phases they touch are measured again, as
        // measuring afresh measures them.
        let tile = |b: u32| l.value.buffers[b as usize].tile;
        let mut moved: Placement = (*p.value).clone();
        for phase in l.value.phases.iter() {
            for t in phase.iter() {
                if let Some(d) = phase.iter().flat_map(|u| u.destinations.iter()).find(|d| tile(d.0) == tile(t.source.0) && d.0 != t.source.0) {
                    moved.addresses[t.source.0 as usize] = p.value.addresses[d.0 as usize];
                }
            }
        }
        let fresh = written(&target, &l.value, phases, &moved, Some(&relocated), false, None).unwrap();
        assert_ne!(fresh.2, stats, "the move changes some phase's statistics");
        let taken = written(&target, &l.value, phases, &moved, Some(&relocated), false, Some((m, &scope))).unwrap();
        assert_eq!((&taken.1, &taken.2), (&fresh.1, &fresh.2));
        assert!(memo.stats_len() > made);
        // Another target (other memory elements) keys apart.
        let mut other = target.clone();
        other.memory.element_bytes /= 2;
        let (_, other_scope) = memo.for_statistics(&other).unwrap();
        assert_ne!(other_scope, scope);
    }

    /// Tiles placed through a rebuilding process's memo (`storage::place_storage_memoized`)
    /// are placed as afresh, with and without exchange rules: taken where a tile's buffers,
    /// rules and data start are unchanged, placed again where one of its buffers grew.
    #[test]
    fn tiles_placed_through_the_memo_are_placed_as_afresh() {
        let (target, l, _, _) = built(include_str!("../../fixtures/workloads/siglip-encoder-f16-b1-t29-d64-h4-m96-l3.toml"));
        let code = vec![2048u32; l.value.tiles as usize];
        let memo = RelativeMemo::default();
        memo.keep_packings(true);
        let (m, scope) = memo.for_statistics(&target).unwrap();
        for rules in [ExchangeRules::default(), exchange_rules(&l.value, 0), exchange_rules(&l.value, 4096)] {
            let fresh = crate::storage::place_storage_with(&target, &l.value, &code, &rules).unwrap();
            let before = memo.tiles_len();
            assert_eq!(crate::storage::place_storage_memoized(&target, &l.value, &code, &rules, Some((m, &scope))).unwrap(), fresh);
            let made = memo.tiles_len();
            assert!(made > before);
            assert_eq!(crate::storage::place_storage_memoized(&target, &l.value, &code, &rules, Some((m, &scope))).unwrap(), fresh);
            assert_eq!(memo.tiles_len(), made, "every tile taken");
            // One buffer grows: its tile is placed again, as afresh.
            let mut grown: Lowered = (*l.value).clone();
            let b = grown.buffers.iter().position(|b| b.bytes > 0).unwrap();
            grown.buffers[b].bytes += 64;
            let fresh = crate::storage::place_storage_with(&target, &grown, &code, &rules).unwrap();
            assert_eq!(crate::storage::place_storage_memoized(&target, &grown, &code, &rules, Some((m, &scope))).unwrap(), fresh);
            assert_eq!(memo.tiles_len(), made + 1);
        }
        // Code that moves a tile's data start places it again; code within the same granule does not.
        let mut more = code.clone();
        more[0] += 16;
        let n = memo.tiles_len();
        let rules = ExchangeRules::default();
        assert_eq!(crate::storage::place_storage_memoized(&target, &l.value, &more, &rules, Some((m, &scope))).unwrap(), crate::storage::place_storage_with(&target, &l.value, &more, &rules).unwrap());
        assert_eq!(memo.tiles_len(), n);
        more[0] += crate::storage::DATA_START_GRANULE;
        assert_eq!(crate::storage::place_storage_memoized(&target, &l.value, &more, &rules, Some((m, &scope))).unwrap(), crate::storage::place_storage_with(&target, &l.value, &more, &rules).unwrap());
        assert_eq!(memo.tiles_len(), n + 1);
    }

    /// A candidate that does not keep its tables (each phase written, measured and dropped in
    /// turn) scores exactly as one that keeps them, with and without relative tables, and its
    /// tables written again (should it win) are the ones it would have kept.
    #[test]
    fn candidates_measured_phase_by_phase_score_as_kept_tables_do() {
        let (target, l, s, p) = built(include_str!("../../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml"));
        let relocated = relocation(&target, &l.value, &s.value.phases, &s.value.digests).unwrap();
        for relocation in [None, Some(&relocated)] {
            let (kept, kept_summary, kept_stats) = written(&target, &l.value, &s.value.phases, &p.value, relocation, true, None).unwrap();
            let (none, summary, stats) = written(&target, &l.value, &s.value.phases, &p.value, relocation, false, None).unwrap();
            let kept = kept.expect("kept tables");
            assert!(none.is_none());
            assert!(!kept.is_empty());
            assert_eq!((&summary, &stats), (&kept_summary, &kept_stats));
            assert_eq!(score(&summary, &stats), score(&kept_summary, &kept_stats));
            assert_eq!(write_all(&target, &l.value, &s.value.phases, &p.value, relocation).unwrap(), kept);
            assert_eq!(horizons(&summary), kept.iter().map(|t| t.horizon).collect::<Vec<_>>());
        }
    }
}

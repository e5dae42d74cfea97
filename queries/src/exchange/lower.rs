//! Lowering: an address-free schedule plus this phase's addresses become the per-tile send and
//! receive tables the device executes.
//!
//! Pieces become entries; entries that continue each other on one tile (next cycle, next
//! address, same width and, for receives, same source) are joined, which is why sticky
//! schedules give short rows. The output is sorted and deterministic. This module must not
//! change any cycle: it only writes down what the schedule says.
//!
//! Row size: the device reads a send entry as 3 words (cycle, address, words with the paired
//! flag in the top bit) and a receive entry as 4 words (cycle, source, address, words and
//! flag); a tile's `row_words` is the sum over its entries.

use tracing::info;

use crate::package::{ExchangePhase, ReceiveEntry, SendEntry, TileExchange};
use crate::target::Target;

use super::problem::{alignment_class, prepare, prepare_for_fit, Problem};
use super::validate::validate;
use super::types::{Destination, ExchangeError, PhaseRequest, Schedule, ScheduleKind, Transfer};

pub const SEND_ENTRY_WORDS: u32 = 3;
pub const RECEIVE_ENTRY_WORDS: u32 = 4;

/// Table size of one tile in words.
pub fn table_row_words(tile: &TileExchange) -> u32 {
    tile.sends.len() as u32 * SEND_ENTRY_WORDS + tile.receives.len() as u32 * RECEIVE_ENTRY_WORDS
}

/// The tile with the largest table and its size in words (lowest tile on ties).
pub fn row_words(tables: &ExchangePhase) -> (u32, u32) {
    tables.tiles.iter().map(|t| (t.tile, table_row_words(t))).fold((0, 0), |best, (tile, w)| if w > best.1 { (tile, w) } else { best })
}

/// Write the tables of a schedule with the phase's addresses (see the module header), and log
/// the largest row.
pub fn lower_to_tables(target: &Target, phase: &PhaseRequest, schedule: &Schedule) -> ExchangePhase {
    let tables = write_tables(target, phase, schedule);
    log_finished(&tables);
    tables
}

fn log_finished(tables: &ExchangePhase) {
    let (tile, words) = row_words(tables);
    info!(phase = tables.index, tile, row_words = words, horizon = tables.horizon, "finished large physical exchange phase");
}

fn write_tables(target: &Target, phase: &PhaseRequest, schedule: &Schedule) -> ExchangePhase {
    // Entries carry their transfer: only entries of one transfer (one source buffer, one
    // destination buffer each) are joined, so an entry never spans two allocations that
    // placement happened to put side by side.
    let (mut sends, mut receives) = entries(target, phase, schedule, |transfer, _| transfer, |t| t.source_address, |d| d.address);
    let mut out = Vec::new();
    let mut horizon = 0;
    for tile in 0..target.chip.tiles as usize {
        let (mut s, mut r) = (std::mem::take(&mut sends[tile]), std::mem::take(&mut receives[tile]));
        if s.is_empty() && r.is_empty() {
            continue;
        }
        s.sort_unstable_by_key(|(t, e)| (e.cycle, e.address, *t));
        r.sort_unstable_by_key(|(t, e)| (e.cycle, e.source, e.address, *t));
        let s: Vec<SendEntry> = join_keyed(s).into_iter().map(|(_, e)| e).collect();
        let r: Vec<ReceiveEntry> = join_keyed(r).into_iter().map(|(_, e)| e).collect();
        horizon = r.iter().map(ReceiveEntry::end).fold(horizon, u32::max);
        out.push(TileExchange { tile: tile as u32, sends: s, receives: r });
    }
    ExchangePhase { index: phase.index, tiles: out, horizon, endpoint_lower_bound: schedule.endpoint_lower_bound }
}

/// Each tile's send and receive entries of a schedule, unsorted, each beside its transfer
/// (receives: beside `key(transfer, destination index)`), with addresses from
/// `source_address` and `destination_address` plus the piece's offset (wrapping). A piece
/// naming a transfer that does not exist is skipped (the validator then reports the words it
/// fails to deliver), as are tiles past the chip.
#[allow(clippy::type_complexity)]
fn entries<K>(
    target: &Target,
    phase: &PhaseRequest,
    schedule: &Schedule,
    key: impl Fn(u32, u32) -> K,
    source_address: impl Fn(&Transfer) -> u32,
    destination_address: impl Fn(&Destination) -> u32,
) -> (Vec<Vec<(u32, SendEntry)>>, Vec<Vec<(K, ReceiveEntry)>>) {
    let tiles = target.chip.tiles as usize;
    let mut sends: Vec<Vec<(u32, SendEntry)>> = vec![Vec::new(); tiles];
    let mut receives: Vec<Vec<(K, ReceiveEntry)>> = (0..tiles).map(|_| Vec::new()).collect();
    for piece in schedule.pieces.iter() {
        let Some(t) = phase.transfers.get(piece.transfer as usize) else { continue };
        if t.source as usize >= tiles {
            continue;
        }
        let offset = piece.offset_words.wrapping_mul(4);
        sends[t.source as usize].push((piece.transfer, SendEntry { cycle: piece.send_cycle, address: source_address(t).wrapping_add(offset), words: piece.words, paired: piece.paired }));
        for (d, destination) in t.destinations.iter().enumerate().filter(|(_, d)| (d.tile as usize) < tiles) {
            receives[destination.tile as usize].push((key(piece.transfer, d as u32), ReceiveEntry {
                cycle: piece.send_cycle + target.delay(t.source, destination.tile),
                source: t.source,
                address: destination_address(destination).wrapping_add(offset),
                words: piece.words,
                paired: piece.paired,
            }));
        }
    }
    (sends, receives)
}

fn cycles(words: u32, paired: bool) -> u32 {
    if paired {
        words / 2
    } else {
        words
    }
}

/// A table entry that the next entry of its transfer may continue (next cycle, next address,
/// same width and, for receives, same source): then the two are written as one.
trait Entry {
    fn continued_by(&self, next: &Self) -> bool;
    /// Takes `next`'s words (`next` continues this entry).
    fn absorb(&mut self, next: &Self);
}

impl Entry for SendEntry {
    fn continued_by(&self, next: &Self) -> bool {
        self.paired == next.paired && self.cycle + cycles(self.words, self.paired) == next.cycle && self.address.wrapping_add(self.words * 4) == next.address
    }
    fn absorb(&mut self, next: &Self) {
        self.words += next.words;
    }
}

impl Entry for ReceiveEntry {
    fn continued_by(&self, next: &Self) -> bool {
        self.paired == next.paired && self.source == next.source && self.cycle + cycles(self.words, self.paired) == next.cycle && self.address.wrapping_add(self.words * 4) == next.address
    }
    fn absorb(&mut self, next: &Self) {
        self.words += next.words;
    }
}

impl ReceiveEntry {
    /// The cycle after the entry's last word lands.
    fn end(&self) -> u32 {
        self.cycle + cycles(self.words, self.paired)
    }
}

/// Sorted entries with their keys (transfer, or transfer and destination), each joined into
/// the previous one when both have one key and the previous is continued by it.
fn join_keyed<K: PartialEq + Copy, E: Entry>(entries: Vec<(K, E)>) -> Vec<(K, E)> {
    let mut out: Vec<(K, E)> = Vec::with_capacity(entries.len());
    for (key, e) in entries {
        if let Some(last) = out.last_mut().filter(|l| l.0 == key) {
            if last.1.continued_by(&e) {
                last.1.absorb(&e);
                continue;
            }
        }
        out.push((key, e));
    }
    out
}

/// Whether a cached schedule can be replayed on this phase: same transfer count, pieces
/// inside their transfers, paired pieces only where the new addresses allow them.
pub(crate) fn check_fits(problem: &Problem, phase: &PhaseRequest, schedule: &Schedule) -> Result<(), ExchangeError> {
    let mismatch = |message: String| ExchangeError::CachedMismatch { phase: phase.index, message };
    for (i, p) in schedule.pieces.iter().enumerate() {
        let Some(job) = problem.jobs.get(p.transfer as usize) else {
            return Err(mismatch(format!("piece {i} names transfer {}, the phase has {}", p.transfer, problem.jobs.len())));
        };
        if p.words == 0 || p.offset_words as u64 + p.words as u64 > job.words as u64 {
            return Err(mismatch(format!("piece {i} covers words {}..{} of transfer {} ({} words)", p.offset_words, p.offset_words as u64 + p.words as u64, p.transfer, job.words)));
        }
        if p.paired && (!problem.eligible(p.transfer as usize) || alignment_class(phase, p.transfer as usize) != 0 || p.words % 2 != 0 || p.offset_words % 2 != 0) {
            return Err(mismatch(format!("piece {i} is paired but transfer {} can no longer go paired (alignment moved)", p.transfer)));
        }
    }
    Ok(())
}

/// Patch this phase's addresses into a cached schedule without logging; `check` also
/// validates the tables (placement candidates are scored unchecked, finalists checked).
/// `written`: the tables an unchecked `relocate` already wrote for this phase and schedule,
/// taken instead of writing them again (and with `check`, checked as written ones are).
pub fn relocate(target: &Target, phase: &PhaseRequest, cached: &Schedule, check: bool, written: Option<ExchangePhase>) -> Result<ExchangePhase, ExchangeError> {
    if !check {
        return Ok(written.unwrap_or_else(|| write_tables(target, phase, cached)));
    }
    let problem = prepare_for_fit(target, phase)?;
    relocate_checked(target, &problem, phase, cached, written)
}

/// The checks `relocate` with `check` makes (schedule fit, validation) on tables an unchecked
/// `relocate` wrote for this phase and schedule, without taking them: `relocate(…, true,
/// Some(tables))` returns `tables` exactly when this is `Ok`.
pub fn check_relocated(target: &Target, phase: &PhaseRequest, cached: &Schedule, tables: &ExchangePhase) -> Result<(), ExchangeError> {
    let problem = prepare_for_fit(target, phase)?;
    check_fits(&problem, phase, cached)?;
    validate(target, phase, tables).map_err(|source| ExchangeError::Invalid { phase: phase.index, source })
}

/// `relocate` with `check`, on the phase's already prepared problem (tables written here
/// unless `written` holds them).
fn relocate_checked(target: &Target, problem: &Problem, phase: &PhaseRequest, cached: &Schedule, written: Option<ExchangePhase>) -> Result<ExchangePhase, ExchangeError> {
    check_fits(problem, phase, cached)?;
    let tables = written.unwrap_or_else(|| write_tables(target, phase, cached));
    validate(target, phase, &tables).map_err(|source| ExchangeError::Invalid { phase: phase.index, source })?;
    Ok(tables)
}

/// The log lines of `reuse`, for tables validated elsewhere (the exchange-placement search
/// validates the tables of the placement it accepts).
pub fn log_validated(phase: u32, cached: &Schedule, tables: &ExchangePhase) {
    info!(phase, "reused exchange optimization after validating relocated rows");
    super::log_optimized(phase, cached.horizon, tables.horizon, cached.endpoint_lower_bound, ScheduleKind::Reused, 0);
    log_finished(tables);
}

/// Replay a cached schedule of an identical pattern with this phase's addresses: patch,
/// validate, and return the tables. Fails when the schedule does not fit (then schedule anew).
pub fn reuse(target: &Target, phase: &PhaseRequest, cached: &Schedule) -> Result<ExchangePhase, ExchangeError> {
    let problem = prepare(target, phase)?;
    let tables = relocate_checked(target, &problem, phase, cached, None)?;
    info!(phase = phase.index, "reused exchange optimization after validating relocated rows");
    info!(phase = phase.index, transfers = phase.transfers.len(), maximum_identical_destinations = problem.maximum_identical_destinations(), "prepared large physical exchange phase");
    super::log_optimized(phase.index, cached.horizon, tables.horizon, cached.endpoint_lower_bound, ScheduleKind::Reused, 0);
    log_finished(&tables);
    Ok(tables)
}

/// A schedule's tables for one pattern of transfers (source tiles, words, destination tiles),
/// with every address left as an offset from its transfer's base (the source address, or the
/// destination's address): what `write_tables` writes for any addresses of that pattern,
/// sorted and joined as it sorts and joins them. Phases of one pattern scheduled alike (the
/// same phase of repeated layers) share it; each placement only adds its bases (`apply`).
///
/// `write_tables` sorts a tile's entries by cycle, then address: the order depends on the
/// addresses only where two entries of a tile share a cycle (sends) or a cycle and a source
/// (receives), which no valid schedule has (a port carries one thing per cycle); it joins
/// entries of one transfer whose addresses continue each other, which for one base is
/// offsets continuing each other. So the relative tables are exact unless some tile has such
/// a tie, or some transfer names a destination tile twice (then two bases meet on one tile):
/// for those `relative_tables` gives `None` and the phase is written as before.
#[derive(Clone, Debug)]
pub struct RelativeTables {
    tiles: Vec<RelativeTile>,
    horizon: u32,
}

/// One tile's entries, addresses as offsets (bytes, wrapping) from the base of the transfer
/// named beside each (sends: transfer; receives: transfer and destination index).
#[derive(Clone, Debug)]
struct RelativeTile {
    tile: u32,
    sends: Vec<(u32, SendEntry)>,
    receives: Vec<((u32, u32), ReceiveEntry)>,
}

/// The relative tables of `schedule` over the pattern of `phase` (its addresses are not
/// read), or `None` where they would not be exact (see [`RelativeTables`]).
pub fn relative_tables(target: &Target, phase: &PhaseRequest, schedule: &Schedule) -> Option<RelativeTables> {
    let tiles = target.chip.tiles as usize;
    let mut seen = vec![u32::MAX; tiles];
    for (index, t) in phase.transfers.iter().enumerate() {
        for d in t.destinations.iter().filter(|d| (d.tile as usize) < tiles) {
            if std::mem::replace(&mut seen[d.tile as usize], index as u32) == index as u32 {
                return None;
            }
        }
    }
    let (mut sends, mut receives) = entries(target, phase, schedule, |transfer, d| (transfer, d), |_| 0, |_| 0);
    let mut out = Vec::new();
    let mut horizon = 0;
    for tile in 0..tiles {
        let (mut s, mut r) = (std::mem::take(&mut sends[tile]), std::mem::take(&mut receives[tile]));
        if s.is_empty() && r.is_empty() {
            continue;
        }
        s.sort_unstable_by_key(|(t, e)| (e.cycle, *t, e.address));
        r.sort_unstable_by_key(|(t, e)| (e.cycle, e.source, *t, e.address));
        if s.windows(2).any(|w| w[0].1.cycle == w[1].1.cycle) || r.windows(2).any(|w| (w[0].1.cycle, w[0].1.source) == (w[1].1.cycle, w[1].1.source)) {
            return None;
        }
        let (s, r) = (join_keyed(s), join_keyed(r));
        horizon = r.iter().map(|(_, e)| e.end()).fold(horizon, u32::max);
        out.push(RelativeTile { tile: tile as u32, sends: s, receives: r });
    }
    Some(RelativeTables { tiles: out, horizon })
}

impl RelativeTables {
    /// The tables `write_tables` writes for phase `index` of this pattern and schedule, where
    /// transfer `t` sends from `source(t)` and its destination `d` receives at
    /// `destination(t, d)`: the same tables, entry for entry.
    pub fn apply(&self, index: u32, endpoint_lower_bound: u32, source: impl Fn(u32) -> u32, destination: impl Fn(u32, u32) -> u32) -> ExchangePhase {
        let tiles = self
            .tiles
            .iter()
            .map(|t| TileExchange {
                tile: t.tile,
                sends: t.sends.iter().map(|&(transfer, e)| SendEntry { address: source(transfer).wrapping_add(e.address), ..e }).collect(),
                receives: t.receives.iter().map(|&((transfer, d), e)| ReceiveEntry { address: destination(transfer, d).wrapping_add(e.address), ..e }).collect(),
            })
            .collect();
        ExchangePhase { index, tiles, horizon: self.horizon, endpoint_lower_bound }
    }
}

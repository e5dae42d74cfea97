//! Exchange phases: checking the send and receive tables at load time, and moving the words.
//!
//! The checks have word-level meaning but work on runs (one interval per table entry, sorted):
//! - a tile's send port carries one run at a time; a paired send (two words per cycle for
//!   `words / 2` cycles) also holds the supertile partner's send port;
//! - a tile's receive port (its incoming mux) listens to one run at a time; a paired receive
//!   also holds the partner's port, where it may overlap only paired receives of the same
//!   source and delay (the supertile hearing one stream together: the same words in the same
//!   cycles), and a tile's own entries never overlap (each incoming word is stored once);
//! - each receive starting at cycle `c` from `source` is covered, word for word, by sends of
//!   `source` that start at `c - delay(source, tile)`, of the same width, back to back;
//! - every entry is word aligned (paired: even words, 8-byte aligned) and lies in tensor storage
//!   that is live at the phase's step; a run descriptor's entries lie in one such buffer, and
//!   its own entries break none of these rules among themselves, which is checked on the
//!   descriptor before it is expanded (`check_runs`: a run is the format's rows of one buffer,
//!   and a hostile count must not cost an expansion first);
//! - the byte rules (overlapping receive writes, read-after-write hazards, unreceived sends)
//!   live in `rules.rs`.
//!
//! A violation is an error naming the phase, the tile and the cycle: on hardware it would be a
//! hang or corrupted data. Because no send may read a byte written earlier in the same phase
//! (`rules::read_after_write`), reading every source as it was when the phase began gives
//! exactly the words each send reads at its own cycle. This module must not estimate costs: the
//! phase's horizon is recomputed from the tables, and the caller charges it.

use std::collections::BTreeMap;

use ipuq_queries::package::{ExchangePhase, SendEntry, TileExchange};
use ipuq_queries::tables::PackedPhase;
use ipuq_queries::target::Target;
use rayon::prelude::*;

use super::memory::{Need, TileMemory};
use super::rules;
use crate::device::DeviceError;

/// Bytes in one exchange word: the exchange moves 32-bit words (an ISA fact, not a tunable).
const WORD_BYTES: u64 = 4;

/// Words received by one tile from one source, at one arrival cycle.
struct Piece {
    source: usize,
    source_address: u32,
    address: u32,
    bytes: usize,
    arrival: u64,
}

/// A checked phase: what each tile receives, in arrival order, and how long it takes.
pub struct PhasePlan {
    pub horizon: u32,
    /// Per tile slot: the end of the tile's own last send or receive.
    pub busy: Vec<u64>,
    incoming: Vec<Vec<Piece>>,
    /// No tile receives into a byte that it sends from in this
    /// phase: every byte read is unchanged by the phase, so words can move straight from
    /// source to destination, in any order.
    disjoint: bool,
}

/// Whether no tile's received bytes overlap the bytes sent from it in the phase.
fn sends_and_receives_disjoint(tables: &BTreeMap<u32, &TileExchange>) -> bool {
    tables.values().all(|table| {
        let mut sent: Vec<(u64, u64)> = table.sends.iter().map(|s| (s.address as u64, s.address as u64 + s.words as u64 * WORD_BYTES)).collect();
        let mut received: Vec<(u64, u64)> = table.receives.iter().map(|r| (r.address as u64, r.address as u64 + r.words as u64 * WORD_BYTES)).collect();
        sent.sort_unstable();
        received.sort_unstable();
        // Sweep both sorted lists: any sent range that starts before a received range ends and
        // ends after it starts overlaps it.
        let mut j = 0;
        for &(start, end) in &sent {
            while j < received.len() && received[j].1 <= start {
                j += 1;
            }
            if received[j..].iter().take_while(|r| r.0 < end).any(|r| r.1 > start) {
                return false;
            }
        }
        true
    })
}

/// One run on a port, for overlap checks and their messages.
struct PortUse {
    start: u64,
    end: u64,
    /// The tile whose table holds the entry (the partner's, for paired use).
    owner: u32,
    source: Option<u32>,
    /// Paired receives: (source, delay). Runs with the same share hear the same words in the
    /// same cycles, so the two tiles of a supertile may both hold them.
    share: Option<(u32, u32)>,
}

fn describe(u: &PortUse, tile: u32) -> String {
    let from = u.source.map(|s| format!(" from tile {s}")).unwrap_or_default();
    let whose = if u.owner == tile { String::new() } else { format!("paired entry of partner tile {} ", u.owner) };
    format!("{whose}[{}, {}){from}", u.start, u.end)
}

/// Sweep each tile's port in start order. A run may overlap the runs in flight only when all
/// carry the same paired share and at most one of them is the tile's own entry (a tile
/// stores each incoming word once).
fn check_port(phase: u32, port: &str, ports: BTreeMap<u32, Vec<PortUse>>) -> Result<(), DeviceError> {
    for (tile, mut uses) in ports {
        uses.sort_by_key(|u| (u.start, u.end));
        let (mut reach, mut own_reach, mut holder): (u64, u64, Option<usize>) = (0, 0, None);
        for (i, u) in uses.iter().enumerate() {
            let own = u.owner == tile;
            if let Some(h) = holder.filter(|_| u.start < reach) {
                let shared = u.share.is_some() && u.share == uses[h].share;
                if !shared || (own && u.start < own_reach) {
                    return Err(DeviceError::Exchange {
                        phase,
                        tile,
                        cycle: u.start,
                        message: format!("{port} port used twice: {} overlaps {}", describe(&uses[h], tile), describe(u, tile)),
                    });
                }
            }
            if holder.is_none() || u.start >= reach || u.end > reach {
                holder = Some(i);
            }
            reach = reach.max(u.end);
            if own {
                own_reach = own_reach.max(u.end);
            }
        }
    }
    Ok(())
}

/// Cycles one entry of `words` words holds its port: at `per_cycle` words a cycle, or the
/// paired rate for a paired entry.
pub(crate) fn entry_cycles(target: &Target, words: u32, paired: bool, per_cycle: u32) -> u64 {
    let rate = if paired { target.exchange.paired_words_per_cycle } else { per_cycle };
    (words as u64).div_ceil(rate.max(1) as u64)
}

/// The run descriptors of a packed phase, before the device expands them:
/// - each run's entries, from its lowest address to its highest entry's end (a stride read as
///   signed, the compact tables' wrapping form of a descending run), lie in one tensor buffer
///   of the tile that is live at the phase's steps, as the package format defines a run (its
///   rows of one buffer, `tables.rs`);
/// - and a run's own entries break none of the rules `check_phase` applies to any two entries
///   of a tile: none is empty, consecutive ones do not overlap on the tile's port (the cycle
///   stride is at least one entry's duration), and a receive run's entries write no byte twice
///   (its address stride, either way, is at least one entry's bytes).
///
/// Every entry is checked again after expansion (`check_phase`), so these reject exactly
/// tables that would be rejected anyway; they make a hostile count (up to
/// `MAX_PHASE_ENTRIES`; a larger one is `unpack_phase`'s error) an error at once instead of an
/// expansion, a sort and a check of millions of entries first.
pub fn check_runs(target: &Target, packed: &PackedPhase, slots: &[Option<usize>], memories: &[TileMemory], labels: &[String], steps: &[u32]) -> Result<(), DeviceError> {
    let fail = |tile: u32, cycle: u32, message: String| DeviceError::Exchange { phase: packed.index, tile, cycle: cycle as u64, message };
    let x = &target.exchange;
    for t in &packed.tiles {
        let Some(slot) = slots.get(t.tile as usize).copied().flatten() else {
            return Err(fail(t.tile, 0, "tile has exchange tables but is not in the package".into()));
        };
        let memory = &memories[slot];
        let sends = t.sends.iter().map(|r| ("send", r.cycle, r.address, r.words, r.paired, r.count, r.cycle_stride, r.address_stride, x.send_words_per_cycle));
        let receives = t.receives.iter().map(|r| ("receive", r.cycle, r.address, r.words, r.paired, r.count, r.cycle_stride, r.address_stride, x.receive_words_per_cycle));
        for (kind, cycle, address, words, paired, count, cycle_stride, stride, per_cycle) in sends.chain(receives) {
            // A count past what a phase may expand is refused by `unpack_phase` by that reason,
            // before it expands anything of that run.
            if count < 2 || count as u64 > ipuq_queries::tables::MAX_PHASE_ENTRIES {
                continue;
            }
            if words == 0 {
                return Err(fail(t.tile, cycle, format!("a {kind} run of {count} empty entries")));
            }
            let cycles = entry_cycles(target, words, paired, per_cycle);
            if (cycle_stride as u64) < cycles {
                return Err(fail(t.tile, cycle, format!("a {kind} run of {count} entries {cycle_stride} cycles apart, each {cycles} cycles long: its entries overlap on the tile's {kind} port")));
            }
            let bytes = words as i64 * WORD_BYTES as i64;
            if kind == "receive" && (stride as i32 as i64).abs() < bytes {
                return Err(fail(t.tile, cycle, format!("a receive run of {count} entries {} bytes apart, each writing {bytes} bytes: its entries write the same bytes", stride as i32)));
            }
            let last = address as i64 + (count as i64 - 1) * stride as i32 as i64;
            let (low, high) = (last.min(address as i64), last.max(address as i64) + bytes);
            if low < 0 || high > 1 << 32 {
                return Err(fail(t.tile, cycle, format!("a {kind} run of {count} entries from {address:#x} by {} bytes leaves the 32-bit address space", stride as i32)));
            }
            memory
                .check(low as u64, high as u64, Need::Tensor, steps, labels)
                .map_err(|problem| fail(t.tile, cycle, format!("a {kind} run of {count} entries spans [{low:#x}, {high:#x}), which is not one buffer: it {problem}")))?;
        }
    }
    Ok(())
}

/// Check a phase's tables against the target and the tiles' allocations, and plan its moves.
/// `slots[tile]` is the memory index of each loaded tile.
/// `steps` are the program steps that run the phase: every entry must lie in storage live then.
pub fn check_phase(
    target: &Target,
    phase: &ExchangePhase,
    slots: &[Option<usize>],
    memories: &[TileMemory],
    labels: &[String],
    steps: &[u32],
) -> Result<PhasePlan, DeviceError> {
    let x = &target.exchange;
    let index = phase.index;
    let fail = |tile: u32, cycle: u64, message: String| DeviceError::Exchange { phase: index, tile, cycle, message };
    let duration = |words: u32, paired: bool, per_cycle: u32| entry_cycles(target, words, paired, per_cycle);
    let send_cycles = |e: &SendEntry| duration(e.words, e.paired, x.send_words_per_cycle);
    let slot_of = |tile: u32| slots.get(tile as usize).copied().flatten();

    let mut tables: BTreeMap<u32, &TileExchange> = BTreeMap::new();
    for table in &phase.tiles {
        if slot_of(table.tile).is_none() {
            return Err(fail(table.tile, 0, "tile has exchange tables but is not in the package".into()));
        }
        if tables.insert(table.tile, table).is_some() {
            return Err(fail(table.tile, 0, "tile has two exchange tables in one phase".into()));
        }
    }

    // Entry shape and memory bounds.
    for (&tile, table) in &tables {
        let memory = &memories[slot_of(tile).unwrap_or_default()];
        let sends = table.sends.iter().map(|s| ("send", s.cycle, s.address, s.words, s.paired));
        let receives = table.receives.iter().map(|r| ("receive", r.cycle, r.address, r.words, r.paired));
        for (kind, cycle, address, words, paired) in sends.chain(receives) {
            let cycle = cycle as u64;
            if words == 0 {
                return Err(fail(tile, cycle, format!("empty {kind} entry")));
            }
            if !(address as u64).is_multiple_of(WORD_BYTES) {
                return Err(fail(tile, cycle, format!("{kind} address {address:#x} is not word aligned")));
            }
            if paired && (words % 2 != 0 || !(address as u64).is_multiple_of(2 * WORD_BYTES)) {
                return Err(fail(tile, cycle, format!("paired {kind} of {words} words at {address:#x} needs an even word count and 8-byte alignment")));
            }
            let end = address as u64 + words as u64 * WORD_BYTES;
            memory
                .check(address as u64, end, Need::Tensor, steps, labels)
                .map_err(|problem| fail(tile, cycle, format!("{kind} range [{address:#x}, {end:#x}) {problem}")))?;
        }
    }

    // Port occupancy.
    let mut send_ports: BTreeMap<u32, Vec<PortUse>> = BTreeMap::new();
    let mut receive_ports: BTreeMap<u32, Vec<PortUse>> = BTreeMap::new();
    for (&tile, table) in &tables {
        let partner = target.partner(tile);
        for e in &table.sends {
            let run = |owner| PortUse { start: e.cycle as u64, end: e.cycle as u64 + send_cycles(e), owner, source: None, share: None };
            send_ports.entry(tile).or_default().push(run(tile));
            if e.paired {
                send_ports.entry(partner).or_default().push(run(tile));
            }
        }
        for r in &table.receives {
            let end = r.cycle as u64 + duration(r.words, r.paired, x.receive_words_per_cycle);
            let share = r.paired.then(|| (r.source, target.delay(r.source.min(target.chip.tiles - 1), tile)));
            let run = || PortUse { start: r.cycle as u64, end, owner: tile, source: Some(r.source), share };
            receive_ports.entry(tile).or_default().push(run());
            if r.paired {
                receive_ports.entry(partner).or_default().push(run());
            }
        }
    }
    check_port(index, "send", send_ports)?;
    check_port(index, "receive", receive_ports)?;
    let paired_rate = x.paired_words_per_cycle as u64;
    for (&tile, table) in &tables {
        rules::receive_overlaps(index, tile, &table.receives)?;
        rules::read_after_write(index, tile, &table.sends, &table.receives, paired_rate)?;
    }
    let mut coverage = rules::Coverage::default();

    // Match every receive with the sends that feed it.
    let sorted_sends: BTreeMap<u32, Vec<SendEntry>> = tables
        .iter()
        .map(|(&tile, t)| {
            let mut sends = t.sends.clone();
            sends.sort_by_key(|s| s.cycle);
            (tile, sends)
        })
        .collect();
    let mut incoming: Vec<Vec<Piece>> = (0..memories.len()).map(|_| Vec::new()).collect();
    let mut busy = vec![0u64; memories.len()];
    let mut horizon = 0u64;
    for (&tile, table) in &tables {
        let slot = slot_of(tile).unwrap_or_default();
        for s in &table.sends {
            busy[slot] = busy[slot].max(s.cycle as u64 + send_cycles(s));
        }
        for r in &table.receives {
            let arrival = r.cycle as u64;
            let end = arrival + duration(r.words, r.paired, x.receive_words_per_cycle);
            busy[slot] = busy[slot].max(end);
            horizon = horizon.max(end);
            let source_slot = slot_of(r.source)
                .ok_or_else(|| fail(tile, arrival, format!("receive names source tile {}, which is not in the package", r.source)))?;
            let delay = target.delay(r.source, tile) as u64;
            if arrival < delay {
                return Err(fail(tile, arrival, format!("receive from tile {} starts before any word could arrive (delay {delay})", r.source)));
            }
            let rate = if r.paired { x.paired_words_per_cycle } else { x.send_words_per_cycle } as u64;
            let sends = sorted_sends.get(&r.source).map(Vec::as_slice).unwrap_or_default();
            let mut cycle = arrival - delay;
            let mut remaining = r.words as u64;
            let mut address = r.address as u64;
            let mut next = sends.partition_point(|e| e.cycle as u64 <= cycle).checked_sub(1);
            while remaining > 0 {
                let covering = next.and_then(|i| sends.get(i)).filter(|e| {
                    let start = e.cycle as u64;
                    start <= cycle && cycle < start + send_cycles(e) && e.paired == r.paired
                });
                let Some(e) = covering else {
                    let width = if r.paired { "paired" } else { "single" };
                    return Err(fail(
                        tile,
                        cycle + delay,
                        format!("receive expects a {width} word from tile {} sent at cycle {cycle}, but that tile sends no such word then", r.source),
                    ));
                };
                let offset = cycle - e.cycle as u64;
                let available = (send_cycles(e) - offset) * rate;
                let words = available.min(remaining).min(e.words as u64 - offset * rate);
                coverage.hear(r.source, next.unwrap_or_default(), offset * rate, words);
                incoming[slot].push(Piece {
                    source: source_slot,
                    source_address: (e.address as u64 + offset * rate * WORD_BYTES) as u32,
                    address: address as u32,
                    bytes: (words * WORD_BYTES) as usize,
                    arrival: cycle + delay,
                });
                cycle += words.div_ceil(rate);
                remaining -= words;
                address += words * WORD_BYTES;
                next = next.map(|i| i + 1);
            }
        }
    }
    coverage.check_all_heard(index, &sorted_sends, paired_rate)?;
    for pieces in &mut incoming {
        pieces.sort_by_key(|p| p.arrival);
    }
    let horizon = u32::try_from(horizon)
        .map_err(|_| fail(0, horizon, "the phase's horizon does not fit in 32 bits".into()))?;
    let disjoint = sends_and_receives_disjoint(&tables);
    Ok(PhasePlan { horizon, busy, incoming, disjoint })
}

/// Move the phase's words: gather from every source as it was when the phase began, then
/// write each tile's incoming pieces in arrival order. When no tile receives into bytes sent
/// in the phase (`PhasePlan::disjoint`), no byte read changes during the phase, so the words
/// move straight from source to destination, without the intermediate copy.
pub fn execute(plan: &PhasePlan, memories: &mut [TileMemory]) {
    if plan.disjoint {
        let tiles = TileMemory::raw_parts(memories);
        plan.incoming.par_iter().enumerate().for_each(|(slot, pieces)| {
            for p in pieces {
                // SAFETY: `check_phase` checked every source and destination range against its
                // tile's allocations (so inside its memory), a tile's receives never overlap
                // (`rules::receive_overlaps`), and no received byte is a sent byte
                // (`disjoint`): this task is the only writer of its tile's received bytes,
                // and no task writes a byte that any task reads. `memories` is exclusively
                // borrowed for the whole loop, so nothing else touches these bytes.
                unsafe { tiles.copy(p.source, p.source_address, slot, p.address, p.bytes) };
            }
        });
        return;
    }
    let snapshot: &[TileMemory] = memories;
    let gathered: Vec<Vec<u8>> = plan
        .incoming
        .par_iter()
        .map(|pieces| {
            let mut buffer = Vec::with_capacity(pieces.iter().map(|p| p.bytes).sum());
            for p in pieces {
                buffer.extend_from_slice(snapshot[p.source].range(p.source_address, p.bytes));
            }
            buffer
        })
        .collect();
    memories.par_iter_mut().zip(plan.incoming.par_iter()).zip(gathered).for_each(|((memory, pieces), buffer)| {
        let mut at = 0;
        for p in pieces {
            memory.range_mut(p.address, p.bytes).copy_from_slice(&buffer[at..at + p.bytes]);
            at += p.bytes;
        }
    });
}

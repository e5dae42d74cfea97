//! Compact exchange tables: the form the package and the tile images carry.
//!
//! A tile's table for one phase is a list of run descriptors, sends and receives apart, each
//! list grouped by entry shape (width, source, pairing, buffer) and in cycle order within a
//! group, so one stream's rows interleaved with another's still form a run. A run is `count`
//! entries of the same width (and, for receives, the same source) in one buffer, entry i at
//! `cycle + i * cycle_stride` and `address + i * address_stride` (wrapping): contiguous and
//! strided rows are one descriptor, not one entry each. Runs are chosen by an exact dynamic
//! program (fewest encoded bytes for a sorted entry list cut into arithmetic runs), so equal
//! tables always give equal runs.
//!
//! Runs never span two buffers, and a descriptor's address is relative to the start of the
//! buffer it addresses (the run's base slot): a phase's runs on a tile, hence its encoded
//! segment, depend on what it moves where within its buffers, never on where the buffers
//! were placed. Slots are numbered in order of first use among the phase's transfers (the
//! lowering's order, the same for repeated layers), so the same phase of repeated layers and
//! blocks has the same segment wherever their buffers land.
//!
//! The device executes runs: it decodes them from the tile's image (`decode_tile`) and
//! expands each descriptor itself (`unpack_phase`), with a limit on the entries it will expand
//! and no arithmetic that can panic on hostile values.
//!
//! Encoded in a tile image (`encode_tile`), a single entry is 3 words (cycle,
//! `offset | slot << 20`, `words | source << 20 | paired << 31`) and a run 6 (the same with
//! bit 19 set, then count, cycle stride, address stride; any count but 1 is written as a run,
//! and the decoder refuses runs of fewer than 2). The offset (from the slot's buffer start)
//! must fit 20 bits and the slot 12 (an encoding error otherwise). A tile's tables are a
//! binding per phase (phase, segment offset, base-list offset, base count), then the distinct
//! base lists (each base a buffer's start address, one word per slot), then the distinct
//! segments (send and receive descriptor counts, then the descriptors); phases with equal
//! segments share one, each binding supplying its own buffers' bases.
//!
//! This file is long (about 830 lines, 180 of them tests) because the packing, its moved form
//! for repeated phases (`rebased_phase`), the encoding and the device's expansion must agree
//! exactly, so they are kept and tested side by side.

use crate::package::{ExchangePhase, ReceiveEntry, SendEntry, TileExchange};

/// Bytes of an encoded single entry and of an encoded run.
pub const ENTRY_BYTES: u32 = 12;
pub const RUN_BYTES: u32 = 24;
/// Bytes of one binding (phase, segment offset, base-list offset, base count), of one base in
/// a base list, and of a segment header (send and receive descriptor counts).
pub const BINDING_BYTES: u32 = 16;
pub const BASE_BYTES: u32 = 4;
pub const SEGMENT_HEADER_BYTES: u32 = 8;
/// A descriptor's address word: the offset from its buffer's start in the low `OFFSET_BITS`,
/// the base slot above.
pub const OFFSET_BITS: u32 = 20;
pub const MAX_SLOTS: u32 = 1 << (32 - OFFSET_BITS);
const OFFSET_MASK: u32 = (1 << OFFSET_BITS) - 1;
/// Bit 19 of the third word marks a run (entry widths stay below 2^19 words).
/// The most entries a device expands one phase into (about ten times the largest phase of the
/// seed workloads); a package asking for more is refused rather than exhausting memory.
pub const MAX_PHASE_ENTRIES: u64 = 1 << 24;
const RUN_FLAG: u32 = 1 << 19;
const WORDS_MASK: u32 = RUN_FLAG - 1;

/// `count` sends: entry i sends `words` words from `address + i * address_stride` at
/// `cycle + i * cycle_stride`, all within the buffer of base slot `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct SendRun {
    pub cycle: u32,
    pub slot: u32,
    pub address: u32,
    pub words: u32,
    pub paired: bool,
    pub count: u32,
    pub cycle_stride: u32,
    pub address_stride: u32,
}

/// `count` receives from `source`, entry i at `cycle + i * cycle_stride` into
/// `address + i * address_stride`, all within the buffer of base slot `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ReceiveRun {
    pub cycle: u32,
    pub source: u32,
    pub slot: u32,
    pub address: u32,
    pub words: u32,
    pub paired: bool,
    pub count: u32,
    pub cycle_stride: u32,
    pub address_stride: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct PackedTile {
    pub tile: u32,
    /// Start address of each base slot's buffer (slot order).
    pub bases: Vec<u32>,
    pub sends: Vec<SendRun>,
    pub receives: Vec<ReceiveRun>,
}

/// One exchange phase as the package carries it.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct PackedPhase {
    pub index: u32,
    /// Per-tile runs, sorted by tile; tiles with nothing to do are absent.
    pub tiles: Vec<PackedTile>,
    /// The compiler's horizon (the device recomputes it from the tables).
    pub horizon: u32,
    pub endpoint_lower_bound: u32,
}

/// What makes two entries members of one run: everything but cycle and address (an entry
/// with its base slot).
trait Row: Copy {
    fn cycle(&self) -> u32;
    fn address(&self) -> u32;
    fn shape(&self) -> (u32, u32, bool, u32);
}

impl Row for (u32, SendEntry) {
    fn cycle(&self) -> u32 {
        self.1.cycle
    }
    fn address(&self) -> u32 {
        self.1.address
    }
    fn shape(&self) -> (u32, u32, bool, u32) {
        (self.1.words, 0, self.1.paired, self.0)
    }
}

impl Row for (u32, ReceiveEntry) {
    fn cycle(&self) -> u32 {
        self.1.cycle
    }
    fn address(&self) -> u32 {
        self.1.address
    }
    fn shape(&self) -> (u32, u32, bool, u32) {
        (self.1.words, self.1.source, self.1.paired, self.0)
    }
}

/// Cut a sorted entry list into runs with the fewest encoded bytes: (first entry, count,
/// cycle stride, address stride) per run. A run of k >= 2 costs RUN_BYTES, a single entry
/// ENTRY_BYTES; the longest run ending at each entry is the best one to end there.
fn runs_of<R: Row>(entries: &[R]) -> Vec<(usize, u32, u32, u32)> {
    let n = entries.len();
    // start[i]: first entry of the longest arithmetic run ending at i.
    let mut start = vec![0usize; n];
    for i in 1..n {
        let (a, b) = (&entries[i - 1], &entries[i]);
        start[i] = if a.shape() != b.shape() {
            i
        } else if i >= 2 && start[i - 1] <= i - 2 && {
            let z = &entries[i - 2];
            b.cycle().wrapping_sub(a.cycle()) == a.cycle().wrapping_sub(z.cycle()) && b.address().wrapping_sub(a.address()) == a.address().wrapping_sub(z.address())
        } {
            start[i - 1]
        } else {
            i - 1
        };
    }
    let mut best = vec![0u64; n + 1];
    let mut from = vec![0usize; n + 1];
    for i in 0..n {
        let single = best[i] + ENTRY_BYTES as u64;
        let (mut cost, mut f) = (single, i);
        if start[i] < i && best[start[i]] + (RUN_BYTES as u64) < cost {
            cost = best[start[i]] + RUN_BYTES as u64;
            f = start[i];
        }
        best[i + 1] = cost;
        from[i + 1] = f;
    }
    let mut out = Vec::new();
    let mut end = n;
    while end > 0 {
        let s = from[end];
        let count = (end - s) as u32;
        let (cs, as_) = if count >= 2 {
            (entries[s + 1].cycle().wrapping_sub(entries[s].cycle()), entries[s + 1].address().wrapping_sub(entries[s].address()))
        } else {
            (0, 0)
        };
        out.push((s, count, cs, as_));
        end = s;
    }
    out.reverse();
    out
}

/// Entries grouped by shape (width, source, pairing, slot), each group in cycle order: rows of
/// one stream interleaved with others' become neighbours, so their strides show. Within a
/// slot, address order is offset order, wherever the buffer lies.
fn grouped<R: Row>(mut v: Vec<R>) -> Vec<R> {
    v.sort_by_key(|e| (e.shape(), e.cycle(), e.address()));
    v
}

/// The buffers (start address, bytes) one phase touches on each tile, candidate base slots in
/// slot order (the order of first use among the phase's transfers), by tile (sorted).
pub type PhaseBuffers = Vec<(u32, Vec<(u32, u64)>)>;

/// Buffers for tables that come without theirs (tools and tests that write tables by hand):
/// per tile, windows of 2^OFFSET_BITS bytes, each from the lowest address the ones before do
/// not cover, so every address encodes.
pub fn address_windows(p: &ExchangePhase) -> PhaseBuffers {
    p.tiles
        .iter()
        .map(|t| {
            let mut addresses: Vec<u32> = t.sends.iter().map(|e| e.address).chain(t.receives.iter().map(|e| e.address)).collect();
            addresses.sort_unstable();
            let mut windows: Vec<(u32, u64)> = Vec::new();
            for a in addresses {
                if windows.last().is_none_or(|&(start, bytes)| (a - start) as u64 >= bytes) {
                    windows.push((a, 1 << OFFSET_BITS));
                }
            }
            (t.tile, windows)
        })
        .collect()
}

/// A tile's candidate buffers as `slot_of` searches them: (start, bytes, candidate index),
/// sorted by start.
fn by_start(buffers: &[(u32, u64)]) -> Vec<(u32, u64, u32)> {
    let mut by_start: Vec<(u32, u64, u32)> = buffers.iter().enumerate().map(|(i, &(start, bytes))| (start, bytes, i as u32)).collect();
    by_start.sort_unstable();
    by_start
}

/// The slot (index into `buffers`) of the buffer holding `address`, or an error.
fn slot_of(by_start: &[(u32, u64, u32)], address: u32, tile: u32, what: &str) -> Result<u32, String> {
    let inside = |&&(start, bytes, _): &&(u32, u64, u32)| address >= start && ((address - start) as u64) < bytes;
    let i = by_start.partition_point(|b| b.0 <= address);
    match by_start[..i].last().filter(inside).or_else(|| by_start.iter().find(inside)) {
        Some(b) => Ok(b.2),
        None => Err(format!("tile {tile}: a {what} at {address:#x} lies in none of the phase's buffers on the tile")),
    }
}

/// The runs of one tile's table, cut per buffer (`buffers`: candidate slots, in slot order;
/// the slots used are renumbered in that order). An error when an entry lies in no buffer.
pub fn pack_tile(t: &TileExchange, buffers: &[(u32, u64)]) -> Result<PackedTile, String> {
    let by_start = by_start(buffers);
    let mut used = vec![false; buffers.len()];
    let mut sends = Vec::with_capacity(t.sends.len());
    for e in &t.sends {
        let slot = slot_of(&by_start, e.address, t.tile, "send")?;
        used[slot as usize] = true;
        sends.push((slot, *e));
    }
    let mut receives = Vec::with_capacity(t.receives.len());
    for e in &t.receives {
        let slot = slot_of(&by_start, e.address, t.tile, "receive")?;
        used[slot as usize] = true;
        receives.push((slot, *e));
    }
    // Slots the entries use, renumbered in candidate order.
    let mut renumber = vec![0u32; buffers.len()];
    let mut bases = Vec::new();
    for (i, &(start, _)) in buffers.iter().enumerate() {
        if used[i] {
            renumber[i] = bases.len() as u32;
            bases.push(start);
        }
    }
    sends.iter_mut().for_each(|e| e.0 = renumber[e.0 as usize]);
    receives.iter_mut().for_each(|e| e.0 = renumber[e.0 as usize]);
    let (sends_in, receives_in) = (grouped(sends), grouped(receives));
    let sends = runs_of(&sends_in)
        .into_iter()
        .map(|(s, count, cycle_stride, address_stride)| {
            let (slot, e) = sends_in[s];
            SendRun { cycle: e.cycle, slot, address: e.address, words: e.words, paired: e.paired, count, cycle_stride, address_stride }
        })
        .collect();
    let receives = runs_of(&receives_in)
        .into_iter()
        .map(|(s, count, cycle_stride, address_stride)| {
            let (slot, e) = receives_in[s];
            ReceiveRun { cycle: e.cycle, source: e.source, slot, address: e.address, words: e.words, paired: e.paired, count, cycle_stride, address_stride }
        })
        .collect();
    Ok(PackedTile { tile: t.tile, bases, sends, receives })
}

/// A phase's runs, each tile's cut per the buffers the phase touches there (`buffers`, by
/// tile); an error names the tile whose entries lie outside them.
pub fn pack_phase(p: &ExchangePhase, buffers: &PhaseBuffers) -> Result<PackedPhase, String> {
    let tiles = p
        .tiles
        .iter()
        .map(|t| match buffers.binary_search_by_key(&t.tile, |b| b.0) {
            Ok(i) => pack_tile(t, &buffers[i].1),
            Err(_) => Err(format!("tile {}: exchange phase {} has tables there but touches no buffer on it", t.tile, p.index)),
        })
        .collect::<Result<Vec<_>, String>>()
        .map_err(|m| format!("exchange phase {}: {m}", p.index))?;
    Ok(PackedPhase { index: p.index, tiles, horizon: p.horizon, endpoint_lower_bound: p.endpoint_lower_bound })
}

/// `pack_phase(tables, buffers)` found from the packing of another phase (`rep`: its tables,
/// buffers and packing) whose tables these are moved buffer by buffer, as the same phase of
/// repeated layers is (the same schedule relocated): None when they are not, or when the
/// buffers do not make the packing a function of the offsets alone (then pack them).
///
/// Checked here, per tile: the same tile, the same number of candidate buffers of the same
/// sizes in the same order, non-empty buffers disjoint and within 32 bits on both sides, and
/// every entry equal to `rep`'s but for its address, which is `rep`'s moved by the move of
/// the buffer holding it. Then each entry lies in the corresponding buffer at the same offset
/// (and in no other), so the same buffers are used and renumbered alike, the entries sort in
/// the same order (the sort key holds the slot before the address, and one buffer's addresses
/// move alike), and the runs are cut alike with the same strides: `pack_phase` would give
/// `rep`'s runs, each address moved by its buffer's move, and this phase's bases.
pub fn rebased_phase(rep: (&ExchangePhase, &PhaseBuffers, &PackedPhase), tables: &ExchangePhase, buffers: &PhaseBuffers) -> Option<PackedPhase> {
    let (rep_tables, rep_buffers, rep_packed) = rep;
    if rep_tables.tiles.len() != tables.tiles.len() || rep_packed.tiles.len() != tables.tiles.len() {
        return None;
    }
    let tiles = rep_tables
        .tiles
        .iter()
        .zip(&tables.tiles)
        .zip(&rep_packed.tiles)
        .map(|((a, b), packed)| {
            let (from, to) = (tile_buffers(rep_buffers, a.tile)?, tile_buffers(buffers, b.tile)?);
            rebased_tile(a, from, packed, b, to)
        })
        .collect::<Option<Vec<_>>>()?;
    Some(PackedPhase { index: tables.index, tiles, horizon: tables.horizon, endpoint_lower_bound: tables.endpoint_lower_bound })
}

/// A tile's buffers in a phase's list of them.
fn tile_buffers(list: &PhaseBuffers, tile: u32) -> Option<&[(u32, u64)]> {
    list.binary_search_by_key(&tile, |l| l.0).ok().map(|i| list[i].1.as_slice())
}

/// One tile of `rebased_phase`: `packed` (of `a` over buffers `from`) for `b` over `to`.
fn rebased_tile(a: &TileExchange, from: &[(u32, u64)], packed: &PackedTile, b: &TileExchange, to: &[(u32, u64)]) -> Option<PackedTile> {
    let alike = a.tile == b.tile && packed.tile == a.tile && a.sends.len() == b.sends.len() && a.receives.len() == b.receives.len() && from.len() == to.len();
    if !alike || from.iter().zip(to).any(|(x, y)| x.1 != y.1) || !separate(from) || !separate(to) {
        return None;
    }
    let moved: Vec<u32> = from.iter().zip(to).map(|(x, y)| y.0.wrapping_sub(x.0)).collect();
    let by_start = by_start(from);
    let mut used = vec![false; from.len()];
    let mut follows = |address: u32, moved_to: u32| -> bool {
        match slot_of(&by_start, address, a.tile, "") {
            Ok(slot) => {
                used[slot as usize] = true;
                address.wrapping_add(moved[slot as usize]) == moved_to
            }
            Err(_) => false,
        }
    };
    for (x, y) in a.sends.iter().zip(&b.sends) {
        if (x.cycle, x.words, x.paired) != (y.cycle, y.words, y.paired) || !follows(x.address, y.address) {
            return None;
        }
    }
    for (x, y) in a.receives.iter().zip(&b.receives) {
        if (x.cycle, x.source, x.words, x.paired) != (y.cycle, y.source, y.words, y.paired) || !follows(x.address, y.address) {
            return None;
        }
    }
    // The used buffers in candidate order are the packing's slots: their bases must be `from`'s.
    let slots: Vec<usize> = (0..from.len()).filter(|&i| used[i]).collect();
    if slots.len() != packed.bases.len() || slots.iter().zip(&packed.bases).any(|(&i, &base)| from[i].0 != base) {
        return None;
    }
    let move_of = |slot: u32| slots.get(slot as usize).map(|&i| moved[i]);
    let mut sends = Vec::with_capacity(packed.sends.len());
    for r in &packed.sends {
        sends.push(SendRun { address: r.address.wrapping_add(move_of(r.slot)?), ..*r });
    }
    let mut receives = Vec::with_capacity(packed.receives.len());
    for r in &packed.receives {
        receives.push(ReceiveRun { address: r.address.wrapping_add(move_of(r.slot)?), ..*r });
    }
    Some(PackedTile { tile: b.tile, bases: slots.iter().map(|&i| to[i].0).collect(), sends, receives })
}

/// Whether a tile's non-empty buffers are disjoint and each within 32 bits of address.
fn separate(buffers: &[(u32, u64)]) -> bool {
    let mut spans: Vec<(u64, u64)> = buffers.iter().filter(|b| b.1 > 0).map(|&(start, bytes)| (start as u64, start as u64 + bytes)).collect();
    spans.sort_unstable();
    spans.iter().all(|s| s.1 <= 1 << 32) && spans.windows(2).all(|w| w[0].1 <= w[1].0)
}

/// Phases packed without their buffers (`address_windows`), for tools and tests that write
/// tables by hand.
pub fn pack(phases: &[ExchangePhase]) -> Vec<PackedPhase> {
    phases.iter().map(|p| pack_phase(p, &address_windows(p)).expect("address windows cover every entry")).collect()
}

/// Entries of one run, or an error naming the run when it is empty or its arithmetic
/// leaves 32 bits.
fn expand(count: u32, cycle: u32, address: u32, cycle_stride: u32, address_stride: u32, budget: &mut u64) -> Result<Vec<(u32, u32)>, String> {
    if count == 0 {
        return Err("a run of zero entries".into());
    }
    if count as u64 > *budget {
        return Err(format!("a run of {count} entries exceeds the entries left to the phase"));
    }
    *budget -= count as u64;
    let last = (count - 1) as u64;
    if cycle as u64 + last * cycle_stride as u64 > u32::MAX as u64 {
        return Err(format!("a run of {count} entries from cycle {cycle} by {cycle_stride} passes cycle 2^32"));
    }
    Ok((0..count).map(|i| (cycle + i * cycle_stride, address.wrapping_add(i.wrapping_mul(address_stride)))).collect())
}

/// The device's expansion of a packed phase into entries, sorted as the compiler's tables
/// are (by cycle): at most `max_entries` in all.
/// Errors name the tile (never a panic, whatever the values).
pub fn unpack_phase(p: &PackedPhase, max_entries: u64) -> Result<ExchangePhase, (u32, String)> {
    let mut budget = max_entries;
    let mut tiles = Vec::with_capacity(p.tiles.len());
    for t in &p.tiles {
        let mut sends = Vec::new();
        for r in &t.sends {
            for (cycle, address) in expand(r.count, r.cycle, r.address, r.cycle_stride, r.address_stride, &mut budget).map_err(|m| (t.tile, m))? {
                sends.push(SendEntry { cycle, address, words: r.words, paired: r.paired });
            }
        }
        let mut receives = Vec::new();
        for r in &t.receives {
            for (cycle, address) in expand(r.count, r.cycle, r.address, r.cycle_stride, r.address_stride, &mut budget).map_err(|m| (t.tile, m))? {
                receives.push(ReceiveEntry { cycle, source: r.source, address, words: r.words, paired: r.paired });
            }
        }
        // Back in table order (the compiler's: by cycle, then source, then address).
        sends.sort_unstable_by_key(|e| (e.cycle, e.address, e.words, e.paired));
        receives.sort_unstable_by_key(|e| (e.cycle, e.source, e.address, e.words, e.paired));
        tiles.push(TileExchange { tile: t.tile, sends, receives });
    }
    Ok(ExchangePhase { index: p.index, tiles, horizon: p.horizon, endpoint_lower_bound: p.endpoint_lower_bound })
}

/// Entries a packed phase expands to (saturating).
pub fn entry_count(p: &PackedPhase) -> u64 {
    p.tiles.iter().flat_map(|t| t.sends.iter().map(|r| r.count as u64).chain(t.receives.iter().map(|r| r.count as u64))).fold(0u64, |a, b| a.saturating_add(b))
}

fn record(out: &mut Vec<u8>, cycle: u32, address: u32, words: u32, source: u32, paired: bool, count: u32, cs: u32, as_: u32) {
    let flag = if count != 1 { RUN_FLAG } else { 0 };
    let third = (words & WORDS_MASK) | flag | source << 20 | (paired as u32) << 31;
    for w in [cycle, address, third] {
        out.extend_from_slice(&w.to_le_bytes());
    }
    if count != 1 {
        for w in [count, cs, as_] {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
}

/// A descriptor's address word: its offset from its slot's base, and the slot; an error when
/// either does not fit its bits.
fn address_word(t: &PackedTile, slot: u32, address: u32) -> Result<u32, String> {
    let Some(&base) = t.bases.get(slot as usize) else {
        return Err(format!("tile {}: a run at {address:#x} names base slot {slot}, the tile's tables have {} bases", t.tile, t.bases.len()));
    };
    if slot >= MAX_SLOTS {
        return Err(format!("tile {}: base slot {slot} does not fit the {} slot bits of a descriptor", t.tile, 32 - OFFSET_BITS));
    }
    let offset = address.wrapping_sub(base);
    if offset > OFFSET_MASK {
        return Err(format!("tile {}: a run at {address:#x} lies {offset:#x} bytes past its buffer's start {base:#x}, beyond the {OFFSET_BITS}-bit offsets of a descriptor", t.tile));
    }
    Ok(offset | slot << OFFSET_BITS)
}

/// One segment's bytes: the send and receive descriptor counts, then the descriptors, each
/// address an offset from its slot's base (`t.bases`) with the slot above it. An error when
/// an offset or a slot does not fit.
pub fn encode_segment(t: &PackedTile) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity((SEGMENT_HEADER_BYTES + RUN_BYTES * (t.sends.len() + t.receives.len()) as u32) as usize);
    out.extend_from_slice(&(t.sends.len() as u32).to_le_bytes());
    out.extend_from_slice(&(t.receives.len() as u32).to_le_bytes());
    for r in &t.sends {
        record(&mut out, r.cycle, address_word(t, r.slot, r.address)?, r.words, 0, r.paired, r.count, r.cycle_stride, r.address_stride);
    }
    for r in &t.receives {
        record(&mut out, r.cycle, address_word(t, r.slot, r.address)?, r.words, r.source, r.paired, r.count, r.cycle_stride, r.address_stride);
    }
    Ok(out)
}

/// A tile's exchange tables over all phases, encoded: a binding per phase the tile takes part
/// in (phase, segment offset, base-list offset, base count), then the distinct base lists,
/// then the distinct segments (offsets from the start of the tables). Phases whose segments
/// are equal share one; bindings whose base lists are equal share one. An error when an
/// offset or a slot does not fit a descriptor.
pub fn encode_tile(phases: &[(u32, &PackedTile)]) -> Result<Vec<u8>, String> {
    let mut segments: Vec<Vec<u8>> = Vec::new();
    let mut segment_index: std::collections::HashMap<Vec<u8>, usize> = std::collections::HashMap::new();
    let mut lists: Vec<&[u32]> = Vec::new();
    let mut list_index: std::collections::HashMap<&[u32], usize> = std::collections::HashMap::new();
    let mut bindings: Vec<(u32, usize, usize)> = Vec::with_capacity(phases.len());
    for (phase, t) in phases {
        let bytes = encode_segment(t).map_err(|m| format!("exchange phase {phase}: {m}"))?;
        let s = intern(&mut segments, &mut segment_index, bytes);
        let l = *list_index.entry(&t.bases).or_insert_with(|| {
            lists.push(&t.bases);
            lists.len() - 1
        });
        bindings.push((*phase, s, l));
    }
    let mut at = phases.len() as u32 * BINDING_BYTES;
    let list_offsets: Vec<u32> = lists
        .iter()
        .map(|l| {
            let o = at;
            at += l.len() as u32 * BASE_BYTES;
            o
        })
        .collect();
    let segment_offsets: Vec<u32> = segments
        .iter()
        .map(|s| {
            let o = at;
            at += s.len() as u32;
            o
        })
        .collect();
    let mut out = Vec::with_capacity(at as usize);
    for (phase, s, l) in bindings {
        for w in [phase, segment_offsets[s], list_offsets[l], lists[l].len() as u32] {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
    for l in &lists {
        for w in l.iter() {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
    for s in segments {
        out.extend_from_slice(&s);
    }
    Ok(out)
}

/// Decode a tile's encoded tables (`encode_tile`; `bytes` at `address`, `bindings` bindings)
/// back into (phase, runs) per binding, with absolute addresses. Every error names the
/// address and the binding or descriptor; segments that several bindings share are decoded
/// once.
pub fn decode_tile(bytes: &[u8], address: u32, tile: u32, bindings: u32) -> Result<Vec<(u32, PackedTile)>, String> {
    let word = |at: u64, what: &str| -> Result<u32, String> {
        match usize::try_from(at).ok().and_then(|a| bytes.get(a..a.checked_add(4)?)) {
            Some(b) => Ok(u32::from_le_bytes(b.try_into().unwrap())),
            None => Err(format!("{what} at {:#x} runs past the end of the {}-byte exchange tables at {address:#x}", address as u64 + at, bytes.len())),
        }
    };
    let binding_bytes = bindings as u64 * BINDING_BYTES as u64;
    if binding_bytes > bytes.len() as u64 {
        return Err(format!("exchange tables at {address:#x}: {bindings} bindings need {binding_bytes} bytes, the tables hold {}", bytes.len()));
    }
    // A segment: its runs (addresses relative to their slots' bases) and the highest slot + 1.
    type Segment = (Vec<SendRun>, Vec<ReceiveRun>, u32);
    let mut segments: std::collections::HashMap<u32, std::rc::Rc<Segment>> = std::collections::HashMap::new();
    let mut lists: std::collections::HashMap<u32, std::rc::Rc<Vec<u32>>> = std::collections::HashMap::new();
    let mut spans: Vec<(u64, u64)> = Vec::new();
    // Bytes of the distinct segments decoded so far: they must lie apart within the tables, so
    // more than the tables hold means overlapping segments (refused before decoding more, which
    // keeps the work linear in the bytes however many bindings point into them).
    let mut decoded = 0u64;
    let mut out = Vec::with_capacity(bindings as usize);
    for b in 0..bindings {
        let at = b as u64 * BINDING_BYTES as u64;
        let [phase, offset, list, count] = [0, 4, 8, 12].map(|o| word(at + o, "binding").unwrap_or_default());
        let fail = |m: String| format!("exchange-table binding {b} (phase {phase}) at {:#x}: {m}", address as u64 + at);
        if (offset as u64) < binding_bytes {
            return Err(fail(format!("segment offset {offset} points into the bindings")));
        }
        if (list as u64) < binding_bytes {
            return Err(fail(format!("base-list offset {list} points into the bindings")));
        }
        let bases = match lists.get(&list) {
            Some(l) if l.len() == count as usize => l.clone(),
            Some(l) => return Err(fail(format!("a base list of {count} bases at offset {list}, where another binding's list of {} starts", l.len()))),
            None => {
                let end = list as u64 + count as u64 * BASE_BYTES as u64;
                if end > bytes.len() as u64 {
                    return Err(fail(format!("a base list of {count} bases at offset {list} runs past the end of the {}-byte tables", bytes.len())));
                }
                let l = std::rc::Rc::new((0..count as u64).map(|i| word(list as u64 + i * BASE_BYTES as u64, "base")).collect::<Result<Vec<u32>, String>>().map_err(fail)?);
                spans.push((list as u64, end));
                lists.insert(list, l.clone());
                l
            }
        };
        let segment = match segments.get(&offset) {
            Some(s) => s.clone(),
            None => {
                let mut at = offset as u64;
                let sends = word(at, "segment header").map_err(fail)?;
                let receives = word(at + 4, "segment header").map_err(fail)?;
                at += SEGMENT_HEADER_BYTES as u64;
                if (sends as u64 + receives as u64) * ENTRY_BYTES as u64 > bytes.len() as u64 - at.min(bytes.len() as u64) {
                    return Err(fail(format!("a segment of {sends} send and {receives} receive descriptors does not fit in the tables")));
                }
                let mut send_runs = Vec::with_capacity(sends as usize);
                let mut receive_runs = Vec::with_capacity(receives as usize);
                let mut slots = 0u32;
                for i in 0..sends as u64 + receives as u64 {
                    let here = address as u64 + at;
                    let describe = |m: String| fail(format!("descriptor {i} at {here:#x}: {m}"));
                    let (cycle, addr, third) = (word(at, "descriptor").map_err(fail)?, word(at + 4, "descriptor").map_err(fail)?, word(at + 8, "descriptor").map_err(fail)?);
                    at += ENTRY_BYTES as u64;
                    let (count, cycle_stride, address_stride) = if third & RUN_FLAG != 0 {
                        let run = (word(at, "run").map_err(fail)?, word(at + 4, "run").map_err(fail)?, word(at + 8, "run").map_err(fail)?);
                        at += (RUN_BYTES - ENTRY_BYTES) as u64;
                        if run.0 < 2 {
                            return Err(describe(format!("a run descriptor of {} entries (runs have at least 2)", run.0)));
                        }
                        run
                    } else {
                        (1, 0, 0)
                    };
                    let (words, source, paired) = (third & WORDS_MASK, (third >> 20) & 0x7FF, third >> 31 != 0);
                    let (slot, offset) = (addr >> OFFSET_BITS, addr & OFFSET_MASK);
                    slots = slots.max(slot + 1);
                    if i < sends as u64 {
                        if source != 0 {
                            return Err(describe(format!("a send descriptor names source tile {source}")));
                        }
                        send_runs.push(SendRun { cycle, slot, address: offset, words, paired, count, cycle_stride, address_stride });
                    } else {
                        receive_runs.push(ReceiveRun { cycle, source, slot, address: offset, words, paired, count, cycle_stride, address_stride });
                    }
                }
                decoded += at - offset as u64;
                if decoded > bytes.len() as u64 {
                    return Err(fail(format!("its segment at offset {offset} overlaps another: the distinct segments decoded so far take {decoded} bytes of {}", bytes.len())));
                }
                spans.push((offset as u64, at));
                let s = std::rc::Rc::new((send_runs, receive_runs, slots));
                segments.insert(offset, s.clone());
                s
            }
        };
        if segment.2 > count {
            let (i, slot) = segment.0.iter().map(|r| r.slot).chain(segment.1.iter().map(|r| r.slot)).enumerate().find(|&(_, s)| s >= count).unwrap_or((0, segment.2 - 1));
            return Err(fail(format!("descriptor {i} of the segment at offset {offset} names base slot {slot}, the binding supplies {count} bases")));
        }
        let sends = segment.0.iter().map(|r| SendRun { address: r.address.wrapping_add(bases[r.slot as usize]), ..*r }).collect();
        let receives = segment.1.iter().map(|r| ReceiveRun { address: r.address.wrapping_add(bases[r.slot as usize]), ..*r }).collect();
        out.push((phase, PackedTile { tile, bases: bases.to_vec(), sends, receives }));
    }
    // The bindings' base lists and segments follow the bindings back to back, each once, to
    // the end (an empty base list is an empty span).
    if let Err((from, to)) = spans_cover(&mut spans, binding_bytes, bytes.len() as u64) {
        return Err(format!("exchange tables at {address:#x}: bytes {from} to {to} of {} do not hold exactly the bindings' base lists and segments", bytes.len()));
    }
    Ok(out)
}

/// The index of `value` in `values`, appended (and indexed) where it is not there yet.
pub(crate) fn intern<T: std::hash::Hash + Eq + Clone>(values: &mut Vec<T>, index: &mut std::collections::HashMap<T, usize>, value: T) -> usize {
    if let Some(&i) = index.get(&value) {
        return i;
    }
    values.push(value.clone());
    index.insert(value, values.len() - 1);
    values.len() - 1
}

/// Whether `spans` (start, end), sorted here, lie back to back from `from` to `end`, each
/// once; else the first stretch where they do not (a gap, or where two overlap).
pub(crate) fn spans_cover(spans: &mut [(u64, u64)], from: u64, end: u64) -> Result<(), (u64, u64)> {
    spans.sort_unstable();
    let mut at = from;
    for &(start, stop) in spans.iter().chain([(end, end)].iter()) {
        if start != at {
            return Err((at.min(start), start));
        }
        at = stop;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::synthetic::SplitMix64;

    fn receive(cycle: u32, source: u32, address: u32, words: u32) -> ReceiveEntry {
        ReceiveEntry { cycle, source, address, words, paired: false }
    }

    /// A random phase on a few tiles (entries in cycle order, each in one of its tile's
    /// buffers) and its buffers, with every buffer placed at `starts(tile, buffer)`.
    fn placed_phase(seed: u64, starts: &dyn Fn(u32, usize) -> u32) -> (ExchangePhase, PhaseBuffers) {
        let mut rng = SplitMix64(seed);
        let mut tiles = Vec::new();
        let mut buffers: PhaseBuffers = Vec::new();
        for tile in [1u32, 4, 5, 9] {
            let sizes: Vec<u64> = (0..1 + rng.below(4)).map(|_| 64 * (1 + rng.below(16)) as u64).collect();
            let list: Vec<(u32, u64)> = sizes.iter().enumerate().map(|(b, &bytes)| (starts(tile, b), bytes)).collect();
            let entry = |cycle: u32, rng: &mut SplitMix64| {
                let (start, bytes) = list[rng.below(list.len() as u32) as usize];
                (cycle, start + 4 * rng.below(bytes as u32 / 4), 1 + rng.below(2))
            };
            let (mut sends, mut receives) = (Vec::new(), Vec::new());
            for cycle in 0..rng.below(60) {
                if rng.chance(60) {
                    let (cycle, address, words) = entry(cycle * 3, &mut rng);
                    sends.push(SendEntry { cycle, address, words, paired: false });
                }
                if rng.chance(60) {
                    let (cycle, address, words) = entry(cycle * 3 + 1, &mut rng);
                    receives.push(ReceiveEntry { cycle, source: rng.below(3), address, words, paired: false });
                }
            }
            tiles.push(TileExchange { tile, sends, receives });
            buffers.push((tile, list));
        }
        (ExchangePhase { index: 7, tiles, horizon: 200, endpoint_lower_bound: 150 }, buffers)
    }

    /// A phase whose tables are another's moved buffer by buffer packs as `rebased_phase`
    /// says, without being packed; tables that differ otherwise, or buffers that overlap, are
    /// refused (packed instead).
    #[test]
    fn moved_tables_pack_as_rebased() {
        for seed in 0..200u64 {
            // The same buffers 64 KiB apart, then in another order with other gaps.
            let (a, from) = placed_phase(seed, &|_, b| 0x1_0000 * (b as u32 + 1));
            let (b, to) = placed_phase(seed, &|tile, b| 0x20_0000 + 0x1_0000 * ((b as u32 * 7 + tile) % 5) + 0x100 * b as u32);
            let packed = pack_phase(&a, &from).unwrap();
            let rebased = rebased_phase((&a, &from, &packed), &b, &to).expect("moved buffer by buffer");
            assert_eq!(rebased, pack_phase(&b, &to).unwrap(), "seed {seed}");
            // One entry elsewhere in its buffer: not a move.
            let mut other = b.clone();
            if let Some(t) = other.tiles.iter_mut().find(|t| !t.receives.is_empty()) {
                let r = &mut t.receives[0];
                r.address = if r.address % 8 == 0 { r.address + 4 } else { r.address - 4 };
                assert_eq!(rebased_phase((&a, &from, &packed), &other, &to), None, "seed {seed}");
            }
            // Overlapping buffers: refused.
            let mut crowded = to.clone();
            if let Some(list) = crowded.iter_mut().find(|l| l.1.len() > 1) {
                list.1[1].0 = list.1[0].0;
                assert_eq!(rebased_phase((&a, &from, &packed), &b, &crowded), None, "seed {seed}");
            }
        }
    }

    /// Phase `index` on tile 2: a send from buffer `send` and two interleaved strided receive
    /// streams into buffers `a` and `b` (rows of 8 words, every 16 cycles each), with the
    /// phase's buffers (send, a, b).
    fn streams(index: u32, send: u32, a: u32, b: u32) -> (ExchangePhase, PhaseBuffers) {
        let mut receives: Vec<ReceiveEntry> = (0..20).flat_map(|i| [receive(i * 16, 3, a + i * 64, 8), receive(i * 16 + 8, 5, b + i * 32, 8)]).collect();
        receives.sort_by_key(|e| (e.cycle, e.source, e.address));
        let table = TileExchange { tile: 2, sends: vec![SendEntry { cycle: 0, address: send + 0x10, words: 4, paired: false }], receives };
        (ExchangePhase { index, tiles: vec![table], horizon: 328, endpoint_lower_bound: 320 }, vec![(2, vec![(send, 64), (a, 20 * 64), (b, 20 * 32)])])
    }

    #[test]
    fn interleaved_strided_streams_become_one_run_each_and_expand_back() {
        let (phase, buffers) = streams(7, 0x100, 0x1000, 0x9000);
        let packed = pack_phase(&phase, &buffers).unwrap();
        assert_eq!(packed.tiles[0].receives.len(), 2, "{:?}", packed.tiles[0].receives);
        assert_eq!(packed.tiles[0].receives[0].address_stride, 64);
        assert_eq!(packed.tiles[0].bases, vec![0x100, 0x1000, 0x9000]);
        assert_eq!(unpack_phase(&packed, MAX_PHASE_ENTRIES).unwrap(), phase);
        assert_eq!(entry_count(&packed), 41);
        // Phase 9 moves the same data between buffers placed elsewhere (the receive buffers
        // in the other order): one segment, a base list each.
        let (other, other_buffers) = streams(9, 0x2200, 0x30000, 0x8000);
        let moved = pack_phase(&other, &other_buffers).unwrap();
        assert_eq!(encode_segment(&moved.tiles[0]).unwrap(), encode_segment(&packed.tiles[0]).unwrap());
        let bytes = encode_tile(&[(7, &packed.tiles[0]), (9, &moved.tiles[0])]).unwrap();
        assert_eq!(bytes.len() as u32, 2 * BINDING_BYTES + 6 * BASE_BYTES + SEGMENT_HEADER_BYTES + ENTRY_BYTES + 2 * RUN_BYTES);
        let decoded = decode_tile(&bytes, 0x4C100, 2, 2).unwrap();
        assert_eq!(decoded, vec![(7, packed.tiles[0].clone()), (9, moved.tiles[0].clone())]);
        // Corrupted bytes are errors naming where, or tables, never a panic.
        for i in 0..bytes.len() {
            for v in [0u8, 0xFF, 0x08, 0x10] {
                let mut b = bytes.clone();
                b[i] = v;
                let _ = decode_tile(&b, 0x4C100, 2, 2);
            }
        }
        let e = decode_tile(&bytes[..bytes.len() - 4], 0x4C100, 2, 2).unwrap_err();
        assert!(e.contains("binding 0 (phase 7)") && e.contains("runs past the end"), "{e}");
        assert!(decode_tile(&bytes, 0x4C100, 2, 1).unwrap_err().contains("exactly the bindings' base lists and segments"));
        // Binding 1 supplying two bases where the segment names slot 2.
        let mut few = bytes.clone();
        few[16 + 12..16 + 16].copy_from_slice(&2u32.to_le_bytes());
        let e = decode_tile(&few, 0x4C100, 2, 2).unwrap_err();
        assert!(e.contains("binding 1 (phase 9) at 0x4c110") && e.contains("base slot 2") && e.contains("supplies 2 bases"), "{e}");
        // A base list past the end of the tables.
        let mut far = bytes.clone();
        far[8..12].copy_from_slice(&(bytes.len() as u32 - 4).to_le_bytes());
        let e = decode_tile(&far, 0x4C100, 2, 2).unwrap_err();
        assert!(e.contains("binding 0 (phase 7) at 0x4c100") && e.contains("base list of 3 bases") && e.contains("runs past the end"), "{e}");
    }

    /// `p`'s phase back from the bytes of its one tile.
    fn decode_phase(bytes: &[u8], p: &PackedPhase) -> PackedPhase {
        let (_, tile) = decode_tile(bytes, 0, p.tiles[0].tile, 1).unwrap().remove(0);
        PackedPhase { tiles: vec![tile], ..p.clone() }
    }

    #[test]
    fn runs_stop_at_buffer_boundaries_and_segments_ignore_placement() {
        // Rows 0..8 of one stream, the first 4 in one buffer and the rest in the next: placed
        // back to back they form one progression, but each buffer gets its own run.
        let rows = |a: u32, b: u32| -> (ExchangePhase, PhaseBuffers) {
            let receives = (0..8).map(|i| receive(i * 4, 1, if i < 4 { a + i * 32 } else { b + (i - 4) * 32 }, 8)).collect();
            let phase = ExchangePhase { index: 0, tiles: vec![TileExchange { tile: 0, sends: vec![], receives }], horizon: 40, endpoint_lower_bound: 32 };
            (phase, vec![(0, vec![(a, 128), (b, 128)])])
        };
        let (adjacent, adjacent_buffers) = rows(0x1000, 0x1080);
        let packed = pack_phase(&adjacent, &adjacent_buffers).unwrap();
        assert_eq!(packed.tiles[0].receives.iter().map(|r| (r.slot, r.count)).collect::<Vec<_>>(), vec![(0, 4), (1, 4)]);
        assert_eq!(pack(std::slice::from_ref(&adjacent))[0].tiles[0].receives.len(), 1, "without its buffers the phase is one run");
        let (apart, apart_buffers) = rows(0x7000, 0x2000);
        let elsewhere = pack_phase(&apart, &apart_buffers).unwrap();
        assert_eq!(encode_segment(&elsewhere.tiles[0]).unwrap(), encode_segment(&packed.tiles[0]).unwrap());
        assert_eq!(unpack_phase(&elsewhere, MAX_PHASE_ENTRIES).unwrap(), apart);
        // An entry outside the phase's buffers, an offset past 20 bits: errors naming the tile.
        let e = pack_phase(&adjacent, &vec![(0, vec![(0x1000, 128)])]).unwrap_err();
        assert!(e.contains("tile 0") && e.contains("0x1080") && e.contains("none of the phase's buffers"), "{e}");
        let (far, _) = rows(0x1000, 0x101000);
        let e = encode_tile(&[(0, &pack_phase(&far, &vec![(0, vec![(0x1000, 0x200000)])]).unwrap().tiles[0])]).unwrap_err();
        assert!(e.contains("exchange phase 0: tile 0") && e.contains("20-bit offsets"), "{e}");
        // Without its buffers, a phase gets address windows that every address fits.
        let windowed = &pack(std::slice::from_ref(&far))[0];
        assert_eq!(windowed.tiles[0].bases, vec![0x1000, 0x101000]);
        assert_eq!(unpack_phase(&decode_phase(&encode_tile(&[(0, &windowed.tiles[0])]).unwrap(), windowed), MAX_PHASE_ENTRIES).unwrap(), far);
    }

    #[test]
    fn random_tables_round_trip_and_never_grow() {
        let mut rng = SplitMix64(17);
        for _ in 0..200 {
            let n = rng.below(40) as usize;
            let mut receives: Vec<ReceiveEntry> = (0..n).map(|_| receive(rng.below(64) * 4, rng.below(3), 0x4000 + rng.below(16) * 16, 1 + rng.below(2))).collect();
            receives.sort_by_key(|e| (e.cycle, e.source, e.address, e.words));
            receives.dedup();
            let table = TileExchange { tile: 0, sends: vec![], receives };
            let phase = ExchangePhase { index: 0, tiles: vec![table.clone()], horizon: 0, endpoint_lower_bound: 0 };
            let packed = pack_phase(&phase, &vec![(0, vec![(0x4000, 256)])]).unwrap();
            assert_eq!(unpack_phase(&packed, MAX_PHASE_ENTRIES).unwrap(), phase);
            let encoded = encode_segment(&packed.tiles[0]).unwrap().len() as u32;
            assert!(encoded <= SEGMENT_HEADER_BYTES + ENTRY_BYTES * table.receives.len() as u32);
        }
    }

    #[test]
    fn hostile_runs_are_errors_not_panics() {
        let run = |count, cycle, cycle_stride| PackedPhase {
            index: 0,
            tiles: vec![PackedTile { tile: 4, bases: vec![0], sends: vec![SendRun { cycle, slot: 0, address: u32::MAX, words: 1, paired: false, count, cycle_stride, address_stride: u32::MAX }], receives: vec![] }],
            horizon: 0,
            endpoint_lower_bound: 0,
        };
        assert!(unpack_phase(&run(0, 0, 1), 100).unwrap_err().1.contains("zero entries"));
        assert!(unpack_phase(&run(101, 0, 1), 100).unwrap_err().1.contains("exceeds"));
        assert!(unpack_phase(&run(3, u32::MAX - 1, 1), 100).unwrap_err().1.contains("passes cycle"));
        assert_eq!(unpack_phase(&run(3, 5, 2), 100).unwrap().tiles[0].sends.len(), 3);
    }

    #[test]
    fn bindings_pointing_into_one_another_s_segments_are_refused() {
        // Words of 1: at any word a segment of one send and one receive (32 bytes). Sixty-four
        // bindings each point one word further into the run; once the distinct segments
        // decoded take more bytes than the tables hold, decoding stops there.
        let n = 64u32;
        let mut bytes = Vec::new();
        for i in 0..n {
            for w in [i, n * BINDING_BYTES + 4 * i, n * BINDING_BYTES, 1] {
                bytes.extend_from_slice(&w.to_le_bytes());
            }
        }
        for _ in 0..n + 8 {
            bytes.extend_from_slice(&1u32.to_le_bytes());
        }
        let e = decode_tile(&bytes, 0x60000, 3, n).unwrap_err();
        assert!(e.contains("overlaps another"), "{e}");
    }
}

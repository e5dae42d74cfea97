//! Compact exchange tables: the form the package and the tile images carry.
//!
//! A tile's table for one phase is a list of run descriptors, sends and receives apart, each
//! list grouped by entry shape (width, source, pairing) and in cycle order within a group,
//! so one stream's rows interleaved with another's still form a run. A run is `count` entries of the same width (and, for receives, the same source), entry i at
//! `cycle + i * cycle_stride` and `address + i * address_stride` (wrapping): contiguous and
//! strided rows are one descriptor, not one entry each. Runs are chosen by an exact dynamic
//! program (fewest encoded bytes for a sorted entry list cut into arithmetic runs), so equal
//! tables always give equal runs.
//!
//! The device executes runs: it decodes them from the tile's image (`decode_tile`) and
//! expands each descriptor itself (`unpack_phase`), with a limit on the entries it will expand
//! and no arithmetic that can panic on hostile values.
//!
//! Encoded in a tile image (`encode_tile`), a single entry is 3 words (cycle, address,
//! `words | source << 20 | paired << 31`) and a run 6 (the same with bit 19 set, then count,
//! cycle stride, address stride; any count but 1 is written as a run, and the decoder refuses
//! runs of fewer than 2). Phases whose tables on a tile differ only by one address
//! offset for the sends and one for the receives share one segment there, patched by its
//! binding (`TileTables`): repeated layers and blocks reuse table segments.

use crate::package::{ExchangePhase, ReceiveEntry, SendEntry, TileExchange};

/// Bytes of an encoded single entry and of an encoded run.
pub const ENTRY_BYTES: u32 = 12;
pub const RUN_BYTES: u32 = 24;
/// Bytes of one binding (phase, segment offset, send base, receive base) and of a segment
/// header (send and receive descriptor counts).
pub const BINDING_BYTES: u32 = 16;
pub const SEGMENT_HEADER_BYTES: u32 = 8;
/// Bit 19 of the third word marks a run (entry widths stay below 2^19 words).
/// The most entries a device expands one phase into (about ten times the largest phase of the
/// seed workloads); a package asking for more is refused rather than exhausting memory.
pub const MAX_PHASE_ENTRIES: u64 = 1 << 24;
const RUN_FLAG: u32 = 1 << 19;
const WORDS_MASK: u32 = RUN_FLAG - 1;

/// `count` sends: entry i sends `words` words from `address + i * address_stride` at
/// `cycle + i * cycle_stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct SendRun {
    pub cycle: u32,
    pub address: u32,
    pub words: u32,
    pub paired: bool,
    pub count: u32,
    pub cycle_stride: u32,
    pub address_stride: u32,
}

/// `count` receives from `source`, entry i at `cycle + i * cycle_stride` into
/// `address + i * address_stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ReceiveRun {
    pub cycle: u32,
    pub source: u32,
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

/// What makes two entries members of one run: everything but cycle and address.
trait Row: Copy {
    fn cycle(&self) -> u32;
    fn address(&self) -> u32;
    fn shape(&self) -> (u32, u32, bool);
}

impl Row for SendEntry {
    fn cycle(&self) -> u32 {
        self.cycle
    }
    fn address(&self) -> u32 {
        self.address
    }
    fn shape(&self) -> (u32, u32, bool) {
        (self.words, 0, self.paired)
    }
}

impl Row for ReceiveEntry {
    fn cycle(&self) -> u32 {
        self.cycle
    }
    fn address(&self) -> u32 {
        self.address
    }
    fn shape(&self) -> (u32, u32, bool) {
        (self.words, self.source, self.paired)
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

/// Entries grouped by shape (width, source, pairing), each group in cycle order: rows of one
/// stream interleaved with others' become neighbours, so their strides show.
fn grouped<R: Row>(entries: &[R]) -> Vec<R> {
    let mut v = entries.to_vec();
    v.sort_by_key(|e| (e.shape(), e.cycle(), e.address()));
    v
}

/// The runs of one tile's table.
pub fn pack_tile(t: &TileExchange) -> PackedTile {
    let (sends_in, receives_in) = (grouped(&t.sends), grouped(&t.receives));
    let sends = runs_of(&sends_in)
        .into_iter()
        .map(|(s, count, cycle_stride, address_stride)| {
            let e = sends_in[s];
            SendRun { cycle: e.cycle, address: e.address, words: e.words, paired: e.paired, count, cycle_stride, address_stride }
        })
        .collect();
    let receives = runs_of(&receives_in)
        .into_iter()
        .map(|(s, count, cycle_stride, address_stride)| {
            let e = receives_in[s];
            ReceiveRun { cycle: e.cycle, source: e.source, address: e.address, words: e.words, paired: e.paired, count, cycle_stride, address_stride }
        })
        .collect();
    PackedTile { tile: t.tile, sends, receives }
}

pub fn pack_phase(p: &ExchangePhase) -> PackedPhase {
    PackedPhase { index: p.index, tiles: p.tiles.iter().map(pack_tile).collect(), horizon: p.horizon, endpoint_lower_bound: p.endpoint_lower_bound }
}

pub fn pack(phases: &[ExchangePhase]) -> Vec<PackedPhase> {
    phases.iter().map(pack_phase).collect()
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

/// One segment's bytes: the send and receive descriptor counts, then the descriptors with
/// addresses relative to the bases (`send_base`, `receive_base`).
pub fn encode_segment(t: &PackedTile, send_base: u32, receive_base: u32) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(t.sends.len() as u32).to_le_bytes());
    out.extend_from_slice(&(t.receives.len() as u32).to_le_bytes());
    for r in &t.sends {
        record(&mut out, r.cycle, r.address.wrapping_sub(send_base), r.words, 0, r.paired, r.count, r.cycle_stride, r.address_stride);
    }
    for r in &t.receives {
        record(&mut out, r.cycle, r.address.wrapping_sub(receive_base), r.words, r.source, r.paired, r.count, r.cycle_stride, r.address_stride);
    }
    out
}

/// The bases a segment is relative to: the lowest send and receive addresses (0 when none).
pub fn bases(t: &PackedTile) -> (u32, u32) {
    (t.sends.iter().map(|r| r.address).min().unwrap_or(0), t.receives.iter().map(|r| r.address).min().unwrap_or(0))
}

/// A tile's exchange tables over all phases, encoded: a binding per phase the tile takes part
/// in (phase, segment offset, send base, receive base), then the distinct segments. Phases
/// whose segments are equal share one.
pub fn encode_tile(phases: &[(u32, &PackedTile)]) -> Vec<u8> {
    let mut segments: Vec<Vec<u8>> = Vec::new();
    let mut bindings: Vec<[u32; 4]> = Vec::new();
    let mut offset = phases.len() as u32 * BINDING_BYTES;
    let mut offsets: Vec<u32> = Vec::new();
    for (phase, t) in phases {
        let (sb, rb) = bases(t);
        let bytes = encode_segment(t, sb, rb);
        let at = match segments.iter().position(|s| *s == bytes) {
            Some(i) => offsets[i],
            None => {
                let at = offset;
                offset += bytes.len() as u32;
                offsets.push(at);
                segments.push(bytes);
                at
            }
        };
        bindings.push([*phase, at, sb, rb]);
    }
    let mut out = Vec::with_capacity(offset as usize);
    for b in bindings {
        for w in b {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
    for s in segments {
        out.extend_from_slice(&s);
    }
    out
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
    if bindings as u64 * BINDING_BYTES as u64 > bytes.len() as u64 {
        return Err(format!("exchange tables at {address:#x}: {bindings} bindings need {} bytes, the tables hold {}", bindings as u64 * BINDING_BYTES as u64, bytes.len()));
    }
    type Segment = (Vec<SendRun>, Vec<ReceiveRun>);
    let mut segments: std::collections::HashMap<u32, std::rc::Rc<Segment>> = std::collections::HashMap::new();
    let mut spans: Vec<(u64, u64)> = Vec::new();
    let mut out = Vec::with_capacity(bindings as usize);
    for b in 0..bindings {
        let at = b as u64 * BINDING_BYTES as u64;
        let [phase, offset, send_base, receive_base] = [0, 4, 8, 12].map(|o| word(at + o, "binding").unwrap_or_default());
        let fail = |m: String| format!("exchange-table binding {b} (phase {phase}) at {:#x}: {m}", address as u64 + at);
        if (offset as u64) < bindings as u64 * BINDING_BYTES as u64 {
            return Err(fail(format!("segment offset {offset} points into the bindings")));
        }
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
                    if i < sends as u64 {
                        if source != 0 {
                            return Err(describe(format!("a send descriptor names source tile {source}")));
                        }
                        send_runs.push(SendRun { cycle, address: addr, words, paired, count, cycle_stride, address_stride });
                    } else {
                        receive_runs.push(ReceiveRun { cycle, source, address: addr, words, paired, count, cycle_stride, address_stride });
                    }
                }
                spans.push((offset as u64, at));
                let s = std::rc::Rc::new((send_runs, receive_runs));
                segments.insert(offset, s.clone());
                s
            }
        };
        let sends = segment.0.iter().map(|r| SendRun { address: r.address.wrapping_add(send_base), ..*r }).collect();
        let receives = segment.1.iter().map(|r| ReceiveRun { address: r.address.wrapping_add(receive_base), ..*r }).collect();
        out.push((phase, PackedTile { tile, sends, receives }));
    }
    // The bindings' segments follow the bindings back to back, each once, to the end.
    spans.sort_unstable();
    let mut at = bindings as u64 * BINDING_BYTES as u64;
    for &(start, end) in spans.iter().chain([(bytes.len() as u64, bytes.len() as u64)].iter()) {
        if start != at {
            return Err(format!("exchange tables at {address:#x}: bytes {} to {start} of {} do not hold exactly the bindings' segments", at.min(start), bytes.len()));
        }
        at = end;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::synthetic::SplitMix64;

    fn receive(cycle: u32, source: u32, address: u32, words: u32) -> ReceiveEntry {
        ReceiveEntry { cycle, source, address, words, paired: false }
    }

    #[test]
    fn interleaved_strided_streams_become_one_run_each_and_expand_back() {
        // Two sources alternate on one tile: rows of 8 words, every 16 cycles each.
        let mut receives: Vec<ReceiveEntry> = (0..20).flat_map(|i| [receive(i * 16, 3, 0x1000 + i * 64, 8), receive(i * 16 + 8, 5, 0x9000 + i * 32, 8)]).collect();
        receives.sort_by_key(|e| (e.cycle, e.source, e.address));
        let table = TileExchange { tile: 2, sends: vec![SendEntry { cycle: 0, address: 0x100, words: 4, paired: false }], receives };
        let phase = ExchangePhase { index: 7, tiles: vec![table], horizon: 328, endpoint_lower_bound: 320 };
        let packed = pack_phase(&phase);
        assert_eq!(packed.tiles[0].receives.len(), 2, "{:?}", packed.tiles[0].receives);
        assert_eq!(packed.tiles[0].receives[0].address_stride, 64);
        assert_eq!(unpack_phase(&packed, MAX_PHASE_ENTRIES).unwrap(), phase);
        assert_eq!(entry_count(&packed), 41);
        let bytes = encode_tile(&[(7, &packed.tiles[0]), (9, &packed.tiles[0])]);
        assert_eq!(bytes.len() as u32, 2 * BINDING_BYTES + SEGMENT_HEADER_BYTES + ENTRY_BYTES + 2 * RUN_BYTES);
        let decoded = decode_tile(&bytes, 0x4C100, 2, 2).unwrap();
        assert_eq!(decoded, vec![(7, packed.tiles[0].clone()), (9, packed.tiles[0].clone())]);
        // Corrupted bytes are errors naming where, or tables, never a panic.
        for i in 0..bytes.len() {
            for v in [0u8, 0xFF, 0x08] {
                let mut b = bytes.clone();
                b[i] = v;
                let _ = decode_tile(&b, 0x4C100, 2, 2);
            }
        }
        let e = decode_tile(&bytes[..bytes.len() - 4], 0x4C100, 2, 2).unwrap_err();
        assert!(e.contains("binding 0 (phase 7)") && e.contains("runs past the end"), "{e}");
        assert!(decode_tile(&bytes, 0x4C100, 2, 1).unwrap_err().contains("exactly the bindings' segments"));
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
            let packed = pack_phase(&phase);
            assert_eq!(unpack_phase(&packed, MAX_PHASE_ENTRIES).unwrap(), phase);
            let encoded = encode_segment(&packed.tiles[0], 0, 0x4000).len() as u32;
            assert!(encoded <= SEGMENT_HEADER_BYTES + ENTRY_BYTES * table.receives.len() as u32);
        }
    }

    #[test]
    fn hostile_runs_are_errors_not_panics() {
        let run = |count, cycle, cycle_stride| PackedPhase {
            index: 0,
            tiles: vec![PackedTile { tile: 4, sends: vec![SendRun { cycle, address: u32::MAX, words: 1, paired: false, count, cycle_stride, address_stride: u32::MAX }], receives: vec![] }],
            horizon: 0,
            endpoint_lower_bound: 0,
        };
        assert!(unpack_phase(&run(0, 0, 1), 100).unwrap_err().1.contains("zero entries"));
        assert!(unpack_phase(&run(101, 0, 1), 100).unwrap_err().1.contains("exceeds"));
        assert!(unpack_phase(&run(3, u32::MAX - 1, 1), 100).unwrap_err().1.contains("passes cycle"));
        assert_eq!(unpack_phase(&run(3, 5, 2), 100).unwrap().tiles[0].sends.len(), 3);
    }
}

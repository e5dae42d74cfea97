//! Validity carried from one phase to another that is the first moved buffer by buffer.
//!
//! The same phase of repeated layers is one pattern scheduled once: its requests and tables
//! differ only in where storage placement put each buffer. `validate` decides whether tables
//! deliver a request; what it reads of an address is (1) whether a paired entry's is 8-byte
//! aligned, and (2) the word-level mapping (tile, destination address) -> (source tile, source
//! address) that the receives deliver and that the request asks for (runs are followed word by
//! word, merged and compared). Ports, cycles, delays, sources and word counts are read
//! without addresses. The checks around it (`check_relocated`: the request prepared, its
//! schedule fitted) read addresses modulo 8 (word alignment, pairing), through overlaps of
//! destination ranges, and against the 32-bit limit.
//!
//! So when, on every tile, the two phases' buffers correspond one to one (same sizes, each
//! side's non-empty buffers disjoint and within 32-bit addresses), every move is a multiple of
//! 8 bytes, and every table entry and every request range of the second phase is the first's
//! (same tile, cycle, source, words, pairing) with its address moved by the move of the one
//! buffer that holds its whole range, then the second phase is the first under a bijection of
//! words that keeps tiles, contiguity within a buffer, overlaps and 8-byte alignment: it
//! validates exactly when the first does. `moved_alike` checks those conditions (in time linear in the entries, against a
//! validation's sorting of every run), and says no whenever one fails: then the phase is
//! validated itself.

use super::types::PhaseRequest;
use crate::package::ExchangePhase;

/// A phase's buffers (start address, bytes) per tile, sorted by tile, in the order of their
/// first use among the phase's transfers (`sizing::phase_buffers`).
pub type TileBuffers = [(u32, Vec<(u32, u64)>)];

/// One tile's buffers of the first phase, sorted by start: (start, bytes, move to the second).
struct Moves {
    slots: Vec<(u32, u64, i64)>,
}

impl Moves {
    /// The tile's moves, or None when the buffers do not correspond (count, sizes), overlap
    /// or end past 32-bit addresses on either side, or move by other than a multiple of 8
    /// bytes.
    fn of(from: &[(u32, u64)], to: &[(u32, u64)]) -> Option<Moves> {
        if from.len() != to.len() || from.iter().zip(to).any(|(a, b)| a.1 != b.1) {
            return None;
        }
        let slots: Vec<(u32, u64, i64)> = from.iter().zip(to).map(|(a, b)| (a.0, a.1, b.0 as i64 - a.0 as i64)).collect();
        let within = |list: &[(u32, u64)]| list.iter().all(|b| b.0 as u64 + b.1 <= u32::MAX as u64);
        if slots.iter().any(|s| s.2 % 8 != 0) || !disjoint(from) || !disjoint(to) || !within(from) || !within(to) {
            return None;
        }
        let mut slots = slots;
        slots.sort_unstable();
        Some(Moves { slots })
    }

    /// Whether `moved_to` is `address` moved by the move of the buffer holding the whole range
    /// of `bytes` bytes from `address` (none holds an empty range's start in an empty buffer).
    fn follows(&self, address: u32, bytes: u64, moved_to: u32) -> bool {
        let at = self.slots.partition_point(|s| s.0 <= address);
        let Some(&(start, size, moved)) = at.checked_sub(1).map(|i| &self.slots[i]) else { return false };
        let end = address as u64 + bytes.max(1);
        end <= start as u64 + size && address as i64 + moved == moved_to as i64
    }
}

/// Whether the non-empty buffers of `list` are pairwise disjoint.
fn disjoint(list: &[(u32, u64)]) -> bool {
    let mut spans: Vec<(u64, u64)> = list.iter().filter(|b| b.1 > 0).map(|b| (b.0 as u64, b.0 as u64 + b.1)).collect();
    spans.sort_unstable();
    spans.windows(2).all(|w| w[0].1 <= w[1].0)
}

/// Whether `to` (request, tables, buffers) is `from` moved buffer by buffer as the module note
/// says, so that `to` validates exactly when `from` does.
pub fn moved_alike(from: (&PhaseRequest, &ExchangePhase, &TileBuffers), to: (&PhaseRequest, &ExchangePhase, &TileBuffers)) -> bool {
    let ((request_a, tables_a, buffers_a), (request_b, tables_b, buffers_b)) = (from, to);
    if buffers_a.len() != buffers_b.len() || tables_a.tiles.len() != tables_b.tiles.len() || tables_a.horizon != tables_b.horizon || request_a.transfers.len() != request_b.transfers.len() {
        return false;
    }
    let mut moves: Vec<(u32, Moves)> = Vec::with_capacity(buffers_a.len());
    for (a, b) in buffers_a.iter().zip(buffers_b) {
        match Moves::of(&a.1, &b.1) {
            Some(m) if a.0 == b.0 && moves.last().is_none_or(|l| l.0 < a.0) => moves.push((a.0, m)),
            _ => return false,
        }
    }
    let tile_moves = |tile: u32| moves.binary_search_by_key(&tile, |m| m.0).ok().map(|i| &moves[i].1);
    let follows = |tile: u32, address: u32, words: u32, moved_to: u32| tile_moves(tile).is_some_and(|m| m.follows(address, words as u64 * 4, moved_to));
    for (a, b) in tables_a.tiles.iter().zip(&tables_b.tiles) {
        if a.tile != b.tile || a.sends.len() != b.sends.len() || a.receives.len() != b.receives.len() {
            return false;
        }
        let Some(m) = tile_moves(a.tile) else { return false };
        let sends = a.sends.iter().zip(&b.sends).all(|(x, y)| (x.cycle, x.words, x.paired) == (y.cycle, y.words, y.paired) && m.follows(x.address, x.words as u64 * 4, y.address));
        let receives = a.receives.iter().zip(&b.receives).all(|(x, y)| (x.cycle, x.source, x.words, x.paired) == (y.cycle, y.source, y.words, y.paired) && m.follows(x.address, x.words as u64 * 4, y.address));
        if !sends || !receives {
            return false;
        }
    }
    request_a.transfers.iter().zip(&request_b.transfers).all(|(x, y)| {
        (x.source, x.words, x.destinations.len()) == (y.source, y.words, y.destinations.len())
            && follows(x.source, x.source_address, x.words, y.source_address)
            && x.destinations.iter().zip(&y.destinations).all(|(p, q)| p.tile == q.tile && follows(p.tile, p.address, x.words, q.address))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::{lower_to_tables, schedule_phase, validate, Destination, Transfer};
    use crate::target::{fixtures, Target};

    fn small16() -> Target {
        Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap()
    }

    /// A phase over two buffers per tile (at `starts[tile][slot]`, 256 bytes each): each
    /// tile sends 8 words of its first buffer to the next tile's second buffer and 4 words of
    /// its second buffer (from byte 32) to the tile after that's first buffer (at byte 64).
    fn phase(starts: &[[u32; 2]]) -> (PhaseRequest, Vec<(u32, Vec<(u32, u64)>)>) {
        let n = starts.len() as u32;
        let mut transfers = Vec::new();
        for t in 0..n {
            let (next, after) = ((t + 1) % n, (t + 2) % n);
            transfers.push(Transfer { source: t, source_address: starts[t as usize][0], words: 8, destinations: vec![Destination { tile: next, address: starts[next as usize][1] }].into() });
            transfers.push(Transfer { source: t, source_address: starts[t as usize][1] + 32, words: 4, destinations: vec![Destination { tile: after, address: starts[after as usize][0] + 64 }].into() });
        }
        let buffers = (0..n).map(|t| (t, vec![(starts[t as usize][0], 256), (starts[t as usize][1], 256)])).collect();
        (PhaseRequest { index: 0, transfers, half_duplex: Vec::new() }, buffers)
    }

    /// Starts of the two buffers on each of 16 tiles: the first at `base + 1024 * tile`, the
    /// second `gap` bytes after it.
    fn starts(base: u32, gap: u32) -> Vec<[u32; 2]> {
        (0..16).map(|t| [base + 1024 * t, base + 1024 * t + gap]).collect()
    }

    /// Per tile, the maximal byte ranges the request reads or writes there (its "buffers").
    fn ranges_as_buffers(request: &PhaseRequest) -> Vec<(u32, Vec<(u32, u64)>)> {
        let mut spans: std::collections::BTreeMap<u32, Vec<(u64, u64)>> = std::collections::BTreeMap::new();
        for t in &request.transfers {
            let bytes = t.words as u64 * 4;
            spans.entry(t.source).or_default().push((t.source_address as u64, t.source_address as u64 + bytes));
            for d in &t.destinations {
                spans.entry(d.tile).or_default().push((d.address as u64, d.address as u64 + bytes));
            }
        }
        spans
            .into_iter()
            .map(|(tile, mut list)| {
                list.sort_unstable();
                let mut merged: Vec<(u64, u64)> = Vec::new();
                for (a, b) in list {
                    match merged.last_mut() {
                        Some(last) if a <= last.1 => last.1 = last.1.max(b),
                        _ => merged.push((a, b)),
                    }
                }
                (tile, merged.into_iter().map(|(a, b)| (a as u32, b - a)).collect())
            })
            .collect()
    }

    /// Every buffer laid out again at a random place (same residue mod 8, random gaps, in
    /// order), and the map of an address on a tile to its new place.
    fn relaid(rng: &mut crate::exchange::synthetic::SplitMix64, buffers: &[(u32, Vec<(u32, u64)>)]) -> Vec<(u32, Vec<(u32, u64)>)> {
        buffers
            .iter()
            .map(|(tile, list)| {
                let mut cursor = 1024 + 8 * rng.below(4096);
                let moved = list
                    .iter()
                    .map(|&(start, bytes)| {
                        let at = cursor + (start % 8 + 8 - cursor % 8) % 8;
                        cursor = at + bytes as u32 + 8 * rng.below(64);
                        (at, bytes)
                    })
                    .collect();
                (*tile, moved)
            })
            .collect()
    }

    /// `address` on `tile` moved from `from`'s buffer holding it to `to`'s.
    fn moved_address(from: &[(u32, Vec<(u32, u64)>)], to: &[(u32, Vec<(u32, u64)>)], tile: u32, address: u32) -> u32 {
        let i = from.binary_search_by_key(&tile, |b| b.0).expect("the tile has buffers");
        let slot = from[i].1.iter().position(|&(start, bytes)| start <= address && (address as u64) < start as u64 + bytes.max(1)).expect("a buffer holds the address");
        address - from[i].1[slot].0 + to[i].1[slot].0
    }

    fn moved_request(request: &PhaseRequest, from: &[(u32, Vec<(u32, u64)>)], to: &[(u32, Vec<(u32, u64)>)]) -> PhaseRequest {
        let mut out = request.clone();
        for t in &mut out.transfers {
            t.source_address = moved_address(from, to, t.source, t.source_address);
            for d in &mut t.destinations {
                d.address = moved_address(from, to, d.tile, d.address);
            }
        }
        out
    }

    fn moved_tables(tables: &ExchangePhase, from: &[(u32, Vec<(u32, u64)>)], to: &[(u32, Vec<(u32, u64)>)]) -> ExchangePhase {
        let mut out = tables.clone();
        for t in &mut out.tiles {
            for s in &mut t.sends {
                s.address = moved_address(from, to, t.tile, s.address);
            }
            for r in &mut t.receives {
                r.address = moved_address(from, to, t.tile, r.address);
            }
        }
        out
    }

    /// The claim `moved_alike` rests on, over random phases: a phase whose request and tables
    /// are another's moved buffer by buffer validates exactly when that one does, valid or not
    /// (the tables corrupted before the move: addresses shifted inside their buffers, entries'
    /// addresses swapped, cycles changed), and `moved_alike` recognises every such pair.
    #[test]
    fn moved_phases_validate_alike_valid_or_not() {
        let target = small16();
        let mut rng = crate::exchange::synthetic::SplitMix64(0x5eed_0039);
        let (mut checked, mut invalid) = (0, 0);
        for round in 0..200 {
            let transfers = rng.between(1, 24);
            let request = crate::exchange::synthetic::random_phase(&mut rng, 16, transfers, 24, 30, 20);
            let Ok(schedule) = schedule_phase(&target, &request) else { continue };
            let buffers = ranges_as_buffers(&request);
            let mut tables = lower_to_tables(&target, &request, &schedule);
            // Corrupt most rounds' tables, inside the buffers (so the move still applies).
            let tiles = tables.tiles.len();
            if round % 4 != 0 && tiles > 0 {
                let tile = &mut tables.tiles[rng.below(tiles as u32) as usize];
                let within = |tile: u32, a: u32, words: u32| buffers.iter().find(|b| b.0 == tile).is_some_and(|b| b.1.iter().any(|&(s, n)| s <= a && a as u64 + words as u64 * 4 <= s as u64 + n));
                match rng.below(3) {
                    0 if !tile.receives.is_empty() => {
                        let i = rng.below(tile.receives.len() as u32) as usize;
                        let r = tile.receives[i];
                        let shifted = if rng.chance(50) { r.address.wrapping_add(8) } else { r.address.wrapping_sub(8) };
                        if within(tile.tile, shifted, r.words) {
                            tile.receives[i].address = shifted;
                        }
                    }
                    1 if tile.sends.len() >= 2 => {
                        let (i, j) = (rng.below(tile.sends.len() as u32) as usize, rng.below(tile.sends.len() as u32) as usize);
                        let (a, b) = (tile.sends[i], tile.sends[j]);
                        if within(tile.tile, b.address, a.words) && within(tile.tile, a.address, b.words) {
                            tile.sends[i].address = b.address;
                            tile.sends[j].address = a.address;
                        }
                    }
                    _ if !tile.receives.is_empty() => {
                        let i = rng.below(tile.receives.len() as u32) as usize;
                        tile.receives[i].cycle += 1;
                    }
                    _ => {}
                }
            }
            let first = validate(&target, &request, &tables).is_ok();
            for _ in 0..3 {
                let to = relaid(&mut rng, &buffers);
                let (request_b, tables_b) = (moved_request(&request, &buffers, &to), moved_tables(&tables, &buffers, &to));
                assert!(moved_alike((&request, &tables, &buffers), (&request_b, &tables_b, &to)), "round {round}: a moved phase is not recognised");
                assert_eq!(validate(&target, &request_b, &tables_b).is_ok(), first, "round {round}: the moved phase validates otherwise");
                checked += 1;
            }
            invalid += usize::from(!first);
        }
        assert!(checked > 300 && invalid > 20, "{checked} moved phases checked, {invalid} rounds invalid");
    }

    #[test]
    fn a_phase_moved_buffer_by_buffer_is_recognised_and_anything_else_is_not() {
        let target = small16();
        let (request_a, buffers_a) = phase(&starts(4096, 512));
        let schedule = schedule_phase(&target, &request_a).unwrap();
        let tables_a = lower_to_tables(&target, &request_a, &schedule);
        validate(&target, &request_a, &tables_a).expect("the first phase validates");
        // The same schedule relocated to buffers placed elsewhere (moves of 8-byte multiples).
        let (request_b, buffers_b) = phase(&starts(65536, 768));
        let tables_b = lower_to_tables(&target, &request_b, &schedule);
        validate(&target, &request_b, &tables_b).expect("the moved phase validates");
        assert!(moved_alike((&request_a, &tables_a, &buffers_a), (&request_b, &tables_b, &buffers_b)));

        // One table address off its buffer's move: not alike (and not valid).
        let mut wrong = tables_b.clone();
        let tile = wrong.tiles.iter_mut().find(|t| !t.receives.is_empty()).unwrap();
        tile.receives[0].address += 4;
        assert!(!moved_alike((&request_a, &tables_a, &buffers_a), (&request_b, &wrong, &buffers_b)));
        assert!(validate(&target, &request_b, &wrong).is_err());

        // A move of 4 bytes (not a multiple of 8): not alike, whatever the tables.
        let (request_c, buffers_c) = phase(&starts(4100, 512));
        let tables_c = lower_to_tables(&target, &request_c, &schedule);
        assert!(!moved_alike((&request_a, &tables_a, &buffers_a), (&request_c, &tables_c, &buffers_c)));

        // Buffers of other sizes, or overlapping ones: not alike.
        let mut resized = buffers_b.clone();
        resized[3].1[1].1 = 128;
        assert!(!moved_alike((&request_a, &tables_a, &buffers_a), (&request_b, &tables_b, &resized)));
        let (request_d, buffers_d) = phase(&starts(65536, 128));
        let tables_d = lower_to_tables(&target, &request_d, &schedule);
        assert!(!moved_alike((&request_a, &tables_a, &buffers_a), (&request_d, &tables_d, &buffers_d)));

        // A range that spans past its buffer (the first buffers of tile 0 of 16 bytes on both
        // sides, from which 32 bytes are sent): not alike.
        let (mut short_a, mut short_b) = (buffers_a.clone(), buffers_b.clone());
        short_a[0].1[0].1 = 16;
        short_b[0].1[0].1 = 16;
        assert!(moved_alike((&request_a, &tables_a, &buffers_a), (&request_b, &tables_b, &buffers_b)));
        assert!(!moved_alike((&request_a, &tables_a, &short_a), (&request_b, &tables_b, &short_b)));
    }
}

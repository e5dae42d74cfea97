//! The independent validator: do these tables, run as the device runs them, deliver exactly
//! the phase's transfers?
//!
//! It re-derives everything from the request, the target's delays and the tables alone, and
//! shares no code with the schedulers (only the public types). Checks:
//! - tables sorted, tiles on the chip, no empty entries, paired entries even and 8-byte aligned;
//! - no port busy twice in one cycle: a paired send holds the partner's send port, a paired
//!   receive the partner's receive port unless the partner has the identical receive;
//! - every receive hears a send of its source at `cycle − delay(source, tile)` of the same width;
//! - every sent word is heard by someone, and no tile sends more words than the phase asks;
//! - the words each tile receives are exactly the phase's (source tile, source address) →
//!   destination address mapping: nothing missing, nothing twice, nothing extra;
//! - the stated horizon is the end of the last receive.
//!
//! It works on runs of words, never word by word, so it is cheap enough to run in release.

use crate::package::{ExchangePhase, ReceiveEntry, SendEntry};
use crate::target::Target;

use super::types::{PhaseRequest, ValidationError};

fn cycles(words: u32, paired: bool) -> u32 {
    if paired {
        words / 2
    } else {
        words
    }
}

/// A run of words: on `tile`, at `address`, from `source` at `source_address`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Run {
    tile: u32,
    address: u32,
    source: u32,
    source_address: u32,
    words: u32,
}

pub fn validate(target: &Target, phase: &PhaseRequest, tables: &ExchangePhase) -> Result<(), ValidationError> {
    let tiles = target.chip.tiles;
    let mut sends_of: Vec<&[SendEntry]> = vec![&[]; tiles as usize];
    check_shape(tables, tiles, &mut sends_of)?;
    check_ports(tables, target)?;
    // Receives against sends.
    let receives: usize = tables.tiles.iter().map(|t| t.receives.len()).sum();
    // A receive that hears a whole send entry marks it heard (`heard`, by source in order of
    // `sends_of`); parts of send entries go to `cover`.
    let mut first = Vec::with_capacity(sends_of.len() + 1);
    first.push(0usize);
    for sends in &sends_of {
        first.push(first.last().copied().unwrap_or(0) + sends.len());
    }
    let mut heard = vec![false; first.last().copied().unwrap_or(0)];
    let mut cover: Vec<(u32, u32, u32, u32)> = Vec::new();
    // The run lists come from the thread's spare storage (a phase holds up to hundreds of
    // thousands of runs; fresh lists for every phase cost more in page faults than in work).
    let (mut received, mut required) = SPARE_RUNS.take();
    received.clear();
    received.reserve(receives);
    let mut horizon = 0;
    for t in &tables.tiles {
        for r in &t.receives {
            horizon = horizon.max(r.cycle + cycles(r.words, r.paired));
            if r.source >= tiles {
                return Err(ValidationError::TileOutOfRange { tile: r.source });
            }
            let source = r.source as usize;
            hear(target, t.tile, r, sends_of[source], &mut heard[first[source]..first[source + 1]], &mut cover, &mut received)?;
        }
    }
    if horizon != tables.horizon {
        return Err(ValidationError::Horizon { stated: tables.horizon, actual: horizon });
    }
    // Every send entry fully heard.
    cover.sort_unstable();
    check_heard(&sends_of, &heard, &cover)?;
    // Sent volume per tile.
    let mut expected = vec![0u64; tiles as usize];
    for tr in &phase.transfers {
        if tr.source < tiles {
            expected[tr.source as usize] += tr.words as u64;
        }
    }
    for (tile, sends) in sends_of.iter().enumerate() {
        let words: u64 = sends.iter().map(|s| s.words as u64).sum();
        if words > expected[tile] {
            return Err(ValidationError::SentWords { tile: tile as u32, words, expected: expected[tile] });
        }
    }
    // Delivered mapping against the request.
    // Runs are sorted by tile first: one tile's at a time (`received` comes in tile order).
    let required_runs = || phase.transfers.iter().flat_map(|tr| tr.destinations.iter().map(|d| Run { tile: d.tile, address: d.address, source: tr.source, source_address: tr.source_address, words: tr.words }));
    sorted_by_bucket_into(required_runs, tiles as usize + 1, |r| r.tile.min(tiles) as usize, &mut required);
    sort_grouped(&mut received, |r| r.tile);
    normalise(&mut required);
    normalise(&mut received);
    let result = compare(&required, &received);
    SPARE_RUNS.set((received, required));
    result
}

thread_local! {
    /// Storage a validation leaves to the next one on the thread: its received and required
    /// runs (emptied when taken).
    static SPARE_RUNS: std::cell::Cell<(Vec<Run>, Vec<Run>)> = const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}

fn check_shape<'a>(tables: &'a ExchangePhase, tiles: u32, sends_of: &mut [&'a [SendEntry]]) -> Result<(), ValidationError> {
    let mut previous: Option<u32> = None;
    for t in &tables.tiles {
        if t.tile >= tiles {
            return Err(ValidationError::TileOutOfRange { tile: t.tile });
        }
        if previous.is_some_and(|p| p >= t.tile) {
            return Err(ValidationError::Unsorted { message: format!("tile {} after tile {}", t.tile, previous.unwrap_or(0)) });
        }
        previous = Some(t.tile);
        if t.sends.windows(2).any(|w| w[0].cycle > w[1].cycle) || t.receives.windows(2).any(|w| w[0].cycle > w[1].cycle) {
            return Err(ValidationError::Unsorted { message: format!("entries of tile {} are not in cycle order", t.tile) });
        }
        let entries = t.sends.iter().map(|s| (s.cycle, s.words, s.paired, s.address)).chain(t.receives.iter().map(|r| (r.cycle, r.words, r.paired, r.address)));
        for (cycle, words, paired, address) in entries {
            if words == 0 {
                return Err(ValidationError::Empty { tile: t.tile, cycle });
            }
            if paired && (words % 2 != 0 || address % 8 != 0) {
                return Err(ValidationError::Paired { tile: t.tile, cycle, message: format!("moves {words} words at {address:#x}: needs an even count, 8-byte aligned") });
            }
            if paired && (t.tile ^ 1) >= tiles {
                return Err(ValidationError::Paired { tile: t.tile, cycle, message: "has no partner tile".into() });
            }
        }
        sends_of[t.tile as usize] = &t.sends;
    }
    Ok(())
}

/// A port's occupation: (start, end, share) (see `check_ports`).
type Busy = (u32, u32, (u32, u32));

/// No port is used by two different things in one cycle.
fn check_ports(tables: &ExchangePhase, target: &Target) -> Result<(), ValidationError> {
    // Per port: (start, end, share). Paired receives carry `share` = (source, delay): two of
    // them overlapping on one port with the same share hear the same words at the same cycles,
    // which the hardware allows (partner receives).
    const ALONE: (u32, u32) = (u32::MAX, u32::MAX);
    // A paired entry holds its partner's port too, so the ports are swept one supertile pair
    // at a time (tiles come in order): its four ports, 2 * tile + (0 send, 1 receive) for its
    // two tiles, each collected apart. A port's entries are its own tile's (in cycle order,
    // which `check_shape` checked) followed by the partner's paired ones (in cycle order too):
    // two sorted runs, which the stable sort merges in one pass.
    let mut ports: [Vec<Busy>; 4] = Default::default();
    for pair in tables.tiles.chunk_by(|a, b| a.tile / 2 == b.tile / 2) {
        ports.iter_mut().for_each(Vec::clear);
        for t in pair {
            let (own, partner) = (2 * (t.tile as usize & 1), 2 * ((t.tile as usize ^ 1) & 1));
            for s in &t.sends {
                let end = s.cycle + cycles(s.words, s.paired);
                ports[own].push((s.cycle, end, ALONE));
                if s.paired {
                    ports[partner].push((s.cycle, end, ALONE));
                }
            }
            for r in &t.receives {
                let end = r.cycle + cycles(r.words, r.paired);
                if !r.paired {
                    ports[own + 1].push((r.cycle, end, ALONE));
                    continue;
                }
                let share = (r.source, target.delay(r.source.min(target.chip.tiles - 1), t.tile));
                ports[own + 1].push((r.cycle, end, share));
                ports[partner + 1].push((r.cycle, end, share));
            }
        }
        let first_port = 4 * (pair[0].tile / 2);
        for (local, busy) in ports.iter_mut().enumerate() {
            busy.sort();
            // Sweep the port, remembering the occupation that reaches furthest.
            let mut reach: Option<(u32, (u32, u32))> = None;
            for &(start, end, share) in busy.iter() {
                match reach {
                    Some((furthest, previous)) if start < furthest => {
                        if share == ALONE || share != previous {
                            let port = first_port + local as u32;
                            let name = if local % 2 == 0 { "send" } else { "receive" };
                            return Err(ValidationError::PortConflict { tile: port / 2, port: name, cycle: start });
                        }
                        reach = Some((furthest.max(end), share));
                    }
                    _ => reach = Some((end, share)),
                }
            }
        }
    }
    Ok(())
}

/// Follow a receive through its source's send entries; record what it covers and delivers.
fn hear(target: &Target, tile: u32, r: &ReceiveEntry, sends: &[SendEntry], heard: &mut [bool], cover: &mut Vec<(u32, u32, u32, u32)>, received: &mut Vec<Run>) -> Result<(), ValidationError> {
    let sent = r.cycle as i64 - target.delay(r.source, tile) as i64;
    let unmatched = || ValidationError::UnmatchedReceive { tile, cycle: r.cycle, source_tile: r.source, send_cycle: sent };
    if sent < 0 {
        return Err(unmatched());
    }
    let width = if r.paired { 2 } else { 1 };
    let mut position = sent as u32;
    let mut left = cycles(r.words, r.paired);
    let mut address = r.address;
    let mut index = sends.partition_point(|s| s.cycle <= position).checked_sub(1).ok_or_else(unmatched)?;
    while left > 0 {
        let s = sends.get(index).ok_or_else(unmatched)?;
        let length = cycles(s.words, s.paired);
        if s.paired != r.paired || position < s.cycle || position >= s.cycle + length {
            return Err(unmatched());
        }
        let skip = position - s.cycle;
        let take = left.min(length - skip);
        if skip == 0 && take == length {
            heard[index] = true;
        } else {
            cover.push((r.source, index as u32, skip, skip + take));
        }
        received.push(Run { tile, address, source: r.source, source_address: s.address.wrapping_add(skip * width * 4), words: take * width });
        address = address.wrapping_add(take * width * 4);
        position += take;
        left -= take;
        index += 1;
    }
    Ok(())
}

/// Every send entry is heard whole by one receive (`heard`, flat in the order of `sends_of`)
/// or from its start to its end by parts (`cover`, sorted).
fn check_heard(sends_of: &[&[SendEntry]], heard: &[bool], cover: &[(u32, u32, u32, u32)]) -> Result<(), ValidationError> {
    let mut c = 0;
    let mut flat = 0;
    for (source, sends) in sends_of.iter().enumerate() {
        for (index, s) in sends.iter().enumerate() {
            flat += 1;
            if heard[flat - 1] {
                continue;
            }
            let key = (source as u32, index as u32);
            let mut reached = 0;
            while c < cover.len() && (cover[c].0, cover[c].1) < key {
                c += 1;
            }
            while c < cover.len() && (cover[c].0, cover[c].1) == key {
                if cover[c].2 > reached {
                    break;
                }
                reached = reached.max(cover[c].3);
                c += 1;
            }
            if reached < cycles(s.words, s.paired) {
                return Err(ValidationError::UnreceivedSend { tile: source as u32, cycle: s.cycle + reached });
            }
        }
    }
    Ok(())
}

/// Join sorted runs that continue each other (same tile and source, both addresses
/// contiguous), so that equal mappings compare equal however they were cut.
fn normalise(runs: &mut Vec<Run>) {
    let mut kept = 0;
    for i in 0..runs.len() {
        let r = runs[i];
        if kept > 0 {
            let last = &mut runs[kept - 1];
            if last.tile == r.tile
                && last.source == r.source
                && last.address.wrapping_add(last.words * 4) == r.address
                && last.source_address.wrapping_add(last.words * 4) == r.source_address
            {
                last.words += r.words;
                continue;
            }
        }
        runs[kept] = r;
        kept += 1;
    }
    runs.truncate(kept);
}

fn compare(required: &[Run], received: &[Run]) -> Result<(), ValidationError> {
    for i in 0..required.len().max(received.len()) {
        match (required.get(i), received.get(i)) {
            (Some(a), Some(b)) if a == b => {}
            (Some(a), Some(b)) if (b.tile, b.address) < (a.tile, a.address) || (b.tile == a.tile && b.address == a.address && b.words > a.words) => {
                return Err(ValidationError::Coverage { tile: b.tile, address: b.address, message: "receives words the phase does not ask for, or receives them twice".into() });
            }
            (Some(a), _) => {
                return Err(ValidationError::Coverage { tile: a.tile, address: a.address, message: format!("does not receive the {} words from tile {} at {:#x} the phase asks for", a.words, a.source, a.source_address) });
            }
            (None, Some(b)) => {
                return Err(ValidationError::Coverage { tile: b.tile, address: b.address, message: "receives words the phase does not ask for".into() });
            }
            (None, None) => {}
        }
    }
    Ok(())
}

/// The items `items()` yields, sorted (what `sort_unstable` gives), where `bucket` (below
/// `buckets`) orders them first: every item of a lower bucket is smaller. The items are
/// counted, dealt into their buckets, and each bucket is sorted alone (small sorts, in
/// cache, instead of one sort of a whole phase), by the stable sort: a bucket's items often
/// come in a few ascending runs (a tile's destinations in transfer order), which it merges
/// instead of sorting again; equal items are identical, so the result is the unstable sort's.
#[cfg(test)]
fn sorted_by_bucket<T: Ord + Copy + Default, I: Iterator<Item = T>>(items: impl Fn() -> I, buckets: usize, bucket: impl Fn(&T) -> usize) -> Vec<T> {
    let mut out = Vec::new();
    sorted_by_bucket_into(items, buckets, bucket, &mut out);
    out
}

/// `sorted_by_bucket` into `out` (its contents replaced, its storage reused).
fn sorted_by_bucket_into<T: Ord + Copy + Default, I: Iterator<Item = T>>(items: impl Fn() -> I, buckets: usize, bucket: impl Fn(&T) -> usize, out: &mut Vec<T>) {
    let mut next = vec![0usize; buckets + 1];
    for x in items() {
        next[bucket(&x) + 1] += 1;
    }
    for b in 0..buckets {
        next[b + 1] += next[b];
    }
    let bounds = next.clone();
    out.clear();
    out.resize(next[buckets], T::default());
    for x in items() {
        let b = bucket(&x);
        out[next[b]] = x;
        next[b] += 1;
    }
    for w in bounds.windows(2) {
        out[w[0]..w[1]].sort();
    }
}

/// Sort `items` (what `sort_unstable` gives) that come in groups of equal `group`, groups in
/// increasing order, where `group` orders items first: each group is sorted alone (stably,
/// taking the ascending runs the items come in, as `sorted_by_bucket` does). Items not so
/// grouped are sorted whole.
fn sort_grouped<T: Ord>(items: &mut [T], group: impl Fn(&T) -> u32) {
    let mut previous: Option<u32> = None;
    for chunk in items.chunk_by_mut(|a, b| group(a) == group(b)) {
        let g = group(&chunk[0]);
        if previous.is_some_and(|p| p >= g) {
            items.sort_unstable();
            return;
        }
        previous = Some(g);
        chunk.sort();
    }
}

#[cfg(test)]
mod bucket_tests {
    use super::{sort_grouped, sorted_by_bucket};

    type Item = (u32, u32, u32, (u32, u32));

    /// A fixed pseudo-random sequence of tuples with many ties.
    fn items(n: usize, seed: u64) -> Vec<Item> {
        let mut x = seed;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % m) as u32
        };
        (0..n).map(|_| (next(40), next(50), next(3), (next(2), next(2)))).collect()
    }

    #[test]
    fn sorting_by_bucket_gives_the_plain_sort() {
        for n in [0usize, 1, 2, 7, 1000, 20_000] {
            let items = items(n, 0x2545_F491_4F6C_DD1D);
            let mut plain = items.clone();
            plain.sort_unstable();
            // Bucket 32 collects everything at or past it, as the validator's out-of-range bucket does.
            let bucketed = sorted_by_bucket(|| items.iter().copied(), 33, |t| t.0.min(32) as usize);
            assert_eq!(bucketed, plain, "{n} items");
        }
    }

    #[test]
    fn sorting_groups_gives_the_plain_sort_grouped_or_not() {
        for n in [0usize, 1, 2, 7, 1000, 20_000] {
            let items = items(n, 0x9E37_79B9_7F4A_7C15);
            let mut plain = items.clone();
            plain.sort_unstable();
            // Grouped by the first field (as the validator's runs come by tile), groups shuffled inside.
            let mut grouped = items.clone();
            grouped.sort_unstable_by_key(|t| t.0);
            sort_grouped(&mut grouped, |t| t.0 / 4);
            assert_eq!(grouped, plain, "{n} grouped items");
            // Not grouped: sorted whole.
            let mut loose = items.clone();
            sort_grouped(&mut loose, |t| t.0 / 4);
            assert_eq!(loose, plain, "{n} loose items");
        }
    }
}

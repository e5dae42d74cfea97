//! Memory elements (banks) and the exchange's memory-element rule, as the compiler sees it.
//!
//! Tile SRAM is made of 16 KiB elements below the interleaved window and 32 KiB element pairs
//! inside it (`target.memory`). A tile cannot send from and receive into the same element in
//! one cycle. This module counts, over final exchange tables, the tile-cycles that break the
//! rule, and computes the per-phase lower bound that the rule implies for a placement (a tile
//! whose sends and receives share an element needs at least their sum of cycles there).
//! `optimize_exchange_placement` scores placements with it; the simulator checks the rule
//! with its own code.

use crate::package::ExchangePhase;
use crate::target::{Memory, Target};

/// The element holding byte `address`: standard elements first, then interleaved pairs.
pub fn element_of(m: &Memory, address: u32) -> u32 {
    element_and_end(m, address).0
}

/// One access run split at element boundaries: cycles [start, end) touch `element`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ElementRun {
    pub element: u32,
    pub start: u64,
    pub end: u64,
}

/// Split `words` words at `address` moved from `cycle`, `rate` words per cycle, by element.
pub fn split_runs(m: &Memory, cycle: u32, address: u32, words: u32, rate: u32, out: &mut Vec<ElementRun>) {
    let rate = rate.max(1) as u64;
    // Word `w` of the run moves in cycle `cycle + w / rate` (rates are 1 or 2 words a cycle:
    // no division on this path, which runs for every table entry of every placement scored).
    let cycle_of = |w: u64| cycle as u64 + if rate == 1 { w } else if rate == 2 { w >> 1 } else { w / rate };
    let mut word = 0u64;
    while word < words as u64 {
        let at = address as u64 + word * 4;
        // The element, and where the next element starts (the first address mapping elsewhere).
        let (element, boundary) = element_and_end(m, at as u32);
        let words_here = ((boundary as u64 - at).div_ceil(4)).min(words as u64 - word);
        let first_cycle = cycle_of(word);
        let last_cycle = cycle_of(word + words_here - 1) + 1;
        match out.last_mut() {
            Some(last) if last.element == element && last.end >= first_cycle => last.end = last.end.max(last_cycle),
            _ => out.push(ElementRun { element, start: first_cycle, end: last_cycle }),
        }
        word += words_here;
    }
}

/// `x / d` (shifting where `d` is a power of two, as element sizes are).
fn divide(x: u32, d: u32) -> u32 {
    if d.is_power_of_two() {
        x >> d.trailing_zeros()
    } else {
        x / d
    }
}

/// The element holding byte `address` and where the next element starts (the first address
/// above it mapping elsewhere), with one division.
fn element_and_end(m: &Memory, address: u32) -> (u32, u32) {
    if address < m.interleaved_start {
        let e = m.element_bytes.max(1);
        let index = divide(address.saturating_sub(m.base), e);
        (index, (m.base + (index + 1) * e).min(m.interleaved_start))
    } else {
        let e = m.interleaved_element_bytes.max(1);
        let index = divide(address - m.interleaved_start, e);
        let standard = (m.interleaved_start - m.base).div_ceil(m.element_bytes.max(1));
        (standard + index, m.interleaved_start.saturating_add((index + 1).saturating_mul(e)))
    }
}

fn next_element_start(m: &Memory, address: u32) -> u32 {
    element_and_end(m, address).1
}

/// Conflicting tile-cycles of one phase, the tiles concerned, and the first one found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Conflicts {
    pub tile_cycles: u64,
    pub tiles: u32,
    /// (tile, cycle, element) of the earliest conflict on the lowest such tile.
    pub first: Option<(u32, u64, u32)>,
}

/// Each tile's send and receive runs of a phase by element, sorted by (element, start, end),
/// handed to `each` one tile at a time (two buffers reused over the tiles).
fn tile_runs(target: &Target, phase: &ExchangePhase, mut each: impl FnMut(u32, &[ElementRun], &[ElementRun])) {
    let m = &target.memory;
    let x = &target.exchange;
    let (mut sends, mut receives) = (Vec::new(), Vec::new());
    for t in &phase.tiles {
        sends.clear();
        receives.clear();
        for s in &t.sends {
            split_runs(m, s.cycle, s.address, s.words, if s.paired { x.paired_words_per_cycle } else { x.send_words_per_cycle }, &mut sends);
        }
        for r in &t.receives {
            split_runs(m, r.cycle, r.address, r.words, if r.paired { x.paired_words_per_cycle } else { x.receive_words_per_cycle }, &mut receives);
        }
        sends.sort_unstable_by_key(|r| (r.element, r.start, r.end));
        receives.sort_unstable_by_key(|r| (r.element, r.start, r.end));
        each(t.tile, &sends, &receives);
    }
}

/// Count the cycles in which a tile sends from and receives into the same element.
pub fn phase_conflicts(target: &Target, phase: &ExchangePhase) -> Conflicts {
    let mut out = Conflicts::default();
    tile_runs(target, phase, |tile, sends, receives| tile_conflicts(tile, sends, receives, &mut out));
    out
}

/// The tiles of a phase that send from and receive into one element in some cycle, in order.
pub fn conflict_tiles(target: &Target, phase: &ExchangePhase) -> Vec<u32> {
    let mut out = Vec::new();
    tile_runs(target, phase, |tile, sends, receives| {
        let mut c = Conflicts::default();
        tile_conflicts(tile, sends, receives, &mut c);
        if c.tile_cycles > 0 {
            out.push(tile);
        }
    });
    out
}

/// `phase_conflicts` and `element_bound` of a phase, splitting its runs by element once.
pub fn conflicts_and_bound(target: &Target, phase: &ExchangePhase) -> (Conflicts, u64) {
    let mut out = Conflicts::default();
    let mut bound = 0u64;
    tile_runs(target, phase, |tile, sends, receives| {
        tile_conflicts(tile, sends, receives, &mut out);
        bound = bound.max(tile_bound(sends, receives));
    });
    (out, bound)
}

/// The runs of `runs` (sorted by element) on the element `runs[from]` is on: their end.
fn element_end(runs: &[ElementRun], from: usize) -> usize {
    let element = runs[from].element;
    from + runs[from..].iter().take_while(|r| r.element == element).count()
}

/// Add one tile's conflicting cycles (see `phase_conflicts`) to `out`; `sends` and
/// `receives` sorted by (element, start, end).
fn tile_conflicts(tile: u32, sends: &[ElementRun], receives: &[ElementRun], out: &mut Conflicts) {
    let mut tile_total = 0u64;
    let mut first: Option<(u64, u32)> = None;
    // The elements both touch, in increasing order.
    let (mut i, mut j) = (0, 0);
    while i < sends.len() && j < receives.len() {
        let (a, b) = (sends[i].element, receives[j].element);
        if a < b {
            i = element_end(sends, i);
        } else if b < a {
            j = element_end(receives, j);
        } else {
            let (i_end, j_end) = (element_end(sends, i), element_end(receives, j));
            let (n, at) = overlap(&sends[i..i_end], &receives[j..j_end]);
            if n > 0 {
                tile_total += n;
                if first.is_none_or(|(c, _)| at < c) {
                    first = Some((at, a));
                }
            }
            (i, j) = (i_end, j_end);
        }
    }
    if tile_total > 0 {
        out.tile_cycles += tile_total;
        out.tiles += 1;
        if out.first.is_none() {
            out.first = first.map(|(c, e)| (tile, c, e));
        }
    }
}

/// Total overlap of two interval lists sorted by start (each may overlap itself only through
/// merged runs of one entry, which are joined first), and the earliest overlapping cycle.
fn overlap(a: &[ElementRun], b: &[ElementRun]) -> (u64, u64) {
    let (mut a, mut b) = (Merged::new(a), Merged::new(b));
    let (mut x, mut y) = (a.next(), b.next());
    let (mut total, mut first) = (0u64, u64::MAX);
    while let (Some(p), Some(q)) = (x, y) {
        let lo = p.0.max(q.0);
        let hi = p.1.min(q.1);
        if lo < hi {
            total += hi - lo;
            first = first.min(lo);
        }
        if p.1 < q.1 {
            x = a.next();
        } else {
            y = b.next();
        }
    }
    (total, first)
}

/// The intervals of runs sorted by start, those that touch or overlap joined.
struct Merged<'a> {
    runs: &'a [ElementRun],
    at: usize,
}

impl<'a> Merged<'a> {
    fn new(runs: &'a [ElementRun]) -> Merged<'a> {
        Merged { runs, at: 0 }
    }
}

impl Iterator for Merged<'_> {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        let first = self.runs.get(self.at)?;
        let (start, mut end) = (first.start, first.end);
        self.at += 1;
        while let Some(r) = self.runs.get(self.at).filter(|r| r.start <= end) {
            end = end.max(r.end);
            self.at += 1;
        }
        Some((start, end))
    }
}

/// The memory-element lower bound of a phase under its placement: on every tile, sends from
/// and receives into one element cannot share a cycle, so the tile is busy at least
/// max over elements of (send cycles there + receive cycles there). Returns the largest
/// such figure over tiles (compare with the endpoint bound: it binds when larger).
pub fn element_bound(target: &Target, phase: &ExchangePhase) -> u64 {
    let mut bound = 0u64;
    tile_runs(target, phase, |_, sends, receives| bound = bound.max(tile_bound(sends, receives)));
    bound
}

/// One tile's figure in `element_bound` (`sends` and `receives` sorted by element).
fn tile_bound(sends: &[ElementRun], receives: &[ElementRun]) -> u64 {
    let mut most = 0u64;
    let (mut i, mut j) = (0, 0);
    while i < sends.len() || j < receives.len() {
        // The next element either touches, and its cycles in both.
        let element = match (sends.get(i), receives.get(j)) {
            (Some(a), Some(b)) => a.element.min(b.element),
            (Some(a), None) => a.element,
            (None, Some(b)) => b.element,
            (None, None) => break,
        };
        let mut cycles = 0u64;
        while let Some(r) = sends.get(i).filter(|r| r.element == element) {
            cycles += r.end - r.start;
            i += 1;
        }
        while let Some(r) = receives.get(j).filter(|r| r.element == element) {
            cycles += r.end - r.start;
            j += 1;
        }
        most = most.max(cycles);
    }
    most
}

/// [start, end) of the element (or interleaved element pair) holding `address`.
pub fn element_range(m: &Memory, address: u32) -> (u32, u32) {
    let end = next_element_start(m, address);
    let start = if address < m.interleaved_start {
        m.base + (address.saturating_sub(m.base)) / m.element_bytes.max(1) * m.element_bytes.max(1)
    } else {
        m.interleaved_start + (address - m.interleaved_start) / m.interleaved_element_bytes.max(1) * m.interleaved_element_bytes.max(1)
    };
    (start, end)
}

#[cfg(test)]
mod tests {
    use super::{element_and_end, element_of, next_element_start, split_runs, tile_bound, tile_conflicts, Conflicts, ElementRun};
    use crate::target::Memory;

    fn memory(element_bytes: u32, interleaved_element_bytes: u32) -> Memory {
        let mut m = crate::target::Target::from_toml(crate::target::fixtures::IPU21, "ipu21.toml").unwrap().memory;
        m.element_bytes = element_bytes;
        m.interleaved_element_bytes = interleaved_element_bytes;
        m
    }

    /// Elements count up from the base, one every `element_bytes`, then one every
    /// `interleaved_element_bytes` from the interleaved window's start; each element ends where
    /// the next address maps to the next element.
    #[test]
    fn elements_and_their_ends_follow_the_memory_layout() {
        // The target's power-of-two elements, and sizes that are not powers of two.
        for (e, ie) in [(16 * 1024, 32 * 1024), (12_000, 20_004), (4, 8)] {
            let m = memory(e, ie);
            let standard = (m.interleaved_start - m.base).div_ceil(e);
            assert_eq!(element_and_end(&m, m.base), (0, (m.base + e).min(m.interleaved_start)));
            assert_eq!(element_of(&m, m.base + e), 1.min(standard));
            assert_eq!(element_and_end(&m, m.interleaved_start), (standard, m.interleaved_start + ie));
            assert_eq!(element_of(&m, m.interleaved_start + ie), standard + 1);
            let top = m.interleaved_start + 3 * ie + 20;
            let step = ((top - m.base) / 5000).max(1) * 4;
            for address in (m.base..top).step_by(step as usize).chain([m.interleaved_start - 4]) {
                let (element, end) = element_and_end(&m, address);
                assert!(end > address, "address {address:#x}: end {end:#x}");
                assert_eq!(element_of(&m, end - 4), element, "the last word before {end:#x} is in element {element}");
                assert_eq!(element_of(&m, end), element + 1, "{end:#x} starts element {}", element + 1);
                assert_eq!(next_element_start(&m, address), end);
            }
        }
    }

    /// Conflicts, the first conflict and the bound of one tile's runs, against a count cycle by
    /// cycle: random runs on a few elements, overlapping themselves and each other.
    #[test]
    fn tile_conflicts_and_bound_match_a_count_cycle_by_cycle() {
        let mut rng = crate::exchange::synthetic::SplitMix64(0x9E37_79B9_7F4A_7C15);
        for case in 0..500 {
            let mut runs = || -> Vec<ElementRun> {
                let mut v: Vec<ElementRun> = (0..rng.below(12))
                    .map(|_| {
                        let start = rng.below(60) as u64;
                        ElementRun { element: rng.below(4), start, end: start + 1 + rng.below(8) as u64 }
                    })
                    .collect();
                v.sort_unstable_by_key(|r| (r.element, r.start, r.end));
                v
            };
            let (sends, receives) = (runs(), runs());
            let mut out = Conflicts::default();
            tile_conflicts(7, &sends, &receives, &mut out);
            let (mut total, mut first, mut bound) = (0u64, None::<(u64, u32)>, 0u64);
            for element in 0..4u32 {
                let busy = |runs: &[ElementRun], c: u64| runs.iter().any(|r| r.element == element && r.start <= c && c < r.end);
                for c in 0..80 {
                    if busy(&sends, c) && busy(&receives, c) {
                        total += 1;
                        if first.is_none_or(|(f, _)| c < f) {
                            first = Some((c, element));
                        }
                    }
                }
                let cycles: u64 = sends.iter().chain(&receives).filter(|r| r.element == element).map(|r| r.end - r.start).sum();
                bound = bound.max(cycles);
            }
            assert_eq!(out.tile_cycles, total, "case {case}: {sends:?} {receives:?}");
            assert_eq!(out.tiles, (total > 0) as u32, "case {case}");
            assert_eq!(out.first, first.map(|(c, e)| (7, c, e)), "case {case}");
            assert_eq!(tile_bound(&sends, &receives), bound, "case {case}");
        }
    }

    #[test]
    fn runs_split_at_element_boundaries_by_cycle() {
        let m = memory(16 * 1024, 32 * 1024);
        let start = m.base + 16 * 1024 - 8;
        let mut out = Vec::new();
        // Four words: two in element 0, two in element 1; paired (two words a cycle).
        split_runs(&m, 100, start, 4, 2, &mut out);
        assert_eq!(out, vec![ElementRun { element: 0, start: 100, end: 101 }, ElementRun { element: 1, start: 101, end: 102 }]);
        // Three words a cycle: words 0..2 in cycle 100, word 2 (element 1) in cycle 100 too.
        out.clear();
        split_runs(&m, 100, start, 3, 3, &mut out);
        assert_eq!(out, vec![ElementRun { element: 0, start: 100, end: 101 }, ElementRun { element: 1, start: 100, end: 101 }]);
    }
}

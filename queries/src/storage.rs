//! `place_storage`: final addresses for every buffer, per tile, honouring regions, alignment
//! and lifetimes (buffers whose step intervals do not overlap may share bytes).
//!
//! Code, vertex state and exchange tables sit at the bottom of standard memory (instruction
//! fetch works only there). AMP partials go to interleaved memory, 16-byte aligned;
//! matrix-product weights prefer interleaved memory (128-bit weight loads); everything else
//! prefers standard memory. First fit by start step; a buffer that fits nowhere is an error
//! naming the tile, the buffer, its bytes and steps, and each region it may use with its
//! capacity and the bytes taken there at those steps (`PlacementError`).
//!
//! A matrix product's streamed input (A) and its output (C: partials or f16) never share a
//! memory element: the AMP's inner loop loads the input and the partials and stores partials
//! in one instruction, whose accesses must hit different memory elements (machine model,
//! memory rules `[OFF]`; poplibs' AMP convolution vertices carry the same constraint between
//! their input and output fields). This rule is hard: unlike the exchange rules it is never
//! relaxed when room is short, and a buffer that cannot keep it does not fit.
//!
//! Where neither first-fit order fits a tile, a buffer that finds no room moves the buffers in
//! its way (`TileContext::make_room`). The file is long because its tests (a third of it:
//! first fit against a plain reference, the rules, and random tiles whose placements, moved
//! buffers included, are checked rule by rule) sit beside the code they check.

use rayon::prelude::*;

use crate::elements::element_range;
use crate::exchange_placement::RelativeMemo;
use crate::hash::{Digest, KeyHasher};
use crate::lower::Lowered;
use crate::package::AllocationKind;
use crate::target::Target;

#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Placement {
    /// Address of each buffer of the lowering.
    pub addresses: Vec<u32>,
    /// Per tile: [start, end) of its code and tables.
    pub code: Vec<(u32, u32)>,
    /// Per tile: highest address used in standard and in interleaved memory.
    pub peak_standard: Vec<u32>,
    pub peak_interleaved: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementError {
    pub tile: u32,
    pub label: String,
    pub bytes: u32,
    /// The region the buffer prefers, its bytes, and the most bytes of other buffers live there
    /// at one of the buffer's steps.
    pub region: &'static str,
    pub capacity: u32,
    pub live: u64,
    /// The other region (name, bytes, most bytes live), where the buffer may go there too and
    /// found no room either (a data buffer; partials go only to interleaved memory).
    pub also: Option<(&'static str, u32, u64)>,
    pub first: u32,
    pub last: u32,
}

impl std::fmt::Display for PlacementError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let PlacementError { tile, label, bytes, region, capacity, live, first, last, .. } = self;
        // A region whose live bytes leave room for the buffer failed on its free pieces
        // (fragmentation, alignment, or the memory-element rules).
        let room = |region: &str, capacity: u32, live: u64| {
            let pieces = if live + *bytes as u64 <= capacity as u64 { " and the rest in pieces too small" } else { "" };
            format!("{capacity} bytes of {region} memory, {live} of them taken then{pieces}")
        };
        match self.also {
            None => write!(f, "tile {tile}: '{label}' needs {bytes} bytes of {region} memory alive at steps {first}..={last}, but there are only {}", room(region, *capacity, *live)),
            Some((other, other_capacity, other_live)) => write!(
                f,
                "tile {tile}: '{label}' needs {bytes} bytes of {region} or {other} memory alive at steps {first}..={last}, but neither has room: there are only {}, and {}",
                room(region, *capacity, *live),
                room(other, other_capacity, other_live)
            ),
        }
    }
}

impl std::error::Error for PlacementError {}

/// One tile's result: (buffer, address) pairs, its code range, and its peaks per region.
type TilePlacement = (Vec<(u32, u32)>, (u32, u32), u32, u32);

#[derive(Clone)]
struct Placed {
    start: u32,
    end: u32,
    first: u32,
    last: u32,
}

pub fn place_storage(target: &Target, lowered: &Lowered, code_bytes: &[u32]) -> Result<Placement, PlacementError> {
    place_storage_with(target, lowered, code_bytes, &ExchangeRules::default())
}

/// What `optimize_exchange_placement` asks of placement: per buffer, the buffers of the same
/// tile that it sends against or receives against in some phase (they must not share a memory
/// element with it, where room allows), and the offset from the region start at which
/// receive buffers start their search (in 4 KiB steps; the search wraps to the region start).
/// The opposites and receive flags are shared (candidates at other offsets take them
/// without a copy).
#[derive(Clone, Debug, Default)]
pub struct ExchangeRules {
    pub opposites: std::sync::Arc<Vec<Vec<u32>>>,
    pub receives: std::sync::Arc<Vec<bool>>,
    pub receive_offset: u32,
    /// Opposites are never shared, not only where room allows: a buffer that finds no room
    /// away from its opposites' elements does not fit (the search's test of whether a program
    /// leaves room to keep every phase free of memory-element conflicts).
    pub strict: bool,
}

/// `place_storage` under exchange rules (see `ExchangeRules`).
pub fn place_storage_with(target: &Target, lowered: &Lowered, code_bytes: &[u32], rules: &ExchangeRules) -> Result<Placement, PlacementError> {
    place_storage_memoized(target, lowered, code_bytes, rules, None)
}

/// `place_storage_with`, each tile's placement taken from `memo` (with its scope: the target,
/// `RelativeMemo::for_statistics`) where a rebuilding process placed a tile alike before
/// (`tile_key`: everything placing a tile reads), and kept there when made.
pub fn place_storage_memoized(target: &Target, lowered: &Lowered, code_bytes: &[u32], rules: &ExchangeRules, memo: Option<(&RelativeMemo, &Digest)>) -> Result<Placement, PlacementError> {
    let m = &target.memory;
    let amp = amp_counterparts(lowered);
    let mut per_tile: Vec<Vec<u32>> = vec![Vec::new(); lowered.tiles as usize];
    for (i, b) in lowered.buffers.iter().enumerate() {
        per_tile[b.tile as usize].push(i as u32);
    }
    // The error reported is the lowest failing tile's, so once a tile fails the tiles above it
    // are not placed (`None`): their results could not change the outcome. A tile is skipped
    // only above a tile that failed, so the lowest failing tile is always placed, whatever the
    // threads' order: the same error at any thread count. (Placements that do not fit are
    // common: the exchange-placement search tries offsets that do not fit, and feasibility
    // places programs over tile memory.)
    let lowest_failed = std::sync::atomic::AtomicUsize::new(usize::MAX);
    let results: Vec<Option<Result<TilePlacement, PlacementError>>> = per_tile
        .par_iter()
        .enumerate()
        .map(|(tile, ids)| {
            if tile > lowest_failed.load(std::sync::atomic::Ordering::Relaxed) {
                return None;
            }
            let placed = match memo {
                None => place_one_tile(m, lowered, rules, &amp, tile, code_bytes, ids),
                Some((memo, scope)) => {
                    let key = tile_key(scope, m, lowered, rules, &amp, tile, code_bytes, ids);
                    match memo.tile_placement(&key) {
                        Some(kept) => Ok(kept.placement(m, tile, code_bytes, ids)),
                        None => {
                            let placed = place_one_tile(m, lowered, rules, &amp, tile, code_bytes, ids);
                            if let Ok(p) = &placed {
                                memo.keep_tile_placement(key, KeptTile::of(p, ids));
                            }
                            placed
                        }
                    }
                }
            };
            if placed.is_err() {
                lowest_failed.fetch_min(tile, std::sync::atomic::Ordering::Relaxed);
            }
            Some(placed)
        })
        .collect();
    let mut placement = Placement { addresses: vec![0; lowered.buffers.len()], code: Vec::new(), peak_standard: Vec::new(), peak_interleaved: Vec::new() };
    for r in results {
        // A skipped tile lies above a failed one, whose error comes first.
        let Some(r) = r else { unreachable!("a tile is skipped only above a tile that failed") };
        let (addresses, code, ps, pi) = r?;
        for (i, a) in addresses {
            placement.addresses[i as usize] = a;
        }
        placement.code.push(code);
        placement.peak_standard.push(ps);
        placement.peak_interleaved.push(pi);
    }
    Ok(placement)
}

/// A tile's placement as a rebuilding process keeps it (`RelativeMemo`): each buffer's address
/// by its position in the tile's buffer list (ascending index), in the order placed, and the
/// regions' peaks. The code range is not kept: it is the tile's code, made again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptTile {
    addresses: Vec<(u32, u32)>,
    peak_standard: u32,
    peak_interleaved: u32,
}

impl KeptTile {
    fn of(placed: &TilePlacement, ids: &[u32]) -> KeptTile {
        let position = |i: u32| ids.binary_search(&i).expect("a tile's placement places its own buffers") as u32;
        KeptTile { addresses: placed.0.iter().map(|&(i, a)| (position(i), a)).collect(), peak_standard: placed.2, peak_interleaved: placed.3 }
    }

    fn placement(&self, m: &crate::target::Memory, tile: usize, code_bytes: &[u32], ids: &[u32]) -> TilePlacement {
        let code = code_bytes.get(tile).copied().unwrap_or(0);
        (self.addresses.iter().map(|&(k, a)| (ids[k as usize], a)).collect(), code_range(m.base, code), self.peak_standard, self.peak_interleaved)
    }
}

/// Everything placing one tile reads (`place_one_tile`), its buffers by position in the tile's
/// list: the target (`scope`), where its data starts (the code's bytes only through
/// `data_start`), the receive offset and strictness of the rules and whether there are any,
/// and per buffer its bytes,
/// kind, region preference, steps, whether it receives, and the positions of its opposites and
/// matrix-product counterparts (buffers elsewhere are never near it, and are left out).
#[allow(clippy::too_many_arguments)]
fn tile_key(scope: &Digest, m: &crate::target::Memory, lowered: &Lowered, rules: &ExchangeRules, amp: &[Vec<u32>], tile: usize, code_bytes: &[u32], ids: &[u32]) -> Digest {
    let code = code_bytes.get(tile).copied().unwrap_or(0);
    let mut h = KeyHasher::new("ipuq tile placement v2");
    // Whether any rules exist at all (with none, a tile that does not fit is not placed again).
    h.add(scope).add(&data_start(m.base, code)).add(&rules.receive_offset).add(&rules.strict).add(&rules.opposites.is_empty()).add(&(ids.len() as u64));
    let positions = |others: &[u32], h: &mut KeyHasher| {
        let local: Vec<u32> = others.iter().filter_map(|o| ids.binary_search(o).ok().map(|k| k as u32)).collect();
        h.add(&(local.len() as u64));
        for k in local {
            h.add(&k);
        }
    };
    for &i in ids {
        let b = &lowered.buffers[i as usize];
        let kind: u8 = match b.kind {
            AllocationKind::Code => 0,
            AllocationKind::Data => 1,
            AllocationKind::Partials => 2,
        };
        h.add(&b.bytes).add(&kind).add(&b.prefer_interleaved).add(&b.first_step).add(&b.last_step).add(&rules.receives.get(i as usize).copied().unwrap_or(false));
        positions(rules.opposites.get(i as usize).map_or(&[], |v| v.as_slice()), &mut h);
        positions(amp.get(i as usize).map_or(&[], |v| v.as_slice()), &mut h);
    }
    h.finish()
}

/// One tile's placement: its buffers by first step (largest first among equals); when the
/// exchange rules left no room, again largest first; and when neither order fits (and the
/// rules are not strict), by first step again, moving placed buffers to make room for one
/// that fits nowhere.
fn place_one_tile(m: &crate::target::Memory, lowered: &Lowered, rules: &ExchangeRules, amp: &[Vec<u32>], tile: usize, code_bytes: &[u32], ids: &[u32]) -> Result<TilePlacement, PlacementError> {
    let code = code_bytes.get(tile).copied().unwrap_or(0);
    // Code (vertex state and exchange tables too) runs only from below the interleaved region:
    // instructions are not fetched above it (the simulator rejects such an image).
    if m.base.saturating_add(code) > m.interleaved_start {
        let capacity = m.interleaved_start - m.base;
        return Err(PlacementError { tile: tile as u32, label: "code".into(), bytes: code, region: "standard", capacity, live: 0, also: None, first: 0, last: lowered.steps.len().saturating_sub(1) as u32 });
    }
    let mut by_start = ids.to_vec();
    by_start.sort_by_key(|&i| {
        let b = &lowered.buffers[i as usize];
        (b.first_step, std::cmp::Reverse(b.bytes), i)
    });
    let first = place_tile(m, lowered, rules, amp, tile, code, &by_start, true, false);
    if first.is_ok() {
        return first;
    }
    if !(rules.opposites.is_empty() && ids.iter().all(|&i| amp[i as usize].is_empty())) {
        // Separating opposites (or a product's input from its output) fragmented the tile's
        // memory (the rules move buffers off the lowest free addresses, and a later large
        // buffer finds no room): the tile is placed again, the largest buffers first, under
        // the same rules.
        let mut largest = ids.to_vec();
        largest.sort_by_key(|&i| {
            let b = &lowered.buffers[i as usize];
            (std::cmp::Reverse(b.bytes), b.first_step, i)
        });
        if let Ok(placed) = place_tile(m, lowered, rules, amp, tile, code, &largest, false, false) {
            return Ok(placed);
        }
    }
    if rules.strict {
        // Strict rules ask whether the program leaves room to keep every phase's opposites
        // apart as the usual placement lays buffers out (first fit, which moves nothing where
        // it fits by sharing an element): a layout found only by moving buffers would answer
        // yes for a placement that then keeps its conflicts.
        return first;
    }
    // First fit left a buffer's bytes free only in pieces (or the rules took them): the tile
    // is placed by first step again, and a buffer that finds no room moves the buffers in
    // the way (`TileContext::make_room`). Only tiles that failed both orders change, so
    // placements that fitted before are the same. Where this fails too, its error is the one
    // reported: up to the buffer the first order failed on, both placed alike, so it names a
    // buffer (that one or a later one) for which moving others made no room.
    place_tile(m, lowered, rules, amp, tile, code, &by_start, true, true)
}

/// Per buffer: the buffers it meets as a matrix product's input (A) or output (C) in some
/// call, the other side of that call (a product's input and output must lie in different
/// memory elements; see the module note). Sorted, without repeats.
fn amp_counterparts(lowered: &Lowered) -> Vec<Vec<u32>> {
    let mut amp: Vec<Vec<u32>> = vec![Vec::new(); lowered.buffers.len()];
    for set in &lowered.compute_sets {
        for (_, call) in set.iter() {
            if let crate::package::VertexCall::MatMul { a, c, .. } = call {
                if a.buffer != c.buffer && (a.buffer as usize) < amp.len() && (c.buffer as usize) < amp.len() {
                    amp[a.buffer as usize].push(c.buffer);
                    amp[c.buffer as usize].push(a.buffer);
                }
            }
        }
    }
    for list in &mut amp {
        list.sort_unstable();
        list.dedup();
    }
    amp
}

/// Memory-element ranges [start, end), sorted.
type ElementRanges = Vec<(u32, u32)>;

/// What placing one tile's buffers reads besides the buffers themselves.
struct TileContext<'a> {
    m: &'a crate::target::Memory,
    lowered: &'a Lowered,
    rules: &'a ExchangeRules,
    amp: &'a [Vec<u32>],
    /// [standard, interleaved]: each region's [start, end) for data.
    ranges: [(u32, u32); 2],
}

/// A tile's placement so far: per region ([standard, interleaved]) the placed buffers sorted
/// by (start, end) (when buffers come by start step, those that ended before the current
/// buffer's first step are dropped: each first fit scans only what is alive), and each placed
/// buffer's address, in the order placed and by buffer.
#[derive(Clone)]
struct TileState {
    placed: [Vec<Placed>; 2],
    out: Vec<(u32, u32)>,
    at: std::collections::HashMap<u32, u32>,
}

impl TileContext<'_> {
    fn alignment(&self, i: u32) -> u32 {
        if self.lowered.buffers[i as usize].kind == AllocationKind::Partials {
            self.m.partial_alignment
        } else {
            self.m.data_alignment
        }
    }

    /// The regions a buffer may use, the one it prefers first (true: interleaved).
    fn regions(&self, i: u32) -> &'static [bool] {
        let b = &self.lowered.buffers[i as usize];
        match (b.kind, b.prefer_interleaved) {
            (AllocationKind::Partials, _) => &[true],
            (_, true) => &[true, false],
            _ => &[false, true],
        }
    }

    /// The element ranges of the placed buffers among `others`, sorted.
    fn elements_of(&self, state: &TileState, others: &[u32]) -> Vec<(u32, u32)> {
        let mut list: Vec<(u32, u32)> = others
            .iter()
            .filter_map(|o| state.at.get(o).map(|&s| (s, s + self.lowered.buffers[*o as usize].bytes)))
            .map(|(s, e)| (element_range(self.m, s).0, element_range(self.m, e.saturating_sub(1).max(s)).1))
            .collect();
        list.sort_unstable();
        list
    }

    /// The elements buffer `i` must not share (its matrix-product counterparts'), and those it
    /// avoids where room allows (those and its exchange opposites'), as placed in `state`.
    fn avoided(&self, state: &TileState, i: u32) -> (ElementRanges, ElementRanges) {
        let hard = self.elements_of(state, &self.amp[i as usize]);
        let mut avoid = self.elements_of(state, self.rules.opposites.get(i as usize).map_or(&[], |v| v.as_slice()));
        if !hard.is_empty() {
            avoid.extend_from_slice(&hard);
            avoid.sort_unstable();
        }
        (hard, avoid)
    }

    /// Where buffer `i` goes first: away from opposite elements from the receive offset, then
    /// from the region start, then (room is short, and the rules are not strict) anywhere but
    /// a product counterpart's elements; in each, its preferred region first. `lists`: the
    /// placed buffers to fit among, per region (`state`'s own lists when `None`).
    fn fit(&self, state: &TileState, i: u32, lists: Option<&[Vec<Placed>; 2]>) -> Option<(bool, u32)> {
        let b = &self.lowered.buffers[i as usize];
        let (hard, avoid) = self.avoided(state, i);
        let offset = if self.rules.receives.get(i as usize).copied().unwrap_or(false) { self.rules.receive_offset } else { 0 };
        let attempts: [(&[(u32, u32)], u32); 3] = [(&avoid, offset), (&avoid, 0), (&hard, 0)];
        let tries = if self.rules.strict { 2 } else { 3 };
        let lists = lists.unwrap_or(&state.placed);
        for (avoid, offset) in attempts.into_iter().take(tries) {
            for &inter in self.regions(i) {
                let range = self.ranges[inter as usize];
                let from = (range.0.saturating_add(offset).min(range.1), range.1);
                if let Some(start) = first_fit(from, &lists[inter as usize], avoid, b.bytes, self.alignment(i), b.first_step, b.last_step) {
                    return Some((inter, start));
                }
            }
        }
        None
    }

    /// Every placed buffer of `state`, per region, sorted by (start, end): none dropped.
    fn all_placed(&self, state: &TileState) -> [Vec<Placed>; 2] {
        let mut lists: [Vec<Placed>; 2] = [Vec::new(), Vec::new()];
        for &(j, start) in &state.out {
            let b = &self.lowered.buffers[j as usize];
            lists[(start >= self.m.interleaved_start) as usize].push(Placed { start, end: start + b.bytes, first: b.first_step, last: b.last_step });
        }
        for list in &mut lists {
            list.sort_by_key(|p| (p.start, p.end));
        }
        lists
    }

    /// Room for buffer `i`, which fits nowhere as the buffers lie, made by moving some of them
    /// ("rip up and re-place"): the windows of its size in each region it may use, away from
    /// the elements it must not share and from the buffers in `pinned`, are ranked by the
    /// bytes of the placed buffers alive with it that they cover (fewest first, then the
    /// preferred region, then the lowest address); for the first `MOVE_WINDOWS`, the buffers
    /// covered are taken out, `i` goes into the window, and they go back, largest first, each
    /// by the same first fit among every buffer placed (also those that ended before `i`
    /// began), or, `depth` allowing, by moving others in turn (never `i` nor one moved for
    /// it). The first window after which all of them find room is kept; with none, nothing
    /// changes.
    fn make_room(&self, state: &mut TileState, i: u32, depth: u32, pinned: &mut Vec<u32>) -> bool {
        const MOVE_WINDOWS: usize = 8;
        let b = &self.lowered.buffers[i as usize];
        let alignment = self.alignment(i);
        // (Strict rules never move buffers: `place_one_tile`.)
        let blocked = self.elements_of(state, &self.amp[i as usize]);
        let mut windows: Vec<(u64, usize, u32)> = Vec::new();
        // Per region `i` may use: every placed buffer alive with it there (start, end, buffer).
        let mut alive_in: Vec<Vec<(u32, u32, u32)>> = Vec::new();
        for (rank, &inter) in self.regions(i).iter().enumerate() {
            let range = self.ranges[inter as usize];
            let alive: Vec<(u32, u32, u32)> = state
                .out
                .iter()
                .filter(|&&(j, start)| {
                    let o = &self.lowered.buffers[j as usize];
                    (start >= self.m.interleaved_start) == inter && o.first_step <= b.last_step && b.first_step <= o.last_step
                })
                .map(|&(j, start)| (start, start + self.lowered.buffers[j as usize].bytes, j))
                .collect();
            let mut starts: Vec<u32> = vec![align(range.0, alignment)];
            for &(start, end, _) in &alive {
                starts.push(align(end, alignment));
                if let Some(below) = start.checked_sub(b.bytes) {
                    starts.push(below / alignment * alignment);
                }
            }
            starts.sort_unstable();
            starts.dedup();
            'windows: for s in starts {
                let end = s as u64 + b.bytes as u64;
                if s < range.0 || end > range.1 as u64 || blocked.iter().any(|&(a, z)| (s as u64) < z as u64 && (a as u64) < end) {
                    continue;
                }
                let mut covered = 0u64;
                for &(start, stop, j) in &alive {
                    if (s as u64) < stop as u64 && (start as u64) < end {
                        if pinned.contains(&j) {
                            continue 'windows;
                        }
                        covered += (stop - start) as u64;
                    }
                }
                windows.push((covered, rank, s));
            }
            alive_in.push(alive);
        }
        windows.sort_unstable();
        for &(_, rank, s) in windows.iter().take(MOVE_WINDOWS) {
            let inter = self.regions(i)[rank];
            let end = s + b.bytes;
            let mut trial = state.clone();
            let moved: Vec<u32> = alive_in[rank].iter().filter(|&&(start, stop, _)| start < end && s < stop).map(|&(.., j)| j).collect();
            for &j in &moved {
                trial.remove(self.lowered, j);
            }
            trial.put(self.lowered, i, inter, s);
            let mut order = moved;
            order.sort_by_key(|&j| (std::cmp::Reverse(self.lowered.buffers[j as usize].bytes), j));
            let depth_pinned = pinned.len();
            pinned.push(i);
            let all_back = order.iter().all(|&j| {
                let lists = self.all_placed(&trial);
                match self.fit(&trial, j, Some(&lists)) {
                    Some((inter, start)) => {
                        trial.put(self.lowered, j, inter, start);
                        pinned.push(j);
                        true
                    }
                    None if depth > 0 => {
                        let moved_room = self.make_room(&mut trial, j, depth - 1, pinned);
                        pinned.push(j);
                        moved_room
                    }
                    None => false,
                }
            });
            pinned.truncate(depth_pinned);
            if all_back {
                *state = trial;
                return true;
            }
        }
        false
    }
}

impl TileState {
    fn put(&mut self, lowered: &Lowered, i: u32, inter: bool, start: u32) {
        let b = &lowered.buffers[i as usize];
        let end = start + b.bytes;
        let placed = &mut self.placed[inter as usize];
        let slot = placed.partition_point(|p| (p.start, p.end) <= (start, end));
        placed.insert(slot, Placed { start, end, first: b.first_step, last: b.last_step });
        self.out.push((i, start));
        self.at.insert(i, start);
    }

    /// Takes buffer `i` out (placed buffers alive at one time never share bytes, so its
    /// range and steps name it in its region's list).
    fn remove(&mut self, lowered: &Lowered, i: u32) {
        let Some(start) = self.at.remove(&i) else { return };
        let b = &lowered.buffers[i as usize];
        for list in &mut self.placed {
            list.retain(|p| !(p.start == start && p.end == start + b.bytes && p.first == b.first_step && p.last == b.last_step));
        }
        self.out.retain(|&(j, _)| j != i);
    }
}

/// How many times over a buffer moved to make room may itself move others
/// (`TileContext::make_room`).
const MOVE_DEPTH: u32 = 1;

/// One tile's placement, buffers taken in `order`; `by_start`: the order is by first step,
/// so buffers that ended before the current one's first step are dropped from the scans;
/// `make_room`: a buffer that fits nowhere moves others to make room (`TileContext::make_room`).
#[allow(clippy::too_many_arguments)]
fn place_tile(m: &crate::target::Memory, lowered: &Lowered, rules: &ExchangeRules, amp: &[Vec<u32>], tile: usize, code: u32, order: &[u32], by_start: bool, make_room: bool) -> Result<TilePlacement, PlacementError> {
    let code_end = data_start(m.base, code);
    let ctx = TileContext { m, lowered, rules, amp, ranges: [(code_end, m.interleaved_start), (m.interleaved_start, m.loader_limit)] };
    let mut state = TileState { placed: [Vec::new(), Vec::new()], out: Vec::with_capacity(order.len()), at: std::collections::HashMap::new() };
    let mut pruned_at: Option<u32> = None;
    for &i in order {
        let b = &lowered.buffers[i as usize];
        if by_start && pruned_at != Some(b.first_step) {
            pruned_at = Some(b.first_step);
            for list in &mut state.placed {
                list.retain(|p| p.last >= b.first_step);
            }
        }
        if let Some((inter, start)) = ctx.fit(&state, i, None) {
            state.put(lowered, i, inter, start);
            continue;
        }
        if make_room && ctx.make_room(&mut state, i, MOVE_DEPTH, &mut Vec::new()) {
            continue;
        }
        // The most bytes the region's placed buffers hold at one of this buffer's steps
        // (those placed are the ones that can overlap it: see the pruning above).
        let live = |placed: &[Placed]| (b.first_step..=b.last_step).map(|step| placed.iter().filter(|p| p.first <= step && step <= p.last).map(|p| (p.end - p.start) as u64).sum::<u64>()).max().unwrap_or(0);
        let region = |inter: bool| {
            let range = ctx.ranges[inter as usize];
            (if inter { "interleaved" } else { "standard" }, range.1 - range.0, live(&state.placed[inter as usize]))
        };
        let regions = ctx.regions(i);
        let (name, capacity, taken) = region(regions[0]);
        return Err(PlacementError {
            tile: tile as u32,
            label: lowered.labels[b.label as usize].clone(),
            bytes: b.bytes,
            region: name,
            capacity,
            live: taken,
            also: regions.get(1).map(|&inter| region(inter)),
            first: b.first_step,
            last: b.last_step,
        });
    }
    // Each region's highest address in use (the placements that moved hold none).
    let (mut peak_s, mut peak_i) = (code_end, m.interleaved_start);
    for &(i, start) in &state.out {
        let end = start + lowered.buffers[i as usize].bytes;
        if start >= m.interleaved_start {
            peak_i = peak_i.max(end);
        } else {
            peak_s = peak_s.max(end);
        }
    }
    // The code range is the code itself; what lies between it and the data start is free.
    Ok((state.out, code_range(m.base, code), peak_s, peak_i))
}

/// Data starts at the code's end rounded up to this many bytes, as long as that stays within
/// the code reserve the planner assumed for every tile (`CODE_RESERVE_BYTES`): an edit that
/// changes a tile's code by a few bytes then moves none of its buffers, so the exchange phases
/// it does not touch keep their addresses, and with them their validation and table entries
/// and the tile images. Past the reserve, data starts at the code's end rounded to 16 bytes.
/// A compiler policy (memory the planner already set aside), not a machine constant.
pub const DATA_START_GRANULE: u32 = 8192;

/// A tile's code allocation: `code` bytes from `base`, rounded to 16.
fn code_range(base: u32, code: u32) -> (u32, u32) {
    (base, align(base.saturating_add(code), 16))
}

/// Where a tile's data may start after `code` bytes of code (see `DATA_START_GRANULE`).
pub(crate) fn data_start(base: u32, code: u32) -> u32 {
    let coarse = align(base.saturating_add(code), DATA_START_GRANULE);
    let reserve = base.saturating_add(crate::lower::build::CODE_RESERVE_BYTES as u32);
    if coarse <= reserve {
        coarse
    } else {
        align(base.saturating_add(code), 16)
    }
}

fn align(x: u32, a: u32) -> u32 {
    x.div_ceil(a) * a
}

/// Lowest aligned start in `range` not overlapping any placed buffer alive at the same time
/// nor any `avoid` range. `placed` and `avoid` are sorted by (start, end): the busy ranges are
/// met in that order, merged, as one sorted list of both would give them.
fn first_fit(range: (u32, u32), placed: &[Placed], avoid: &[(u32, u32)], bytes: u32, alignment: u32, first: u32, last: u32) -> Option<u32> {
    let mut alive = placed.iter().filter(|p| p.first <= last && first <= p.last).map(|p| (p.start, p.end)).peekable();
    let mut avoid = avoid.iter().copied().peekable();
    let mut start = align(range.0, alignment);
    loop {
        let next = match (alive.peek(), avoid.peek()) {
            (Some(&a), Some(&v)) if v < a => avoid.next(),
            (Some(_), _) => alive.next(),
            (None, _) => avoid.next(),
        };
        let Some((s, e)) = next else { break };
        if start as u64 + bytes as u64 <= s as u64 {
            break;
        }
        if e > start {
            start = align(e, alignment);
        }
    }
    (start as u64 + bytes as u64 <= range.1 as u64).then_some(start)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::{align, amp_counterparts, first_fit, place_storage, place_storage_with, place_tile, ExchangeRules, Placed};
    use crate::elements::element_range;
    use crate::lower::{BufferDecl, Lowered};
    use crate::package::AllocationKind;
    use crate::target::Target;

    /// One tile's buffers (bytes, first step, last step), all partials (interleaved memory).
    pub(crate) fn partials(buffers: &[(u32, u32, u32)]) -> Lowered {
        Lowered {
            tiles: 1,
            labels: buffers.iter().enumerate().map(|(i, _)| format!("b{i}")).collect(),
            buffers: buffers.iter().enumerate().map(|(i, &(bytes, first_step, last_step))| BufferDecl { tile: 0, bytes, kind: AllocationKind::Partials, prefer_interleaved: true, label: i as u32, first_step, last_step }).collect(),
            steps: Vec::new(),
            compute_sets: Vec::new(),
            phases: Vec::new(),
            phase_plans: Vec::new(),
            initialize: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            checkpoints: Vec::new(),
            plans: Vec::new(),
            gemm_flops: 0,
            logical_shards: 1,
            half_duplex: Vec::new(),
        }
    }

    /// A data buffer that finds room in neither region is reported with both, the one it
    /// prefers first; partials, which only interleaved memory takes, name that region alone.
    #[test]
    fn a_buffer_with_no_room_in_either_region_names_both() {
        let target = Target::from_toml(crate::target::fixtures::SMALL16, "small16.toml").unwrap();
        let m = &target.memory;
        let (standard, interleaved) = (m.interleaved_start - m.base, m.loader_limit - m.interleaved_start);
        let too_big = standard.max(interleaved) + 8;
        let mut l = partials(&[(too_big, 0, 1)]);
        l.buffers[0].kind = AllocationKind::Data;
        l.buffers[0].prefer_interleaved = false;
        let error = place_storage(&target, &l, &[0]).expect_err("larger than either region");
        assert_eq!((error.region, error.also), ("standard", Some(("interleaved", interleaved, 0))));
        assert_eq!(
            error.to_string(),
            format!("tile 0: 'b0' needs {too_big} bytes of standard or interleaved memory alive at steps 0..=1, but neither has room: there are only {standard} bytes of standard memory, 0 of them taken then, and {interleaved} bytes of interleaved memory, 0 of them taken then")
        );
        l.buffers[0].prefer_interleaved = true;
        let error = place_storage(&target, &l, &[0]).expect_err("larger than either region");
        assert_eq!((error.region, error.also.map(|a| a.0)), ("interleaved", Some("standard")));
        let partial = place_storage(&target, &partials(&[(too_big, 0, 1)]), &[0]).expect_err("larger than interleaved memory");
        assert_eq!(partial.also, None);
        assert_eq!(partial.to_string(), format!("tile 0: 'b0' needs {too_big} bytes of interleaved memory alive at steps 0..=1, but there are only {interleaved} bytes of interleaved memory, 0 of them taken then"));
        // Partials beside a buffer live at step 1 only: at steps 0..=1 the most taken is that
        // buffer's; where the taken bytes leave room, the free bytes are in pieces too small.
        let half = interleaved / 2 / 8 * 8;
        let error = place_storage(&target, &partials(&[(half + 8, 1, 1), (half + 8, 0, 1)]), &[0]).expect_err("two halves and more");
        assert_eq!((error.label.as_str(), error.live), ("b0", half as u64 + 8), "{error}");
        assert!(!error.to_string().contains("pieces"), "{error}");
    }

    /// Strict rules never put a buffer in an element its opposite holds: where first fit finds
    /// room only in that element, the placement fails, though the usual rules place it there.
    #[test]
    fn strict_rules_refuse_what_the_usual_rules_place_against_an_opposite() {
        let target = Target::from_toml(crate::target::fixtures::SMALL16, "small16.toml").unwrap();
        let m = &target.memory;
        // The elements before the last (the region need not end on an element boundary).
        let whole = (m.loader_limit - m.interleaved_start - 1) / m.interleaved_element_bytes * m.interleaved_element_bytes;
        // A buffer filling all elements but the last, and a sender and its receiver beside it:
        // the last element holds both only if they share it.
        let l = partials(&[(1024, 0, 2), (1024, 0, 2), (whole, 0, 2)]);
        let rules = ExchangeRules { opposites: std::sync::Arc::new(vec![vec![1], vec![0], vec![]]), receives: std::sync::Arc::new(vec![false, true, false]), receive_offset: 0, strict: false };
        let placed = place_storage_with(&target, &l, &[0], &rules).expect("placed, sharing an element");
        let element = |b: usize| (placed.addresses[b] - m.interleaved_start) / m.interleaved_element_bytes;
        assert_eq!(element(0), element(1), "{:?}", placed.addresses);
        let strict = ExchangeRules { strict: true, ..rules };
        // Moving the large buffer up by the sender's bytes would put the two apart at the
        // region's ends, but strict rules judge the layout first fit gives: no buffer moves.
        assert!(place_storage_with(&target, &l, &[0], &strict).is_err());
        // With room in another element, strict rules place them apart.
        let roomy = partials(&[(1024, 0, 2), (1024, 0, 2), (whole - m.interleaved_element_bytes, 0, 2)]);
        let apart = place_storage_with(&target, &roomy, &[0], &strict).expect("placed apart");
        let element = |b: usize| (apart.addresses[b] - m.interleaved_start) / m.interleaved_element_bytes;
        assert_ne!(element(0), element(1), "{:?}", apart.addresses);
    }

    #[test]
    fn a_tile_that_separating_opposites_fragments_is_placed_largest_first() {
        let target = Target::from_toml(crate::target::fixtures::SMALL16, "small16.toml").unwrap();
        let m = &target.memory;
        let region = m.loader_limit - m.interleaved_start;
        // A sender and its receiver from step 0, and from step 1 one buffer that needs all of
        // the interleaved memory but the sender's 1 KiB and the receiver's.
        let big = region - 2048;
        let l = partials(&[(1024, 0, 2), (1024, 0, 2), (big, 1, 3)]);
        let rules = ExchangeRules { opposites: std::sync::Arc::new(vec![vec![1], vec![0], vec![]]), receives: std::sync::Arc::new(vec![false, true, false]), receive_offset: 0, strict: false };
        // Without the rule the three fit by first step; with it, by first step the receiver
        // moves to the next element and the large buffer no longer fits.
        assert!(place_storage(&target, &l, &[0]).is_ok());
        let placed = place_storage_with(&target, &l, &[0], &rules).expect("placed largest first");
        let a = &placed.addresses;
        let ends: Vec<u32> = l.buffers.iter().zip(a).map(|(b, &s)| s + b.bytes).collect();
        assert!(a.iter().all(|&s| s >= m.interleaved_start) && ends.iter().all(|&e| e <= m.loader_limit));
        for i in 0..3 {
            for j in i + 1..3 {
                assert!(ends[i] <= a[j] || ends[j] <= a[i], "buffers {i} and {j} overlap: {a:?}");
            }
        }
        // A tile the rule does not fragment keeps its placement by first step.
        let small = partials(&[(1024, 0, 2), (1024, 0, 2), (4096, 1, 3)]);
        let by_start = place_storage_with(&target, &small, &[0], &rules).unwrap();
        assert_eq!(by_start.addresses[2], m.interleaved_start + 1024, "the third buffer follows the sender");
        assert!(by_start.addresses[1] >= m.interleaved_start + m.interleaved_element_bytes, "the receiver is in another element");
    }

    /// A matrix product's input and output never share a memory element: the output moves to
    /// the next element when the first fit would put it beside the input, also with no
    /// exchange rules, and when only the input's element has room the placement fails rather
    /// than share it.
    #[test]
    fn a_products_input_and_output_are_placed_in_different_elements() {
        let target = Target::from_toml(crate::target::fixtures::SMALL16, "small16.toml").unwrap();
        let m = &target.memory;
        let region = m.loader_limit - m.interleaved_start;
        let loc = |buffer| crate::lower::Loc { buffer, offset: 0, row_stride: 4, dtype_bytes: 2 };
        let program = |input: u32, output: u32| {
            // Buffer 0: an input block in interleaved memory (as a weight prefers); buffer 1:
            // the product's partials; buffer 2: the weights (B), which the rule does not concern.
            let mut l = partials(&[(output, 0, 1)]);
            l.labels = vec!["a".into(), "c".into(), "b".into()];
            let data = |bytes, label| BufferDecl { tile: 0, bytes, kind: AllocationKind::Data, prefer_interleaved: true, label, first_step: 0, last_step: 1 };
            l.buffers = vec![data(input, 0), BufferDecl { label: 1, ..l.buffers[0].clone() }, data(64, 2)];
            let call = crate::package::VertexCall::MatMul { m: 4, k: 4, n: 4, a: loc(0), a_panel: 0, b: loc(2), b_transposed: false, c: loc(1), c_panel: 0, partials: true, add: None };
            l.compute_sets = vec![std::sync::Arc::new(vec![(0, call)])];
            l
        };
        let placed = place_storage(&target, &program(1024, 1024), &[0]).expect("fits");
        let a = &placed.addresses;
        assert_eq!(a[0], m.interleaved_start, "the input takes the first fit");
        let (input, output) = (element_range(m, a[0]), element_range(m, a[1]));
        assert!(output.0 >= input.1, "the output left the input's element: input {input:x?}, output {output:x?}");
        assert_eq!(a[2], m.interleaved_start + 1024, "the weights may share the input's element");
        // Without the product the output follows the input in its element.
        let mut plain = program(1024, 1024);
        plain.compute_sets.clear();
        assert_eq!(place_storage(&target, &plain, &[0]).unwrap().addresses[1], m.interleaved_start + 1024);
        // The input fills all of the interleaved memory but part of its last element: the
        // output would fit only there, and does not fit.
        let input = (region - 4096) / m.interleaved_element_bytes * m.interleaved_element_bytes + 1024;
        let error = place_storage(&target, &program(input, 1024), &[0]).expect_err("only the input's element has room");
        assert_eq!((error.label.as_str(), error.region), ("c", "interleaved"));
        // Enough bytes are free, but only in the input's element: the error says so.
        assert!(error.to_string().contains(&format!("{input} of them taken then and the rest in pieces too small")), "{error}");
    }

    /// When tiles do not fit, the error is the lowest failing tile's at any thread count
    /// (tiles above a failed one are not placed), and a program that fits is placed whole.
    #[test]
    fn the_lowest_tile_that_does_not_fit_is_reported_at_any_thread_count() {
        let target = Target::from_toml(crate::target::fixtures::SMALL16, "small16.toml").unwrap();
        let region = target.memory.loader_limit - target.memory.interleaved_start;
        let tiles = 64u32;
        let program = |over: &[u32]| {
            let mut l = partials(&[]);
            l.tiles = tiles;
            for tile in 0..tiles {
                let bytes = if over.contains(&tile) { region + 16 } else { 1024 };
                l.labels.push(format!("t{tile}"));
                l.buffers.push(crate::lower::BufferDecl { tile, bytes, kind: AllocationKind::Partials, prefer_interleaved: true, label: tile, first_step: 0, last_step: 1 });
            }
            l
        };
        let code = vec![0u32; tiles as usize];
        for threads in [1, 4] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for over in [vec![63u32], vec![40, 9, 50], vec![0, 1, 2, 63]] {
                let error = pool.install(|| place_storage(&target, &program(&over), &code)).expect_err("a tile is over its memory");
                assert_eq!(error.tile, *over.iter().min().unwrap(), "{threads} threads, tiles over: {over:?}");
            }
            let placed = pool.install(|| place_storage(&target, &program(&[]), &code)).expect("every tile fits");
            assert_eq!(placed.peak_interleaved.len(), tiles as usize);
            assert!(placed.addresses.iter().all(|&a| a == target.memory.interleaved_start));
        }
    }

    /// The first fit as it was: every placed buffer alive at the time and every avoided range,
    /// gathered and sorted whole.
    fn reference(range: (u32, u32), placed: &[Placed], avoid: &[(u32, u32)], bytes: u32, alignment: u32, first: u32, last: u32) -> Option<u32> {
        let mut busy: Vec<(u32, u32)> = placed.iter().filter(|p| p.first <= last && first <= p.last).map(|p| (p.start, p.end)).collect();
        busy.extend_from_slice(avoid);
        busy.sort_unstable();
        let mut start = align(range.0, alignment);
        for (s, e) in busy {
            if start as u64 + bytes as u64 <= s as u64 {
                break;
            }
            if e > start {
                start = align(e, alignment);
            }
        }
        (start as u64 + bytes as u64 <= range.1 as u64).then_some(start)
    }

    #[test]
    fn merged_first_fit_finds_what_sorting_everything_found() {
        let mut rng = crate::exchange::synthetic::SplitMix64(0x2545_F491_4F6C_DD1D);
        let mut next = |bound: u32| rng.below(bound);
        for case in 0..2000 {
            let mut placed: Vec<Placed> = (0..next(40))
                .map(|_| {
                    let (start, bytes, first) = (next(64) * 16, 16 + next(48) * 16, next(20));
                    Placed { start, end: start + bytes, first, last: first + next(10) }
                })
                .collect();
            placed.sort_by_key(|p| (p.start, p.end));
            let mut avoid: Vec<(u32, u32)> = (0..next(6)).map(|_| (next(32) * 64, 64 + next(32) * 64)).collect();
            avoid.sort_unstable();
            let (bytes, alignment, first) = (8 + next(40) * 8, [8, 16][next(2) as usize], next(25));
            let last = first + next(8);
            let range = (next(4) * 8, 1024 + next(2048));
            assert_eq!(first_fit(range, &placed, &avoid, bytes, alignment, first, last), reference(range, &placed, &avoid, bytes, alignment, first, last), "case {case}");
        }
    }

    /// First fit by start step leaves the bytes a buffer needs only in pieces: a small
    /// long-lived buffer sits between a short-lived one's bytes and the rest. Moving it to the
    /// top of the region makes room, and what no moving can fit is still an error.
    #[test]
    fn moving_a_buffer_makes_room_that_first_fit_left_in_pieces() {
        let target = Target::from_toml(crate::target::fixtures::SMALL16, "small16.toml").unwrap();
        let m = &target.memory;
        let region = m.loader_limit - m.interleaved_start;
        let program = |big: u32| partials(&[(1024, 0, 0), (1024, 0, 2), (big, 1, 2)]);
        let amp = vec![Vec::new(); 3];
        let rules = ExchangeRules::default();
        let order = [0u32, 1, 2];
        let error = place_tile(m, &program(region - 1024), &rules, &amp, 0, 0, &order, true, false).expect_err("first fit leaves the room in two pieces");
        assert_eq!(error.label, "b2");
        assert!(error.to_string().contains("1024 of them taken then and the rest in pieces too small"), "{error}");
        let placed = place_storage(&target, &program(region - 1024), &[0]).expect("moving the long-lived buffer makes room");
        assert_eq!(placed.addresses, vec![m.interleaved_start, m.loader_limit - 1024, m.interleaved_start]);
        assert_eq!(placed.peak_interleaved, vec![m.loader_limit]);
        let error = place_storage(&target, &program(region - 1008), &[0]).expect_err("no room however the buffers lie");
        assert_eq!((error.label.as_str(), error.region, error.live), ("b2", "interleaved", 1024));
    }

    /// Random tiles filled near their memory, some buffers a matrix product's input and
    /// output: every placement found, also those that moved buffers to make room, keeps each
    /// buffer in a region its kind may use, aligned, apart from every buffer alive with it,
    /// and off its product counterparts' memory elements; and moving buffers fits tiles that
    /// first fit alone does not.
    #[test]
    fn placements_that_move_buffers_keep_every_rule() {
        let target = Target::from_toml(crate::target::fixtures::SMALL16, "small16.toml").unwrap();
        let m = &target.memory;
        let mut rng = crate::exchange::synthetic::SplitMix64(0x9E37_79B9_7F4A_7C15);
        let (mut fitted, mut moved) = (0, 0);
        for case in 0..300 {
            let count = 6 + rng.below(14);
            let mut l = partials(&[]);
            for i in 0..count {
                let first = rng.below(8);
                let kind = if rng.below(3) == 0 { AllocationKind::Partials } else { AllocationKind::Data };
                let bytes = 16 * (1 + rng.below(6000)) + if kind == AllocationKind::Data { 8 * rng.below(2) } else { 0 };
                l.labels.push(format!("b{i}"));
                l.buffers.push(crate::lower::BufferDecl { tile: 0, bytes, kind, prefer_interleaved: rng.below(2) == 0, label: i, first_step: first, last_step: first + rng.below(6) });
            }
            let loc = |buffer| crate::lower::Loc { buffer, offset: 0, row_stride: 4, dtype_bytes: 2 };
            let calls: Vec<(u32, crate::package::VertexCall<crate::lower::Loc>)> = (0..rng.below(4))
                .map(|_| {
                    let (a, c) = (rng.below(count), rng.below(count));
                    (0, crate::package::VertexCall::MatMul { m: 4, k: 4, n: 4, a: loc(a), a_panel: 0, b: loc(a), b_transposed: false, c: loc(c), c_panel: 0, partials: true, add: None })
                })
                .collect();
            l.compute_sets = vec![std::sync::Arc::new(calls)];
            let code = 1000 + rng.below(60000);
            let Ok(placed) = place_storage(&target, &l, &[code]) else { continue };
            fitted += 1;
            let amp = amp_counterparts(&l);
            let mut order: Vec<u32> = (0..count).collect();
            order.sort_by_key(|&i| (l.buffers[i as usize].first_step, std::cmp::Reverse(l.buffers[i as usize].bytes), i));
            if place_tile(m, &l, &ExchangeRules::default(), &amp, 0, code, &order, true, false).is_err() {
                moved += 1;
            }
            let code_end = placed.code[0].1;
            for (i, b) in l.buffers.iter().enumerate() {
                let start = placed.addresses[i];
                let end = start + b.bytes;
                let interleaved = start >= m.interleaved_start;
                assert!(if interleaved { end <= m.loader_limit } else { start >= code_end && end <= m.interleaved_start }, "case {case}: b{i} at {start:#x}..{end:#x} outside its region");
                assert!(interleaved || b.kind != AllocationKind::Partials, "case {case}: partials b{i} in standard memory");
                let alignment = if b.kind == AllocationKind::Partials { m.partial_alignment } else { m.data_alignment };
                assert_eq!(start % alignment, 0, "case {case}: b{i} misaligned");
                for (j, o) in l.buffers.iter().enumerate().skip(i + 1) {
                    let (s, e) = (placed.addresses[j], placed.addresses[j] + o.bytes);
                    let alive_together = b.first_step <= o.last_step && o.first_step <= b.last_step;
                    assert!(!(alive_together && start < e && s < end), "case {case}: b{i} and b{j} overlap while both alive");
                }
                for &j in &amp[i] {
                    let elements = |start: u32, bytes: u32| (element_range(m, start).0, element_range(m, start + bytes - 1).1);
                    let (a, c) = (elements(start, b.bytes), elements(placed.addresses[j as usize], l.buffers[j as usize].bytes));
                    assert!(a.1 <= c.0 || c.1 <= a.0, "case {case}: product counterparts b{i} and b{j} share a memory element");
                }
            }
        }
        assert!(fitted >= 100 && moved >= 10, "the cases should exercise moving buffers: {fitted} fitted, {moved} by moving buffers");
    }
}

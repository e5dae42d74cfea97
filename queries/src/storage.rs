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
    let mut h = KeyHasher::new("ipuq tile placement v1");
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

/// One tile's placement: its buffers by first step (largest first among equals), and when
/// the exchange rules left no room, again largest first.
fn place_one_tile(m: &crate::target::Memory, lowered: &Lowered, rules: &ExchangeRules, amp: &[Vec<u32>], tile: usize, code_bytes: &[u32], ids: &[u32]) -> Result<TilePlacement, PlacementError> {
    let code = code_bytes.get(tile).copied().unwrap_or(0);
    let mut order = ids.to_vec();
    order.sort_by_key(|&i| {
        let b = &lowered.buffers[i as usize];
        (b.first_step, std::cmp::Reverse(b.bytes), i)
    });
    let first = place_tile(m, lowered, rules, amp, tile, code, &order, true);
    if first.is_ok() || (rules.opposites.is_empty() && ids.iter().all(|&i| amp[i as usize].is_empty())) {
        return first;
    }
    // Separating opposites (or a product's input from its output) fragmented the tile's
    // memory (the rules move buffers off the lowest free addresses, and a later large buffer
    // finds no room): the tile is placed again, the largest buffers first, under the same rules. Only tiles that failed
    // change, so placements that fitted before are the same; the search scores the
    // conflicts either order leaves.
    order.sort_by_key(|&i| {
        let b = &lowered.buffers[i as usize];
        (std::cmp::Reverse(b.bytes), b.first_step, i)
    });
    place_tile(m, lowered, rules, amp, tile, code, &order, false).or(first)
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

/// One tile's placement, buffers taken in `order`; `by_start`: the order is by first step,
/// so buffers that ended before the current one's first step are dropped from the scans.
#[allow(clippy::too_many_arguments)]
fn place_tile(m: &crate::target::Memory, lowered: &Lowered, rules: &ExchangeRules, amp: &[Vec<u32>], tile: usize, code: u32, order: &[u32], by_start: bool) -> Result<TilePlacement, PlacementError> {
    let code_end = data_start(m.base, code);
    let standard = (code_end, m.interleaved_start);
    let interleaved = (m.interleaved_start, m.loader_limit);
    // Per region: the placed buffers, sorted by (start, end). When buffers come by start
    // step, one that ended before the current start step can never overlap a later buffer
    // and is dropped: each first fit scans only what is alive.
    let mut placed_std: Vec<Placed> = Vec::new();
    let mut placed_int: Vec<Placed> = Vec::new();
    let mut pruned_at: Option<u32> = None;
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(order.len());
    let mut at: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    let (mut peak_s, mut peak_i) = (code_end, m.interleaved_start);
    for &i in order {
        let b = &lowered.buffers[i as usize];
        if by_start && pruned_at != Some(b.first_step) {
            pruned_at = Some(b.first_step);
            placed_std.retain(|p| p.last >= b.first_step);
            placed_int.retain(|p| p.last >= b.first_step);
        }
        let alignment = if b.kind == AllocationKind::Partials { m.partial_alignment } else { m.data_alignment };
        let regions: &[bool] = match (b.kind, b.prefer_interleaved) {
            (AllocationKind::Partials, _) => &[true],
            (_, true) => &[true, false],
            _ => &[false, true],
        };
        // The element range of each placed buffer in `others`, sorted: those it exchanges
        // against (avoided where room allows) and those it meets across a matrix product
        // (never shared).
        let elements_of = |others: &[u32]| -> Vec<(u32, u32)> {
            let mut list: Vec<(u32, u32)> = others
                .iter()
                .filter_map(|o| at.get(o).map(|&s| (s, s + lowered.buffers[*o as usize].bytes)))
                .map(|(s, e)| (element_range(m, s).0, element_range(m, e.saturating_sub(1).max(s)).1))
                .collect();
            list.sort_unstable();
            list
        };
        let hard = elements_of(&amp[i as usize]);
        let mut avoid = elements_of(rules.opposites.get(i as usize).map_or(&[], |v| v.as_slice()));
        if !hard.is_empty() {
            avoid.extend_from_slice(&hard);
            avoid.sort_unstable();
        }
        let offset = if rules.receives.get(i as usize).copied().unwrap_or(false) { rules.receive_offset } else { 0 };
        // Try: away from opposite elements from the offset, then from the region start,
        // then (room is short, and the rules are not strict) anywhere but a product
        // counterpart's elements.
        let attempts: [(&[(u32, u32)], u32); 3] = [(&avoid, offset), (&avoid, 0), (&hard, 0)];
        let tries = if rules.strict { 2 } else { 3 };
        let mut done = false;
        'attempts: for (avoid, offset) in attempts.into_iter().take(tries) {
            for &inter in regions {
                let (range, placed) = if inter { (interleaved, &mut placed_int) } else { (standard, &mut placed_std) };
                let from = (range.0.saturating_add(offset).min(range.1), range.1);
                if let Some(start) = first_fit(from, placed, avoid, b.bytes, alignment, b.first_step, b.last_step) {
                    let end = start + b.bytes;
                    let slot = placed.partition_point(|p| (p.start, p.end) <= (start, end));
                    placed.insert(slot, Placed { start, end, first: b.first_step, last: b.last_step });
                    if inter { peak_i = peak_i.max(start + b.bytes) } else { peak_s = peak_s.max(start + b.bytes) }
                    out.push((i, start));
                    at.insert(i, start);
                    done = true;
                    break 'attempts;
                }
            }
        }
        if !done {
            // The most bytes the region's placed buffers hold at one of this buffer's steps
            // (those placed are the ones that can overlap it: see the pruning above).
            let live = |placed: &[Placed]| (b.first_step..=b.last_step).map(|step| placed.iter().filter(|p| p.first <= step && step <= p.last).map(|p| (p.end - p.start) as u64).sum::<u64>()).max().unwrap_or(0);
            let region = |inter: bool| {
                let (range, placed) = if inter { (interleaved, &placed_int) } else { (standard, &placed_std) };
                (if inter { "interleaved" } else { "standard" }, range.1 - range.0, live(placed))
            };
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
    }
    // The code range is the code itself; what lies between it and the data start is free.
    Ok((out, code_range(m.base, code), peak_s, peak_i))
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
fn data_start(base: u32, code: u32) -> u32 {
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
    use super::{align, first_fit, place_storage, place_storage_with, ExchangeRules, Placed};
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

    /// Strict rules never put a buffer in an element its opposite holds: where only that
    /// element has room, the placement fails, though the usual rules place it there.
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
}

//! The plan beam's peak live bytes per tile (`search::score`), kept up to date from one lowered
//! prefix to its extensions instead of swept over every buffer of the program each time.
//!
//! Each buffer is live from its first step to its last, inclusive (host-written ones from step
//! 0; one never used, at step 0 only), as `search::tile_peaks` counts. A [`PeakCache`], made
//! when a prefix is scored, holds per tile the live bytes at step 0 and the peaks over steps
//! 1..T of the prefix's buffers, and the buffers still live at step T or later (`open`). An
//! extension of the prefix adds buffers that start at step T or later (steps only grow, and
//! the first step of an extension is at most the prefix's last), or host-written ones, live
//! from step 0 through at least T - 1 (adding the same bytes to every step before T), or never
//! used ones (step 0); and it widens some buffers' lifetimes. The builder counts each widening
//! of a buffer of the cache that changes what it adds before step T (`Watch`), and each host
//! tensor whose segments are replaced: then, or for any buffer added otherwise, the peaks are
//! swept from scratch. Else only the open and added buffers are swept, from step T on.
//! T trails the prefix's last step by `LAG` steps, so that values read again within that many
//! steps (a residual) do not force a sweep from scratch.

use std::cell::Cell;

use tracing::debug;

use super::chunked::Chunked;
use super::BufferDecl;
use crate::package::AllocationKind;

/// Steps the cache's boundary T trails the last step of the prefix it was made for. On the
/// four-layer encoder (145 steps, 658k buffers at the end) a boundary at the last step sweeps
/// from scratch at 28 of the build's 55 scores (values read again a few steps later), 16 steps
/// back at one, each score then sweeping about 100k open buffers.
pub const LAG: u32 = 16;

thread_local! {
    /// The event table of the thread's last peak sweep (`update`, `search::tile_peaks`), for
    /// the next one (a fresh table of hundreds of thousands of events costs more in page
    /// faults than its use).
    pub(super) static SPARE_EVENTS: Cell<Vec<(u32, i64, i64)>> = const { Cell::new(Vec::new()) };
}

/// What the builder watches for the cache of the prefix it extends (see the module docs).
#[derive(Clone, Copy, Debug, Default)]
pub struct Watch {
    /// The cache's buffers (those before this index) and its boundary T.
    pub buffers: u32,
    pub step: u32,
    /// Changes that invalidate the cache, counted.
    pub changed: u32,
}

impl Watch {
    /// Note that a buffer with lifetime (`first`, `last`) is used at `step` (before the update):
    /// a change when it changes what the buffer adds before T, or when a buffer that ended
    /// before T (not open) lives on.
    pub fn touch(&mut self, buffer: u32, first: u32, last: u32, step: u32) {
        if buffer < self.buffers && (first == u32::MAX || (step < first && step < self.step) || (step > last && last < self.step)) {
            self.changed += 1;
        }
    }
}

/// The counting sort of lifetimes into steps that the peak sweeps share: each `[first, end)`
/// range (steps) has a start event at `first` and an end event at `end`; returns the offsets
/// at which each step's events are placed (`starts[k + 1]` is where step k's go, advanced as
/// they are placed, so that once placed it ends them) and, last, the number of events.
pub(super) fn event_offsets(ranges: impl Iterator<Item = (usize, usize)>) -> Vec<usize> {
    let mut starts = vec![0usize];
    for (first, end) in ranges {
        if starts.len() < end + 2 {
            starts.resize(end + 2, 0);
        }
        starts[first + 1] += 1;
        starts[end + 1] += 1;
    }
    let steps = starts.len() - 1;
    for k in 0..steps {
        starts[k + 1] += starts[k];
    }
    starts
}

/// Peaks of a scored prefix (see the module docs).
#[derive(Debug)]
pub struct PeakCache {
    buffers: usize,
    marks: usize,
    changed: u32,
    step: u32,
    /// Per tile: live (standard, interleaved) bytes at step 0, when T >= 1.
    zero: Vec<(i64, i64)>,
    /// Per tile: peak (standard, interleaved, total) over steps 1..T.
    early: Vec<(i64, i64, i64)>,
    /// Buffers of the cache live at step T or later, and whether the host writes them.
    open: Vec<(u32, bool)>,
}

impl PeakCache {
    /// What the builder watches for this cache.
    pub fn watch(&self) -> Watch {
        Watch { buffers: self.buffers as u32, step: self.step, changed: self.changed }
    }
}

/// (standard, interleaved) bytes of a buffer.
pub(super) fn bytes(b: &BufferDecl) -> (i64, i64) {
    let n = b.bytes as i64;
    if b.kind == AllocationKind::Partials || b.prefer_interleaved {
        (0, n)
    } else {
        (n, 0)
    }
}

/// (first step, last step) of a buffer's lifetime.
pub(super) fn range(b: &BufferDecl, host: bool) -> (u32, u32) {
    let last = b.last_step.max(if b.first_step == u32::MAX { 0 } else { b.first_step });
    let first = if host || b.first_step == u32::MAX { 0 } else { b.first_step };
    (first, last)
}

/// Raise peaks (standard, interleaved, total) to live (standard, interleaved) bytes.
pub(super) fn raise(p: &mut (i64, i64, i64), (s, i): (i64, i64)) {
    *p = (p.0.max(s), p.1.max(i), p.2.max(s + i));
}

/// Apply one step's events (tile, standard bytes, interleaved bytes; negative when a buffer
/// dies) to the running live bytes per tile.
pub(super) fn apply(live: &mut [(i64, i64)], events: &[(u32, i64, i64)]) {
    for &(tile, ds, di) in events {
        let l = &mut live[tile as usize];
        l.0 += ds;
        l.1 += di;
    }
}

/// The peak (standard, interleaved, total) live bytes on any tile of a lowering with
/// `buffers` (the host writes those in `marks`) and `steps` steps, from `previous`, the cache
/// of a prefix it extends (when still valid); and the cache for this lowering, its boundary
/// `lag` steps before the last.
#[allow(clippy::too_many_arguments)]
pub fn update(buffers: &Chunked<BufferDecl, 9>, marks: &Chunked<u32, 10>, watch: Watch, steps: usize, previous: Option<&PeakCache>, tiles: u32, lag: u32) -> ((u64, u64, u64), PeakCache) {
    let tiles_n = tiles as usize;
    let empty = PeakCache { buffers: 0, marks: 0, changed: watch.changed, step: 0, zero: Vec::new(), early: Vec::new(), open: Vec::new() };
    let valid = |c: &PeakCache| c.changed == watch.changed && c.buffers <= buffers.len() && c.marks <= marks.len();
    let mut cache = previous.filter(|c| valid(c)).unwrap_or(&empty);
    if previous.is_some_and(|c| c.step > 0 && !valid(c)) {
        debug!("peak live bytes swept from scratch: a buffer of the last scored prefix changed");
    }
    // Host-written buffers among the added ones; per tile, the bytes added to every step
    // before T (host-written) and to step 0 (never used).
    let (host, uniform, zero_add) = loop {
        match added(buffers, marks, cache, tiles) {
            Some(found) => break found,
            None => {
                debug!("peak live bytes swept from scratch: an added buffer lives before the last scored prefix's boundary");
                cache = &empty
            }
        }
    };
    let n = cache.buffers;
    let t = cache.step;
    let t_next = (steps as u32).saturating_sub(1 + lag).max(t).min((steps as u32).saturating_sub(1).max(t));
    // The buffers swept from step T: the open ones and the added ones that reach it.
    let mut swept: Vec<(u32, bool)> = cache.open.clone();
    for (j, b) in buffers.iter().enumerate().skip(n) {
        let h = host[j - n];
        if b.tile < tiles && range(b, h).1 >= t {
            swept.push((j as u32, h));
        }
    }
    // Events per step from T (counting sort, as in `search::tile_peaks`).
    let mut starts = event_offsets(swept.iter().map(|&(j, h)| {
        let (first, last) = range(&buffers[j as usize], h);
        ((first.max(t) - t) as usize, (last - t) as usize + 1)
    }));
    let span = starts.len() - 1;
    // Every slot is written once below (two events per swept buffer).
    let mut events = SPARE_EVENTS.with(Cell::take);
    events.clear();
    events.resize(starts[span], (0, 0, 0));
    for &(j, h) in &swept {
        let b = &buffers[j as usize];
        let (first, last) = range(b, h);
        let (first, end) = ((first.max(t) - t) as usize, (last - t) as usize + 1);
        let (s, i) = bytes(b);
        events[starts[first]] = (b.tile, s, i);
        starts[first] += 1;
        events[starts[end]] = (b.tile, -s, -i);
        starts[end] += 1;
    }
    let mut live = vec![(0i64, 0i64); tiles_n];
    let mut zero_swept = vec![(0i64, 0i64); tiles_n];
    // Peaks over steps max(T, 1)..T' and from T'.
    let mut mid = vec![(0i64, 0i64, 0i64); tiles_n];
    let mut late = vec![(0i64, 0i64, 0i64); tiles_n];
    let mut from = 0;
    for (k, &to) in starts[..span].iter().enumerate() {
        let step = t + k as u32;
        let e = &events[from..to];
        from = to;
        apply(&mut live, e);
        let peaks = if step < t_next { &mut mid } else { &mut late };
        if step == 0 {
            zero_swept.copy_from_slice(&live);
        } else if step == t.max(1) || step == t_next {
            // A range starts: every tile's live bytes count, not only those that changed.
            for (p, &l) in peaks.iter_mut().zip(&live) {
                raise(p, l);
            }
            continue;
        }
        if step > 0 {
            for &(tile, _, _) in e {
                raise(&mut peaks[tile as usize], live[tile as usize]);
            }
        }
    }
    // Peaks per tile: before T from the cache (what the added buffers add to it), from T swept.
    let (mut ps, mut pi, mut pt) = (0i64, 0i64, 0i64);
    let mut zero_next = vec![(0i64, 0i64); tiles_n];
    let mut early_next = vec![(0i64, 0i64, 0i64); tiles_n];
    for tile in 0..tiles_n {
        let mut peak = (0i64, 0i64, 0i64);
        let (hs, hi) = uniform[tile];
        if t >= 1 {
            let (zs, zi) = cache.zero[tile];
            let z = (zs + zero_add[tile].0 + hs, zi + zero_add[tile].1 + hi);
            raise(&mut peak, z);
            zero_next[tile] = z;
        } else {
            raise(&mut peak, zero_swept[tile]);
            zero_next[tile] = zero_swept[tile];
        }
        let mut early = mid[tile];
        if t > 1 {
            let (es, ei, et) = cache.early[tile];
            let e = (es + hs, ei + hi, et + hs + hi);
            early = (early.0.max(e.0), early.1.max(e.1), early.2.max(e.2));
        }
        early_next[tile] = early;
        let l = late[tile];
        peak = (peak.0.max(early.0).max(l.0), peak.1.max(early.1).max(l.1), peak.2.max(early.2).max(l.2));
        (ps, pi, pt) = (ps.max(peak.0), pi.max(peak.1), pt.max(peak.2));
    }
    SPARE_EVENTS.with(|spare| spare.set(events));
    let open = swept.into_iter().filter(|&(j, h)| range(&buffers[j as usize], h).1 >= t_next).collect();
    let next = PeakCache { buffers: buffers.len(), marks: marks.len(), changed: watch.changed, step: t_next, zero: zero_next, early: early_next, open };
    ((ps as u64, pi as u64, pt as u64), next)
}

/// Per added buffer (from `cache.buffers` on), whether the host writes it; per tile, the bytes
/// added buffers add to every step before T and to step 0 alone. None when an added buffer
/// adds otherwise before T (or a mark names a buffer of the cache): then sweep from scratch.
#[allow(clippy::type_complexity)]
fn added(buffers: &Chunked<BufferDecl, 9>, marks: &Chunked<u32, 10>, cache: &PeakCache, tiles: u32) -> Option<(Vec<bool>, Vec<(i64, i64)>, Vec<(i64, i64)>)> {
    let n = cache.buffers;
    let t = cache.step;
    let mut host = vec![false; buffers.len() - n];
    for &m in marks.iter().skip(cache.marks) {
        let m = m as usize;
        if m < n {
            return None;
        }
        host[m - n] = true;
    }
    let mut uniform = vec![(0i64, 0i64); tiles as usize];
    let mut zero = uniform.clone();
    if t == 0 {
        // Every added buffer is swept.
        return Some((host, uniform, zero));
    }
    for (j, b) in buffers.iter().enumerate().skip(n) {
        if b.tile >= tiles {
            continue;
        }
        let h = host[j - n];
        let (first, last) = range(b, h);
        let (s, i) = bytes(b);
        if h {
            if last + 1 < t {
                return None;
            }
            let u = &mut uniform[b.tile as usize];
            *u = (u.0 + s, u.1 + i);
        } else if b.first_step == u32::MAX {
            if b.last_step > 0 {
                return None;
            }
            let z = &mut zero[b.tile as usize];
            *z = (z.0 + s, z.1 + i);
        } else if first < t {
            return None;
        }
    }
    Some((host, uniform, zero))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::super::build::{extend, Partial};
    use super::super::orient::orient;
    use super::super::search::tests_support::full_peaks;
    use crate::ir::Graph;
    use crate::target::{fixtures, Target};

    const ENCODER: &str = include_str!("../../../fixtures/workloads/siglip-encoder-f16-b1-t29-d64-h4-m96-l3.toml");
    const ATTENTION: &str = include_str!("../../../fixtures/workloads/attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8.toml");

    /// Peaks kept up to date along a lineage of prefixes (scored after every operation, or
    /// every few, forks included, with homed weights from some product on) are those swept
    /// over every buffer, at any lag of the boundary.
    #[test]
    fn kept_peaks_equal_swept_peaks() {
        let target = Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap();
        let tiles = target.chip.tiles;
        let mut checked = 0;
        for (name, text) in [("encoder", ENCODER), ("attention", ATTENTION)] {
            let graph = Graph::parse(text, "w.toml").unwrap();
            let oriented = orient(&graph, &BTreeSet::new()).unwrap();
            let n = oriented.graph.operations.len();
            for lag in [0, 1, 3, super::LAG] {
                for home in [usize::MAX, n / 3, 0] {
                    let mut lineage = if home == 0 { Partial::new(true) } else { Partial::new(false) };
                    for end in 1..=n {
                        let Ok(next) = extend(lineage.clone(), &oriented, &target, &[], end) else { break };
                        lineage = if end == n / 3 && home != 0 && home != usize::MAX { next.home_later(home) } else { next };
                        if end % 2 == 0 {
                            // A fork scored a few operations on.
                            if let Ok(mut fork) = extend(lineage.clone(), &oriented, &target, &[], (end + 3).min(n)) {
                                assert_eq!(fork.peaks_lagging(tiles, lag), full_peaks(&fork, tiles), "{name} lag {lag} home {home} fork at {end}");
                                checked += 1;
                            }
                        }
                        if end % 3 != 1 {
                            assert_eq!(lineage.peaks_lagging(tiles, lag), full_peaks(&lineage, tiles), "{name} lag {lag} home {home} at {end}");
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked > 500, "{checked}");
    }
}

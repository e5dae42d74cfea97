//! Left-shift compaction with splitting: move every piece into the earliest idle time that all
//! its ports share, cutting it across several such gaps when no single one is long enough.
//!
//! Pieces are taken in the order of their current send cycle. A piece usually finds its own
//! slot again, but an earlier piece with a longer delay may have moved into it on a receive
//! port, so the horizon can grow: callers keep the better of before and after. This is the
//! "split a critical piece and defer the rest" move of a critical-path search, applied to every
//! piece at once; list schedules leave many short waits that it fills.
//!
//! `justify` alternates right and left compaction ("forward-backward improvement", Li and
//! Willis, EJOR 1992; "double justification", Valls, Ballestín and Quintanilla, EJOR 2005):
//! right-justifying against the horizon (the same compaction on time reversed) opens room at
//! the start that the next left pass uses. It must not change which words go where: only cycles
//! and the cutting of pieces.

use super::problem::Problem;
use super::timing;
use super::types::Piece;

/// Gaps shorter than this (cycles) are not filled unless they finish the piece: every cut
/// costs a table entry per port.
const SHORTEST_FRAGMENT: u32 = 24;
/// Gaps a port's window search steps over before handing the search back (`Port::window_from`).
const WINDOW_SCAN: usize = 8;
/// Idle stretches shorter than this (cycles) are given up rather than remembered: they would
/// almost never be filled, and every remembered gap slows every later search on the port.
const SHORTEST_GAP: u32 = 8;

/// Idle time of one port: sorted disjoint free intervals below `tail`, free from `tail` on.
#[derive(Clone, Default)]
struct Port {
    gaps: Vec<(u32, u32)>,
    tail: u32,
}

impl Port {
    /// The free interval (native cycles) holding `at`, or the first one after it.
    #[cfg(test)]
    fn free_from(&self, at: u32) -> (u32, u32) {
        let i = self.gaps.partition_point(|g| g.1 <= at);
        match self.gaps.get(i) {
            Some(&(a, b)) => (a.max(at), b),
            None => (self.tail.max(at), u32::MAX),
        }
    }

    /// The first free interval (native cycles) from which at least `need` cycles are free
    /// starting at or after `at`: `Ok((its first such cycle, its end))`. Looks at no more than
    /// `WINDOW_SCAN` short gaps: past them, `Err(a cycle no later than that first one)` (the
    /// start of the next gap), so that another port's later free time can move the search on
    /// instead (as a binary search then finds it).
    fn window_from(&self, at: u32, need: u32) -> Result<(u32, u32), u32> {
        let i = self.gaps.partition_point(|g| g.1 <= at);
        for (scanned, &(a, b)) in self.gaps[i..].iter().enumerate() {
            let a = a.max(at);
            if scanned == WINDOW_SCAN {
                return Err(a);
            }
            if b - a >= need {
                return Ok((a, b));
            }
        }
        Ok((self.tail.max(at), u32::MAX))
    }

    /// Mark [start, end) busy; it lies inside one free interval.
    fn take(&mut self, start: u32, end: u32) {
        if start >= self.tail {
            if start >= self.tail + SHORTEST_GAP {
                self.gaps.push((self.tail, start));
            }
            self.tail = end;
            return;
        }
        let i = self.gaps.partition_point(|g| g.1 <= start);
        let (a, b) = self.gaps[i];
        match (a + SHORTEST_GAP <= start, end + SHORTEST_GAP <= b) {
            (true, true) => {
                self.gaps[i] = (a, start);
                self.gaps.insert(i + 1, (end, b));
            }
            (true, false) => self.gaps[i] = (a, start),
            (false, true) => self.gaps[i] = (end, b),
            (false, false) => {
                self.gaps.remove(i);
            }
        }
    }
}

/// How hard `justify` works: right/left passes, and how far before its current cycle a piece
/// looks for room (`None`: back to cycle 0). On large phases walking far back to rare gaps
/// dominates the cost.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Effort {
    pub passes: usize,
    pub lookback: Option<u32>,
}

/// Left compaction, then right/left passes while the horizon drops; never worse than the input.
pub(crate) fn justify(problem: &Problem, pieces: Vec<Piece>, effort: Effort) -> Vec<Piece> {
    let lookback = effort.lookback;
    let mut best_horizon = timing::horizon(problem, &pieces);
    let mut best = pieces;
    if let Some(left) = compact(problem, best.clone(), None, lookback) {
        let h = timing::horizon(problem, &left);
        if h <= best_horizon {
            best_horizon = h;
            best = left;
        }
    }
    for _ in 0..effort.passes {
        let Some(left) = compact(problem, best.clone(), Some(best_horizon), lookback).and_then(|right| compact(problem, right, None, lookback)) else {
            break;
        };
        let h = timing::horizon(problem, &left);
        if h >= best_horizon {
            break;
        }
        best_horizon = h;
        best = left;
    }
    best
}

/// Compact `pieces` to the left, or with `Some(horizon)` to the right against that horizon
/// (see the module header); returns the new pieces, merged and sorted, or `None` when a right
/// pass cannot keep every piece within the horizon.
pub(crate) fn compact(problem: &Problem, mut pieces: Vec<Piece>, reverse: Option<u32>, lookback: Option<u32>) -> Option<Vec<Piece>> {
    // Right compaction works in reversed time: a piece ending (last arrival) at E starts at
    // z = H − E in its own frame, its send port sits at z + maxδ and a receive port with
    // delay δ at z + maxδ − δ (both at least 0).
    match reverse {
        None => timing::sort_pieces(&mut pieces),
        // (latest end first, transfer, offset) packed as `sort_pieces` packs its key.
        Some(_) => pieces.sort_unstable_by_key(|p| (((u32::MAX - timing::piece_end(problem, p)) as u128) << 64) | ((p.transfer as u128) << 32) | p.offset_words as u128),
    }
    let tiles = problem.tiles as usize;
    let mut ports = vec![Port::default(); 2 * tiles];
    let mut out = Vec::with_capacity(pieces.len());
    // (port index, shift from the placement frame to the port's own cycles)
    let mut touched: Vec<(usize, u32)> = Vec::new();
    for piece in pieces {
        let job = &problem.jobs[piece.transfer as usize];
        let receivers = problem.receive_ports(piece.transfer as usize, piece.paired);
        let farthest = job.max_delay;
        let send_shift = if reverse.is_some() { farthest } else { 0 };
        touched.clear();
        touched.push((2 * job.source as usize, send_shift));
        if piece.paired {
            touched.push((2 * (job.source as usize ^ 1), send_shift));
        }
        for p in receivers {
            let shift = if reverse.is_some() { farthest - p.delay } else { p.delay };
            touched.push((2 * p.tile as usize + 1, shift));
        }
        let width = if piece.paired { 2 } else { 1 };
        let mut left = piece.cycles();
        let current = match reverse {
            None => piece.send_cycle,
            Some(horizon) => horizon.saturating_sub(piece.send_cycle + piece.cycles() + farthest),
        };
        let mut at = lookback.map_or(0, |l| current.saturating_sub(l));
        while left > 0 {
            // The whole rest, or a fragment of at least `SHORTEST_FRAGMENT` cycles.
            let (start, end) = common_window(&ports, &touched, at, left.min(SHORTEST_FRAGMENT));
            let length = left.min(end - start);
            for &(port, shift) in &touched {
                ports[port].take(start + shift, start + shift + length);
            }
            // Left: words in order from the front. Right: the first fragment in reversed time
            // is the last one in real time, so it carries the last words.
            let (offset, send_cycle) = match reverse {
                None => (piece.offset_words + (piece.cycles() - left) * width, start),
                // A piece pushed past the horizon (its slot was taken, see the header) makes
                // the pass useless: give it up.
                Some(horizon) => (piece.offset_words + (left - length) * width, horizon.checked_sub(start + farthest + length)?),
            };
            out.push(Piece { transfer: piece.transfer, offset_words: offset, words: length * width, send_cycle, paired: piece.paired });
            left -= length;
            at = start + length;
        }
    }
    timing::merge_adjacent(&mut out);
    Some(out)
}

/// Earliest send cycle at or after `at` from which every touched port is free for at least
/// `need` cycles, and the end of that common free interval: the first maximal common free
/// interval from `at` that is at least `need` long (an earlier start would lie in an earlier
/// common interval at least that long). Ports skip their own shorter gaps, so a piece does
/// not visit every port for each short common gap on its way (as the search this replaced,
/// which took the earliest common free interval and stepped past it when too short, did).
///
/// The earliest such cycle is a fixpoint: a port that cannot give the window at `at` moves it
/// to the start of its next window (or to a cycle no later than that), and no cycle skipped that
/// way works on that port. The ports are visited round-robin from the last one that moved `at`,
/// and the search ends once every port has been seen to give the window at the same `at` (one
/// full round without a move), so a piece sent to hundreds of tiles costs one round plus the
/// ports visited between moves, not a whole round per move.
fn common_window(ports: &[Port], touched: &[(usize, u32)], mut at: u32, need: u32) -> (u32, u32) {
    let n = touched.len();
    let mut end = u32::MAX;
    let mut settled = 0;
    let mut i = 0;
    while settled < n {
        let (port, shift) = touched[i];
        let (a, b) = match ports[port].window_from(at + shift, need) {
            Ok(window) => window,
            Err(no_sooner) => {
                // Not settled here: every port is looked at again from the later cycle.
                at = no_sooner - shift;
                end = u32::MAX;
                settled = 0;
                i = if i + 1 == n { 0 } else { i + 1 };
                continue;
            }
        };
        let (a, b) = (a - shift, b.saturating_sub(shift));
        if a > at {
            at = a;
            end = b;
            settled = 1;
        } else {
            end = end.min(b);
            settled += 1;
        }
        i = if i + 1 == n { 0 } else { i + 1 };
    }
    (at, end)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every cycle of `[at, ..)` checked in turn: the first from which every port stays free
    /// for `need` cycles, and how far that stays so (the definition `common_window` must meet).
    fn first_window_by_scan(ports: &[Port], touched: &[(usize, u32)], at: u32, need: u32) -> (u32, u32) {
        let fits = |t: u32| {
            touched.iter().all(|&(p, s)| {
                let (a, b) = ports[p].free_from(t + s);
                a == t + s && b - a >= need
            })
        };
        let start = (at..).find(|&t| fits(t)).expect("a common free window");
        let end = touched.iter().map(|&(p, s)| ports[p].free_from(start + s).1.saturating_sub(s)).min().expect("ports");
        (start, end)
    }

    #[test]
    fn common_window_is_the_first_cycle_from_which_every_port_stays_free_long_enough() {
        // Ports with random busy intervals (up to 48, so that window searches run past
        // `WINDOW_SCAN` gaps), from the tests' deterministic generator.
        let mut rng = crate::exchange::synthetic::SplitMix64(0x9e37_79b9_7f4a_7c15);
        let mut next = |bound: u32| rng.below(bound);
        for _ in 0..500 {
            let mut ports = vec![Port::default(); 8];
            for port in ports.iter_mut() {
                let mut cycle = 0;
                for _ in 0..next(48) {
                    let start = cycle + next(40);
                    let end = start + 1 + next(30);
                    let (a, b) = port.free_from(start);
                    if a == start && end <= b {
                        port.take(start, end);
                    }
                    cycle = end;
                }
            }
            let count = 1 + next(8) as usize;
            let touched: Vec<(usize, u32)> = (0..count).map(|_| (next(8) as usize, next(20))).collect();
            let (at, need) = (next(200), 1 + next(40));
            assert_eq!(common_window(&ports, &touched, at, need), first_window_by_scan(&ports, &touched, at, need), "ports {:?} touched {touched:?} at {at} need {need}", ports.iter().map(|p| (&p.gaps, p.tail)).collect::<Vec<_>>());
        }
    }
}

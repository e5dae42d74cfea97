//! Timing with delays: turn an order of pieces into send cycles, and measure horizons.
//!
//! Send ports are tracked in send cycles, receive ports in arrival cycles (send + delay), so a
//! piece fits when its sender is free and every receiver is free at the piece's arrival there.
//! The rule everywhere is "as soon as possible, in the given order": a piece starts at
//! max(sender free, receiver free − delay) over all its ports. This module must not reorder
//! pieces; the constructions and the local search decide orders.

use super::problem::Problem;
use super::types::Piece;

/// When each port is next free, after the pieces placed so far.
pub(crate) struct Timeline {
    pub send_free: Vec<u32>,
    pub receive_free: Vec<u32>,
}

impl Timeline {
    pub fn new(tiles: u32) -> Timeline {
        Timeline { send_free: vec![0; tiles as usize], receive_free: vec![0; tiles as usize] }
    }

    /// Earliest send cycle at or after `not_before` at which the piece's ports are all free.
    pub fn earliest(&self, problem: &Problem, job: usize, paired: bool, not_before: u32) -> u32 {
        let source = problem.jobs[job].source as usize;
        let mut start = not_before.max(self.send_free[source]);
        if paired {
            start = start.max(self.send_free[source ^ 1]);
        }
        for p in problem.receive_ports(job, paired) {
            start = start.max(self.receive_free[p.tile as usize].saturating_sub(p.delay));
        }
        start
    }

    /// Mark the piece's ports busy for `cycles` from `start`.
    pub fn occupy(&mut self, problem: &Problem, job: usize, paired: bool, start: u32, cycles: u32) {
        let source = problem.jobs[job].source as usize;
        let end = start + cycles;
        self.send_free[source] = self.send_free[source].max(end);
        if paired {
            self.send_free[source ^ 1] = self.send_free[source ^ 1].max(end);
        }
        for p in problem.receive_ports(job, paired) {
            let slot = &mut self.receive_free[p.tile as usize];
            *slot = (*slot).max(end + p.delay);
        }
    }

    /// Place a piece as soon as possible and return its send cycle.
    pub fn place(&mut self, problem: &Problem, piece: &Piece) -> u32 {
        let job = piece.transfer as usize;
        let start = self.earliest(problem, job, piece.paired, 0);
        self.occupy(problem, job, piece.paired, start, piece.cycles());
        start
    }
}

/// Cycle after the piece's last word has landed at its farthest destination.
pub(crate) fn piece_end(problem: &Problem, piece: &Piece) -> u32 {
    // The job's largest delay is the largest over its receive ports either way: a paired
    // piece's ports are the destinations and their partners, each at a destination's delay.
    piece.send_cycle + piece.cycles() + problem.jobs[piece.transfer as usize].max_delay
}

pub(crate) fn horizon(problem: &Problem, pieces: &[Piece]) -> u32 {
    pieces.iter().map(|p| piece_end(problem, p)).max().unwrap_or(0)
}

/// Time the pieces as soon as possible in the order given; returns the horizon.
pub(crate) fn retime_in_order(problem: &Problem, pieces: &mut [Piece]) -> u32 {
    let mut timeline = Timeline::new(problem.tiles);
    let mut end = 0;
    for piece in pieces.iter_mut() {
        piece.send_cycle = timeline.place(problem, piece);
        end = end.max(piece_end(problem, piece));
    }
    end
}

/// Canonical order of a finished schedule: by send cycle, then transfer and offset.
pub(crate) fn sort_pieces(pieces: &mut [Piece]) {
    // (send cycle, transfer, offset) packed into one integer: the same order, and so the same
    // permutation, as comparing the tuple, with one wide comparison instead of three.
    pieces.sort_unstable_by_key(|p| ((p.send_cycle as u128) << 64) | ((p.transfer as u128) << 32) | p.offset_words as u128);
}

/// Join pieces of one transfer that continue each other on the same cycles (fewer table rows).
pub(crate) fn merge_adjacent(pieces: &mut Vec<Piece>) {
    // By transfer, then offset: dealt into one bucket per transfer (a transfer has few pieces),
    // each bucket sorted alone, instead of one sort of the whole phase. Pieces of a transfer
    // cover disjoint words, so no two share an offset and this is the order of sorting by
    // (transfer, offset); the other fields only order pieces that would be equal there.
    let buckets = pieces.iter().map(|p| p.transfer as usize + 1).max().unwrap_or(0);
    let mut next = vec![0usize; buckets + 1];
    for p in pieces.iter() {
        next[p.transfer as usize + 1] += 1;
    }
    for b in 0..buckets {
        next[b + 1] += next[b];
    }
    let bounds = next.clone();
    let mut by_transfer = vec![Piece { transfer: 0, offset_words: 0, words: 0, send_cycle: 0, paired: false }; pieces.len()];
    for p in pieces.iter() {
        let slot = &mut next[p.transfer as usize];
        by_transfer[*slot] = *p;
        *slot += 1;
    }
    for w in bounds.windows(2) {
        if w[1] - w[0] > 1 {
            by_transfer[w[0]..w[1]].sort_unstable_by_key(|p| (p.offset_words, p.send_cycle, p.words, p.paired));
        }
    }
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for p in by_transfer.drain(..) {
        if let Some(last) = out.last_mut() {
            if last.transfer == p.transfer
                && last.paired == p.paired
                && last.offset_words + last.words == p.offset_words
                && last.send_cycle + last.cycles() == p.send_cycle
            {
                last.words += p.words;
                continue;
            }
        }
        out.push(p);
    }
    *pieces = out;
    sort_pieces(pieces);
}

/// A sender's place in the list schedules' heaps: (cycle, tile) packed so that the integer
/// order is the pair's order (one comparison per heap step instead of two).
pub(crate) fn sender_key(cycle: u32, tile: u32) -> u64 {
    ((cycle as u64) << 32) | tile as u64
}

/// The (cycle, tile) of a [`sender_key`].
pub(crate) fn sender_of(key: u64) -> (u32, u32) {
    ((key >> 32) as u32, key as u32)
}

/// How far a sender may look past its first pending piece for one that can start now.
const WINDOW: usize = 8;

/// List schedule following a priority (e.g. the virtual start of a delay-free schedule):
/// each sender, when free, starts the first of its next `WINDOW` pieces in priority order that
/// can start at once, or waits for the soonest of them. Unlike `retime_in_order` a piece does
/// not wait for pieces before it in the priority order that belong to other ports.
pub(crate) fn list_in_priority(problem: &Problem, keyed: Vec<(u64, Piece)>) -> Vec<Piece> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let tiles = problem.tiles as usize;
    let mut queues: Vec<Vec<Piece>> = vec![Vec::new(); tiles];
    let mut sorted = keyed;
    sorted.sort_by_key(|(k, p)| (*k, p.transfer, p.offset_words));
    for (_, p) in sorted {
        queues[problem.jobs[p.transfer as usize].source as usize].push(p);
    }
    let mut taken: Vec<Vec<bool>> = queues.iter().map(|q| vec![false; q.len()]).collect();
    let mut head = vec![0usize; tiles];
    let mut timeline = Timeline::new(problem.tiles);
    let mut heap: BinaryHeap<Reverse<u64>> = (0..tiles as u32).filter(|&t| !queues[t as usize].is_empty()).map(|t| Reverse(sender_key(0, t))).collect();
    let mut out = Vec::new();
    while let Some(Reverse(key)) = heap.pop() {
        let (now, s) = sender_of(key);
        let su = s as usize;
        if now < timeline.send_free[su] {
            heap.push(Reverse(sender_key(timeline.send_free[su], s)));
            continue;
        }
        while head[su] < queues[su].len() && taken[su][head[su]] {
            head[su] += 1;
        }
        let mut soonest = u32::MAX;
        let mut chosen = None;
        let mut seen = 0;
        let mut i = head[su];
        while i < queues[su].len() && seen < WINDOW {
            if !taken[su][i] {
                seen += 1;
                let p = &queues[su][i];
                let start = timeline.earliest(problem, p.transfer as usize, p.paired, now);
                if start == now {
                    chosen = Some(i);
                    break;
                }
                soonest = soonest.min(start);
            }
            i += 1;
        }
        match chosen {
            Some(i) => {
                taken[su][i] = true;
                let mut p = queues[su][i];
                p.send_cycle = now;
                timeline.occupy(problem, p.transfer as usize, p.paired, now, p.cycles());
                out.push(p);
                if head[su] < queues[su].len() {
                    heap.push(Reverse(sender_key(timeline.send_free[su], s)));
                }
            }
            None if soonest != u32::MAX => heap.push(Reverse(sender_key(soonest, s))),
            None => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{merge_adjacent, sort_pieces};
    use crate::exchange::types::Piece;

    /// `merge_adjacent` as it was written first: one sort of the whole phase by (transfer,
    /// offset), the same joining pass, then the canonical order.
    fn merged_by_one_sort(mut pieces: Vec<Piece>) -> Vec<Piece> {
        pieces.sort_unstable_by_key(|p| (p.transfer, p.offset_words));
        let mut out: Vec<Piece> = Vec::new();
        for p in pieces {
            if let Some(last) = out.last_mut() {
                if last.transfer == p.transfer && last.paired == p.paired && last.offset_words + last.words == p.offset_words && last.send_cycle + last.cycles() == p.send_cycle {
                    last.words += p.words;
                    continue;
                }
            }
            out.push(p);
        }
        sort_pieces(&mut out);
        out
    }

    #[test]
    fn merging_by_transfer_buckets_gives_the_one_sort_result() {
        let mut rng = crate::exchange::synthetic::SplitMix64(0x51_7cc1_b727_220a);
        for _ in 0..200 {
            // Transfers cut into consecutive pieces, some continuing each other in time.
            let mut pieces = Vec::new();
            for transfer in 0..1 + rng.below(30) {
                let paired = rng.below(3) == 0;
                let (mut offset, mut cycle) = (0, rng.below(500));
                for _ in 0..1 + rng.below(6) {
                    let words = if paired { 2 * (1 + rng.below(20)) } else { 1 + rng.below(40) };
                    pieces.push(Piece { transfer, offset_words: offset, words, send_cycle: cycle, paired });
                    offset += words;
                    cycle += if paired { words / 2 } else { words } + if rng.below(2) == 0 { 0 } else { rng.below(50) };
                }
            }
            // In no particular order, as the constructions hand them over.
            for i in (1..pieces.len()).rev() {
                pieces.swap(i, rng.below(i as u32 + 1) as usize);
            }
            let expected = merged_by_one_sort(pieces.clone());
            merge_adjacent(&mut pieces);
            assert_eq!(pieces, expected);
        }
    }
}

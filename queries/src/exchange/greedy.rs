//! "full-duplex": a preemptive list schedule for any phase (multicast, pairs), and the choice
//! of which transfers go paired.
//!
//! Senders are visited in order of the cycle their port frees up. A free sender starts, from
//! among its pending transfers that can start now (every receiver free when the word arrives),
//! the one whose most loaded port has the most work left, for a chunk of at most
//! `chunk_words` words; when none can start it waits for the earliest that can. Serving the
//! most-loaded ports first is the classic open-shop rule (a port whose remaining load equals
//! the remaining time must never idle); chunks of 64–256 words let urgent work preempt.
//! Multicast is handled by requiring all receivers at once. It must not try to be optimal:
//! `matching.rs` is for bipartite phases, `compact.rs` polishes timing.
//!
//! **"critical-neighborhood".** The greedy's horizon is set by a few transfers on the critical
//! tail: a port that finished late because its senders served other ports first. We raise the
//! urgency of every transfer that ended late, in proportion to how late it ended, and rebuild;
//! repeat, keeping the best ("squeaky wheel" optimisation, Joslin and Clements, JAIR 1999: the
//! priorities are the neighbourhood, the critical tail picks the move). Two chains with
//! different step sizes run side by side. The budget counts rebuilds scaled by the phase size,
//! never wall-clock time, so the result is the same on every machine and thread count.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rayon::prelude::*;

use super::compact::{self, Effort};
use super::problem::Problem;
use super::timing::{self, Timeline};
use super::types::Piece;

/// Which eligible transfers go paired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pairing {
    /// None: every word through one 32-bit port.
    Ordinary,
    /// Every eligible transfer.
    All,
    /// Eligible transfers whose pairing lowers the busiest port they touch (largest first).
    Balanced,
}

/// Per transfer, whether it goes paired under `mode`.
pub(crate) fn choose_pairing(problem: &Problem, mode: Pairing) -> Vec<bool> {
    let n = problem.jobs.len();
    match mode {
        Pairing::Ordinary => return vec![false; n],
        Pairing::All => return (0..n).map(|j| problem.eligible(j)).collect(),
        Pairing::Balanced => {}
    }
    let tiles = problem.tiles as usize;
    let (mut send, mut receive) = (vec![0u64; tiles], vec![0u64; tiles]);
    for (j, job) in problem.jobs.iter().enumerate() {
        send[job.source as usize] += job.words as u64;
        for p in problem.receive_ports(j, false) {
            receive[p.tile as usize] += job.words as u64;
        }
    }
    let mut order: Vec<usize> = (0..n).filter(|&j| problem.eligible(j)).collect();
    order.sort_by_key(|&j| (Reverse(problem.jobs[j].words), j));
    let mut paired = vec![false; n];
    for j in order {
        let job = &problem.jobs[j];
        let (w, half) = (job.words as u64, job.words as u64 / 2);
        let s = job.source as usize;
        let ordinary = problem.receive_ports(j, false);
        let pairs = problem.receive_ports(j, true);
        let before = send[s].max(send[s ^ 1]).max(pairs.iter().map(|p| receive[p.tile as usize]).max().unwrap_or(0));
        // Loads if this transfer went paired instead.
        let own = |tile: usize| if ordinary.iter().any(|p| p.tile as usize == tile) { w } else { 0 };
        let after_receive = pairs.iter().map(|p| receive[p.tile as usize] - own(p.tile as usize) + half).max().unwrap_or(0);
        let after = (send[s] - w + half).max(send[s ^ 1] + half).max(after_receive);
        if after < before {
            paired[j] = true;
            send[s] = send[s] - w + half;
            send[s ^ 1] += half;
            for p in pairs {
                let tile = p.tile as usize;
                receive[tile] = receive[tile] - own(tile) + half;
            }
        }
    }
    paired
}

/// A transfer waiting on its sender in `full_duplex`, with what the sender's look at it reads
/// kept together (the look is the schedule's inner loop).
///
/// `not_before`: the earliest start the last look found (0: not looked at yet, or it could
/// start then). Ports only ever get busier, so a transfer whose last look said "not before c"
/// cannot start before c: while c is still ahead it is skipped without walking its ports.
/// When no transfer can start, the skipped ones are walked after all (those whose bound is
/// below the earliest start found), so the sender looks again exactly when the first one can
/// start: which piece goes when is exactly as when every look walks every port.
#[derive(Clone)]
struct Waiting {
    job: u32,
    not_before: u32,
    pair: bool,
    /// Its receive ports: `Problem::ports_in(list, first, end)`.
    list: bool,
    first: u32,
    end: u32,
}

/// The greedy list schedule with the given pairing choice and chunk size. `bias` (per
/// transfer, may be empty) raises the urgency of transfers that ended late in an earlier run.
pub(crate) fn full_duplex(problem: &Problem, paired: &[bool], chunk_words: u32, bias: &[u64]) -> Vec<Piece> {
    let tiles = problem.tiles as usize;
    let cycles = |j: usize, words: u32| if paired[j] { words / 2 } else { words };
    // Remaining port cycles: the urgency of every port.
    let (mut send_load, mut receive_load) = (vec![0u64; tiles], vec![0u64; tiles]);
    let mut pending: Vec<Vec<Waiting>> = vec![Vec::new(); tiles];
    for (j, job) in problem.jobs.iter().enumerate() {
        let c = cycles(j, job.words) as u64;
        send_load[job.source as usize] += c;
        if paired[j] {
            send_load[job.source as usize ^ 1] += c;
        }
        for p in problem.receive_ports(j, paired[j]) {
            receive_load[p.tile as usize] += c;
        }
        let (list, first, end) = problem.receive_port_range(j, paired[j]);
        pending[job.source as usize].push(Waiting { job: j as u32, not_before: 0, pair: paired[j], list, first, end });
    }
    let mut sent = vec![0u32; problem.jobs.len()];
    let mut timeline = Timeline::new(problem.tiles);
    let mut heap: BinaryHeap<Reverse<u64>> = (0..tiles as u32).filter(|&t| !pending[t as usize].is_empty()).map(|t| Reverse(timing::sender_key(0, t))).collect();
    let mut pieces = Vec::new();
    while let Some(Reverse(key)) = heap.pop() {
        let (now, s) = timing::sender_of(key);
        let su = s as usize;
        if now < timeline.send_free[su] {
            // A paired piece of the partner took this port meanwhile.
            heap.push(Reverse(timing::sender_key(timeline.send_free[su], s)));
            continue;
        }
        let mut best: Option<(u64, u32)> = None;
        let mut soonest = u32::MAX;
        // One pass per pending transfer: its earliest start and its urgency together.
        let own_free = if now > timeline.send_free[su] { now } else { timeline.send_free[su] };
        for w in pending[su].iter_mut() {
            if w.not_before > now {
                soonest = soonest.min(w.not_before);
                continue;
            }
            let (j, ju, pair) = (w.job, w.job as usize, w.pair);
            let mut start = own_free;
            let mut most = 0;
            if pair {
                start = start.max(timeline.send_free[su ^ 1]);
                most = send_load[su ^ 1];
            }
            for p in problem.ports_in(w.list, w.first, w.end) {
                let d = p.tile as usize;
                start = start.max(timeline.receive_free[d].saturating_sub(p.delay));
                most = most.max(receive_load[d]);
            }
            if start > now {
                w.not_before = start;
                soonest = soonest.min(start);
                continue;
            }
            let urgency = most + bias.get(ju).copied().unwrap_or(0);
            if best.is_none_or(|(u, b)| urgency > u || (urgency == u && j < b)) {
                best = Some((urgency, j));
            }
        }
        let Some((_, j)) = best else {
            // Exact earliest start: bounds below the earliest found may be stale.
            for w in pending[su].iter_mut().filter(|w| w.not_before > now) {
                if w.not_before < soonest {
                    w.not_before = earliest(problem, &timeline, su, w);
                    soonest = soonest.min(w.not_before);
                }
            }
            if soonest != u32::MAX {
                heap.push(Reverse(timing::sender_key(soonest, s)));
            }
            continue;
        };
        let ju = j as usize;
        let words = problem.jobs[ju].words;
        // Whole members up to the chunk, a member cut only when it alone exceeds the chunk.
        let mut take = problem.chunk_end(ju, sent[ju], chunk_words) - sent[ju];
        if paired[ju] {
            take &= !1;
        }
        let piece = Piece { transfer: j, offset_words: sent[ju], words: take, send_cycle: now, paired: paired[ju] };
        let c = piece.cycles();
        timeline.occupy(problem, ju, paired[ju], now, c);
        send_load[su] -= c as u64;
        if paired[ju] {
            send_load[su ^ 1] -= c as u64;
        }
        for p in problem.receive_ports(ju, paired[ju]) {
            receive_load[p.tile as usize] -= c as u64;
        }
        sent[ju] += take;
        pieces.push(piece);
        if sent[ju] == words {
            pending[su].retain(|k| k.job != j);
        }
        if !pending[su].is_empty() {
            heap.push(Reverse(timing::sender_key(timeline.send_free[su], s)));
        }
    }
    timing::merge_adjacent(&mut pieces);
    pieces
}

/// The earliest send cycle of a waiting transfer of sender `su` on the timeline so far.
fn earliest(problem: &Problem, timeline: &Timeline, su: usize, w: &Waiting) -> u32 {
    let mut start = timeline.send_free[su];
    if w.pair {
        start = start.max(timeline.send_free[su ^ 1]);
    }
    for p in problem.ports_in(w.list, w.first, w.end) {
        start = start.max(timeline.receive_free[p.tile as usize].saturating_sub(p.delay));
    }
    start
}

/// The plain fallback: whole transfers, in request order, each as soon as possible.
pub(crate) fn in_request_order(problem: &Problem) -> Vec<Piece> {
    let mut pieces: Vec<Piece> = (0..problem.jobs.len() as u32)
        .map(|j| Piece { transfer: j, offset_words: 0, words: problem.jobs[j as usize].words, send_cycle: 0, paired: false })
        .collect();
    timing::retime_in_order(problem, &mut pieces);
    timing::sort_pieces(&mut pieces);
    pieces
}

/// Transfer-rebuilds per chain: a 15k-transfer phase gets 3, a 25k one 2, an 85k one none.
const WORK_PER_CHAIN: usize = 60_000;
const MAX_REBUILDS: usize = 20;
/// Step sizes (bias per cycle of lateness) of the chains.
const STEPS: [u64; 2] = [2, 6];

pub(crate) struct Improved {
    pub pieces: Vec<Piece>,
    pub horizon: u32,
    pub improvements: u32,
}

/// Rebuild the greedy schedule with urgency raised on late transfers; `floor` is the best
/// bound, at which the search stops.
pub(crate) fn critical_neighborhood(problem: &Problem, paired: &[bool], chunk: u32, pieces: Vec<Piece>, floor: u32, effort: Effort) -> Improved {
    let horizon = timing::horizon(problem, &pieces);
    let start = Improved { pieces, horizon, improvements: 0 };
    if horizon <= floor || problem.jobs.is_empty() {
        return start;
    }
    // A rebuild's work is its number of chunks times the ports each one checks: long and wide
    // multicast transfers cost more than their count says (at least one unit per transfer).
    let chunks: usize = (0..problem.jobs.len())
        .map(|j| problem.jobs[j].words.div_ceil(chunk.max(1)) as usize * problem.receive_ports(j, false).len().max(1))
        .sum();
    let rebuilds = (WORK_PER_CHAIN / chunks.max(problem.jobs.len())).min(MAX_REBUILDS);
    if rebuilds == 0 {
        return start;
    }
    let chains: Vec<Improved> = STEPS.par_iter().map(|&step| chain(problem, paired, chunk, &start, floor, step, rebuilds, effort)).collect();
    let mut best = start;
    for c in chains {
        if c.horizon < best.horizon {
            best = c;
        }
    }
    best
}

#[allow(clippy::too_many_arguments)]
fn chain(problem: &Problem, paired: &[bool], chunk: u32, start: &Improved, floor: u32, step: u64, rebuilds: usize, effort: Effort) -> Improved {
    let mut bias = vec![0u64; problem.jobs.len()];
    let mut best = Improved { pieces: Vec::new(), horizon: start.horizon, improvements: 0 };
    let mut current_horizon = start.horizon;
    let mut ends = job_ends(problem, &start.pieces);
    for _ in 0..rebuilds {
        // Lateness against the bound; only the tail is pushed forward.
        let threshold = floor.max(current_horizon.saturating_sub((current_horizon - floor.min(current_horizon)) / 2 + 1));
        let mut moved = false;
        for (j, &end) in ends.iter().enumerate() {
            if end > threshold {
                bias[j] += step * (end - threshold) as u64;
                moved = true;
            }
        }
        if !moved {
            break;
        }
        let pieces = compact::justify(problem, full_duplex(problem, paired, chunk, &bias), effort);
        let horizon = timing::horizon(problem, &pieces);
        ends = job_ends(problem, &pieces);
        current_horizon = horizon;
        if horizon < best.horizon {
            best = Improved { pieces, horizon, improvements: best.improvements + 1 };
            if horizon <= floor {
                break;
            }
        }
    }
    best
}

/// Cycle at which each transfer's last word has landed everywhere.
fn job_ends(problem: &Problem, pieces: &[Piece]) -> Vec<u32> {
    let mut ends = vec![0u32; problem.jobs.len()];
    for p in pieces {
        let e = &mut ends[p.transfer as usize];
        *e = (*e).max(timing::piece_end(problem, p));
    }
    ends
}

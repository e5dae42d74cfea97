//! "critical-neighborhood": improve a greedy schedule by working on what ends last.
//!
//! The greedy's horizon is set by a few transfers on the critical tail: a port that finished
//! late because its senders served other ports first. We raise the urgency of every transfer
//! that ended after the bound, in proportion to how late it ended, and rebuild; repeat while
//! the horizon drops, keeping the best ("squeaky wheel" optimisation, Joslin and Clements,
//! JAIR 1999; the priorities are the neighbourhood, the critical tail picks the move). Two
//! chains with different step sizes run side by side.
//!
//! The budget counts rebuilds (scaled by the phase size), never wall-clock time, so the result
//! is the same on every machine and thread count. This module must not encode tables.

use rayon::prelude::*;

use super::compact;
use super::greedy;
use super::problem::Problem;
use super::timing;
use super::types::Piece;

/// Transfer-rebuilds per chain: a 15k-transfer phase gets 9 rebuilds, an 85k one 1.
const WORK_PER_CHAIN: usize = 150_000;
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
pub(crate) fn critical_neighborhood(problem: &Problem, paired: &[bool], chunk: u32, pieces: Vec<Piece>, floor: u32) -> Improved {
    let horizon = timing::horizon(problem, &pieces);
    let start = Improved { pieces, horizon, improvements: 0 };
    if horizon <= floor || problem.jobs.is_empty() {
        return start;
    }
    let rebuilds = (WORK_PER_CHAIN / problem.jobs.len()).min(MAX_REBUILDS);
    if rebuilds == 0 {
        return start;
    }
    let chains: Vec<Improved> = STEPS.par_iter().map(|&step| chain(problem, paired, chunk, &start, floor, step, rebuilds)).collect();
    let mut best = start;
    for c in chains {
        if c.horizon < best.horizon {
            best = c;
        }
    }
    best
}

fn chain(problem: &Problem, paired: &[bool], chunk: u32, start: &Improved, floor: u32, step: u64, rebuilds: usize) -> Improved {
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
        let pieces = compact::justify(problem, greedy::full_duplex(problem, paired, chunk, &bias));
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

//! Lower bounds on the horizon of a phase: no schedule, whatever its kind, is shorter.
//!
//! **Endpoint bound.** For every port the cycles it must be busy, plus the smallest delay the
//! last of those words can have. Precisely, with ineligible words counted in full and
//! pair-eligible words at half (a paired piece moves two words per cycle):
//! - send port of tile a: `I_a + E_a / 2` cycles of a's own words, and the last of them lands
//!   no earlier than `min over a's transfers of (largest delay to its destinations)`;
//! - supertile pair (a, a^1) sending: the two ports together carry every word of both tiles
//!   (a paired piece uses both ports for half as many cycles), so one of them is busy
//!   `ceil((S_a + S_{a^1}) / 2)` cycles;
//! - receive port of tile a: `I_a + E_a / 2 + C_a / 2`, with `C_a` the eligible words that a and
//!   its partner both receive (a paired receive shares both ports), plus the smallest delay of
//!   any word into a, because sends start at cycle 0;
//! - receiving pair: `ceil((I_a + I_b + E_a + E_b + C) / 2)`, because a paired receive for one
//!   tile occupies its partner's port as well, and a shared one costs each port half.
//!
//! **Multicast clique bound.** Transfers that pairwise share a receiver (or a sender) cannot
//! overlap there. When their delays to the shared receivers are consistent (there are shifts
//! τ with `δ(X, r) − τ_X = δ(Y, r) − τ_Y` for the witnessing receiver r), their shifted send
//! cycles are pairwise disjoint, so the horizon is at least `Σ cycles + min τ`. Three transfers
//! to {a,b}, {b,c}, {a,c} of w words need 3w, not 2w. We grow cliques greedily from the most
//! loaded receivers; a clique that is not maximum still gives a valid bound.
//!
//! This module must not build schedules; it only counts.

use super::problem::Problem;

pub(crate) struct Bounds {
    pub endpoint: u32,
    pub stronger: Option<(String, u32)>,
}

/// Port cycles of a transfer when it goes paired if it can.
fn least_cycles(problem: &Problem, job: usize) -> u64 {
    let j = &problem.jobs[job];
    if j.paired.is_some() {
        j.words as u64 / 2
    } else {
        j.words as u64
    }
}

pub(crate) fn endpoint_bound(problem: &Problem) -> u32 {
    let n = problem.tiles as usize;
    let mut send_full = vec![0u64; n];
    let mut send_eligible = vec![0u64; n];
    let mut send_delay = vec![u32::MAX; n];
    let mut receive_full = vec![0u64; n];
    let mut receive_eligible = vec![0u64; n];
    let mut receive_shared = vec![0u64; n];
    let mut receive_delay = vec![u32::MAX; n];
    for (index, job) in problem.jobs.iter().enumerate() {
        let s = job.source as usize;
        let words = job.words as u64;
        let eligible = problem.eligible(index);
        if eligible { send_eligible[s] += words } else { send_full[s] += words }
        send_delay[s] = send_delay[s].min(job.max_delay);
        let ports = problem.receive_ports(index, false);
        for p in ports {
            let d = p.tile as usize;
            receive_delay[d] = receive_delay[d].min(p.delay);
            if !eligible {
                receive_full[d] += words;
            } else if ports.iter().any(|q| q.tile as usize == d ^ 1) {
                receive_shared[d] += words;
            } else {
                receive_eligible[d] += words;
            }
        }
    }
    let mut best = 0u64;
    for a in (0..n).step_by(2) {
        let b = a + 1;
        let pair = b < n;
        // Sending.
        let own = |t: usize| send_full[t] + send_eligible[t] / 2;
        for t in [a, b].into_iter().filter(|&t| t < n && send_delay[t] != u32::MAX) {
            best = best.max(own(t) + send_delay[t] as u64);
        }
        if pair && (send_delay[a] != u32::MAX || send_delay[b] != u32::MAX) {
            let total = send_full[a] + send_eligible[a] + send_full[b] + send_eligible[b];
            best = best.max(total.div_ceil(2) + send_delay[a].min(send_delay[b]) as u64);
        }
        // Receiving.
        for t in [a, b].into_iter().filter(|&t| t < n && receive_delay[t] != u32::MAX) {
            best = best.max(receive_full[t] + (receive_eligible[t] + receive_shared[t]) / 2 + receive_delay[t] as u64);
        }
        if pair && (receive_delay[a] != u32::MAX || receive_delay[b] != u32::MAX) {
            // Shared words are counted on both tiles; a paired receive moves them once.
            let total = receive_full[a] + receive_full[b] + receive_eligible[a] + receive_eligible[b] + receive_shared[a];
            best = best.max(total.div_ceil(2) + receive_delay[a].min(receive_delay[b]) as u64);
        }
    }
    best.min(u32::MAX as u64) as u32
}

pub(crate) fn bounds(problem: &Problem) -> Bounds {
    let endpoint = endpoint_bound(problem);
    let multicast = problem.jobs.iter().any(|j| j.ordinary.1 - j.ordinary.0 > 1);
    let stronger = if multicast { clique_bound(problem).filter(|&b| b > endpoint).map(|b| ("multicast-clique".to_string(), b)) } else { None };
    Bounds { endpoint, stronger }
}

/// Tiles whose receive ports a clique is grown from.
const CLIQUE_SEEDS: usize = 4;
/// Candidates examined per seed, largest first.
const CLIQUE_CANDIDATES: usize = 256;
/// Work caps that keep the search cheap on phases of wide broadcasts: members per clique,
/// destinations of a transfer considered, and (transfer, receiver) visits while collecting.
const CLIQUE_MEMBERS: usize = 512;
const CLIQUE_FANOUT: usize = 64;
const CLIQUE_VISITS: usize = 1 << 20;

fn clique_bound(problem: &Problem) -> Option<u32> {
    let n = problem.tiles as usize;
    let mut incoming: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut load = vec![0u64; n];
    for index in 0..problem.jobs.len() {
        for p in problem.receive_ports(index, false) {
            incoming[p.tile as usize].push(index as u32);
            load[p.tile as usize] += least_cycles(problem, index);
        }
    }
    let mut seeds: Vec<usize> = (0..n).filter(|&t| load[t] > 0).collect();
    seeds.sort_by_key(|&t| (std::cmp::Reverse(load[t]), t));
    let mut best: Option<u32> = None;
    for &seed in seeds.iter().take(CLIQUE_SEEDS) {
        // Members with their shifts τ; the seed tile witnesses every pair among them.
        let mut members: Vec<(u32, i64)> = incoming[seed]
            .iter()
            .map(|&x| (x, delay_to(problem, x as usize, seed as u32).unwrap_or(0) as i64))
            .collect();
        let mut candidates: Vec<u32> = Vec::new();
        let mut marked = vec![false; problem.jobs.len()];
        for &x in &incoming[seed] {
            marked[x as usize] = true;
        }
        let mut visits = if members.len() > CLIQUE_MEMBERS { CLIQUE_VISITS } else { 0 };
        'collect: for &(x, _) in members.iter().take(CLIQUE_MEMBERS) {
            for p in problem.receive_ports(x as usize, false).iter().take(CLIQUE_FANOUT) {
                for &y in &incoming[p.tile as usize] {
                    visits += 1;
                    if visits > CLIQUE_VISITS {
                        break 'collect;
                    }
                    let fanout = problem.receive_ports(y as usize, false).len();
                    if !marked[y as usize] && fanout <= CLIQUE_FANOUT {
                        marked[y as usize] = true;
                        candidates.push(y);
                    }
                }
            }
        }
        candidates.sort_by_key(|&y| (std::cmp::Reverse(least_cycles(problem, y as usize)), y));
        for &y in candidates.iter().take(CLIQUE_CANDIDATES) {
            if members.len() >= CLIQUE_MEMBERS {
                break;
            }
            if let Some(shift) = consistent_shift(problem, &members, y as usize) {
                members.push((y, shift));
            }
        }
        let cycles: u64 = members.iter().map(|&(x, _)| least_cycles(problem, x as usize)).sum();
        let start = members.iter().map(|&(_, s)| s).min().unwrap_or(0);
        let value = (cycles as i64 + start).clamp(0, u32::MAX as i64) as u32;
        best = Some(best.map_or(value, |b| b.max(value)));
    }
    best
}

fn delay_to(problem: &Problem, job: usize, tile: u32) -> Option<u32> {
    problem.receive_ports(job, false).iter().find(|p| p.tile == tile).map(|p| p.delay)
}

/// The shift of `y` that makes it conflict consistently with every member, if there is one.
fn consistent_shift(problem: &Problem, members: &[(u32, i64)], y: usize) -> Option<i64> {
    let mut shift: Option<i64> = None;
    let source = problem.jobs[y].source;
    for &(x, tau_x) in members {
        let xj = &problem.jobs[x as usize];
        if problem.receive_ports(x as usize, false).len() > CLIQUE_FANOUT {
            // Too wide to check cheaply; leaving y out keeps the bound valid.
            return None;
        }
        let mut options: Vec<i64> = Vec::new();
        if xj.source == source {
            options.push(tau_x);
        }
        for p in problem.receive_ports(y, false) {
            if let Some(dx) = delay_to(problem, x as usize, p.tile) {
                options.push(tau_x + p.delay as i64 - dx as i64);
            }
        }
        match shift {
            None => shift = options.iter().copied().min(),
            Some(s) if options.contains(&s) => {}
            Some(_) => return None,
        }
        shift?;
    }
    // The shifted send cycles must not run past the transfer's own last arrival.
    shift.filter(|&s| s <= problem.jobs[y].max_delay as i64)
}

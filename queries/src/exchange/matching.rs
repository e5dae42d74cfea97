//! "matching-waves": optimal preemptive schedule of a bipartite phase, ignoring delays, then
//! timed with the delays.
//!
//! The (sender, receiver class) graph carries one edge per pair with its word count. We pad it
//! to a Δ-regular weight matrix (northwest-corner dummy entries, at most 2n − 1 of them), find
//! one perfect matching, then repeatedly let the matched edges run until the first one is
//! exhausted and repair only the freed nodes with shortest augmenting paths. Every node is
//! matched at every instant, so the whole decomposition lasts exactly Δ: the preemptive
//! open-shop construction of Gonzalez and Sahni ("Open shop scheduling to minimize finish
//! time", JACM 1976), a Birkhoff–von Neumann decomposition; König (1916) guarantees the
//! repairs. Matched edges stay matched until exhausted ("sticky"), so a message is split only
//! when an augmenting path flips it out.
//!
//! It never colours word by word: work is per block, not per word. It only applies when merging
//! receivers with identical incoming sets leaves a bipartite graph; pairing is left to the
//! other constructions.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::problem::Problem;
use super::timing;
use super::types::Piece;

const NONE: u32 = u32::MAX;

struct Graph {
    left: Vec<u32>,
    right: Vec<u32>,
    remaining: Vec<u64>,
    /// First job of the edge in `jobs` (real edges only); dummy edges have `NONE`.
    jobs_start: Vec<u32>,
    jobs_end: Vec<u32>,
    adjacency: Vec<Vec<u32>>,
}

/// Build the schedule; `None` when the phase is not bipartite after merging receivers.
pub(crate) fn matching_waves(problem: &Problem) -> Option<Vec<Piece>> {
    if !problem.is_bipartite() || problem.jobs.is_empty() {
        return None;
    }
    let (graph, jobs, _delta) = build_graph(problem);
    let runs = decompose(&graph);
    let mut keyed = runs_to_pieces(problem, &graph, &jobs, runs);
    // Two timings of the same blocks: strictly in block order (exact when delays are uniform:
    // every port then runs exactly as in the delay-free schedule), and a list schedule that
    // lets a sender run ahead of the order when its next piece is blocked.
    keyed.sort_unstable_by_key(|(start, p)| (*start, p.transfer, p.offset_words));
    let mut ordered: Vec<Piece> = keyed.iter().map(|(_, p)| *p).collect();
    let in_order = timing::retime_in_order(problem, &mut ordered);
    let mut listed = timing::list_in_priority(problem, keyed);
    let mut pieces = if timing::horizon(problem, &listed) < in_order { std::mem::take(&mut listed) } else { ordered };
    timing::merge_adjacent(&mut pieces);
    Some(pieces)
}

/// Edges per (source, receiver class), jobs grouped by edge, padded to Δ-regular.
fn build_graph(problem: &Problem) -> (Graph, Vec<u32>, u64) {
    let n = problem.tiles as usize;
    let mut keyed: Vec<(u32, u32, u32)> = problem
        .jobs
        .iter()
        .enumerate()
        .map(|(i, j)| (j.source, problem.receiver_class[problem.receive_ports(i, false)[0].tile as usize], i as u32))
        .collect();
    keyed.sort_unstable();
    let mut g = Graph { left: vec![], right: vec![], remaining: vec![], jobs_start: vec![], jobs_end: vec![], adjacency: vec![Vec::new(); n] };
    let jobs: Vec<u32> = keyed.iter().map(|k| k.2).collect();
    let mut row = vec![0u64; n];
    let mut column = vec![0u64; n];
    let mut i = 0;
    while i < keyed.len() {
        let (s, c, _) = keyed[i];
        let mut j = i;
        let mut weight = 0u64;
        while j < keyed.len() && keyed[j].0 == s && keyed[j].1 == c {
            weight += problem.jobs[keyed[j].2 as usize].words as u64;
            j += 1;
        }
        push_edge(&mut g, s, c, weight, i as u32, j as u32);
        row[s as usize] += weight;
        column[c as usize] += weight;
        i = j;
    }
    let delta = row.iter().chain(column.iter()).copied().max().unwrap_or(0);
    // Northwest-corner padding: walk rows and columns with slack together.
    let (mut r, mut c) = (0usize, 0usize);
    loop {
        while r < n && row[r] == delta {
            r += 1;
        }
        while c < n && column[c] == delta {
            c += 1;
        }
        if r >= n || c >= n {
            break;
        }
        let amount = (delta - row[r]).min(delta - column[c]);
        push_edge(&mut g, r as u32, c as u32, amount, NONE, NONE);
        row[r] += amount;
        column[c] += amount;
    }
    (g, jobs, delta)
}

fn push_edge(g: &mut Graph, left: u32, right: u32, weight: u64, start: u32, end: u32) {
    let e = g.left.len() as u32;
    g.left.push(left);
    g.right.push(right);
    g.remaining.push(weight);
    g.jobs_start.push(start);
    g.jobs_end.push(end);
    g.adjacency[left as usize].push(e);
}

/// One stretch during which an edge stays matched: (edge, virtual start, length).
type Run = (u32, u64, u64);

struct State {
    mate_left: Vec<u32>,
    mate_right: Vec<u32>,
    run_start: Vec<u64>,
    matched: Vec<bool>,
    remaining: Vec<u64>,
    heap: BinaryHeap<Reverse<(u64, u32)>>,
    stamp: Vec<u32>,
    parent: Vec<u32>,
    epoch: u32,
    queue: Vec<u32>,
}

fn decompose(g: &Graph) -> Vec<Run> {
    let n = g.adjacency.len();
    let mut adjacency = g.adjacency.clone();
    let mut st = State {
        remaining: g.remaining.clone(),
        mate_left: vec![NONE; n],
        mate_right: vec![NONE; n],
        run_start: vec![0; g.remaining.len()],
        matched: vec![false; g.remaining.len()],
        heap: BinaryHeap::new(),
        stamp: vec![0; n],
        parent: vec![NONE; n],
        epoch: 0,
        queue: Vec::new(),
    };
    let mut runs = Vec::new();
    let mut now = 0u64;
    for u in 0..n as u32 {
        augment(g, &mut adjacency, &mut st, u, now, &mut runs);
    }
    let mut freed = Vec::new();
    while let Some(Reverse((end, e))) = st.heap.pop() {
        if !st.matched[e as usize] || st.run_start[e as usize] + st.remaining[e as usize] != end {
            continue;
        }
        now = end;
        freed.clear();
        freed.push(e);
        while let Some(&Reverse((next, f))) = st.heap.peek() {
            if next != now {
                break;
            }
            st.heap.pop();
            if st.matched[f as usize] && st.run_start[f as usize] + st.remaining[f as usize] == now {
                freed.push(f);
            }
        }
        for &f in &freed {
            let fu = f as usize;
            runs.push((f, st.run_start[fu], now - st.run_start[fu]));
            st.remaining[fu] = 0;
            st.matched[fu] = false;
            st.mate_left[g.left[fu] as usize] = NONE;
            st.mate_right[g.right[fu] as usize] = NONE;
        }
        for &f in &freed {
            augment(g, &mut adjacency, &mut st, g.left[f as usize], now, &mut runs);
        }
    }
    runs
}

/// Match left node `u` by a shortest augmenting path; edges flipped out end their runs.
fn augment(g: &Graph, adjacency: &mut [Vec<u32>], st: &mut State, u: u32, now: u64, runs: &mut Vec<Run>) {
    if st.mate_left[u as usize] != NONE {
        return;
    }
    st.epoch += 1;
    st.queue.clear();
    st.queue.push(u);
    let mut head = 0;
    let mut found = NONE;
    'search: while head < st.queue.len() {
        let x = st.queue[head] as usize;
        head += 1;
        // Drop exhausted edges while scanning; order is still deterministic.
        let remaining = &st.remaining;
        adjacency[x].retain(|&e| remaining[e as usize] > 0);
        for &e in &adjacency[x] {
            let v = g.right[e as usize] as usize;
            if st.matched[e as usize] || st.stamp[v] == st.epoch {
                continue;
            }
            st.stamp[v] = st.epoch;
            st.parent[v] = e;
            let mate = st.mate_right[v];
            if mate == NONE {
                found = v as u32;
                break 'search;
            }
            st.queue.push(g.left[mate as usize]);
        }
    }
    // A regular graph always has the path (König); without one the node simply stays idle.
    let mut v = found;
    while v != NONE {
        let e = st.parent[v as usize];
        let x = g.left[e as usize] as usize;
        let previous = st.mate_left[x];
        if previous != NONE {
            let p = previous as usize;
            let length = now - st.run_start[p];
            if length > 0 {
                runs.push((previous, st.run_start[p], length));
            }
            st.remaining[p] -= length;
            st.matched[p] = false;
        }
        let eu = e as usize;
        st.matched[eu] = true;
        st.run_start[eu] = now;
        st.mate_left[x] = e;
        st.mate_right[v as usize] = e;
        st.heap.push(Reverse((now + st.remaining[eu], e)));
        v = if previous == NONE { NONE } else { g.right[previous as usize] };
    }
}

/// Split edge runs over the edge's jobs in order, then order pieces by virtual start.
fn runs_to_pieces(problem: &Problem, g: &Graph, jobs: &[u32], mut runs: Vec<Run>) -> Vec<(u64, Piece)> {
    runs.retain(|r| g.jobs_start[r.0 as usize] != NONE);
    runs.sort_unstable_by_key(|r| (r.0, r.1));
    let mut keyed: Vec<(u64, Piece)> = Vec::with_capacity(runs.len() + jobs.len());
    let mut i = 0;
    while i < runs.len() {
        let e = runs[i].0 as usize;
        let (mut job, end) = (g.jobs_start[e] as usize, g.jobs_end[e] as usize);
        let mut offset = 0u32;
        while i < runs.len() && runs[i].0 as usize == e {
            let (_, mut start, mut length) = runs[i];
            while length > 0 && job < end {
                let t = jobs[job];
                let words = problem.jobs[t as usize].words;
                let take = (length as u32).min(words - offset);
                keyed.push((start, Piece { transfer: t, offset_words: offset, words: take, send_cycle: 0, paired: false }));
                offset += take;
                start += take as u64;
                length -= take as u64;
                if offset == words {
                    job += 1;
                    offset = 0;
                }
            }
            i += 1;
        }
    }
    keyed
}

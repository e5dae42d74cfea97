//! Job coalescing: the schedulers work on jobs, and transfers that no schedule can tell apart
//! except by their words become one job.
//!
//! Transfers with the same source, the same ordinary receive ports (the same tiles in the same
//! order, hence the same delays) and the same pairing eligibility (hence the same paired ports)
//! occupy exactly the same ports per cycle: one row segment per transfer of a block sent to
//! the same tiles, home-tile weight multicasts above all. Such a group becomes one job whose
//! words are its members' words one after another, in request order; the schedulers' work
//! then scales with the groups, not the transfers. A paired group's members all have even
//! words, so every member boundary is even and a paired piece stays even once split.
//!
//! `expand` turns a schedule of the coalesced problem back into pieces of the request's
//! transfers: a piece `[offset, offset + words)` sent from cycle `s` becomes one piece per
//! member it overlaps, back to back (`s` plus the cycles of the words before it). The ports
//! every cycle occupies are unchanged, so the horizon and validity carry over exactly. The
//! bounds stay computed on the request's own problem.
//!
//! This module must not decide anything about schedules: it only regroups words.

use std::collections::BTreeMap;

use super::problem::{Job, Member, Port, Problem};
use super::timing;
use super::types::Piece;

/// The coalesced problem, or `None` when no two transfers share a job.
pub(crate) fn coalesce(problem: &Problem) -> Option<Problem> {
    let n = problem.jobs.len();
    // Groups are numbered in the order of their first member (a BTreeMap: no hash order).
    let mut groups: BTreeMap<(u32, bool, &[Port]), u32> = BTreeMap::new();
    let mut group_of = Vec::with_capacity(n);
    for (index, job) in problem.jobs.iter().enumerate() {
        let next = groups.len() as u32;
        let key = (job.source, job.paired.is_some(), problem.receive_ports(index, false));
        group_of.push(*groups.entry(key).or_insert(next));
    }
    let count = groups.len();
    drop(groups);
    if count == n {
        return None;
    }
    // Members grouped by job, in request order within each (a counting sort).
    let mut first = vec![0u32; count + 1];
    for &g in &group_of {
        first[g as usize + 1] += 1;
    }
    for g in 0..count {
        first[g + 1] += first[g];
    }
    let mut fill = first.clone();
    let mut order = vec![0u32; n];
    for (index, &g) in group_of.iter().enumerate() {
        order[fill[g as usize] as usize] = index as u32;
        fill[g as usize] += 1;
    }
    let mut jobs = Vec::with_capacity(count);
    let mut members = Vec::with_capacity(n);
    let mut ordinary_ports = Vec::new();
    let mut paired_ports = Vec::new();
    for g in 0..count {
        let (a, b) = (first[g] as usize, first[g + 1] as usize);
        let leader = &problem.jobs[order[a] as usize];
        let members_start = members.len() as u32;
        let mut words = 0u32;
        for &transfer in &order[a..b] {
            members.push(Member { transfer, start: words });
            // `prepare` keeps every port under 2^30 cycles, so a source's words fit.
            words += problem.jobs[transfer as usize].words;
        }
        let ordinary = copy_range(&problem.ordinary_ports, leader.ordinary, &mut ordinary_ports);
        let paired = leader.paired.map(|range| copy_range(&problem.paired_ports, range, &mut paired_ports));
        jobs.push(Job { source: leader.source, words, ordinary, paired, max_delay: leader.max_delay, members: (members_start, members.len() as u32) });
    }
    // A tile receives a group's job exactly when it receives each of its members, so tiles
    // with identical incoming sets stay identical, numbered in the same order: the receiver
    // classes do not change.
    Some(Problem {
        tiles: problem.tiles,
        jobs,
        ordinary_ports,
        paired_ports,
        receiver_class: problem.receiver_class.clone(),
        class_sizes: problem.class_sizes.clone(),
        members,
    })
}

fn copy_range(from: &[Port], (a, b): (u32, u32), to: &mut Vec<Port>) -> (u32, u32) {
    let start = to.len() as u32;
    to.extend_from_slice(&from[a as usize..b as usize]);
    (start, to.len() as u32)
}

/// Pieces of the coalesced `problem`'s jobs as pieces of the request's transfers (see the
/// module header), in canonical order.
pub(crate) fn expand(problem: &Problem, pieces: &[Piece]) -> Vec<Piece> {
    let mut out = Vec::with_capacity(pieces.len());
    for p in pieces {
        let job = p.transfer as usize;
        let members = problem.members_of(job);
        let end = p.offset_words + p.words;
        let mut i = members.partition_point(|m| m.start <= p.offset_words) - 1;
        let mut at = p.offset_words;
        while at < end {
            let member = members[i];
            let member_end = members.get(i + 1).map_or(problem.jobs[job].words, |m| m.start);
            let stop = end.min(member_end);
            let before = at - p.offset_words;
            let cycles_before = if p.paired { before / 2 } else { before };
            out.push(Piece { transfer: member.transfer, offset_words: at - member.start, words: stop - at, send_cycle: p.send_cycle + cycles_before, paired: p.paired });
            at = stop;
            i += 1;
        }
    }
    timing::sort_pieces(&mut out);
    out
}

//! Half-duplex tiles: a schedule in which some tiles never send and receive in one cycle.
//!
//! A tile cannot send from and receive into the same memory element in one cycle
//! (`elements.rs`). Placement keeps a phase's sending and receiving buffers in different
//! elements where tile memory leaves room; where it cannot, `select_finalist` names the tiles
//! (`PhaseRequest::half_duplex`) and their schedule keeps the two apart in time instead, so the
//! rule holds wherever the buffers land. The schedule stays address-free: it is a function of
//! the phase's pattern and those tiles.
//!
//! How: on each half-duplex tile, the pieces it receives while it sends, or those it sends
//! while it receives (whichever side moves fewer cycles), are taken out of their places and
//! scheduled again, in the schedule's order, at the earliest cycle where every port it
//! holds is free (a paired piece holds its partner's too) and every tile it touches does
//! nothing on its other port meanwhile: its source receives nothing while it sends, and each
//! destination sends nothing while it receives. So a moved piece can break the memory-element
//! rule nowhere, whatever the addresses; taking pieces out frees ports and adds no overlap. In
//! the dense gathers where this is needed there is seldom such a gap before the phase's end,
//! so a half-duplex tile's phase grows by about what it receives.

use super::types::{PhaseRequest, Piece, Schedule};
use crate::target::Target;

const SEND: usize = 0;
const RECEIVE: usize = 1;

/// Sorted intervals merged where they overlap or touch.
fn merged(mut list: Vec<(u32, u32)>) -> Vec<(u32, u32)> {
    list.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(list.len());
    for (s, e) in list {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Where `[start, end)` meets an interval of `list` (disjoint, sorted), the end of the first
/// it meets; None when it is free.
fn busy_until(list: &[(u32, u32)], start: u32, end: u32) -> Option<u32> {
    let i = list.partition_point(|&(_, e)| e <= start);
    list.get(i).filter(|&&(s, _)| s < end).map(|&(_, e)| e)
}

/// `interval` added to `list` (disjoint, sorted), merging.
fn insert(list: &mut Vec<(u32, u32)>, interval: (u32, u32)) {
    let i = list.partition_point(|&(_, e)| e < interval.0);
    let mut j = i;
    let (mut s, mut e) = interval;
    while j < list.len() && list[j].0 <= e {
        s = s.min(list[j].0);
        e = e.max(list[j].1);
        j += 1;
    }
    list.splice(i..j, [(s, e)]);
}

/// `schedule` with the pieces that overlap a send with a receive on a half-duplex tile moved
/// (see the module header), and how many pieces moved. A phase without half-duplex
/// tiles, or whose half-duplex tiles never send and receive at once, keeps its schedule.
pub fn half_duplex(target: &Target, phase: &PhaseRequest, schedule: Schedule) -> (Schedule, usize) {
    let tiles = target.chip.tiles as usize;
    let mut half = vec![false; tiles];
    for &t in &phase.half_duplex {
        if (t as usize) < tiles {
            half[t as usize] = true;
        }
    }
    if !half.iter().any(|&h| h) {
        return (schedule, 0);
    }
    let delay = |s: u32, d: u32| target.delay(s.min(target.chip.tiles - 1), d.min(target.chip.tiles - 1));
    // Each half-duplex tile's send and receive intervals [start, end), sorted and merged.
    let mut busy: Vec<[Vec<(u32, u32)>; 2]> = vec![[Vec::new(), Vec::new()]; tiles];
    for p in schedule.pieces.iter() {
        let Some(t) = phase.transfers.get(p.transfer as usize) else { continue };
        if (t.source as usize) < tiles && half[t.source as usize] {
            busy[t.source as usize][SEND].push((p.send_cycle, p.send_cycle + p.cycles()));
        }
        for d in t.destinations.iter().filter(|d| (d.tile as usize) < tiles && half[d.tile as usize]) {
            let at = p.send_cycle + delay(t.source, d.tile);
            busy[d.tile as usize][RECEIVE].push((at, at + p.cycles()));
        }
    }
    for tile in busy.iter_mut() {
        for list in tile.iter_mut().filter(|l| !l.is_empty()) {
            *list = merged(std::mem::take(list));
        }
    }
    let overlaps = |list: &[(u32, u32)], start: u32, end: u32| busy_until(list, start, end).is_some();
    // Per piece: whether it overlaps, on a half-duplex tile, that tile's other port as the
    // tile's sender (its source) and as a receiver (each destination).
    let sent_over = |p: &Piece| -> Option<usize> {
        let t = phase.transfers.get(p.transfer as usize)?;
        let s = t.source as usize;
        (s < tiles && half[s] && overlaps(&busy[s][RECEIVE], p.send_cycle, p.send_cycle + p.cycles())).then_some(s)
    };
    let received_over = |p: &Piece| -> Vec<usize> {
        let Some(t) = phase.transfers.get(p.transfer as usize) else { return Vec::new() };
        t.destinations
            .iter()
            .filter(|d| (d.tile as usize) < tiles && half[d.tile as usize])
            .filter(|d| {
                let at = p.send_cycle + delay(t.source, d.tile);
                overlaps(&busy[d.tile as usize][SEND], at, at + p.cycles())
            })
            .map(|d| d.tile as usize)
            .collect()
    };
    let overlapping: Vec<(Option<usize>, Vec<usize>)> = schedule.pieces.iter().map(|p| (sent_over(p), received_over(p))).collect();
    // Each half-duplex tile gives up the side that moves fewer cycles: the pieces it sends
    // while receiving, or those it receives while sending.
    let mut cost = vec![[0u64; 2]; tiles];
    for (p, (sent, received)) in schedule.pieces.iter().zip(&overlapping) {
        if let Some(s) = sent {
            cost[*s][SEND] += p.cycles() as u64;
        }
        for &d in received {
            cost[d][RECEIVE] += p.cycles() as u64;
        }
    }
    let gives_up = |tile: usize| if cost[tile][SEND] < cost[tile][RECEIVE] { SEND } else { RECEIVE };
    let moves: Vec<bool> = overlapping.iter().map(|(sent, received)| sent.is_some_and(|s| gives_up(s) == SEND) || received.iter().any(|&d| gives_up(d) == RECEIVE)).collect();
    let moved = moves.iter().filter(|&&m| m).count();
    if moved == 0 {
        return (schedule, 0);
    }
    // (tile, port, cycles after the send) of every port a piece holds: its source's send port
    // and each destination's receive port, and a paired piece its partners' too; with
    // `idle_other`, also the other port of its source and of each destination.
    let held = |t: &super::types::Transfer, p: &Piece, idle_other: bool| -> Vec<(usize, usize, u32)> {
        let mut out = Vec::new();
        let mut add = |tile: u32, port: usize, at: u32| {
            if (tile as usize) < tiles {
                out.push((tile as usize, port, at));
            }
        };
        let partners = |tile: u32| [Some(tile), p.paired.then_some(tile ^ 1)].into_iter().flatten();
        for tile in partners(t.source) {
            add(tile, SEND, 0);
        }
        if idle_other {
            add(t.source, RECEIVE, 0);
        }
        for d in &t.destinations {
            let at = delay(t.source, d.tile);
            for tile in partners(d.tile) {
                add(tile, RECEIVE, at);
            }
            if idle_other {
                add(d.tile, SEND, at);
            }
        }
        out
    };
    // The ports the kept pieces hold, per tile, merged into disjoint intervals.
    let mut ports: Vec<[Vec<(u32, u32)>; 2]> = vec![[Vec::new(), Vec::new()]; tiles];
    let mut pieces: Vec<Piece> = Vec::with_capacity(schedule.pieces.len());
    for (p, _) in schedule.pieces.iter().zip(&moves).filter(|(_, &m)| !m) {
        if let Some(t) = phase.transfers.get(p.transfer as usize) {
            for (tile, port, at) in held(t, p, false) {
                ports[tile][port].push((p.send_cycle + at, p.send_cycle + at + p.cycles()));
            }
        }
        pieces.push(*p);
    }
    for tile in ports.iter_mut() {
        for list in tile.iter_mut() {
            *list = merged(std::mem::take(list));
        }
    }
    // Each moved piece, in the schedule's order, at the earliest cycle where every port it
    // holds is free and every tile it touches is doing nothing else on its other port: the
    // source receives nothing while it sends, a destination sends nothing while it receives.
    // So a moved piece never overlaps a send with a receive on one tile, whatever the
    // addresses, and no port is held twice.
    let mut later: Vec<Piece> = Vec::with_capacity(moved);
    for (p, _) in schedule.pieces.iter().zip(&moves).filter(|(_, &m)| m) {
        let t = &phase.transfers[p.transfer as usize];
        let n = p.cycles();
        let needs = held(t, p, true);
        let mut cycle = 0u32;
        'search: loop {
            for &(tile, port, at) in &needs {
                if let Some(free) = busy_until(&ports[tile][port], cycle + at, cycle + at + n) {
                    cycle = free - at;
                    continue 'search;
                }
            }
            break;
        }
        let placed = Piece { send_cycle: cycle, ..*p };
        for &(tile, port, at) in &needs {
            insert(&mut ports[tile][port], (cycle + at, cycle + at + n));
        }
        later.push(placed);
    }
    pieces.extend(later);
    pieces.sort_unstable_by_key(|p| (p.send_cycle, p.transfer, p.offset_words));
    let horizon = pieces
        .iter()
        .filter_map(|p| {
            let t = phase.transfers.get(p.transfer as usize)?;
            t.destinations.iter().map(|d| p.send_cycle + delay(t.source, d.tile) + p.cycles()).max()
        })
        .max()
        .unwrap_or(0);
    (Schedule { pieces: std::sync::Arc::new(pieces), horizon, ..schedule }, moved)
}

//! The checked, normalised form of a phase request that every scheduler works on: per transfer,
//! its source, words, receive ports with their route delays, and whether it may go paired.
//!
//! This is the only place that rejects malformed requests; the schedulers trust a `Problem`.
//! It must not look at addresses beyond alignment and overlap checks: schedules are
//! address-free so that they survive relocation.

use std::collections::BTreeMap;

use crate::hash::{Digest, KeyHasher};
use crate::target::Target;

use super::types::{ExchangeError, PhaseRequest};

/// A receive port a piece occupies and the delay after which the data reaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Port {
    pub tile: u32,
    pub delay: u32,
}

#[derive(Clone, Debug)]
pub(crate) struct Job {
    pub source: u32,
    pub words: u32,
    /// Range of `Problem::ordinary_ports`: the destinations themselves.
    pub ordinary: (u32, u32),
    /// Range of `Problem::paired_ports` (destinations and their partners, once each), when
    /// the transfer may move paired: even words, every address 8-byte aligned, and a partner
    /// that is also a destination hearing the words at the same cycles.
    pub paired: Option<(u32, u32)>,
    /// Largest delay to any destination: when the transfer's last word has landed everywhere.
    pub max_delay: u32,
    /// Range of `Problem::members`: the request's transfers this job moves, one after another
    /// (one member, itself, unless the problem was coalesced; see `coalesce.rs`).
    pub members: (u32, u32),
}

/// A transfer of the request inside a job: words `start..` of the job are its words `0..`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Member {
    pub transfer: u32,
    pub start: u32,
}

pub(crate) struct Problem {
    pub tiles: u32,
    pub jobs: Vec<Job>,
    pub ordinary_ports: Vec<Port>,
    pub paired_ports: Vec<Port>,
    /// Receiver class of each tile: tiles with identical incoming transfer sets share one.
    pub receiver_class: Vec<u32>,
    pub class_sizes: Vec<u32>,
    /// The members of every job, each job's in request order.
    pub members: Vec<Member>,
}

impl Problem {
    pub fn receive_ports(&self, job: usize, paired: bool) -> &[Port] {
        let j = &self.jobs[job];
        match (paired, j.paired) {
            (true, Some((a, b))) => &self.paired_ports[a as usize..b as usize],
            _ => &self.ordinary_ports[j.ordinary.0 as usize..j.ordinary.1 as usize],
        }
    }

    /// Where `receive_ports(job, paired)` lies: (in `paired_ports`, start, end).
    pub fn receive_port_range(&self, job: usize, paired: bool) -> (bool, u32, u32) {
        let j = &self.jobs[job];
        match (paired, j.paired) {
            (true, Some((a, b))) => (true, a, b),
            _ => (false, j.ordinary.0, j.ordinary.1),
        }
    }

    /// The ports of a range from `receive_port_range`.
    pub fn ports_in(&self, paired_list: bool, start: u32, end: u32) -> &[Port] {
        let list = if paired_list { &self.paired_ports } else { &self.ordinary_ports };
        &list[start as usize..end as usize]
    }

    pub fn members_of(&self, job: usize) -> &[Member] {
        let (a, b) = self.jobs[job].members;
        &self.members[a as usize..b as usize]
    }

    /// Where a chunk of at most `chunk` words from word `offset` of `job` ends: at the last
    /// member boundary within the chunk, or after `chunk` words when the member at `offset`
    /// alone runs past it (so that chunks cut members only where they must).
    pub fn chunk_end(&self, job: usize, offset: u32, chunk: u32) -> u32 {
        let words = self.jobs[job].words;
        let limit = offset.saturating_add(chunk);
        if limit >= words {
            return words;
        }
        let members = self.members_of(job);
        let boundary = members[members.partition_point(|m| m.start <= limit) - 1].start;
        if boundary > offset {
            boundary
        } else {
            limit
        }
    }

    pub fn eligible(&self, job: usize) -> bool {
        self.jobs[job].paired.is_some()
    }

    /// Largest number of destination tiles sharing one identical incoming transfer set.
    pub fn maximum_identical_destinations(&self) -> u32 {
        self.class_sizes.iter().copied().max().unwrap_or(0)
    }

    /// Whether every transfer goes to exactly one receiver class, so that merging identical
    /// receivers leaves a bipartite (sender, class) graph.
    pub fn is_bipartite(&self) -> bool {
        self.jobs.iter().all(|j| {
            let ports = &self.ordinary_ports[j.ordinary.0 as usize..j.ordinary.1 as usize];
            let class = self.receiver_class[ports[0].tile as usize];
            ports.iter().all(|p| self.receiver_class[p.tile as usize] == class)
                && ports.len() as u32 == self.class_sizes[class as usize]
        })
    }

    /// Largest minus smallest delay over all (source, destination) pairs of the phase.
    pub fn delay_spread(&self) -> u32 {
        let delays = self.ordinary_ports.iter().map(|p| p.delay);
        delays.clone().max().unwrap_or(0) - delays.min().unwrap_or(0)
    }

    pub fn eligible_count(&self) -> usize {
        self.jobs.iter().filter(|j| j.paired.is_some()).count()
    }
}

/// Largest number of words one port may carry in a phase (cycles stay far from overflow).
const MAXIMUM_PORT_CYCLES: u64 = 1 << 30;

/// Check a request and build its `Problem`; the error names the first bad transfer.
pub(crate) fn prepare(target: &Target, phase: &PhaseRequest) -> Result<Problem, ExchangeError> {
    prepare_with(target, phase, true)
}

/// `prepare` without the receiver classes (left empty): the same checks and errors, for a
/// cached schedule's fit check (`lower::check_fits` reads only the jobs and their pairing).
pub(crate) fn prepare_for_fit(target: &Target, phase: &PhaseRequest) -> Result<Problem, ExchangeError> {
    prepare_with(target, phase, false)
}

fn prepare_with(target: &Target, phase: &PhaseRequest, classes: bool) -> Result<Problem, ExchangeError> {
    let tiles = target.chip.tiles;
    let bad = |transfer: usize, message: String| ExchangeError::Malformed { phase: phase.index, transfer: transfer as u32, message };
    let mut jobs = Vec::with_capacity(phase.transfers.len());
    let mut ordinary_ports = Vec::new();
    let mut paired_ports = Vec::new();
    let mut writes: Vec<(u32, u32, u32, u32)> = Vec::new();
    let mut seen = vec![u32::MAX; tiles as usize];
    // Per tile: (transfer, position in `paired_ports`) of its paired port, for the transfer
    // being prepared.
    let mut listed = vec![(u32::MAX, 0u32); tiles as usize];
    // Port loads, so that no cycle count can overflow 32 bits anywhere downstream.
    let mut load = vec![0u64; 2 * tiles as usize];
    for (index, t) in phase.transfers.iter().enumerate() {
        if t.source >= tiles {
            return Err(bad(index, format!("source tile {} is outside the chip ({} tiles)", t.source, tiles)));
        }
        if t.words == 0 {
            return Err(bad(index, "has zero words".into()));
        }
        if t.destinations.is_empty() {
            return Err(bad(index, "has no destination".into()));
        }
        let bytes = t.words as u64 * 4;
        if t.source_address % 4 != 0 || t.source_address as u64 + bytes > u32::MAX as u64 {
            return Err(bad(index, format!("source address {:#x} is not word aligned or overflows", t.source_address)));
        }
        load[2 * t.source as usize] += t.words as u64;
        let start = ordinary_ports.len() as u32;
        let mut aligned = t.source_address % 8 == 0 && t.words % 2 == 0;
        let mut max_delay = 0;
        for d in &t.destinations {
            if d.tile >= tiles {
                return Err(bad(index, format!("destination tile {} is outside the chip ({} tiles)", d.tile, tiles)));
            }
            if d.tile == t.source {
                return Err(bad(index, format!("destination tile {} is its own source", d.tile)));
            }
            if seen[d.tile as usize] == index as u32 {
                return Err(bad(index, format!("destination tile {} appears twice", d.tile)));
            }
            seen[d.tile as usize] = index as u32;
            if d.address % 4 != 0 || d.address as u64 + bytes > u32::MAX as u64 {
                return Err(bad(index, format!("destination address {:#x} on tile {} is not word aligned or overflows", d.address, d.tile)));
            }
            aligned &= d.address % 8 == 0;
            load[2 * d.tile as usize + 1] += t.words as u64;
            if load[2 * d.tile as usize + 1].max(load[2 * t.source as usize]) > MAXIMUM_PORT_CYCLES {
                return Err(bad(index, format!("makes a port of tile {} or {} busy for more than {MAXIMUM_PORT_CYCLES} cycles", t.source, d.tile)));
            }
            let delay = target.delay(t.source, d.tile);
            max_delay = max_delay.max(delay);
            ordinary_ports.push(Port { tile: d.tile, delay });
            writes.push((d.tile, d.address, d.address + t.words * 4, index as u32));
        }
        let end = ordinary_ports.len() as u32;
        let paired = if aligned && target.partner(t.source) < tiles { paired_ports_of(target, &ordinary_ports[start as usize..], &mut paired_ports, &mut listed, index as u32) } else { None };
        jobs.push(Job { source: t.source, words: t.words, ordinary: (start, end), paired, max_delay, members: (index as u32, index as u32 + 1) });
    }
    // Two transfers writing the same words of one tile would make the phase's result depend
    // on the schedule: reject them rather than pick a winner. The writes are bucketed by tile
    // (a counting sort) and sorted one tile at a time: the same order as sorting them all,
    // at a fraction of the cost on phases of a million writes. The stable sort merges the
    // ascending runs a tile's writes come in (transfers in address order); the writes are
    // distinct, so the order is the unstable sort's.
    let mut first = vec![0usize; tiles as usize + 1];
    for w in &writes {
        first[w.0 as usize + 1] += 1;
    }
    for tile in 0..tiles as usize {
        first[tile + 1] += first[tile];
    }
    let mut fill = first.clone();
    let mut by_tile = vec![(0u32, 0u32, 0u32); writes.len()];
    for &(tile, address, end, transfer) in &writes {
        by_tile[fill[tile as usize]] = (address, end, transfer);
        fill[tile as usize] += 1;
    }
    drop(writes);
    for tile in 0..tiles as usize {
        let list = &mut by_tile[first[tile]..first[tile + 1]];
        list.sort();
        for w in list.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(bad(w[1].2 as usize, format!("writes addresses {:#x}.. on tile {} that transfer {} also writes", w[1].0, tile, w[0].2)));
            }
        }
    }
    let (receiver_class, class_sizes) = if classes { receiver_classes(tiles, &jobs, &ordinary_ports) } else { (Vec::new(), Vec::new()) };
    let members = (0..jobs.len() as u32).map(|transfer| Member { transfer, start: 0 }).collect();
    Ok(Problem { tiles, jobs, ordinary_ports, paired_ports, receiver_class, class_sizes, members })
}

/// The receive ports of a paired piece: each destination and its partner, at the destination's
/// delay. A partner that is itself a destination shares the port only at the same delay.
///
/// `listed` (one slot per tile) remembers where this transfer's ports are in `out`, so that a
/// transfer with many destinations finds a tile's port without a search.
fn paired_ports_of(target: &Target, ports: &[Port], out: &mut Vec<Port>, listed: &mut [(u32, u32)], transfer: u32) -> Option<(u32, u32)> {
    let start = out.len();
    for p in ports {
        for tile in [p.tile, target.partner(p.tile)] {
            if tile >= target.chip.tiles {
                out.truncate(start);
                return None;
            }
            let slot = &mut listed[tile as usize];
            if slot.0 == transfer {
                if out[slot.1 as usize].delay != p.delay {
                    out.truncate(start);
                    return None;
                }
            } else {
                *slot = (transfer, out.len() as u32);
                out.push(Port { tile, delay: p.delay });
            }
        }
    }
    Some((start as u32, out.len() as u32))
}

fn receiver_classes(tiles: u32, jobs: &[Job], ports: &[Port]) -> (Vec<u32>, Vec<u32>) {
    let mut incoming: Vec<Vec<u32>> = vec![Vec::new(); tiles as usize];
    for (index, job) in jobs.iter().enumerate() {
        for p in &ports[job.ordinary.0 as usize..job.ordinary.1 as usize] {
            incoming[p.tile as usize].push(index as u32);
        }
    }
    // A BTreeMap keeps class numbering independent of hashing: classes are numbered in the
    // order of their first tile.
    let mut ids: BTreeMap<&[u32], u32> = BTreeMap::new();
    let mut class = vec![u32::MAX; tiles as usize];
    let mut sizes = Vec::new();
    for tile in 0..tiles as usize {
        if incoming[tile].is_empty() {
            continue;
        }
        let next = sizes.len() as u32;
        let id = *ids.entry(incoming[tile].as_slice()).or_insert(next);
        if id == next {
            sizes.push(0);
        }
        sizes[id as usize] += 1;
        class[tile] = id;
    }
    (class, sizes)
}

/// Alignment class of a transfer for pairing: 0 when every address is 8-byte aligned, 1 when
/// every address is 4 mod 8, 2 when they differ.
pub(crate) fn alignment_class(phase: &PhaseRequest, transfer: usize) -> u8 {
    let t = &phase.transfers[transfer];
    alignment_class_of(t.source_address, t.destinations.iter().map(|d| d.address))
}

/// `alignment_class` of a transfer from `source` to `destinations` (addresses).
pub fn alignment_class_of(source: u32, mut destinations: impl Iterator<Item = u32>) -> u8 {
    let first = source % 8;
    if destinations.any(|d| d % 8 != first) {
        2
    } else {
        (first / 4) as u8
    }
}

/// Address-free key of a phase: tiles, words and pairing alignment class of every transfer.
/// Two phases with equal digests accept the same schedules.
pub fn pattern_digest(phase: &PhaseRequest) -> Digest {
    let mut h = KeyHasher::new(PATTERN_DOMAIN);
    h.add(&(phase.transfers.len() as u64));
    for (index, t) in phase.transfers.iter().enumerate() {
        h.add(&t.source).add(&t.words).add(&alignment_class(phase, index)).add(&(t.destinations.len() as u64));
        for d in &t.destinations {
            h.add(&d.tile);
        }
    }
    hash_half_duplex(&mut h, &phase.half_duplex);
    h.finish()
}

/// Key domain of `pattern_digest` (also streamed from a program by `pipeline::LazyRequests`).
pub const PATTERN_DOMAIN: &str = "ipuq exchange pattern v1";

/// A phase's half-duplex tiles as `pattern_digest` hashes them: they change the schedule, and
/// a phase without them keeps its digest.
pub fn hash_half_duplex(h: &mut KeyHasher, tiles: &[u32]) {
    if !tiles.is_empty() {
        h.add("half duplex").add(&(tiles.len() as u64));
        for t in tiles {
            h.add(t);
        }
    }
}

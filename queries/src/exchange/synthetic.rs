//! Synthetic exchange phases with the shapes and sizes of the seed's (GEMM-like gathers,
//! all-to-all reductions inside small groups, multicast broadcasts, random mixes), for tests,
//! benches and the lead's reports.
//!
//! Everything is deterministic from a seed (splitmix64, no external RNG). Addresses are laid
//! out without overlap, 8-byte aligned unless asked otherwise, so pairing is possible. This
//! module must not be used by the scheduler itself.

use super::types::{Destination, PhaseRequest, Transfer};

/// Sebastiano Vigna's splitmix64: tiny, fast, and good enough for test data.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, n); 0 when n is 0.
    pub fn below(&mut self, n: u32) -> u32 {
        if n == 0 {
            0
        } else {
            (((self.next_u64() >> 32) * n as u64) >> 32) as u32
        }
    }
    /// Uniform in [low, high].
    pub fn between(&mut self, low: u32, high: u32) -> u32 {
        low + self.below(high - low + 1)
    }
    pub fn chance(&mut self, percent: u32) -> bool {
        self.below(100) < percent
    }
}

/// Hands out non-overlapping addresses per tile, as a storage plan would.
struct Layout {
    next_source: Vec<u32>,
    next_destination: Vec<u32>,
    misalign_percent: u32,
}

const SOURCE_BASE: u32 = 0x4C000;
const DESTINATION_BASE: u32 = 0x80000;

impl Layout {
    fn new(tiles: u32, misalign_percent: u32) -> Layout {
        Layout { next_source: vec![SOURCE_BASE; tiles as usize], next_destination: vec![DESTINATION_BASE; tiles as usize], misalign_percent }
    }
    fn take(slot: &mut u32, words: u32, rng: &mut SplitMix64, misalign: u32) -> u32 {
        let skew = if rng.chance(misalign) { 4 } else { 0 };
        let address = *slot + skew;
        *slot = (address + words * 4 + 7) & !7;
        address
    }
    fn transfer(&mut self, rng: &mut SplitMix64, source: u32, words: u32, destinations: &[u32]) -> Transfer {
        let m = self.misalign_percent;
        let source_address = Layout::take(&mut self.next_source[source as usize], words, rng, m);
        let destinations = destinations
            .iter()
            .map(|&tile| Destination { tile, address: Layout::take(&mut self.next_destination[tile as usize], words, rng, m) })
            .collect();
        Transfer { source, source_address, words, destinations }
    }
}

fn even(words: u32) -> u32 {
    (words + 1) & !1
}

/// GEMM-like gather: every destination tile receives `transfers / tiles` (±1) row blocks of
/// `low..=high` words from distinct sources; round r's sources are a fresh permutation, so
/// every tile also sends about as many blocks as it receives.
pub fn gemm_gather(tiles: u32, transfers: u32, low: u32, high: u32, seed: u64) -> PhaseRequest {
    let mut rng = SplitMix64(seed);
    let mut layout = Layout::new(tiles, 0);
    let rounds = transfers.div_ceil(tiles);
    let mut out = Vec::with_capacity(transfers as usize);
    let mut offsets: Vec<u32> = Vec::new();
    for round in 0..rounds {
        // A random nonzero rotation per round keeps sources distinct from destinations.
        let shift = loop {
            let s = rng.below(tiles);
            if s != 0 && !offsets.contains(&s) {
                break s;
            }
        };
        offsets.push(shift);
        let count = if round + 1 == rounds { transfers - round * tiles } else { tiles };
        for d in 0..count {
            let words = even(rng.between(low, high));
            out.push(layout.transfer(&mut rng, (d + shift) % tiles, words, &[d]));
        }
    }
    PhaseRequest { index: 1, transfers: out, half_duplex: Vec::new() }
}

/// Reductions: all-to-all exchange of partials inside groups of 4..=15 consecutive tiles at
/// random positions, `low..=high` words each, until `transfers` transfers exist.
pub fn reduction_groups(tiles: u32, transfers: u32, low: u32, high: u32, seed: u64) -> PhaseRequest {
    let mut rng = SplitMix64(seed);
    let mut layout = Layout::new(tiles, 0);
    let mut out = Vec::with_capacity(transfers as usize);
    let mut next_start = 0u32;
    while (out.len() as u32) < transfers {
        let size = rng.between(4, 15).min(tiles);
        let start = next_start % tiles;
        next_start = next_start + size + rng.below(3);
        let members: Vec<u32> = (0..size).map(|i| (start + i) % tiles).collect();
        let words = even(rng.between(low, high));
        for &s in &members {
            for &d in &members {
                if s != d && (out.len() as u32) < transfers {
                    out.push(layout.transfer(&mut rng, s, words, &[d]));
                }
            }
        }
    }
    PhaseRequest { index: 3, transfers: out, half_duplex: Vec::new() }
}

/// Multicast broadcasts: `blocks` blocks, each from a random source to a contiguous range of
/// `fanout` tiles (intervals, as a broadcast axis gives).
pub fn broadcast(tiles: u32, blocks: u32, fanout: u32, words: u32, seed: u64) -> PhaseRequest {
    let mut rng = SplitMix64(seed);
    let mut layout = Layout::new(tiles, 0);
    let fanout = fanout.clamp(1, tiles - 1);
    let out = (0..blocks)
        .map(|_| {
            let source = rng.below(tiles);
            let start = rng.below(tiles);
            let destinations: Vec<u32> = (0..tiles).map(|i| (start + i) % tiles).filter(|&d| d != source).take(fanout as usize).collect();
            layout.transfer(&mut rng, source, even(words), &destinations)
        })
        .collect();
    PhaseRequest { index: 2, transfers: out, half_duplex: Vec::new() }
}

/// The large seed phase: many small gathers (`low..=high` words) plus a few big row blocks
/// of up to `big` words into a handful of hot tiles, as an attention projection makes.
pub fn mixed_large(tiles: u32, transfers: u32, low: u32, high: u32, big: u32, seed: u64) -> PhaseRequest {
    let mut phase = gemm_gather(tiles, transfers, low, high, seed);
    let mut rng = SplitMix64(seed ^ 0x5EED);
    let hot = 8.min(tiles);
    for (i, t) in phase.transfers.iter_mut().enumerate().take(hot as usize * 4) {
        // Grow a few blocks in place; addresses move to fresh space past everything else.
        t.words = even(rng.between(big / 2, big));
        t.source_address = 0xB0000 + (i as u32 % 4) * 0x4000;
        for d in t.destinations.iter_mut() {
            d.address = 0xC0000 + (i as u32 % 4) * 0x4000;
        }
    }
    phase.index = 6;
    phase
}

/// Random phase for property tests: sizes `1..=max_words`, some multicast, some misaligned.
pub fn random_phase(rng: &mut SplitMix64, tiles: u32, transfers: u32, max_words: u32, multicast_percent: u32, misalign_percent: u32) -> PhaseRequest {
    let mut layout = Layout::new(tiles, misalign_percent);
    let out = (0..transfers)
        .map(|_| {
            let source = rng.below(tiles);
            let words = rng.between(1, max_words);
            let fanout = if rng.chance(multicast_percent) { rng.between(2, 6.min(tiles - 1)) } else { 1 };
            let mut destinations: Vec<u32> = Vec::new();
            while (destinations.len() as u32) < fanout {
                let d = rng.below(tiles);
                if d != source && !destinations.contains(&d) {
                    destinations.push(d);
                }
            }
            layout.transfer(rng, source, words, &destinations)
        })
        .collect();
    PhaseRequest { index: 0, transfers: out, half_duplex: Vec::new() }
}

/// The three seed-sized phases: (name, phase) for 15,064, 24,760 and 84,859 transfers.
pub fn seed_sized(tiles: u32) -> Vec<(&'static str, PhaseRequest)> {
    vec![
        ("mlp-gather-15064", gemm_gather(tiles, 15_064, 200, 360, 1)),
        ("reduction-24760", reduction_groups(tiles, 24_760, 90, 200, 3)),
        ("mixed-84859", mixed_large(tiles, 84_859, 40, 260, 4_440, 6)),
    ]
}

//! Host traffic: each weight byte and, where the exchange is cheaper than the host link, each
//! input byte crosses the host link once and is replicated on the device by exchange.
//!
//! The lowering writes host tensors straight into the layout their consumers want, replicas
//! included (a weight block that 23 tiles use is streamed 23 times). This post-pass on the
//! lowered program finds host segments that carry the same elements to several tiles, keeps one
//! host write per group (the home segment) and moves the other copies as exchange transfers
//! from the home buffer:
//! - **weights**: one exchange phase per weight tensor, run by the `initialize` call after the
//!   host writes (load time, like the seed's 14 initialize phases); `Lowered::initialize` lists
//!   them. They are not steps of `run`, so the run's cycles do not change.
//! - **inputs** stream on every inference, so their replication is one exchange phase at the
//!   start of `run` (step 0; every later step index moves by one), taken only when the phase's
//!   endpoint bound (plus sync) is fewer cycles than the saved bytes take on the host link at
//!   the target's `host.link_bytes_per_second` and clock.
//!
//! Buffers are grouped by the shape of their share of the tensor (the same segments at the same
//! offsets from the first byte): such buffers hold the same bytes in the same layout, and each
//! maximal contiguous byte run moves as one multicast transfer. A group qualifies when its runs
//! start on word boundaries and padding a run to whole words stays inside the buffer and short
//! of the next run; a second buffer on one tile stays a host write. Homes are spread over tiles
//! (least words sent so far by the tensors before; then, for a weight, the tile nearest the
//! middle of its group's tiles; then the lowest tile), so no tile's send port carries a whole
//! tensor and table entries spread over tiles; a weight whose groups (shapes and member tiles)
//! equal an earlier weight's takes that weight's homes, so repeated layers' equal weights get
//! equal phases. Deterministic: groups in shape order.

use std::collections::BTreeMap;

use super::{LHostTensor, LSegment, LStep, Lowered, Transfer};
use crate::cost;
use crate::package::HostRole;
use crate::target::Target;

/// What replicating one tensor would do: the segments left to the host, the transfers, and
/// per-tile words sent and received.
struct Plan {
    host_segments: Vec<LSegment>,
    transfers: Vec<Transfer>,
    saved_bytes: u64,
    bound_words: u64,
}

/// Apply the pass (see the module header). Returns the program unchanged when nothing repeats.
pub fn replicate(l: Lowered, target: &Target) -> Lowered {
    replicate_in_range(l, target).0
}

/// The pass with every input that repeats replicated by exchange, whatever the host link
/// rate: the most exchange phases and table entries the pass can give a program (each input
/// taken adds its transfers, and removes none), for `lower_mid`'s table screen, which does
/// not read the link rate.
pub fn replicate_every_input(l: Lowered, target: &Target) -> Lowered {
    replicate_with(l, target, true).0
}

/// Host link rates (bytes per second, at least 1) for which every decision of one or more
/// host passes comes out the same: a pass reads the rate only through them (`take` below).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateRange {
    /// The lowest and highest rate, inclusive.
    pub low: u64,
    pub high: u64,
}

impl RateRange {
    pub const ALL: RateRange = RateRange { low: 1, high: u64::MAX };

    /// Whether the rate (as the pass reads it: at least 1) lies in the range.
    pub fn contains(&self, rate: u64) -> bool {
        (self.low..=self.high).contains(&rate.max(1))
    }

    /// The rates in both ranges.
    pub fn intersect(&self, other: &RateRange) -> RateRange {
        RateRange { low: self.low.max(other.low), high: self.high.min(other.high) }
    }

    /// The rates at which `host_cycles(bytes) > exchange_cycles` decides as it did: with
    /// N = bytes * clock and E the exchange cycles, floor(N / r) > E holds exactly for
    /// r <= floor(N / (E + 1)) (and never when E is the largest count).
    fn of_decision(target: &Target, bytes: u64, exchange: u64, taken: bool) -> RateRange {
        let Some(e1) = exchange.checked_add(1) else { return RateRange::ALL };
        let threshold = (bytes as u128 * target.chip.clock_hz as u128 / e1 as u128).min(u64::MAX as u128) as u64;
        if taken {
            RateRange { low: 1, high: threshold }
        } else {
            RateRange { low: threshold.saturating_add(1), high: u64::MAX }
        }
    }
}

/// The pass, with the range of host link rates over which it gives this same program (the
/// rate decides only whether an input's copies move by exchange): a result computed at one
/// rate holds for every rate of the range (`pipeline::selection` caches so).
pub fn replicate_in_range(l: Lowered, target: &Target) -> (Lowered, RateRange) {
    replicate_with(l, target, false)
}

fn replicate_with(mut l: Lowered, target: &Target, every_input: bool) -> (Lowered, RateRange) {
    let mut range = RateRange::ALL;
    let mut input_phase: Vec<Transfer> = Vec::new();
    let mut sends = vec![0u64; l.tiles as usize];
    // The homes each weight's groups took, by the groups' shapes and member tiles
    // (`Signature`): a weight equal to an earlier one (the same weight of a repeated layer or
    // block) takes the same homes, so their phases are equal.
    let mut homes: Homes = BTreeMap::new();
    for i in 0..l.inputs.len() {
        // A weight is always taken: planned once, its homes committed. An input (which reads
        // no weight's homes) is planned on a copy of the sends, then again if taken.
        let weight = l.inputs[i].role == HostRole::Weight;
        let plan = if weight { plan_tensor(&l, &l.inputs[i], &mut sends, &mut homes) } else { plan_tensor(&l, &l.inputs[i], &mut sends.clone(), &mut Homes::new()) };
        if plan.transfers.is_empty() {
            continue;
        }
        let take = match l.inputs[i].role {
            HostRole::Weight => true,
            _ if every_input => true,
            _ => {
                let exchange = exchange_cycles(target, plan.bound_words);
                let take = host_cycles(target, plan.saved_bytes) > exchange;
                range = range.intersect(&RateRange::of_decision(target, plan.saved_bytes, exchange, take));
                take
            }
        };
        if !take {
            continue;
        }
        // Commit the home choices' send load for the next tensors.
        let committed = if weight { plan } else { plan_tensor(&l, &l.inputs[i], &mut sends, &mut homes) };
        let tensor = &mut l.inputs[i];
        tensor.segments = committed.host_segments;
        if tensor.role == HostRole::Weight {
            l.initialize.push(l.phases.len() as u32);
            l.phases.push(std::sync::Arc::new(committed.transfers));
        } else {
            input_phase.extend(committed.transfers);
        }
    }
    if !input_phase.is_empty() {
        let phase = l.phases.len() as u32;
        l.phases.push(std::sync::Arc::new(input_phase));
        shift_steps(&mut l);
        l.steps.insert(0, LStep::Exchange(phase));
    }
    (l, range)
}

/// Cycles the host link needs for `bytes` at the target's rate.
fn host_cycles(target: &Target, bytes: u64) -> u64 {
    let rate = target.host.link_bytes_per_second.max(1) as u128;
    (bytes as u128 * target.chip.clock_hz as u128 / rate).min(u64::MAX as u128) as u64
}

/// Cycles of an exchange phase whose busiest port moves `words` words.
fn exchange_cycles(target: &Target, words: u64) -> u64 {
    let per_cycle = target.exchange.send_words_per_cycle.max(1) as u64;
    cost::exchange_phase(target, words.div_ceil(per_cycle).min(u32::MAX as u64) as u32)
}

/// Every step index moves one later (a phase is inserted at step 0); storage written by the
/// host (first step 0) stays live from step 0.
fn shift_steps(l: &mut Lowered) {
    for b in &mut l.buffers {
        if b.first_step != 0 {
            b.first_step = b.first_step.saturating_add(1);
        }
        if b.last_step != u32::MAX {
            b.last_step = b.last_step.saturating_add(1);
        }
    }
    for c in &mut l.checkpoints {
        c.after_step += 1;
    }
}

/// A buffer's share of a tensor: its segments and the byte runs they cover, relative to the
/// first byte (`base`). Two buffers with equal shapes hold the same bytes in the same layout.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Shape {
    /// (element, count, rows, element stride, offset - base, offset stride, element step) per segment.
    segments: Vec<(u32, u32, u32, u32, u32, u32, u32)>,
    /// Maximal contiguous byte runs [start, end), relative to base, each padded to whole words.
    runs: Vec<(u32, u32)>,
}

/// The shape of one buffer's segments, or `None` when they cannot move as whole words
/// (unaligned base, runs that would need bytes past the next run or the buffer's end).
fn shape_of(segments: &[LSegment], dtype_bytes: u32, buffer_bytes: u32) -> Option<(u32, Shape)> {
    let base = segments.iter().map(|s| s.offset).min()?;
    if base % 4 != 0 {
        return None;
    }
    let mut bytes: Vec<(u32, u32)> = Vec::new();
    for s in segments {
        let run = s.count.checked_mul(dtype_bytes)?;
        let rows = s.rows.max(1);
        if rows == 1 || s.offset_stride == run {
            bytes.push((s.offset - base, s.offset - base + run.checked_mul(rows)?));
        } else {
            for r in 0..rows {
                let at = s.offset - base + r.checked_mul(s.offset_stride)?;
                bytes.push((at, at.checked_add(run)?));
            }
        }
    }
    bytes.sort_unstable();
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for (a, b) in bytes {
        match runs.last_mut() {
            Some(last) if a < last.1 => return None,
            Some(last) if a == last.1 => last.1 = b,
            _ => runs.push((a, b)),
        }
    }
    for i in 0..runs.len() {
        let limit = runs.get(i + 1).map_or(buffer_bytes.saturating_sub(base), |next| next.0);
        if runs[i].0 % 4 != 0 || runs[i].1.div_ceil(4) * 4 > limit {
            return None;
        }
        runs[i].1 = runs[i].1.div_ceil(4) * 4;
    }
    let mut list: Vec<_> = segments.iter().map(|s| (s.element, s.count, s.rows, if s.rows > 1 { s.element_stride } else { 0 }, s.offset - base, if s.rows > 1 { s.offset_stride } else { 0 }, s.element_step)).collect();
    list.sort_unstable();
    Some((base, Shape { segments: list, runs }))
}

/// A weight's groups (two or more members), in shape order: each one's shape and member tiles.
type Signature = Vec<(Shape, Vec<u32>)>;

/// The home tile of each group of the weights planned so far, by their `Signature`.
type Homes = BTreeMap<Signature, Vec<u32>>;

/// Group a tensor's buffers by the bytes they hold and choose homes (a weight equal to one in
/// `homes` takes its homes; another weight's are recorded there).
fn plan_tensor(l: &Lowered, tensor: &LHostTensor, sends: &mut [u64], homes: &mut Homes) -> Plan {
    let bytes = tensor.dtype.bytes();
    let weight = tensor.role == HostRole::Weight;
    let mut by_buffer: BTreeMap<u32, Vec<LSegment>> = BTreeMap::new();
    for s in &tensor.segments {
        by_buffer.entry(s.buffer).or_default().push(*s);
    }
    // Shape -> (tile -> (buffer, base)), first buffer per tile; others stay host writes.
    let mut groups: BTreeMap<Shape, BTreeMap<u32, (u32, u32)>> = BTreeMap::new();
    for (&buffer, segments) in &by_buffer {
        let b = &l.buffers[buffer as usize];
        if let Some((base, shape)) = shape_of(segments, bytes, b.bytes) {
            groups.entry(shape).or_default().entry(b.tile).or_insert((buffer, base));
        }
    }
    // A weight's signature, the homes an equal earlier weight took (if any), and the homes
    // chosen here, group by group.
    let signature: Signature = if weight { groups.iter().filter(|g| g.1.len() >= 2).map(|(shape, members)| (shape.clone(), members.keys().copied().collect())).collect() } else { Vec::new() };
    let known: Option<Vec<u32>> = homes.get(&signature).cloned().filter(|_| weight);
    let mut chosen: Vec<u32> = Vec::new();
    // The buffers whose copies move by exchange (sorted once filled): a set of this tensor's
    // buffers, not a flag per buffer of the program (the pass plans every input).
    let mut replaced: Vec<u32> = Vec::new();
    let mut receives = vec![0u64; l.tiles as usize];
    let mut group_sends = vec![0u64; l.tiles as usize];
    let (mut transfers, mut saved_bytes) = (Vec::new(), 0u64);
    for (shape, members) in &groups {
        if members.len() < 2 {
            continue;
        }
        let words: u64 = shape.runs.iter().map(|r| ((r.1 - r.0) / 4) as u64).sum();
        // A weight's ties between the least-sending members go to the one nearest the middle
        // of the group's tiles (the least farthest destination), then the lowest tile; an
        // input's to the lowest tile.
        let (low, high) = (*members.keys().next().expect("two or more members"), *members.keys().next_back().expect("two or more members"));
        let reach = |tile: u32| if weight { (tile - low).max(high - tile) } else { 0 };
        let (&home_tile, &(home, home_base)) = match known.as_ref().and_then(|k| k.get(chosen.len())).and_then(|t| members.get_key_value(t)) {
            Some(found) => found,
            None => members.iter().min_by_key(|(&tile, _)| (sends[tile as usize], reach(tile), tile)).expect("two or more members"),
        };
        chosen.push(home_tile);
        sends[home_tile as usize] += words;
        group_sends[home_tile as usize] += words;
        let copies: Vec<(u32, u32, u32)> = members.iter().filter(|(&t, _)| t != home_tile).map(|(&t, &(b, base))| (t, b, base)).collect();
        for &(tile, buffer, _) in &copies {
            replaced.push(buffer);
            receives[tile as usize] += words;
            saved_bytes += shape.segments.iter().map(|s| s.1 as u64 * s.2.max(1) as u64 * bytes as u64).sum::<u64>();
        }
        for &(a, b) in &shape.runs {
            let destinations = copies.iter().map(|&(_, buffer, base)| (buffer, base + a)).collect();
            transfers.push(Transfer { source: (home, home_base + a), words: (b - a) / 4, destinations });
        }
    }
    if weight && known.is_none() {
        homes.insert(signature, chosen);
    }
    let bound_words = receives.iter().chain(&group_sends).copied().max().unwrap_or(0);
    replaced.sort_unstable();
    let host_segments = tensor.segments.iter().filter(|s| replaced.binary_search(&s.buffer).is_err()).copied().collect();
    Plan { host_segments, transfers, saved_bytes, bound_words }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::fixtures;

    /// A decision's range holds exactly the rates that decide the same way.
    #[test]
    fn a_decisions_range_holds_exactly_the_rates_that_decide_alike() {
        let mut target = Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap();
        let decide = |target: &mut Target, rate: u64, bytes: u64, exchange: u64| {
            target.host.link_bytes_per_second = rate;
            host_cycles(target, bytes) > exchange
        };
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..2000 {
            let (bytes, exchange) = (next(1 << 24), next(1 << 16));
            let base = 1 + next(1 << 34);
            let taken = decide(&mut target, base, bytes, exchange);
            let range = RateRange::of_decision(&target, bytes, exchange, taken);
            assert!(range.contains(base));
            // The range's edges and their neighbours, and rates around the base.
            let probes = [range.low, range.high, range.low.saturating_sub(1).max(1), range.high.saturating_add(1), base / 2 + 1, base.saturating_mul(2), 1, u64::MAX];
            for r in probes {
                assert_eq!(decide(&mut target, r, bytes, exchange) == taken, range.contains(r), "bytes {bytes} exchange {exchange} base {base} rate {r} range {range:?}");
            }
        }
        // The largest exchange count is never beaten: every rate decides alike.
        assert_eq!(RateRange::of_decision(&target, 10, u64::MAX, false), RateRange::ALL);
    }
}

//! Scheduler tests: seed-sized phases, random phases on the small and the full chip, exactness
//! where the bound is reachable, malformed requests, reuse and determinism. The validator's
//! own rejection tests live in `validate_tests.rs`.

use super::synthetic::{self, SplitMix64};
use super::*;
use crate::target::fixtures;

pub(super) fn ipu21() -> Target {
    Target::from_toml(fixtures::IPU21, "ipu21.toml").unwrap()
}

pub(super) fn small16() -> Target {
    Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap()
}

/// The same chip with every route as long as every other: the bound is then reachable.
pub(super) fn uniform_delays(mut target: Target) -> Target {
    target.exchange.delay_per_column = 0;
    target.exchange.delay_per_row_group = 0;
    target.exchange.delay_turn = 0;
    target
}

/// Schedule, lower, validate, and check the horizon against both bounds.
fn check(target: &Target, phase: &PhaseRequest) -> Schedule {
    let (schedule, tables) = compile_phase(target, phase).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(tables.horizon, schedule.horizon, "tables and schedule disagree on the horizon");
    assert!(schedule.horizon >= schedule.endpoint_lower_bound, "horizon {} below the bound {}", schedule.horizon, schedule.endpoint_lower_bound);
    assert!(schedule.horizon >= schedule.best_bound(), "horizon {} below {:?}", schedule.horizon, schedule.stronger_bound);
    assert_eq!(schedule.endpoint_lower_bound, endpoint_lower_bound(target, phase));
    schedule
}

#[test]
fn seed_sized_phases_validate_and_stay_near_the_bound() {
    let target = ipu21();
    for (name, phase) in synthetic::seed_sized(target.chip.tiles) {
        let schedule = check(&target, &phase);
        let (tile, words) = row_words(&lower_to_tables(&target, &phase, &schedule));
        eprintln!("{name}: bound {} horizon {} gap {:.2}% kind {} largest row: tile {tile}, {words} words", schedule.endpoint_lower_bound, schedule.horizon, schedule.gap_percent(), schedule.kind.name());
        // The acceptance target: within 5 % of the endpoint bound (we reach about 1 %).
        assert!(schedule.gap_percent() < 5.0, "{name}: gap {:.2}%", schedule.gap_percent());
    }
}

#[test]
fn random_phases_on_the_small_chip_validate() {
    let target = small16();
    let mut rng = SplitMix64(7);
    for _ in 0..150 {
        let transfers = rng.between(1, 40);
        let max_words = rng.between(1, 300);
        let phase = synthetic::random_phase(&mut rng, 16, transfers, max_words, 30, 30);
        check(&target, &phase);
    }
}

#[test]
fn random_phases_on_the_full_chip_validate() {
    let target = ipu21();
    let mut rng = SplitMix64(11);
    for round in 0..6 {
        let transfers = rng.between(200, 3_000);
        let phase = synthetic::random_phase(&mut rng, 1472, transfers, 400, if round % 2 == 0 { 0 } else { 25 }, 20);
        check(&target, &phase);
    }
    check(&target, &synthetic::broadcast(1472, 300, 24, 256, 5));
}

#[test]
fn unicast_reaches_the_bound_exactly_when_delays_are_uniform() {
    let mut rng = SplitMix64(3);
    for target in [uniform_delays(small16()), uniform_delays(ipu21())] {
        for _ in 0..8 {
            let transfers = rng.between(5, if target.chip.tiles == 16 { 60 } else { 4_000 });
            // Every address 4 mod 8: nothing may pair, so the single-port bound is the bound.
            let phase = synthetic::random_phase(&mut rng, target.chip.tiles, transfers, 500, 0, 100);
            let schedule = check(&target, &phase);
            assert_eq!(schedule.horizon, schedule.endpoint_lower_bound, "{} transfers on {} tiles", transfers, target.chip.tiles);
        }
    }
}

#[test]
fn multicast_triangle_reports_the_clique_bound() {
    let target = uniform_delays(small16());
    let words = 100;
    let t = |source: u32, a: u32, b: u32| Transfer {
        source,
        source_address: 0x4C004,
        words,
        destinations: vec![Destination { tile: a, address: 0x80004 + source * 0x1000 }, Destination { tile: b, address: 0x80004 + source * 0x1000 }].into(),
    };
    let phase = PhaseRequest { index: 4, transfers: vec![t(0, 4, 6), t(2, 6, 8), t(10, 4, 8)], half_duplex: Vec::new() };
    let schedule = check(&target, &phase);
    let delay = target.exchange.delay_base;
    assert_eq!(schedule.endpoint_lower_bound, 2 * words + delay);
    assert_eq!(schedule.stronger_bound, Some(("multicast-clique".to_string(), 3 * words + delay)));
    assert_eq!(schedule.horizon, 3 * words + delay);
}

#[test]
fn malformed_requests_name_the_transfer() {
    let target = small16();
    let good = Transfer { source: 0, source_address: 0x4C000, words: 4, destinations: vec![Destination { tile: 1, address: 0x80000 }].into() };
    let cases: Vec<(Transfer, &str)> = vec![
        (Transfer { source: 16, ..good.clone() }, "outside the chip"),
        (Transfer { words: 0, ..good.clone() }, "zero words"),
        (Transfer { destinations: vec![Destination { tile: 1, address: 0x80000 }, Destination { tile: 1, address: 0x90000 }].into(), ..good.clone() }, "appears twice"),
        (Transfer { destinations: vec![Destination { tile: 0, address: 0x80000 }].into(), ..good.clone() }, "its own source"),
        (Transfer { destinations: vec![Destination { tile: 99, address: 0x80000 }].into(), ..good.clone() }, "outside the chip"),
        (Transfer { source_address: 0x4C002, ..good.clone() }, "not word aligned"),
        (Transfer { destinations: vec![].into(), ..good.clone() }, "no destination"),
    ];
    for (bad, expected) in cases {
        let phase = PhaseRequest { index: 9, transfers: vec![good.clone(), bad], half_duplex: Vec::new() };
        let error = schedule_phase(&target, &phase).unwrap_err().to_string();
        assert!(error.contains("transfer 1") && error.contains(expected), "{error}");
    }
    let overlap = PhaseRequest { index: 9, transfers: vec![good.clone(), Transfer { source: 2, ..good.clone() }], half_duplex: Vec::new() };
    assert!(schedule_phase(&target, &overlap).unwrap_err().to_string().contains("also writes"));
}

#[test]
fn relocated_phase_reuses_the_schedule_and_moved_alignment_is_refused() {
    let target = ipu21();
    let phase = synthetic::gemm_gather(1472, 2_000, 40, 200, 9);
    let schedule = check(&target, &phase);
    assert!(schedule.paired, "this phase is expected to use pairs");
    // rkyv round trip: the schedule is what the disk cache keeps.
    let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&schedule).unwrap();
    let back: Schedule = rkyv::from_bytes::<Schedule, rkyv::rancor::Error>(&bytes).unwrap();
    assert_eq!(back, schedule);
    let mut moved = phase.clone();
    for t in &mut moved.transfers {
        t.source_address += 0x100;
        for d in &mut t.destinations {
            d.address += 0x2000;
        }
    }
    assert_eq!(pattern_digest(&moved), pattern_digest(&phase));
    let tables = reuse(&target, &moved, &back).unwrap();
    assert_eq!(tables.horizon, schedule.horizon);
    // Misalign one paired transfer: the pattern changes and the cached schedule is refused.
    let paired = schedule.pieces.iter().find(|p| p.paired).unwrap().transfer as usize;
    moved.transfers[paired].source_address += 4;
    assert_ne!(pattern_digest(&moved), pattern_digest(&phase));
    assert!(matches!(reuse(&target, &moved, &back), Err(ExchangeError::CachedMismatch { .. })));
}

#[test]
fn schedules_do_not_depend_on_thread_count() {
    let target = ipu21();
    let phase = synthetic::reduction_groups(1472, 3_000, 50, 200, 4);
    let many = schedule_phase(&target, &phase).unwrap();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let one = pool.install(|| schedule_phase(&target, &phase).unwrap());
    assert_eq!(many, one);
    assert_eq!(lower_to_tables(&target, &phase, &many), lower_to_tables(&target, &phase, &one));
}

/// `Job::max_delay`, which piece ends and compaction read instead of their ports, is the
/// largest delay over the job's receive ports, ordinary or paired, coalesced or not.
#[test]
fn a_jobs_largest_delay_is_its_ports_largest_either_way() {
    let target = ipu21();
    let mut rng = SplitMix64(0x9E37_79B9_7F4A_7C15);
    let mut phases: Vec<PhaseRequest> = (0..40).map(|_| synthetic::random_phase(&mut rng, target.chip.tiles, 60, 96, 40, 20)).collect();
    phases.extend([row_segments(20, 6, 40, 3), row_segments(8, 12, 16, 5)]);
    for (case, phase) in phases.iter().enumerate() {
        let original = problem::prepare(&target, phase).unwrap();
        let coalesced = coalesce::coalesce(&original);
        for prepared in [Some(&original), coalesced.as_ref()].into_iter().flatten() {
            for (j, job) in prepared.jobs.iter().enumerate() {
                for paired in [false, true].into_iter().filter(|&p| !p || job.paired.is_some()) {
                    let largest = prepared.receive_ports(j, paired).iter().map(|p| p.delay).max().unwrap_or(0);
                    assert_eq!(job.max_delay, largest, "case {case} job {j} paired {paired}");
                }
            }
        }
    }
}

#[test]
fn empty_phase_has_an_empty_schedule() {
    let target = small16();
    let phase = PhaseRequest { index: 0, transfers: vec![], half_duplex: Vec::new() };
    let schedule = check(&target, &phase);
    assert_eq!((schedule.horizon, schedule.pieces.len()), (0, 0));
}


/// Twelve phases of four shapes: the median gap must stay within 2 % of the endpoint bound,
/// unicast phases within 5 %. Wide overlapping broadcasts are held to 12 %: there the
/// endpoint bound is weak (the clique bound rarely applies with the chip's delays) and the
/// greedy is not near-optimal either (see the report).
#[test]
fn gap_survey_over_synthetic_phases() {
    let target = ipu21();
    let mut phases: Vec<(String, PhaseRequest)> = Vec::new();
    for seed in 0..3 {
        phases.push((format!("gather-{seed}"), synthetic::gemm_gather(1472, 6_000 + 3_000 * seed as u32, 100, 400, seed)));
        phases.push((format!("reduction-{seed}"), synthetic::reduction_groups(1472, 8_000 + 4_000 * seed as u32, 60, 300, seed)));
        phases.push((format!("broadcast-{seed}"), synthetic::broadcast(1472, 400 + 200 * seed as u32, 8 + 8 * seed as u32, 256, seed)));
        let mut rng = SplitMix64(seed);
        phases.push((format!("random-{seed}"), synthetic::random_phase(&mut rng, 1472, 5_000, 400, 20, 30)));
    }
    let mut gaps = Vec::new();
    for (name, phase) in &phases {
        let s = check(&target, phase);
        eprintln!("{name}: bound {} horizon {} gap {:.2}% kind {} paired {}", s.endpoint_lower_bound, s.horizon, s.gap_percent(), s.kind.name(), s.paired);
        let limit = if name.starts_with("broadcast") || name.starts_with("random") { 12.0 } else { 5.0 };
        assert!(s.gap_percent() <= limit, "{name}: gap {:.2}%", s.gap_percent());
        gaps.push(s.gap_percent());
    }
    gaps.sort_by(f64::total_cmp);
    assert!(gaps[gaps.len() / 2] <= 2.0, "median gap {:.2}%", gaps[gaps.len() / 2]);
}

/// Row segments of blocks: every source sends `rows` segments of `words` words to the same
/// `fanout` tiles, the request ordered row by row (a job's members are not adjacent).
fn row_segments(sources: u32, rows: u32, words: u32, fanout: u32) -> PhaseRequest {
    let mut transfers = Vec::new();
    for r in 0..rows {
        for s in 0..sources {
            let source = 2 * s;
            let destinations = (0..fanout)
                .map(|k| Destination { tile: (source + 101 + 7 * k) % 1472, address: 0x8_0000 + (s * rows + r) * words * 4 })
                .collect();
            transfers.push(Transfer { source, source_address: 0x4_0000 + r * words * 4, words, destinations });
        }
    }
    PhaseRequest { index: 3, transfers, half_duplex: Vec::new() }
}

#[test]
fn coalescing_groups_row_segments_in_request_order() {
    let target = ipu21();
    let phase = row_segments(20, 6, 40, 3);
    let original = problem::prepare(&target, &phase).unwrap();
    let merged = coalesce::coalesce(&original).expect("rows of one source to the same tiles merge");
    assert_eq!(merged.jobs.len(), 20);
    for (j, job) in merged.jobs.iter().enumerate() {
        let members: Vec<u32> = merged.members_of(j).iter().map(|m| m.transfer).collect();
        assert_eq!(members, (0..6).map(|r| r * 20 + j as u32).collect::<Vec<_>>());
        assert_eq!(job.words, 240);
        assert_eq!(merged.receive_ports(j, false), original.receive_ports(j, false));
        assert_eq!(merged.receive_ports(j, true), original.receive_ports(j, true));
    }
    assert_eq!((merged.receiver_class.clone(), merged.class_sizes.clone()), (original.receiver_class.clone(), original.class_sizes.clone()));
    // Chunks end at member boundaries, and cut a member only when it alone is too long.
    assert_eq!(merged.chunk_end(0, 0, 96), 80);
    assert_eq!(merged.chunk_end(0, 20, 96), 80);
    assert_eq!(merged.chunk_end(0, 200, 96), 240);
    assert_eq!(merged.chunk_end(0, 0, 30), 30);
    assert_eq!(original.chunk_end(0, 0, 30), 30);
    assert_eq!(original.chunk_end(0, 0, 96), 40);
    // Transfers that differ in destinations or pairing stay apart.
    assert!(coalesce::coalesce(&problem::prepare(&target, &row_segments(20, 1, 40, 3)).unwrap()).is_none());
    let mut misaligned = phase.clone();
    misaligned.transfers[20].source_address += 4;
    let problem = problem::prepare(&target, &misaligned).unwrap();
    assert_eq!(coalesce::coalesce(&problem).unwrap().jobs.len(), 21);
}

#[test]
fn expanded_pieces_run_back_to_back_over_members() {
    let target = ipu21();
    let phase = row_segments(2, 3, 40, 2);
    let merged = coalesce::coalesce(&problem::prepare(&target, &phase).unwrap()).unwrap();
    // Job 1 is source 2: transfers 1, 3, 5.
    let ordinary = Piece { transfer: 1, offset_words: 20, words: 80, send_cycle: 100, paired: false };
    let paired = Piece { transfer: 1, offset_words: 20, words: 80, send_cycle: 500, paired: true };
    let piece = |transfer, offset_words, words, send_cycle, paired| Piece { transfer, offset_words, words, send_cycle, paired };
    assert_eq!(coalesce::expand(&merged, &[ordinary, paired]), vec![
        piece(1, 20, 20, 100, false),
        piece(3, 0, 40, 120, false),
        piece(5, 0, 20, 160, false),
        piece(1, 20, 20, 500, true),
        piece(3, 0, 40, 510, true),
        piece(5, 0, 20, 530, true),
    ]);
}

#[test]
fn coalesced_phases_validate_and_keep_their_horizons() {
    let target = ipu21();
    for (sources, rows, words, fanout) in [(300, 12, 64, 6), (700, 4, 50, 1), (100, 30, 36, 40)] {
        let phase = row_segments(sources, rows, words, fanout);
        let schedule = check(&target, &phase);
        assert!(schedule.pieces.iter().all(|p| p.words > 0 && (!p.paired || (p.words % 2 == 0 && p.offset_words % 2 == 0))));
        let apart = schedule_with(&target, &phase, false).unwrap();
        validate(&target, &phase, &lower_to_tables(&target, &phase, &apart)).unwrap();
        eprintln!(
            "{sources}x{rows}x{words}->{fanout}: bound {} horizon {} pieces {}; transfers apart: horizon {} pieces {}",
            schedule.endpoint_lower_bound,
            schedule.horizon,
            schedule.pieces.len(),
            apart.horizon,
            apart.pieces.len()
        );
        assert_eq!((schedule.endpoint_lower_bound, &schedule.stronger_bound), (apart.endpoint_lower_bound, &apart.stronger_bound));
        // Coalescing makes the schedulers' chunks coarser; it may cost a little, not more.
        assert!(schedule.horizon as u64 * 100 <= apart.horizon as u64 * 102, "{} against {}", schedule.horizon, apart.horizon);
    }
}

/// The phase with every address moved: transfer `t`'s source by `source(t)` bytes and its
/// destination `d` by `destination(t, d)` (wrapping).
fn moved(phase: &PhaseRequest, source: impl Fn(usize) -> u32, destination: impl Fn(usize, usize) -> u32) -> PhaseRequest {
    let mut out = phase.clone();
    for (i, t) in out.transfers.iter_mut().enumerate() {
        t.source_address = t.source_address.wrapping_add(source(i));
        for (j, d) in t.destinations.iter_mut().enumerate() {
            d.address = d.address.wrapping_add(destination(i, j));
        }
    }
    out
}

#[test]
fn relative_tables_write_what_relocation_writes_wherever_the_buffers_lie() {
    let target = ipu21();
    let mut rng = SplitMix64(17);
    let mut phases = vec![synthetic::gemm_gather(1472, 2_000, 40, 200, 3), synthetic::reduction_groups(1472, 3_000, 50, 200, 5), synthetic::broadcast(1472, 200, 16, 256, 7)];
    phases.push(synthetic::random_phase(&mut rng, 1472, 3_000, 300, 20, 30));
    for phase in &phases {
        let schedule = schedule_phase(&target, phase).unwrap();
        // Made from the pattern at other addresses (all zero), applied at the phase's own and
        // at addresses moved per transfer and destination (the same phase of another layer).
        let zero = moved(phase, |i| phase.transfers[i].source_address.wrapping_neg(), |i, j| phase.transfers[i].destinations[j].address.wrapping_neg());
        let relative = relative_tables(&target, &zero, &schedule).expect("a valid schedule has exact relative tables");
        let shifted = moved(phase, |i| (i as u32 % 7) * 0x40, |i, j| ((i + 3 * j) as u32 % 5) * 0x1000 + 8);
        for p in [phase, &shifted] {
            let applied = relative.apply(p.index, schedule.endpoint_lower_bound, |t| p.transfers[t as usize].source_address, |t, d| p.transfers[t as usize].destinations[d as usize].address);
            assert_eq!(applied, relocate(&target, p, &schedule, false, None).unwrap());
        }
    }
}

#[test]
fn relative_tables_refuse_ties_and_repeated_destinations() {
    let target = small16();
    let transfer = |source: u32, address: u32, tiles: &[u32]| Transfer { source, source_address: address, words: 4, destinations: tiles.iter().map(|&tile| Destination { tile, address: address + 0x100 }).collect() };
    let piece = |transfer: u32, send_cycle: u32| Piece { transfer, offset_words: 0, words: 4, send_cycle, paired: false };
    let schedule = |pieces: Vec<Piece>| Schedule { pieces: std::sync::Arc::new(pieces), horizon: 0, endpoint_lower_bound: 0, stronger_bound: None, kind: ScheduleKind::Reused, initial_horizon: 0, neighborhood_improvements: 0, paired: false };
    // Two sends of tile 0 in one cycle: their order would depend on the addresses.
    let phase = PhaseRequest { index: 0, transfers: vec![transfer(0, 0x40, &[1]), transfer(0, 0x80, &[2])], half_duplex: Vec::new() };
    assert!(relative_tables(&target, &phase, &schedule(vec![piece(0, 0), piece(1, 0)])).is_none());
    assert!(relative_tables(&target, &phase, &schedule(vec![piece(0, 0), piece(1, 4)])).is_some());
    // A transfer naming tile 1 twice: two bases on one tile.
    let phase = PhaseRequest { index: 0, transfers: vec![transfer(0, 0x40, &[1, 1])], half_duplex: Vec::new() };
    assert!(relative_tables(&target, &phase, &schedule(vec![piece(0, 0)])).is_none());
}

/// Tiles of `tables` that send and receive in one cycle, in order.
fn sending_while_receiving(tables: &ExchangePhase) -> Vec<u32> {
    let cycles = |words: u32, paired: bool| if paired { words / 2 } else { words };
    tables
        .tiles
        .iter()
        .filter(|t| t.sends.iter().any(|s| t.receives.iter().any(|r| s.cycle < r.cycle + cycles(r.words, r.paired) && r.cycle < s.cycle + cycles(s.words, s.paired))))
        .map(|t| t.tile)
        .collect()
}

#[test]
fn half_duplex_tiles_never_send_and_receive_in_one_cycle() {
    for (target, tiles, seed) in [(small16(), 16, 11), (ipu21(), 1472, 12)] {
        let mut rng = SplitMix64(seed);
        let mut moved = 0;
        for _ in 0..40 {
            let transfers = rng.between(5, 60);
            let max_words = rng.between(8, 400);
            let phase = synthetic::random_phase(&mut rng, tiles, transfers, max_words, 40, 30);
            let plain = check(&target, &phase);
            let before = sending_while_receiving(&lower_to_tables(&target, &phase, &plain));
            if before.is_empty() {
                continue;
            }
            // Half of them half-duplex: those may no longer overlap; the others keep theirs
            // or lose them, and no tile gains one.
            let half: Vec<u32> = before.iter().copied().step_by(2).collect();
            let request = PhaseRequest { half_duplex: half.clone(), ..phase.clone() };
            assert_ne!(pattern_digest(&request), pattern_digest(&phase), "half-duplex tiles are part of the pattern");
            let schedule = check(&target, &request);
            let after = sending_while_receiving(&lower_to_tables(&target, &request, &schedule));
            assert!(after.iter().all(|t| !half.contains(t) && before.contains(t)), "half-duplex {half:?}: before {before:?}, after {after:?}");
            assert!(schedule.horizon >= plain.horizon);
            assert_eq!(schedule.pieces.iter().map(|p| p.words as u64).sum::<u64>(), plain.pieces.iter().map(|p| p.words as u64).sum::<u64>());
            // A request without half-duplex tiles keeps its schedule.
            assert_eq!(schedule_phase(&target, &phase).unwrap(), plain);
            moved += 1;
        }
        assert!(moved >= 10, "only {moved} phases had a tile sending while receiving");
    }
}

#[test]
fn destinations_read_as_the_list_they_were_made_from() {
    let d = |tile: u32| Destination { tile, address: 0x8_0000 + tile * 16 };
    for n in 0..5u32 {
        let list: Vec<Destination> = (0..n).map(d).collect();
        let collected: Destinations = list.iter().copied().collect();
        let converted = Destinations::from(list.clone());
        let mut pushed = Destinations::default();
        for &x in &list {
            pushed.push(x);
        }
        for made in [&collected, &converted, &pushed] {
            assert_eq!(&made[..], &list[..], "{n} destinations");
            assert_eq!(format!("{made:?}"), format!("{list:?}"));
            assert_eq!(matches!(made, Destinations::One(_)), n == 1, "one destination is kept inline");
        }
        assert_eq!(collected, pushed);
    }
    // Equality is by the list, whatever the representation.
    assert_eq!(Destinations::Many(vec![d(3)]), Destinations::One(d(3)));
    assert_ne!(Destinations::One(d(3)), Destinations::One(d(4)));
    let mut moved = Destinations::from(vec![d(1), d(2)]);
    for x in &mut moved {
        x.address += 4;
    }
    assert_eq!(&moved[..], &[Destination { tile: 1, address: d(1).address + 4 }, Destination { tile: 2, address: d(2).address + 4 }]);
}

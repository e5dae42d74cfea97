//! The validator must reject hand-broken tables, each for the reason it was broken, and
//! accept the legal corner cases (multicast, partners sharing a paired receive).

use super::tests::small16;
use super::*;
use crate::package::SendEntry;

/// t0: tile 0 → {4, 5} (a supertile pair), 8 words, aligned: may pair, partners share.
/// t1: tile 2 → 6, 6 words, aligned. t2: tile 8 → 6, 4 words, addresses 4 mod 8.
/// t3: tile 9 → 7, 2 words, aligned.
fn phase() -> PhaseRequest {
    let d = |tile, address| Destination { tile, address };
    PhaseRequest {
        index: 5,
        transfers: vec![
            Transfer { source: 0, source_address: 0x4C000, words: 8, destinations: vec![d(4, 0x80000), d(5, 0x80000)].into() },
            Transfer { source: 2, source_address: 0x4C000, words: 6, destinations: vec![d(6, 0x80000)].into() },
            Transfer { source: 8, source_address: 0x4C004, words: 4, destinations: vec![d(6, 0x80104)].into() },
            Transfer { source: 9, source_address: 0x4C000, words: 2, destinations: vec![d(7, 0x80000)].into() },
        ],
        half_duplex: Vec::new(),
    }
}

fn piece(transfer: u32, offset_words: u32, words: u32, send_cycle: u32, paired: bool) -> Piece {
    Piece { transfer, offset_words, words, send_cycle, paired }
}

fn tables(pieces: Vec<Piece>) -> ExchangePhase {
    let schedule = Schedule {
        pieces: std::sync::Arc::new(pieces),
        horizon: 0,
        endpoint_lower_bound: 0,
        stronger_bound: None,
        kind: ScheduleKind::Greedy,
        initial_horizon: 0,
        neighborhood_improvements: 0,
        paired: false,
    };
    lower_to_tables(&small16(), &phase(), &schedule)
}

/// A legal schedule: t0 paired to both partners at once, the rest ordinary, well apart.
fn legal() -> Vec<Piece> {
    vec![piece(0, 0, 8, 0, true), piece(1, 0, 6, 0, false), piece(2, 0, 4, 60, false), piece(3, 0, 2, 100, false)]
}

fn check(t: &ExchangePhase) -> Result<(), ValidationError> {
    validate(&small16(), &phase(), t)
}

fn tile_mut(t: &mut ExchangePhase, tile: u32) -> &mut crate::package::TileExchange {
    t.tiles.iter_mut().find(|x| x.tile == tile).unwrap()
}

#[test]
fn legal_tables_pass_including_shared_paired_receives() {
    assert_eq!(check(&tables(legal())), Ok(()));
    // Split pieces, in any order of cycles, are fine too.
    let split = vec![piece(0, 0, 4, 0, true), piece(0, 4, 4, 2, true), piece(1, 0, 3, 10, false), piece(1, 3, 3, 13, false), piece(2, 0, 4, 60, false), piece(3, 0, 2, 100, false)];
    assert_eq!(check(&tables(split)), Ok(()));
}

#[test]
fn two_receives_in_one_cycle_on_one_tile_are_refused() {
    let target = small16();
    // t1 lands on tile 6 two cycles after t2 started landing there.
    let mut pieces = legal();
    pieces[2].send_cycle = 0;
    pieces[1].send_cycle = target.delay(8, 6) + 2 - target.delay(2, 6);
    assert!(matches!(check(&tables(pieces)), Err(ValidationError::PortConflict { tile: 6, port: "receive", .. })));
}

#[test]
fn a_word_sent_twice_is_refused() {
    // A stray send nobody hears.
    let mut t = tables(legal());
    tile_mut(&mut t, 2).sends.push(SendEntry { cycle: 200, address: 0x4C000, words: 2, paired: false });
    assert!(matches!(check(&t), Err(ValidationError::UnreceivedSend { tile: 2, cycle: 200 })));
    // The same words sent and received a second time.
    let mut pieces = legal();
    pieces.push(piece(1, 0, 2, 200, false));
    assert!(matches!(check(&tables(pieces)), Err(ValidationError::Coverage { tile: 6, .. }) | Err(ValidationError::SentWords { tile: 2, .. })));
}

#[test]
fn a_missing_destination_is_refused() {
    let mut t = tables(legal());
    tile_mut(&mut t, 5).receives.clear();
    let error = check(&t).unwrap_err();
    assert!(matches!(error, ValidationError::Coverage { tile: 5, .. }), "{error}");
    assert!(error.to_string().contains("does not receive"), "{error}");
}

#[test]
fn a_receive_off_its_send_cycle_plus_delay_is_refused() {
    let mut t = tables(legal());
    tile_mut(&mut t, 6).receives[0].cycle += 1;
    assert!(matches!(check(&t), Err(ValidationError::UnmatchedReceive { tile: 6, source_tile: 2, .. })));
    let mut t = tables(legal());
    tile_mut(&mut t, 7).receives[0].source = 3;
    assert!(matches!(check(&t), Err(ValidationError::UnmatchedReceive { tile: 7, .. })));
}

#[test]
fn paired_misuse_is_refused() {
    // Odd word count.
    let mut t = tables(legal());
    tile_mut(&mut t, 0).sends[0].words = 7;
    assert!(matches!(check(&t), Err(ValidationError::Paired { tile: 0, .. })));
    // Misaligned addresses (t2 lives at 4 mod 8).
    let mut pieces = legal();
    pieces[2].paired = true;
    assert!(matches!(check(&tables(pieces)), Err(ValidationError::Paired { .. })));
    // t1 paired from tile 2 (partner 3 idle) into tile 6 (partner 7 idle then) is fine.
    let mut pieces = legal();
    pieces[1].paired = true;
    assert_eq!(check(&tables(pieces.clone())), Ok(()));
    // t1 paired into tile 6 holds tile 7's receive port; t3 lands on 7 at the same cycles.
    let target = small16();
    pieces[3].send_cycle = 0;
    pieces[1].send_cycle = target.delay(9, 7) + 1 - target.delay(2, 6);
    assert!(matches!(check(&tables(pieces)), Err(ValidationError::PortConflict { tile: 7, port: "receive", .. })));
    // t0 goes paired from tile 0, so tile 1's send port is taken during its cycles.
    let mut t = tables(legal());
    t.tiles.insert(1, crate::package::TileExchange { tile: 1, sends: vec![SendEntry { cycle: 1, address: 0x4C000, words: 1, paired: false }], receives: vec![] });
    assert!(matches!(check(&t), Err(ValidationError::PortConflict { tile: 1, port: "send", .. })));
}

#[test]
fn a_wrong_horizon_and_unsorted_tables_are_refused() {
    let mut t = tables(legal());
    t.horizon += 1;
    assert!(matches!(check(&t), Err(ValidationError::Horizon { .. })));
    let mut t = tables(legal());
    t.tiles.swap(0, 1);
    assert!(matches!(check(&t), Err(ValidationError::Unsorted { .. })));
}

/// A tile hearing one source many times, and another hearing its first and last transfers:
/// legal tables pass, and a receive moved one cycle late is unmatched on either.
#[test]
fn receives_from_one_source_are_matched_after_short_steps_and_long_jumps() {
    let d = |tile, address| Destination { tile, address };
    // Tile 2 sends 30 one-word transfers to tile 6; the first and the last go to tile 7 too.
    let transfers: Vec<Transfer> = (0..30u32)
        .map(|k| {
            let mut destinations = vec![d(6, 0x80000 + 8 * k)];
            if k == 0 || k == 29 {
                destinations.push(d(7, 0x80000 + 8 * k));
            }
            Transfer { source: 2, source_address: 0x4C000 + 8 * k, words: 1, destinations: destinations.into() }
        })
        .collect();
    let phase = PhaseRequest { index: 3, transfers, half_duplex: Vec::new() };
    let pieces = (0..30u32).map(|k| piece(k, 0, 1, 3 * k, false)).collect();
    let schedule = Schedule { pieces: std::sync::Arc::new(pieces), horizon: 0, endpoint_lower_bound: 0, stronger_bound: None, kind: ScheduleKind::Greedy, initial_horizon: 0, neighborhood_improvements: 0, paired: false };
    let target = small16();
    let legal = lower_to_tables(&target, &phase, &schedule);
    assert_eq!(validate(&target, &phase, &legal), Ok(()));
    assert_eq!(legal.tiles.iter().find(|t| t.tile == 7).map(|t| t.receives.len()), Some(2));
    for (tile, receive) in [(6u32, 20usize), (7, 1)] {
        let mut late = legal.clone();
        let receives = &mut late.tiles.iter_mut().find(|t| t.tile == tile).unwrap().receives;
        receives[receive].cycle += 1;
        let error = validate(&target, &phase, &late);
        assert!(matches!(error, Err(ValidationError::UnmatchedReceive { tile: t, source_tile: 2, .. }) if t == tile), "tile {tile}: {error:?}");
    }
}

//! The memory-element rule on the simulator: a tile that sends from and receives into one
//! memory element (16 KiB in standard memory, a 32 KiB pair in the interleaved window) in the
//! same cycle is rejected at load, naming phase, tile, cycle and element; the same exchange
//! with the receive buffer one element away loads. Packages are hand-built for small16.

use ipuq::device::{Device, DeviceError, Simulator};
use ipuq_queries::package::*;
use ipuq_queries::target::{fixtures, Target};

fn target() -> Target {
    Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap()
}

/// Tiles 0 and 1 swap 8 words: each sends from `send_at` at cycle 0 and receives into
/// `receive_at` when the partner's words arrive (timed to overlap its own send when
/// `overlap`: tile 1 then receives while it sends).
fn swap(send_at: u32, receive_at: u32, overlap: bool) -> Package {
    let t = target();
    let d = t.delay(0, 1);
    assert_eq!(d, t.delay(1, 0));
    // Tile 0 sends late enough that its words reach tile 1 while tile 1 is still sending.
    let (s0, s1) = if overlap { (0, d.saturating_sub(4)) } else { (0, d + 16) };
    let labels = vec!["a".to_string(), "b".to_string(), "code".to_string()];
    let tile = |tile: u32| TileImage {
        tile,
        segments: vec![],
        shared: vec![],
        zero_fill: vec![AddressRange { start: send_at, end: send_at + 32 }],
        allocations: {
            let mut v = vec![
                Allocation { start: send_at, end: send_at + 32, kind: AllocationKind::Data, label: 0, first_step: 0, last_step: 1 },
                Allocation { start: receive_at, end: receive_at + 32, kind: AllocationKind::Data, label: 1, first_step: 0, last_step: 1 },
                Allocation { start: 0x4C000, end: 0x4C400, kind: AllocationKind::Code, label: 2, first_step: 0, last_step: u32::MAX },
            ];
            v.sort_by_key(|a| a.start);
            v
        },
    };
    let tables = vec![
        TileExchange {
            tile: 0,
            sends: vec![SendEntry { cycle: s0, address: send_at, words: 8, paired: false }],
            receives: vec![ReceiveEntry { cycle: s1 + d, source: 1, address: receive_at, words: 8, paired: false }],
        },
        TileExchange {
            tile: 1,
            sends: vec![SendEntry { cycle: s1, address: send_at, words: 8, paired: false }],
            receives: vec![ReceiveEntry { cycle: s0 + d, source: 0, address: receive_at, words: 8, paired: false }],
        },
    ];
    let mut package = Package {
        compiler: "tests".into(),
        target_toml: t.canonical_toml(),
        target_digest: t.digest(),
        workload_name: "hand-built".into(),
        workload_toml: String::new(),
        tiles: vec![tile(0), tile(1)],
        shared_segments: vec![],
        steps: vec![Step::Exchange { phase: 0 }],
        phases: vec![PhaseSummary { index: 0, horizon: 0, endpoint_lower_bound: 0 }],
        host: HostTables { inputs: vec![], initialize: vec![], outputs: vec![], checkpoints: vec![] },
        labels,
        summary: Summary { operations: 0, active_tiles: 0, gemm_flops: 0, estimated_cycles: 0, estimated_exchange_cycles: 0, logical_shards: 0 },
    };
    // The tables live in the tiles' images only.
    let exchanges = ipuq_queries::tables::pack(&[ExchangePhase { index: 0, tiles: tables, horizon: 0, endpoint_lower_bound: 0 }]);
    ipuq_queries::image::Programs { compute_sets: vec![vec![], vec![]], exchanges }.write(&mut package).unwrap();
    package
}

fn load(package: &Package) -> Result<Simulator, DeviceError> {
    let mut device = Simulator::open(target());
    device.initialize()?;
    device.load(package)?;
    Ok(device)
}

const STD: u32 = 0x60000;
const IL: u32 = 0x80000;

#[test]
fn sending_and_receiving_in_one_element_in_one_cycle_is_rejected() {
    for (send_at, receive_at, what) in [(STD, STD + 0x100, "standard element"), (IL, IL + 0x4100, "interleaved element pair")] {
        let err = load(&swap(send_at, receive_at, true)).err().unwrap_or_else(|| panic!("accepted a conflict in one {what}"));
        assert!(matches!(err, DeviceError::Exchange { phase: 0, tile: 1, .. }), "{what}: {err}");
        assert!(err.to_string().contains("memory element"), "{err}");
    }
}

#[test]
fn other_elements_or_other_cycles_load() {
    // One element (16 KiB) or one pair (32 KiB) away, in the same cycles.
    load(&swap(STD, STD + 0x4000, true)).expect("different standard elements may be used in one cycle");
    load(&swap(IL, IL + 0x8000, true)).expect("different interleaved pairs may be used in one cycle");
    // The same element, in different cycles.
    load(&swap(IL, IL + 0x100, false)).expect("one element used in different cycles");
}

//! `optimize_exchange_placement` on a small MLP (small16 target): the final placement leaves
//! no tile sending from and receiving into one memory element in one cycle, is no more costly
//! than `place_storage`'s, and support memory adds up to the code sizes placement used.

use ipuq_queries::db::{Database, Sources};
use ipuq_queries::elements::phase_conflicts;
use ipuq_queries::emit::estimate_cycles;
use ipuq_queries::exchange_placement::placed_tables;
use ipuq_queries::pipeline::{code_sizes, lowered, placed, placement, schedules};
use ipuq_queries::target::{fixtures, Target};

const WORKLOAD: &str = include_str!("../../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");

#[test]
fn the_final_placement_has_no_memory_element_conflicts_and_costs_no_more() {
    let db = Database::default();
    let sources = Sources::new(&db, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    let t = Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap();
    let l = lowered(&db, sources).unwrap();
    let s = schedules(&db, sources).unwrap();
    let base = placement(&db, sources).unwrap();
    let fin = placed(&db, sources).unwrap();
    let count = |p| -> u64 {
        let tables = placed_tables(&t, &l.value, &s.value.phases, p, true).unwrap();
        tables.iter().map(|x| phase_conflicts(&t, x).tile_cycles).sum()
    };
    assert_eq!(count(&fin.value), 0, "the optimized placement leaves conflicts");
    let cost = |p| estimate_cycles(&t, &l.value, p, &placed_tables(&t, &l.value, &s.value.phases, p, true).unwrap().iter().map(|x| x.horizon).collect::<Vec<_>>()).0;
    assert!(cost(&fin.value) <= cost(&base.value) || count(&base.value) > 0);
    // Code ranges are those sized by size_tile_code.
    let c = code_sizes(&db, sources).unwrap();
    for (tile, &(start, end)) in fin.value.code.iter().enumerate() {
        assert!(end - start >= c.value[tile], "tile {tile}");
    }
}

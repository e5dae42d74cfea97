//! Exchange scheduling on phases of the seed's sizes (15,064 / 24,760 / 84,859 transfers on
//! the 1472-tile chip): scheduling alone, and lowering plus validation of the result.
//!
//! Run with `cargo bench -p ipuq-queries --bench exchange`. The phases come from
//! `exchange::synthetic`, so the figures are reproducible; the bound and the horizon of each
//! phase are printed once before timing.

use criterion::{criterion_group, criterion_main, Criterion};

use ipuq_queries::exchange::{self, synthetic};
use ipuq_queries::target::{fixtures, Target};

fn bench(c: &mut Criterion) {
    let target = Target::from_toml(fixtures::IPU21, "ipu21.toml").expect("the shipped target parses");
    let mut group = c.benchmark_group("exchange");
    group.sample_size(10);
    for (name, phase) in synthetic::seed_sized(target.chip.tiles) {
        let schedule = exchange::schedule_phase(&target, &phase).expect("synthetic phases are well formed");
        println!(
            "{name}: transfers={} endpoint_lower_bound={} horizon={} gap={:.2}% kind={} pieces={}",
            phase.transfers.len(),
            schedule.endpoint_lower_bound,
            schedule.horizon,
            schedule.gap_percent(),
            schedule.kind.name(),
            schedule.pieces.len()
        );
        group.bench_function(format!("schedule/{name}"), |b| b.iter(|| exchange::schedule_phase(&target, &phase).unwrap()));
        group.bench_function(format!("lower_and_validate/{name}"), |b| {
            b.iter(|| {
                let tables = exchange::lower_to_tables(&target, &phase, &schedule);
                exchange::validate(&target, &phase, &tables).unwrap();
                tables
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

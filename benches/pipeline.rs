//! Criterion benches of the whole path: a cold build (fresh salsa database, no disk cache), a
//! no-op rebuild in the same database, a simulator run of the built package (load, initialize,
//! execute, read back), and the host reference of the seed MLP. Small shapes on the 16-tile
//! target and the seeds on ipu21; `ipuq exchange-report` and `queries/benches/exchange.rs`
//! cover the scheduler alone.

use std::collections::BTreeMap;
use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion};
use ipuq::reference::evaluate_values;
use ipuq::runtime::{execute, RunOptions};
use ipuq::workload::data::tensor_data;
use ipuq_queries::db::{Database, Sources};
use ipuq_queries::ir::Graph;
use ipuq_queries::pipeline::{package, run_phase, PHASES};
use ipuq_queries::target::fixtures;

const SMALL_MLP: &str = include_str!("../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");
const SEED_MLP: &str = include_str!("../fixtures/workloads/siglip-mlp-f16-b1-t729-d1152-h4304-n1.toml");
const ATTENTION: &str = include_str!("../fixtures/workloads/attention-grouped-materialized-gaussian-f16-b1-t729-h16-kv4-d72.toml");

fn build(db: &Database, sources: Sources) {
    for phase in PHASES {
        run_phase(db, sources, phase).expect("the fixture builds");
    }
}

fn builds(c: &mut Criterion) {
    let mut group = c.benchmark_group("build");
    group.sample_size(10);
    for (name, workload, target) in [("small-mlp/small16", SMALL_MLP, fixtures::SMALL16), ("seed-attention/ipu21", ATTENTION, fixtures::IPU21)] {
        group.bench_function(format!("cold/{name}"), |b| {
            b.iter(|| {
                let db = Database::default();
                let sources = Sources::new(&db, workload.to_string(), name.into(), target.to_string(), "target".into());
                build(&db, sources);
            })
        });
        let db = Database::default();
        let sources = Sources::new(&db, workload.to_string(), name.into(), target.to_string(), "target".into());
        build(&db, sources);
        group.bench_function(format!("no-op/{name}"), |b| b.iter(|| build(&db, sources)));
    }
    group.finish();
}

fn runs(c: &mut Criterion) {
    let mut group = c.benchmark_group("simulator");
    group.sample_size(10);
    let workloads = [("small-mlp/small16", SMALL_MLP, fixtures::SMALL16), ("seed-mlp/ipu21", SEED_MLP, fixtures::IPU21), ("seed-attention/ipu21", ATTENTION, fixtures::IPU21)];
    for (name, workload, target) in workloads {
        let db = Database::default();
        let sources = Sources::new(&db, workload.to_string(), name.into(), target.to_string(), "target".into());
        let pkg = package(&db, sources).expect("the fixture builds").value;
        let graph = Graph::parse(workload, name).unwrap();
        let data = tensor_data(&graph, Path::new(".")).unwrap();
        let inputs: BTreeMap<String, Vec<u8>> = data.into_iter().map(|(k, v)| (k, v.bytes)).collect();
        let options = RunOptions { profile_path: None, lock_path: None, ..RunOptions::default() };
        group.bench_function(format!("run/{name}"), |b| b.iter(|| execute(&pkg, &inputs, &options).expect("the package runs")));
    }
    group.finish();
}

/// The f64 host reference of the seed MLP's output (two products of 729 x 1152 x 4304).
fn reference(c: &mut Criterion) {
    let mut group = c.benchmark_group("reference");
    group.sample_size(10);
    let graph = Graph::parse(SEED_MLP, "seed-mlp").unwrap();
    let data = tensor_data(&graph, Path::new(".")).unwrap();
    group.bench_function("seed-mlp", |b| b.iter(|| evaluate_values(&graph, &data, &["y_0"]).expect("the reference evaluates")));
    group.finish();
}

criterion_group!(benches, builds, runs, reference);
criterion_main!(benches);

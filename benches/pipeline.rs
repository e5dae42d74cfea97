//! Criterion benches of the whole path: a cold build (fresh salsa database, no disk cache), a
//! no-op rebuild in the same database, a one-operation edit rebuilt by `ipuq watch`'s session,
//! by a build server's (`ipuq serve`) and by `--incremental` in a new session, a simulator run of the built package (load,
//! initialize, execute, read back), and the host reference of the seed MLP. Small shapes on the 16-tile
//! target and the seeds on ipu21; `ipuq exchange-report` and `queries/benches/exchange.rs`
//! cover the scheduler alone.

use std::collections::BTreeMap;
use std::path::Path;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, SamplingMode};
use ipuq::build::{BuildOptions, Session};
use ipuq::reference::evaluate_values;
use ipuq::runtime::{execute, RunOptions};
use ipuq::workload::data::tensor_data;
use ipuq::workload::generate::{siglip_mlp, to_toml, SiglipMlp};
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

/// Issue 8's edit: the last block's GELU made a scale, rebuilt (package written, fsync
/// included) after a cold build of the unedited workload, for the seed MLP and four of its
/// blocks on ipu21. `watch`: in the session that built the unedited workload, as `ipuq watch`
/// rebuilds. `incremental`: in a new session over a disk cache that holds the unedited build's
/// entries, as `ipuq build --incremental` after the edit (with no build server); `served`: as
/// `ipuq serve` rebuilds (see below); the cache is opened read-only in `incremental`,
/// so every sample finds the same entries (the entries a writing build would add are written
/// behind by a thread and not timed). The untimed setup of each sample builds cold (watch,
/// served: with a fresh cache of its own) or opens a new session and output folder
/// (incremental).
fn edits(c: &mut Criterion) {
    // The allocator as `ipuq` sets it up.
    ipuq::alloc::tune();
    let mut group = c.benchmark_group("edit");
    // One edit per sample: each needs its own cold build (watch) or session (incremental).
    group.sample_size(10).sampling_mode(SamplingMode::Flat).warm_up_time(std::time::Duration::from_millis(1));
    let options = |dir: &Path, incremental: bool| BuildOptions {
        target: None,
        out_dir: dir.join("out"),
        incremental,
        cache_dir: Some(dir.join("cache")),
        cache_read_only: incremental,
        cache_max_bytes: None,
        plan_finalists: 4,
        table_budget: None,
        remote: None,
    };
    for blocks in [1, 4] {
        let base = to_toml(&siglip_mlp(&SiglipMlp { blocks, ..SiglipMlp::default() }).expect("the family generates"));
        let at = base.rfind("op = \"gelu\"").expect("a GELU to edit");
        let edited = format!("{}op = \"scale\"\nfactor = 0.5{}", &base[..at], &base[at + "op = \"gelu\"".len()..]);
        let name = format!("gelu-to-scale/mlp-{blocks}-blocks/ipu21");
        let dir = tempfile::tempdir().expect("a temporary folder");
        let workload = dir.path().join("workload.toml");
        group.bench_function(format!("watch/{name}"), |b| {
            let options = options(dir.path(), false);
            b.iter_batched(
                || {
                    let mut session = Session::rebuilding(&options).expect("a session");
                    session.build_text(base.clone(), &workload, &options).expect("the workload builds");
                    session
                },
                |mut session| {
                    session.build_text(edited.clone(), &workload, &options).expect("the edit builds");
                    session
                },
                BatchSize::PerIteration,
            )
        });
        // The unedited build's entries, written once (a writing build) for every sample to read.
        let writing = BuildOptions { cache_read_only: false, ..options(dir.path(), true) };
        Session::new(&writing).expect("a session").build_text(base.clone(), &workload, &writing).expect("the workload builds");
        group.bench_function(format!("incremental/{name}"), |b| {
            b.iter_batched(
                || {
                    // An output folder of this sample's own (not a counter's name: criterion
                    // may run this function more than once, and a folder holding the edited
                    // package would skip its write).
                    let out = tempfile::tempdir_in(dir.path()).expect("a temporary folder");
                    let options = BuildOptions { out_dir: out.path().to_path_buf(), ..options(dir.path(), true) };
                    (Session::new(&options).expect("a session"), options, out)
                },
                |(mut session, options, out)| {
                    session.build_text(edited.clone(), &workload, &options).expect("the edit builds");
                    (session, out)
                },
                BatchSize::PerIteration,
            )
        });
        // As `ipuq serve` rebuilds for a client: the session that built the unedited workload
        // with a writing cache of its own, its writer held while the edit builds; the end of
        // the build (the entries written, the record) comes after the answer, untimed.
        group.bench_function(format!("served/{name}"), |b| {
            b.iter_batched(
                || {
                    // A cache and output folder of this sample's own (criterion may run this
                    // function more than once: a counter would repeat names, and a cache that
                    // holds the edit's entries would time hits).
                    let folder = tempfile::tempdir_in(dir.path()).expect("a temporary folder");
                    let options = BuildOptions { cache_dir: Some(folder.path().join("cache")), out_dir: folder.path().join("out"), cache_read_only: false, ..options(dir.path(), true) };
                    let mut session = Session::rebuilding(&options).expect("a session");
                    session.defer_finishing();
                    session.build_text(base.clone(), &workload, &options).expect("the workload builds");
                    session.finish();
                    (session, options, folder)
                },
                |(mut session, options, folder)| {
                    session.build_text(edited.clone(), &workload, &options).expect("the edit builds");
                    (session, options, folder)
                },
                BatchSize::PerIteration,
            )
        });
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

criterion_group!(benches, builds, edits, runs, reference);
criterion_main!(benches);

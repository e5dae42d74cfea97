//! Incrementality of the stage queries: salsa's in-memory reuse (event log of stage bodies)
//! and the disk-store layer (keys change when, and only when, their inputs change).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ipuq_queries::db::{Database, Origin, Sources, StageStore};
use ipuq_queries::hash::Digest;
use ipuq_queries::exchange::pattern_digest;
use ipuq_queries::emit::tile_inputs;
use ipuq_queries::phases::EntryCounts;
use ipuq_queries::pipeline::{finalists, lowered, package, placed, provisional_bases, requests, run_phase, selection, tables, PHASES};
use ipuq_queries::target::fixtures;
use salsa::Setter;

const WORKLOAD: &str = include_str!("../../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");

#[derive(Default)]
struct MemoryStore(Mutex<BTreeMap<(String, Digest, u64), Vec<u8>>>);

impl StageStore for MemoryStore {
    fn load(&self, stage: &str, key: &Digest, schema: u64) -> Option<rkyv::util::AlignedVec<16>> {
        let map = self.0.lock().unwrap();
        let bytes = map.get(&(stage.to_string(), *key, schema))?;
        let mut v = rkyv::util::AlignedVec::<16>::new();
        v.extend_from_slice(bytes);
        Some(v)
    }
    fn store(&self, stage: &str, key: &Digest, schema: u64, bytes: &[u8]) {
        self.0.lock().unwrap().insert((stage.to_string(), *key, schema), bytes.to_vec());
    }
}

fn build_all(db: &Database, sources: Sources) -> Vec<(&'static str, Origin)> {
    for phase in PHASES {
        run_phase(db, sources, phase).unwrap_or_else(|e| panic!("{phase}: {e}"));
    }
    db.take_runs()
}

fn stages(runs: &[(&'static str, Origin)], origin: Origin) -> Vec<&'static str> {
    let mut v: Vec<&str> = runs.iter().filter(|r| r.1 == origin).map(|r| r.0).collect();
    v.dedup();
    v
}

#[test]
fn an_initialiser_change_re_plans_nothing() {
    let mut db = Database::default();
    let sources = Sources::new(&db, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    let first = build_all(&db, sources);
    assert!(stages(&first, Origin::Computed).contains(&"lower_mid"), "{first:?}");
    let before = package(&db, sources).unwrap();

    // Same text: nothing re-runs at all.
    assert!(build_all(&db, sources).is_empty());

    // A new initialiser seed changes the package (it embeds the workload) but no compile stage.
    let edited = WORKLOAD.replacen("seed = 1\n", "seed = 7\n", 1);
    assert_ne!(edited, WORKLOAD);
    sources.set_workload_text(&mut db).to(edited);
    let second = build_all(&db, sources);
    assert_eq!(stages(&second, Origin::Computed), vec!["build_tile_images"], "{second:?}");
    let after = package(&db, sources).unwrap();
    assert_ne!(before.digest, after.digest);
    assert_eq!(before.value.tiles, after.value.tiles);
}

fn computed_after_target_edit(from: &str, to: &str) -> Vec<&'static str> {
    assert!(fixtures::SMALL16.contains(from), "{from}");
    let mut db = Database::default();
    let sources = Sources::new(&db, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    build_all(&db, sources);
    sources.set_target_text(&mut db).to(fixtures::SMALL16.replacen(from, to, 1));
    stages(&build_all(&db, sources), Origin::Computed)
}

#[test]
fn a_target_change_recomputes_only_the_stages_that_read_it() {
    // A route delay: the planner's exchange estimate and the schedules read it.
    let runs = computed_after_target_edit("delay_base = 12", "delay_base = 30");
    for stage in ["lower_mid", "exchange_schedule", "lower_exchanges", "build_tile_images"] {
        assert!(runs.contains(&stage), "{stage} did not re-run: {runs:?}");
    }
    // A runtime-only constant reaches only the package.
    assert_eq!(computed_after_target_edit("page_bytes = ", "page_bytes = 1"), vec!["build_tile_images"]);
    // The host link rate is a planning input of the host pass (`lower/host.rs` weighs input
    // copies by exchange against the link), which select_finalist applies: a rate that flips
    // a decision re-selects, but re-plans nothing; one that flips none reaches only the
    // package (`a_link_rate_edit_that_flips_no_decision_reaches_only_the_package`).
    let runs = computed_after_target_edit("link_bytes_per_second = ", "link_bytes_per_second = 1");
    assert!(runs.contains(&"select_finalist") && !runs.contains(&"lower_mid"), "{runs:?}");
    // A cost constant re-plans but reschedules no exchange pattern.
    let runs = computed_after_target_edit("gelu_base = ", "gelu_base = 1");
    assert!(runs.contains(&"lower_mid"), "{runs:?}");
    assert!(!runs.contains(&"exchange_schedule"), "a cost edit rescheduled exchanges: {runs:?}");
}

#[test]
fn each_stage_reads_only_its_target_view() {
    // Stages get views of the target; handing them the whole target must change nothing, so a
    // key over the view's digest holds everything the stage reads.
    let digests = |db: Database| {
        let sources = Sources::new(&db, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
        PHASES.iter().map(|phase| run_phase(&db, sources, phase).unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(digests(Database::default()), digests(Database::default().with_full_target_views()));
}

#[test]
fn entries_of_another_compiler_build_are_misses() {
    let store = Arc::new(MemoryStore::default());
    let old = Digest::of_bytes(b"an older compiler build");
    let first = Database::new(Some(store.clone())).with_fingerprint(old);
    let sources = Sources::new(&first, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    build_all(&first, sources);
    let written = store.0.lock().unwrap().len();

    // The real compiler build reads nothing the older one wrote.
    let second = Database::new(Some(store.clone()));
    let sources = Sources::new(&second, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    let runs = build_all(&second, sources);
    assert!(stages(&runs, Origin::DiskHit).is_empty(), "stale hits across compiler builds: {runs:?}");
    assert_eq!(store.0.lock().unwrap().len(), 2 * written);

    // The same build again hits everything.
    let third = Database::new(Some(store.clone())).with_fingerprint(old);
    let sources = Sources::new(&third, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    assert_eq!(stages(&build_all(&third, sources), Origin::Computed), vec!["build_tile_images"]);
}

#[test]
fn a_runtime_constant_edit_hits_every_compile_stage_on_disk() {
    let store = Arc::new(MemoryStore::default());
    let cold = Database::new(Some(store.clone()));
    let sources = Sources::new(&cold, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    build_all(&cold, sources);
    let edited = fixtures::SMALL16.replacen("page_bytes = ", "page_bytes = 1", 1);
    let warm = Database::new(Some(store.clone()));
    let sources = Sources::new(&warm, WORKLOAD.to_string(), "mlp.toml".into(), edited, "small16".into());
    assert_eq!(stages(&build_all(&warm, sources), Origin::Computed), vec!["build_tile_images"]);
}

/// The package of a cold build of the test workload on `target`, with no store.
fn cold_package(target: &str) -> Vec<u8> {
    let db = Database::default();
    let sources = Sources::new(&db, WORKLOAD.to_string(), "mlp.toml".into(), target.to_string(), "small16".into());
    build_all(&db, sources);
    package(&db, sources).unwrap().value.to_bytes()
}

#[test]
fn a_link_rate_edit_that_flips_no_decision_reaches_only_the_package() {
    let link = |rate: &str| fixtures::SMALL16.replacen("link_bytes_per_second = 24000000000", &format!("link_bytes_per_second = {rate}"), 1);
    assert_ne!(link("25000000000"), fixtures::SMALL16);
    // In one process: the selection is found in the process's ranges; only the package (which
    // embeds the target) is rebuilt, and it is the one a cold build at that rate makes.
    assert_eq!(computed_after_target_edit("link_bytes_per_second = 24000000000", "link_bytes_per_second = 25000000000"), vec!["build_tile_images"]);
    // Across processes, through the disk index of ranges.
    let store = Arc::new(MemoryStore::default());
    let cold = Database::new(Some(store.clone()));
    let sources = Sources::new(&cold, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    build_all(&cold, sources);
    // (On this workload the host pass decides alike from 1 to about 25.5 GB/s, and again from
    // there to about 29.4 GB/s.) A rate outside every range computed re-selects; a rate in one
    // of them, the first or a later one, is a hit.
    for (rate, reselects) in [("25000000000", false), ("26000000000", true), ("1", false), ("26500000000", false), ("124000000000", true)] {
        let warm = Database::new(Some(store.clone()));
        let sources = Sources::new(&warm, WORKLOAD.to_string(), "mlp.toml".into(), link(rate), "small16".into());
        let runs = build_all(&warm, sources);
        let computed = stages(&runs, Origin::Computed);
        assert_eq!(computed.contains(&"select_finalist"), reselects, "rate {rate}: {runs:?}");
        assert!(!computed.contains(&"lower_mid"), "rate {rate}: {runs:?}");
        assert_eq!(package(&warm, sources).unwrap().value.to_bytes(), cold_package(&link(rate)), "rate {rate}");
    }
    // A verifying build recomputes the hit and finds the same bytes.
    let verifying = Database::new(Some(store.clone())).verifying_hits(true);
    let sources = Sources::new(&verifying, WORKLOAD.to_string(), "mlp.toml".into(), link("25000000000"), "small16".into());
    for phase in PHASES {
        run_phase(&verifying, sources, phase).unwrap();
    }
}

#[test]
fn the_disk_store_serves_a_second_process_and_gives_identical_bytes() {
    let store = Arc::new(MemoryStore::default());
    let cold = Database::new(Some(store.clone()));
    let sources = Sources::new(&cold, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    let runs = build_all(&cold, sources);
    assert!(stages(&runs, Origin::DiskHit).is_empty());
    let cold_bytes = package(&cold, sources).unwrap().value.to_bytes();

    let warm = Database::new(Some(store.clone()));
    let sources = Sources::new(&warm, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    let runs = build_all(&warm, sources);
    // The package is not stored (its copy on disk is the output file): only it is rebuilt.
    assert_eq!(stages(&runs, Origin::Computed), vec!["build_tile_images"], "a warm build recomputed: {runs:?}");
    assert_eq!(package(&warm, sources).unwrap().value.to_bytes(), cold_bytes);

    // A damaged entry is a miss: recomputed, and the bytes are the same.
    for bytes in store.0.lock().unwrap().values_mut() {
        bytes.truncate(bytes.len() / 2);
    }
    let repaired = Database::new(Some(store.clone()));
    let sources = Sources::new(&repaired, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    let runs = build_all(&repaired, sources);
    assert!(stages(&runs, Origin::Computed).contains(&"lower_mid"), "{runs:?}");
    assert_eq!(package(&repaired, sources).unwrap().value.to_bytes(), cold_bytes);
}

#[test]
fn identical_patterns_are_scheduled_once_and_threads_change_no_byte() {
    let build = |threads: usize| {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(|| {
            let db = Database::default();
            let sources = Sources::new(&db, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
            let runs = build_all(&db, sources);
            let l = lowered(&db, sources).unwrap();
            // select_finalist schedules every finalist it costs; the chosen one's phases then
            // come from the memo. Each distinct pattern is scheduled once.
            let chosen = selection(&db, sources).unwrap();
            let costed: Vec<_> = finalists(&db, sources)
                .unwrap()
                .value
                .iter()
                .enumerate()
                .filter(|(f, _)| !chosen.value.failures.iter().any(|x| x.0 == *f as u32 && x.1.starts_with("not costed")))
                .map(|(_, l)| l.clone())
                .collect();
            let mut patterns: std::collections::BTreeSet<Digest> = std::collections::BTreeSet::new();
            let target = ipuq_queries::target::Target::from_toml(fixtures::SMALL16, "small16").unwrap();
            for f in &costed {
                // As select_finalist costs it: after the host pass.
                let f = &ipuq_queries::lower::host::replicate(f.clone(), &target);
                let bases = provisional_bases(f);
                patterns.extend(requests(f, |b, o| bases[b as usize] + o).iter().map(pattern_digest));
            }
            let scheduled = runs.iter().filter(|r| r.0 == "exchange_schedule" && r.1 == Origin::Computed).count();
            assert_eq!(scheduled, patterns.len(), "{} phases", l.value.phases.len());
            package(&db, sources).unwrap().value.to_bytes()
        })
    };
    assert!(build(1) == build(4), "the package depends on the thread count");
}

const ATTENTION: &str = include_str!("../../fixtures/workloads/attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8.toml");

/// Build every phase in a pool of `threads` threads; the database back, the package bytes and
/// how its tile images were obtained.
fn tile_build(db: Database, sources: Sources, threads: usize) -> (Database, Vec<u8>, EntryCounts) {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(move || {
        let runs = build_all(&db, sources);
        assert!(stages(&runs, Origin::Computed).contains(&"build_tile_images"), "the package stage did not run: {runs:?}");
        let bytes = package(&db, sources).unwrap().value.to_bytes();
        let counts = db.tile_image_counts().expect("tile image counts");
        (db, bytes, counts)
    })
}

#[test]
fn tile_images_are_built_once_per_distinct_content_at_any_thread_count() {
    let build = |threads: usize| {
        let db = Database::default();
        let sources = Sources::new(&db, ATTENTION.to_string(), "attention.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
        let (db, bytes, counts) = tile_build(db, sources, threads);
        // Distinct contents: the tile inputs' digests, as the stage keys them.
        let inputs = tile_inputs(&lowered(&db, sources).unwrap().value, &placed(&db, sources).unwrap().value, &tables(&db, sources).unwrap().value).unwrap();
        let distinct: std::collections::BTreeSet<Digest> = inputs.iter().map(|i| i.digest().unwrap()).collect();
        assert_eq!(counts, EntryCounts { entries: 16, distinct: distinct.len(), reused: 0, computed: distinct.len() }, "{threads} threads");
        bytes
    };
    assert!(build(1) == build(4), "the package depends on the thread count");
}

#[test]
fn an_edit_that_leaves_every_tile_unchanged_reuses_every_tile_image() {
    let db = Database::default();
    let sources = Sources::new(&db, WORKLOAD.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    let (mut db, _, cold) = tile_build(db, sources, 2);
    assert_eq!((cold.entries, cold.reused, cold.computed), (16, 0, cold.distinct), "{cold:?}");
    let before = package(&db, sources).unwrap();

    // A runtime-only target constant: the package (which embeds the target) is built again,
    // from the previous build's tile images.
    sources.set_target_text(&mut db).to(fixtures::SMALL16.replacen("page_bytes = ", "page_bytes = 1", 1));
    let (mut db, _, counts) = tile_build(db, sources, 2);
    assert_eq!(counts, EntryCounts { entries: 16, distinct: cold.distinct, reused: cold.distinct, computed: 0 });
    let after = package(&db, sources).unwrap();
    assert_ne!(before.digest, after.digest);
    assert_eq!((&before.value.tiles, &before.value.shared_segments), (&after.value.tiles, &after.value.shared_segments));

    // An initialiser edit: the same.
    sources.set_workload_text(&mut db).to(WORKLOAD.replacen("seed = 1\n", "seed = 7\n", 1));
    let (_, _, counts) = tile_build(db, sources, 2);
    assert_eq!((counts.reused, counts.computed), (cold.distinct, 0), "{counts:?}");
}

/// The small MLP with a second output: a scale of a small input of its own, which lands on
/// fewer tiles than the products (`factor` is the edit).
fn mlp_with_a_small_scale(factor: &str) -> String {
    let text = WORKLOAD.replacen("outputs = [\"y_0\"]", "outputs = [\"y_0\", \"z\"]", 1);
    assert_ne!(text, WORKLOAD);
    format!("{text}\n[[tensor]]\nname = \"u\"\nshape = [2, 16]\ndtype = \"f16\"\nrole = \"input\"\n\n[tensor.init.gaussian]\nseed = 3\nstd = 1.0\n\n[[operation]]\nname = \"z\"\nop = \"scale\"\ninputs = [\"u\"]\nfactor = {factor}\n")
}

#[test]
fn a_one_operation_edit_rebuilds_only_the_tiles_it_changed() {
    let db = Database::default();
    let sources = Sources::new(&db, mlp_with_a_small_scale("0.5"), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    let (mut db, before, _) = tile_build(db, sources, 2);
    let edited = mlp_with_a_small_scale("0.25");
    sources.set_workload_text(&mut db).to(edited.clone());
    let (_, bytes, counts) = tile_build(db, sources, 2);
    assert!(bytes != before);
    assert!(counts.computed > 0 && counts.reused > 0, "{counts:?}");
    assert_eq!(counts.computed + counts.reused, counts.distinct);

    // The same bytes as a cold build of the edited workload.
    let cold = Database::default();
    let fresh = Sources::new(&cold, edited, "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    let (_, cold_bytes, cold_counts) = tile_build(cold, fresh, 2);
    assert!(bytes == cold_bytes, "the incremental package differs from a cold build's");
    assert_eq!((cold_counts.reused, cold_counts.computed), (0, cold_counts.distinct));
}

/// `blocks` MLP blocks `y_i = f_i(x_i · w1_i) · w2_i` of 37 tokens, dimension 64 and hidden
/// dimension 96, each feeding the next, named `mlp`; `f_i` is GELU but in block `scaled`
/// (when given), where it is a scale by 0.5.
fn mlp_workload(blocks: usize, scaled: Option<usize>) -> String {
    let mut text = format!("name = \"mlp\"\noutputs = [\"y_{}\"]\n[[tensor]]\nname = \"x\"\nshape = [37, 64]\ndtype = \"f16\"\nrole = \"input\"\ninit = \"zeros\"\n", blocks - 1);
    for b in 0..blocks {
        for (w, shape) in [("w1", "[64, 96]"), ("w2", "[96, 64]")] {
            text += &format!("[[tensor]]\nname = \"{w}_{b}\"\nshape = {shape}\ndtype = \"f16\"\nrole = \"weight\"\ninit = \"zeros\"\n");
        }
        let input = if b == 0 { "x".to_string() } else { format!("y_{}", b - 1) };
        let f = if scaled == Some(b) { "op = \"scale\"\nfactor = 0.5" } else { "op = \"gelu\"" };
        text += &format!("[[operation]]\nname = \"h_{b}\"\nop = \"matmul\"\ninputs = [\"{input}\", \"w1_{b}\"]\n[[operation]]\nname = \"g_{b}\"\n{f}\ninputs = [\"h_{b}\"]\n[[operation]]\nname = \"y_{b}\"\nop = \"matmul\"\ninputs = [\"g_{b}\", \"w2_{b}\"]\n");
    }
    text
}

/// The package digest of one build of `workload` in `db`, and the stages it computed.
fn package_of(db: &Database, workload: &str) -> (Digest, Vec<&'static str>) {
    let sources = Sources::new(db, workload.to_string(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    let runs = build_all(db, sources);
    (package(db, sources).unwrap().digest, stages(&runs, Origin::Computed))
}

/// After a build of one workload, a build of an edit of it resumes the plan beam from the
/// first build's trace (on disk, or in the process without a disk cache), and makes the
/// package a cold build of the edit makes, byte for byte; a trace entry that does not decode
/// is ignored.
#[test]
fn a_build_resumed_from_the_previous_plan_beam_equals_a_cold_build() {
    let (a, b) = (mlp_workload(4, None), mlp_workload(4, Some(3)));
    let cold = package_of(&Database::default(), &b).0;

    // Through the disk cache: a new process (database) over the first build's store.
    let store = Arc::new(MemoryStore::default());
    package_of(&Database::new(Some(store.clone())), &a);
    let traces = |store: &MemoryStore| store.0.lock().unwrap().keys().filter(|k| k.0 == "beam_trace").count();
    assert_eq!(traces(&store), 1);
    let (resumed, computed) = package_of(&Database::new(Some(store.clone())), &b);
    assert!(computed.contains(&"lower_mid"), "{computed:?}");
    assert_eq!(resumed, cold);
    // The edit's trace replaced the first build's (one per workload name).
    assert_eq!(traces(&store), 1);

    // In the process, without a disk cache (`ipuq watch`).
    let mut db = Database::default();
    let sources = Sources::new(&db, a.clone(), "mlp.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
    build_all(&db, sources);
    sources.set_workload_text(&mut db).to(b.clone());
    let runs = build_all(&db, sources);
    assert!(stages(&runs, Origin::Computed).contains(&"lower_mid"), "{runs:?}");
    assert_eq!(package(&db, sources).unwrap().digest, cold);

    // A corrupt trace entry (a flipped byte, a truncated one, garbage) is ignored.
    for corrupt in [|v: &mut Vec<u8>| v[40] ^= 1, |v: &mut Vec<u8>| v.truncate(v.len() / 2), |v: &mut Vec<u8>| *v = b"not a trace".to_vec()] {
        let store = Arc::new(MemoryStore::default());
        package_of(&Database::new(Some(store.clone())), &a);
        for (key, bytes) in store.0.lock().unwrap().iter_mut() {
            if key.0 == "beam_trace" {
                corrupt(bytes);
            }
        }
        assert_eq!(package_of(&Database::new(Some(store.clone())), &b).0, cold);
    }
}

/// A package serialised into a buffer that held another package before (as `ipuq watch`
/// writes build after build) is, after its header, the bytes `to_bytes` gives.
#[test]
fn a_package_serialised_into_a_reused_buffer_is_the_bytes_of_to_bytes() {
    const ATTENTION: &str = include_str!("../../fixtures/workloads/attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8.toml");
    let built = |text: &str| {
        let db = Database::default();
        let sources = Sources::new(&db, text.to_string(), "w.toml".into(), fixtures::SMALL16.to_string(), "small16".into());
        build_all(&db, sources);
        package(&db, sources).unwrap().value
    };
    let (mlp, attention) = (built(WORKLOAD), built(ATTENTION));
    let mut payload = rkyv::util::AlignedVec::new();
    for p in [&attention, &mlp, &mlp, &attention] {
        let header = p.serialize_into(&mut payload);
        let mut bytes = header.to_vec();
        bytes.extend_from_slice(&payload);
        assert_eq!(bytes, p.to_bytes());
    }
    assert_ne!(mlp.to_bytes(), attention.to_bytes());
}

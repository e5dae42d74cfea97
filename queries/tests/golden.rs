//! Golden stage digests: each stage's output digest on small fixed workloads (small16 target),
//! recorded with the stage's version in `tests/golden/stages.txt`. A stage whose output
//! changes while its version stays the same fails here: its cache entries would be served
//! stale to other builds. After bumping the version, re-bless:
//! `IPUQ_BLESS=1 cargo test -p ipuq-queries --test golden`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ipuq_queries::db::{Database, Sources};
use ipuq_queries::hash::Digest;
use ipuq_queries::pipeline::{package, run_phase, PHASES, VERSIONS};
use ipuq_queries::target::fixtures;

const WORKLOADS: &[(&str, &str)] = &[
    ("siglip-mlp-f16-b1-t37-d64-h96-n1", include_str!("../../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml")),
    ("attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8", include_str!("../../fixtures/workloads/attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8.toml")),
    // Five tokens on 16 tiles: the LayerNorms split their rows over the idle tiles.
    ("siglip-encoder-f16-b1-t5-d256-h4-m96-l1", include_str!("../../fixtures/workloads/siglip-encoder-f16-b1-t5-d256-h4-m96-l1.toml")),
];

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/stages.txt")
}

/// (workload, stage) -> (version, digest), as computed now.
fn current() -> BTreeMap<(String, String), (u32, String)> {
    let mut out = BTreeMap::new();
    for (name, text) in WORKLOADS {
        let db = Database::default();
        let sources = Sources::new(&db, text.to_string(), format!("{name}.toml"), fixtures::SMALL16.to_string(), "small16".into());
        for (phase, (stage, version)) in PHASES.iter().zip(VERSIONS) {
            assert_eq!(phase, stage, "VERSIONS must follow PHASES");
            let mut digest = run_phase(&db, sources, phase).unwrap_or_else(|e| panic!("{name} {phase}: {e}"));
            if *phase == "build_tile_images" {
                // The package names the compiler build, which changes with every source edit:
                // record the package with that field blanked.
                let mut p = (*package(&db, sources).unwrap().value).clone();
                p.compiler = String::new();
                digest = Digest::of_bytes(&p.to_bytes());
            }
            out.insert((name.to_string(), stage.to_string()), (*version, digest.to_hex()));
        }
    }
    out
}

fn render(entries: &BTreeMap<(String, String), (u32, String)>) -> String {
    let mut text = String::from("# Stage output digests on small16 (queries/tests/golden.rs). Re-bless after a version bump:\n# IPUQ_BLESS=1 cargo test -p ipuq-queries --test golden\n# workload stage version digest\n");
    for ((workload, stage), (version, digest)) in entries {
        text.push_str(&format!("{workload} {stage} {version} {digest}\n"));
    }
    text
}

fn parse(text: &str) -> BTreeMap<(String, String), (u32, String)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 4, "golden file line '{l}': expected workload stage version digest");
            ((f[0].to_string(), f[1].to_string()), (f[2].parse().unwrap_or_else(|_| panic!("golden file line '{l}': bad version")), f[3].to_string()))
        })
        .collect()
}

type Entries = BTreeMap<(String, String), (u32, String)>;

/// (changed without a version bump, needing a re-bless) between the golden file and now.
fn compare(golden: &Entries, now: &Entries) -> (Vec<String>, Vec<String>) {
    let mut unbumped = Vec::new();
    let mut rebless = Vec::new();
    for (entry, (version, digest)) in now {
        match golden.get(entry) {
            Some((v, d)) if v == version && d == digest => {}
            Some((v, d)) if v == version => unbumped.push(format!("  {} {}: v{v} output {} -> {}", entry.0, entry.1, &d[..16.min(d.len())], &digest[..16])),
            Some((v, _)) => rebless.push(format!("  {} {}: version {v} -> {version}", entry.0, entry.1)),
            None => rebless.push(format!("  {} {}: not in the golden file", entry.0, entry.1)),
        }
    }
    rebless.extend(golden.keys().filter(|k| !now.contains_key(*k)).map(|k| format!("  {} {}: no longer produced", k.0, k.1)));
    (unbumped, rebless)
}

#[test]
fn stage_outputs_change_only_with_their_versions() {
    let now = current();
    if std::env::var_os("IPUQ_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(golden_path(), render(&now)).expect("write the golden file");
        return;
    }
    let text = std::fs::read_to_string(golden_path()).unwrap_or_else(|e| panic!("{}: {e}; create it with IPUQ_BLESS=1", golden_path().display()));
    let (unbumped, rebless) = compare(&parse(&text), &now);
    assert!(
        unbumped.is_empty(),
        "stage output changed without a version bump (bump the stage's version in queries/src/pipeline.rs, then re-bless with IPUQ_BLESS=1):\n{}",
        unbumped.join("\n")
    );
    assert!(rebless.is_empty(), "stage versions changed: check the outputs, then re-bless with IPUQ_BLESS=1 cargo test -p ipuq-queries --test golden:\n{}", rebless.join("\n"));
}

#[test]
fn the_golden_check_tells_an_unbumped_change_from_a_bump() {
    let now = current();
    let first = now.keys().next().unwrap().clone();
    // Same version, other digest: an unbumped change, named.
    let mut stale = now.clone();
    stale.get_mut(&first).unwrap().1 = "0".repeat(64);
    let (unbumped, rebless) = compare(&parse(&render(&stale)), &now);
    assert!(unbumped.len() == 1 && unbumped[0].contains(&first.1) && rebless.is_empty(), "{unbumped:?} {rebless:?}");
    // Older version recorded: a bump, which asks for a re-bless.
    let mut older = now.clone();
    older.get_mut(&first).unwrap().0 += 1;
    let (unbumped, rebless) = compare(&parse(&render(&older)), &now);
    assert!(unbumped.is_empty() && rebless.len() == 1, "{unbumped:?} {rebless:?}");
}

//! Host traffic (`queries/src/lower/host.rs`): every weight byte crosses the host link once and
//! is replicated on the device by the initialize call's exchange phases; input replicas move
//! by an exchange phase at the start of the run when that is cheaper than the host link at the
//! target's rate, and stay host writes when the link is the cheaper one.

mod common;

use std::path::Path;

use common::{assert_pass, field, fixture, ipuq};
use ipuq_queries::package::{HostRole, Package, Step};
use ipuq_queries::target::fixtures;

const MLP: &str = "workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml";
/// x [37, 64] f16; w1 [64, 96] and w2 [96, 64] f16.
const INPUT_BYTES: u64 = 37 * 64 * 2;
const WEIGHT_BYTES: u64 = 2 * 64 * 96 * 2;

fn build(dir: &Path, target: &str) -> Package {
    let out = ipuq(&["build", &fixture(MLP), "--target", target, "-o", "base"], dir);
    assert_eq!(out.code, 0, "{}", out.stderr);
    Package::from_bytes(&std::fs::read(dir.join("base/model.ipuexe")).unwrap(), "base").unwrap()
}

fn number(stdout: &str, key: &str) -> u64 {
    field(stdout, "workload=", key).unwrap_or_else(|| panic!("no {key} in {stdout}")).parse().unwrap()
}

#[test]
fn each_host_byte_crosses_the_link_once_and_the_run_passes() {
    let dir = tempfile::tempdir().unwrap();
    let package = build(dir.path(), "small16");
    assert!(!package.host.initialize.is_empty(), "no initialize phases: weights are not replicated on the device");
    // Every weight element is written by the host exactly once.
    for t in package.host.inputs.iter().filter(|t| t.role == HostRole::Weight) {
        let elements: u64 = t.shape.iter().map(|&d| d as u64).product();
        assert_eq!(t.streamed_elements(), elements, "weight `{}` streamed more than once", t.name);
    }
    // The input replication phase is the run's first step, not an initialize phase.
    let Step::Exchange { phase } = package.steps[0] else { panic!("step 0 is not the input replication phase: {:?}", package.steps[0]) };
    assert!(!package.host.initialize.contains(&phase));
    let out = ipuq(&["run", "base/model.ipuexe"], dir.path());
    assert_pass(&out);
    assert_eq!(number(&out.stdout, "inputBytes"), INPUT_BYTES);
    assert_eq!(number(&out.stdout, "weightBytes"), WEIGHT_BYTES);
    assert!(number(&out.stdout, "initializeCycles") > 0, "{}", out.stdout);
    assert!(out.stderr.contains(&format!("call=\"initialize\" command=0 phases={}", package.host.inputs.len() + package.host.initialize.len())));
}

#[test]
fn a_package_without_its_initialize_phases_fails_numerically() {
    let dir = tempfile::tempdir().unwrap();
    let mut package = build(dir.path(), "small16");
    package.host.initialize.clear();
    std::fs::create_dir_all(dir.path().join("mutated")).unwrap();
    std::fs::write(dir.path().join("mutated/model.ipuexe"), package.to_bytes()).unwrap();
    let out = ipuq(&["run", "mutated/model.ipuexe"], dir.path());
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, common::tail(&out.stderr));
    assert_eq!(field(&out.stdout, "workload=", "numericalTest").as_deref(), Some("FAIL"));
}

#[test]
fn an_initialize_phase_that_is_also_a_run_step_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut package = build(dir.path(), "small16");
    let Some(Step::Exchange { phase }) = package.steps.iter().find(|s| matches!(s, Step::Exchange { .. })).copied() else { panic!("no exchange step") };
    package.host.initialize.push(phase);
    std::fs::create_dir_all(dir.path().join("mutated")).unwrap();
    std::fs::write(dir.path().join("mutated/model.ipuexe"), package.to_bytes()).unwrap();
    let out = ipuq(&["run", "mutated/model.ipuexe"], dir.path());
    assert_eq!(out.code, 2, "{}", out.stdout);
    assert!(out.stderr.contains(&format!("initialize phase {phase} is repeated, also a step of the run")), "{}", common::tail(&out.stderr));
}

/// With a host link far faster than the exchange, input replicas stay host writes (the
/// weighing is real); weights are still written once and replicated at load.
#[test]
fn a_fast_host_link_keeps_input_replicas_on_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let fast = fixtures::SMALL16.replace("link_bytes_per_second = 24000000000", "link_bytes_per_second = 24000000000000000");
    assert_ne!(fast, fixtures::SMALL16, "small16 no longer states the link rate this test edits");
    std::fs::write(dir.path().join("fast.toml"), fast).unwrap();
    let package = build(dir.path(), "fast.toml");
    assert!(matches!(package.steps[0], Step::Compute { .. }), "an input replication phase was added although the host link is cheaper");
    let out = ipuq(&["run", "base/model.ipuexe", "--device-target", "fast.toml"], dir.path());
    assert_pass(&out);
    assert!(number(&out.stdout, "inputBytes") > INPUT_BYTES, "{}", out.stdout);
    assert_eq!(number(&out.stdout, "weightBytes"), WEIGHT_BYTES);
}

//! The shared cache end to end, through the `ipuq` binary: two fresh local caches sharing a
//! real nginx or Redis server, faults that must never change the package, concurrent builds
//! on one remote, and export/import. Small workloads on the small16 target.

mod common;
#[path = "../cache/tests/common/fake_server.rs"]
mod fake_server;
#[path = "common/servers.rs"]
mod servers;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{fixture, ipuq, Output};
use fake_server::{closed_port, FakeServer, Mode};

const MLP: &str = "workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml";
const ATTENTION: &str = "workloads/attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8.toml";

fn build(dir: &Path, workload: &str, out: &str, extra: &[&str]) -> Output {
    let mut args = vec!["build", workload, "--target", "small16", "-o", out, "--timings"];
    args.extend_from_slice(extra);
    let result = ipuq(&args, dir);
    assert_eq!(result.code, 0, "{}", result.stderr);
    result
}

fn package(dir: &Path, out: &str) -> Vec<u8> {
    std::fs::read(dir.join(out).join("model.ipuexe")).expect("package")
}

/// Stages computed outside the package assembly (`build_tile_images`, which is never stored
/// and always runs), from the `--timings` table.
fn cached_computed(out: &Output) -> u64 {
    let rows: Vec<&str> = out.stderr.lines().filter(|l| PHASE_ROWS.iter().any(|p| l.starts_with(p))).collect();
    assert!(!rows.is_empty(), "no timings:\n{}", out.stderr);
    rows.iter().filter(|l| !l.starts_with("build_tile_images")).map(|l| l.split_whitespace().nth(2).and_then(|f| f.parse::<u64>().ok()).expect("computed column")).sum()
}

const PHASE_ROWS: [&str; 6] = ["lower_mid ", "lower_exchanges_provisional ", "size_tile_code ", "place_storage ", "lower_exchanges ", "build_tile_images "];

/// (computed, disk hits, remote hits) from the `--timings` total line.
fn totals(out: &Output) -> (u64, u64, u64) {
    let line = out.stderr.lines().find(|l| l.starts_with("total")).unwrap_or_else(|| panic!("no timings:\n{}", out.stderr));
    let n: Vec<u64> = line.split_whitespace().skip(1).map(|f| f.parse().expect("number")).collect();
    (n[1], n[2], n[3])
}

/// A plain build's bytes, then two fresh caches sharing `url`: the second computes nothing.
fn two_fresh_caches_share(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let workload = fixture(MLP);
    build(dir.path(), &workload, "plain", &[]);
    let first = build(dir.path(), &workload, "a", &["--cache-dir", "cache-a", "--remote-cache", url]);
    let second = build(dir.path(), &workload, "b", &["--cache-dir", "cache-b", "--remote-cache", url]);
    let (_, disk, remote) = totals(&second);
    assert_eq!((cached_computed(&second), disk), (0, 0), "second build with a fresh cache:\n{}\nfirst:\n{}", second.stderr, first.stderr);
    assert!(remote > 0, "{}", second.stderr);
    assert!(package(dir.path(), "a") == package(dir.path(), "plain") && package(dir.path(), "b") == package(dir.path(), "plain"));
    let stats = ipuq(&["cache", "stats", "--cache-dir", "cache-b"], dir.path());
    let line = stats.stdout.lines().find(|l| l.starts_with("remote")).unwrap_or_else(|| panic!("{}", stats.stdout));
    // The phases' hits, plus the build record looked up before them.
    let hits: u64 = line.split(": ").nth(1).and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{line}"));
    assert!(hits >= remote && line.contains(" 0 errors"), "{line}");
    // The local copies serve the next build without the remote.
    let third = build(dir.path(), &workload, "c", &["--cache-dir", "cache-b", "--incremental"]);
    assert_eq!(cached_computed(&third), 0, "{}", third.stderr);
}

#[test]
fn two_fresh_caches_share_one_nginx() {
    let Some(server) = servers::nginx() else { return };
    two_fresh_caches_share(&format!("{}/{}", server.url, std::process::id()));
}

#[test]
fn two_fresh_caches_share_one_redis_and_read_only_uploads_nothing() {
    let Some(server) = servers::redis(3) else { return };
    two_fresh_caches_share(&server.url);
    let Some(other) = servers::redis(4) else { return };
    let dir = tempfile::tempdir().unwrap();
    let workload = fixture(ATTENTION);
    build(dir.path(), &workload, "ro", &["--cache-dir", "ro", "--remote-cache", &other.url, "--remote-cache-read-only"]);
    let fresh = build(dir.path(), &workload, "fresh", &["--cache-dir", "fresh", "--remote-cache", &other.url]);
    assert!(cached_computed(&fresh) > 0, "a read-only build uploaded: {}", fresh.stderr);
}

/// Builds with a failing remote: exit 0, the plain build's bytes, exactly one warning.
fn survives(dir: &Path, url: &str, name: &str, plain: &[u8]) -> Duration {
    let start = Instant::now();
    let out = build(dir, &fixture(MLP), name, &["--cache-dir", name, "--remote-cache", url, "--remote-cache-timeout-ms", "300"]);
    let elapsed = start.elapsed();
    assert!(package(dir, name) == plain, "{name}: bytes differ");
    assert_eq!(out.stderr.matches("remote cache failed").count(), 1, "{name}: {}", out.stderr);
    elapsed
}

#[test]
fn faulty_remotes_never_change_the_package() {
    let dir = tempfile::tempdir().unwrap();
    let start = Instant::now();
    build(dir.path(), &fixture(MLP), "plain", &[]);
    let plain_time = start.elapsed();
    let plain = package(dir.path(), "plain");
    let junk = FakeServer::start(Mode::Junk);
    let garbage = FakeServer::start(Mode::Garbage);
    let slow = FakeServer::start(Mode::Slow(Duration::from_secs(2)));
    let cases = [
        ("closed", format!("http://127.0.0.1:{}/c", closed_port())),
        ("closed-redis", format!("redis://127.0.0.1:{}/0", closed_port())),
        ("junk", junk.url("c")),
        ("garbage", garbage.url("c")),
        ("garbage-redis", format!("redis://127.0.0.1:{}/0", garbage.port)),
        ("slow", slow.url("c")),
    ];
    for (name, url) in &cases {
        let elapsed = survives(dir.path(), url, name, &plain);
        assert!(elapsed < plain_time.mul_f64(1.5) + Duration::from_secs(3), "{name}: {elapsed:?} against a plain {plain_time:?}");
    }
    // A server that drops the connection mid-body: entries exist but never arrive whole.
    let dropping = FakeServer::start(Mode::Store);
    build(dir.path(), &fixture(MLP), "seed", &["--cache-dir", "seed", "--remote-cache", &dropping.url("c")]);
    dropping.set_mode(Mode::DropMidBody);
    survives(dir.path(), &dropping.url("c"), "dropped", &plain);
}

#[test]
fn concurrent_builds_share_one_remote() {
    let dir = tempfile::tempdir().unwrap();
    let server = FakeServer::start(Mode::Store);
    let url = server.url("shared");
    let workload = fixture(MLP);
    // All three start before any is waited for: they race on the same remote names.
    let children: Vec<_> = (0..3)
        .map(|i| {
            Command::new(env!("CARGO_BIN_EXE_ipuq"))
                .args(["build", &workload, "--target", "small16", "-o", &format!("p{i}"), "--cache-dir", &format!("c{i}"), "--remote-cache", &url])
                .current_dir(dir.path())
                .env("IPUQ_LOG", "warn")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("ipuq starts")
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().expect("ipuq runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(!String::from_utf8_lossy(&out.stderr).contains("remote cache failed"), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let last = build(dir.path(), &workload, "last", &["--cache-dir", "c-last", "--remote-cache", &url]);
    assert_eq!(cached_computed(&last), 0, "{}", last.stderr);
    for i in 0..3 {
        assert!(package(dir.path(), &format!("p{i}")) == package(dir.path(), "last"));
    }
}

#[test]
fn export_then_import_serves_a_fresh_cache() {
    let dir = tempfile::tempdir().unwrap();
    let workload = fixture(ATTENTION);
    let source = build(dir.path(), &workload, "source", &["--cache-dir", "from", "--incremental"]);
    assert!(cached_computed(&source) > 0);
    build(dir.path(), &fixture(MLP), "other", &["--cache-dir", "from", "--incremental"]);
    let export = ipuq(&["cache", "export", "attention.bundle", "--workload", &workload, "--target", "small16", "--cache-dir", "from"], dir.path());
    assert_eq!(export.code, 0, "{}", export.stderr);
    let all = ipuq(&["cache", "export", "all.bundle", "--cache-dir", "from"], dir.path());
    assert_eq!(all.code, 0, "{}", all.stderr);
    let size = |f: &str| std::fs::metadata(dir.path().join(f)).unwrap().len();
    assert!(size("attention.bundle") < size("all.bundle"), "the workload's entries are a subset");

    let import = ipuq(&["cache", "import", "attention.bundle", "--cache-dir", "to"], dir.path());
    assert_eq!(import.code, 0, "{}{}", import.stdout, import.stderr);
    assert!(import.stdout.contains("rejected 0"), "{}", import.stdout);
    let rebuilt = build(dir.path(), &workload, "rebuilt", &["--cache-dir", "to", "--incremental"]);
    assert_eq!(cached_computed(&rebuilt), 0, "{}", rebuilt.stderr);
    assert!(package(dir.path(), "rebuilt") == package(dir.path(), "source"));

    let mut bytes = std::fs::read(dir.path().join("all.bundle")).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(dir.path().join("flipped.bundle"), &bytes).unwrap();
    let damaged = ipuq(&["cache", "import", "flipped.bundle", "--cache-dir", "damaged"], dir.path());
    assert_eq!(damaged.code, 1, "a damaged entry must be reported: {}", damaged.stdout);
    assert!(damaged.stdout.contains("rejected 1"), "{}", damaged.stdout);
}

#[test]
fn credentials_never_reach_the_logs() {
    let dir = tempfile::tempdir().unwrap();
    let port = closed_port();
    let out = Command::new(env!("CARGO_BIN_EXE_ipuq"))
        .args(["build", &fixture(MLP), "--target", "small16", "-o", "out", "--cache-dir", "cache"])
        .current_dir(dir.path())
        .env("IPUQ_REMOTE_CACHE", format!("http://ci:hunter2secret@127.0.0.1:{port}/team"))
        .env("IPUQ_LOG", "debug,salsa=warn")
        .output()
        .expect("ipuq runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("***@127.0.0.1"), "{stderr}");
    assert!(!stderr.contains("hunter2secret"), "a password reached the log");
}

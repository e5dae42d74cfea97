//! Integration tests of several builds on one cache at once: threads sharing
//! a handle, threads with their own handles racing garbage collection, and
//! separate processes (this test binary re-invoked as a child).

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Barrier;

use common::{key, open, payload};
use ipuq_cache::Cache;

const SCHEMA: u64 = 0x2_0001;
const SHARED_KEYS: u64 = 12;
const OWN_KEYS: u64 = 6;

/// The payload every writer stores under shared key `input`: identical
/// across writers, as a deterministic stage's output is.
fn shared_payload(input: u64) -> Vec<u8> {
    payload(input, 512 + 97 * input as usize)
}

/// Puts the shared keys and `OWN_KEYS` keys of its own, reading back after
/// each write; panics on any error or wrong payload.
fn write_and_check(cache: &Cache, writer: u64) {
    for input in 0..SHARED_KEYS {
        let entry_key = key("shared", input);
        if let Some(found) = cache.get("shared", &entry_key, SCHEMA) {
            assert_eq!(
                found.as_slice(),
                shared_payload(input).as_slice(),
                "torn shared entry {input}"
            );
        }
        cache
            .put("shared", &entry_key, SCHEMA, &shared_payload(input))
            .expect("shared put");
        let own_input = 1000 * (writer + 1) + input % OWN_KEYS;
        let own_key = key("own", own_input);
        cache
            .put("own", &own_key, SCHEMA, &payload(own_input, 300))
            .expect("own put");
        let found = cache
            .get("own", &own_key, SCHEMA)
            .expect("own entry readable after put");
        assert_eq!(found.as_slice(), payload(own_input, 300).as_slice());
    }
}

/// Every shared entry and every writer's own entries are present and intact.
fn check_final_state(root: &Path, writers: u64) {
    let cache = open(root);
    for input in 0..SHARED_KEYS {
        let found = cache
            .get("shared", &key("shared", input), SCHEMA)
            .expect("shared entry present");
        assert_eq!(found.as_slice(), shared_payload(input).as_slice());
    }
    for writer in 0..writers {
        for input in 0..OWN_KEYS {
            let own_input = 1000 * (writer + 1) + input;
            let found = cache
                .get("own", &key("own", own_input), SCHEMA)
                .expect("own entry present");
            assert_eq!(found.as_slice(), payload(own_input, 300).as_slice());
        }
    }
    let report = cache.verify().expect("verify");
    assert!(report.is_clean(), "{report}");
    assert_eq!(
        cache.stats().expect("stats").entries,
        SHARED_KEYS + writers * OWN_KEYS
    );
    assert!(
        std::fs::read_dir(root.join("tmp"))
            .expect("tmp")
            .next()
            .is_none(),
        "temporary files left behind"
    );
}

#[test]
fn threads_sharing_a_handle_publish_without_tearing() {
    let directory = tempfile::tempdir().expect("tempdir");
    let cache = open(directory.path());
    let writers = 6;
    let barrier = Barrier::new(writers as usize);
    std::thread::scope(|scope| {
        for writer in 0..writers {
            let (cache, barrier) = (&cache, &barrier);
            scope.spawn(move || {
                barrier.wait();
                write_and_check(cache, writer);
            });
        }
    });
    let counters = cache.counters();
    assert_eq!(counters["shared"].writes, writers * SHARED_KEYS);
    assert_eq!(counters["own"].misses, 0);
    check_final_state(directory.path(), writers);
}

#[test]
fn garbage_collection_racing_builds_never_yields_a_wrong_payload() {
    let directory = tempfile::tempdir().expect("tempdir");
    {
        let earlier_build = open(directory.path());
        for input in 0..SHARED_KEYS {
            earlier_build
                .put(
                    "shared",
                    &key("shared", input),
                    SCHEMA,
                    &shared_payload(input),
                )
                .expect("put");
        }
    }
    let collector = open(directory.path());
    let writers = 3;
    std::thread::scope(|scope| {
        for writer in 0..writers {
            let root = directory.path();
            // Each writer has its own handle, as a separate build would.
            scope.spawn(move || write_and_check(&open(root), writer));
        }
        scope.spawn(|| {
            for _ in 0..20 {
                collector.gc(0).expect("gc while builds run");
            }
        });
    });
    // The collector could evict only the earlier build's entries; the
    // writers re-put every shared key, so everything is back.
    check_final_state(directory.path(), writers);
}

/// One test, two roles: run normally it spawns children (this same binary,
/// filtered to this test) that write into one cache at once; run with
/// `IPUQ_CACHE_TEST_CHILD` set it is such a child.
#[test]
fn processes_share_one_cache() {
    if let Ok(spec) = std::env::var("IPUQ_CACHE_TEST_CHILD") {
        let (writer, root) = spec.split_once(':').expect("child spec is writer:root");
        write_and_check(
            &open(Path::new(root)),
            writer.parse().expect("writer number"),
        );
        return;
    }
    let directory = tempfile::tempdir().expect("tempdir");
    let executable = std::env::current_exe().expect("test binary path");
    let writers = 3;
    let children: Vec<_> = (0..writers)
        .map(|writer| {
            Command::new(&executable)
                .args([
                    "--exact",
                    "processes_share_one_cache",
                    "--test-threads=1",
                    "--quiet",
                ])
                .env(
                    "IPUQ_CACHE_TEST_CHILD",
                    format!("{writer}:{}", directory.path().display()),
                )
                .output_spawn()
        })
        .collect();
    for child in children {
        let output = child.wait_with_output().expect("child finishes");
        assert!(
            output.status.success(),
            "child failed: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            String::from_utf8_lossy(&output.stdout).contains("1 passed"),
            "child ran no test"
        );
    }
    check_final_state(directory.path(), writers);
}

trait SpawnPiped {
    fn output_spawn(&mut self) -> std::process::Child;
}

impl SpawnPiped for Command {
    /// Spawns with stdout and stderr captured, so that all children run at
    /// once and their output is shown only on failure.
    fn output_spawn(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn child test process")
    }
}

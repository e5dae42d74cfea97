//! Integration tests of garbage collection: least-recently-used eviction
//! under a size budget, protection of what the running build uses, and
//! cleanup after crashed builds. Each "session" is a fresh `Cache` handle, as
//! each build process would open one.

mod common;

use std::fs;

use common::{key, open, payload};
use ipuq_cache::{Cache, CacheOptions};

const SCHEMA: u64 = 0x3_0001;
const ENTRY_BYTES: usize = 10_000;

fn put_entry(cache: &Cache, input: u64) {
    cache
        .put(
            "plan",
            &key("plan", input),
            SCHEMA,
            &payload(input, ENTRY_BYTES),
        )
        .expect("put");
}

fn present(cache: &Cache, input: u64) -> bool {
    cache.get("plan", &key("plan", input), SCHEMA).is_some()
}

#[test]
fn gc_evicts_least_recently_used_and_keeps_what_is_in_use() {
    let directory = tempfile::tempdir().expect("tempdir");
    {
        let first_build = open(directory.path());
        for input in 0..6 {
            put_entry(&first_build, input);
        }
    }
    {
        // A later build used entries 1 and 4: they are now the most recent.
        let second_build = open(directory.path());
        assert!(present(&second_build, 1) && present(&second_build, 4));
    }
    let build = open(directory.path());
    put_entry(&build, 100);
    let per_entry = build.stats().expect("stats").bytes / 7;
    // Room for three entries: the running build's own, then 1 and 4.
    let report = build.gc(3 * per_entry + per_entry / 2).expect("gc");
    assert_eq!(report.removed_entries, 4, "{report}");
    assert_eq!(report.removed_blobs, 4, "{report}");
    assert!(
        report.bytes_after <= 3 * per_entry + per_entry / 2,
        "{report}"
    );
    assert_eq!(report.bytes_after, build.stats().expect("stats").bytes);

    let after = open(directory.path());
    let kept: Vec<u64> = [0, 1, 2, 3, 4, 5, 100]
        .into_iter()
        .filter(|&input| present(&after, input))
        .collect();
    assert_eq!(kept, vec![1, 4, 100]);
    assert!(after.verify().expect("verify").is_clean());
}

#[test]
fn gc_never_evicts_entries_of_the_running_session() {
    let directory = tempfile::tempdir().expect("tempdir");
    {
        let earlier = open(directory.path());
        put_entry(&earlier, 1);
        put_entry(&earlier, 2);
    }
    let build = open(directory.path());
    put_entry(&build, 3);
    assert!(present(&build, 1), "a hit makes entry 1 in use");
    let report = build.gc(0).expect("gc");
    assert_eq!(report.removed_entries, 1, "{report}");
    assert_eq!(report.protected_entries, 2, "{report}");
    assert!(present(&build, 1) && present(&build, 3));
    assert!(!present(&build, 2));

    // Entries stamped after the collector opened the cache belong to a build
    // running alongside and are protected too.
    let collector = open(directory.path());
    let alongside = open(directory.path());
    put_entry(&alongside, 4);
    let report = collector.gc(0).expect("gc");
    assert_eq!(
        report.removed_entries, 2,
        "entries 1 and 3 are idle for the collector: {report}"
    );
    assert!(present(&alongside, 4));
}

#[test]
fn gc_keeps_a_blob_shared_by_a_surviving_entry() {
    let directory = tempfile::tempdir().expect("tempdir");
    {
        let earlier = open(directory.path());
        earlier
            .put("plan", &key("plan", 1), SCHEMA, b"shared bytes")
            .expect("put");
    }
    let build = open(directory.path());
    build
        .put("schedule", &key("schedule", 1), SCHEMA, b"shared bytes")
        .expect("put");
    let report = build.gc(0).expect("gc");
    assert_eq!(
        (report.removed_entries, report.removed_blobs),
        (1, 0),
        "{report}"
    );
    assert!(build.get("plan", &key("plan", 1), SCHEMA).is_none());
    assert_eq!(
        build
            .get("schedule", &key("schedule", 1), SCHEMA)
            .expect("hit")
            .as_slice(),
        b"shared bytes"
    );
}

#[test]
fn gc_removes_leftovers_of_crashed_builds() {
    let directory = tempfile::tempdir().expect("tempdir");
    let orphan_digest;
    {
        let crashed = open(directory.path());
        orphan_digest = crashed
            .put("plan", &key("plan", 1), SCHEMA, b"orphan")
            .expect("put");
        // Killed after the blob was published but before the manifest.
        fs::remove_file(crashed.manifest_path(&key("plan", 1))).expect("remove manifest");
        put_entry(&crashed, 2);
        // A manifest whose blob vanished, and a broken manifest.
        let dead = crashed
            .put("plan", &key("plan", 3), SCHEMA, b"dead")
            .expect("put");
        fs::remove_file(crashed.blob_path(&dead)).expect("remove blob");
        put_entry(&crashed, 4);
        fs::write(crashed.manifest_path(&key("plan", 4)), b"torn").expect("tear manifest");
        fs::write(directory.path().join("tmp").join("77-3.tmp"), b"partial").expect("temporary");
    }
    let build = open(directory.path());
    let report = build.gc(u64::MAX).expect("gc");
    assert_eq!(report.removed_temporaries, 1, "{report}");
    assert_eq!(
        report.removed_entries, 2,
        "the dead and the torn manifest: {report}"
    );
    // The orphan and the torn entry's blob.
    assert_eq!(report.removed_blobs, 2, "{report}");
    assert!(!build.blob_path(&orphan_digest).exists());
    assert!(
        present(&build, 2),
        "an intact entry survives an unbounded gc"
    );
    let stats = build.stats().expect("stats");
    assert_eq!((stats.entries, stats.blobs), (1, 1));
    assert!(build.verify().expect("verify").is_clean());
}

#[test]
fn enforce_budget_uses_the_configured_size() {
    let directory = tempfile::tempdir().expect("tempdir");
    {
        let earlier = open(directory.path());
        for input in 0..4 {
            put_entry(&earlier, input);
        }
    }
    let unbounded = open(directory.path());
    assert_eq!(unbounded.enforce_budget().expect("no budget"), None);
    let bounded = Cache::open(
        directory.path(),
        CacheOptions {
            read_only: false,
            max_bytes: Some(1),
        },
    )
    .expect("open");
    let report = bounded
        .enforce_budget()
        .expect("gc")
        .expect("a budget is set");
    assert_eq!(report.removed_entries, 4, "{report}");
    assert_eq!(bounded.stats().expect("stats").bytes, 0);
}

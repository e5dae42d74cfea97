//! Integration tests of the cache directory as a whole: read-only and
//! unusable directories, and the inspection and maintenance commands
//! (`stats`, `verify`, `clear`).

mod common;

use std::fs;

use common::{files_under, key, open, open_read_only, payload};
use ipuq_cache::{digest_of, Cache, CacheError, CacheOptions, Problem, HEADER_LEN};

const SCHEMA: u64 = 0x4_0001;

#[test]
fn read_only_cache_serves_hits_and_writes_nothing() {
    let directory = tempfile::tempdir().expect("tempdir");
    open(directory.path())
        .put("plan", &key("plan", 6), SCHEMA, b"stored")
        .expect("put");
    let before = files_under(directory.path());
    let stamp_time =
        |path: &std::path::Path| fs::metadata(path).and_then(|meta| meta.modified()).ok();
    let stamps_before: Vec<_> = before.iter().map(|path| stamp_time(path)).collect();

    let cache = open_read_only(directory.path());
    assert_eq!(
        cache
            .get("plan", &key("plan", 6), SCHEMA)
            .expect("hit")
            .as_slice(),
        b"stored"
    );
    let digest = cache
        .put("plan", &key("plan", 7), SCHEMA, b"new")
        .expect("read-only put is a no-op");
    assert_eq!(digest, digest_of(b"new"));
    assert!(cache.get("plan", &key("plan", 7), SCHEMA).is_none());
    assert!(matches!(cache.gc(0), Err(CacheError::ReadOnly { .. })));
    assert!(matches!(cache.clear(), Err(CacheError::ReadOnly { .. })));
    assert_eq!(files_under(directory.path()), before);
    let stamps_after: Vec<_> = before.iter().map(|path| stamp_time(path)).collect();
    assert_eq!(
        stamps_after, stamps_before,
        "a read-only hit must not touch stamps"
    );

    let missing = directory.path().join("absent");
    assert!(Cache::open(
        &missing,
        CacheOptions {
            read_only: true,
            max_bytes: None
        }
    )
    .is_err());
    assert!(!missing.exists());
}

#[test]
fn unusable_directories_degrade_instead_of_failing() {
    let directory = tempfile::tempdir().expect("tempdir");
    let file = directory.path().join("a-file");
    fs::write(&file, b"not a directory").expect("file");
    let error =
        Cache::open(&file.join("cache"), CacheOptions::default()).expect_err("cannot create");
    assert!(error.to_string().contains("a-file"), "{error}");
    assert!(Cache::open_or_warn(&file.join("cache"), CacheOptions::default()).is_none());

    // A cache whose tmp/ cannot be made is still usable read-only.
    let root = directory.path().join("cache");
    open(&root)
        .put("plan", &key("plan", 8), SCHEMA, b"kept")
        .expect("put");
    fs::remove_dir(root.join("tmp")).expect("remove tmp");
    fs::write(root.join("tmp"), b"in the way").expect("block tmp");
    assert!(Cache::open(&root, CacheOptions::default()).is_err());
    let degraded =
        Cache::open_or_warn(&root, CacheOptions::default()).expect("degrades to read-only");
    assert!(degraded.options().read_only);
    assert_eq!(
        degraded
            .get("plan", &key("plan", 8), SCHEMA)
            .expect("hit")
            .as_slice(),
        b"kept"
    );
    assert!(degraded
        .put_or_warn("plan", &key("plan", 9), SCHEMA, b"dropped")
        .is_some());
}

#[test]
fn stats_verify_and_clear_describe_the_cache() {
    let directory = tempfile::tempdir().expect("tempdir");
    let cache = open(directory.path());
    for input in 0..3 {
        cache
            .put("plan", &key("plan", input), SCHEMA, &payload(input, 100))
            .expect("put");
    }
    cache
        .put("schedule", &key("schedule", 0), SCHEMA, &payload(10, 50))
        .expect("put");
    let stats = cache.stats().expect("stats");
    assert_eq!(
        (stats.entries, stats.blobs, stats.unreadable_entries),
        (4, 4, 0)
    );
    assert_eq!(stats.per_stage["plan"].entries, 3);
    assert_eq!(stats.per_stage["plan"].payload_bytes, 300);
    assert_eq!(stats.per_stage["schedule"].entries, 1);
    assert!(stats.bytes > 350 + 4 * HEADER_LEN as u64);
    assert!(
        stats.to_string().starts_with("4 entries, 4 blobs"),
        "{stats}"
    );

    fs::write(directory.path().join("cas").join("stray"), b"?").expect("stray file");
    let report = cache.verify().expect("verify");
    assert_eq!((report.blobs_checked, report.manifests_checked), (5, 4));
    assert_eq!(report.damaged.len(), 1, "{report}");
    assert_eq!(report.damaged[0].problem, Problem::UnexpectedFile);

    cache.clear().expect("clear");
    let cleared = cache.stats().expect("stats");
    assert_eq!((cleared.entries, cleared.blobs, cleared.bytes), (0, 0, 0));
    assert!(cache.get("plan", &key("plan", 0), SCHEMA).is_none());
    cache
        .put("plan", &key("plan", 0), SCHEMA, b"after clear")
        .expect("put after clear");
    assert!(cache.get("plan", &key("plan", 0), SCHEMA).is_some());
}

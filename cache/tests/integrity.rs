//! Integration tests of entries used by one thread: round trips, damaged and
//! stale entries, key collisions, and crashes during publish. The directory
//! as a whole, concurrency and garbage collection have their own files.

mod common;

use std::fs;

use common::{flip_bit, key, open, payload, truncate};
use ipuq_cache::{digest_of, Problem, HEADER_LEN};

const SCHEMA: u64 = 0x1_0001;

#[test]
fn round_trip_returns_the_payload_aligned_and_counts() {
    let directory = tempfile::tempdir().expect("tempdir");
    let cache = open(directory.path());
    let plan_key = key("plan", 1);
    let bytes = payload(1, 1000);
    assert!(cache.get("plan", &plan_key, SCHEMA).is_none());
    let digest = cache.put("plan", &plan_key, SCHEMA, &bytes).expect("put");
    assert_eq!(digest, digest_of(&bytes));
    let hit = cache.get("plan", &plan_key, SCHEMA).expect("hit after put");
    assert_eq!(hit.as_slice(), bytes.as_slice());
    assert_eq!(
        hit.as_ptr() as usize % 16,
        0,
        "payload must be 16-byte aligned for rkyv"
    );
    let counters = cache.counters();
    assert_eq!(
        (
            counters["plan"].hits,
            counters["plan"].misses,
            counters["plan"].writes
        ),
        (1, 1, 1)
    );

    // Another process (a fresh handle) sees the entry; the empty payload works too.
    let again = open(directory.path());
    assert_eq!(
        again
            .get("plan", &plan_key, SCHEMA)
            .expect("hit")
            .as_slice(),
        bytes.as_slice()
    );
    again
        .put("empty", &key("empty", 0), SCHEMA, b"")
        .expect("empty put");
    assert_eq!(
        again
            .get("empty", &key("empty", 0), SCHEMA)
            .expect("empty hit")
            .len(),
        0
    );
    assert_eq!(again.counters()["plan"].hits, 1);
    assert!(!again.counters().contains_key("schedule"));
}

#[test]
fn published_files_have_the_documented_layout() {
    let directory = tempfile::tempdir().expect("tempdir");
    let cache = open(directory.path());
    let digest = cache
        .put("plan", &key("plan", 2), SCHEMA, b"twelve bytes")
        .expect("put");
    let blob = fs::read(cache.blob_path(&digest)).expect("blob file");
    assert_eq!(&blob[..8], b"IPUQCACH");
    assert_eq!(blob.len(), HEADER_LEN + 12);
    assert_eq!(&blob[HEADER_LEN..], b"twelve bytes");
    let hex = ipuq_cache::to_hex(&digest);
    assert!(cache
        .blob_path(&digest)
        .ends_with(format!("cas/{}/{}", &hex[..2], &hex[2..])));
    let manifest = fs::read(cache.manifest_path(&key("plan", 2))).expect("manifest file");
    assert_eq!(&manifest[16..24], &SCHEMA.to_le_bytes());
    assert!(fs::read_dir(directory.path().join("tmp"))
        .expect("tmp")
        .next()
        .is_none());
    assert!(directory.path().join("gc.lock").is_file());
}

/// Damages the blob of a fresh entry with `damage`, checks that the entry
/// misses (and `verify` notices), then that one put repairs it.
fn check_blob_damage_is_repaired(damage: impl Fn(&std::path::Path)) {
    let directory = tempfile::tempdir().expect("tempdir");
    let cache = open(directory.path());
    let entry_key = key("tile-code", 7);
    let bytes = payload(7, 4096);
    let digest = cache
        .put("tile-code", &entry_key, SCHEMA, &bytes)
        .expect("put");
    damage(&cache.blob_path(&digest));
    assert!(
        !cache.verify().expect("verify").is_clean(),
        "verify must see the damage"
    );
    assert!(
        cache.get("tile-code", &entry_key, SCHEMA).is_none(),
        "damaged entry must miss"
    );
    cache
        .put("tile-code", &entry_key, SCHEMA, &bytes)
        .expect("repairing put");
    assert_eq!(
        cache
            .get("tile-code", &entry_key, SCHEMA)
            .expect("repaired")
            .as_slice(),
        bytes.as_slice()
    );
    assert!(cache.verify().expect("verify").is_clean());
    let counters = cache.counters()["tile-code"];
    assert_eq!((counters.hits, counters.misses, counters.writes), (1, 1, 2));
}

#[test]
fn deleted_blob_misses_then_put_repairs() {
    check_blob_damage_is_repaired(|path| fs::remove_file(path).expect("delete blob"));
}

#[test]
fn truncated_blob_misses_then_put_repairs() {
    check_blob_damage_is_repaired(|path| truncate(path, HEADER_LEN + 100));
}

#[test]
fn bit_flipped_blob_misses_then_put_repairs() {
    check_blob_damage_is_repaired(|path| flip_bit(path, HEADER_LEN + 2000));
}

#[test]
fn damaged_blob_header_misses_then_put_repairs() {
    check_blob_damage_is_repaired(|path| flip_bit(path, 0));
}

#[test]
fn damaged_manifest_misses_then_put_repairs() {
    let directory = tempfile::tempdir().expect("tempdir");
    let cache = open(directory.path());
    let entry_key = key("plan", 3);
    cache
        .put("plan", &entry_key, SCHEMA, b"plan bytes")
        .expect("put");
    flip_bit(&cache.manifest_path(&entry_key), HEADER_LEN + 40);
    assert!(cache.get("plan", &entry_key, SCHEMA).is_none());
    cache
        .put("plan", &entry_key, SCHEMA, b"plan bytes")
        .expect("repairing put");
    assert_eq!(
        cache
            .get("plan", &entry_key, SCHEMA)
            .expect("repaired")
            .as_slice(),
        b"plan bytes"
    );
}

#[test]
fn manifest_pointing_at_a_missing_blob_is_a_miss() {
    let directory = tempfile::tempdir().expect("tempdir");
    let cache = open(directory.path());
    let entry_key = key("plan", 4);
    cache
        .put("plan", &entry_key, SCHEMA, b"plan bytes")
        .expect("put");
    fs::remove_dir_all(directory.path().join("cas")).expect("remove every blob");
    assert!(cache.get("plan", &entry_key, SCHEMA).is_none());
    fs::create_dir(directory.path().join("cas")).expect("recreate cas");
    let report = cache.verify().expect("verify");
    assert_eq!(report.damaged.len(), 1, "{report}");
    assert_eq!(report.damaged[0].path, cache.manifest_path(&entry_key));
    assert!(matches!(
        report.damaged[0].problem,
        Problem::BrokenBlob { .. }
    ));
    cache
        .put("plan", &entry_key, SCHEMA, b"plan bytes")
        .expect("repairing put");
    assert!(cache.get("plan", &entry_key, SCHEMA).is_some());
}

#[test]
fn bumped_schema_is_a_clean_miss() {
    let directory = tempfile::tempdir().expect("tempdir");
    let cache = open(directory.path());
    let entry_key = key("schedule", 1);
    cache
        .put("schedule", &entry_key, SCHEMA, b"old layout")
        .expect("put");
    assert!(cache.get("schedule", &entry_key, SCHEMA + 1).is_none());
    // A stale entry is not damage: it is left for the binary that wrote it.
    assert!(cache.get("schedule", &entry_key, SCHEMA).is_some());
    cache
        .put("schedule", &entry_key, SCHEMA + 1, b"new layout")
        .expect("put new schema");
    assert_eq!(
        cache
            .get("schedule", &entry_key, SCHEMA + 1)
            .expect("hit")
            .as_slice(),
        b"new layout"
    );
    assert!(cache.get("schedule", &entry_key, SCHEMA).is_none());
}

#[test]
fn a_key_shared_by_two_stages_never_gives_a_wrong_hit() {
    let directory = tempfile::tempdir().expect("tempdir");
    let cache = open(directory.path());
    let shared_key = key("collide", 1);
    cache
        .put("plan", &shared_key, SCHEMA, b"plan")
        .expect("put plan");
    assert!(cache.get("schedule", &shared_key, SCHEMA).is_none());
    assert_eq!(
        cache
            .get("plan", &shared_key, SCHEMA)
            .expect("hit")
            .as_slice(),
        b"plan"
    );
}

#[test]
fn identical_payloads_share_one_blob() {
    let directory = tempfile::tempdir().expect("tempdir");
    let cache = open(directory.path());
    let first = cache
        .put("plan", &key("plan", 5), SCHEMA, b"same")
        .expect("put");
    let second = cache
        .put("schedule", &key("schedule", 5), SCHEMA + 9, b"same")
        .expect("put");
    assert_eq!(first, second);
    let stats = cache.stats().expect("stats");
    assert_eq!((stats.entries, stats.blobs), (2, 1));
    assert_eq!(
        cache
            .get("schedule", &key("schedule", 5), SCHEMA + 9)
            .expect("hit")
            .as_slice(),
        b"same"
    );
}

#[test]
fn crash_mid_publish_leaves_nothing_that_breaks_the_next_build() {
    let directory = tempfile::tempdir().expect("tempdir");
    let cache = open(directory.path());
    let entry_key = key("tile-code", 9);
    let bytes = payload(9, 3000);
    // A killed build left a partial temporary, a blob cut short at its final
    // name (as a non-atomic writer would), and a half manifest.
    fs::write(
        directory.path().join("tmp").join("4242-0.tmp"),
        &bytes[..100],
    )
    .expect("garbage");
    let full = {
        let scratch = tempfile::tempdir().expect("scratch");
        let scratch_cache = open(scratch.path());
        scratch_cache
            .put("tile-code", &entry_key, SCHEMA, &bytes)
            .expect("scratch put");
        let blob = fs::read(scratch_cache.blob_path(&digest_of(&bytes))).expect("blob");
        let manifest = fs::read(scratch_cache.manifest_path(&entry_key)).expect("manifest");
        (blob, manifest)
    };
    let blob_path = cache.blob_path(&digest_of(&bytes));
    fs::create_dir_all(blob_path.parent().expect("fan-out")).expect("fan-out dir");
    fs::write(&blob_path, &full.0[..full.0.len() / 2]).expect("half blob");
    let manifest_path = cache.manifest_path(&entry_key);
    fs::create_dir_all(manifest_path.parent().expect("fan-out")).expect("fan-out dir");
    fs::write(&manifest_path, &full.1[..full.1.len() - 3]).expect("half manifest");

    assert!(cache.get("tile-code", &entry_key, SCHEMA).is_none());
    cache
        .put("tile-code", &entry_key, SCHEMA, &bytes)
        .expect("put after crash");
    assert_eq!(
        cache
            .get("tile-code", &entry_key, SCHEMA)
            .expect("hit")
            .as_slice(),
        bytes.as_slice()
    );
    assert_eq!(fs::read(&blob_path).expect("blob"), full.0);
    let report = cache.gc(u64::MAX).expect("gc");
    assert_eq!(report.removed_temporaries, 1);
    assert!(cache.verify().expect("verify").is_clean());
}

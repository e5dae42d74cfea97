//! Unit tests of the remote tier's semantics against an in-memory backend
//! (the fault tests against real sockets are in `cache/tests/remote.rs`).

use std::collections::HashMap;
use std::sync::Mutex;

use super::*;
use std::sync::atomic::AtomicU64;
use crate::CacheOptions;

/// An in-memory backend that can be told to fail or to answer junk.
#[derive(Default)]
struct Memory {
    entries: Mutex<HashMap<String, Vec<u8>>>,
    failing: AtomicBool,
    junk: AtomicBool,
    requests: AtomicU64,
}

impl Backend for Memory {
    fn get(&self, area: Area, hex: &str) -> Result<Option<Vec<u8>>, RemoteError> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if self.failing.load(Ordering::Relaxed) {
            return Err(RemoteError::Transport("connection refused".into()));
        }
        if self.junk.load(Ordering::Relaxed) {
            return Ok(Some(b"<html>junk</html>".to_vec()));
        }
        Ok(self.entries.lock().unwrap().get(&format!("{}/{hex}", area.dir())).cloned())
    }
    fn contains(&self, area: Area, hex: &str) -> Result<bool, RemoteError> {
        Ok(self.get(area, hex)?.is_some())
    }
    fn put(&self, area: Area, hex: &str, bytes: &[u8]) -> Result<(), RemoteError> {
        if self.failing.load(Ordering::Relaxed) {
            return Err(RemoteError::Status(503));
        }
        self.entries.lock().unwrap().insert(format!("{}/{hex}", area.dir()), bytes.to_vec());
        Ok(())
    }
}

fn cache() -> (tempfile::TempDir, Cache) {
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = Cache::open(dir.path(), CacheOptions::default()).expect("cache");
    (dir, cache)
}

#[test]
fn uploaded_entries_are_fetched_verified_and_copied_locally() {
    let memory = Arc::new(Memory::default());
    let mut writer = Remote::with_backend(memory.clone(), &RemoteOptions::new("mem://"));
    writer.upload("plan", &[1; 32], 5, b"payload");
    writer.finish(None);
    assert_eq!(memory.entries.lock().unwrap().len(), 2, "blob and manifest");

    let (_dir, local) = cache();
    let reader = Remote::with_backend(memory.clone(), &RemoteOptions { read_only: true, ..RemoteOptions::new("mem://") });
    assert_eq!(reader.fetch(&local, "plan", &[1; 32], 5).expect("hit").as_slice(), b"payload");
    assert_eq!(local.get("plan", &[1; 32], 5).expect("copied locally").as_slice(), b"payload");
    assert!(reader.fetch(&local, "plan", &[2; 32], 5).is_none(), "absent key");
    assert!(reader.fetch(&local, "code", &[1; 32], 5).is_none(), "manifest for another stage");
    assert!(reader.fetch(&local, "plan", &[1; 32], 6).is_none(), "another schema");
    let counters = reader.counters();
    assert_eq!((counters.hits, counters.misses), (1, 3));
    assert_eq!(counters.errors, 2, "wrong stage and schema are bad entries");
    assert!(counters.bytes_down > 7);
}

#[test]
fn a_tampered_blob_is_never_returned_nor_stored() {
    let memory = Arc::new(Memory::default());
    let mut writer = Remote::with_backend(memory.clone(), &RemoteOptions::new("mem://"));
    writer.upload("plan", &[1; 32], 5, b"payload");
    writer.finish(None);
    for (name, bytes) in memory.entries.lock().unwrap().iter_mut() {
        if name.starts_with("cas/") {
            bytes[0] ^= 1;
        }
    }
    let (_dir, local) = cache();
    let reader = Remote::with_backend(memory.clone(), &RemoteOptions::new("mem://"));
    assert!(reader.fetch(&local, "plan", &[1; 32], 5).is_none());
    assert!(local.get("plan", &[1; 32], 5).is_none(), "bad bytes stored locally");
    assert_eq!(reader.counters().errors, 1);
}

#[test]
fn a_failing_remote_is_disabled_after_a_few_failures() {
    let memory = Arc::new(Memory::default());
    memory.junk.store(true, Ordering::Relaxed);
    let (_dir, local) = cache();
    let remote = Remote::with_backend(memory.clone(), &RemoteOptions::new("mem://"));
    for n in 0..10u8 {
        assert!(remote.fetch(&local, "plan", &[n; 32], 5).is_none());
    }
    assert!(remote.is_disabled());
    assert_eq!(memory.requests.load(Ordering::Relaxed), u64::from(FAILURES_TO_DISABLE));
    assert_eq!(remote.counters().errors, u64::from(FAILURES_TO_DISABLE));
    remote.upload("plan", &[1; 32], 5, b"x");
    assert!(memory.entries.lock().unwrap().is_empty(), "disabled remote uploads nothing");
}

#[test]
fn failed_uploads_are_counted_and_read_only_uploads_nothing() {
    let memory = Arc::new(Memory::default());
    let mut read_only = Remote::with_backend(memory.clone(), &RemoteOptions { read_only: true, ..RemoteOptions::new("mem://") });
    read_only.upload("plan", &[1; 32], 5, b"x");
    read_only.finish(None);
    assert!(memory.entries.lock().unwrap().is_empty());

    memory.failing.store(true, Ordering::Relaxed);
    let (_dir, local) = cache();
    let mut writer = Remote::with_backend(memory.clone(), &RemoteOptions::new("mem://"));
    writer.upload("plan", &[1; 32], 5, b"x");
    std::thread::sleep(Duration::from_millis(50));
    let counters = writer.counters();
    writer.finish(Some(&local));
    assert_eq!((counters.uploads, counters.uploads_dropped), (0, 1));
    assert_eq!(local.remote_totals().errors, 1, "totals persisted in the cache directory");
}

#[test]
fn urls_are_redacted_and_checked() {
    assert_eq!(redact("http://ci:s3cret@cache:8080/ipuq"), "http://***@cache:8080/ipuq");
    assert_eq!(redact("redis://:pw@127.0.0.1:6379/2"), "redis://***@127.0.0.1:6379/2");
    assert_eq!(redact("http://cache:8080/a@b"), "http://cache:8080/a@b");
    let error = Remote::open(&RemoteOptions::new("https://u:pw@cache/x")).expect_err("no TLS");
    assert!(error.to_string().contains("TLS") && !error.to_string().contains("pw"), "{error}");
    assert!(Remote::open(&RemoteOptions::new("ftp://cache")).is_err());
    assert!(!format!("{:?}", RemoteOptions::new("http://u:pw@h:1/p")).contains("pw"));
    assert!(Remote::open(&RemoteOptions::new("redis://127.0.0.1:1/0")).is_ok(), "opening sends nothing");
}

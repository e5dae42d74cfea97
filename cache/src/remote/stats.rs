//! Remote-cache counters: live atomics for this process, and running totals
//! kept in the cache directory so that `ipuq cache stats`, a later process,
//! can report them.
//!
//! The totals live in `<root>/remote-stats` (one `name value` line each),
//! updated under an exclusive `flock` on `<root>/remote-stats.lock` and
//! published by rename, so concurrent builds add up and a crash leaves the
//! old totals. They are bookkeeping, never content: nothing reads them into
//! a key or a payload, and an unreadable file counts as zeros.

use std::fmt;
use std::fs::{self, OpenOptions};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::inspect::human_bytes;
use crate::publish::{lock, publish, LockMode};
use crate::store::Cache;

/// What the remote tier did: in one process, or summed over processes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RemoteCounters {
    /// Look-ups answered with a verified entry.
    pub hits: u64,
    /// Look-ups that found nothing usable (absent, or failed).
    pub misses: u64,
    /// Failed requests: unreachable, timeout, HTTP error, bad bytes.
    pub errors: u64,
    /// Body bytes received.
    pub bytes_down: u64,
    /// Body bytes sent.
    pub bytes_up: u64,
    /// Entries uploaded (manifest and blob both stored).
    pub uploads: u64,
    /// Entries not uploaded: queue full, remote disabled, or the wait at exit ran out.
    pub uploads_dropped: u64,
}

const FIELDS: [&str; 7] = ["hits", "misses", "errors", "bytes_down", "bytes_up", "uploads", "uploads_dropped"];

impl RemoteCounters {
    fn values(&self) -> [u64; 7] {
        [self.hits, self.misses, self.errors, self.bytes_down, self.bytes_up, self.uploads, self.uploads_dropped]
    }

    fn from_values(v: [u64; 7]) -> RemoteCounters {
        RemoteCounters { hits: v[0], misses: v[1], errors: v[2], bytes_down: v[3], bytes_up: v[4], uploads: v[5], uploads_dropped: v[6] }
    }

    /// Whether nothing happened.
    pub fn is_empty(&self) -> bool {
        self.values().iter().all(|&v| v == 0)
    }

    fn added(&self, other: &RemoteCounters) -> RemoteCounters {
        let (a, b) = (self.values(), other.values());
        RemoteCounters::from_values(std::array::from_fn(|i| a[i].saturating_add(b[i])))
    }

    fn encode(&self) -> String {
        FIELDS.iter().zip(self.values()).map(|(name, value)| format!("{name} {value}\n")).collect()
    }

    /// Parses [`RemoteCounters::encode`]'s text; unknown lines are ignored
    /// and a malformed one makes the whole file `None`.
    fn decode(text: &str) -> Option<RemoteCounters> {
        let mut values = [0u64; 7];
        for line in text.lines().filter(|line| !line.trim().is_empty()) {
            let (name, value) = line.split_once(' ')?;
            let value: u64 = value.trim().parse().ok()?;
            if let Some(index) = FIELDS.iter().position(|field| *field == name) {
                values[index] = value;
            }
        }
        Some(RemoteCounters::from_values(values))
    }
}

impl fmt::Display for RemoteCounters {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "{} hits, {} misses, {} errors, {} down, {} up, {} uploads, {} uploads dropped",
            self.hits,
            self.misses,
            self.errors,
            human_bytes(self.bytes_down),
            human_bytes(self.bytes_up),
            self.uploads,
            self.uploads_dropped
        )
    }
}

/// The counters of the running process.
#[derive(Debug, Default)]
pub(crate) struct Live {
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) bytes_down: AtomicU64,
    pub(crate) bytes_up: AtomicU64,
    pub(crate) uploads: AtomicU64,
    pub(crate) uploads_dropped: AtomicU64,
}

impl Live {
    fn all(&self) -> [&AtomicU64; 7] {
        [&self.hits, &self.misses, &self.errors, &self.bytes_down, &self.bytes_up, &self.uploads, &self.uploads_dropped]
    }

    pub(crate) fn snapshot(&self) -> RemoteCounters {
        RemoteCounters::from_values(self.all().map(|a| a.load(Ordering::Relaxed)))
    }

    /// The counters so far, reset to zero (so totals are added once).
    pub(crate) fn take(&self) -> RemoteCounters {
        RemoteCounters::from_values(self.all().map(|a| a.swap(0, Ordering::Relaxed)))
    }
}

impl Cache {
    fn remote_stats_path(&self) -> PathBuf {
        self.root.join("remote-stats")
    }

    /// Remote-cache counters summed over every process that used this cache
    /// directory with a remote (since the directory was created or cleared).
    pub fn remote_totals(&self) -> RemoteCounters {
        fs::read_to_string(self.remote_stats_path())
            .ok()
            .and_then(|text| RemoteCounters::decode(&text))
            .unwrap_or_default()
    }

    /// Forgets the remote-cache totals (part of `clear`).
    pub(crate) fn reset_remote_totals(&self) {
        crate::publish::remove_quietly(&self.remote_stats_path());
    }
}

/// Adds `counters` to the totals in `cache`'s directory. Failure only loses
/// statistics, so it is a debug line.
pub(crate) fn add_to_totals(cache: &Cache, counters: &RemoteCounters) {
    if cache.options().read_only {
        return;
    }
    let lock_path = cache.root.join("remote-stats.lock");
    let result = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&lock_path)
        .map_err(|error| error.to_string())
        .and_then(|_| lock(&lock_path, LockMode::Exclusive).map_err(|error| error.to_string()))
        .and_then(|_guard| {
            let total = cache.remote_totals().added(counters);
            publish(&cache.tmp_dir(), &cache.remote_stats_path(), &[total.encode().as_bytes()]).map_err(|error| error.to_string())
        });
    if let Err(error) = result {
        tracing::debug!(%error, "could not record remote-cache statistics");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CacheOptions;

    #[test]
    fn totals_add_up_across_processes_and_survive_junk() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = Cache::open(dir.path(), CacheOptions::default()).expect("cache");
        assert!(cache.remote_totals().is_empty());
        let one = RemoteCounters { hits: 2, misses: 1, errors: 0, bytes_down: 100, bytes_up: 0, uploads: 0, uploads_dropped: 0 };
        add_to_totals(&cache, &one);
        add_to_totals(&cache, &RemoteCounters { errors: 3, uploads: 4, ..one });
        let total = cache.remote_totals();
        assert_eq!((total.hits, total.misses, total.errors, total.bytes_down, total.uploads), (4, 2, 3, 200, 4));
        assert!(total.to_string().starts_with("4 hits, 2 misses, 3 errors, 200 B down"), "{total}");
        fs::write(cache.remote_stats_path(), b"hits lots\n").expect("junk");
        assert!(cache.remote_totals().is_empty());
        cache.reset_remote_totals();
        assert!(cache.remote_totals().is_empty());
    }
}

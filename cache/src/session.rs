//! What this process has done with the cache: when it started, which entries
//! it used or wrote, and per-stage hit, miss and write counters.
//!
//! The session serves two purposes. Garbage collection never evicts an entry
//! this process touched (and nothing stamped since the session began, which
//! covers builds running alongside), and the command line prints the counters
//! with `--timings`. Nothing here is written to disk or hashed into a key:
//! times and counts must never leak into payloads.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::{Mutex, MutexGuard};
use std::time::SystemTime;

use crate::key::Key;

/// Cache activity of one stage in the current process.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StageCounters {
    /// Lookups that returned a payload.
    pub hits: u64,
    /// Lookups that found nothing usable (absent, stale or damaged).
    pub misses: u64,
    /// Successful `put`s (including those that found the entry already
    /// present, and none in read-only mode).
    pub writes: u64,
    /// Payload bytes returned by hits.
    pub bytes_read: u64,
    /// Payload bytes handed to successful `put`s.
    pub bytes_written: u64,
}

impl StageCounters {
    /// Hits as a fraction of lookups, or `None` before the first lookup.
    pub fn hit_rate(&self) -> Option<f64> {
        let lookups = self.hits + self.misses;
        (lookups > 0).then(|| self.hits as f64 / lookups as f64)
    }
}

impl fmt::Display for StageCounters {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "{} hit{}, {} miss{}, {} write{}",
            self.hits,
            plural(self.hits, "s"),
            self.misses,
            plural(self.misses, "es"),
            self.writes,
            plural(self.writes, "s"),
        )
    }
}

fn plural(count: u64, suffix: &'static str) -> &'static str {
    if count == 1 {
        ""
    } else {
        suffix
    }
}

/// Per-process state shared by all threads using one [`crate::Cache`].
#[derive(Debug)]
pub(crate) struct Session {
    /// When the cache was opened; entries stamped at or after this time are
    /// in use by this or a concurrent build and are not evicted.
    pub(crate) start: SystemTime,
    touched: Mutex<HashSet<Key>>,
    counters: Mutex<BTreeMap<String, StageCounters>>,
}

/// Which counter an event bumps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    Hit { bytes: u64 },
    Miss,
    Write { bytes: u64 },
}

impl Session {
    pub(crate) fn new() -> Session {
        Session {
            start: SystemTime::now(),
            touched: Mutex::new(HashSet::new()),
            counters: Mutex::new(BTreeMap::new()),
        }
    }

    /// Records that this process used or wrote `key`. Returns whether this
    /// is the first time, so that a hit refreshes its on-disk stamp only once
    /// per process and repeated hits stay cheap.
    pub(crate) fn touch(&self, key: &Key) -> bool {
        relock(&self.touched).insert(*key)
    }

    /// Every key this process used or wrote, sorted.
    pub(crate) fn touched_keys(&self) -> Vec<Key> {
        let mut keys: Vec<Key> = relock(&self.touched).iter().copied().collect();
        keys.sort_unstable();
        keys
    }

    /// Whether this process used or wrote `key`.
    pub(crate) fn has_touched(&self, key: &Key) -> bool {
        relock(&self.touched).contains(key)
    }

    pub(crate) fn record(&self, stage: &str, event: Event) {
        let mut counters = relock(&self.counters);
        let entry = match counters.get_mut(stage) {
            Some(entry) => entry,
            None => counters.entry(stage.to_owned()).or_default(),
        };
        match event {
            Event::Hit { bytes } => {
                entry.hits += 1;
                entry.bytes_read += bytes;
            }
            Event::Miss => entry.misses += 1,
            Event::Write { bytes } => {
                entry.writes += 1;
                entry.bytes_written += bytes;
            }
        }
    }

    pub(crate) fn counters(&self) -> BTreeMap<String, StageCounters> {
        relock(&self.counters).clone()
    }
}

/// Locks a mutex, recovering from poisoning: the guarded data are counters
/// and a set of keys, which a panicking thread cannot leave inconsistent.
fn relock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_stage_and_touches_once() {
        let session = Session::new();
        session.record("plan", Event::Miss);
        session.record("plan", Event::Write { bytes: 10 });
        session.record("plan", Event::Hit { bytes: 10 });
        session.record("schedule", Event::Hit { bytes: 4 });
        let counters = session.counters();
        assert_eq!(
            counters["plan"],
            StageCounters {
                hits: 1,
                misses: 1,
                writes: 1,
                bytes_read: 10,
                bytes_written: 10
            }
        );
        assert_eq!(counters["schedule"].hits, 1);
        assert_eq!(counters["plan"].hit_rate(), Some(0.5));
        assert_eq!(counters["plan"].to_string(), "1 hit, 1 miss, 1 write");
        assert_eq!(
            StageCounters::default().to_string(),
            "0 hits, 0 misses, 0 writes"
        );
        assert!(session.touch(&[1; 32]));
        assert!(!session.touch(&[1; 32]));
        assert!(session.has_touched(&[1; 32]));
        assert!(!session.has_touched(&[2; 32]));
    }
}

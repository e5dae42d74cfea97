//! Per-phase entries of the exchange stages: one schedule per distinct pattern, one set of
//! tables per phase whose addresses or schedule moved.
//!
//! A phase's entry is found in this process's memo (the previous build's entries), then in
//! the disk store, else computed. Entries with equal keys are computed once per build. What is
//! missing is computed in parallel with rayon over plain data (no query runs on a rayon
//! worker: `api-notes.md`) and collected in phase order, so the output is the same at any
//! thread count.
//!
//! The package's tile images use the same memo without the disk store (`per_tile`): the
//! package is never stored, so neither are its parts; they are not stage runs either (the
//! driver's `computed` column counts cache entries), so they report their own counts.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use rayon::prelude::*;

use crate::db::{CompileError, StageCache, Staged};
use crate::hash::{Digest, KeyHasher};

/// An in-process memo of per-phase entries by key: holds the latest build's entries only.
pub type Memo<T> = Mutex<HashMap<Digest, Staged<T>>>;

/// What a per-entry memo holds: shared by rayon workers, and stored and loaded with rkyv.
pub(crate) trait Entry:
    Clone
    + Send
    + Sync
    + 'static
    + rkyv::Archive<
        Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
                      + rkyv::Deserialize<Self, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
    > + crate::db::Canonical
{
}

impl<T> Entry for T
where
    T: Clone + Send + Sync + 'static + rkyv::Archive + crate::db::Canonical,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
{
}

/// How an entry was obtained, counted over one call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryCounts {
    /// Entries asked for (one per phase or tile).
    pub entries: usize,
    /// Distinct keys among them.
    pub distinct: usize,
    /// Distinct keys found in the memo (or on disk).
    pub reused: usize,
    /// Distinct keys computed.
    pub computed: usize,
}

/// Where entries live besides the in-process memo.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tier {
    /// The disk store too: loaded, published, and noted as stage runs.
    Disk,
    /// The memo only: never stored, not noted.
    Memory,
}

/// For each phase, the first phase with the same schedule digest (itself when it is the
/// first): the same phase of repeated layers maps to the first layer's.
pub(crate) fn first_of_schedule(digests: &[Digest]) -> Vec<usize> {
    let mut first: HashMap<Digest, usize> = HashMap::new();
    digests.iter().enumerate().map(|(i, d)| *first.entry(*d).or_insert(i)).collect()
}

/// The entry of every phase, in phase order; `keys[i]` is phase i's key, `compute(i)` makes it.
pub(crate) fn per_phase<T>(
    db: &StageCache,
    stage: &'static str,
    version: u32,
    keys: &[Digest],
    memo: &Memo<T>,
    compute: impl Fn(usize) -> Result<T, CompileError> + Sync,
) -> Result<Vec<Staged<T>>, CompileError>
where
    T: Entry,
{
    Ok(memoized(db, stage, version, keys, memo, Tier::Disk, &compute)?.0)
}

/// The entry of every tile, in tile order, from the in-process memo or computed (never the
/// disk store; see the module note), with how many were reused and computed.
pub(crate) fn per_tile<T>(
    db: &StageCache,
    stage: &'static str,
    version: u32,
    keys: &[Digest],
    memo: &Memo<T>,
    compute: impl Fn(usize) -> Result<T, CompileError> + Sync,
) -> Result<(Vec<Staged<T>>, EntryCounts), CompileError>
where
    T: Entry,
{
    memoized(db, stage, version, keys, memo, Tier::Memory, &compute)
}

fn memoized<T>(
    db: &StageCache,
    stage: &'static str,
    version: u32,
    keys: &[Digest],
    memo: &Memo<T>,
    tier: Tier,
    compute: &(impl Fn(usize) -> Result<T, CompileError> + Sync),
) -> Result<(Vec<Staged<T>>, EntryCounts), CompileError>
where
    T: Entry,
{
    let previous = std::mem::take(&mut *memo.lock().expect("phase memo lock"));
    let result = collect(db, stage, version, keys, &previous, tier, compute);
    *memo.lock().expect("phase memo lock") = match &result {
        Ok((found, _)) => found.clone(),
        Err(_) => previous,
    };
    let (found, counts) = result?;
    Ok((keys.iter().map(|key| found[key].clone()).collect(), counts))
}

fn collect<T>(
    db: &StageCache,
    stage: &'static str,
    version: u32,
    keys: &[Digest],
    previous: &HashMap<Digest, Staged<T>>,
    tier: Tier,
    compute: &(impl Fn(usize) -> Result<T, CompileError> + Sync),
) -> Result<(HashMap<Digest, Staged<T>>, EntryCounts), CompileError>
where
    T: Entry,
{
    let mut found: HashMap<Digest, Staged<T>> = HashMap::new();
    let mut missing: Vec<usize> = Vec::new();
    let mut pending: HashSet<Digest> = HashSet::new();
    let mut counts = EntryCounts { entries: keys.len(), ..EntryCounts::default() };
    for (index, key) in keys.iter().enumerate() {
        if found.contains_key(key) || pending.contains(key) {
            continue;
        }
        counts.distinct += 1;
        if tier == Tier::Disk && db.verifying() {
            found.insert(*key, db.cached(stage, version, *key, || compute(index))?);
            counts.computed += 1;
            continue;
        }
        let hit = match tier {
            Tier::Disk => previous.get(key).cloned().or_else(|| db.load(stage, version, key)),
            Tier::Memory => previous.get(key).cloned(),
        };
        if let Some(hit) = hit {
            found.insert(*key, hit);
            counts.reused += 1;
        } else {
            pending.insert(*key);
            missing.push(index);
        }
    }
    let span = tracing::Span::current();
    let fresh: Vec<Result<T, CompileError>> = missing
        .par_iter()
        .map(|&index| {
            let _span = span.enter();
            compute(index)
        })
        .collect();
    counts.computed += missing.len();
    for (&index, value) in missing.iter().zip(fresh) {
        let key = keys[index];
        let entry = match tier {
            Tier::Disk => db.save(stage, version, key, value?)?,
            // An entry that is never published is known by its key (its value is a function
            // of what the key digests), so its bytes are not serialised to digest them.
            Tier::Memory => Staged { digest: key, value: std::sync::Arc::new(value?) },
        };
        found.insert(key, entry);
    }
    Ok((found, counts))
}

/// Digest of a stage made of per-phase entries: the entries' digests in phase order.
pub(crate) fn combined<T>(domain: &str, entries: &[Staged<T>]) -> Digest {
    let mut h = KeyHasher::new(domain);
    h.add(&entries.len());
    for e in entries {
        h.add(&e.digest);
    }
    h.finish()
}

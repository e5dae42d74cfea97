//! Per-phase entries of the exchange stages: one schedule per distinct pattern, one set of
//! tables per phase whose addresses or schedule moved.
//!
//! A phase's entry is found in this process's memo (the previous build's entries), then in
//! the disk store, else computed. Entries with equal keys are computed once per build. What is
//! missing is computed in parallel with rayon over plain data (no query runs on a rayon
//! worker: `api-notes.md`) and collected in phase order, so the output is the same at any
//! thread count.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use rayon::prelude::*;

use crate::db::{CompileError, Database, Staged};
use crate::hash::{Digest, KeyHasher};

/// An in-process memo of per-phase entries by key: holds the latest build's entries only.
pub type Memo<T> = Mutex<HashMap<Digest, Staged<T>>>;

/// The entry of every phase, in phase order; `keys[i]` is phase i's key, `compute(i)` makes it.
pub(crate) fn per_phase<T>(
    db: &Database,
    stage: &'static str,
    version: u32,
    keys: &[Digest],
    memo: &Memo<T>,
    compute: impl Fn(usize) -> Result<T, CompileError> + Sync,
) -> Result<Vec<Staged<T>>, CompileError>
where
    T: Clone + Send + Sync + rkyv::Archive
        + for<'a> rkyv::Serialize<rkyv::api::high::HighSerializer<rkyv::util::AlignedVec, rkyv::ser::allocator::ArenaHandle<'a>, rkyv::rancor::Error>>,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
{
    let previous = std::mem::take(&mut *memo.lock().expect("phase memo lock"));
    let result = collect(db, stage, version, keys, &previous, &compute);
    *memo.lock().expect("phase memo lock") = match &result {
        Ok((_, found)) => found.clone(),
        Err(_) => previous,
    };
    let (order, found) = result?;
    Ok(order.iter().map(|key| found[key].clone()).collect())
}

type Found<T> = (Vec<Digest>, HashMap<Digest, Staged<T>>);

fn collect<T>(
    db: &Database,
    stage: &'static str,
    version: u32,
    keys: &[Digest],
    previous: &HashMap<Digest, Staged<T>>,
    compute: &(impl Fn(usize) -> Result<T, CompileError> + Sync),
) -> Result<Found<T>, CompileError>
where
    T: Clone + Send + Sync + rkyv::Archive
        + for<'a> rkyv::Serialize<rkyv::api::high::HighSerializer<rkyv::util::AlignedVec, rkyv::ser::allocator::ArenaHandle<'a>, rkyv::rancor::Error>>,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
{
    let mut found: HashMap<Digest, Staged<T>> = HashMap::new();
    let mut missing: Vec<usize> = Vec::new();
    let mut pending: HashSet<Digest> = HashSet::new();
    for (index, key) in keys.iter().enumerate() {
        if found.contains_key(key) || pending.contains(key) {
            continue;
        }
        if db.verifying() {
            found.insert(*key, db.cached(stage, version, *key, || compute(index))?);
        } else if let Some(hit) = previous.get(key).cloned().or_else(|| db.load(stage, version, key)) {
            found.insert(*key, hit);
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
    for (&index, value) in missing.iter().zip(fresh) {
        found.insert(keys[index], db.save(stage, version, keys[index], value?)?);
    }
    Ok((keys.to_vec(), found))
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

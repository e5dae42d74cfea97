//! The salsa database and the stages as tracked queries, each consulting the on-disk cache.
//!
//! A stage's value is `Staged<T>`: the value and the blake3 digest of its canonical bytes.
//! Equality is digest equality, so a stage that re-runs and produces the same bytes backdates
//! and wakes none of its dependents (salsa's early cutoff); across processes the same digests
//! form the disk-cache keys of downstream stages (`caching.md`).

use std::sync::{Arc, Mutex};

use crate::hash::{Digest, KeyHasher};
use crate::ir::Graph;
use crate::lower::search::{BeamTrace, KeptBeam};
use crate::target::Target;

/// Bump when any stage's output format or meaning changes.
pub const CACHE_FORMAT_VERSION: u32 = 1;

/// The disk cache as the compiler sees it: bytes in, bytes out, keyed by digest.
pub trait StageStore: Send + Sync {
    fn load(&self, stage: &str, key: &Digest, schema: u64) -> Option<rkyv::util::AlignedVec<16>>;
    fn store(&self, stage: &str, key: &Digest, schema: u64, bytes: &[u8]);
    /// Store bytes the caller is done with, whose blake3 is `digest`. A store may write them
    /// after returning (in the background) as long as [`StageStore::flush`] waits for them;
    /// by default they are written at once.
    fn store_owned(&self, stage: &str, key: &Digest, schema: u64, bytes: rkyv::util::AlignedVec<16>, digest: &Digest) {
        let _ = digest;
        self.store(stage, key, schema, &bytes);
    }
    /// Store a value whose canonical bytes, `bytes()` makes them, have blake3 `digest`. A store
    /// may make and write them after returning (in the background, after the build's work) as
    /// long as [`StageStore::flush`] waits for them; by default they are made and stored at once.
    fn store_deferred(&self, stage: &str, key: &Digest, schema: u64, bytes: DeferredBytes, digest: &Digest) {
        if let Some(bytes) = bytes() {
            self.store_owned(stage, key, schema, bytes, digest);
        }
    }
    /// Wait until every entry handed to [`StageStore::store_owned`] or
    /// [`StageStore::store_deferred`] is written.
    fn flush(&self) {}
}

/// A stage output's canonical bytes, made when called (`StageStore::store_deferred`); `None`
/// when it does not serialise (never for a value that was digested).
pub type DeferredBytes = Box<dyn FnOnce() -> Option<rkyv::util::AlignedVec<16>> + Send>;

/// One value of this process (with its digest) under the key it was made for, taken by its
/// one reader.
pub(crate) type KeyedSlot<T> = Arc<Mutex<Option<(Digest, Staged<T>)>>>;

/// The latest plan-beam trace of this process, under its key (`Database::beam_trace`).
/// With it, the beam's states per step when the database keeps them (`keeping_beam_states`).
type TraceSlot = Arc<Mutex<Option<(Digest, Arc<BeamTrace>, Option<Arc<KeptBeam>>)>>>;

/// The validated exchange tables `optimize_exchange_placement` hands to `lower_exchanges`, by key.
type ValidatedEntry = (Digest, Arc<crate::exchange_placement::Validated>);

/// Ranged results of one stage in this process (`Database::ranged`).
pub(crate) type RangedMemo<T> = Arc<Mutex<Vec<(Digest, crate::lower::host::RateRange, Staged<T>)>>>;

/// Ranged results a process keeps in memory, and ranges a disk index lists, per key.
const RANGED_MEMO_ENTRIES: usize = 8;
const RANGED_INDEX_ENTRIES: usize = 16;

/// A stage output with the digest of its canonical bytes.
#[derive(Debug)]
pub struct Staged<T> {
    pub digest: Digest,
    pub value: Arc<T>,
}

impl<T> Clone for Staged<T> {
    fn clone(&self) -> Self {
        Staged { digest: self.digest, value: self.value.clone() }
    }
}

impl<T> PartialEq for Staged<T> {
    fn eq(&self, other: &Self) -> bool {
        self.digest == other.digest
    }
}
impl<T> Eq for Staged<T> {}

impl<T> Staged<T> {
    /// A value with the digest of its canonical (rkyv) bytes.
    pub(crate) fn of(value: T) -> StageResult<T>
    where
        T: Canonical,
    {
        Ok(Staged { digest: digest_of(&value)?, value: Arc::new(value) })
    }
}

/// Digest of a value as stages digest their outputs: blake3 of its canonical (rkyv) bytes.
///
/// The bytes stream through blake3 as they are serialised (256 KiB blocks hashed on rayon
/// workers while the serialiser goes on, `TreeHasher`), never held whole: the same digest as
/// `Digest::of_bytes` of `rkyv::to_bytes`'s buffer (the serialiser writes the same bytes in the
/// same order to any writer, and blake3 hashes a stream as the whole), without allocating and
/// clearing a buffer the size of the value (a four-block program is 67 MB).
pub(crate) fn digest_of<T>(value: &T) -> Result<Digest, CompileError>
where
    T: Canonical,
{
    let writer = rkyv::ser::writer::IoWriter::new(crate::hash::TreeHasher::default());
    let writer = rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(value, writer).map_err(CompileError::from)?;
    Ok(writer.into_inner().finalize())
}

/// The writer `digest_of` serialises into: blake3, its 256 KiB blocks hashed on rayon workers
/// while the serialiser goes on (`TreeHasher`).
pub(crate) type DigestWriter = rkyv::ser::writer::IoWriter<crate::hash::TreeHasher>;

/// A value with canonical (rkyv) bytes, which it serialises into a buffer (to store them) or
/// straight into the digest (`digest_of`).
pub(crate) trait Canonical:
    for<'a> rkyv::Serialize<rkyv::api::high::HighSerializer<rkyv::util::AlignedVec, rkyv::ser::allocator::ArenaHandle<'a>, rkyv::rancor::Error>>
    + for<'a> rkyv::Serialize<rkyv::api::high::HighSerializer<DigestWriter, rkyv::ser::allocator::ArenaHandle<'a>, rkyv::rancor::Error>>
{
}

impl<T> Canonical for T where
    T: for<'a> rkyv::Serialize<rkyv::api::high::HighSerializer<rkyv::util::AlignedVec, rkyv::ser::allocator::ArenaHandle<'a>, rkyv::rancor::Error>>
        + for<'a> rkyv::Serialize<rkyv::api::high::HighSerializer<DigestWriter, rkyv::ser::allocator::ArenaHandle<'a>, rkyv::rancor::Error>>
{
}

/// Any error a stage can report, as text naming what and where (errors must compare equal
/// for salsa, and every one already carries its context).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CompileError(pub String);

impl CompileError {
    pub fn from(e: impl std::fmt::Display) -> Self {
        CompileError(e.to_string())
    }
}

pub type StageResult<T> = Result<Staged<T>, CompileError>;

/// How a stage's value was obtained in this process, for `--timings` and the logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Computed,
    DiskHit,
}

#[salsa::input]
pub struct Sources {
    #[returns(ref)]
    pub workload_text: String,
    #[returns(ref)]
    pub workload_origin: String,
    #[returns(ref)]
    pub target_text: String,
    #[returns(ref)]
    pub target_origin: String,
}

/// The disk cache, the compiler fingerprint and the log of stage runs: the part of the
/// database that per-phase entries need (`phases.rs`), shareable with rayon workers (the
/// salsa storage is not). The database derefs to it.
#[derive(Clone)]
pub struct StageCache {
    store: Option<Arc<dyn StageStore>>,
    /// Recompute every disk hit and compare digests (`IPUQ_VERIFY_CACHE=1` at the command line).
    verify_hits: bool,
    /// (stage, origin) each time a stage body runs: what re-ran, and whether from disk.
    runs: Arc<Mutex<Vec<(&'static str, Origin)>>>,
    /// The compiler build, part of every stage key (`fingerprint.rs`; replaceable in tests).
    fingerprint: Digest,
}

#[salsa::db]
#[derive(Clone)]
pub struct Database {
    storage: salsa::Storage<Self>,
    cache: StageCache,
    /// Operator-plan finalists `lower_mid` keeps for `select_finalist` (`--plan-finalists`).
    plan_finalists: usize,
    /// Exchange-table bytes a tile may hold (`--exchange-table-budget`; a compiler policy that
    /// tests lower to exercise re-planning at small sizes).
    table_budget: u32,
    table_budget_hard: bool,
    /// Hand stages the whole target instead of their views (the test proving views complete).
    full_target_views: bool,
    /// Per-phase schedules of this process by key (`phases.rs`): an edit that re-runs the
    /// schedules stage reschedules only new patterns, with or without a disk cache.
    pub(crate) schedule_memo: Arc<crate::phases::Memo<crate::exchange::Schedule>>,
    /// Per-phase exchange tables by key: only phases whose addresses moved are re-validated.
    pub(crate) tables_memo: Arc<crate::phases::Memo<crate::tables::PackedPhase>>,
    /// Exchange-placement searches `select_finalist` ran, by the key of everything the search
    /// reads (`pipeline::placement_search_key`): the stage `optimize_exchange_placement` finds
    /// the chosen finalist's search there instead of running it again. Holds the latest
    /// selection's searches only; not stored on disk.
    pub(crate) placement_memo: Arc<std::sync::Mutex<std::collections::HashMap<Digest, Arc<crate::exchange_placement::Searched>>>>,
    /// Per-phase validations of relocated exchange tables by key (`pipeline::checked_tables_memoized`):
    /// an edit re-validates only the phases whose addresses or schedule moved.
    pub(crate) validation_memo: Arc<crate::phases::Memo<u32>>,
    /// Relative exchange tables of the patterns lower_mid's table screen sized, for
    /// select_finalist's relocation of the same program (`exchange_placement::RelativeMemo`):
    /// cleared when lower_mid starts and when selection ends.
    pub(crate) relative_memo: Arc<crate::exchange_placement::RelativeMemo>,
    /// Support memory per tile of every finalist `select_finalist` sized, by the key of what
    /// sizing reads (`pipeline::sizing_key`): the stage `size_tile_code` finds the chosen
    /// finalist's there instead of encoding its tables again. Holds the latest selection's
    /// only; not stored on disk.
    pub(crate) sizing_memo: Arc<std::sync::Mutex<std::collections::HashMap<Digest, Arc<Vec<crate::emit::SupportMemory>>>>>,
    /// The baseline placement of every finalist `select_finalist` placed, by the key of what
    /// placement reads (`pipeline::baseline_key`): the stage `place_storage` finds the chosen
    /// finalist's there instead of placing it again. Holds the latest selection's only; not
    /// stored on disk.
    pub(crate) baseline_memo: Arc<std::sync::Mutex<std::collections::HashMap<Digest, Arc<crate::storage::Placement>>>>,
    /// The tables the exchange-placement search validated for the placement it accepted, by
    /// the key of what they are made of (`pipeline::validated_key`): `lower_exchanges` packs
    /// them instead of validating the same tables again. Taken by the next `lower_exchanges`.
    pub(crate) validated_memo: Arc<std::sync::Mutex<Option<ValidatedEntry>>>,
    /// In a process that builds again (`ipuq watch`): the entries `placement_memo`,
    /// `sizing_memo` and `baseline_memo` held for each selection before the latest one ran
    /// (`PreviousSelection`), newest first, as many as `selection_memo` holds selections
    /// besides the latest, where the later stages also look. An edit undone (to any state
    /// `selection_memo` still holds) selects from `selection_memo` without running
    /// `select_finalist`, and its stages find the sizing, placement and exchange-placement
    /// search of that selection here instead of computing them again.
    pub(crate) previous_selection: Arc<Mutex<std::collections::VecDeque<PreviousSelection>>>,
    /// Finalist selections of this process: (key without the host link rate, the rates they
    /// hold for, the selection), the latest few (`Database::ranged`).
    pub(crate) selection_memo: RangedMemo<crate::lower::select::Selection>,
    /// The program select_finalist just costed and chose, when it is the host pass of a
    /// lower_mid finalist (`pipeline::chosen_key`): the `lowered` query takes it instead of
    /// running the host pass again. Taken by that query.
    pub(crate) chosen_memo: KeyedSlot<crate::lower::Lowered>,
    /// Each tile's exchange-table bytes of the finalists `lower_mid`'s table screen kept, with
    /// the prepared program and its schedules' digests (`pipeline::Screened`):
    /// `select_finalist` takes them instead of encoding the same tables again.
    pub(crate) screen_memo: Arc<std::sync::Mutex<Vec<crate::pipeline::Screened>>>,
    /// Tile images by key (`emit::TileInput`): an edit that leaves a tile's content unchanged
    /// reuses its image. In memory only, like the package they make.
    pub(crate) tile_memo: Arc<crate::phases::Memo<crate::emit::TileBody>>,
    /// How the last package build obtained its tile images.
    tile_counts: Arc<Mutex<Option<crate::phases::EntryCounts>>>,
    /// The latest plan-beam trace `lower_mid` made, under its key (`Database::beam_trace`):
    /// the next build of an edited workload resumes the beam from it, with or without a disk
    /// cache (`ipuq watch`).
    beam_trace_memo: TraceSlot,
    /// Whether `lower_mid` keeps its beam's states with the trace (`search::KeptBeam`): set by
    /// a process that builds again (`ipuq watch`), where the next build's resumed beam takes
    /// them instead of lowering them again.
    keep_beam_states: bool,
    /// What a rebuilding process's build replaced (the previous build's kept beam states),
    /// dropped once the build is done (`release_deferred`) rather than on its critical path.
    deferred: Arc<Mutex<Vec<Box<dyn std::any::Any + Send>>>>,
}

#[salsa::db]
impl salsa::Database for Database {}

impl Default for Database {
    fn default() -> Self {
        Database::new(None)
    }
}

impl Database {
    pub fn new(store: Option<Arc<dyn StageStore>>) -> Self {
        Database {
            storage: salsa::Storage::new(None),
            cache: StageCache { store, verify_hits: false, runs: Arc::default(), fingerprint: crate::fingerprint::compiler_fingerprint() },
            full_target_views: false,
            schedule_memo: Arc::default(),
            tables_memo: Arc::default(),
            placement_memo: Arc::default(),
            sizing_memo: Arc::default(),
            baseline_memo: Arc::default(),
            validation_memo: Arc::default(),
            relative_memo: Arc::default(),
            validated_memo: Arc::default(),
            selection_memo: Arc::default(),
            previous_selection: Arc::default(),
            chosen_memo: Arc::default(),
            screen_memo: Arc::default(),
            tile_memo: Arc::default(),
            tile_counts: Arc::default(),
            beam_trace_memo: Arc::default(),
            keep_beam_states: false,
            deferred: Arc::default(),
            plan_finalists: crate::lower::search::DEFAULT_FINALISTS,
            table_budget: crate::sizing::EXCHANGE_TABLE_BUDGET_BYTES,
            table_budget_hard: false,
        }
    }

    /// Replace the compiler fingerprint (tests: entries written by another compiler build).
    pub fn with_fingerprint(mut self, fingerprint: Digest) -> Self {
        self.cache.fingerprint = fingerprint;
        self
    }

    /// Give every stage the whole target rather than its view: a stage's output must not
    /// change (the test that proves each view holds everything its stage reads).
    pub fn with_full_target_views(mut self) -> Self {
        self.full_target_views = true;
        self
    }

    /// Recompute every disk-cache hit and compare its digest with the cached bytes': a
    /// mismatch means a stage whose output changed without a version bump, or a bad key.
    pub fn verifying_hits(mut self, verify: bool) -> Self {
        self.cache.verify_hits = verify;
        self
    }

    /// Keep the plan beam's states of each build in memory for the next (`ipuq watch`; see
    /// `search::KeptBeam`): faster resumed beams, at the price of holding the states.
    pub fn keeping_beam_states(mut self, keep: bool) -> Self {
        self.keep_beam_states = keep;
        self
    }

    pub(crate) fn keeps_beam_states(&self) -> bool {
        self.keep_beam_states && !self.cache.verify_hits
    }

    /// Keep `k` (at least one) operator-plan finalists.
    pub fn with_plan_finalists(mut self, k: usize) -> Self {
        self.plan_finalists = k.max(1);
        self
    }

    /// A hard per-tile exchange-table budget of `bytes` (a user's setting), or (None) the
    /// compiler's policy: `sizing::EXCHANGE_TABLE_BUDGET_BYTES`, exceeded where the program
    /// places with its tables (`sizing` module docs).
    pub fn with_table_budget(mut self, bytes: Option<u32>) -> Self {
        self.table_budget = bytes.unwrap_or(crate::sizing::EXCHANGE_TABLE_BUDGET_BYTES);
        self.table_budget_hard = bytes.is_some();
        self
    }

    pub fn table_budget(&self) -> u32 {
        self.table_budget
    }

    /// Whether the table budget is a hard limit (a user's setting) rather than the policy
    /// that a program over it is kept where it places with its tables.
    pub fn table_budget_hard(&self) -> bool {
        self.table_budget_hard
    }

    pub fn plan_finalists(&self) -> usize {
        self.plan_finalists
    }

    /// How the last run of the package stage obtained its tile images: tiles, distinct
    /// images, reused from the previous build, computed (None before the first).
    pub fn tile_image_counts(&self) -> Option<crate::phases::EntryCounts> {
        *self.tile_counts.lock().expect("tile counts lock")
    }

    pub(crate) fn note_tile_images(&self, counts: crate::phases::EntryCounts) {
        *self.tile_counts.lock().expect("tile counts lock") = Some(counts);
    }

    /// The latest plan-beam trace kept under `key` (`keep_beam_trace`): this process's, else the
    /// disk store's. An entry that fails its digest or does not decode is ignored with a
    /// warning. None while verifying cache hits (every stage is then computed from the start).
    pub(crate) fn beam_trace(&self, key: Digest) -> Option<Arc<BeamTrace>> {
        if self.cache.verify_hits {
            return None;
        }
        if let Some((k, trace, _)) = &*self.beam_trace_memo.lock().expect("beam trace memo lock") {
            if *k == key {
                return Some(trace.clone());
            }
        }
        let store = self.cache.store.as_ref()?;
        let bytes = store.load(BEAM_TRACE_STAGE, &key, schema(BEAM_TRACE_STAGE, BEAM_TRACE_VERSION))?;
        // The entry: the digest of the trace's bytes, then those bytes.
        let decoded = match bytes.split_at_checked(32) {
            Some((digest, body)) if Digest::of_bytes(body).0[..] == digest[..] => {
                let mut aligned = rkyv::util::AlignedVec::<16>::new();
                aligned.extend_from_slice(body);
                value_from::<BeamTrace>(&aligned).map_err(|e| e.0)
            }
            _ => Err("the digest does not match the bytes".to_string()),
        };
        match decoded {
            Ok(trace) => Some(Arc::new(trace)),
            Err(error) => {
                tracing::warn!(stage = BEAM_TRACE_STAGE, %error, "cache entry failed to decode; ignoring it");
                None
            }
        }
    }

    /// The beam states kept with `trace` under `key` in this process, if that trace is the one
    /// kept there (`keep_beam_trace`).
    pub(crate) fn beam_states(&self, key: Digest, trace: &Arc<BeamTrace>) -> Option<Arc<KeptBeam>> {
        match &*self.beam_trace_memo.lock().expect("beam trace memo lock") {
            Some((k, t, kept)) if *k == key && Arc::ptr_eq(t, trace) => kept.clone(),
            _ => None,
        }
    }

    /// Keep the plan-beam trace of this build under `key`, in this process and in the disk store
    /// (replacing the previous build's: each workload name keeps its latest), with the beam's
    /// states in this process when they were kept (`keeping_beam_states`).
    pub(crate) fn keep_beam_trace(&self, key: Digest, trace: BeamTrace, kept: Option<KeptBeam>) {
        if let Some(store) = &self.cache.store {
            match rkyv::to_bytes::<rkyv::rancor::Error>(&trace) {
                Ok(body) => {
                    let mut bytes = Digest::of_bytes(&body).0.to_vec();
                    bytes.extend_from_slice(&body);
                    store.store(BEAM_TRACE_STAGE, &key, schema(BEAM_TRACE_STAGE, BEAM_TRACE_VERSION), &bytes);
                }
                Err(error) => tracing::warn!(stage = BEAM_TRACE_STAGE, %error, "could not encode the plan beam's trace; not storing it"),
            }
        }
        let replaced = self.beam_trace_memo.lock().expect("beam trace memo lock").replace((key, Arc::new(trace), kept.map(Arc::new)));
        // The previous build's states (a watch edit's largest garbage: its four-block MLP's
        // partial programs take about 35 ms to free) wait for the build's end.
        if let Some(replaced) = replaced.filter(|_| self.keep_beam_states) {
            self.deferred.lock().expect("deferred drops lock").push(Box::new(replaced));
        }
    }

    /// Drops what the last build replaced and deferred (see `deferred`): a rebuilding process
    /// calls it once a build is done.
    pub fn release_deferred(&self) {
        let deferred = std::mem::take(&mut *self.deferred.lock().expect("deferred drops lock"));
        drop(deferred);
    }
}

/// The selections whose memo entries a rebuilding process sets aside
/// (`Database::previous_selection`): those `selection_memo` holds besides the latest.
pub(crate) const PREVIOUS_SELECTIONS: usize = RANGED_MEMO_ENTRIES - 1;

/// The entries of the selection memos a selection left (`Database::previous_selection`).
#[derive(Default)]
pub(crate) struct PreviousSelection {
    pub placements: std::collections::HashMap<Digest, Arc<crate::exchange_placement::Searched>>,
    pub sizings: std::collections::HashMap<Digest, Arc<Vec<crate::emit::SupportMemory>>>,
    pub baselines: std::collections::HashMap<Digest, Arc<crate::storage::Placement>>,
}

/// The disk entry of the plan beam's trace (`Database::beam_trace`), and its version.
pub(crate) const BEAM_TRACE_STAGE: &str = "beam_trace";
pub(crate) const BEAM_TRACE_VERSION: u32 = 1;

impl std::ops::Deref for Database {
    type Target = StageCache;
    fn deref(&self) -> &StageCache {
        &self.cache
    }
}

impl StageCache {
    /// Key of a stage: its name and version, the cache format, the compiler fingerprint, and
    /// the digests it read.
    pub fn key(&self, stage: &str, version: u32, inputs: &[Digest]) -> Digest {
        let mut all = Vec::with_capacity(inputs.len() + 1);
        all.push(self.fingerprint);
        all.extend_from_slice(inputs);
        stage_key(stage, version, &all)
    }

    pub(crate) fn verifying(&self) -> bool {
        self.verify_hits
    }

    /// Stage bodies that ran since the last call (for timings and event-log tests).
    pub fn take_runs(&self) -> Vec<(&'static str, Origin)> {
        std::mem::take(&mut *self.runs.lock().expect("run log lock"))
    }

    pub(crate) fn note(&self, stage: &'static str, origin: Origin) {
        self.runs.lock().expect("run log lock").push((stage, origin));
    }

    /// Load a stage output from disk, or compute and publish it.
    pub(crate) fn cached<T>(&self, stage: &'static str, version: u32, key: Digest, compute: impl FnOnce() -> Result<T, CompileError>) -> StageResult<T>
    where
        T: rkyv::Archive + Canonical + Send + Sync + 'static,
        T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
            + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
    {
        let schema = schema(stage, version);
        if let Some(store) = &self.store {
            if let Some(bytes) = store.load(stage, &key, schema) {
                match rkyv::from_bytes::<T, rkyv::rancor::Error>(&bytes) {
                    Ok(value) if !self.verify_hits => {
                        self.note(stage, Origin::DiskHit);
                        return Ok(Staged { digest: Digest::of_bytes(&bytes), value: Arc::new(value) });
                    }
                    Ok(_) => {
                        let fresh = rkyv::to_bytes::<rkyv::rancor::Error>(&compute()?).map_err(CompileError::from)?;
                        same_as_entry(stage, version, &key, &bytes, &fresh)?;
                        self.note(stage, Origin::DiskHit);
                        return Ok(Staged { digest: Digest::of_bytes(&bytes), value: Arc::new(value_from(&fresh)?) });
                    }
                    Err(e) => tracing::warn!(stage, error = %e, "cache entry failed to decode; recomputing"),
                }
            }
        }
        let value = compute()?;
        self.save(stage, version, key, value)
    }

    /// A stage output that reads one rate only through threshold decisions: `compute` returns
    /// the value and the range of rates over which it decides alike, so the value holds for
    /// every rate in that range. Found by the key of everything else it reads (`base`) and a
    /// range holding `rate`: in this process's memo, else on disk, where an index entry under
    /// `base` lists the ranges computed and each value is stored under `base` and its range.
    /// (The host link rate and `select_finalist`: a link edit that flips no host-pass decision
    /// re-selects nothing.)
    pub(crate) fn ranged<T>(
        &self,
        stage: &'static str,
        version: u32,
        base: Digest,
        rate: u64,
        memo: &RangedMemo<T>,
        compute: impl FnOnce() -> Result<(T, crate::lower::host::RateRange), CompileError>,
    ) -> StageResult<T>
    where
        T: rkyv::Archive + Canonical + Send + Sync + 'static,
        T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
            + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
    {
        use crate::lower::host::RateRange;
        let keyed = |r: &RateRange| KeyHasher::new("ipuq rate range key v1").add(&base).add(&r.low).add(&r.high).finish();
        let index_stage: &'static str = "rate_ranges";
        if !self.verify_hits {
            if let Some(hit) = memo.lock().expect("ranged memo lock").iter().find(|(k, r, _)| *k == base && r.contains(rate)) {
                return Ok(hit.2.clone());
            }
        }
        let load_index = || -> Vec<(u64, u64)> {
            let Some(bytes) = self.store.as_ref().and_then(|s| s.load(index_stage, &base, schema(index_stage, version))) else { return Vec::new() };
            rkyv::from_bytes::<Vec<(u64, u64)>, rkyv::rancor::Error>(&bytes).unwrap_or_else(|e| {
                tracing::warn!(stage = index_stage, error = %e, "cache entry failed to decode; ignoring it");
                Vec::new()
            })
        };
        let remember = |found: &Staged<T>, range: RateRange| {
            let mut m = memo.lock().expect("ranged memo lock");
            m.retain(|(k, r, _)| !(*k == base && *r == range));
            m.push((base, range, found.clone()));
            let excess = m.len().saturating_sub(RANGED_MEMO_ENTRIES);
            m.drain(..excess);
        };
        // (Verifying: every hit is recomputed and compared below.)
        let index = if self.verify_hits { Vec::new() } else { load_index() };
        for &(low, high) in &index {
            let range = RateRange { low, high };
            if !range.contains(rate) {
                continue;
            }
            if let Some(found) = self.load::<T>(stage, version, &keyed(&range)) {
                remember(&found, range);
                return Ok(found);
            }
        }
        let (value, range) = compute()?;
        debug_assert!(range.contains(rate), "a computation's range holds the rate it read");
        let key = keyed(&range);
        if self.verify_hits {
            // Verifying: an entry for the same range must hold the same bytes.
            if let Some(bytes) = self.store.as_ref().and_then(|s| s.load(stage, &key, schema(stage, version))) {
                let fresh = rkyv::to_bytes::<rkyv::rancor::Error>(&value).map_err(CompileError::from)?;
                same_as_entry(stage, version, &key, &bytes, &fresh)?;
            }
        }
        let found = self.save(stage, version, key, value)?;
        if let Some(store) = &self.store {
            // The index lists the latest ranges (re-read: another build may have added some).
            let mut ranges: Vec<(u64, u64)> = load_index().into_iter().filter(|&r| r != (range.low, range.high)).collect();
            ranges.push((range.low, range.high));
            let excess = ranges.len().saturating_sub(RANGED_INDEX_ENTRIES);
            ranges.drain(..excess);
            let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&ranges).map_err(CompileError::from)?;
            store.store(index_stage, &base, schema(index_stage, version), &bytes);
        }
        remember(&found, range);
        Ok(found)
    }

    /// Record a freshly computed value that is not worth a disk entry (the package: its one
    /// copy on disk is the output file, see the driver's build record).
    pub(crate) fn unstored<T>(&self, stage: &'static str, value: T) -> StageResult<T>
    where
        T: Canonical,
    {
        self.note(stage, Origin::Computed);
        Staged::of(value)
    }

    /// The disk store, for the driver's whole-build record.
    pub fn store(&self) -> Option<&Arc<dyn StageStore>> {
        self.store.as_ref()
    }

    /// A disk hit, when there is a store and the entry decodes (not used while verifying).
    pub(crate) fn load<T>(&self, stage: &'static str, version: u32, key: &Digest) -> Option<Staged<T>>
    where
        T: rkyv::Archive,
        T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
            + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
    {
        let store = self.store.as_ref()?;
        let bytes = store.load(stage, key, schema(stage, version))?;
        match value_from::<T>(&bytes) {
            Ok(value) => {
                self.note(stage, Origin::DiskHit);
                Some(Staged { digest: Digest::of_bytes(&bytes), value: Arc::new(value) })
            }
            Err(e) => {
                tracing::warn!(stage, error = %e, "cache entry failed to decode; recomputing");
                None
            }
        }
    }

    /// Record a freshly computed value: note it, digest it, publish it to the store.
    pub(crate) fn save<T>(&self, stage: &'static str, version: u32, key: Digest, value: T) -> StageResult<T>
    where
        T: Canonical + Send + Sync + 'static,
    {
        self.note(stage, Origin::Computed);
        // Digested as the bytes stream (`digest_of`); the store makes the bytes themselves when
        // it writes them, off the build's path where it can.
        let staged = Staged::of(value)?;
        if let Some(store) = &self.store {
            let value = staged.value.clone();
            let bytes: DeferredBytes = Box::new(move || rkyv::to_bytes::<rkyv::rancor::Error>(&*value).ok());
            store.store_deferred(stage, &key, schema(stage, version), bytes, &staged.digest);
        }
        Ok(staged)
    }
}

/// Verifying a cache hit: the recomputed bytes must be the entry's.
fn same_as_entry(stage: &str, version: u32, key: &Digest, entry: &[u8], fresh: &[u8]) -> Result<(), CompileError> {
    if fresh != entry {
        return Err(CompileError(format!(
            "cache verification: stage '{stage}' v{version} recomputed to different bytes than its cache entry {key} holds (a stage changed without a version bump, or a key misses an input)"
        )));
    }
    Ok(())
}

fn value_from<T>(bytes: &rkyv::util::AlignedVec) -> Result<T, CompileError>
where
    T: rkyv::Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
{
    rkyv::from_bytes::<T, rkyv::rancor::Error>(bytes).map_err(CompileError::from)
}

/// Schema id of a stage's payload: the stage, its version and the cache format.
pub fn schema(stage: &str, version: u32) -> u64 {
    let d = KeyHasher::new("ipuq schema v1").add(stage).add(&version).add(&CACHE_FORMAT_VERSION).finish();
    u64::from_le_bytes(d.0[..8].try_into().expect("8 bytes"))
}

/// Key of a stage: its name and version, the cache format, and the digests it read.
pub fn stage_key(stage: &str, version: u32, inputs: &[Digest]) -> Digest {
    let mut h = KeyHasher::new("ipuq stage key v1");
    h.add(stage).add(&version).add(&CACHE_FORMAT_VERSION).add(&inputs.len());
    for d in inputs {
        h.add(d);
    }
    h.finish()
}

#[salsa::tracked(returns(clone))]
pub fn target(db: &dyn Db, sources: Sources) -> StageResult<Target> {
    let t = Target::from_toml(sources.target_text(db), sources.target_origin(db)).map_err(CompileError::from)?;
    Ok(Staged { digest: t.digest(), value: Arc::new(t) })
}

/// A view of the target for the stages that read one section (`Target::*_view`). Each is its
/// own query with its own digest: an edit elsewhere in the target re-runs the projection,
/// which compares equal and backdates, so no stage behind it re-runs (salsa's early cutoff).
fn view(db: &dyn Db, sources: Sources, section: &str, project: fn(&Target) -> Target) -> StageResult<Target> {
    let t = target(db, sources)?;
    if db.ipuq().full_target_views {
        return Ok(t);
    }
    let v = project(&t.value);
    Ok(Staged { digest: v.view_digest(section), value: Arc::new(v) })
}

/// What planning and lowering read: everything but the host link.
#[salsa::tracked(returns(clone))]
pub fn lowering_target(db: &dyn Db, sources: Sources) -> StageResult<Target> {
    view(db, sources, "lowering", Target::lowering_view)
}

/// What finalist selection reads: the lowering view and the host link rate.
#[salsa::tracked(returns(clone))]
pub fn selection_target(db: &dyn Db, sources: Sources) -> StageResult<Target> {
    view(db, sources, "selection", Target::selection_view)
}

/// What exchange scheduling and table lowering read: grid, delays, pairing, port widths.
#[salsa::tracked(returns(clone))]
pub fn exchange_target(db: &dyn Db, sources: Sources) -> StageResult<Target> {
    view(db, sources, "exchange", Target::exchange_view)
}

/// What placement reads: the grid and the memory constants.
#[salsa::tracked(returns(clone))]
pub fn memory_target(db: &dyn Db, sources: Sources) -> StageResult<Target> {
    view(db, sources, "memory", Target::memory_view)
}

/// The validated workload. Its digest covers the structure only (initialisers blanked), so an
/// initialiser change re-plans nothing: the data is made by the runtime, not the compiler.
#[salsa::tracked(returns(clone))]
pub fn graph(db: &dyn Db, sources: Sources) -> StageResult<Graph> {
    let g = Graph::parse(sources.workload_text(db), sources.workload_origin(db)).map_err(CompileError::from)?;
    let mut structure = g.file.clone();
    for t in &mut structure.tensors {
        t.init = crate::ir::Init::Zeros;
    }
    let text = toml::to_string(&structure).map_err(CompileError::from)?;
    let digest = KeyHasher::new("ipuq graph structure v1").add(&text).finish();
    Ok(Staged { digest, value: Arc::new(g) })
}

/// The database as stage queries see it.
#[salsa::db]
pub trait Db: salsa::Database {
    fn ipuq(&self) -> &Database;
}

#[salsa::db]
impl Db for Database {
    fn ipuq(&self) -> &Database {
        self
    }
}

/// The inputs of one build. The target description rarely changes, so it gets high durability:
/// an edit to the workload then never re-validates the queries that read only the target.
pub fn sources(db: &Database, workload_text: String, workload_origin: String, target_text: String, target_origin: String) -> Sources {
    Sources::builder(workload_text, workload_origin, target_text, target_origin)
        .target_text_durability(salsa::Durability::HIGH)
        .target_origin_durability(salsa::Durability::HIGH)
        .new(db)
}

//! The build driver: sets the salsa inputs, runs the pipeline's phases in order with the
//! seed's spans and log lines, consults the disk cache when asked, and writes the package.
//!
//! Only this crate touches files: the compiler (`ipuq_queries`) gets text and returns bytes.

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use ipuq_cache::{Cache, CacheOptions, Remote, RemoteOptions};
use ipuq_queries::db::{graph, Database, DeferredBytes, Origin, Sources, StageStore};
use ipuq_queries::hash::Digest;
use ipuq_queries::package::Package;
use ipuq_queries::pipeline::{load_build_record, lowered, package, run_phase, store_build_record, BuildRecord, PHASES};
use ipuq_queries::target::fixtures;
use salsa::Setter;
use tracing::{info, info_span};

/// The disk cache, and the remote cache behind it, as the compiler's store trait: local, then
/// remote (verified, copied locally), then compute; computed entries go up in the background.
/// Stage outputs the compiler hands over (`store_owned`) are written to the local cache by one
/// writer thread, in the order they came, while the build goes on; `flush` (at the end of every
/// build, before its record and the size budget) waits for them.
pub struct DiskStore {
    pub cache: Arc<Cache>,
    pub remote: Option<Remote>,
    writer: Mutex<Option<Writer>>,
}

/// The local cache's writer thread and the queue it drains.
struct Writer {
    jobs: mpsc::Sender<WriteJob>,
    thread: std::thread::JoinHandle<()>,
}

enum WriteJob {
    /// An entry, its payload made by the writer (already made for `store_owned`, serialised
    /// there for `store_deferred`).
    Put { stage: String, key: ipuq_cache::Key, schema: u64, bytes: DeferredBytes, digest: ipuq_cache::Digest },
    /// Answered once every job queued before it is written.
    Flush(mpsc::Sender<()>),
    /// Write nothing more until the other end is dropped (`DiskStore::hold`).
    Hold(mpsc::Receiver<()>),
}

impl Writer {
    fn start(cache: Arc<Cache>) -> Option<Writer> {
        let (jobs, queue) = mpsc::channel::<WriteJob>();
        let thread = std::thread::Builder::new()
            .name("ipuq-cache-writer".into())
            .spawn(move || {
                for job in queue {
                    match job {
                        WriteJob::Put { stage, key, schema, bytes, digest } => put_made(&cache, &stage, &key, schema, bytes, digest),
                        WriteJob::Flush(done) => {
                            let _ = done.send(());
                        }
                        WriteJob::Hold(release) => {
                            let _ = release.recv();
                        }
                    }
                }
            })
            .ok()?;
        Some(Writer { jobs, thread })
    }
}

impl StageStore for DiskStore {
    fn load(&self, stage: &str, key: &Digest, schema: u64) -> Option<rkyv::util::AlignedVec<16>> {
        self.cache.get(stage, &key.0, schema).or_else(|| self.remote.as_ref()?.fetch(&self.cache, stage, &key.0, schema))
    }
    fn store(&self, stage: &str, key: &Digest, schema: u64, bytes: &[u8]) {
        let _ = self.cache.put_or_warn(stage, &key.0, schema, bytes);
        if let Some(remote) = &self.remote {
            remote.upload(stage, &key.0, schema, bytes);
        }
    }
    fn store_owned(&self, stage: &str, key: &Digest, schema: u64, bytes: rkyv::util::AlignedVec<16>, digest: &Digest) {
        if let Some(remote) = &self.remote {
            remote.upload(stage, &key.0, schema, &bytes);
        }
        self.queue(stage, key, schema, Box::new(move || Some(bytes)), digest);
    }
    fn store_deferred(&self, stage: &str, key: &Digest, schema: u64, bytes: DeferredBytes, digest: &Digest) {
        match &self.remote {
            // The remote tier uploads as the value comes: made here.
            Some(_) => {
                if let Some(payload) = bytes() {
                    self.store_owned(stage, key, schema, payload, digest);
                }
            }
            None => self.queue(stage, key, schema, bytes, digest),
        }
    }
    fn flush(&self) {
        let (done, wait) = mpsc::channel();
        let sent = self.writer.lock().expect("cache writer lock").as_ref().is_some_and(|w| w.jobs.send(WriteJob::Flush(done)).is_ok());
        if sent {
            let _ = wait.recv();
        }
    }
}

/// An entry's payload made and published under its digest.
fn put_made(cache: &Cache, stage: &str, key: &ipuq_cache::Key, schema: u64, bytes: DeferredBytes, digest: ipuq_cache::Digest) {
    if let Some(payload) = bytes() {
        debug_assert_eq!(Digest::of_bytes(&payload).0, digest, "a payload's digest");
        let _ = cache.put_digested_or_warn(stage, key, schema, &payload, digest);
    }
}

impl DiskStore {
    /// Hand an entry to the writer thread; without one (it could not start, or it is gone),
    /// written here and now.
    fn queue(&self, stage: &str, key: &Digest, schema: u64, bytes: DeferredBytes, digest: &Digest) {
        let job = WriteJob::Put { stage: stage.to_string(), key: key.0, schema, bytes, digest: digest.0 };
        let queued = match &*self.writer.lock().expect("cache writer lock") {
            Some(writer) => writer.jobs.send(job).map_err(|e| e.0),
            None => Err(job),
        };
        if let Err(WriteJob::Put { stage, key, schema, bytes, digest }) = queued {
            put_made(&self.cache, &stage, &key, schema, bytes, digest);
        }
    }

    fn remote_hits(&self) -> u64 {
        self.remote.as_ref().map_or(0, |r| r.counters().hits)
    }

    /// Hold the writer thread (entries queue up, nothing is written or serialised) until the
    /// guard is dropped: a build server keeps both cores for its client's build and writes the
    /// build's entries once the client has its answer.
    pub fn hold(&self) -> WriterHold {
        let (release, held) = mpsc::channel();
        let sent = self.writer.lock().expect("cache writer lock").as_ref().is_some_and(|w| w.jobs.send(WriteJob::Hold(held)).is_ok());
        WriterHold(sent.then_some(release))
    }
}

/// The writer thread held (`DiskStore::hold`) until this is dropped.
pub struct WriterHold(#[allow(dead_code)] Option<mpsc::Sender<()>>);

impl Drop for DiskStore {
    /// The queued local writes, then a bounded wait for queued uploads, then the remote
    /// counters join the cache's totals.
    fn drop(&mut self) {
        if let Some(writer) = self.writer.get_mut().ok().and_then(Option::take) {
            drop(writer.jobs);
            let _ = writer.thread.join();
        }
        if let Some(remote) = &mut self.remote {
            remote.finish(Some(&self.cache));
        }
    }
}

/// Opens the local cache (and the remote one, if asked) when the build is incremental.
fn open_store(options: &BuildOptions) -> Result<Option<Arc<DiskStore>>, BuildError> {
    if !options.incremental && options.remote.is_none() {
        return Ok(None);
    }
    let dir = options.cache_dir.clone().unwrap_or_else(default_cache_dir);
    let max_bytes = Some(cache_budget(options.cache_max_bytes)?);
    let Some(cache) = Cache::open_or_warn(&dir, CacheOptions { read_only: options.cache_read_only, max_bytes }) else { return Ok(None) };
    let remote = options.remote.as_ref().and_then(Remote::open_or_warn);
    if let Some(remote) = &remote {
        info!(remote = remote.shown_url(), "using a remote cache");
    }
    let cache = Arc::new(cache);
    let writer = Mutex::new(if options.cache_read_only { None } else { Writer::start(cache.clone()) });
    Ok(Some(Arc::new(DiskStore { cache, remote, writer })))
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{0}")]
    Input(String),
    #[error("{0}")]
    Compile(String),
    #[error("{path}: {message}")]
    Io { path: String, message: String },
}

/// Where the target description comes from: a built-in name or a file.
pub fn load_target(spec: Option<&str>) -> Result<(String, String), BuildError> {
    match target_file(spec) {
        None => {
            let name = spec.unwrap_or("ipu21");
            let text = if name == "small16" { fixtures::SMALL16 } else { fixtures::IPU21 };
            Ok((text.to_string(), format!("{name} (built in)")))
        }
        Some(path) => std::fs::read(path).map_err(|e| BuildError::Io { path: path.to_string(), message: format!("cannot read target description: {e}") }).and_then(|bytes| target_from_bytes(path, bytes)),
    }
}

/// The file a target spec names, or `None` for a built-in target (`ipu21`, the default, and
/// `small16`).
pub fn target_file(spec: Option<&str>) -> Option<&str> {
    spec.filter(|s| !matches!(*s, "ipu21" | "small16"))
}

/// The target description read from the file at `path` as `bytes`, with its origin.
pub fn target_from_bytes(path: &str, bytes: Vec<u8>) -> Result<(String, String), BuildError> {
    String::from_utf8(bytes).map(|t| (t, path.to_string())).map_err(|e| BuildError::Io { path: path.to_string(), message: format!("cannot read target description: {e}") })
}

pub struct BuildOptions {
    pub target: Option<String>,
    pub out_dir: PathBuf,
    pub incremental: bool,
    pub cache_dir: Option<PathBuf>,
    /// Use the cache's entries but write none (shared CI caches).
    pub cache_read_only: bool,
    /// Size budget of the cache, enforced (least recently used first) after a build that
    /// wrote to it; `None`: `IPUQ_CACHE_MAX_BYTES`, else [`DEFAULT_CACHE_MAX_BYTES`].
    pub cache_max_bytes: Option<u64>,
    /// Operator-plan finalists `lower_mid` keeps (`--plan-finalists`).
    pub plan_finalists: usize,
    /// Exchange-table bytes a tile may hold (`--exchange-table-budget`).
    pub table_budget: Option<u32>,
    /// A shared cache server behind the local cache (implies `incremental`).
    pub remote: Option<RemoteOptions>,
}

/// The cache's default size budget: 2 GiB.
pub const DEFAULT_CACHE_MAX_BYTES: u64 = 2 << 30;

/// One stage's time and how its value was obtained.
pub struct PhaseTiming {
    pub phase: &'static str,
    pub elapsed_ms: u128,
    pub computed: usize,
    /// Stages read from the local cache.
    pub disk_hits: usize,
    /// Stages read from the remote cache (and copied into the local one).
    pub remote_hits: usize,
}

pub struct Built {
    /// The package, when this build made it; `None` when the output file already held
    /// exactly this build's package (a no-op rebuild reads it back only when it runs it).
    pub package: Option<Arc<Package>>,
    pub path: PathBuf,
    pub tiles: u32,
    pub estimated_cycles: u64,
    pub timings: Vec<PhaseTiming>,
}

pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("IPUQ_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("ipuq");
    }
    match std::env::var_os("HOME") {
        Some(home) => PathBuf::from(home).join(".cache").join("ipuq"),
        None => PathBuf::from(".ipuq-cache"),
    }
}

/// A byte count: digits, optionally followed by K, M or G (binary units, an optional "iB").
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (digits, unit) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&t[..i], c.to_ascii_uppercase()),
        _ => (t, ' '),
    };
    let shift = match unit {
        ' ' => 0,
        'K' => 10,
        'M' => 20,
        'G' => 30,
        _ => return Err(format!("'{text}': unknown unit (use a byte count, or K, M or G)")),
    };
    let n: u64 = digits.trim().parse().map_err(|_| format!("'{text}': not a byte count"))?;
    n.checked_mul(1 << shift).ok_or_else(|| format!("'{text}': too large"))
}

/// The budget: the option, else `IPUQ_CACHE_MAX_BYTES`, else the default.
pub fn cache_budget(option: Option<u64>) -> Result<u64, BuildError> {
    if let Some(bytes) = option {
        return Ok(bytes);
    }
    match std::env::var("IPUQ_CACHE_MAX_BYTES") {
        Ok(text) => parse_bytes(&text).map_err(|e| BuildError::Input(format!("IPUQ_CACHE_MAX_BYTES={e}"))),
        Err(_) => Ok(DEFAULT_CACHE_MAX_BYTES),
    }
}

/// Whether cache hits are checked against a recomputation (`IPUQ_VERIFY_CACHE=1`).
pub fn verifying_hits() -> bool {
    std::env::var_os("IPUQ_VERIFY_CACHE").is_some_and(|v| v == "1")
}

/// A compiler session: one salsa database and its inputs, kept across rebuilds by
/// `ipuq watch` (each rebuild re-evaluates only what the edit touched) and used once by
/// `ipuq build`.
pub struct Session {
    /// The cache's writer, held while a build runs (`defer_finishing`). First: fields drop in
    /// order, and the store (which waits for its writer when dropped) must see it released.
    held: Option<WriterHold>,
    db: Database,
    sources: Option<Sources>,
    disk: Option<Arc<DiskStore>>,
    /// The buffer each package is serialised into, kept for the next build (`write_package`).
    payload: rkyv::util::AlignedVec,
    /// The end of the last build, when left for later (`defer_finishing`).
    pending: Option<Finish>,
    defer_finish: bool,
}

impl Session {
    pub fn new(options: &BuildOptions) -> Result<Session, BuildError> {
        Session::verifying(options, verifying_hits())
    }

    /// [`Session::new`], checking every cache hit against a recomputation when `verify`
    /// (`IPUQ_VERIFY_CACHE=1` for [`Session::new`]; a build server takes its client's).
    pub fn verifying(options: &BuildOptions, verify: bool) -> Result<Session, BuildError> {
        let disk = open_store(options)?;
        let db = Database::new(disk.clone().map(|d| d as Arc<dyn StageStore>)).verifying_hits(verify).with_plan_finalists(options.plan_finalists).with_table_budget(options.table_budget);
        Ok(Session { db, sources: None, disk, payload: rkyv::util::AlignedVec::new(), pending: None, defer_finish: false, held: None })
    }

    /// A session that builds again after edits (`ipuq watch`): it also keeps the plan beam's
    /// states in memory, so an edit's resumed beam takes them instead of lowering them again.
    pub fn rebuilding(options: &BuildOptions) -> Result<Session, BuildError> {
        Session::rebuilding_verifying(options, verifying_hits())
    }

    /// [`Session::rebuilding`] with [`Session::verifying`]'s `verify`.
    pub fn rebuilding_verifying(options: &BuildOptions, verify: bool) -> Result<Session, BuildError> {
        let mut session = Session::verifying(options, verify)?;
        session.db = session.db.keeping_beam_states(true);
        Ok(session)
    }

    /// Drops what the last build replaced and put off dropping (the previous build's beam
    /// states): `ipuq watch` calls it once a rebuild is done, while it waits for the next save.
    pub fn release_deferred(&self) {
        self.db.release_deferred();
    }

    /// The local cache and remote tier this session reads and writes, if any.
    pub fn store(&self) -> Option<&Arc<DiskStore>> {
        self.disk.as_ref()
    }

    /// Set the inputs, changing only what changed (an unchanged input keeps every query
    /// that reads it valid).
    fn set_inputs(&mut self, text: String, origin: String, target_text: String, target_origin: String) -> Sources {
        match self.sources {
            None => {
                let s = ipuq_queries::db::sources(&self.db, text, origin, target_text, target_origin);
                self.sources = Some(s);
                s
            }
            Some(s) => {
                if s.workload_text(&self.db) != &text {
                    s.set_workload_text(&mut self.db).to(text);
                }
                if s.workload_origin(&self.db) != &origin {
                    s.set_workload_origin(&mut self.db).to(origin);
                }
                if s.target_text(&self.db) != &target_text {
                    s.set_target_text(&mut self.db).with_durability(salsa::Durability::HIGH).to(target_text);
                }
                if s.target_origin(&self.db) != &target_origin {
                    s.set_target_origin(&mut self.db).with_durability(salsa::Durability::HIGH).to(target_origin);
                }
                s
            }
        }
    }

    /// Build `workload` into `out_dir/model.ipuexe`.
    pub fn build(&mut self, workload: &Path, options: &BuildOptions) -> Result<Built, BuildError> {
        let text = std::fs::read_to_string(workload).map_err(|e| BuildError::Io { path: workload.display().to_string(), message: format!("cannot read workload: {e}") })?;
        self.build_text(text, workload, options)
    }

    /// [`Session::build`] of `text`, the workload as read from `workload` (`ipuq watch` builds
    /// the bytes its polls read, not the file as it reads a moment later).
    pub fn build_text(&mut self, text: String, workload: &Path, options: &BuildOptions) -> Result<Built, BuildError> {
        let target = load_target(options.target.as_deref())?;
        self.build_with_target(text, workload, target, options)
    }

    /// [`Session::build_text`] with the target description as read (`ipuq watch` builds the
    /// target file's bytes its polls read too): its text and origin, as `load_target` gives them.
    pub fn build_with_target(&mut self, text: String, workload: &Path, target: (String, String), options: &BuildOptions) -> Result<Built, BuildError> {
        // The previous build's end first, where it was left.
        self.finish();
        if self.defer_finish {
            self.held = self.disk.as_ref().map(|d| d.hold());
        }
        let (target_text, target_origin) = target;
        let path = options.out_dir.join("model.ipuexe");
        // A no-op rebuild: this compiler built exactly these inputs into exactly this file.
        if let Some(record) = load_build_record(&self.db, &text, &target_text) {
            if file_matches(&path, &record.file_head, record.file_len) {
                info!(path = %path.display(), "application package unchanged");
                return Ok(Built { package: None, path, tiles: record.tiles, estimated_cycles: record.estimated_cycles, timings: Vec::new() });
            }
        }
        let sources = self.set_inputs(text.clone(), workload.display().to_string(), target_text.clone(), target_origin);
        let db = &self.db;
        let target = ipuq_queries::db::target(db, sources).map_err(|e| BuildError::Input(e.to_string()))?;
        let g = graph(db, sources).map_err(|e| BuildError::Input(e.to_string()))?;
        let span = info_span!("ipuq.package.build", tile_count = target.value.chip.tiles, operations = g.value.compute_operation_count());
        let _build = span.enter();
        let mut timings = Vec::new();
        let progress = crate::progress::Progress::start(PHASES.len());
        for (i, &phase) in PHASES.iter().enumerate() {
            progress.phase(i, phase);
            let phase_span = info_span!("ipuq.package.phase", phase);
            let _p = phase_span.enter();
            let start = Instant::now();
            let remote_before = self.disk.as_ref().map_or(0, |d| d.remote_hits());
            let result = run_phase(db, sources, phase);
            let remote_hits = (self.disk.as_ref().map_or(0, |d| d.remote_hits()) - remote_before) as usize;
            let elapsed_ms = start.elapsed().as_millis();
            info!(phase, elapsed_ms = elapsed_ms as u64, success = result.is_ok(), "package build phase finished");
            let runs = db.take_runs();
            let computed = runs.iter().filter(|r| r.1 == Origin::Computed).count();
            let disk_hits = runs.iter().filter(|r| r.1 == Origin::DiskHit).count().saturating_sub(remote_hits);
            if computed == 0 && disk_hits + remote_hits > 0 {
                info!(phase, stages = disk_hits + remote_hits, remote_hits, "reused cached stage outputs");
            }
            timings.push(PhaseTiming { phase, elapsed_ms, computed, disk_hits, remote_hits });
            result.map_err(|e| BuildError::Compile(e.to_string()))?;
            if phase == "select_finalist" {
                let l = lowered(db, sources).map_err(|e| BuildError::Compile(e.to_string()))?;
                info!(logical_shards = l.value.logical_shards, exchange_phases = l.value.phases.len(), "lowered graph for package construction");
            }
        }
        drop(progress);
        drop(_build);
        let pkg = package(db, sources).map_err(|e| BuildError::Compile(e.to_string()))?;
        let package = pkg.value.clone();
        info!(final_cycles = package.summary.estimated_cycles, final_exchange = package.summary.estimated_exchange_cycles, "costed final placed program");
        let (file_head, file_len) = write_package(&package, &path, &mut self.payload)?;
        let record = BuildRecord { file_head, file_len, tiles: package.tile_count(), estimated_cycles: package.summary.estimated_cycles };
        let built = Built { tiles: record.tiles, estimated_cycles: record.estimated_cycles, package: Some(package), path, timings };
        self.pending = Some(Finish { text, target_text, record, computed: built.timings.iter().any(|t| t.computed > 0) });
        if !self.defer_finish {
            self.finish();
        }
        Ok(built)
    }

    /// Leave the end of each build (writing its cache entries, its record, the cache's size
    /// budget) to [`Session::finish`], and hold the cache's writer thread while each build runs
    /// (`DiskStore::hold`: both cores go to the build): a build server answers its client, and
    /// a watch prints its result line, first.
    pub fn defer_finishing(&mut self) {
        self.defer_finish = true;
    }

    /// The end of the last build, where it was left: the writer released, every entry of the
    /// build on disk before its record, and before the size budget.
    pub fn finish(&mut self) {
        self.held = None;
        let Some(finish) = self.pending.take() else { return };
        if let Some(disk) = &self.disk {
            disk.flush();
        }
        store_build_record(&self.db, &finish.text, &finish.target_text, &finish.record);
        if let Some(disk) = &self.disk {
            if finish.computed {
                if let Err(error) = disk.cache.enforce_budget() {
                    tracing::warn!(%error, "cache size budget not enforced");
                }
            }
        }
    }
}

/// What is left of a build once its package is written (`Session::finish`).
struct Finish {
    text: String,
    target_text: String,
    record: BuildRecord,
    /// Whether the build computed a stage (wrote to the cache).
    computed: bool,
}

/// Build `workload` into `out_dir/model.ipuexe`.
pub fn build(workload: &Path, options: &BuildOptions) -> Result<Built, BuildError> {
    Session::new(options)?.build(workload, options)
}

/// Leading bytes of a package file a build record keeps: the header, which holds the
/// payload's length and blake3 (`package.rs`).
const FILE_HEAD: usize = 128;

fn file_matches(path: &Path, head: &[u8], len: u64) -> bool {
    use std::io::Read;
    let Ok(mut file) = std::fs::File::open(path) else { return false };
    if file.metadata().map(|m| m.len()).ok() != Some(len) {
        return false;
    }
    let mut buffer = vec![0u8; head.len()];
    file.read_exact(&mut buffer).is_ok() && buffer == head
}

/// Temporary package files older than this are removed even if their writer may still live.
const STALE_TEMPORARY: std::time::Duration = std::time::Duration::from_secs(3600);

/// Remove `.model.ipuexe.<pid>.tmp` files left by killed builds: those whose process is gone
/// (checked in /proc where there is one) or that are older than an hour.
fn remove_stale_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let proc = Path::new("/proc/self").exists();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(".model.ipuexe.").and_then(|n| n.strip_suffix(".tmp")).and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid == std::process::id() {
            continue;
        }
        let dead = proc && !Path::new(&format!("/proc/{pid}")).exists();
        let old = entry.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok()).is_some_and(|age| age > STALE_TEMPORARY);
        if dead || old {
            if std::fs::remove_file(entry.path()).is_ok() {
                info!(path = %entry.path().display(), "removed a stale temporary package");
            }
        }
    }
}

/// Write atomically (temporary file, flushed to disk, then renamed) so a reader never sees
/// half a package; a file that already holds these bytes is left alone. The package is
/// serialised into `payload` (a buffer the session keeps for its next build) and written
/// after its header, the bytes `Package::to_bytes` gives, never copied into one buffer.
/// Returns the file's first `FILE_HEAD` bytes and its length.
pub fn write_package(package: &Package, path: &Path, payload: &mut rkyv::util::AlignedVec) -> Result<(Vec<u8>, u64), BuildError> {
    use std::io::Write;
    let io = |e: std::io::Error| BuildError::Io { path: path.display().to_string(), message: e.to_string() };
    info!(tiles = package.tile_count(), "writing application package");
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    remove_stale_temporaries(dir);
    let header = package.serialize_into(payload);
    let len = (header.len() + payload.len()) as u64;
    let mut head = header.to_vec();
    head.extend_from_slice(&payload[..payload.len().min(FILE_HEAD.saturating_sub(header.len()))]);
    if file_matches(path, &head, len) {
        info!("application package unchanged");
        return Ok((head, len));
    }
    let tmp = dir.join(format!(".model.ipuexe.{}.tmp", std::process::id()));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(&header)?;
        f.write_all(payload)?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    info!("application package written");
    Ok((head, len))
}

pub fn read_package(path: &Path) -> Result<Package, BuildError> {
    info!("reading application package");
    let bytes = std::fs::read(path).map_err(|e| BuildError::Io { path: path.display().to_string(), message: e.to_string() })?;
    let package = Package::from_bytes(&bytes, &path.display().to_string()).map_err(|e| BuildError::Input(e.to_string()))?;
    info!(tiles = package.tile_count(), compiler = %package.compiler, "application package read");
    Ok(package)
}

pub fn print_timings(timings: &[PhaseTiming]) {
    eprintln!("{:<30} {:>10} {:>9} {:>9} {:>11}", "phase", "ms", "computed", "disk hits", "remote hits");
    for t in timings {
        eprintln!("{:<30} {:>10} {:>9} {:>9} {:>11}", t.phase, t.elapsed_ms, t.computed, t.disk_hits, t.remote_hits);
    }
    let sum = |f: fn(&PhaseTiming) -> u128| timings.iter().map(f).sum::<u128>();
    eprintln!("{:<30} {:>10} {:>9} {:>9} {:>11}", "total", sum(|t| t.elapsed_ms), sum(|t| t.computed as u128), sum(|t| t.disk_hits as u128), sum(|t| t.remote_hits as u128));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk_store(dir: &Path) -> Arc<DiskStore> {
        let options = BuildOptions {
            target: None,
            out_dir: dir.join("out"),
            incremental: true,
            cache_dir: Some(dir.to_path_buf()),
            cache_read_only: false,
            cache_max_bytes: None,
            plan_finalists: 4,
            table_budget: None,
            remote: None,
        };
        open_store(&options).expect("the cache opens").expect("an incremental build has a store")
    }

    fn entry(i: u8) -> (Digest, rkyv::util::AlignedVec<16>) {
        let mut bytes = rkyv::util::AlignedVec::<16>::new();
        bytes.extend_from_slice(&vec![i; 1000 + 7919 * i as usize]);
        (Digest::of_bytes(&[i]), bytes)
    }

    /// Entries handed over to be made later are made and written only once a hold is
    /// released, and are on disk after `flush`, as a new process would read them.
    #[test]
    fn deferred_entries_wait_for_a_hold_and_are_on_disk_after_flush() {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let store = disk_store(dir.path());
        let hold = store.hold();
        let made = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for i in 0..10 {
            let (key, bytes) = entry(i);
            let digest = Digest::of_bytes(&bytes);
            let counter = made.clone();
            let make: DeferredBytes = Box::new(move || {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Some(bytes)
            });
            store.store_deferred("test_stage", &key, 7, make, &digest);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        let reader = Cache::open(dir.path(), CacheOptions { read_only: true, max_bytes: None }).expect("the cache opens read-only");
        assert_eq!(made.load(std::sync::atomic::Ordering::SeqCst), 0, "made while held");
        assert!(reader.get("test_stage", &entry(0).0 .0, 7).is_none(), "written while held");
        drop(hold);
        store.flush();
        assert_eq!(made.load(std::sync::atomic::Ordering::SeqCst), 10);
        for i in 0..10 {
            let (key, bytes) = entry(i);
            assert_eq!(reader.get("test_stage", &key.0, 7).as_deref(), Some(&bytes[..]), "entry {i} after the hold and flush");
        }
    }

    /// Entries handed to the writer thread are on disk after `flush`, and after the store is
    /// dropped without one (a build that failed midway), as a new process would read them.
    #[test]
    fn entries_written_behind_are_on_disk_after_flush_and_drop() {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let store = disk_store(dir.path());
        for i in 0..20 {
            let (key, bytes) = entry(i);
            let digest = Digest::of_bytes(&bytes);
            store.store_owned("test_stage", &key, 7, bytes, &digest);
        }
        store.flush();
        let reader = Cache::open(dir.path(), CacheOptions { read_only: true, max_bytes: None }).expect("the cache opens read-only");
        for i in 0..20 {
            let (key, bytes) = entry(i);
            assert_eq!(reader.get("test_stage", &key.0, 7).as_deref(), Some(&bytes[..]), "entry {i} after flush");
        }
        for i in 20..30 {
            let (key, bytes) = entry(i);
            let digest = Digest::of_bytes(&bytes);
            store.store_owned("test_stage", &key, 7, bytes, &digest);
        }
        drop(store);
        for i in 20..30 {
            let (key, bytes) = entry(i);
            assert_eq!(reader.get("test_stage", &key.0, 7).as_deref(), Some(&bytes[..]), "entry {i} after drop");
        }
    }

    #[test]
    fn byte_counts_take_binary_units_and_name_bad_text() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1k"), Ok(1024));
        assert!(parse_bytes("3T").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("lots").unwrap_err().contains("'lots'"));
        assert!(parse_bytes("99999999999G").unwrap_err().contains("too large"));
    }
}

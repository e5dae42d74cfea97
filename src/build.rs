//! The build driver: sets the salsa inputs, runs the pipeline's phases in order with the
//! seed's spans and log lines, consults the disk cache when asked, and writes the package.
//!
//! Only this crate touches files: the compiler (`ipuq_queries`) gets text and returns bytes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ipuq_cache::{Cache, CacheOptions, Remote, RemoteOptions};
use ipuq_queries::db::{graph, Database, Origin, StageStore};
use ipuq_queries::hash::Digest;
use ipuq_queries::package::Package;
use ipuq_queries::pipeline::{lowered, package, run_phase, PHASES};
use ipuq_queries::target::fixtures;
use tracing::{info, info_span};

/// The disk cache, and the remote cache behind it, as the compiler's store trait: local, then
/// remote (verified, copied locally), then compute; computed entries go up in the background.
pub struct DiskStore {
    pub cache: Cache,
    pub remote: Option<Remote>,
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
}

impl DiskStore {
    fn remote_hits(&self) -> u64 {
        self.remote.as_ref().map_or(0, |r| r.counters().hits)
    }
}

impl Drop for DiskStore {
    /// Bounded wait for queued uploads, then the remote counters join the cache's totals.
    fn drop(&mut self) {
        if let Some(remote) = &mut self.remote {
            remote.finish(Some(&self.cache));
        }
    }
}

/// Opens the local cache (and the remote one, if asked) when the build is incremental.
pub fn open_store(options: &BuildOptions) -> Option<Arc<DiskStore>> {
    if !options.incremental && options.remote.is_none() {
        return None;
    }
    let dir = options.cache_dir.clone().unwrap_or_else(default_cache_dir);
    let cache = Cache::open_or_warn(&dir, CacheOptions { read_only: options.cache_read_only, max_bytes: None })?;
    let remote = options.remote.as_ref().and_then(Remote::open_or_warn);
    if let Some(remote) = &remote {
        info!(remote = remote.shown_url(), "using a remote cache");
    }
    Some(Arc::new(DiskStore { cache, remote }))
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
    match spec.unwrap_or("ipu21") {
        "ipu21" => Ok((fixtures::IPU21.to_string(), "ipu21 (built in)".into())),
        "small16" => Ok((fixtures::SMALL16.to_string(), "small16 (built in)".into())),
        path => std::fs::read_to_string(path)
            .map(|t| (t, path.to_string()))
            .map_err(|e| BuildError::Io { path: path.to_string(), message: format!("cannot read target description: {e}") }),
    }
}

pub struct BuildOptions {
    pub target: Option<String>,
    pub out_dir: PathBuf,
    pub incremental: bool,
    pub cache_dir: Option<PathBuf>,
    /// Use the cache's entries but write none (shared CI caches).
    pub cache_read_only: bool,
    /// A shared cache server behind the local cache (implies `incremental`).
    pub remote: Option<RemoteOptions>,
}

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
    pub package: Package,
    pub path: PathBuf,
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

/// Build `workload` into `out_dir/model.ipuexe`.
pub fn build(workload: &Path, options: &BuildOptions) -> Result<Built, BuildError> {
    build_with_store(workload, options, open_store(options))
}

/// [`build`] with a store the caller opened (and can inspect afterwards).
pub fn build_with_store(workload: &Path, options: &BuildOptions, disk: Option<Arc<DiskStore>>) -> Result<Built, BuildError> {
    let text = std::fs::read_to_string(workload).map_err(|e| BuildError::Io { path: workload.display().to_string(), message: format!("cannot read workload: {e}") })?;
    let (target_text, target_origin) = load_target(options.target.as_deref())?;
    let store = disk.clone().map(|d| d as Arc<dyn StageStore>);
    let verify = std::env::var_os("IPUQ_VERIFY_CACHE").is_some_and(|v| v == "1");
    let db = Database::new(store).verifying_hits(verify);
    let sources = ipuq_queries::db::sources(&db, text, workload.display().to_string(), target_text, target_origin);
    let target = ipuq_queries::db::target(&db, sources).map_err(|e| BuildError::Input(e.to_string()))?;
    let g = graph(&db, sources).map_err(|e| BuildError::Input(e.to_string()))?;
    let span = info_span!("ipuq.package.build", tile_count = target.value.chip.tiles, operations = g.value.compute_operation_count());
    let _build = span.enter();
    let mut timings = Vec::new();
    for &phase in PHASES {
        let phase_span = info_span!("ipuq.package.phase", phase);
        let _p = phase_span.enter();
        let start = Instant::now();
        let remote_before = disk.as_ref().map_or(0, |d| d.remote_hits());
        let result = run_phase(&db, sources, phase);
        let remote_hits = (disk.as_ref().map_or(0, |d| d.remote_hits()) - remote_before) as usize;
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
        if phase == "lower_mid" {
            let l = lowered(&db, sources).map_err(|e| BuildError::Compile(e.to_string()))?;
            info!(logical_shards = l.value.logical_shards, exchange_phases = l.value.phases.len(), "lowered graph for package construction");
        }
    }
    drop(_build);
    let pkg = package(&db, sources).map_err(|e| BuildError::Compile(e.to_string()))?;
    let package = (*pkg.value).clone();
    info!(final_cycles = package.summary.estimated_cycles, final_exchange = package.summary.estimated_exchange_cycles, "costed final placed program");
    let path = options.out_dir.join("model.ipuexe");
    write_package(&package, &path)?;
    Ok(Built { package, path, timings })
}

/// Write atomically (temporary file, then rename) so a reader never sees half a package.
pub fn write_package(package: &Package, path: &Path) -> Result<(), BuildError> {
    let io = |e: std::io::Error| BuildError::Io { path: path.display().to_string(), message: e.to_string() };
    info!(tiles = package.tile_count(), "writing application package");
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let bytes = package.to_bytes();
    let tmp = dir.join(format!(".model.ipuexe.{}.tmp", std::process::id()));
    std::fs::write(&tmp, &bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    info!("application package written");
    Ok(())
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

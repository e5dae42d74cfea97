//! The build driver: sets the salsa inputs, runs the pipeline's phases in order with the
//! seed's spans and log lines, consults the disk cache when asked, and writes the package.
//!
//! Only this crate touches files: the compiler (`ipuq_queries`) gets text and returns bytes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ipuq_cache::{Cache, CacheOptions};
use ipuq_queries::db::{graph, Database, Origin, StageStore};
use ipuq_queries::hash::Digest;
use ipuq_queries::package::Package;
use ipuq_queries::pipeline::{lowered, package, run_phase, PHASES};
use ipuq_queries::target::fixtures;
use tracing::{info, info_span};

/// The disk cache behind the compiler's store trait.
pub struct DiskStore(pub Cache);

impl StageStore for DiskStore {
    fn load(&self, stage: &str, key: &Digest, schema: u64) -> Option<rkyv::util::AlignedVec<16>> {
        self.0.get(stage, &key.0, schema)
    }
    fn store(&self, stage: &str, key: &Digest, schema: u64, bytes: &[u8]) {
        let _ = self.0.put_or_warn(stage, &key.0, schema, bytes);
    }
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
    /// Operator-plan finalists `lower_mid` keeps (`--plan-finalists`).
    pub plan_finalists: usize,
}

/// One stage's time and how its value was obtained.
pub struct PhaseTiming {
    pub phase: &'static str,
    pub elapsed_ms: u128,
    pub computed: usize,
    pub disk_hits: usize,
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
    let text = std::fs::read_to_string(workload).map_err(|e| BuildError::Io { path: workload.display().to_string(), message: format!("cannot read workload: {e}") })?;
    let (target_text, target_origin) = load_target(options.target.as_deref())?;
    let store: Option<Arc<dyn StageStore>> = if options.incremental {
        let dir = options.cache_dir.clone().unwrap_or_else(default_cache_dir);
        Cache::open_or_warn(&dir, CacheOptions { read_only: options.cache_read_only, max_bytes: None }).map(|c| Arc::new(DiskStore(c)) as Arc<dyn StageStore>)
    } else {
        None
    };
    let verify = std::env::var_os("IPUQ_VERIFY_CACHE").is_some_and(|v| v == "1");
    let db = Database::new(store).verifying_hits(verify).with_plan_finalists(options.plan_finalists);
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
        let result = run_phase(&db, sources, phase);
        let elapsed_ms = start.elapsed().as_millis();
        info!(phase, elapsed_ms = elapsed_ms as u64, success = result.is_ok(), "package build phase finished");
        let runs = db.take_runs();
        let computed = runs.iter().filter(|r| r.1 == Origin::Computed).count();
        let disk_hits = runs.iter().filter(|r| r.1 == Origin::DiskHit).count();
        if computed == 0 && disk_hits > 0 {
            info!(phase, stages = disk_hits, "reused cached stage outputs");
        }
        timings.push(PhaseTiming { phase, elapsed_ms, computed, disk_hits });
        result.map_err(|e| BuildError::Compile(e.to_string()))?;
        if phase == "select_finalist" {
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
    eprintln!("{:<30} {:>10} {:>9} {:>9}", "phase", "ms", "computed", "disk hits");
    for t in timings {
        eprintln!("{:<30} {:>10} {:>9} {:>9}", t.phase, t.elapsed_ms, t.computed, t.disk_hits);
    }
    let sum = |f: fn(&PhaseTiming) -> u128| timings.iter().map(f).sum::<u128>();
    eprintln!("{:<30} {:>10} {:>9} {:>9}", "total", sum(|t| t.elapsed_ms), sum(|t| t.computed as u128), sum(|t| t.disk_hits as u128));
}

//! Command-line and environment settings of the remote cache (`--remote-cache URL`,
//! `IPUQ_REMOTE_CACHE`), and `ipuq cache export | import`.
//!
//! Flags win over environment variables. Credentials belong in the environment
//! (`IPUQ_REMOTE_CACHE=http://user:pass@host/…`): a URL with credentials given as a flag
//! is accepted with a warning, because other users of the machine can read command lines.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ipuq_cache::{Cache, CacheOptions, RemoteOptions};

use crate::build::{BuildOptions, Session};

#[derive(clap::Args, Clone, Debug, Default)]
pub struct RemoteArgs {
    /// Shared cache server behind the local cache: http://HOST:PORT/PREFIX (Bazel layout) or
    /// redis://HOST:PORT/DB. Implies --incremental. Default: $IPUQ_REMOTE_CACHE.
    #[arg(long, value_name = "URL")]
    remote_cache: Option<String>,
    /// Read from the remote cache but upload nothing (untrusted jobs). Also IPUQ_REMOTE_CACHE_READ_ONLY=1.
    #[arg(long)]
    remote_cache_read_only: bool,
    /// Milliseconds allowed to connect to the remote (default 1000; IPUQ_REMOTE_CACHE_CONNECT_TIMEOUT_MS).
    #[arg(long, value_name = "MS")]
    remote_cache_connect_timeout_ms: Option<u64>,
    /// Milliseconds allowed per remote request once connected (default 5000; IPUQ_REMOTE_CACHE_TIMEOUT_MS).
    #[arg(long, value_name = "MS")]
    remote_cache_timeout_ms: Option<u64>,
}

fn env_ms(name: &str) -> Result<Option<u64>, String> {
    match std::env::var(name) {
        Ok(text) if !text.trim().is_empty() => text.trim().parse().map(Some).map_err(|_| format!("{name}={text}: expected a whole number of milliseconds")),
        _ => Ok(None),
    }
}

impl RemoteArgs {
    /// The remote cache to use, if any.
    pub fn options(&self) -> Result<Option<RemoteOptions>, String> {
        let from_flag = self.remote_cache.clone().filter(|u| !u.trim().is_empty());
        if from_flag.as_deref().is_some_and(|u| ipuq_cache::remote::redact(u) != u) {
            tracing::warn!("credentials in --remote-cache are visible to other users; prefer IPUQ_REMOTE_CACHE");
        }
        let Some(url) = from_flag.or_else(|| std::env::var("IPUQ_REMOTE_CACHE").ok().filter(|u| !u.trim().is_empty())) else {
            return Ok(None);
        };
        let mut options = RemoteOptions::new(url);
        options.read_only = self.remote_cache_read_only || std::env::var_os("IPUQ_REMOTE_CACHE_READ_ONLY").is_some_and(|v| v == "1");
        if let Some(ms) = self.remote_cache_connect_timeout_ms.or(env_ms("IPUQ_REMOTE_CACHE_CONNECT_TIMEOUT_MS")?) {
            options.connect_timeout = Duration::from_millis(ms.max(1));
        }
        if let Some(ms) = self.remote_cache_timeout_ms.or(env_ms("IPUQ_REMOTE_CACHE_TIMEOUT_MS")?) {
            options.io_timeout = Duration::from_millis(ms.max(1));
        }
        if let Some(ms) = env_ms("IPUQ_REMOTE_CACHE_UPLOAD_WAIT_MS")? {
            options.upload_wait = Duration::from_millis(ms);
        }
        Ok(Some(options))
    }
}

/// `ipuq cache export FILE [--workload W…]`: the entries the workloads need (building them
/// against the cache first, so missing entries are computed), or the whole cache.
pub fn export(dir: &Path, file: &Path, workloads: &[PathBuf], target: Option<&str>) -> Result<String, String> {
    if workloads.is_empty() {
        let cache = Cache::open(dir, CacheOptions::default()).map_err(|e| e.to_string())?;
        return cache.export(file, None).map(|r| r.to_string()).map_err(|e| e.to_string());
    }
    let scratch = std::env::temp_dir().join(format!("ipuq-export-{}", std::process::id()));
    let options = BuildOptions {
        target: target.map(str::to_owned),
        out_dir: scratch.clone(),
        incremental: true,
        cache_dir: Some(dir.to_path_buf()),
        cache_read_only: false,
        cache_max_bytes: None,
        plan_finalists: ipuq_queries::lower::search::DEFAULT_FINALISTS,
        table_budget: None,
        remote: None,
    };
    let mut session = Session::new(&options).map_err(|e| e.to_string())?;
    for workload in workloads {
        let built = session.build(workload, &options);
        let _ = std::fs::remove_dir_all(&scratch);
        built.map_err(|e| e.to_string())?;
    }
    let store = session.store().ok_or_else(|| format!("cannot open the cache at {}", dir.display()))?;
    let keys = store.cache.touched_keys();
    store.cache.export(file, Some(&keys)).map(|r| r.to_string()).map_err(|e| e.to_string())
}

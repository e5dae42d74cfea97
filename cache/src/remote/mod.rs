//! The remote tier: a cache server shared by a team or a CI fleet, behind the
//! local cache. Look-up order is local, then remote, then compute.
//!
//! ```text
//! http://[user:pass@]host:port/prefix   Bazel HTTP cache layout (nginx + WebDAV)
//!     PREFIX/ac/<key hex>               the manifest file, exactly as in ac/ on disk
//!     PREFIX/cas/<digest hex>           the bare payload, named by its blake3
//! redis://[user:pass@]host:port/db      the same two names as Redis keys
//! ```
//!
//! A remote hit is checked like a local file (header, length, blake3, stage
//! and key in the manifest; blake3 of the payload against the manifest) and
//! then stored in the local cache through [`Cache::put`], which hashes it
//! again. Computed entries go up in the background ([`upload`]), blob first
//! and manifest last, so a reader never finds a manifest before its blob.
//!
//! Architecture Invariant: the remote can never fail a build nor put bad bytes
//! in it. Every failure (unreachable, timeout, HTTP status, junk or truncated
//! body, Redis error) is a miss; the first one in a process is a warning, and
//! after [`FAILURES_TO_DISABLE`] in a row the remote is off for the rest of the
//! process. Bytes that fail a check are dropped, never stored or returned.
//!
//! Architecture Invariant: like the rest of the crate, this tier knows bytes
//! and digests only, and never logs credentials: URLs are shown through
//! [`redact`].

mod http;
mod redis;
mod stats;
mod upload;

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rkyv::util::AlignedVec;

use crate::header::{parse_bytes, Kind};
use crate::key::{digest_of, to_hex, Digest, Key};
use crate::manifest::Manifest;
use crate::store::{manifest_file, Cache};

pub use stats::RemoteCounters;
use upload::Uploader;

/// Failures in a row after which the remote is disabled for the process.
pub const FAILURES_TO_DISABLE: u32 = 3;

/// Where and how to reach a remote cache.
#[derive(Clone, PartialEq, Eq)]
pub struct RemoteOptions {
    /// `http://…` or `redis://…`, credentials included (never logged).
    pub url: String,
    /// Read hits but upload nothing (untrusted jobs such as pull requests).
    pub read_only: bool,
    /// Time allowed to open a connection (default 1 s).
    pub connect_timeout: Duration,
    /// Time allowed for each request once connected (default 5 s).
    pub io_timeout: Duration,
    /// Longest wait for queued uploads when the build ends (default 10 s).
    pub upload_wait: Duration,
}

impl RemoteOptions {
    /// Options with the default timeouts.
    pub fn new(url: impl Into<String>) -> RemoteOptions {
        RemoteOptions {
            url: url.into(),
            read_only: false,
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(5),
            upload_wait: Duration::from_secs(10),
        }
    }
}

impl fmt::Debug for RemoteOptions {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("RemoteOptions")
            .field("url", &redact(&self.url))
            .field("read_only", &self.read_only)
            .field("connect_timeout", &self.connect_timeout)
            .field("io_timeout", &self.io_timeout)
            .field("upload_wait", &self.upload_wait)
            .finish()
    }
}

/// Which half of the Bazel layout a name lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Area {
    /// Action cache: manifests by key.
    Ac,
    /// Content store: payloads by digest.
    Cas,
}

impl Area {
    pub(crate) fn dir(self) -> &'static str {
        match self {
            Area::Ac => "ac",
            Area::Cas => "cas",
        }
    }
}

/// Why one remote request failed. The text never holds credentials.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RemoteError {
    /// The URL is not one this build can use.
    #[error("remote cache URL {url}: {reason}")]
    Url { url: String, reason: String },
    /// Connecting, sending or receiving failed (refused, timed out, dropped).
    #[error("{0}")]
    Transport(String),
    /// The server answered with an unexpected HTTP status.
    #[error("HTTP status {0}")]
    Status(u16),
    /// The server answered with bytes that fail the checks.
    #[error("bad remote entry {name}: {problem}")]
    BadEntry { name: String, problem: String },
}

/// A key-value store holding the `ac/` and `cas/` names.
pub(crate) trait Backend: Send + Sync {
    /// The bytes under `area/hex`, `None` when absent.
    fn get(&self, area: Area, hex: &str) -> Result<Option<Vec<u8>>, RemoteError>;
    /// Whether `area/hex` exists (to skip uploading a blob twice).
    fn contains(&self, area: Area, hex: &str) -> Result<bool, RemoteError>;
    /// Stores `bytes` under `area/hex`.
    fn put(&self, area: Area, hex: &str, bytes: &[u8]) -> Result<(), RemoteError>;
}

/// Opens the backend that `url` names.
fn connect(options: &RemoteOptions) -> Result<Box<dyn Backend>, RemoteError> {
    let url = options.url.trim();
    let bad = |reason: &str| RemoteError::Url {
        url: redact(url),
        reason: reason.to_owned(),
    };
    match url.split_once("://").map(|(scheme, _)| scheme) {
        Some("http") => Ok(Box::new(http::HttpBackend::new(url, options)?)),
        Some("redis") => Ok(Box::new(redis::RedisBackend::new(url, options)?)),
        Some("https" | "rediss") => Err(bad(
            "TLS is not built into ipuq; use http:// or redis:// on a trusted network, or a local TLS-terminating proxy",
        )),
        _ => Err(bad("expected http://HOST:PORT/PREFIX or redis://HOST:PORT/DB")),
    }
}

/// `scheme://user:pass@host/…` shown as `scheme://***@host/…`.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => url.to_owned(),
    }
}

/// Failure bookkeeping shared by look-ups and the upload thread.
#[derive(Debug, Default)]
pub(crate) struct Health {
    in_a_row: AtomicU32,
    warned: AtomicBool,
    disabled: AtomicBool,
}

impl Health {
    pub(crate) fn is_disabled(&self) -> bool {
        self.disabled.load(Ordering::Relaxed)
    }

    pub(crate) fn success(&self) {
        self.in_a_row.store(0, Ordering::Relaxed);
    }

    /// Records a failure: the first is a warning, later ones are debug lines,
    /// and [`FAILURES_TO_DISABLE`] in a row turn the remote off.
    pub(crate) fn failure(&self, remote: &str, error: &RemoteError, counters: &stats::Live) {
        counters.errors.fetch_add(1, Ordering::Relaxed);
        let in_a_row = self.in_a_row.fetch_add(1, Ordering::Relaxed) + 1;
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(remote, %error, "remote cache failed; building on with the local cache");
        } else {
            tracing::debug!(remote, %error, "remote cache failed again");
        }
        if in_a_row >= FAILURES_TO_DISABLE && !self.disabled.swap(true, Ordering::Relaxed) {
            tracing::info!(remote, failures = in_a_row, "remote cache disabled for the rest of this process");
        }
    }
}

/// An open remote tier: the backend, its health, counters and uploads.
pub struct Remote {
    shown: String,
    backend: Arc<dyn Backend>,
    health: Arc<Health>,
    counters: Arc<stats::Live>,
    uploader: Option<Uploader>,
}

impl fmt::Debug for Remote {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "Remote({})", self.shown)
    }
}

impl Remote {
    /// Opens the remote tier. Nothing is sent yet; a URL this build cannot
    /// use is the only error (the caller warns and builds locally).
    pub fn open(options: &RemoteOptions) -> Result<Remote, RemoteError> {
        Ok(Remote::with_backend(Arc::from(connect(options)?), options))
    }

    pub(crate) fn with_backend(backend: Arc<dyn Backend>, options: &RemoteOptions) -> Remote {
        let shown = redact(options.url.trim());
        let health = Arc::new(Health::default());
        let counters = Arc::new(stats::Live::default());
        let uploader = (!options.read_only).then(|| {
            Uploader::start(
                backend.clone(),
                health.clone(),
                counters.clone(),
                shown.clone(),
                options.upload_wait,
            )
        });
        Remote {
            shown,
            backend,
            health,
            counters,
            uploader,
        }
    }

    /// [`Remote::open`], with an unusable URL logged as a warning.
    pub fn open_or_warn(options: &RemoteOptions) -> Option<Remote> {
        Remote::open(options)
            .map_err(|error| tracing::warn!(%error, "building without the remote cache"))
            .ok()
    }

    /// The URL with its credentials hidden.
    pub fn shown_url(&self) -> &str {
        &self.shown
    }

    /// Whether too many failures in a row have turned the remote off.
    pub fn is_disabled(&self) -> bool {
        self.health.is_disabled()
    }

    /// Looks `stage`/`key` up remotely. A hit that passes every check is
    /// stored in `local` (unless it is read-only) and returned; anything else
    /// is a miss, and a failure is recorded against the remote's health.
    pub fn fetch(&self, local: &Cache, stage: &str, key: &Key, schema: u64) -> Option<AlignedVec<16>> {
        if self.health.is_disabled() {
            return None;
        }
        match self.try_fetch(stage, key, schema) {
            Ok(Some(payload)) => {
                self.health.success();
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                local.put_or_warn(stage, key, schema, &payload);
                Some(payload)
            }
            Ok(None) => {
                self.health.success();
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(error) => {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                self.health.failure(&self.shown, &error, &self.counters);
                None
            }
        }
    }

    fn try_fetch(&self, stage: &str, key: &Key, schema: u64) -> Result<Option<AlignedVec<16>>, RemoteError> {
        let key_hex = to_hex(key);
        let Some(manifest_bytes) = self.backend.get(Area::Ac, &key_hex)? else {
            return Ok(None);
        };
        self.count_down(manifest_bytes.len());
        let bad = |name: &str, problem: String| RemoteError::BadEntry {
            name: name.to_owned(),
            problem,
        };
        let ac_name = format!("ac/{key_hex}");
        let (_, manifest_payload) = parse_bytes(&manifest_bytes, Kind::Manifest, Some(schema))
            .map_err(|problem| bad(&ac_name, problem.to_string()))?;
        let manifest = Manifest::decode(manifest_payload).map_err(|problem| bad(&ac_name, problem.to_string()))?;
        if !manifest.is_for(stage, key) {
            return Err(bad(&ac_name, "manifest names another stage or key".into()));
        }
        let digest_hex = to_hex(&manifest.digest);
        let cas_name = format!("cas/{digest_hex}");
        let Some(payload) = self.backend.get(Area::Cas, &digest_hex)? else {
            // A manifest without its blob: an upload still in flight, or an
            // evicted blob. A miss, not damage.
            return Ok(None);
        };
        self.count_down(payload.len());
        check_payload(&manifest, &payload).map_err(|problem| bad(&cas_name, problem))?;
        let mut aligned = AlignedVec::<16>::with_capacity(payload.len());
        aligned.extend_from_slice(&payload);
        Ok(Some(aligned))
    }

    fn count_down(&self, bytes: usize) {
        self.counters.bytes_down.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Queues the entry for upload (no-op when read-only or disabled). Never
    /// blocks: a full queue drops the entry and counts it.
    pub fn upload(&self, stage: &str, key: &Key, schema: u64, payload: &[u8]) {
        let Some(uploader) = &self.uploader else {
            return;
        };
        if self.health.is_disabled() {
            return;
        }
        let digest = digest_of(payload);
        let manifest = manifest_file(stage, key, schema, &digest, payload.len() as u64);
        uploader.enqueue(upload::Job {
            key_hex: to_hex(key),
            digest_hex: to_hex(&digest),
            manifest,
            payload: payload.to_vec(),
        });
    }

    /// This process's counters so far.
    pub fn counters(&self) -> RemoteCounters {
        self.counters.snapshot()
    }

    /// Waits (bounded) for queued uploads, then adds this process's counters
    /// to the totals kept in `local`'s directory. Called once; dropping the
    /// remote calls it too.
    pub fn finish(&mut self, local: Option<&Cache>) {
        if let Some(uploader) = self.uploader.take() {
            uploader.finish();
        }
        let counters = self.counters.take();
        if let Some(cache) = local.filter(|_| !counters.is_empty()) {
            stats::add_to_totals(cache, &counters);
        }
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        if let Some(uploader) = self.uploader.take() {
            uploader.finish();
        }
    }
}

/// Checks a payload against the manifest that points at it.
fn check_payload(manifest: &Manifest, payload: &[u8]) -> Result<(), String> {
    if payload.len() as u64 != manifest.payload_len {
        return Err(format!(
            "{} bytes where the manifest says {}",
            payload.len(),
            manifest.payload_len
        ));
    }
    let digest: Digest = digest_of(payload);
    if digest != manifest.digest {
        return Err("blake3 of the body does not match its name".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests;

//! The cache handle: opening the directory, looking entries up, publishing
//! them, and refreshing their last-used stamps.
//!
//! Layout under the root:
//!
//! - `cas/ab/cdef…`: blobs, named by the blake3 of their payload. A blob is
//!   pure content: its header's schema is [`BLOB_SCHEMA`], because identical
//!   bytes produced by two stages (an empty list, say) are one blob.
//! - `ac/ab/cdef…`: manifests, named by the key, binding a stage and key to
//!   an output digest. The manifest's header carries the caller's schema, so
//!   the type check happens where the stage, key and output meet.
//! - `ac/ab/cdef….used`: the entry's last-used stamp, an empty sidecar file
//!   whose modification time this crate sets explicitly on put and on the
//!   first hit of each process. Stamps live beside manifests, not inside
//!   them, so manifests stay immutable and byte-identical across builds; and
//!   they do not rely on atime, which most mounts do not keep.
//! - `tmp/`: files being written; anything left there is garbage.
//! - `gc.lock`: builds hold a shared `flock` while publishing, garbage
//!   collection and `clear` an exclusive one.
//!
//! This module must not panic on anything found on disk, must not modify a
//! published file in place, and must not fail a build: every failed check is
//! a miss, and every error is the caller's to turn into a warning.

use std::fs::{self, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use rkyv::util::AlignedVec;

use crate::error::{CacheError, Problem};
use crate::header::{read_file, Header, Kind};
use crate::key::{digest_of, fan_out, to_hex, Digest, Key};
use crate::manifest::Manifest;
use crate::publish::{lock, publish, remove_quietly, LockMode};
use crate::session::{Event, Session, StageCounters};

/// The schema recorded in every blob header (blobs are typed by the
/// manifests that point at them).
pub const BLOB_SCHEMA: u64 = 0;

/// Suffix of last-used stamp files beside manifests.
pub(crate) const STAMP_SUFFIX: &str = ".used";

/// How to open a cache.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheOptions {
    /// Never write: `put` is a no-op, hits refresh no stamps, damaged
    /// entries are left alone, and garbage collection is refused.
    pub read_only: bool,
    /// Size budget in bytes for [`Cache::enforce_budget`]; `None` means
    /// unbounded.
    pub max_bytes: Option<u64>,
}

/// An open cache directory. Cheap to share between threads (`&Cache` is
/// `Sync`); each process opening the cache has its own session.
#[derive(Debug)]
pub struct Cache {
    pub(crate) root: PathBuf,
    pub(crate) options: CacheOptions,
    pub(crate) session: Session,
}

impl Cache {
    /// Opens (and, unless read-only, creates) the cache at `root`, with
    /// `cas/`, `ac/`, `tmp/` and `gc.lock`. A writable cache is probed with a
    /// temporary file, so an unwritable directory is reported here as
    /// [`CacheError::NotWritable`] rather than on every `put`.
    pub fn open(root: &Path, options: CacheOptions) -> Result<Cache, CacheError> {
        let cache = Cache {
            root: root.to_path_buf(),
            options,
            session: Session::new(),
        };
        if options.read_only {
            for directory in [cache.cas_dir(), cache.ac_dir()] {
                match fs::metadata(&directory) {
                    Ok(metadata) if metadata.is_dir() => {}
                    Ok(_) => {
                        let source = std::io::Error::other("not a directory");
                        return Err(CacheError::Read {
                            path: directory,
                            source,
                        });
                    }
                    Err(source) => {
                        return Err(CacheError::Read {
                            path: directory,
                            source,
                        })
                    }
                }
            }
            return Ok(cache);
        }
        for directory in [cache.cas_dir(), cache.ac_dir(), cache.tmp_dir()] {
            fs::create_dir_all(&directory).map_err(|source| classify_create(directory, source))?;
        }
        let lock_path = cache.lock_path();
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&lock_path)
            .map_err(|source| CacheError::NotWritable {
                path: lock_path,
                source,
            })?;
        let probe = cache
            .tmp_dir()
            .join(format!("probe-{}", std::process::id()));
        fs::write(&probe, b"").map_err(|source| CacheError::NotWritable {
            path: cache.tmp_dir(),
            source,
        })?;
        remove_quietly(&probe);
        Ok(cache)
    }

    /// Opens the cache, or explains in a warning why the build goes on
    /// without it. A directory that exists but cannot be written is opened
    /// read-only instead, so its entries still serve hits.
    pub fn open_or_warn(root: &Path, options: CacheOptions) -> Option<Cache> {
        match Cache::open(root, options) {
            Ok(cache) => Some(cache),
            Err(error) if !options.read_only => {
                let read_only = CacheOptions {
                    read_only: true,
                    ..options
                };
                match Cache::open(root, read_only) {
                    Ok(cache) => {
                        tracing::warn!(%error, "using the cache read-only");
                        Some(cache)
                    }
                    Err(_) => {
                        tracing::warn!(%error, "building without the cache");
                        None
                    }
                }
            }
            Err(error) => {
                tracing::warn!(%error, "building without the cache");
                None
            }
        }
    }

    /// The cache directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The options the cache was opened with (read-only may have been forced
    /// by [`Cache::open_or_warn`]).
    pub fn options(&self) -> CacheOptions {
        self.options
    }

    /// Where the blob with this digest lives: `cas/ab/cdef…`.
    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        let (directory, rest) = fan_out(digest);
        self.cas_dir().join(directory).join(rest)
    }

    /// Where the manifest for this key lives: `ac/ab/cdef…`.
    pub fn manifest_path(&self, key: &Key) -> PathBuf {
        let (directory, rest) = fan_out(key);
        self.ac_dir().join(directory).join(rest)
    }

    /// Looks up the output of `stage` for `key`, expecting a payload of
    /// `schema`. Returns the payload in a 16-byte-aligned buffer, or `None`
    /// when anything is absent, stale or damaged; damage is logged with the
    /// file's name and the damaged file removed so that the next `put`
    /// repairs the entry.
    pub fn get(&self, stage: &str, key: &Key, schema: u64) -> Option<AlignedVec<16>> {
        match self.lookup(stage, key, schema) {
            Ok(payload) => {
                self.session.record(
                    stage,
                    Event::Hit {
                        bytes: payload.len() as u64,
                    },
                );
                if self.session.touch(key) {
                    self.stamp(key);
                }
                Some(payload)
            }
            Err((path, problem)) => {
                self.session.record(stage, Event::Miss);
                if !problem.is_missing() || path != self.manifest_path(key) {
                    tracing::warn!(file = %path.display(), %problem, stage, "cache entry unusable, recomputing");
                }
                if problem.is_damage() && !self.options.read_only {
                    remove_quietly(&path);
                }
                None
            }
        }
    }

    fn lookup(
        &self,
        stage: &str,
        key: &Key,
        schema: u64,
    ) -> Result<AlignedVec<16>, (PathBuf, Problem)> {
        let manifest_path = self.manifest_path(key);
        let (_, bytes) = read_file(&manifest_path, Kind::Manifest, Some(schema))
            .map_err(|problem| (manifest_path.clone(), problem))?;
        let manifest =
            Manifest::decode(&bytes).map_err(|problem| (manifest_path.clone(), problem))?;
        if !manifest.is_for(stage, key) {
            return Err((manifest_path, Problem::ManifestMismatch));
        }
        let blob_path = self.blob_path(&manifest.digest);
        let (header, payload) = read_file(&blob_path, Kind::Blob, Some(BLOB_SCHEMA))
            .map_err(|problem| (blob_path.clone(), problem))?;
        if header.payload_digest != manifest.digest {
            return Err((blob_path, Problem::MisnamedBlob));
        }
        Ok(payload)
    }

    /// Stores `payload` as the output of `stage` for `key`, and returns its
    /// digest (what downstream keys are derived from). The blob is published
    /// before the manifest, each atomically; an existing valid file is left
    /// untouched, and a damaged one is replaced. Concurrent puts of the same
    /// key write identical bytes, so whichever rename lands last changes
    /// nothing. In read-only mode nothing is written and the digest is still
    /// returned.
    pub fn put(
        &self,
        stage: &str,
        key: &Key,
        schema: u64,
        payload: &[u8],
    ) -> Result<Digest, CacheError> {
        self.put_digested(stage, key, schema, payload, digest_of(payload))
    }

    /// [`Cache::put`] of a payload whose blake3 the caller has computed (`digest`), so a
    /// large entry is not hashed twice. A wrong digest would name the blob wrongly, and
    /// every read would then reject it as damaged.
    pub fn put_digested(
        &self,
        stage: &str,
        key: &Key,
        schema: u64,
        payload: &[u8],
        digest: Digest,
    ) -> Result<Digest, CacheError> {
        if self.options.read_only {
            return Ok(digest);
        }
        let _shared = lock(&self.lock_path(), LockMode::Shared)?;
        let blob_path = self.blob_path(&digest);
        let blob_header = Header {
            kind: Kind::Blob,
            schema: BLOB_SCHEMA,
            payload_len: payload.len() as u64,
            payload_digest: digest,
        };
        if !blob_is_intact(&blob_path, &digest) {
            publish(
                &self.tmp_dir(),
                &blob_path,
                &[&blob_header.encode(), payload],
            )?;
        }
        let manifest_bytes = manifest_file(stage, key, schema, &digest, payload.len() as u64);
        let manifest_path = self.manifest_path(key);
        if fs::read(&manifest_path).ok().as_deref() != Some(manifest_bytes.as_slice()) {
            publish(&self.tmp_dir(), &manifest_path, &[&manifest_bytes])?;
        }
        self.session.touch(key);
        self.stamp(key);
        self.session.record(
            stage,
            Event::Write {
                bytes: payload.len() as u64,
            },
        );
        Ok(digest)
    }

    /// [`Cache::put`], with a failure logged as a warning instead of
    /// returned: a full disk or a permission problem must not fail a build.
    pub fn put_or_warn(
        &self,
        stage: &str,
        key: &Key,
        schema: u64,
        payload: &[u8],
    ) -> Option<Digest> {
        self.put_digested_or_warn(stage, key, schema, payload, digest_of(payload))
    }

    /// [`Cache::put_digested`], with a failure logged as a warning instead of returned.
    pub fn put_digested_or_warn(
        &self,
        stage: &str,
        key: &Key,
        schema: u64,
        payload: &[u8],
        digest: Digest,
    ) -> Option<Digest> {
        match self.put_digested(stage, key, schema, payload, digest) {
            Ok(digest) => Some(digest),
            Err(error) => {
                let disk_full = error.is_disk_full();
                tracing::warn!(%error, stage, disk_full, "could not store a cache entry");
                None
            }
        }
    }

    /// Every key this process looked up successfully or wrote, sorted: what
    /// a build needed (`ipuq cache export --workload`).
    pub fn touched_keys(&self) -> Vec<Key> {
        self.session.touched_keys()
    }

    /// Hits, misses and writes per stage in this process, for `--timings`.
    pub fn counters(&self) -> std::collections::BTreeMap<String, StageCounters> {
        self.session.counters()
    }

    /// Sets the entry's last-used stamp to now. A stamp that cannot be
    /// written only makes the entry look older to garbage collection, so
    /// failure is logged at debug level and otherwise ignored.
    fn stamp(&self, key: &Key) {
        if self.options.read_only {
            return;
        }
        let path = self.stamp_path(key);
        let result = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .and_then(|file| file.set_modified(SystemTime::now()));
        if let Err(error) = result {
            tracing::debug!(file = %path.display(), %error, "could not refresh a cache stamp");
        }
    }

    pub(crate) fn stamp_path(&self, key: &Key) -> PathBuf {
        let mut path = self.manifest_path(key).into_os_string();
        path.push(STAMP_SUFFIX);
        PathBuf::from(path)
    }

    pub(crate) fn cas_dir(&self) -> PathBuf {
        self.root.join("cas")
    }

    pub(crate) fn ac_dir(&self) -> PathBuf {
        self.root.join("ac")
    }

    pub(crate) fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    pub(crate) fn lock_path(&self) -> PathBuf {
        self.root.join("gc.lock")
    }
}

/// Whether a published blob is present and passes every check; reading it
/// back costs about what rewriting it would, and only happens when the blob
/// already exists (shared content, or a repair).
fn blob_is_intact(path: &Path, digest: &Digest) -> bool {
    match read_file(path, Kind::Blob, Some(BLOB_SCHEMA)) {
        Ok((header, _)) => &header.payload_digest == digest,
        Err(Problem::Missing) => false,
        Err(problem) => {
            tracing::warn!(file = %path.display(), %problem, blob = %to_hex(digest), "replacing a damaged cache blob");
            false
        }
    }
}

/// The bytes of the manifest file binding `stage` and `key` to a payload:
/// what `ac/` holds on disk, and what a remote cache's `ac/<key>` holds.
pub(crate) fn manifest_file(
    stage: &str,
    key: &Key,
    schema: u64,
    digest: &Digest,
    payload_len: u64,
) -> Vec<u8> {
    let manifest = Manifest {
        stage: stage.to_owned(),
        key: *key,
        digest: *digest,
        payload_len,
    };
    let manifest_payload = manifest.encode();
    let mut bytes = Header::for_payload(Kind::Manifest, schema, &manifest_payload)
        .encode()
        .to_vec();
    bytes.extend_from_slice(&manifest_payload);
    bytes
}

/// A directory that cannot be created because of permissions or a read-only
/// file system is "not writable"; anything else is a plain creation error.
fn classify_create(path: PathBuf, source: std::io::Error) -> CacheError {
    let read_only = matches!(source.raw_os_error(), Some(code) if code == nix::libc::EROFS);
    if read_only || source.kind() == std::io::ErrorKind::PermissionDenied {
        CacheError::NotWritable { path, source }
    } else {
        CacheError::CreateDir { path, source }
    }
}

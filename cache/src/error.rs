//! What can go wrong: errors returned to the caller and problems found in
//! entries.
//!
//! Two kinds, kept apart on purpose. A [`CacheError`] is an operation that
//! could not be done (the directory cannot be created, the disk is full); the
//! caller turns it into a warning and builds without the cache. A
//! [`Problem`] is a damaged or stale entry; it is never returned as an error
//! because a damaged entry is simply a miss. Nothing here may panic or print:
//! reporting belongs to the caller and to `tracing`.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// An operation on the cache that could not be done. Every variant names the
/// file or directory involved. None of these should fail a build: the caller
/// logs it and carries on without the cache (see [`crate::Cache::open_or_warn`]
/// and [`crate::Cache::put_or_warn`]).
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The cache root or one of its subdirectories could not be created.
    #[error("cannot create cache directory {path}: {source}")]
    CreateDir { path: PathBuf, source: io::Error },

    /// The cache directory exists but cannot be written (read-only mount,
    /// permissions). Opening it with `read_only: true` may still work.
    #[error("cache directory {path} is not writable: {source}")]
    NotWritable { path: PathBuf, source: io::Error },

    /// A directory or file that had to be read could not be.
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },

    /// Writing, flushing or publishing a file failed (a full disk shows up
    /// here; see [`CacheError::is_disk_full`]).
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },

    /// A file could not be removed during garbage collection or clearing.
    #[error("cannot remove {path}: {source}")]
    Remove { path: PathBuf, source: io::Error },

    /// The garbage-collection lock could not be taken.
    #[error("cannot lock {path}: {source}")]
    Lock {
        path: PathBuf,
        source: nix::errno::Errno,
    },

    /// A mutating maintenance operation was asked of a read-only cache.
    #[error("cache at {path} is opened read-only")]
    ReadOnly { path: PathBuf },
}

impl CacheError {
    /// The file or directory the error is about.
    pub fn path(&self) -> &Path {
        match self {
            CacheError::CreateDir { path, .. }
            | CacheError::NotWritable { path, .. }
            | CacheError::Read { path, .. }
            | CacheError::Write { path, .. }
            | CacheError::Remove { path, .. }
            | CacheError::Lock { path, .. }
            | CacheError::ReadOnly { path } => path,
        }
    }

    /// Whether the error is the file system running out of space (or quota),
    /// so that the caller can say so in its warning.
    pub fn is_disk_full(&self) -> bool {
        let source = match self {
            CacheError::Write { source, .. } | CacheError::CreateDir { source, .. } => source,
            _ => return false,
        };
        matches!(
            source.raw_os_error(),
            Some(code) if code == nix::libc::ENOSPC || code == nix::libc::EDQUOT
        )
    }
}

/// Why a stored file is not a usable entry. Any of these makes a lookup a
/// miss; [`crate::Cache::verify`] lists them per file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// The file does not exist.
    Missing,
    /// The file exists but could not be read.
    Unreadable(String),
    /// The file is shorter than its header, or its length disagrees with the
    /// payload length the header declares.
    WrongLength { expected: u64, found: u64 },
    /// The first bytes are not the cache's magic number.
    BadMagic,
    /// Written by another cache format version.
    FormatVersion { expected: u16, found: u16 },
    /// A blob where a manifest was expected, or the reverse.
    WrongKind { expected: u8, found: u8 },
    /// Written with another rkyv version or format flags.
    RkyvLayout { expected: u32, found: u32 },
    /// The payload's schema (type and version) is not the one asked for.
    Schema { expected: u64, found: u64 },
    /// The payload's blake3 does not match the header (bit rot, torn write).
    Checksum,
    /// A blob whose content does not hash to its file name.
    MisnamedBlob,
    /// The header's reserved bytes are not zero.
    ReservedBits,
    /// A manifest payload that does not decode.
    BadManifest(&'static str),
    /// A manifest for another stage or key (a key collision across stages,
    /// or a file copied into the wrong place).
    ManifestMismatch,
    /// A manifest whose blob is missing or damaged.
    BrokenBlob { blob: String },
    /// A file under `cas/` or `ac/` whose name is not a cache file name.
    UnexpectedFile,
}

impl fmt::Display for Problem {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Missing => write!(formatter, "missing"),
            Problem::Unreadable(reason) => write!(formatter, "unreadable: {reason}"),
            Problem::WrongLength { expected, found } => {
                write!(
                    formatter,
                    "wrong length: expected {expected} bytes, found {found}"
                )
            }
            Problem::BadMagic => write!(formatter, "not a cache file (bad magic)"),
            Problem::FormatVersion { expected, found } => {
                write!(
                    formatter,
                    "cache format version {found}, expected {expected}"
                )
            }
            Problem::WrongKind { expected, found } => {
                write!(formatter, "file kind {found}, expected {expected}")
            }
            Problem::RkyvLayout { expected, found } => {
                write!(formatter, "rkyv layout {found:#x}, expected {expected:#x}")
            }
            Problem::Schema { expected, found } => {
                write!(formatter, "schema {found:#x}, expected {expected:#x}")
            }
            Problem::Checksum => write!(formatter, "payload checksum mismatch"),
            Problem::MisnamedBlob => write!(formatter, "blob content does not match its name"),
            Problem::ReservedBits => write!(formatter, "reserved header bytes are not zero"),
            Problem::BadManifest(reason) => write!(formatter, "bad manifest: {reason}"),
            Problem::ManifestMismatch => {
                write!(formatter, "manifest belongs to another stage or key")
            }
            Problem::BrokenBlob { blob } => {
                write!(formatter, "its blob {blob} is missing or damaged")
            }
            Problem::UnexpectedFile => write!(formatter, "not a cache file name"),
        }
    }
}

impl Problem {
    /// Whether this is a plain absence rather than damage: absences are not
    /// worth a warning, damage is.
    pub fn is_missing(&self) -> bool {
        matches!(self, Problem::Missing)
    }

    /// Whether the file is fine but from another schema or format version:
    /// a clean miss, not damage.
    pub fn is_stale(&self) -> bool {
        matches!(
            self,
            Problem::Schema { .. } | Problem::FormatVersion { .. } | Problem::RkyvLayout { .. }
        )
    }

    /// Whether the file's own bytes are bad, so that removing it loses
    /// nothing. Absence, stale versions, unreadable files (which may be a
    /// passing lack of file descriptors) and key mismatches are not damage.
    pub fn is_damage(&self) -> bool {
        matches!(
            self,
            Problem::WrongLength { .. }
                | Problem::BadMagic
                | Problem::WrongKind { .. }
                | Problem::Checksum
                | Problem::MisnamedBlob
                | Problem::ReservedBits
                | Problem::BadManifest(_)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_full_is_recognised_and_paths_are_named() {
        let full = CacheError::Write {
            path: PathBuf::from("/cache/tmp/1"),
            source: io::Error::from_raw_os_error(nix::libc::ENOSPC),
        };
        assert!(full.is_disk_full());
        assert!(full.to_string().contains("/cache/tmp/1"));
        let denied = CacheError::Write {
            path: PathBuf::from("/cache/tmp/2"),
            source: io::Error::from_raw_os_error(nix::libc::EACCES),
        };
        assert!(!denied.is_disk_full());
        assert_eq!(denied.path(), Path::new("/cache/tmp/2"));
    }

    #[test]
    fn problems_classify() {
        assert!(Problem::Missing.is_missing());
        assert!(Problem::Schema {
            expected: 1,
            found: 2
        }
        .is_stale());
        assert!(!Problem::Checksum.is_stale());
        assert!(Problem::Checksum.is_damage());
        assert!(!Problem::Missing.is_damage());
        assert!(!Problem::Schema {
            expected: 1,
            found: 2
        }
        .is_damage());
        assert_eq!(Problem::Checksum.to_string(), "payload checksum mismatch");
    }
}

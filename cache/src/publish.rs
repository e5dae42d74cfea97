//! Atomic publication of files and the garbage-collection lock.
//!
//! A file is published by writing it under `tmp/` with a name no other writer
//! uses, flushing it to disk, and renaming it into place. Rename within one
//! file system is atomic, so a reader sees either no file or the whole file,
//! and a writer killed at any point leaves at worst garbage in `tmp/` (which
//! garbage collection removes). This module must never open a published file
//! for writing: published files are replaced by rename or removed, never
//! modified.
//!
//! The parent directory is not fsynced after the rename. After a power loss
//! the rename may be lost, and that is only a miss; a file whose data was lost
//! fails its checksum and is also only a miss.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use crate::error::CacheError;

/// Distinguishes temporary files written by threads of this process; the
/// process id distinguishes processes.
static TEMPORARY_COUNTER: AtomicU64 = AtomicU64::new(0);

/// How many names to try before giving up on `tmp/` (a name is only taken
/// when a crashed process with the same id left its file behind).
const NAME_ATTEMPTS: u32 = 64;

/// Writes `parts` (concatenated) to a fresh file in `tmp_dir`, flushes it,
/// and renames it to `target`, creating `target`'s parent directory if
/// needed. On failure the temporary file is removed and the target is left
/// as it was.
pub(crate) fn publish(tmp_dir: &Path, target: &Path, parts: &[&[u8]]) -> Result<(), CacheError> {
    let (temporary, mut file) = create_temporary(tmp_dir)?;
    let written = write_parts(&mut file, parts)
        .and_then(|()| file.sync_data())
        .map_err(|source| CacheError::Write {
            path: temporary.clone(),
            source,
        });
    drop(file);
    let result = written.and_then(|()| rename_into_place(&temporary, target));
    if result.is_err() {
        remove_quietly(&temporary);
    }
    result
}

fn write_parts(file: &mut File, parts: &[&[u8]]) -> std::io::Result<()> {
    for part in parts {
        file.write_all(part)?;
    }
    Ok(())
}

fn create_temporary(tmp_dir: &Path) -> Result<(PathBuf, File), CacheError> {
    let process = std::process::id();
    let mut last_error = None;
    for _ in 0..NAME_ATTEMPTS {
        let serial = TEMPORARY_COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = tmp_dir.join(format!("{process}-{serial}.tmp"));
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(file) => return Ok((path, file)),
            Err(error) if error.kind() == ErrorKind::AlreadyExists => last_error = Some(error),
            Err(source) => return Err(CacheError::Write { path, source }),
        }
    }
    let source = last_error.unwrap_or_else(|| ErrorKind::AlreadyExists.into());
    Err(CacheError::Write {
        path: tmp_dir.to_path_buf(),
        source,
    })
}

fn rename_into_place(temporary: &Path, target: &Path) -> Result<(), CacheError> {
    match fs::rename(temporary, target) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == ErrorKind::NotFound => {
            // The fan-out directory does not exist yet (or garbage collection
            // removed it): create it and try once more.
            if let Some(parent) = target.parent() {
                fs::create_dir_all(parent).map_err(|source| CacheError::Write {
                    path: parent.to_path_buf(),
                    source,
                })?;
            }
            fs::rename(temporary, target).map_err(|source| CacheError::Write {
                path: target.to_path_buf(),
                source,
            })
        }
        Err(source) => Err(CacheError::Write {
            path: target.to_path_buf(),
            source,
        }),
    }
}

/// Removes a file, ignoring failure: used for cleanup where the file may
/// already be gone and a failure changes nothing for the caller.
pub(crate) fn remove_quietly(path: &Path) {
    if let Err(error) = fs::remove_file(path) {
        if error.kind() != ErrorKind::NotFound {
            tracing::debug!(path = %path.display(), %error, "could not remove cache file");
        }
    }
}

/// Which lock to take on `gc.lock`: builds share it while publishing;
/// garbage collection and clearing hold it alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockMode {
    Shared,
    Exclusive,
}

/// Takes a `flock` on the lock file, blocking until it is granted. Each call
/// opens its own file description: flock locks belong to the description, so
/// threads of one process sharing a description would release each other's
/// locks. The lock is released when the returned guard is dropped.
pub(crate) fn lock(path: &Path, mode: LockMode) -> Result<Flock<File>, CacheError> {
    let mut file = File::open(path).map_err(|source| CacheError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let argument = match mode {
        LockMode::Shared => FlockArg::LockShared,
        LockMode::Exclusive => FlockArg::LockExclusive,
    };
    loop {
        match Flock::lock(file, argument) {
            Ok(guard) => return Ok(guard),
            Err((returned, Errno::EINTR)) => file = returned,
            Err((_, source)) => {
                return Err(CacheError::Lock {
                    path: path.to_path_buf(),
                    source,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_creates_parent_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tmp = dir.path().join("tmp");
        fs::create_dir(&tmp).expect("tmp dir");
        let target = dir.path().join("cas").join("ab").join("cdef");
        publish(&tmp, &target, &[b"head", b"body"]).expect("publishes");
        assert_eq!(fs::read(&target).expect("target"), b"headbody");
        assert_eq!(fs::read_dir(&tmp).expect("tmp").count(), 0);
    }

    #[test]
    fn publish_replaces_by_rename_and_skips_taken_names() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tmp = dir.path().join("tmp");
        fs::create_dir(&tmp).expect("tmp dir");
        // A crashed process with our id left the next names behind.
        let next = TEMPORARY_COUNTER.load(Ordering::Relaxed);
        for serial in next..next + 3 {
            fs::write(
                tmp.join(format!("{}-{serial}.tmp", std::process::id())),
                b"junk",
            )
            .expect("junk");
        }
        let target = dir.path().join("file");
        fs::write(&target, b"old").expect("old");
        publish(&tmp, &target, &[b"new"]).expect("publishes");
        assert_eq!(fs::read(&target).expect("target"), b"new");
    }

    #[test]
    fn publish_failure_names_the_file_and_cleans_up() {
        let dir = tempfile::tempdir().expect("tempdir");
        let error = publish(
            &dir.path().join("no-such-tmp"),
            &dir.path().join("x"),
            &[b"x"],
        )
        .expect_err("tmp dir is missing");
        assert!(error.path().starts_with(dir.path().join("no-such-tmp")));
        assert!(!dir.path().join("x").exists());
    }

    #[test]
    fn shared_locks_coexist_and_exclusive_waits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("gc.lock");
        fs::write(&path, b"").expect("lock file");
        let first = lock(&path, LockMode::Shared).expect("shared");
        let second = lock(&path, LockMode::Shared).expect("shared again");
        let probe = File::open(&path).expect("open");
        let attempt = Flock::lock(probe, FlockArg::LockExclusiveNonblock);
        assert!(
            attempt.is_err(),
            "exclusive lock granted while shared locks are held"
        );
        drop((first, second));
        assert!(lock(&path, LockMode::Exclusive).is_ok());
    }
}

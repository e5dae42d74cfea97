//! Exclusive ownership of a device through a lock file (`device.lock` next to the artifacts).
//!
//! The lock is an advisory `flock` on the file, held for as long as the [`DeviceLock`] lives
//! and released by the kernel when the process dies, so a crashed run never leaves a stale
//! lock behind. A second owner polls until the holder lets go or its timeout passes; it then
//! fails with an error naming the lock file and the timeout. This module must not delete the
//! lock file (another process may be waiting on the same inode) and must not block forever.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

/// How often a waiting owner retries: short enough to hand over promptly, long enough not
/// to spin on a busy machine.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("cannot open device lock file {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("gave up waiting for device lock {path} after {timeout:?}: another run still owns the device")]
    Timeout { path: PathBuf, timeout: Duration },
    #[error("cannot lock device lock file {path}: {errno}")]
    Flock { path: PathBuf, errno: Errno },
}

/// Ownership of the device; dropping it releases the lock.
#[derive(Debug)]
pub struct DeviceLock {
    path: PathBuf,
    _lock: Flock<File>,
}

impl DeviceLock {
    /// Take the lock at `path` (created if absent), waiting at most `timeout`.
    pub fn acquire(path: &Path, timeout: Duration) -> Result<DeviceLock, LockError> {
        let _span = tracing::info_span!("ipuq.device.lock").entered();
        tracing::info!(path = %path.display(), "waiting for hardware ownership");
        let started = Instant::now();
        let mut announced = false;
        loop {
            let file = OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(path)
                .map_err(|source| LockError::Open { path: path.to_path_buf(), source })?;
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => {
                    tracing::info!(path = %path.display(), "acquired hardware ownership");
                    return Ok(DeviceLock { path: path.to_path_buf(), _lock: lock });
                }
                Err((_, Errno::EWOULDBLOCK)) | Err((_, Errno::EINTR)) => {}
                Err((_, errno)) => return Err(LockError::Flock { path: path.to_path_buf(), errno }),
            }
            let waited = started.elapsed();
            if waited >= timeout {
                return Err(LockError::Timeout { path: path.to_path_buf(), timeout });
            }
            if !announced {
                announced = true;
                // A warning, so that it shows under the default log filter: the run looks stuck.
                tracing::warn!(path = %path.display(), timeout = ?timeout, "device is owned by another run; waiting for it to finish");
            }
            std::thread::sleep(POLL_INTERVAL.min(timeout - waited));
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_owner_times_out_then_succeeds_after_release() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("device.lock");
        let first = DeviceLock::acquire(&path, Duration::from_secs(1)).unwrap();
        let err = DeviceLock::acquire(&path, Duration::from_millis(60)).unwrap_err();
        assert!(matches!(err, LockError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("device.lock"), "{err}");
        drop(first);
        DeviceLock::acquire(&path, Duration::from_millis(60)).unwrap();
    }
}

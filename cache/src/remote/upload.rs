//! Background uploads: a bounded queue drained by one thread, and a bounded
//! wait for it when the build ends.
//!
//! `enqueue` never blocks the build: when the queue holds [`MAX_QUEUED`]
//! entries or [`MAX_QUEUED_BYTES`] of payload, the entry is dropped and
//! counted (a later build computes and uploads it again). Each entry goes up
//! blob first (skipped when the server already has it) and manifest last.
//! `finish` closes the queue and waits at most the configured time; entries
//! still queued then are abandoned with a warning, and the process exits.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::stats::Live;
use super::{Area, Backend, Health};

/// Most entries waiting for upload.
pub(crate) const MAX_QUEUED: usize = 1024;
/// Most payload bytes waiting for upload.
pub(crate) const MAX_QUEUED_BYTES: u64 = 512 << 20;

/// One entry to upload.
pub(crate) struct Job {
    pub(crate) key_hex: String,
    pub(crate) digest_hex: String,
    pub(crate) manifest: Vec<u8>,
    pub(crate) payload: Vec<u8>,
}

impl Job {
    fn bytes(&self) -> u64 {
        (self.manifest.len() + self.payload.len()) as u64
    }
}

/// Entries and bytes queued or being sent, with a condition variable that
/// `finish` waits on.
#[derive(Default)]
struct Pending {
    state: Mutex<(usize, u64)>,
    drained: Condvar,
}

pub(crate) struct Uploader {
    sender: Option<SyncSender<Job>>,
    pending: Arc<Pending>,
    counters: Arc<Live>,
    wait: Duration,
    remote: String,
}

impl Uploader {
    pub(crate) fn start(backend: Arc<dyn Backend>, health: Arc<Health>, counters: Arc<Live>, remote: String, wait: Duration) -> Uploader {
        let (sender, receiver) = sync_channel::<Job>(MAX_QUEUED);
        let pending = Arc::new(Pending::default());
        let worker = Worker { backend, health, counters: counters.clone(), pending: pending.clone(), remote: remote.clone() };
        let spawned = thread::Builder::new().name("ipuq-remote-upload".into()).spawn(move || worker.run(receiver));
        let sender = match spawned {
            Ok(_) => Some(sender),
            Err(error) => {
                tracing::warn!(%error, "cannot start the remote-cache upload thread; uploading nothing");
                None
            }
        };
        Uploader { sender, pending, counters, wait, remote }
    }

    /// Queues `job` unless the queue is full (then it is dropped and counted).
    pub(crate) fn enqueue(&self, job: Job) {
        let Some(sender) = &self.sender else {
            self.counters.uploads_dropped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let bytes = job.bytes();
        {
            let mut state = self.pending.state.lock().unwrap_or_else(|p| p.into_inner());
            if state.1.saturating_add(bytes) > MAX_QUEUED_BYTES && state.0 > 0 {
                drop(state);
                self.counters.uploads_dropped.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("remote-cache upload queue full (bytes); entry dropped");
                return;
            }
            state.0 += 1;
            state.1 += bytes;
        }
        if let Err(error) = sender.try_send(job) {
            let reason = match error {
                TrySendError::Full(_) => "full",
                TrySendError::Disconnected(_) => "closed",
            };
            self.pending.done(bytes);
            self.counters.uploads_dropped.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(reason, "remote-cache upload queue refused an entry");
        }
    }

    /// Closes the queue and waits at most the configured time for it to drain.
    pub(crate) fn finish(mut self) {
        drop(self.sender.take());
        let deadline = Instant::now() + self.wait;
        let mut state = self.pending.state.lock().unwrap_or_else(|p| p.into_inner());
        while state.0 > 0 {
            let now = Instant::now();
            if now >= deadline {
                let (entries, bytes) = *state;
                self.counters.uploads_dropped.fetch_add(entries as u64, Ordering::Relaxed);
                tracing::warn!(remote = %self.remote, entries, bytes, wait_ms = self.wait.as_millis() as u64, "remote-cache uploads still queued at exit; abandoned");
                return;
            }
            state = self.pending.drained.wait_timeout(state, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

impl Pending {
    fn done(&self, bytes: u64) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.0 = state.0.saturating_sub(1);
        state.1 = state.1.saturating_sub(bytes);
        if state.0 == 0 {
            self.drained.notify_all();
        }
    }
}

struct Worker {
    backend: Arc<dyn Backend>,
    health: Arc<Health>,
    counters: Arc<Live>,
    pending: Arc<Pending>,
    remote: String,
}

impl Worker {
    fn run(self, receiver: Receiver<Job>) {
        while let Ok(job) = receiver.recv() {
            let bytes = job.bytes();
            if self.health.is_disabled() {
                self.counters.uploads_dropped.fetch_add(1, Ordering::Relaxed);
            } else {
                match self.send(&job) {
                    Ok(()) => {
                        self.health.success();
                        self.counters.uploads.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(error) => {
                        self.counters.uploads_dropped.fetch_add(1, Ordering::Relaxed);
                        self.health.failure(&self.remote, &error, &self.counters);
                    }
                }
            }
            self.pending.done(bytes);
        }
    }

    fn send(&self, job: &Job) -> Result<(), super::RemoteError> {
        if !self.backend.contains(Area::Cas, &job.digest_hex)? {
            self.backend.put(Area::Cas, &job.digest_hex, &job.payload)?;
            self.counters.bytes_up.fetch_add(job.payload.len() as u64, Ordering::Relaxed);
        }
        self.backend.put(Area::Ac, &job.key_hex, &job.manifest)?;
        self.counters.bytes_up.fetch_add(job.manifest.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

//! Garbage collection under a size budget, and clearing the cache.
//!
//! Both hold the exclusive lock on `gc.lock`, so no `put` is publishing while
//! they run: whatever is in `tmp/` then is left over from a crash, and a blob
//! no manifest points at is an orphan, not a publish in progress.
//!
//! Eviction is least-recently-used by the explicit stamps beside manifests
//! (the manifest's own modification time when a stamp is missing). It must
//! never remove an entry this process used or wrote, nor one stamped since
//! this process opened the cache, which covers builds running alongside. A
//! build that last touched an entry before the collecting process started is
//! not protected: its later lookups simply miss.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs;
use std::time::SystemTime;

use crate::error::CacheError;
use crate::inspect::{human_bytes, list, read_manifest, Listed};
use crate::key::{Digest, Key};
use crate::publish::{lock, remove_quietly, LockMode};
use crate::store::Cache;

/// What a garbage collection did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GcReport {
    /// Bytes of blobs and manifests before and after.
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// Manifests removed: evicted, unreadable, or pointing at no blob.
    pub removed_entries: u64,
    /// Blobs removed because no manifest pointed at them any more.
    pub removed_blobs: u64,
    /// Files removed from `tmp/` (left by crashed or killed builds).
    pub removed_temporaries: u64,
    /// Entries kept although over budget, because they are in use.
    pub protected_entries: u64,
}

impl fmt::Display for GcReport {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "{} -> {}: removed {} entries, {} blobs, {} temporary files; {} entries in use kept",
            human_bytes(self.bytes_before),
            human_bytes(self.bytes_after),
            self.removed_entries,
            self.removed_blobs,
            self.removed_temporaries,
            self.protected_entries,
        )
    }
}

/// A manifest as garbage collection sees it.
struct Entry {
    file: Listed,
    key: Key,
    digest: Digest,
    last_used: SystemTime,
}

impl Cache {
    /// Evicts least-recently-used entries until blobs and manifests take at
    /// most `max_bytes`, sparing entries in use (see the module docs). Also
    /// removes leftovers of crashed builds, unreadable manifests, manifests
    /// without a blob and blobs without a manifest. Refused on a read-only
    /// cache.
    pub fn gc(&self, max_bytes: u64) -> Result<GcReport, CacheError> {
        if self.options.read_only {
            return Err(CacheError::ReadOnly {
                path: self.root.clone(),
            });
        }
        let _exclusive = lock(&self.lock_path(), LockMode::Exclusive)?;
        let mut report = GcReport {
            removed_temporaries: self.remove_temporaries()?,
            ..GcReport::default()
        };

        let mut blobs: HashMap<Digest, Listed> = HashMap::new();
        for blob in list(&self.cas_dir())? {
            report.bytes_before += blob.len;
            match blob.name.filter(|_| !blob.is_stamp) {
                Some(digest) => {
                    blobs.insert(digest, blob);
                }
                None => remove(&blob, &mut report.removed_blobs),
            }
        }

        let (entries, stamps) = self.read_entries(&mut report)?;
        let mut references: HashMap<Digest, u64> = HashMap::new();
        for entry in &entries {
            *references.entry(entry.digest).or_default() += 1;
        }
        blobs.retain(|digest, blob| {
            let referenced = references.contains_key(digest);
            if !referenced {
                remove(blob, &mut report.removed_blobs);
            }
            referenced
        });
        let mut total: u64 = blobs.values().map(|blob| blob.len).sum::<u64>()
            + entries.iter().map(|entry| entry.file.len).sum::<u64>();

        let mut entries = entries;
        entries.sort_by(|a, b| {
            a.last_used
                .cmp(&b.last_used)
                .then_with(|| a.file.path.cmp(&b.file.path))
        });
        for entry in entries {
            // A manifest without its blob is a miss anyway: remove it even
            // under budget, unless this session is about to repair it.
            let dead = !blobs.contains_key(&entry.digest);
            if !dead && total <= max_bytes {
                continue;
            }
            if self.session.has_touched(&entry.key) || entry.last_used >= self.session.start {
                report.protected_entries += u64::from(!dead);
                continue;
            }
            remove(&entry.file, &mut report.removed_entries);
            total -= entry.file.len;
            if let Some(stamp) = stamps.get(&entry.key) {
                remove_quietly(&stamp.path);
            }
            let remaining = references.entry(entry.digest).or_default();
            *remaining = remaining.saturating_sub(1);
            if *remaining == 0 {
                if let Some(blob) = blobs.remove(&entry.digest) {
                    total -= blob.len;
                    remove(&blob, &mut report.removed_blobs);
                }
            }
        }
        report.bytes_after = total;
        tracing::info!(%report, "cache garbage collected");
        Ok(report)
    }

    /// Runs [`Cache::gc`] with the budget given in [`crate::CacheOptions`];
    /// does nothing without a budget or on a read-only cache.
    pub fn enforce_budget(&self) -> Result<Option<GcReport>, CacheError> {
        match self.options.max_bytes {
            Some(max_bytes) if !self.options.read_only => self.gc(max_bytes).map(Some),
            _ => Ok(None),
        }
    }

    /// Removes every entry, blob and temporary file, keeping the directory
    /// structure. Refused on a read-only cache.
    pub fn clear(&self) -> Result<(), CacheError> {
        if self.options.read_only {
            return Err(CacheError::ReadOnly {
                path: self.root.clone(),
            });
        }
        let _exclusive = lock(&self.lock_path(), LockMode::Exclusive)?;
        for directory in [self.ac_dir(), self.cas_dir(), self.tmp_dir()] {
            match fs::remove_dir_all(&directory) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(CacheError::Remove {
                        path: directory,
                        source,
                    })
                }
            }
            fs::create_dir_all(&directory).map_err(|source| CacheError::CreateDir {
                path: directory,
                source,
            })?;
        }
        self.reset_remote_totals();
        Ok(())
    }

    /// Reads every manifest under `ac/`, removing those that cannot be read
    /// and stamps whose manifest is gone. Returns the entries and the stamps
    /// by key.
    fn read_entries(
        &self,
        report: &mut GcReport,
    ) -> Result<(Vec<Entry>, HashMap<Key, Listed>), CacheError> {
        let files = list(&self.ac_dir())?;
        let (stamp_files, manifest_files): (Vec<Listed>, Vec<Listed>) =
            files.into_iter().partition(|file| file.is_stamp);
        let mut stamps: HashMap<Key, Listed> = HashMap::new();
        for stamp in stamp_files {
            match stamp.name {
                Some(key) => {
                    stamps.insert(key, stamp);
                }
                None => remove_quietly(&stamp.path),
            }
        }
        let mut entries = Vec::with_capacity(manifest_files.len());
        for file in manifest_files {
            report.bytes_before += file.len;
            let Some(key) = file.name else {
                remove(&file, &mut report.removed_entries);
                continue;
            };
            match read_manifest(&file.path, &key) {
                Ok(manifest) => {
                    let last_used = stamps
                        .get(&key)
                        .map_or(file.modified, |stamp| stamp.modified);
                    entries.push(Entry {
                        file,
                        key,
                        digest: manifest.digest,
                        last_used,
                    });
                }
                Err(problem) => {
                    tracing::debug!(file = %file.path.display(), %problem, "removing an unusable cache manifest");
                    remove(&file, &mut report.removed_entries);
                }
            }
        }
        let keys: HashSet<Key> = entries.iter().map(|entry| entry.key).collect();
        stamps.retain(|key, stamp| {
            let has_manifest = keys.contains(key);
            if !has_manifest {
                remove_quietly(&stamp.path);
            }
            has_manifest
        });
        Ok((entries, stamps))
    }

    fn remove_temporaries(&self) -> Result<u64, CacheError> {
        let directory = self.tmp_dir();
        let listing = match fs::read_dir(&directory) {
            Ok(listing) => listing,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(source) => {
                return Err(CacheError::Read {
                    path: directory,
                    source,
                })
            }
        };
        let mut removed = 0;
        for file in listing.flatten() {
            remove_quietly(&file.path());
            removed += 1;
        }
        Ok(removed)
    }
}

fn remove(file: &Listed, count: &mut u64) {
    remove_quietly(&file.path);
    *count += 1;
}

//! Looking at the whole cache: listing its files, `stats` and `verify`.
//!
//! These walk every file under `cas/` and `ac/`, so they are for the
//! `ipuq cache stats | verify` commands and for garbage collection, never for
//! the lookup path of a build. They must not change anything on disk: repair
//! is left to `put` (which replaces damaged files) and to `gc` and `clear`.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::error::{CacheError, Problem};
use crate::header::{read_file, Kind};
use crate::key::{from_hex, to_hex, Digest, Key};
use crate::manifest::Manifest;
use crate::store::{Cache, BLOB_SCHEMA, STAMP_SUFFIX};

/// A file found under a fan-out directory (`cas/ab/…` or `ac/ab/…`).
#[derive(Debug, Clone)]
pub(crate) struct Listed {
    pub(crate) path: PathBuf,
    /// The 64-digit name (fan-out directory and file name), if it is one.
    pub(crate) name: Option<[u8; 32]>,
    pub(crate) is_stamp: bool,
    pub(crate) len: u64,
    pub(crate) modified: SystemTime,
}

/// Lists every file in the fan-out directories under `top`. Files removed
/// while listing (a concurrent get removing a damaged file) are skipped.
pub(crate) fn list(top: &Path) -> Result<Vec<Listed>, CacheError> {
    let mut listed = Vec::new();
    let read = |path: &Path| {
        fs::read_dir(path).map_err(|source| CacheError::Read {
            path: path.to_path_buf(),
            source,
        })
    };
    for fan in read(top)? {
        let fan = fan.map_err(|source| CacheError::Read {
            path: top.to_path_buf(),
            source,
        })?;
        let fan_name = fan.file_name().to_string_lossy().into_owned();
        if !fan.path().is_dir() {
            listed.extend(listed_file(fan.path(), None, false));
            continue;
        }
        for file in read(&fan.path())? {
            let file = file.map_err(|source| CacheError::Read {
                path: fan.path(),
                source,
            })?;
            let file_name = file.file_name().to_string_lossy().into_owned();
            let (stem, is_stamp) = match file_name.strip_suffix(STAMP_SUFFIX) {
                Some(stem) => (stem.to_owned(), true),
                None => (file_name, false),
            };
            let name = from_hex(&format!("{fan_name}{stem}")).filter(|_| stem.len() == 62);
            listed.extend(listed_file(file.path(), name, is_stamp));
        }
    }
    listed.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(listed)
}

/// The file's size and modification time, or `None` if it vanished since
/// the directory was read.
fn listed_file(path: PathBuf, name: Option<[u8; 32]>, is_stamp: bool) -> Option<Listed> {
    let metadata = fs::metadata(&path).ok()?;
    let len = metadata.len();
    let modified = metadata.modified().unwrap_or(SystemTime::UNIX_EPOCH);
    Some(Listed {
        path,
        name,
        is_stamp,
        len,
        modified,
    })
}

/// Reads the manifest at `path` whatever its schema, checking that it is
/// stored under its own key.
pub(crate) fn read_manifest(path: &Path, name: &Key) -> Result<Manifest, Problem> {
    let (_, bytes) = read_file(path, Kind::Manifest, None)?;
    let manifest = Manifest::decode(&bytes)?;
    if &manifest.key != name {
        return Err(Problem::ManifestMismatch);
    }
    Ok(manifest)
}

/// How much of the cache one stage uses.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StageStats {
    /// Manifests naming this stage.
    pub entries: u64,
    /// Payload bytes those manifests point at (shared blobs counted once per
    /// manifest).
    pub payload_bytes: u64,
}

/// What the cache holds.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CacheStats {
    /// Readable manifests.
    pub entries: u64,
    /// Files under `cas/`.
    pub blobs: u64,
    /// Bytes of all blobs and manifests on disk (the quantity `gc` bounds).
    pub bytes: u64,
    /// Manifests that could not be read (see `verify` for details).
    pub unreadable_entries: u64,
    /// Entries and payload bytes per stage name.
    pub per_stage: BTreeMap<String, StageStats>,
}

impl fmt::Display for CacheStats {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "{} entries, {} blobs, {}",
            self.entries,
            self.blobs,
            human_bytes(self.bytes)
        )?;
        if self.unreadable_entries > 0 {
            write!(
                formatter,
                ", {} unreadable entries",
                self.unreadable_entries
            )?;
        }
        for (stage, stats) in &self.per_stage {
            write!(
                formatter,
                "\n  {stage:<24} {:>8} entries {:>12}",
                stats.entries,
                human_bytes(stats.payload_bytes)
            )?;
        }
        Ok(())
    }
}

/// Bytes in binary units with one decimal, e.g. `1.5 MiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A file `verify` found wanting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamagedFile {
    pub path: PathBuf,
    pub problem: Problem,
}

/// The outcome of [`Cache::verify`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    pub blobs_checked: u64,
    pub manifests_checked: u64,
    /// Every damaged, stale or unexpected file, in path order.
    pub damaged: Vec<DamagedFile>,
}

impl VerifyReport {
    /// Whether every file passed.
    pub fn is_clean(&self) -> bool {
        self.damaged.is_empty()
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "checked {} blobs and {} manifests: {}",
            self.blobs_checked,
            self.manifests_checked,
            if self.is_clean() {
                "all intact".to_owned()
            } else {
                format!("{} damaged", self.damaged.len())
            }
        )?;
        for damaged in &self.damaged {
            write!(
                formatter,
                "\n  {}: {}",
                damaged.path.display(),
                damaged.problem
            )?;
        }
        Ok(())
    }
}

impl Cache {
    /// Counts entries, blobs and bytes, per stage too. Reads every manifest
    /// (they are small) but no blob.
    pub fn stats(&self) -> Result<CacheStats, CacheError> {
        let mut stats = CacheStats::default();
        for blob in list(&self.cas_dir())? {
            stats.blobs += 1;
            stats.bytes += blob.len;
        }
        for file in list(&self.ac_dir())?
            .into_iter()
            .filter(|file| !file.is_stamp)
        {
            stats.bytes += file.len;
            let manifest = file
                .name
                .ok_or(Problem::UnexpectedFile)
                .and_then(|name| read_manifest(&file.path, &name));
            match manifest {
                Ok(manifest) => {
                    stats.entries += 1;
                    let stage = stats.per_stage.entry(manifest.stage).or_default();
                    stage.entries += 1;
                    stage.payload_bytes += manifest.payload_len;
                }
                Err(_) => stats.unreadable_entries += 1,
            }
        }
        Ok(stats)
    }

    /// Checks every blob's header, length and checksum and that it hashes to
    /// its name, and every manifest's header, encoding and blob. Lists each
    /// file that fails; changes nothing.
    pub fn verify(&self) -> Result<VerifyReport, CacheError> {
        let mut report = VerifyReport::default();
        let mut intact_blobs: HashSet<Digest> = HashSet::new();
        for blob in list(&self.cas_dir())? {
            report.blobs_checked += 1;
            let checked = match (blob.name, blob.is_stamp) {
                (Some(name), false) => match read_file(&blob.path, Kind::Blob, Some(BLOB_SCHEMA)) {
                    Ok((header, _)) if header.payload_digest == name => Ok(name),
                    Ok(_) => Err(Problem::MisnamedBlob),
                    Err(problem) => Err(problem),
                },
                _ => Err(Problem::UnexpectedFile),
            };
            match checked {
                Ok(name) => {
                    intact_blobs.insert(name);
                }
                Err(problem) => report.damaged.push(DamagedFile {
                    path: blob.path,
                    problem,
                }),
            }
        }
        for file in list(&self.ac_dir())? {
            if file.is_stamp && file.name.is_some() {
                continue;
            }
            report.manifests_checked += 1;
            let checked = file
                .name
                .ok_or(Problem::UnexpectedFile)
                .and_then(|name| read_manifest(&file.path, &name))
                .and_then(|manifest| {
                    if intact_blobs.contains(&manifest.digest) {
                        Ok(())
                    } else {
                        Err(Problem::BrokenBlob {
                            blob: to_hex(&manifest.digest),
                        })
                    }
                });
            if let Err(problem) = checked {
                report.damaged.push(DamagedFile {
                    path: file.path,
                    problem,
                });
            }
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_bytes_uses_binary_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 * 1024 * 1024), "3.0 MiB");
    }
}

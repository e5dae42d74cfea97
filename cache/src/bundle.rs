//! Offline sharing: cache entries exported into one file and imported into
//! another cache, for air-gapped CI and for seeding a runner image.
//!
//! ```text
//! "IPUQBNDL" | u16 bundle version | u16 cache FORMAT_VERSION | u32 zero | u64 entry count
//! per entry: u64 length | manifest file (as in ac/) | u64 length | payload (as in cas/, no header)
//! ```
//!
//! All integers are little-endian. Import trusts nothing: every manifest file
//! passes the header, length and blake3 checks a file on disk passes, and
//! every payload must hash to the digest its manifest names before
//! [`Cache::put`] stores it (hashing it again). A damaged entry is rejected
//! and reported; a truncated file stops the import with the offset where the
//! bytes ran out, keeping the entries already verified.

use std::fmt;
use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::error::CacheError;
use crate::header::{parse_bytes, read_file, Kind, FORMAT_VERSION};
use crate::inspect::{human_bytes, list, read_manifest};
use crate::key::{digest_of, to_hex, Key};
use crate::manifest::Manifest;
use crate::store::{Cache, BLOB_SCHEMA};

const MAGIC: [u8; 8] = *b"IPUQBNDL";
const BUNDLE_VERSION: u16 = 1;
/// Largest manifest file accepted (a stage name is at most 64 KiB).
const MAX_MANIFEST: u64 = 1 << 20;

/// What an export wrote.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ExportReport {
    pub entries: u64,
    pub payload_bytes: u64,
    /// Keys asked for but absent or damaged in the cache.
    pub skipped: u64,
}

impl fmt::Display for ExportReport {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "exported {} entries ({}), skipped {}", self.entries, human_bytes(self.payload_bytes), self.skipped)
    }
}

/// What an import did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ImportReport {
    pub imported: u64,
    pub payload_bytes: u64,
    /// Entries that failed a check: (index, reason).
    pub rejected: Vec<(u64, String)>,
}

impl fmt::Display for ImportReport {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "imported {} entries ({}), rejected {}", self.imported, human_bytes(self.payload_bytes), self.rejected.len())?;
        for (index, reason) in &self.rejected {
            write!(formatter, "\n  entry {index}: {reason}")?;
        }
        Ok(())
    }
}

/// Why an import could not go on.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("{path}: {message}")]
    Bad { path: PathBuf, message: String },
}

impl Cache {
    /// Writes the entries for `keys` (every entry when `None`) to `path`,
    /// atomically (a temporary file beside it, then rename).
    pub fn export(&self, path: &Path, keys: Option<&[Key]>) -> Result<ExportReport, CacheError> {
        let keys: Vec<Key> = match keys {
            Some(keys) => keys.to_vec(),
            None => list(&self.ac_dir())?.into_iter().filter(|f| !f.is_stamp).filter_map(|f| f.name).collect(),
        };
        let mut entries = Vec::new();
        let mut report = ExportReport::default();
        for key in keys {
            match self.exportable(&key) {
                Some(entry) => entries.push(entry),
                None => report.skipped += 1,
            }
        }
        let write_error = |source| CacheError::Write { path: path.to_path_buf(), source };
        let temporary = path.with_file_name(format!(".{}.{}.tmp", path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default(), std::process::id()));
        let result = (|| -> std::io::Result<()> {
            let mut out = BufWriter::new(File::create(&temporary)?);
            out.write_all(&MAGIC)?;
            out.write_all(&BUNDLE_VERSION.to_le_bytes())?;
            out.write_all(&FORMAT_VERSION.to_le_bytes())?;
            out.write_all(&0u32.to_le_bytes())?;
            out.write_all(&(entries.len() as u64).to_le_bytes())?;
            for (manifest, payload) in &entries {
                out.write_all(&(manifest.len() as u64).to_le_bytes())?;
                out.write_all(manifest)?;
                out.write_all(&(payload.len() as u64).to_le_bytes())?;
                out.write_all(payload)?;
            }
            out.into_inner().map_err(|e| e.into_error())?.sync_data()?;
            fs::rename(&temporary, path)
        })();
        if let Err(source) = result {
            let _ = fs::remove_file(&temporary);
            return Err(write_error(source));
        }
        report.entries = entries.len() as u64;
        report.payload_bytes = entries.iter().map(|(_, p)| p.len() as u64).sum();
        Ok(report)
    }

    /// The manifest file and payload of `key`, if both are intact.
    fn exportable(&self, key: &Key) -> Option<(Vec<u8>, Vec<u8>)> {
        let manifest_path = self.manifest_path(key);
        let manifest = read_manifest(&manifest_path, key).ok()?;
        let manifest_file = fs::read(&manifest_path).ok()?;
        let (header, payload) = read_file(&self.blob_path(&manifest.digest), Kind::Blob, Some(BLOB_SCHEMA)).ok()?;
        (header.payload_digest == manifest.digest).then(|| (manifest_file, payload.to_vec()))
    }

    /// Verifies and stores every entry of the bundle at `path`.
    pub fn import(&self, path: &Path) -> Result<ImportReport, BundleError> {
        if self.options.read_only {
            return Err(CacheError::ReadOnly { path: self.root.clone() }.into());
        }
        let file = File::open(path).map_err(|source| CacheError::Read { path: path.to_path_buf(), source })?;
        let mut reader = Counting { inner: BufReader::new(file), offset: 0 };
        let bad = |message: String| BundleError::Bad { path: path.to_path_buf(), message };
        let mut head = [0u8; 24];
        reader.read_exact(&mut head).map_err(|_| bad("not an ipuq cache bundle (shorter than its header)".into()))?;
        if head[..8] != MAGIC {
            return Err(bad("not an ipuq cache bundle (bad magic)".into()));
        }
        let version = u16::from_le_bytes([head[8], head[9]]);
        let format = u16::from_le_bytes([head[10], head[11]]);
        if version != BUNDLE_VERSION || format != FORMAT_VERSION {
            return Err(bad(format!("bundle version {version} with cache format {format}; this ipuq reads version {BUNDLE_VERSION} with format {FORMAT_VERSION}")));
        }
        let count = u64::from_le_bytes(head[16..24].try_into().expect("8 bytes"));
        let mut report = ImportReport::default();
        for index in 0..count {
            let truncated = |offset: u64| bad(format!("truncated at byte {offset}, in entry {index} of {count}"));
            let manifest_file = reader.chunk(MAX_MANIFEST).map_err(|_| truncated(reader.offset))?;
            let payload = reader.chunk(u64::MAX).map_err(|_| truncated(reader.offset))?;
            match check_entry(&manifest_file, &payload) {
                Ok((manifest, schema)) => {
                    self.put(&manifest.stage, &manifest.key, schema, &payload)?;
                    report.imported += 1;
                    report.payload_bytes += payload.len() as u64;
                }
                Err(reason) => report.rejected.push((index, reason)),
            }
        }
        Ok(report)
    }
}

/// Checks one bundle entry; returns its manifest and schema.
fn check_entry(manifest_file: &[u8], payload: &[u8]) -> Result<(Manifest, u64), String> {
    let (header, manifest_payload) = parse_bytes(manifest_file, Kind::Manifest, None).map_err(|p| format!("manifest: {p}"))?;
    let manifest = Manifest::decode(manifest_payload).map_err(|p| format!("manifest: {p}"))?;
    if payload.len() as u64 != manifest.payload_len || digest_of(payload) != manifest.digest {
        return Err(format!("payload of {} ({}) does not match its manifest", manifest.stage, to_hex(&manifest.key)));
    }
    Ok((manifest, header.schema))
}

/// A reader that knows its offset, for error messages.
struct Counting<R> {
    inner: R,
    offset: u64,
}

impl<R: Read> Counting<R> {
    fn read_exact(&mut self, buffer: &mut [u8]) -> std::io::Result<()> {
        self.inner.read_exact(buffer)?;
        self.offset += buffer.len() as u64;
        Ok(())
    }

    /// A length-prefixed chunk of at most `limit` bytes. The length is not
    /// trusted for allocation: bytes are read as they come.
    fn chunk(&mut self, limit: u64) -> std::io::Result<Vec<u8>> {
        let mut length = [0u8; 8];
        self.read_exact(&mut length)?;
        let length = u64::from_le_bytes(length);
        if length > limit {
            return Err(std::io::ErrorKind::InvalidData.into());
        }
        let mut bytes = Vec::new();
        let read = (&mut self.inner).take(length).read_to_end(&mut bytes)?;
        self.offset += read as u64;
        if (read as u64) < length {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CacheOptions;

    fn key(n: u8) -> Key {
        [n; 32]
    }

    #[test]
    fn export_import_round_trip_and_rejects_damage() {
        let from_dir = tempfile::tempdir().expect("tempdir");
        let from = Cache::open(from_dir.path(), CacheOptions::default()).expect("cache");
        from.put("plan", &key(1), 7, b"one").expect("put");
        from.put("code", &key(2), 9, b"two two").expect("put");
        let bundle = from_dir.path().join("entries.bundle");
        let all = from.export(&bundle, None).expect("export");
        assert_eq!((all.entries, all.skipped), (2, 0));
        let some = from.export(&from_dir.path().join("one.bundle"), Some(&[key(1), key(3)])).expect("export");
        assert_eq!((some.entries, some.skipped), (1, 1));

        let to_dir = tempfile::tempdir().expect("tempdir");
        let to = Cache::open(to_dir.path(), CacheOptions::default()).expect("cache");
        let report = to.import(&bundle).expect("import");
        assert_eq!((report.imported, report.rejected.len()), (2, 0), "{report}");
        assert_eq!(to.get("code", &key(2), 9).expect("hit").as_slice(), b"two two");

        // A flipped payload byte is rejected; the other entry still imports.
        let mut bytes = fs::read(&bundle).expect("bundle");
        let at = bytes.windows(7).position(|w| w == b"two two").expect("payload");
        bytes[at] ^= 1;
        let flipped = to_dir.path().join("flipped.bundle");
        fs::write(&flipped, &bytes).expect("write");
        let empty_dir = tempfile::tempdir().expect("tempdir");
        let empty = Cache::open(empty_dir.path(), CacheOptions::default()).expect("cache");
        let report = empty.import(&flipped).expect("import");
        assert_eq!((report.imported, report.rejected.len()), (1, 1), "{report}");
        assert!(empty.get("code", &key(2), 9).is_none());

        // Truncation names the offset; junk is not a bundle.
        fs::write(&flipped, &bytes[..bytes.len() - 3]).expect("write");
        let error = empty.import(&flipped).expect_err("truncated").to_string();
        assert!(error.contains("truncated at byte"), "{error}");
        fs::write(&flipped, b"junk").expect("write");
        assert!(empty.import(&flipped).expect_err("junk").to_string().contains("not an ipuq cache bundle"));
    }
}

//! Action-cache manifests: the small record that maps a stage's key to the
//! digest of its output blob.
//!
//! A manifest file is a header (kind `Manifest`, the caller's schema) and this
//! payload, little-endian:
//!
//! | size | field                                  |
//! |------|----------------------------------------|
//! | 32   | key                                    |
//! | 32   | output digest (the blob's name)        |
//! | 8    | output payload length                  |
//! | 2    | stage name length `n`                  |
//! | n    | stage name, UTF-8                      |
//!
//! Manifests hold nothing that changes after they are written: no time, no
//! path, no counter. Two processes that compute the same output write
//! byte-identical manifests, which is what makes same-key races harmless.
//! The last-used stamp lives in a sidecar file instead (see `store.rs`).
//! This module must not touch the file system.

use crate::error::Problem;
use crate::key::{Digest, Key};

/// The longest stage name a manifest can hold.
pub const MAX_STAGE_LEN: usize = u16::MAX as usize;

const FIXED_LEN: usize = 32 + 32 + 8 + 2;

/// One action-cache record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// The stage that produced the output, e.g. `"plan"`.
    pub stage: String,
    /// The key the output is stored under.
    pub key: Key,
    /// blake3 of the output payload; the blob's name under `cas/`.
    pub digest: Digest,
    /// Length of the output payload in bytes.
    pub payload_len: u64,
}

impl Manifest {
    /// The manifest payload bytes. Stage names longer than
    /// [`MAX_STAGE_LEN`] bytes are cut at a character boundary; the cut name
    /// is still checked on read, so nothing mismatches silently.
    pub fn encode(&self) -> Vec<u8> {
        let stage = truncate_stage(&self.stage);
        let mut bytes = Vec::with_capacity(FIXED_LEN + stage.len());
        bytes.extend_from_slice(&self.key);
        bytes.extend_from_slice(&self.digest);
        bytes.extend_from_slice(&self.payload_len.to_le_bytes());
        let stage_len = u16::try_from(stage.len()).unwrap_or(u16::MAX);
        bytes.extend_from_slice(&stage_len.to_le_bytes());
        bytes.extend_from_slice(stage.as_bytes());
        bytes
    }

    /// Decodes a manifest payload; any inconsistency is a [`Problem`].
    pub fn decode(bytes: &[u8]) -> Result<Manifest, Problem> {
        if bytes.len() < FIXED_LEN {
            return Err(Problem::BadManifest("shorter than its fixed fields"));
        }
        let mut key = [0u8; 32];
        key.copy_from_slice(&bytes[0..32]);
        let mut digest = [0u8; 32];
        digest.copy_from_slice(&bytes[32..64]);
        let mut length = [0u8; 8];
        length.copy_from_slice(&bytes[64..72]);
        let stage_len = usize::from(u16::from_le_bytes([bytes[72], bytes[73]]));
        let stage_bytes = &bytes[FIXED_LEN..];
        if stage_bytes.len() != stage_len {
            return Err(Problem::BadManifest(
                "stage name length disagrees with the file",
            ));
        }
        let stage = std::str::from_utf8(stage_bytes)
            .map_err(|_| Problem::BadManifest("stage name is not UTF-8"))?
            .to_owned();
        Ok(Manifest {
            stage,
            key,
            digest,
            payload_len: u64::from_le_bytes(length),
        })
    }

    /// Whether this manifest is the one for `stage` and `key`.
    pub fn is_for(&self, stage: &str, key: &Key) -> bool {
        self.stage == truncate_stage(stage) && &self.key == key
    }
}

fn truncate_stage(stage: &str) -> &str {
    if stage.len() <= MAX_STAGE_LEN {
        return stage;
    }
    let mut end = MAX_STAGE_LEN;
    while !stage.is_char_boundary(end) {
        end -= 1;
    }
    &stage[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            stage: "exchange-schedule".to_owned(),
            key: [1; 32],
            digest: [2; 32],
            payload_len: 4096,
        }
    }

    #[test]
    fn round_trips_and_is_deterministic() {
        let manifest = sample();
        let bytes = manifest.encode();
        assert_eq!(bytes, sample().encode());
        assert_eq!(Manifest::decode(&bytes), Ok(manifest.clone()));
        assert!(manifest.is_for("exchange-schedule", &[1; 32]));
        assert!(!manifest.is_for("plan", &[1; 32]));
        assert!(!manifest.is_for("exchange-schedule", &[3; 32]));
    }

    #[test]
    fn rejects_inconsistent_payloads() {
        let bytes = sample().encode();
        assert!(Manifest::decode(&bytes[..10]).is_err());
        assert!(Manifest::decode(&bytes[..bytes.len() - 1]).is_err());
        let mut longer = bytes.clone();
        longer.push(b'x');
        assert!(Manifest::decode(&longer).is_err());
        let mut not_utf8 = bytes;
        let last = not_utf8.len() - 1;
        not_utf8[last] = 0xff;
        assert_eq!(
            Manifest::decode(&not_utf8),
            Err(Problem::BadManifest("stage name is not UTF-8"))
        );
    }

    #[test]
    fn very_long_stage_names_are_cut_consistently() {
        let long = "é".repeat(MAX_STAGE_LEN);
        let manifest = Manifest {
            stage: long.clone(),
            ..sample()
        };
        let decoded = Manifest::decode(&manifest.encode()).expect("decodes");
        assert!(decoded.stage.len() <= MAX_STAGE_LEN);
        assert!(decoded.is_for(&long, &[1; 32]));
    }
}

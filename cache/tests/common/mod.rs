//! Helpers shared by the cache's integration tests: keys, payloads, and ways
//! to damage files on disk. Tests only; nothing here is part of the crate.
#![allow(dead_code)]

pub mod fake_server;

use std::fs;
use std::path::{Path, PathBuf};

use ipuq_cache::{Cache, CacheOptions, Key};

/// A key derived the way ipuq derives stage keys.
pub fn key(stage: &str, input: u64) -> Key {
    let mut hasher = blake3::Hasher::new_derive_key(&format!("ipuq-cache tests {stage} v1"));
    hasher.update(&input.to_le_bytes());
    *hasher.finalize().as_bytes()
}

/// A deterministic payload of `len` bytes that differs per `seed`.
pub fn payload(seed: u64, len: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(len);
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while bytes.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        bytes.extend_from_slice(&state.to_le_bytes());
    }
    bytes.truncate(len);
    bytes
}

pub fn open(root: &Path) -> Cache {
    Cache::open(root, CacheOptions::default()).expect("opens a writable cache")
}

pub fn open_read_only(root: &Path) -> Cache {
    Cache::open(
        root,
        CacheOptions {
            read_only: true,
            max_bytes: None,
        },
    )
    .expect("opens read-only")
}

/// Flips one bit of the file at `offset` (from the start of the file).
pub fn flip_bit(path: &Path, offset: usize) {
    let mut bytes = fs::read(path).expect("reads file to damage");
    bytes[offset] ^= 0x04;
    fs::write(path, bytes).expect("writes damaged file");
}

/// Cuts the file to `len` bytes.
pub fn truncate(path: &Path, len: usize) {
    let bytes = fs::read(path).expect("reads file to truncate");
    fs::write(path, &bytes[..len]).expect("writes truncated file");
}

/// Every regular file under `root`, sorted.
pub fn files_under(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(directory) = pending.pop() {
        for entry in fs::read_dir(&directory).expect("lists directory") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

//! Build script: the compiler fingerprint. A blake3 digest of this crate's own sources (every
//! file under `src/`, in sorted path order, each with its relative path), its manifest and the
//! workspace lock file (dependency versions change output too), handed to the crate as
//! `IPUQ_COMPILER_SOURCES`. Every cache key and every package carries it (`fingerprint.rs`), so
//! a changed compiler never reads entries written by another one.

use std::path::{Path, PathBuf};

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(&path, out);
        } else {
            out.push(path);
        }
    }
}

fn main() {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    collect(&root.join("src"), &mut files);
    files.push(root.join("Cargo.toml"));
    let lock = root.join("../Cargo.lock");
    if lock.exists() {
        files.push(lock.clone());
    }
    let mut named: Vec<(String, PathBuf)> = files
        .into_iter()
        .map(|p| (p.strip_prefix(&root).unwrap_or(&p).to_string_lossy().replace('\\', "/"), p))
        .collect();
    named.sort();
    let mut hasher = blake3::Hasher::new_derive_key("ipuq compiler sources v1");
    for (name, path) in &named {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        hasher.update(&(name.len() as u64).to_le_bytes());
        hasher.update(name.as_bytes());
        hasher.update(&(bytes.len() as u64).to_le_bytes());
        hasher.update(&bytes);
    }
    println!("cargo:rustc-env=IPUQ_COMPILER_SOURCES={}", hasher.finalize().to_hex());
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=Cargo.toml");
    println!("cargo:rerun-if-changed={}", lock.display());
}

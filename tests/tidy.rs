//! House rules that keep the tree readable (rust-analyzer's "tidy" idea): every Rust file opens
//! with a `//!` header saying what it is for, and a file over 800 lines says why in that header.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_file_has_a_header_and_long_files_say_why() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "tests", "benches", "queries/src", "queries/tests", "queries/benches", "cache/src", "cache/tests"] {
        if root.join(dir).is_dir() {
            rust_files(&root.join(dir), &mut files);
        }
    }
    assert!(files.len() > 30, "found only {} files", files.len());
    let mut problems = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let header: Vec<&str> = text.lines().take_while(|l| l.starts_with("//!")).collect();
        if header.is_empty() {
            problems.push(format!("{}: no //! header", file.display()));
        }
        let lines = text.lines().count();
        if lines > 800 && !header.iter().any(|l| l.contains("long")) {
            problems.push(format!("{}: {lines} lines and the header does not say why it is long", file.display()));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

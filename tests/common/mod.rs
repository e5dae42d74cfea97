//! Helpers for the end-to-end tests: run the real `ipuq` binary and read what it prints.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

pub fn ipuq(args: &[&str], cwd: &Path) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_ipuq"))
        .args(args)
        .current_dir(cwd)
        .env("IPUQ_LOG", "info,salsa=warn")
        .env_remove("RUST_LOG")
        .env_remove("IPUQ_REMOTE_CACHE")
        .output()
        .expect("the ipuq binary runs");
    Output {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

pub fn fixture(relative: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(relative).display().to_string()
}

/// The value of `key=` in the first line of `text` that starts with `prefix`.
pub fn field(text: &str, prefix: &str, key: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with(prefix))?;
    line.split_whitespace().find_map(|kv| kv.strip_prefix(&format!("{key}=")).map(str::to_string))
}

pub fn assert_pass(out: &Output) {
    assert_eq!(out.code, 0, "ipuq failed:\nstdout:\n{}\nstderr:\n{}", out.stdout, tail(&out.stderr));
    assert_eq!(field(&out.stdout, "workload=", "numericalTest").as_deref(), Some("PASS"), "{}", out.stdout);
    assert_eq!(field(&out.stdout, "package=", "simulatorTest").as_deref(), Some("PASS"), "{}", out.stdout);
    assert_eq!(field(&out.stdout, "package=", "device").as_deref(), Some("simulator"), "{}", out.stdout);
}

pub fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// xorshift64*: a tiny deterministic generator, so a failing case is named by its seed (and
/// case).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

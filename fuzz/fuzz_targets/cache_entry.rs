//! Stage-cache entries on disk (manifests under `ac/`, blobs under `cas/`): the first byte
//! picks which file of a one-entry cache the rest replaces or edits; the read must give the
//! payload or a miss, never a panic.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

struct Fixture {
    _dir: tempfile::TempDir,
    cache: ipuq_cache::Cache,
    files: Vec<(PathBuf, Vec<u8>)>,
}

const KEY: [u8; 32] = [3; 32];

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temporary directory");
        let cache = ipuq_cache::Cache::open(dir.path(), ipuq_cache::CacheOptions::default()).expect("cache");
        let payload: Vec<u8> = (0..200u8).collect();
        cache.put("stage", &KEY, 1, &payload).expect("put");
        let mut files = Vec::new();
        let mut stack = vec![dir.path().to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).expect("read_dir").flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p)
                } else if !p.to_string_lossy().contains("lock") {
                    let bytes = std::fs::read(&p).expect("read");
                    files.push((p, bytes));
                }
            }
        }
        files.sort();
        Fixture { _dir: dir, cache, files }
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let Some((&which, rest)) = data.split_first() else { return };
    let (path, original) = &f.files[(which & 0x7f) as usize % f.files.len()];
    // High bit set: byte edits to the file as the cache wrote it (so the fuzzer starts from a
    // valid manifest or blob); clear: the rest replaces the file.
    let bytes = if which & 0x80 != 0 { ipuq_fuzz::mutated_payload(original, rest) } else { rest.to_vec() };
    std::fs::write(path, bytes).expect("write");
    let _ = f.cache.get("stage", &KEY, 1);
    std::fs::write(path, original).expect("restore");
});

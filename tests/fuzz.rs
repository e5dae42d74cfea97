//! Property tests of every reader of outside bytes: workload TOML, target descriptions,
//! packages (header, checksum, rkyv validation, and the simulator's load-time checks behind
//! them), cache entries, `.npy` files and the host-reference cache. Each property is "any
//! input gives `Ok` or a clear `Err`: no panic, no hang", checked over seeded random mutations
//! of valid inputs (bit flips, byte overwrites, truncations, insertions, splices; for packages
//! also payload mutations under a recomputed checksum and field mutations of the decoded
//! structure), so that failures reproduce from the printed seed and case.
//!
//! These run in `cargo test` with small counts so the suite stays fast on two cores; longer
//! campaigns of the same readers: `IPUQ_FUZZ_SCALE=N` (see the README). Findings are fixed and
//! stay covered here (a panelled-A row count that overflowed, host segments whose row count
//! made the run list unbounded).

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::{Duration, Instant};

use ipuq_queries::ir::Graph;
use ipuq_queries::package::*;
use ipuq_queries::target::{fixtures, Target};

use common::Rng;

/// One random byte-level mutation of `input`.
fn mutate(rng: &mut Rng, input: &[u8], dictionary: &[&[u8]]) -> Vec<u8> {
    let mut out = input.to_vec();
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        let at = rng.below(out.len() + 1);
        match rng.below(7) {
            0 if !out.is_empty() => {
                let i = at.min(out.len() - 1);
                out[i] ^= 1 << rng.below(8);
            }
            1 if !out.is_empty() => {
                let i = at.min(out.len() - 1);
                out[i] = [0, 0xFF, 0x7F, 0x80, b'"', b'=', b'[', b'\n'][rng.below(8)];
            }
            2 => out.truncate(at),
            3 => {
                let word = dictionary[rng.below(dictionary.len())];
                out.splice(at..at, word.iter().copied());
            }
            4 if out.len() > 8 => {
                let from = rng.below(out.len() - 4);
                let len = rng.below(64).min(out.len() - from);
                let chunk = out[from..from + len].to_vec();
                out.splice(at..at, chunk);
            }
            5 => {
                let end = (at + rng.below(16)).min(out.len());
                out.drain(at..end);
            }
            _ => {
                let value = (rng.next() as u32).to_le_bytes();
                let i = at.min(out.len().saturating_sub(4));
                if out.len() >= 4 {
                    out[i..i + 4].copy_from_slice(&value);
                }
            }
        }
    }
    out
}

/// `IPUQ_FUZZ_SCALE=N` multiplies every campaign's cases and time limit (long campaigns:
/// `IPUQ_FUZZ_SCALE=1000 cargo test --release --test fuzz -- --nocapture`).
fn scale() -> usize {
    std::env::var("IPUQ_FUZZ_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1).max(1)
}

/// Run `reader` on `cases` mutations of `seed_input`; fail naming the case on a panic, and
/// when the whole campaign takes longer than `limit` (a hang).
fn campaign(name: &str, seed_input: &[u8], dictionary: &[&[u8]], cases: usize, limit: Duration, reader: impl Fn(&[u8])) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ name.len() as u64);
    let (cases, limit) = (cases * scale(), limit * scale() as u32);
    let started = Instant::now();
    for case in 0..cases {
        let input = mutate(&mut rng, seed_input, dictionary);
        if catch_unwind(AssertUnwindSafe(|| reader(&input))).is_err() {
            panic!("{name}: case {case} panicked on input {:?}", String::from_utf8_lossy(&input));
        }
    }
    assert!(started.elapsed() < limit, "{name}: {cases} cases took {:?}", started.elapsed());
    eprintln!("fuzz campaign {name}: {cases} executions in {:?}, no panic", started.elapsed());
}

fn fixture(relative: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(relative)).unwrap()
}

const TOML_WORDS: &[&[u8]] = &[b"[[tensor]]", b"[[operation]]", b"shape = [", b"4294967295", b"-1", b"0", b"1e308", b"\"", b"inputs = []", b"op = \"matmul\"", b"\n", b"perm = [1, 0]", b"factor = nan"];

#[test]
fn workload_files_never_panic() {
    for file in ["workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml", "workloads/attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8.toml"] {
        let text = fixture(file);
        campaign(file, text.as_bytes(), TOML_WORDS, 1500, Duration::from_secs(60), |bytes| {
            let _ = Graph::parse(&String::from_utf8_lossy(bytes), "fuzz.toml");
        });
    }
}

#[test]
fn target_descriptions_never_panic() {
    campaign("target", fixtures::SMALL16.as_bytes(), TOML_WORDS, 1500, Duration::from_secs(60), |bytes| {
        if let Ok(t) = Target::from_toml(&String::from_utf8_lossy(bytes), "fuzz.toml") {
            let _ = (t.delay_range(), t.delay(0, t.chip.tiles - 1), t.digest());
        }
    });
}

#[test]
fn npy_files_and_reference_caches_never_panic() {
    let npy = ipuq::workload::npy::encode_npy(ipuq_queries::ir::DType::F16, &[3, 5], &[0.5; 15], "seed").unwrap();
    let words: &[&[u8]] = &[b"{'descr': '<f4', 'fortran_order': False, 'shape': (", b"18446744073709551615,", b")}", b"<f2", b"True", b"\x93NUMPY"];
    campaign("npy", &npy, words, 3000, Duration::from_secs(60), |bytes| {
        let _ = ipuq::workload::npy::parse_npy(bytes, "fuzz.npy");
    });
    let key = [7u8; 32];
    let mut values = ipuq::reference::Values::new();
    values.insert("y".into(), vec![1.0, 2.0, 3.0]);
    let cached = ipuq::reference_cache::encode(&key, &values);
    campaign("reference cache", &cached, &[&[0xFF; 8], &[0; 8]], 3000, Duration::from_secs(60), |bytes| {
        let _ = ipuq::reference_cache::decode(&key, bytes);
    });
}

#[test]
fn cache_entries_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let cache = ipuq_cache::Cache::open(dir.path(), ipuq_cache::CacheOptions::default()).unwrap();
    let key = [3u8; 32];
    let payload: Vec<u8> = (0..200u8).collect();
    cache.put("stage", &key, 1, &payload).unwrap();
    let mut files = Vec::new();
    let mut stack = vec![dir.path().to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() { stack.push(p) } else { files.push(p) }
        }
    }
    files.sort();
    assert!(!files.is_empty());
    for file in files {
        let original = std::fs::read(&file).unwrap();
        campaign(&file.display().to_string(), &original, &[&[0; 8]], 300, Duration::from_secs(60), |bytes| {
            std::fs::write(&file, bytes).unwrap();
            let _ = cache.get("stage", &key, 1);
        });
        std::fs::write(&file, &original).unwrap();
    }
}

fn small_package() -> (Package, std::collections::BTreeMap<String, Vec<u8>>) {
    package_of("fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml")
}

/// A fixture built for small16, with its input bytes.
fn package_of(fixture: &str) -> (Package, std::collections::BTreeMap<String, Vec<u8>>) {
    let dir = tempfile::tempdir().unwrap();
    let workload = Path::new(env!("CARGO_MANIFEST_DIR")).join(fixture);
    let options = ipuq::build::BuildOptions { target: Some("small16".into()), out_dir: dir.path().to_path_buf(), incremental: false, cache_dir: None, cache_read_only: false, cache_max_bytes: None, plan_finalists: ipuq_queries::lower::search::DEFAULT_FINALISTS, table_budget: None, remote: None };
    let built = ipuq::build::build(&workload, &options).unwrap();
    let package = ipuq::build::read_package(&built.path).unwrap();
    let graph = Graph::parse(&package.workload_toml, "embedded").unwrap();
    let data = ipuq::workload::tensor_data(&graph, dir.path()).unwrap();
    let inputs = data.into_iter().map(|(name, d)| (name, d.bytes)).collect();
    (package, inputs)
}

#[test]
fn packages_never_panic_the_reader_or_the_device() {
    let (package, inputs) = small_package();
    let bytes = package.to_bytes();
    campaign("package file", &bytes, &[&PACKAGE_MAGIC, &[0xFF; 4]], 300, Duration::from_secs(120), |b| {
        let _ = Package::from_bytes(b, "fuzz.ipuexe");
    });
    // Payload mutations under a valid checksum reach rkyv's validation and the device.
    let payload = bytes[HEADER_BYTES..].to_vec();
    let digest = package.target_digest.0;
    let options = ipuq::runtime::RunOptions::default();
    campaign("package payload", &payload, &[&[0xFF; 4], &[0; 4]], 300, Duration::from_secs(300), |p| {
        if let Ok(decoded) = Package::from_bytes(&Package::frame(p, &digest), "fuzz.ipuexe") {
            let _ = ipuq::runtime::execute(&decoded, &inputs, &options);
        }
    });
}

/// Field-level mutations of a decoded package: tables, calls, allocations and steps with
/// hostile numbers. The device must reject or run each, never panic or hang.
/// `IPUQ_FUZZ_DUMP=N` prints what case N changed (compute sets, allocations, tile ids, steps,
/// outputs) before running it: a failing case is read without a debugger.
#[test]
fn structurally_mutated_packages_never_panic_the_device() {
    let (package, inputs) = small_package();
    let options = ipuq::runtime::RunOptions::default();
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    let started = Instant::now();
    let cases = 500 * scale();
    let hostile = [0u32, 1, 2, 3, 4, 0x4C000, 0x7FFFC, 0x80000, 0xE7BB0, 0xE8000, u32::MAX, u32::MAX / 2, 1 << 20];
    for case in 0..cases {
        let mut p = package.clone();
        let value = if rng.below(2) == 0 { hostile[rng.below(hostile.len())] } else { rng.next() as u32 % 2048 };
        match rng.below(9) {
            0 | 1 => {
                // Tables and calls are decoded from the images, mutated, and written back.
                let mut programs = ipuq_queries::image::Programs::of(&p).unwrap();
                let phase = rng.below(programs.exchanges.len());
                let tables = &mut programs.exchanges[phase].tiles;
                let t = rng.below(tables.len());
                let table = &mut tables[t];
                if rng.below(2) == 0 && !table.sends.is_empty() {
                    let s = rng.below(table.sends.len());
                    let e = &mut table.sends[s];
                    match rng.below(6) { 0 => e.cycle = value, 1 => e.address = value, 2 => e.words = value, 3 => e.count = value, 4 => e.cycle_stride = value, _ => e.paired = !e.paired }
                } else if !table.receives.is_empty() {
                    let r = rng.below(table.receives.len());
                    let e = &mut table.receives[r];
                    match rng.below(7) { 0 => e.cycle = value, 1 => e.address = value, 2 => e.words = value, 3 => e.source = value, 4 => e.count = value, 5 => e.address_stride = value, _ => e.paired = !e.paired }
                }
                let _ = programs.write(&mut p);
            }
            2 | 3 => {
                let mut programs = ipuq_queries::image::Programs::of(&p).unwrap();
                let tile = rng.below(p.tiles.len());
                if let Some(set) = programs.compute_sets[tile].first_mut() {
                    let c = rng.below(set.calls.len());
                    let call = &mut set.calls[c];
                    let pick = rng.below(3);
                    let mut touched = 0;
                    *call = call.map(|o| {
                        touched += 1;
                        if touched - 1 == pick { Operand { address: value, row_stride: o.row_stride } } else { *o }
                    });
                    if let VertexCall::MatMul { m, k, n, .. } = call {
                        match rng.below(4) { 0 => *m = value, 1 => *k = value, 2 => *n = value, _ => {} }
                    }
                }
                let _ = programs.write(&mut p);
            }
            8 => {
                // Raw image bytes: one word of a tile's code (header, vertex records, tables).
                let i = rng.below(p.shared_segments.len() + p.tiles.len());
                let bytes = match p.shared_segments.get_mut(i) {
                    Some(b) => b,
                    None => &mut p.tiles[i - p.shared_segments.len()].segments[0].bytes,
                };
                let at = rng.below(bytes.len() / 4) * 4;
                bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
            }
            4 => {
                let tile = rng.below(p.tiles.len());
                let allocations = &mut p.tiles[tile].allocations;
                let a = rng.below(allocations.len());
                match rng.below(4) { 0 => allocations[a].start = value, 1 => allocations[a].end = value, 2 => allocations[a].first_step = value, _ => allocations[a].last_step = value }
            }
            5 => {
                let s = rng.below(p.steps.len());
                p.steps[s] = if rng.below(2) == 0 { Step::Compute { index: value } } else { Step::Exchange { phase: value } };
            }
            6 => {
                if let Some(t) = p.host.outputs.first_mut() {
                    let s = rng.below(t.segments.len());
                    match rng.below(3) { 0 => t.segments[s].address = value, 1 => t.segments[s].count = value, _ => t.segments[s].rows = value }
                }
            }
            _ => {
                let tile = rng.below(p.tiles.len());
                p.tiles[tile].tile = value;
            }
        }
        if std::env::var("IPUQ_FUZZ_DUMP").ok().and_then(|v| v.parse::<usize>().ok()) == Some(case) {
            let before = ipuq_queries::image::Programs::of(&package).unwrap();
            match ipuq_queries::image::Programs::of(&p) {
                Ok(after) => {
                    for (t, (x, y)) in before.compute_sets.iter().zip(&after.compute_sets).enumerate() {
                        if x != y { eprintln!("DUMP tile {t}: {:?}\n  -> {:?}", x, y); }
                    }
                }
                Err(e) => eprintln!("DUMP programs: {e}"),
            }
            for (t, (x, y)) in package.tiles.iter().zip(&p.tiles).enumerate() {
                if x.allocations != y.allocations { eprintln!("DUMP allocations tile {t}: {:?} -> {:?}", x.allocations, y.allocations); }
                if x.tile != y.tile { eprintln!("DUMP tile id {t}: {} -> {}", x.tile, y.tile); }
            }
            if package.steps != p.steps { eprintln!("DUMP steps changed"); }
            if package.host.outputs != p.host.outputs { eprintln!("DUMP outputs changed"); }
        }
        if catch_unwind(AssertUnwindSafe(|| ipuq::runtime::execute(&p, &inputs, &options))).is_err() {
            panic!("structural mutation case {case} panicked the device");
        }
    }
    assert!(started.elapsed() < Duration::from_secs(300) * scale() as u32, "{cases} cases took {:?}", started.elapsed());
    eprintln!("fuzz campaign structural package mutations: {cases} executions in {:?}, no panic", started.elapsed());
}

/// The sizes of vertex calls mutated to hostile numbers (rows, columns, panel widths, segment
/// counts, row strides) in the small encoder's package, whose calls cover every vertex kind
/// the encoder uses (LayerNorm statistics and segments, softmax with panels and reciprocals,
/// bias adds, copies, some made word copies or copies of halves): the device must reject or run
/// each, never panic or hang.
#[test]
fn vertex_sizes_mutated_never_panic_the_device() {
    let (package, inputs) = package_of("fixtures/workloads/siglip-encoder-f16-b1-t5-d256-h4-m96-l1.toml");
    let options = ipuq::runtime::RunOptions::default();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let started = Instant::now();
    let cases = 300 * scale();
    let hostile = [0u32, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 63, 64, 65, 4096, 1 << 16, u32::MAX, u32::MAX / 2];
    let base = ipuq_queries::image::Programs::of(&package).unwrap();
    let calls: Vec<(usize, usize, usize)> = base.compute_sets.iter().enumerate().flat_map(|(t, sets)| sets.iter().enumerate().flat_map(move |(s, set)| (0..set.calls.len()).map(move |c| (t, s, c)))).collect();
    assert!(!calls.is_empty());
    let copies = calls.iter().filter(|&&(t, s, c)| matches!(base.compute_sets[t][s].calls[c], VertexCall::Copy { .. })).count();
    assert!(copies > 0, "the fixture's package has no local copy to make a word copy of");
    for case in 0..cases {
        let value = if rng.below(2) == 0 { hostile[rng.below(hostile.len())] } else { rng.next() as u32 % 1024 };
        let (t, set, c) = calls[rng.below(calls.len())];
        let mut programs = base.clone();
        let call = &mut programs.compute_sets[t][set].calls[c];
        let field = rng.below(4);
        // A third of the copies become word copies (32-bit moves) and a third copies of halves
        // (f16 one at a time), two thirds of those from a start moved by half a word or a word.
        if let VertexCall::Copy { rows, cols, dtype, input, output } = *call {
            let input = Operand { address: input.address.wrapping_add([0, 2, 4][rng.below(3)]), row_stride: input.row_stride };
            match rng.below(3) {
                0 => *call = VertexCall::CopyWords { rows, cols, dtype, input, output },
                1 => *call = VertexCall::CopyHalves { rows, cols, input, output },
                _ => {}
            }
        }
        match call {
            VertexCall::MatMul { m, k, n, a_panel, c_panel, .. } => *[m, k, n, a_panel, c_panel].into_iter().nth(rng.below(5)).unwrap() = value,
            VertexCall::Softmax { rows, cols, input_panel, .. } => *[rows, cols, input_panel].into_iter().nth(rng.below(3)).unwrap() = value,
            VertexCall::LayerNormSegment { rows, cols, segments, segment, .. } => *[rows, cols, segments, segment].into_iter().nth(rng.below(4)).unwrap() = value,
            VertexCall::Reduce { rows, cols, .. }
            | VertexCall::Gelu { rows, cols, .. }
            | VertexCall::Scale { rows, cols, .. }
            | VertexCall::Add { rows, cols, .. }
            | VertexCall::GeluErf { rows, cols, .. }
            | VertexCall::BiasAdd { rows, cols, .. }
            | VertexCall::LayerNorm { rows, cols, .. }
            | VertexCall::LayerNormStatistics { rows, cols, .. }
            | VertexCall::Copy { rows, cols, .. }
            | VertexCall::CopyWords { rows, cols, .. }
            | VertexCall::CopyHalves { rows, cols, .. }
            | VertexCall::Transpose { rows, cols, .. } => *(if field.is_multiple_of(2) { rows } else { cols }) = value,
        }
        if field == 3 {
            // And one operand's row stride.
            let pick = rng.below(4);
            let mut seen = 0;
            *call = call.map(|o| {
                seen += 1;
                if seen - 1 == pick { Operand { address: o.address, row_stride: value } } else { *o }
            });
        }
        let mut p = package.clone();
        if programs.write(&mut p).is_err() {
            continue;
        }
        if catch_unwind(AssertUnwindSafe(|| ipuq::runtime::execute(&p, &inputs, &options))).is_err() {
            panic!("vertex size mutation case {case} panicked the device: {:?}", programs.compute_sets[t][set].calls[c]);
        }
    }
    assert!(started.elapsed() < Duration::from_secs(300) * scale() as u32, "{cases} cases took {:?}", started.elapsed());
    eprintln!("fuzz campaign vertex sizes: {cases} executions in {:?}, no panic", started.elapsed());
}

/// Regression (cargo-fuzz `package_device`, session 17): an output tensor whose shape was
/// corrupted to far more elements than its segments store made the host read allocate
/// coverage and output buffers the size of the shape (34 GB) before finding the gap. It is
/// refused by name, before any allocation of that size (and a shape whose size in bytes
/// overflows 64 bits, which panicked in a debug build, by that reason).
#[test]
fn an_output_shape_larger_than_its_segments_is_refused_before_allocating() {
    let (package, inputs) = small_package();
    let options = ipuq::runtime::RunOptions::default();
    for (shape, reason) in [(vec![u32::MAX; 3], "overflows 64 bits"), (vec![1 << 20, 1 << 20, 64], "cannot be read")] {
        let mut p = package.clone();
        let output = p.host.outputs.first_mut().expect("the fixture has an output");
        output.shape = shape.clone();
        let name = output.name.clone();
        let error = match ipuq::runtime::execute(&p, &inputs, &options) {
            Ok(_) => panic!("a package whose output {name} has shape {shape:?} ran"),
            Err(e) => e.to_string(),
        };
        assert!(error.contains(&name) && error.contains(reason), "{error}");
    }
}

/// The device's error for the small encoder's package with the first `kind` ("send" or
/// "receive") run descriptor that `pick` accepts, by (count, address stride), edited by `edit`
/// (count, cycle stride, address stride) in the decoded tables.
fn error_with_run_edited(kind: &str, pick: impl Fn(u32, u32) -> bool, edit: impl Fn(&mut u32, &mut u32, &mut u32)) -> String {
    let (package, inputs) = package_of("fixtures/workloads/siglip-encoder-f16-b1-t5-d256-h4-m96-l1.toml");
    let mut programs = ipuq_queries::image::Programs::of(&package).unwrap();
    let found = programs.exchanges.iter_mut().flat_map(|x| x.tiles.iter_mut()).find_map(|t| {
        let mut runs: Vec<(&mut u32, &mut u32, &mut u32)> = if kind == "send" {
            t.sends.iter_mut().map(|r| (&mut r.count, &mut r.cycle_stride, &mut r.address_stride)).collect()
        } else {
            t.receives.iter_mut().map(|r| (&mut r.count, &mut r.cycle_stride, &mut r.address_stride)).collect()
        };
        let i = runs.iter().position(|(c, _, s)| pick(**c, **s))?;
        let (c, cs, s) = runs.swap_remove(i);
        edit(c, cs, s);
        Some(())
    });
    assert!(found.is_some(), "the small encoder has the {kind} run asked for");
    let mut p = package.clone();
    programs.write(&mut p).unwrap();
    match ipuq::runtime::execute(&p, &inputs, &ipuq::runtime::RunOptions::default()) {
        Ok(_) => panic!("the package with the {kind} run edited ran"),
        Err(e) => e.to_string(),
    }
}

/// Regression (cargo-fuzz `package_device`, session 67, kept in
/// `fuzz/regressions/package_device/`): one flipped byte made a send run of the small encoder's
/// package 16,515,075 entries long (within `MAX_PHASE_ENTRIES`) by 16 bytes, in a table segment
/// two phases share; the device expanded, sorted and checked every entry of both phases before
/// it found one outside the buffer (80 s in the instrumented fuzz build). A run is the rows of
/// one buffer, so its span is now checked against the tile's buffers before it is expanded, and
/// the error names the run. Sends and receives alike.
#[test]
fn a_run_longer_than_its_buffer_is_refused_before_it_is_expanded() {
    let count = (1u32 << 24) - 1;
    for kind in ["send", "receive"] {
        let error = error_with_run_edited(kind, |c, stride| c >= 2 && stride != 0, |c, _, _| *c = count);
        assert!(error.contains(&format!("a {kind} run of {count} entries spans")) && error.contains("not one buffer"), "{error}");
        eprintln!("refused: {error}");
    }
}

/// A run whose own entries collide, with a hostile count and no address stride (its span stays
/// in its buffer): refused on the descriptor as well, by the rule its expanded entries would
/// break (consecutive sends on one port at once; receives writing the same bytes).
#[test]
fn runs_whose_entries_collide_are_refused_before_they_are_expanded() {
    let count = (1u32 << 24) - 1;
    for (kind, cycle_stride, expected) in [("send", 0, "overlap on the tile's send port"), ("receive", 1 << 20, "write the same bytes")] {
        let error = error_with_run_edited(kind, |c, _| c >= 2, |c, cs, s| (*c, *cs, *s) = (count, cycle_stride, 0));
        assert!(error.contains(&format!("a {kind} run of {count} entries")) && error.contains(expected), "{error}");
        eprintln!("refused: {error}");
    }
}

/// Regression (`structurally_mutated_packages_never_panic_the_device` at
/// `IPUQ_FUZZ_SCALE=300`, session 40, case 6309): a matrix product mutated to zero output
/// columns with its output at address 0. The empty operand passed the checks (an empty extent
/// touches no memory) and the run then took its rows' addresses relative to the tile's base,
/// which underflowed. Empty operands anywhere, with hostile row strides, are now run as the
/// nothing they touch.
#[test]
fn empty_operands_anywhere_do_not_panic_the_device() {
    let (package, inputs) = small_package();
    let mutants: [fn(&mut VertexCall) -> bool; 2] = [
        |call| match call {
            VertexCall::MatMul { n, c, .. } => {
                (*n, c.address) = (0, 0);
                true
            }
            _ => false,
        },
        |call| match call {
            VertexCall::Gelu { rows, cols, input, output } => {
                (*rows, *cols) = (u32::MAX / 2, 0);
                *input = Operand { address: 0, row_stride: u32::MAX };
                *output = Operand { address: u32::MAX, row_stride: u32::MAX / 3 };
                true
            }
            _ => false,
        },
    ];
    run_mutants(&package, &inputs, &mutants);
}

/// Each mutant applied to the first call it changes, and the package run: the outcome of
/// each run (rejected or run), none panicking.
fn run_mutants(package: &Package, inputs: &std::collections::BTreeMap<String, Vec<u8>>, mutants: &[fn(&mut VertexCall) -> bool]) -> Vec<Result<ipuq::runtime::RunResult, String>> {
    let options = ipuq::runtime::RunOptions::default();
    let mut outcomes = Vec::new();
    for (i, mutate) in mutants.iter().enumerate() {
        let mut p = package.clone();
        let mut programs = ipuq_queries::image::Programs::of(&p).unwrap();
        // The first call it changes, and on that tile every call of the same form (the same
        // call of another compute set that shares its segment in the vertex state), so that
        // the vertex state keeps its size.
        let form = |c: &VertexCall| c.map(|o| o.row_stride);
        let found = programs.compute_sets.iter().enumerate().find_map(|(t, sets)| sets.iter().flat_map(|s| &s.calls).find(|c| mutate(&mut (*c).clone())).map(|c| (t, form(c))));
        let (tile, original) = found.unwrap_or_else(|| panic!("mutant {i} found no call to change"));
        for call in programs.compute_sets[tile].iter_mut().flat_map(|s| s.calls.iter_mut()) {
            if form(call) == original {
                mutate(call);
            }
        }
        programs.write(&mut p).unwrap();
        let outcome = catch_unwind(AssertUnwindSafe(|| ipuq::runtime::execute(&p, inputs, &options)));
        outcomes.push(outcome.unwrap_or_else(|_| panic!("mutant {i} panicked the device")).map_err(|e| e.to_string()));
    }
    outcomes
}

/// Regression (cargo-fuzz `package_device`, session 68, kept in
/// `fuzz/regressions/package_device/`): a call whose operand has rows and columns near 2^32
/// spans more than 2^64 bytes; the device's check that no operand spans more than a tile's
/// memory multiplied its element count by its element bytes and overflowed (a panic in a
/// build with overflow checks; a wrapped, passing size without them). Refused by name.
#[test]
fn operands_of_more_than_2_64_bytes_are_refused_not_overflowed() {
    let (package, inputs) = small_package();
    let mutants: [fn(&mut VertexCall) -> bool; 2] = [
        |call| match call {
            VertexCall::Gelu { rows, cols, .. } => {
                (*rows, *cols) = (u32::MAX, u32::MAX);
                true
            }
            _ => false,
        },
        |call| match call {
            VertexCall::MatMul { m, k, .. } => {
                (*m, *k) = (u32::MAX, u32::MAX);
                true
            }
            _ => false,
        },
    ];
    for outcome in run_mutants(&package, &inputs, &mutants) {
        let error = outcome.err().unwrap_or_default();
        assert!(error.contains(&format!("spans {} x {} elements, more than a tile's memory holds", u32::MAX, u32::MAX)), "{error}");
    }
}

/// Regressions (`vertex_sizes_mutated_never_panic_the_device` at `IPUQ_FUZZ_SCALE=300`,
/// session 40): LayerNorm statistics of a zero-column segment (the kernel wrote no records and
/// the write read past them), a product of 2^32 - 1 rows at a row stride of 2^32 - 1 (its
/// extent overflowed 64 bits), a softmax of zero columns with deferred reciprocals (no
/// reciprocals written), and a LayerNorm segment numbered past its row's segments (its
/// statistics spliced past the others'). Each must be rejected or run, never panic.
#[test]
fn degenerate_vertex_sizes_do_not_panic_the_device() {
    let (package, inputs) = package_of("fixtures/workloads/siglip-encoder-f16-b1-t5-d256-h4-m96-l1.toml");
    let mutants: [fn(&mut VertexCall) -> bool; 4] = [
        |call| match call {
            VertexCall::LayerNormStatistics { cols, .. } => {
                *cols = 0;
                true
            }
            _ => false,
        },
        |call| match call {
            VertexCall::MatMul { m, c, .. } => {
                (*m, c.row_stride) = (u32::MAX, u32::MAX);
                true
            }
            _ => false,
        },
        |call| match call {
            VertexCall::Softmax { cols, reciprocals: Some(_), .. } => {
                *cols = 0;
                true
            }
            _ => false,
        },
        |call| match call {
            VertexCall::LayerNormSegment { segments, segment, .. } => {
                *segment = *segments;
                true
            }
            _ => false,
        },
    ];
    let outcomes = run_mutants(&package, &inputs, &mutants);
    let error = outcomes[3].as_ref().err().cloned().unwrap_or_default();
    assert!(error.contains("segments"), "a segment past its row's segments is refused by name: {error}");
}

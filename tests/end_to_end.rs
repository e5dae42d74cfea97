//! End to end through the `ipuq` binary on the 16-tile test target: generate, build, run,
//! verify; odd shapes; bad input; determinism and the incremental cache.

mod common;

use common::{assert_pass, field, fixture, ipuq};

fn workdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("temporary folder")
}

#[test]
fn small_seed_shapes_pass_with_checkpoints() {
    let dir = workdir();
    for workload in ["workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml", "workloads/attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8.toml"] {
        let out = ipuq(&["run", &fixture(workload), "--target", "small16", "-o", "out", "--checkpoints", "--dump", "dump"], dir.path());
        assert_pass(&out);
        // Everything the host gave and got back, as .npy files anyone can check with numpy.
        let graph = ipuq_queries::ir::Graph::parse(&std::fs::read_to_string(fixture(workload)).unwrap(), workload).unwrap();
        for value in graph.values.iter().filter(|v| !matches!(v.producer, ipuq_queries::ir::Producer::Operation(_)) || graph.outputs.iter().any(|&o| graph.value(o).name == v.name)) {
            let array = ipuq::workload::npy::read_npy(&dir.path().join(format!("dump/{}.npy", value.name))).unwrap();
            assert_eq!(array.shape, value.shape.iter().map(|&d| d as u64).collect::<Vec<_>>());
        }
        assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"));
        let cycles: u64 = field(&out.stdout, "workload=", "cycles").unwrap().parse().unwrap();
        assert!(cycles > 0);
        assert!(out.stderr.contains("package build phase finished phase=\"lower_mid\""), "{}", out.stderr);
        assert!(out.stderr.contains("acquired hardware ownership"));
    }
}

#[test]
fn odd_shapes_of_both_families_pass() {
    let dir = workdir();
    let cases: &[&[&str]] = &[
        &["siglip-mlp", "--tokens", "31", "--dim", "62", "--hidden", "94"],
        &["siglip-mlp", "--tokens", "17", "--dim", "30", "--hidden", "50", "--blocks", "2", "--biases"],
        &["siglip-mlp", "--tokens", "7", "--dim", "1", "--hidden", "3"],
        &["attention", "--tokens", "13", "--heads", "6", "--kv-heads", "3", "--head-dim", "10"],
        &["attention", "--tokens", "11", "--heads", "3", "--kv-heads", "1", "--head-dim", "9"],
        &["attention", "--tokens", "19", "--heads", "2", "--kv-heads", "2", "--head-dim", "6", "--batch", "2"],
        // More heads than tiles: each context tile normalises the rows of two heads.
        &["attention", "--tokens", "19", "--heads", "32", "--kv-heads", "8", "--head-dim", "8"],
    ];
    for (i, args) in cases.iter().enumerate() {
        let file = format!("w{i}.toml");
        let mut generate = vec!["workload"];
        generate.extend_from_slice(args);
        generate.extend_from_slice(&["-o", &file]);
        let out = ipuq(&generate, dir.path());
        assert_eq!(out.code, 0, "{:?}: {}", args, out.stderr);
        let out = ipuq(&["run", &file, "--target", "small16", "-o", &format!("out{i}"), "--checkpoints"], dir.path());
        assert_pass(&out);
    }
}

#[test]
fn bad_input_gets_one_clear_error_and_exit_code_2() {
    let dir = workdir();
    let cases = [
        ("bad/malformed.toml", "malformed file"),
        ("bad/unknown-operation.toml", "unknown operation 'convolve'"),
        ("bad/mismatched-shapes.toml", "inner dimensions differ"),
        ("bad/does-not-fit.toml", "67108864 bytes of weights and inputs before the run (one copy of each; the largest, 'w', 33554432 bytes), but every one of the 16 tiles holds at most 637808 bytes of them, in the memory the loader writes (0x4c000 to 0xe7bb0) less its 64-byte runtime header: 10204928 bytes on the chip, 56903936 bytes too few: no program fits"),
        ("bad/no-plan-fits.toml", "operation 'y': no matmul plan fits in tile memory (588720 bytes per tile) on 16 tiles; the smallest needs 770048 bytes per tile"),
    ];
    for (file, expected) in cases {
        let out = ipuq(&["build", &fixture(file), "--target", "small16", "-o", "out"], dir.path());
        assert_eq!(out.code, 2, "{file}: {}", out.stderr);
        let errors: Vec<&str> = out.stderr.lines().filter(|l| l.starts_with("error: ")).collect();
        assert_eq!(errors.len(), 1, "{file}: {}", out.stderr);
        assert!(errors[0].contains(expected), "{file}: {}", errors[0]);
        assert!(!out.stderr.contains("panicked"), "{file}: {}", out.stderr);
    }
    let out = ipuq(&["run", "no-such-file.toml"], dir.path());
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("no-such-file.toml"));
    // A real package, damaged three ways: every one is refused with the file and the problem named.
    let built = ipuq(&["build", &fixture("workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml"), "--target", "small16", "-o", "good"], dir.path());
    assert_eq!(built.code, 0, "{}", built.stderr);
    let good = std::fs::read(dir.path().join("good/model.ipuexe")).unwrap();
    let inspected = ipuq(&["inspect", "good/model.ipuexe"], dir.path());
    assert_eq!(inspected.code, 0, "{}", inspected.stderr);
    assert!(inspected.stdout.contains("program tiles=16") && inspected.stdout.contains("host output=y_0"), "{}", inspected.stdout);
    // Calls per vertex kind add up to the calls.
    let calls: usize = field(&inspected.stdout, "memory ", "vertexCalls").and_then(|v| v.parse().ok()).expect("vertexCalls");
    let kinds = inspected.stdout.lines().find_map(|l| l.strip_prefix("vertices ")).expect("a vertices line");
    assert!(kinds.contains("MatMul=") && kinds.contains("Gelu="), "{kinds}");
    assert_eq!(kinds.split(' ').map(|kv| kv.split_once('=').unwrap().1.parse::<usize>().unwrap()).sum::<usize>(), calls, "{kinds}");
    // Port use: no tile's port is held longer than its phase, some port is busy in every phase
    // that moves words, and the idle receive cycles are what the busy share leaves.
    let number = |line: &str, key: &str| field(line, "", key).and_then(|v| v.parse::<f64>().ok()).unwrap_or_else(|| panic!("{key} in {line}"));
    let phases: Vec<&str> = inspected.stdout.lines().filter(|l| l.starts_with("exchange phase=")).collect();
    assert!(!phases.is_empty(), "{}", inspected.stdout);
    let mut horizons = 0.0;
    for phase in &phases {
        let horizon = number(phase, "horizon");
        // The run's phases make the summary; the load-time ("initialize") ones do not.
        match field(phase, "", "when").as_deref() {
            Some("run") => horizons += horizon,
            Some("initialize") => {}
            other => panic!("when={other:?}: {phase}"),
        }
        for key in ["receivePortBusyMax", "sendPortBusyMax"] {
            assert!(number(phase, key) <= horizon, "{key}: {phase}");
        }
        assert!(number(phase, "receivePortBusyMean") <= number(phase, "receivePortBusyMax"), "{phase}");
        if number(phase, "receiveEntries") > 0.0 {
            assert!(number(phase, "receivePortBusyMax") > 0.0 && number(phase, "sendPortBusyMax") > 0.0, "{phase}");
        }
    }
    // The live peak: at most a tile's memory, its bytes those of the prefixes and at least
    // the largest label's, the code among them.
    let live = inspected.stdout.lines().find(|l| l.starts_with("memoryPeak ")).expect("a memoryPeak line");
    let bytes = number(live, "liveBytes");
    assert!(bytes > 0.0 && bytes <= 638_976.0 && number(live, "allocations") > 0.0, "{live}");
    let pairs = |prefix: &str| -> Vec<(String, f64)> {
        let line = inspected.stdout.lines().find_map(|l| l.strip_prefix(prefix)).unwrap_or_else(|| panic!("a {prefix}line"));
        line.split(' ').map(|kv| kv.rsplit_once('=').map(|(k, v)| (k.to_string(), v.parse::<f64>().unwrap())).unwrap()).collect()
    };
    let by_prefix = pairs("memoryPeakByPrefix ");
    assert_eq!(by_prefix.iter().map(|p| p.1).sum::<f64>(), bytes, "{by_prefix:?}");
    assert!(by_prefix.iter().any(|p| p.0 == "code"), "{by_prefix:?}");
    let largest = pairs("memoryPeakLargest ");
    assert!(!largest.is_empty() && largest.len() <= 8 && largest.windows(2).all(|w| w[0].1 >= w[1].1) && largest[0].1 <= bytes, "{largest:?}");
    // What the code holds: its parts fit in the largest code allocation, the header is the
    // runtime header, and the mean table bytes are the total over the tiles.
    let code = inspected.stdout.lines().find(|l| l.starts_with("code ")).expect("a code line");
    let parts: f64 = ["headerBytes", "hostRecordBytes", "vertexStateBytes", "exchangeTableBytes"].iter().map(|k| number(code, k)).sum();
    assert!(parts > 0.0 && parts <= number(inspected.stdout.lines().find(|l| l.starts_with("memory ")).unwrap(), "largestCodeBytes"), "{code}");
    assert_eq!(number(code, "headerBytes"), 64.0, "{code}");
    // A binding is 16 bytes of the tables (phase, segment, base list, base count).
    assert!(number(code, "tableBindings") >= 1.0 && number(code, "tableBindings") * 16.0 < number(code, "exchangeTableBytes"), "{code}");
    assert!(number(code, "meanTableBindings") * 16.0 <= number(code, "meanExchangeTableBytes"), "{code}");
    assert!(number(code, "vertexStateBytes") > 0.0 && number(code, "meanVertexStateBytes") > 0.0 && number(code, "hostRecordBytes") > 0.0, "{code}");
    let tables = inspected.stdout.lines().find(|l| l.starts_with("exchangeTables ")).expect("an exchangeTables line");
    let mean_tables = number(code, "meanExchangeTableBytes");
    assert!(mean_tables > 0.0 && mean_tables <= number(tables, "largestBytes"), "{code} / {tables}");
    let tiles = number(inspected.stdout.lines().find(|l| l.starts_with("program ")).unwrap(), "tiles");
    assert_eq!((number(tables, "totalBytes") / tiles).floor(), mean_tables, "{code} / {tables}");
    let ports = inspected.stdout.lines().find(|l| l.starts_with("exchangePorts ")).expect("an exchangePorts line");
    assert_eq!(number(ports, "horizonCycles"), horizons, "{ports}");
    let busy = number(ports, "receiveBusyPercent");
    assert!(busy > 0.0 && busy <= 100.0, "{ports}");
    let idle = number(ports, "idleReceiveCyclesPerTile");
    assert!((idle - horizons * (1.0 - busy / 100.0)).abs() <= horizons * 0.001 + 1.0, "{ports}");
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 0x10;
    let mut foreign = good.clone();
    foreign[8] = 99;
    for (name, bytes, expected) in [("flipped", flipped, "checksum mismatch"), ("truncated", good[..good.len() / 3].to_vec(), "truncated package"), ("foreign", foreign, "package format v99")] {
        std::fs::write(dir.path().join(format!("{name}.ipuexe")), bytes).unwrap();
        let out = ipuq(&["run", &format!("{name}.ipuexe")], dir.path());
        assert_eq!(out.code, 2, "{name}: {}", out.stderr);
        assert!(out.stderr.lines().any(|l| l.starts_with("error: ") && l.contains(&format!("{name}.ipuexe")) && l.contains(expected)), "{name}: {}", out.stderr);
    }
    std::fs::write(dir.path().join("broken.ipuexe"), b"IPUQPKG\0 but then nothing").unwrap();
    let out = ipuq(&["run", "broken.ipuexe"], dir.path());
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("broken.ipuexe"), "{}", out.stderr);
}

#[test]
fn cold_builds_are_byte_identical_and_incremental_rebuilds_reuse_everything() {
    let dir = workdir();
    let workload = fixture("workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");
    let a = ipuq(&["build", &workload, "--target", "small16", "-o", "a"], dir.path());
    let b = ipuq(&["build", &workload, "--target", "small16", "-o", "b"], dir.path());
    assert_eq!((a.code, b.code), (0, 0), "{}", b.stderr);
    let pa = std::fs::read(dir.path().join("a/model.ipuexe")).unwrap();
    let pb = std::fs::read(dir.path().join("b/model.ipuexe")).unwrap();
    assert!(pa == pb, "two cold builds differ");
    // The thread count (`-j`, `--threads`) changes no byte; a count of zero is a usage error.
    for (folder, threads) in [("j1", "-j1"), ("j5", "--threads=5")] {
        let t = ipuq(&["build", &workload, "--target", "small16", "-o", folder, threads], dir.path());
        assert_eq!(t.code, 0, "{threads}: {}", t.stderr);
        assert!(std::fs::read(dir.path().join(folder).join("model.ipuexe")).unwrap() == pa, "{threads}: the package differs");
    }
    let zero = ipuq(&["build", &workload, "--target", "small16", "-o", "j0", "--threads", "0"], dir.path());
    assert_eq!(zero.code, 2, "{}", zero.stderr);
    assert!(zero.stderr.contains("--threads"), "{}", zero.stderr);

    let cache = "cache";
    let first = ipuq(&["build", &workload, "--target", "small16", "-o", "c", "--incremental", "--cache-dir", cache, "--timings"], dir.path());
    assert_eq!(first.code, 0, "{}", first.stderr);
    let second = ipuq(&["build", &workload, "--target", "small16", "-o", "d", "--incremental", "--cache-dir", cache, "--timings"], dir.path());
    assert_eq!(second.code, 0, "{}", second.stderr);
    // Into another folder: every compile stage hits; only the package (whose one copy on disk
    // is the output file, not a cache entry) is made again.
    let computed: Vec<&str> = second.stderr.lines().filter(|l| l.starts_with("total")).collect();
    assert_eq!(computed.len(), 1, "{}", second.stderr);
    assert!(computed[0].split_whitespace().nth(2) == Some("1"), "the second build recomputed more than the package: {}", second.stderr);
    assert!(second.stderr.contains("reused"), "{}", second.stderr);
    // Into the same folder again: nothing runs and the file is not rewritten.
    let written = std::fs::metadata(dir.path().join("d/model.ipuexe")).unwrap().modified().unwrap();
    let third = ipuq(&["build", &workload, "--target", "small16", "-o", "d", "--incremental", "--cache-dir", cache], dir.path());
    assert_eq!(third.code, 0, "{}", third.stderr);
    assert!(third.stderr.contains("application package unchanged") && !third.stderr.contains("package build phase finished"), "{}", third.stderr);
    assert_eq!(std::fs::metadata(dir.path().join("d/model.ipuexe")).unwrap().modified().unwrap(), written);
    assert_eq!(field(&third.stdout, "package=", "tiles"), field(&second.stdout, "package=", "tiles"));
    // A temporary left by a killed build (a process id that cannot be alive) is removed.
    std::fs::write(dir.path().join("d/.model.ipuexe.4294967295.tmp"), b"partial").unwrap();
    let fourth = ipuq(&["build", &workload, "--target", "small16", "-o", "d"], dir.path());
    assert_eq!(fourth.code, 0, "{}", fourth.stderr);
    assert!(!dir.path().join("d/.model.ipuexe.4294967295.tmp").exists(), "{}", fourth.stderr);
    let pc = std::fs::read(dir.path().join("c/model.ipuexe")).unwrap();
    let pd = std::fs::read(dir.path().join("d/model.ipuexe")).unwrap();
    assert!(pc == pa && pd == pa, "incremental builds differ from the cold build");
}

#[test]
fn a_second_run_waits_for_the_device_lock_then_succeeds_or_gives_up() {
    use std::process::{Command, Stdio};
    use std::time::Duration;

    let dir = workdir();
    let workload = fixture("workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");
    let out = ipuq(&["build", &workload, "--target", "small16", "-o", "out"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    let lock_path = dir.path().join("out/device.lock");
    let spawn = |timeout: &str| {
        Command::new(env!("CARGO_BIN_EXE_ipuq"))
            .args(["run", "out/model.ipuexe", "--lock-timeout", timeout])
            .current_dir(dir.path())
            .env("IPUQ_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Another process (this test) owns the device: the run waits, then goes on once released.
    let held = ipuq::device::lock::DeviceLock::acquire(&lock_path, Duration::from_secs(5)).unwrap();
    let mut child = spawn("60");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(child.try_wait().unwrap().is_none(), "the run did not wait for the lock");
    drop(held);
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("waiting for hardware ownership") && stderr.contains("acquired hardware ownership"), "{stderr}");
    assert!(String::from_utf8_lossy(&output.stdout).contains("simulatorTest=PASS"));

    // With a short timeout it gives up with a clear error naming the lock file.
    let held = ipuq::device::lock::DeviceLock::acquire(&lock_path, Duration::from_secs(5)).unwrap();
    let output = spawn("1").wait_with_output().unwrap();
    drop(held);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.lines().any(|l| l.starts_with("error: ") && l.contains("device.lock")), "{stderr}");
}

#[test]
fn concurrent_incremental_builds_share_one_cache_and_hits_verify() {
    use std::process::Command;
    let dir = workdir();
    let workload = fixture("workloads/attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8.toml");
    let children: Vec<_> = (0..3)
        .map(|i| {
            Command::new(env!("CARGO_BIN_EXE_ipuq"))
                .args(["build", &workload, "--target", "small16", "-o", &format!("p{i}"), "--incremental", "--cache-dir", "shared"])
                .current_dir(dir.path())
                .env("IPUQ_LOG", "warn")
                .output_spawn()
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let first = std::fs::read(dir.path().join("p0/model.ipuexe")).unwrap();
    for i in 1..3 {
        assert!(std::fs::read(dir.path().join(format!("p{i}/model.ipuexe"))).unwrap() == first);
    }
    // Every hit recomputed and compared: no stage changed without its version.
    let out = Command::new(env!("CARGO_BIN_EXE_ipuq"))
        .args(["build", &workload, "--target", "small16", "-o", "verified", "--incremental", "--cache-dir", "shared", "--timings"])
        .current_dir(dir.path())
        .env("IPUQ_VERIFY_CACHE", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(dir.path().join("verified/model.ipuexe")).unwrap() == first);
    let out = ipuq(&["cache", "verify", "--cache-dir", "shared"], dir.path());
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    // A read-only cache serves hits and writes nothing new.
    let before = ipuq(&["cache", "stats", "--cache-dir", "shared"], dir.path()).stdout;
    let other = fixture("workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");
    let out = ipuq(&["build", &other, "--target", "small16", "-o", "ro", "--incremental", "--cache-dir", "shared", "--cache-read-only"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(ipuq(&["cache", "stats", "--cache-dir", "shared"], dir.path()).stdout, before);
    // Stats and verify need no write access.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let shared = dir.path().join("shared");
        let set = |mode: u32| {
            for path in [shared.clone(), shared.join("tmp")] {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            }
        };
        set(0o555);
        let stats = ipuq(&["cache", "stats", "--cache-dir", "shared"], dir.path());
        let verify = ipuq(&["cache", "verify", "--cache-dir", "shared"], dir.path());
        set(0o755);
        assert_eq!(stats.code, 0, "{}", stats.stderr);
        assert_eq!(stats.stdout, before);
        assert_eq!(verify.code, 0, "{}", verify.stderr);
    }
    // A size budget evicts after a build that wrote (here: everything but what it used).
    let out = ipuq(&["build", &other, "--target", "small16", "-o", "budget", "--incremental", "--cache-dir", "shared", "--cache-max-bytes", "1K"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stderr.contains("cache garbage collected"), "{}", out.stderr);
}

trait SpawnOutput {
    fn output_spawn(&mut self) -> std::process::Child;
}

impl SpawnOutput for std::process::Command {
    fn output_spawn(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap()
    }
}

#[test]
fn a_package_for_a_doctored_target_is_refused_by_default_and_runs_on_a_device_of_that_target() {
    let dir = workdir();
    let text = ipuq_queries::target::fixtures::SMALL16.replace("gemm_per_row = 4 ", "gemm_per_row = 1 ").replace("sync_cycles = 600 ", "sync_cycles = 0 ");
    assert_ne!(text, ipuq_queries::target::fixtures::SMALL16);
    std::fs::write(dir.path().join("doctored.toml"), &text).unwrap();
    let doctored = ipuq_queries::target::Target::from_toml(&text, "doctored").unwrap().digest().short();
    let small16 = ipuq_queries::target::Target::from_toml(ipuq_queries::target::fixtures::SMALL16, "small16").unwrap().digest().short();
    let out = ipuq(&["build", &fixture("workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml"), "--target", "doctored.toml", "-o", "out"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    // The default device is ipuq's own small16, whatever the package says about its machine.
    let out = ipuq(&["run", "out/model.ipuexe"], dir.path());
    assert_eq!(out.code, 2, "{}", out.stdout);
    let error = out.stderr.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
    assert!(error.contains(&doctored) && error.contains(&small16) && error.contains("refused"), "{error}");
    let out = ipuq(&["run", "out/model.ipuexe", "--device-target", "doctored.toml"], dir.path());
    assert_pass(&out);
    assert_eq!(field(&out.stdout, "workload=", "targetDigest"), Some(doctored));
    let out = ipuq(&["run", "out/model.ipuexe", "--device-target", "small16"], dir.path());
    assert_eq!(out.code, 2);
}

//! `ipuq watch --run`: one long-lived process rebuilds and runs on every save of the workload,
//! prints one result line per rebuild, and keeps watching after an error.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::fixture;
use ipuq::workload::npy::{read_npy, write_npy};
use ipuq_queries::ir::DType;

/// A watch process, killed when dropped: also when a test fails before its end, so that no
/// watch is left polling.
struct Watch(std::process::Child);

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `ipuq ARGS` started in `dir` (logging warnings only), and its stdout lines as they come.
fn watch(dir: &std::path::Path, args: &[&str]) -> (Watch, mpsc::Receiver<String>) {
    let mut child = Watch(Command::new(env!("CARGO_BIN_EXE_ipuq")).args(args).current_dir(dir).env("IPUQ_LOG", "warn").stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap());
    let (send, lines) = mpsc::channel();
    let stdout = child.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = send.send(line);
        }
    });
    (child, lines)
}

/// The next stdout line starting with `prefix`, within `limit`.
fn next_line(lines: &mpsc::Receiver<String>, prefix: &str, limit: Duration) -> Option<String> {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        match lines.recv_timeout(left) {
            Ok(line) if line.starts_with(prefix) => return Some(line),
            Ok(_) => continue,
            Err(_) => return None,
        }
    }
}

#[test]
fn watch_rebuilds_and_runs_after_each_save_and_survives_errors() {
    let dir = tempfile::tempdir().unwrap();
    let original = std::fs::read_to_string(fixture("workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml")).unwrap();
    let workload = dir.path().join("mlp.toml");
    std::fs::write(&workload, &original).unwrap();
    let (mut child, lines) = watch(dir.path(), &["watch", "mlp.toml", "--target", "small16", "-o", "out", "--run", "--poll-ms", "50"]);
    let result = |what: &str| next_line(&lines, "workload=", Duration::from_secs(120)).unwrap_or_else(|| panic!("no result line {what}"));
    let first = result("after the first build");
    assert!(first.contains("numericalTest=PASS"), "{first}");

    // A broken save: an error, and the watch goes on.
    std::fs::write(&workload, "this is not a workload [[[").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // A new initialiser seed: a new result line with other numbers, still passing.
    std::fs::write(&workload, original.replacen("seed = 1\n", "seed = 7\n", 1)).unwrap();
    let second = result("after the seed edit");
    assert!(second.contains("numericalTest=PASS"), "{second}");
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.0.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.lines().any(|l| l.starts_with("error: ")), "the broken save printed no error: {stderr}");
}

/// On Linux a save is noticed at once (inotify on the workload's folder), not at the next
/// poll: with a minute between polls, a save in place and a save that renames another file
/// onto the workload (as many editors do) each give a new result line within seconds.
#[cfg(target_os = "linux")]
#[test]
fn watch_notices_saves_without_waiting_for_a_poll() {
    let dir = tempfile::tempdir().unwrap();
    let original = std::fs::read_to_string(fixture("workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml")).unwrap();
    let workload = dir.path().join("mlp.toml");
    std::fs::write(&workload, &original).unwrap();
    let (_child, lines) = watch(dir.path(), &["watch", "mlp.toml", "--target", "small16", "-o", "out", "--run", "--poll-ms", "60000"]);
    let result = |what: &str, limit: u64| next_line(&lines, "workload=", Duration::from_secs(limit)).unwrap_or_else(|| panic!("no result line {what}"));
    assert!(result("after the first build", 120).contains("numericalTest=PASS"));
    std::fs::write(&workload, original.replacen("seed = 1\n", "seed = 7\n", 1)).unwrap();
    let started = Instant::now();
    assert!(result("after a save in place", 30).contains("numericalTest=PASS"));
    let renamed = dir.path().join(".mlp.toml.swp");
    std::fs::write(&renamed, original.replacen("seed = 1\n", "seed = 9\n", 1)).unwrap();
    std::fs::rename(&renamed, &workload).unwrap();
    assert!(result("after a save by rename", 30).contains("numericalTest=PASS"));
    assert!(started.elapsed() < Duration::from_secs(60), "the saves waited for a poll");
}

/// `ipuq watch --target FILE` rebuilds on a save of the target description as well: a cost
/// edit gives a package line with another estimate, a target file that cannot be read prints
/// an error naming it, and the watch goes on when it is back.
#[test]
fn watch_rebuilds_after_a_save_of_the_target_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml"), dir.path().join("mlp.toml")).unwrap();
    let original = std::fs::read_to_string(fixture("targets/small16.toml")).unwrap();
    let target = dir.path().join("target.toml");
    std::fs::write(&target, &original).unwrap();
    let (mut child, lines) = watch(dir.path(), &["watch", "mlp.toml", "--target", "target.toml", "-o", "out", "--poll-ms", "50"]);
    let estimate = |what: &str| -> u64 {
        let line = next_line(&lines, "package=", Duration::from_secs(120)).unwrap_or_else(|| panic!("no package line {what}"));
        line.split_whitespace().find_map(|f| f.strip_prefix("estimatedCycles=")).unwrap_or_else(|| panic!("{line}")).parse().unwrap()
    };
    let first = estimate("after the first build");
    // Gone for a moment (an error), then back with a dearer matrix-product call.
    std::fs::remove_file(&target).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let dearer = original.replacen("gemm_base = 294 ", "gemm_base = 2940", 1);
    assert_ne!(dearer, original);
    std::fs::write(&target, dearer).unwrap();
    let second = estimate("after the target edit");
    assert!(second > first, "the estimate did not follow the target edit: {first} then {second}");
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.0.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.lines().any(|l| l.starts_with("error: ") && l.contains("target.toml: cannot read target description")), "the missing target printed no error naming it: {stderr}");
}

/// `ipuq watch --run --input NAME=FILE.npy --dump DIR`: every run reads the given input and
/// dumps its tensors; an edit of a weight's initialiser gives another output for the same
/// input; so does a save of a `.npy` file a weight is initialised from, and a save of the
/// given input runs again on it. `--input` without `--run` is a usage error.
#[test]
fn watch_runs_on_a_given_input_and_dumps_every_run() {
    let dir = tempfile::tempdir().unwrap();
    let original = std::fs::read_to_string(fixture("workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml")).unwrap();
    // The first weight from a .npy file beside the workload.
    let original = original.replacen("[tensor.init.gaussian]\nseed = 101\nstd = 0.125\n", "[tensor.init.npy]\npath = \"w1.npy\"\n", 1);
    assert!(original.contains("w1.npy"));
    std::fs::write(dir.path().join("mlp.toml"), &original).unwrap();
    let values = |n: usize, step: usize, scale: f32| -> Vec<f32> { (0..n).map(|i| ((i * step % 101) as f32 - 50.0) / scale).collect() };
    let x = values(37 * 64, 37, 25.0);
    write_npy(&dir.path().join("x.npy"), DType::F32, &[37, 64], &x).unwrap();
    write_npy(&dir.path().join("w1.npy"), DType::F16, &[64, 96], &values(64 * 96, 13, 400.0)).unwrap();

    let usage = Command::new(env!("CARGO_BIN_EXE_ipuq")).args(["watch", "mlp.toml", "--input", "x=x.npy"]).current_dir(dir.path()).output().unwrap();
    assert_eq!(usage.status.code(), Some(2), "--input without --run: {}", String::from_utf8_lossy(&usage.stderr));

    let (mut child, lines) = watch(dir.path(), &["watch", "mlp.toml", "--target", "small16", "-o", "out", "--run", "--input", "x=x.npy", "--dump", "dump", "--poll-ms", "50"]);
    let result = |what: &str| {
        let line = next_line(&lines, "workload=", Duration::from_secs(120)).unwrap_or_else(|| panic!("no result line {what}"));
        assert!(line.contains("numericalTest=PASS"), "{what}: {line}");
    };
    let dumped = |name: &str| read_npy(&dir.path().join(format!("dump/{name}.npy"))).unwrap().values;
    let rounded = |v: &[f32]| -> Vec<f32> { v.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect() };
    result("after the first build");
    assert_eq!(dumped("x"), rounded(&x), "the first run did not use the given input");
    let mut outputs = vec![dumped("y_0")];

    std::fs::write(dir.path().join("mlp.toml"), original.replacen("seed = 102\n", "seed = 7\n", 1)).unwrap();
    result("after the second weight's seed edit");
    assert_eq!(dumped("x"), rounded(&x), "the second run did not use the given input");
    outputs.push(dumped("y_0"));

    write_npy(&dir.path().join("w1.npy"), DType::F16, &[64, 96], &values(64 * 96, 17, 300.0)).unwrap();
    result("after the first weight's .npy file was saved");
    assert_eq!(dumped("w1_0"), rounded(&values(64 * 96, 17, 300.0)), "the run did not read the saved weight");
    outputs.push(dumped("y_0"));

    let other = values(37 * 64, 41, 20.0);
    write_npy(&dir.path().join("x.npy"), DType::F32, &[37, 64], &other).unwrap();
    result("after the given input was saved");
    assert_eq!(dumped("x"), rounded(&other), "the run did not read the saved input");
    outputs.push(dumped("y_0"));
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    for i in 1..outputs.len() {
        assert_ne!(outputs[i - 1], outputs[i], "run {i} gave the output of the run before it");
    }
}

/// `ipuq watch`, a long-lived command, executes itself once with glibc's malloc on transparent
/// huge pages (`alloc::huge_pages`, first thing in `main`; one-shot commands do not, see
/// `cli::long_lived`): the process's environment holds the tunable beside the user's own
/// tunables, a `glibc.malloc.hugetlb` the user set is left as it is, and the process builds as
/// before.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn ipuq_watch_runs_with_mallocs_heap_on_huge_pages_unless_the_user_chose() {
    // (The user's tunables, whether the process is marked as executed again already, and the
    // tunables the watching process runs with.)
    for (given, marked, expected) in [
        (None, false, Some("glibc.malloc.hugetlb=1")),
        (Some("glibc.malloc.arena_max=4"), false, Some("glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1")),
        (Some("glibc.malloc.hugetlb=0"), false, Some("glibc.malloc.hugetlb=0")),
        // A process executed again never executes itself once more.
        (None, true, None),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(fixture("workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml"), dir.path().join("mlp.toml")).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_ipuq"));
        command.args(["watch", "mlp.toml", "--target", "small16", "-o", "out", "--poll-ms", "50"]).current_dir(dir.path()).env("IPUQ_LOG", "warn").env_remove("GLIBC_TUNABLES");
        if let Some(t) = given {
            command.env("GLIBC_TUNABLES", t);
        }
        if marked {
            command.env("IPUQ_HUGE_PAGES_EXECUTED", "1");
        } else {
            command.env_remove("IPUQ_HUGE_PAGES_EXECUTED");
        }
        let mut child = Watch(command.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap());
        let (send, lines) = mpsc::channel();
        let stdout = child.0.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = send.send(line);
            }
        });
        let built = next_line(&lines, "package=", Duration::from_secs(120));
        let environ = std::fs::read(format!("/proc/{}/environ", child.0.id())).unwrap();
        child.0.kill().unwrap();
        child.0.wait().unwrap();
        assert!(built.is_some(), "{given:?}: no package line");
        // glibc (2.36) ends each tunable's value in place as it reads them, so the process's
        // environment block shows `GLIBC_TUNABLES=a=1` and `b=2` apart: joined again here.
        let entries: Vec<String> = environ.split(|&b| b == 0).map(|v| String::from_utf8_lossy(v).into_owned()).collect();
        let at: Vec<usize> = (0..entries.len()).filter(|&i| entries[i].starts_with("GLIBC_TUNABLES=")).collect();
        let Some(expected) = expected else {
            assert!(at.is_empty(), "{given:?}, marked: {entries:?}");
            continue;
        };
        assert_eq!(at.len(), 1, "{given:?}: {entries:?}");
        let mut tunables = entries[at[0]].clone();
        for next in entries[at[0] + 1..].iter().take_while(|e| e.starts_with("glibc.")) {
            tunables = format!("{tunables}:{next}");
        }
        assert_eq!(tunables, format!("GLIBC_TUNABLES={expected}"), "{given:?}");
        if given.is_none_or(|g| !g.contains("hugetlb")) {
            assert!(entries.iter().any(|e| e == "IPUQ_HUGE_PAGES_EXECUTED=1"), "{given:?}: not marked as executed again");
        }
    }
}

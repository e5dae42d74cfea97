//! `ipuq watch`: one long-lived compiler session (one salsa database) rebuilding a workload
//! on every save. The file is polled (content compared every `poll`, 200 ms by default); each
//! change re-evaluates only the queries the edit touched (salsa's early cutoff), writes the
//! package and, with `--run`, runs it on the simulator and prints the usual result lines. An
//! error prints `error: …` and the watch goes on.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::build::{read_package, BuildOptions, Session};
use crate::report::{run_and_verify_cached, RunCaches, RunRequest};

pub struct WatchOptions {
    /// Run every successful build on the simulator.
    pub run: bool,
    pub lock_timeout: Duration,
    pub poll: Duration,
    /// Stop after this many rebuilds (tests); `None`: watch until killed.
    pub max_rebuilds: Option<u32>,
}

/// Watch `workload`; `out_dir` names the output folder for the workload as it now reads.
pub fn watch(workload: &Path, options: BuildOptions, out_dir: impl Fn(&Path) -> Result<PathBuf, String>, watch: &WatchOptions) -> Result<(), String> {
    let mut session = Session::rebuilding(&options).map_err(|e| e.to_string())?;
    let mut options = options;
    let mut last: Option<Result<Vec<u8>, String>> = None;
    let mut rebuilds = 0u32;
    // Tensors drawn and reference operations computed for earlier runs: what an edit leaves
    // alone is reused.
    let mut caches = RunCaches::default();
    eprintln!("watching {} (Ctrl-C to stop)", workload.display());
    loop {
        let now = std::fs::read(workload).map_err(|e| format!("workload {}: cannot read: {e}", workload.display()));
        if last.as_ref() != Some(&now) {
            match &now {
                Ok(_) => {
                    let start = Instant::now();
                    rebuild(&mut session, workload, &mut options, &out_dir, watch, &mut caches);
                    tracing::info!(elapsed_ms = start.elapsed().as_millis() as u64, "watch rebuild finished");
                    rebuilds += 1;
                }
                Err(message) => eprintln!("error: {message}"),
            }
            last = Some(now);
            if watch.max_rebuilds.is_some_and(|m| rebuilds >= m) {
                return Ok(());
            }
        }
        std::thread::sleep(watch.poll);
    }
}

fn rebuild(
    session: &mut Session,
    workload: &Path,
    options: &mut BuildOptions,
    out_dir: &impl Fn(&Path) -> Result<PathBuf, String>,
    watch: &WatchOptions,
    caches: &mut RunCaches,
) {
    let result = out_dir(workload).and_then(|dir| {
        options.out_dir = dir;
        session.build(workload, options).map_err(|e| e.to_string())
    });
    let built = match result {
        Ok(built) => built,
        Err(message) => {
            eprintln!("error: {message}");
            return;
        }
    };
    println!("package={} tiles={} estimatedCycles={}", built.path.display(), built.tiles, built.estimated_cycles);
    if !watch.run {
        return;
    }
    let package = match built.package {
        Some(p) => p,
        None => match read_package(&built.path) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("error: {e}");
                return;
            }
        },
    };
    let request = RunRequest {
        // The device models the machine the build targeted (the built-in one it names by default).
        device_target: options.target.clone(),
        checkpoints: false,
        sample_limit: 256,
        dump: None,
        lock_timeout: watch.lock_timeout,
        workload_folder: workload.parent().map(Path::to_path_buf).unwrap_or_default(),
        inputs: Vec::new(),
    };
    if let Err(message) = run_and_verify_cached(&package, &built.path, &request, Some(caches)) {
        eprintln!("error: {message}");
    }
}

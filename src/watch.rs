//! `ipuq watch`: one long-lived compiler session (one salsa database) rebuilding a workload
//! on every save of it, or of the target description when `--target` names a file. The files
//! are read when the kernel notices a change in their folders (inotify, on Linux: `Notices`)
//! and in any case every `poll` (200 ms by default: file systems that send no notices, such as
//! some network mounts, are still watched); a change is built once two reads in a row agree,
//! the second `settle` (50 ms, or a quarter of a poll if shorter) after the first with no
//! notice between, so a save read half written is not (a debounce), or at once when the
//! notices say the save is whole (the file closed after writing, or renamed into place, with
//! no write after). Each change re-evaluates only the queries the edit touched (salsa's early
//! cutoff), writes the package and, with `--run`, runs it on the simulator and prints the usual
//! result lines. An error prints `error: …` and the watch goes on.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use std::sync::Arc;

use crate::build::{load_target, read_package, target_file, target_from_bytes, BuildOptions, Session};
use crate::report::{run_and_verify_cached, RunCaches, RunRequest};

pub struct WatchOptions {
    /// Run every successful build on the simulator.
    pub run: bool,
    /// The runs' given inputs (`--input NAME=FILE.npy`, read again for every run).
    pub inputs: Vec<(String, PathBuf)>,
    /// Where every run writes its tensors as .npy files (`--dump`).
    pub dump: Option<PathBuf>,
    pub lock_timeout: Duration,
    pub poll: Duration,
    /// Stop after this many rebuilds (tests); `None`: watch until killed.
    pub max_rebuilds: Option<u32>,
}

/// Watch `workload`; `out_dir` names the output folder for the workload's text as a poll read it.
pub fn watch(workload: &Path, options: BuildOptions, out_dir: impl Fn(&Path, &str) -> Result<PathBuf, String>, watch: &WatchOptions) -> Result<(), String> {
    let mut session = Session::rebuilding(&options).map_err(|e| e.to_string())?;
    // Each rebuild's result line (and run) comes first; its cache entries are written after.
    session.defer_finishing();
    let mut options = options;
    let mut changes = Changes::default();
    let mut rebuilds = 0u32;
    // Tensors drawn and reference operations computed for earlier runs: what an edit leaves
    // alone is reused.
    let mut caches = RunCaches::default();
    let target = target_file(options.target.as_deref()).map(PathBuf::from);
    match &target {
        Some(t) => eprintln!("watching {} and the target description {} (Ctrl-C to stop)", workload.display(), t.display()),
        None => eprintln!("watching {} (Ctrl-C to stop)", workload.display()),
    }
    // With --run, the files the runs read are watched too (by size and modification time).
    let mut run_files = watch.run.then(|| RunFiles::new(workload, &watch.inputs));
    let mut notices = Notices::new();
    let settle = (watch.poll / 4).min(SETTLE);
    loop {
        let now = poll(workload, target.as_deref(), run_files.as_mut());
        // The files to be told about: these, and those a run of this text reads.
        let watched: Vec<&Path> = [workload].into_iter().chain(target.as_deref()).chain(run_files.as_ref().map(RunFiles::listed).unwrap_or_default().iter().map(PathBuf::as_path)).collect();
        notices.watch(&watched);
        if changes.take(&now) {
            match &now {
                Ok(polled) => {
                    let start = Instant::now();
                    // The bytes the polls read are built (the files may change again meanwhile).
                    rebuild(&mut session, workload, polled, &mut options, &out_dir, watch, &mut caches);
                    tracing::info!(elapsed_ms = start.elapsed().as_millis() as u64, "watch rebuild finished");
                    session.finish();
                    session.release_deferred();
                    rebuilds += 1;
                }
                Err(message) => eprintln!("error: {message}"),
            }
            if watch.max_rebuilds.is_some_and(|m| rebuilds >= m) {
                return Ok(());
            }
        }
        // A change read once is confirmed by a read `settle` later rather than a whole poll
        // later (the save it waits for is already under way), or at the next notice; a notice
        // that the saves of the files it names are whole confirms the read that follows it.
        changes.confirmed = notices.wait(if changes.pending.is_some() { settle } else { watch.poll }) == Notice::Whole;
    }
}

/// What ended a wait for notices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Notice {
    /// The time ran out (or there are no notices).
    None,
    /// A watched file changed; a save may be under way.
    Changed,
    /// Every watched file the notices named was last closed after writing, or renamed into
    /// place: those saves are whole.
    Whole,
}

/// How long a change read once waits for the read that confirms it (at most; a quarter of the
/// poll where that is shorter).
const SETTLE: Duration = Duration::from_millis(50);

/// The kernel's notices of changes to the watched files (inotify on their folders, so that a
/// save that replaces a file by renaming another onto it is seen too), where they can be had;
/// elsewhere, and where inotify cannot start, `wait` sleeps and the watch polls.
struct Notices {
    #[cfg(target_os = "linux")]
    inotify: Option<nix::sys::inotify::Inotify>,
    /// Each watched file as (folder, name); the folders are the ones watched.
    files: Vec<(PathBuf, std::ffi::OsString)>,
}

impl Notices {
    fn new() -> Notices {
        #[cfg(target_os = "linux")]
        {
            use nix::sys::inotify::{InitFlags, Inotify};
            let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC);
            if let Err(error) = &inotify {
                tracing::debug!(%error, "no file-system notices (inotify): the watch polls");
            }
            Notices { inotify: inotify.ok(), files: Vec::new() }
        }
        #[cfg(not(target_os = "linux"))]
        Notices { files: Vec::new() }
    }

    /// Be told about changes to `files` (those not yet watched are added). A symbolic link is
    /// watched where it is and where it leads, since a save changes the file it leads to.
    fn watch(&mut self, files: &[&Path]) {
        let resolved: Vec<PathBuf> = files.iter().filter(|f| f.is_symlink()).filter_map(|f| std::fs::canonicalize(f).ok()).collect();
        for file in files.iter().copied().chain(resolved.iter().map(PathBuf::as_path)) {
            let Some(name) = file.file_name() else { continue };
            let folder = match file.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            if self.files.iter().any(|(f, n)| *f == folder && n == name) {
                continue;
            }
            // A folder is watched once, with its first file.
            #[cfg(target_os = "linux")]
            if let Some(inotify) = self.inotify.as_ref().filter(|_| !self.files.iter().any(|(f, _)| *f == folder)) {
                use nix::sys::inotify::AddWatchFlags as F;
                let events = F::IN_CLOSE_WRITE | F::IN_MODIFY | F::IN_MOVED_TO | F::IN_MOVED_FROM | F::IN_CREATE | F::IN_DELETE | F::IN_ATTRIB;
                // A folder that cannot be watched (gone, not readable) is polled.
                if let Err(error) = inotify.add_watch(folder.as_path(), events) {
                    tracing::debug!(folder = %folder.display(), %error, "no file-system notices for this folder: its files are polled");
                }
            }
            self.files.push((folder, name.to_os_string()));
        }
    }

    /// Wait until a watched file may have changed (a notice naming it) or `timeout` passed.
    fn wait(&self, timeout: Duration) -> Notice {
        #[cfg(target_os = "linux")]
        if let Some(inotify) = &self.inotify {
            use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
            use std::os::fd::AsFd;
            let deadline = Instant::now() + timeout;
            loop {
                let Some(left) = deadline.checked_duration_since(Instant::now()) else { return Notice::None };
                let mut fds = [PollFd::new(inotify.as_fd(), PollFlags::POLLIN)];
                let wait = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
                match poll(&mut fds, wait) {
                    Ok(0) => return Notice::None,
                    Ok(_) => match self.drain(inotify) {
                        Notice::None => {}
                        notice => return notice,
                    },
                    Err(nix::errno::Errno::EINTR) => {}
                    // Notices fail: sleep out the rest, as a poll would.
                    Err(_) => {
                        std::thread::sleep(left);
                        return Notice::None;
                    }
                }
            }
        }
        std::thread::sleep(timeout);
        Notice::None
    }

    /// Read the queued notices: whether they name a watched file (or the queue overflowed, so
    /// some may have been lost), and whether the saves they name are whole.
    #[cfg(target_os = "linux")]
    fn drain(&self, inotify: &nix::sys::inotify::Inotify) -> Notice {
        use nix::sys::inotify::AddWatchFlags as F;
        // Per watched file named, whether its last notice ends a save.
        let mut last: Vec<(&std::ffi::OsStr, bool)> = Vec::new();
        let mut overflow = false;
        while let Ok(events) = inotify.read_events() {
            if events.is_empty() {
                break;
            }
            for event in &events {
                overflow |= event.mask.contains(F::IN_Q_OVERFLOW);
                let Some(name) = event.name.as_deref() else { continue };
                let Some((_, file)) = self.files.iter().find(|(_, f)| f == name) else { continue };
                let whole = event.mask.intersects(F::IN_CLOSE_WRITE | F::IN_MOVED_TO);
                match last.iter_mut().find(|(f, _)| *f == file.as_os_str()) {
                    Some(entry) => entry.1 = whole,
                    None => last.push((file.as_os_str(), whole)),
                }
            }
        }
        match (overflow, last.is_empty()) {
            (true, _) => Notice::Changed,
            (false, true) => Notice::None,
            (false, false) if last.iter().all(|(_, whole)| *whole) => Notice::Whole,
            (false, false) => Notice::Changed,
        }
    }
}

/// What one poll read: the workload's bytes, the target description's where it is a file, and
/// (with --run) the size and modification time of each file the runs read (`RunFiles`; `None`
/// where it cannot be read: the run says why).
#[derive(Clone, Debug, PartialEq)]
struct Polled {
    workload: Vec<u8>,
    target: Option<Vec<u8>>,
    files: Vec<(PathBuf, Option<(u64, std::time::SystemTime)>)>,
}

/// Reads the watched files, or says which one cannot be read.
fn poll(workload: &Path, target: Option<&Path>, run_files: Option<&mut RunFiles>) -> Result<Polled, String> {
    let bytes = std::fs::read(workload).map_err(|e| format!("workload {}: cannot read: {e}", workload.display()))?;
    let target = match target {
        Some(path) => Some(std::fs::read(path).map_err(|e| format!("{}: cannot read target description: {e}", path.display()))?),
        None => None,
    };
    let files = run_files.map(|f| f.stat(&bytes)).unwrap_or_default();
    Ok(Polled { workload: bytes, target, files })
}

/// The files a run reads besides the workload: the `.npy` and safetensors files its tensors'
/// initialisers name (relative to the workload's folder, as the run resolves them) and the
/// `--input` files. A save of one of them runs again (the build is a no-op unless the workload
/// changed too); they are looked at by size and modification time, not read, since a
/// checkpoint may be gigabytes.
struct RunFiles {
    folder: PathBuf,
    inputs: Vec<PathBuf>,
    /// The workload bytes the list was made from, and the list.
    made: Option<(Vec<u8>, Vec<PathBuf>)>,
}

impl RunFiles {
    fn new(workload: &Path, inputs: &[(String, PathBuf)]) -> RunFiles {
        RunFiles { folder: workload.parent().map(Path::to_path_buf).unwrap_or_default(), inputs: inputs.iter().map(|(_, p)| p.clone()).collect(), made: None }
    }

    /// The files as last listed (`stat`).
    fn listed(&self) -> &[PathBuf] {
        self.made.as_ref().map(|(_, f)| f.as_slice()).unwrap_or_default()
    }

    /// The files for this workload text (listed again only when the text changed), each with
    /// its size and modification time.
    fn stat(&mut self, workload: &[u8]) -> Vec<(PathBuf, Option<(u64, std::time::SystemTime)>)> {
        if self.made.as_ref().is_none_or(|(bytes, _)| bytes != workload) {
            let mut files = self.inputs.clone();
            // A workload that does not parse names no files; its build reports the error.
            if let Some(graph) = std::str::from_utf8(workload).ok().and_then(|text| ipuq_queries::ir::Graph::parse(text, "watched workload").ok()) {
                for t in &graph.file.tensors {
                    match &t.init {
                        ipuq_queries::ir::Init::Npy { path } | ipuq_queries::ir::Init::Safetensors { path, .. } => files.push(self.folder.join(path)),
                        _ => {}
                    }
                }
            }
            files.sort();
            files.dedup();
            self.made = Some((workload.to_vec(), files));
        }
        let files = self.made.as_ref().map(|(_, f)| f.as_slice()).unwrap_or_default();
        files.iter().map(|f| (f.clone(), std::fs::metadata(f).ok().and_then(|m| Some((m.len(), m.modified().ok()?))))).collect()
    }
}

/// What the watch read of its files: the read it last built (or reported), and a change read
/// once and not yet taken. An editor's save may be read half written, so a change is taken
/// when two polls in a row read it (the first read at once), or when the read follows a
/// notice that the save is whole (`confirmed`).
struct Changes<T> {
    last: Option<Result<T, String>>,
    pending: Option<Result<T, String>>,
    /// The next read follows a notice that the saves are whole: a change it reads is taken at
    /// once.
    confirmed: bool,
}

impl<T> Default for Changes<T> {
    fn default() -> Self {
        Changes { last: None, pending: None, confirmed: false }
    }
}

impl<T: Clone + PartialEq> Changes<T> {
    /// Whether to build (or report) `now`, this poll's read; if so it becomes the last one.
    fn take(&mut self, now: &Result<T, String>) -> bool {
        let confirmed = std::mem::take(&mut self.confirmed);
        if self.last.as_ref() == Some(now) {
            self.pending = None;
            return false;
        }
        if self.last.is_some() && !confirmed && self.pending.as_ref() != Some(now) {
            self.pending = Some(now.clone());
            return false;
        }
        self.pending = None;
        self.last = Some(now.clone());
        true
    }
}

fn rebuild(
    session: &mut Session,
    workload: &Path,
    polled: &Polled,
    options: &mut BuildOptions,
    out_dir: &impl Fn(&Path, &str) -> Result<PathBuf, String>,
    watch: &WatchOptions,
    caches: &mut RunCaches,
) {
    let text = String::from_utf8(polled.workload.clone()).map_err(|e| format!("{}: cannot read workload: {e}", workload.display()));
    let target = match (&polled.target, target_file(options.target.as_deref())) {
        (Some(bytes), Some(path)) => target_from_bytes(path, bytes.clone()),
        _ => load_target(options.target.as_deref()),
    }
    .map_err(|e| e.to_string());
    let result = text.and_then(|text| {
        let target = target.clone()?;
        options.out_dir = out_dir(workload, &text)?;
        session.build_with_target(text, workload, target, options).map_err(|e| e.to_string())
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
            Ok(p) => Arc::new(p),
            Err(e) => {
                eprintln!("error: {e}");
                return;
            }
        },
    };
    let request = RunRequest {
        // The device models the machine the build targeted, as the build read it (a target
        // file saved again since would give the package another's digest); the built-in one
        // the package names by default.
        device_target: options.target.as_ref().and(target.ok()),
        checkpoints: false,
        sample_limit: 256,
        dump: watch.dump.clone(),
        lock_timeout: watch.lock_timeout,
        workload_folder: workload.parent().map(Path::to_path_buf).unwrap_or_default(),
        inputs: watch.inputs.clone(),
    };
    if let Err(message) = run_and_verify_cached(&package, &built.path, &request, Some(caches)) {
        eprintln!("error: {message}");
    }
}

#[cfg(test)]
mod tests {
    use super::{rebuild, Changes, WatchOptions};
    use crate::build::{BuildOptions, Session};
    use crate::report::RunCaches;
    use std::path::Path;
    use std::time::Duration;

    /// Build options of these tests: `target`, no cache, output into `out`.
    fn options(target: &str, out: &Path) -> BuildOptions {
        BuildOptions {
            target: Some(target.to_string()),
            out_dir: out.to_path_buf(),
            incremental: false,
            cache_dir: None,
            cache_read_only: false,
            cache_max_bytes: None,
            plan_finalists: 4,
            table_budget: None,
            remote: None,
        }
    }

    /// A rebuild builds the bytes the polls took, not the file as it reads by then: a save
    /// landing between the poll and the build (here half written) changes nothing.
    #[test]
    fn a_rebuild_builds_the_polled_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let workload = dir.path().join("mlp.toml");
        let text = include_str!("../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");
        std::fs::write(&workload, &text[..text.len() / 2]).unwrap();
        let mut options = options("small16", dir.path());
        let mut session = Session::rebuilding(&options).unwrap();
        let watch = WatchOptions { run: false, inputs: Vec::new(), dump: None, lock_timeout: Duration::from_secs(1), poll: Duration::from_millis(1), max_rebuilds: None };
        let out = dir.path().join("out");
        let named = |_: &Path, polled: &str| -> Result<std::path::PathBuf, String> {
            assert_eq!(polled, text, "the out folder is named from the polled text");
            Ok(out.clone())
        };
        let polled = super::Polled { workload: text.as_bytes().to_vec(), target: None, files: Vec::new() };
        rebuild(&mut session, &workload, &polled, &mut options, &named, &watch, &mut RunCaches::default());
        assert!(out.join("model.ipuexe").is_file(), "the polled text was not built");
        // The same bytes built by a plain build once the save is whole.
        std::fs::write(&workload, text).unwrap();
        options.out_dir = dir.path().join("plain");
        crate::build::build(&workload, &options).unwrap();
        let package = |p: &Path| std::fs::read(p.join("model.ipuexe")).unwrap();
        assert!(package(&out) == package(&options.out_dir), "the watch's package differs from a plain build's");
    }

    /// With `--target FILE` the watch builds the target description its polls read too: an
    /// edit of the target (here a runtime-only constant, with the file on disk not yet
    /// rewritten) gives the package a plain build of the edited target file gives.
    #[test]
    fn a_rebuild_builds_the_polled_target_description() {
        let dir = tempfile::tempdir().unwrap();
        let workload = dir.path().join("mlp.toml");
        let text = include_str!("../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");
        std::fs::write(&workload, text).unwrap();
        let original = include_str!("../fixtures/targets/small16.toml");
        let edited = original.replacen("link_bytes_per_second = 24000000000", "link_bytes_per_second = 12000000000", 1);
        assert_ne!(edited, original);
        let target = dir.path().join("target.toml");
        std::fs::write(&target, original).unwrap();
        let mut options = options(&target.display().to_string(), dir.path());
        let mut session = Session::rebuilding(&options).unwrap();
        let watch = WatchOptions { run: false, inputs: Vec::new(), dump: None, lock_timeout: Duration::from_secs(1), poll: Duration::from_millis(1), max_rebuilds: None };
        let out = dir.path().join("out");
        let named = |_: &Path, _: &str| -> Result<std::path::PathBuf, String> { Ok(out.clone()) };
        let package = |p: &Path| std::fs::read(p.join("model.ipuexe")).unwrap();
        let polled = |target: &str| super::Polled { workload: text.as_bytes().to_vec(), target: Some(target.as_bytes().to_vec()), files: Vec::new() };
        rebuild(&mut session, &workload, &polled(original), &mut options, &named, &watch, &mut RunCaches::default());
        let first = package(&out);
        rebuild(&mut session, &workload, &polled(&edited), &mut options, &named, &watch, &mut RunCaches::default());
        let second = package(&out);
        assert!(first != second, "the target edit did not reach the package");
        // Plain builds of the original and of the edited target file.
        for (text_of_target, expected) in [(original, &first), (edited.as_str(), &second)] {
            std::fs::write(&target, text_of_target).unwrap();
            options.out_dir = dir.path().join("plain");
            crate::build::build(&workload, &options).unwrap();
            assert!(package(&options.out_dir) == *expected, "the watch's package differs from a plain build's");
        }
        // An unreadable target file is named by the poll.
        std::fs::remove_file(&target).unwrap();
        let message = super::poll(&workload, Some(&target), None).unwrap_err();
        assert!(message.contains("target.toml: cannot read target description"), "{message}");
    }

    /// A change is taken when two polls in a row read it: a save read half written (or any
    /// content seen once) is not built; the first read is; an unreadable file is reported once
    /// it stays so, like any change.
    #[test]
    fn a_change_is_taken_when_two_polls_read_it() {
        let read = |text: &str| -> Result<Vec<u8>, String> { Ok(text.as_bytes().to_vec()) };
        let mut changes = Changes::default();
        let polls = [
            (read("a"), true),
            (read("a"), false),
            (read("b half"), false),
            (read("b whole"), false),
            (read("b whole"), true),
            (read("b whole"), false),
            // Back and forth: a content seen once is dropped when the last one returns.
            (read("c"), false),
            (read("b whole"), false),
            (read("c"), false),
            (read("c"), true),
            (Err("cannot read".to_string()), false),
            (Err("cannot read".to_string()), true),
            (Err("cannot read".to_string()), false),
            (read("c"), false),
            (read("c"), true),
        ];
        for (i, (now, taken)) in polls.iter().enumerate() {
            assert_eq!(changes.take(now), *taken, "poll {i}: {now:?}");
        }
        // After a notice that the save is whole, the next read is taken at once, and only
        // that one: a later change waits for its second read again.
        changes.confirmed = true;
        assert!(changes.take(&read("d")));
        assert!(!changes.take(&read("e")));
        assert!(changes.take(&read("e")));
        changes.confirmed = true;
        assert!(!changes.take(&read("e")), "an unchanged read is no change, notice or not");
        assert!(!changes.take(&read("f")));
    }
}

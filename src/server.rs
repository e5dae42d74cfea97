//! `ipuq serve`: a build server, one long-lived compiler session (as `ipuq watch` keeps)
//! answering the `--incremental` builds of other ipuq processes, so that an edit-build loop
//! driven by separate commands (an editor's build task, a script, a Makefile) rebuilds from
//! memory what a new process would read back or lower again (the plan beam's states, the
//! table screen's packings, the placement statistics: "The cache and incremental builds").
//!
//! The server listens on a Unix socket in the cache folder (`server.sock`, mode 0600). An
//! `ipuq build --incremental` or `ipuq run WORKLOAD --incremental` with that cache folder
//! reads the workload and the target description itself, sends them with its options, working
//! folder and log filter, and prints what comes back: the build's log lines, then its result
//! line, or its error (exit 2). The server builds exactly those bytes, as a build in the
//! client's process would, so the package is the same; the client runs it itself. A client
//! builds in its own process, as before, where no server answers (no socket, or a stale one),
//! where the server is another compiler build (its compiler id or its executable file differs:
//! it says so in a log line), where the connection ends before the answer (a server killed
//! mid-build), with a remote cache, or with `--no-server`.
//!
//! The server answers as soon as the package is written: its cache's writer thread is held
//! while the build runs (both cores go to the build) and writes the build's entries after the
//! answer, before the server takes the next request (`Session::defer_finishing`,
//! `DiskStore::hold`). One build at a time: a second client waits for the first's build. A
//! client that goes away mid-build does not stop it (its entries and package are still
//! written). A build that panics fails its request and the server drops its session and goes
//! on. The server stops on `ipuq serve --stop`, after `--max-idle-secs` without a request
//! (default three hours), or when its socket file is removed.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::build::{cache_budget, default_cache_dir, BuildOptions, Built, PhaseTiming, Session};

/// The socket's file name in the cache folder.
pub const SOCKET: &str = "server.sock";

/// How long a client may take to send its request once connected.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one write to a client may wait for it to read.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// The default `--max-idle-secs`: three hours.
pub const DEFAULT_MAX_IDLE: Duration = Duration::from_secs(3 * 3600);

/// What a client asks.
#[derive(Serialize, Deserialize)]
enum Request {
    Build(Box<BuildRequest>),
    Stop,
}

/// One build, as the client would make it in its own process.
#[derive(Serialize, Deserialize)]
struct BuildRequest {
    /// The client's compiler build (`identity`): the server builds only for its own.
    identity: String,
    /// The client's working folder: the workload and output paths are relative to it.
    cwd: PathBuf,
    /// The workload's path as the client names it (the origin its messages give).
    workload: PathBuf,
    text: String,
    target_text: String,
    target_origin: String,
    out_dir: PathBuf,
    settings: Settings,
    /// The client's log filter (`IPUQ_LOG`, else `RUST_LOG`, else info).
    log_filter: String,
}

/// What the server's session is made with: a request with other settings gets a new session.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
struct Settings {
    cache_dir: PathBuf,
    cache_read_only: bool,
    cache_max_bytes: u64,
    plan_finalists: usize,
    table_budget: Option<u32>,
    verify_hits: bool,
}

/// What the server sends back: log lines and phases, then one of the others.
#[derive(Serialize, Deserialize)]
enum Reply {
    Log(String),
    /// Phase `index` (from 0) of `total` is running (the client draws its progress line).
    Phase { index: usize, total: usize, name: String },
    /// Another compiler build, or a request it cannot take: the client builds itself.
    Refused(String),
    /// The package is written (at the client's output path).
    Built { tiles: u32, estimated_cycles: u64, timings: Vec<Timing> },
    Failed(String),
    Stopping,
}

#[derive(Serialize, Deserialize)]
struct Timing {
    phase: String,
    elapsed_ms: u128,
    computed: usize,
    disk_hits: usize,
    remote_hits: usize,
}

/// This compiler build: its compiler id (the package version and the compiler's sources)
/// and its executable file (device, inode, length and modification time), so that a server
/// whose binary was rebuilt since it started, or another binary, is not used.
pub fn identity() -> String {
    let exe = std::env::current_exe()
        .and_then(std::fs::metadata)
        .map(|m| format!("{}:{}:{}:{}.{}", m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec()))
        .unwrap_or_else(|e| format!("unknown executable ({e})"));
    format!("{} {exe}", ipuq_queries::fingerprint::compiler_id())
}

/// The cache folder `dir` (default: `default_cache_dir`), absolute, and canonical where it
/// exists (so that two spellings of one folder reach one server session).
pub fn cache_folder(dir: Option<&Path>) -> Result<PathBuf, String> {
    let dir = dir.map(Path::to_path_buf).unwrap_or_else(default_cache_dir);
    let absolute = std::path::absolute(&dir).map_err(|e| format!("cache folder {}: {e}", dir.display()))?;
    Ok(std::fs::canonicalize(&absolute).unwrap_or(absolute))
}

/// Serve builds for the cache folder `dir` until stopped.
pub fn serve(dir: &Path, max_idle: Duration) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cache folder {}: cannot create: {e}", dir.display()))?;
    let dir = &std::fs::canonicalize(dir).map_err(|e| format!("cache folder {}: {e}", dir.display()))?;
    let path = dir.join(SOCKET);
    if path.exists() {
        if UnixStream::connect(&path).is_ok() {
            return Err(format!("{}: a build server already answers there (ipuq serve --stop ends it)", path.display()));
        }
        // A server that ended without removing it (killed).
        std::fs::remove_file(&path).map_err(|e| format!("{}: cannot remove the stale socket: {e}", path.display()))?;
    }
    let listener = UnixListener::bind(&path).map_err(|e| format!("{}: cannot listen: {e}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(|e| format!("{}: {e}", path.display()))?;
    let ours = std::fs::metadata(&path).map(|m| m.ino()).map_err(|e| format!("{}: {e}", path.display()))?;
    listener.set_nonblocking(true).map_err(|e| format!("{}: {e}", path.display()))?;
    eprintln!("serving --incremental builds with the cache {} at {} (ipuq serve --stop ends it)", dir.display(), path.display());
    let mut server = Server { identity: identity(), session: None, own_filter: crate::logging::filter() };
    let mut last = Instant::now();
    let still_ours = || std::fs::metadata(&path).is_ok_and(|m| m.ino() == ours);
    let stopped = loop {
        match listener.accept() {
            Ok((stream, _)) => {
                let stop = stream.set_nonblocking(false).is_ok() && server.answer(stream);
                last = Instant::now();
                server.release();
                if stop {
                    break "asked to stop";
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if !still_ours() {
                    // Removed or replaced: nothing reaches this server any more.
                    eprintln!("{}: the socket was removed; stopping", path.display());
                    return Ok(());
                }
                if last.elapsed() >= max_idle {
                    break "idle";
                }
                use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
                use std::os::fd::AsFd;
                let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
                let _ = poll(&mut fds, PollTimeout::from(1000u16));
            }
            // A client gone before it was taken, a signal: the next one.
            Err(e) if matches!(e.kind(), std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::Interrupted) => continue,
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
    };
    if still_ours() {
        let _ = std::fs::remove_file(&path);
    }
    eprintln!("build server stopped ({stopped})");
    Ok(())
}

/// Start a server for the cache folder `dir` in the background where none answers (`--server`),
/// and wait until it does: its own process group (a Ctrl-C of the build that started it does
/// not stop it), its log appended to `server.log` in the folder.
pub fn start(dir: Option<&Path>) -> Result<(), String> {
    let dir = cache_folder(dir)?;
    let path = dir.join(SOCKET);
    if UnixStream::connect(&path).is_ok() {
        return Ok(());
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("cache folder {}: cannot create: {e}", dir.display()))?;
    let log_path = dir.join("server.log");
    let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let exe = std::env::current_exe().map_err(|e| format!("cannot start a build server: {e}"))?;
    use std::os::unix::process::CommandExt;
    let mut child = std::process::Command::new(exe)
        .arg("serve")
        .arg("--cache-dir")
        .arg(&dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot start a build server: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if UnixStream::connect(&path).is_ok() {
            tracing::info!(socket = %path.display(), pid = child.id(), log = %log_path.display(), "started a build server");
            return Ok(());
        }
        // It ended: another server took the folder first (then that one answers), or it failed.
        if let Ok(Some(status)) = child.try_wait() {
            if UnixStream::connect(&path).is_ok() {
                return Ok(());
            }
            return Err(format!("the build server for {} ended at its start ({status}); see {}", dir.display(), log_path.display()));
        }
        if Instant::now() >= deadline {
            return Err(format!("the build server for {} did not answer within 10 s; see {}", dir.display(), log_path.display()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Ask the server for the cache folder `dir` to stop; false where none answers.
pub fn stop(dir: &Path) -> Result<bool, String> {
    let path = dir.join(SOCKET);
    let Ok(mut stream) = UnixStream::connect(&path) else { return Ok(false) };
    send(&mut stream, &Request::Stop).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut reader = BufReader::new(stream);
    loop {
        match receive::<Reply>(&mut reader).map_err(|e| format!("{}: {e}", path.display()))? {
            Some(Reply::Stopping) => return Ok(true),
            Some(_) => continue,
            None => return Err(format!("{}: the server closed the connection", path.display())),
        }
    }
}

struct Server {
    identity: String,
    session: Option<(Settings, Session)>,
    own_filter: String,
}

impl Server {
    /// Answer one client; true when it asked the server to stop.
    fn answer(&mut self, stream: UnixStream) -> bool {
        // A client that stops sending its request, or stops reading the answer (suspended),
        // holds the server no longer than these: then it is dropped, and a build goes on.
        let _ = stream.set_read_timeout(Some(REQUEST_TIMEOUT));
        let _ = stream.set_write_timeout(Some(REPLY_TIMEOUT));
        let Ok(mut writer) = stream.try_clone() else { return false };
        let mut reader = BufReader::new(stream);
        let request = match receive::<Request>(&mut reader) {
            Ok(Some(request)) => request,
            Ok(None) => return false,
            Err(e) => {
                let _ = send(&mut writer, &Reply::Refused(format!("cannot read the request: {e}")));
                return false;
            }
        };
        let request = match request {
            Request::Stop => {
                let _ = send(&mut writer, &Reply::Stopping);
                return true;
            }
            Request::Build(request) => request,
        };
        if request.identity != self.identity {
            let _ = send(&mut writer, &Reply::Refused(format!("it runs another compiler build ({})", self.identity)));
            return false;
        }
        if let Err(e) = std::env::set_current_dir(&request.cwd) {
            let _ = send(&mut writer, &Reply::Refused(format!("cannot enter the working folder {}: {e}", request.cwd.display())));
            return false;
        }
        // The client's log lines, as its own process would print them, and the phases reached
        // (for its progress line) go to it; a client gone away is written to no more, and its
        // build goes on.
        let client = Arc::new(Mutex::new(Some(writer)));
        crate::progress::forward_to(Some(Box::new(Client(client.clone()))));
        crate::logging::set_filter(&request.log_filter);
        // A build that panics (a compiler bug) fails this request, not the server: its session,
        // which may hold half-made state, is dropped.
        let result = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.build(&request))) {
            Ok(built) => built,
            Err(panic) => {
                self.session = None;
                let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned()).unwrap_or_default();
                Err(format!("the build server's build panicked ({what}); the server dropped its session and goes on"))
            }
        };
        let reply = match result {
            Ok(built) => Reply::Built {
                tiles: built.tiles,
                estimated_cycles: built.estimated_cycles,
                timings: built.timings.iter().map(|t| Timing { phase: t.phase.to_string(), elapsed_ms: t.elapsed_ms, computed: t.computed, disk_hits: t.disk_hits, remote_hits: t.remote_hits }).collect(),
            },
            Err(message) => Reply::Failed(message),
        };
        crate::progress::forward_to(None);
        crate::logging::set_filter(&self.own_filter);
        if let Some(w) = client.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            let _ = send(w, &reply);
        }
        false
    }

    /// The build (its session holds the cache's writer while it runs; its entries are
    /// written once the client has its answer: `release`).
    fn build(&mut self, request: &BuildRequest) -> Result<Built, String> {
        let session = self.session_for(request)?;
        let target = (request.target_text.clone(), request.target_origin.clone());
        session.build_with_target(request.text.clone(), &request.workload, target, &options_of(request)).map_err(|e| e.to_string())
    }

    /// The session for the request's settings: the one kept, or a new one where they differ
    /// (a database's plan finalists, table budget and cache are fixed when it is made).
    fn session_for(&mut self, request: &BuildRequest) -> Result<&mut Session, String> {
        if self.session.as_ref().is_none_or(|(settings, _)| *settings != request.settings) {
            self.session = None;
            let mut session = Session::rebuilding_verifying(&options_of(request), request.settings.verify_hits).map_err(|e| e.to_string())?;
            session.defer_finishing();
            self.session = Some((request.settings.clone(), session));
        }
        Ok(&mut self.session.as_mut().expect("made above").1)
    }

    /// Once the client has its answer: finish the last build (its cache entries written, its
    /// record, the size budget) and drop what it put off dropping (as a watch does between
    /// saves).
    fn release(&mut self) {
        if let Some((_, session)) = &mut self.session {
            let start = Instant::now();
            session.finish();
            session.release_deferred();
            tracing::info!(elapsed_ms = start.elapsed().as_millis() as u64, "build finished after the answer: cache entries written, memory released");
        }
    }
}

/// The connection to the client a build is for, as the log's and progress's destination.
struct Client(Arc<Mutex<Option<UnixStream>>>);

impl Client {
    fn send(&self, reply: &Reply) {
        let mut connection = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = connection.as_mut() {
            if send(w, reply).is_err() {
                *connection = None;
            }
        }
    }
}

impl crate::progress::Forward for Client {
    fn log(&mut self, bytes: &[u8]) {
        self.send(&Reply::Log(String::from_utf8_lossy(bytes).into_owned()));
    }
    fn phase(&mut self, index: usize, total: usize, name: &str) {
        self.send(&Reply::Phase { index, total, name: name.to_string() });
    }
}

/// The options a build in the client's process would have (the target is the request's).
fn options_of(request: &BuildRequest) -> BuildOptions {
    BuildOptions {
        target: None,
        out_dir: request.out_dir.clone(),
        incremental: true,
        cache_dir: Some(request.settings.cache_dir.clone()),
        cache_read_only: request.settings.cache_read_only,
        cache_max_bytes: Some(request.settings.cache_max_bytes),
        plan_finalists: request.settings.plan_finalists,
        table_budget: request.settings.table_budget,
        remote: None,
    }
}

/// Build through the server for `options`' cache folder, if one answers and is this compiler
/// build: `None` where the caller builds in its own process.
pub fn build(workload: &Path, options: &BuildOptions) -> Option<Result<Built, String>> {
    if !options.incremental || options.remote.is_some() {
        return None;
    }
    let dir = cache_folder(options.cache_dir.as_deref()).ok()?;
    let path = dir.join(SOCKET);
    if !path.exists() {
        return None;
    }
    let Ok(mut stream) = UnixStream::connect(&path) else {
        tracing::info!(socket = %path.display(), "no build server answers (a stale socket); building in this process");
        return None;
    };
    // What a build in this process would read.
    let text = match std::fs::read_to_string(workload) {
        Ok(text) => text,
        Err(e) => return Some(Err(format!("{}: cannot read workload: {e}", workload.display()))),
    };
    let (target_text, target_origin) = match crate::build::load_target(options.target.as_deref()) {
        Ok(target) => target,
        Err(e) => return Some(Err(e.to_string())),
    };
    let settings = Settings {
        cache_dir: dir,
        cache_read_only: options.cache_read_only,
        cache_max_bytes: match cache_budget(options.cache_max_bytes) {
            Ok(bytes) => bytes,
            Err(e) => return Some(Err(e.to_string())),
        },
        plan_finalists: options.plan_finalists,
        table_budget: options.table_budget,
        verify_hits: crate::build::verifying_hits(),
    };
    let cwd = std::env::current_dir().ok()?;
    let request = BuildRequest {
        identity: identity(),
        cwd,
        workload: workload.to_path_buf(),
        text,
        target_text,
        target_origin,
        out_dir: options.out_dir.clone(),
        settings,
        log_filter: crate::logging::filter(),
    };
    if let Err(e) = send(&mut stream, &Request::Build(Box::new(request))) {
        tracing::info!(socket = %path.display(), error = %e, "the build server took no request; building in this process");
        return None;
    }
    let mut reader = BufReader::new(stream);
    let mut err = crate::progress::Writer;
    // The progress line, drawn here (on a terminal) from the phases the server reports, and
    // cleared when the answer comes.
    let mut progress: Option<crate::progress::Progress> = None;
    loop {
        match receive::<Reply>(&mut reader) {
            Ok(Some(Reply::Log(line))) => {
                let _ = err.write_all(line.as_bytes());
            }
            Ok(Some(Reply::Phase { index, total, name })) => {
                progress.get_or_insert_with(|| crate::progress::Progress::start(total)).phase(index, &name);
            }
            Ok(Some(Reply::Refused(why))) => {
                tracing::info!(socket = %path.display(), "the build server does not build this: {why}; building in this process");
                return None;
            }
            Ok(Some(Reply::Built { tiles, estimated_cycles, timings })) => {
                let timings = timings.into_iter().filter_map(|t| {
                    let phase = ipuq_queries::pipeline::PHASES.iter().find(|p| **p == t.phase)?;
                    Some(PhaseTiming { phase, elapsed_ms: t.elapsed_ms, computed: t.computed, disk_hits: t.disk_hits, remote_hits: t.remote_hits })
                });
                tracing::info!(socket = %path.display(), "built by the build server");
                // The path as this process names it (the file the server wrote).
                let path = options.out_dir.join("model.ipuexe");
                return Some(Ok(Built { package: None, path, tiles, estimated_cycles, timings: timings.collect() }));
            }
            Ok(Some(Reply::Failed(message))) => return Some(Err(message)),
            Ok(Some(Reply::Stopping)) | Ok(None) => {
                tracing::warn!(socket = %path.display(), "the build server ended the connection before its build finished; building in this process");
                return None;
            }
            Err(e) => {
                tracing::warn!(socket = %path.display(), error = %e, "the build server's reply cannot be read; building in this process");
                return None;
            }
        }
    }
}

/// One message: a line of JSON.
fn send<T: Serialize>(to: &mut impl Write, message: &T) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(message).map_err(std::io::Error::other)?;
    line.push(b'\n');
    to.write_all(&line)?;
    to.flush()
}

/// The next message, `None` at the end of the stream.
fn receive<T: for<'de> Deserialize<'de>>(from: &mut impl BufRead) -> std::io::Result<Option<T>> {
    let mut line = Vec::new();
    if from.read_until(b'\n', &mut line)? == 0 {
        return Ok(None);
    }
    serde_json::from_slice(&line).map(Some).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Messages survive their framing, log lines with newlines and quotes included.
    #[test]
    fn messages_round_trip_one_line_each() {
        let mut bytes = Vec::new();
        send(&mut bytes, &Reply::Log("a \"line\"\nand another\n".into())).unwrap();
        send(&mut bytes, &Reply::Failed("error: x".into())).unwrap();
        assert_eq!(bytes.iter().filter(|&&b| b == b'\n').count(), 2);
        let mut reader = std::io::Cursor::new(bytes);
        assert!(matches!(receive::<Reply>(&mut reader).unwrap(), Some(Reply::Log(l)) if l == "a \"line\"\nand another\n"));
        assert!(matches!(receive::<Reply>(&mut reader).unwrap(), Some(Reply::Failed(m)) if m == "error: x"));
        assert!(receive::<Reply>(&mut reader).unwrap().is_none());
        let mut bad = std::io::Cursor::new(b"{not json\n".to_vec());
        assert!(receive::<Reply>(&mut bad).is_err());
    }

    /// What a build logs and the phases it reaches go to its client, in order; once the
    /// client is gone, nothing is written and nothing fails.
    #[test]
    fn a_builds_log_and_phases_reach_its_client_and_a_gone_client_is_dropped() {
        use crate::progress::Forward;
        let (server_end, client_end) = UnixStream::pair().unwrap();
        let mut client = Client(Arc::new(Mutex::new(Some(server_end))));
        client.log(b"a line\n");
        client.phase(1, 8, "select_finalist");
        let mut reader = BufReader::new(client_end);
        assert!(matches!(receive::<Reply>(&mut reader).unwrap(), Some(Reply::Log(l)) if l == "a line\n"));
        assert!(matches!(receive::<Reply>(&mut reader).unwrap(), Some(Reply::Phase { index: 1, total: 8, name }) if name == "select_finalist"));
        drop(reader);
        // The first write after the other end closed may still be buffered by the kernel; a
        // later one fails, and the connection is dropped.
        for _ in 0..3 {
            client.log(b"after\n");
        }
        assert!(client.0.lock().unwrap().is_none(), "a gone client is written to no more");
    }
}

//! `ipuq serve`: a build server answers other processes' `--incremental` builds with the
//! package a build in their own process makes; another compiler build's server, a stale
//! socket and `--no-server` leave the build in the client's process; errors reach the client.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{fixture, ipuq};

/// A server process, killed when dropped (also when a test fails before stopping it).
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `BINARY serve --cache-dir CACHE`, once its socket answers.
fn serve(binary: &Path, cache: &Path) -> Server {
    let child = Command::new(binary).args(["serve", "--cache-dir"]).arg(cache).env("IPUQ_LOG", "warn").stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let server = Server(child);
    let socket = cache.join("server.sock");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "no server answers at {}", socket.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    server
}

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_ipuq"))
}

const SERVED: &str = "built by the build server";

/// The small MLP seed every test builds (on small16).
const MLP: &str = "workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml";

/// A folder holding the small MLP seed as `mlp.toml`; its cache folder and that folder as a
/// command-line argument.
fn workdir() -> (tempfile::TempDir, PathBuf, String) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture(MLP), dir.path().join("mlp.toml")).unwrap();
    let cache = dir.path().join("cache");
    let cache_arg = cache.display().to_string();
    (dir, cache, cache_arg)
}

#[test]
fn a_served_build_is_the_build_a_process_makes_and_errors_reach_the_client() {
    let (dir, cache, cache_arg) = workdir();
    let original = std::fs::read_to_string(fixture(MLP)).unwrap();
    let build = |out: &str, extra: &[&str]| {
        let mut args = vec!["build", "mlp.toml", "--target", "small16", "-o", out];
        args.extend_from_slice(extra);
        ipuq(&args, dir.path())
    };
    let package = |out: &str| std::fs::read(dir.path().join(out).join("model.ipuexe")).unwrap();
    let mut server = serve(&binary(), &cache);
    let incremental = ["--incremental", "--cache-dir", cache_arg.as_str()];

    // Cold, then the same again (a no-op), then an edit: each the package of a build in the
    // client's own process, with the client's result line and the server's log lines.
    let served = build("served", &incremental);
    assert_eq!(served.code, 0, "{}", served.stderr);
    assert!(served.stderr.contains(SERVED), "{}", served.stderr);
    assert!(served.stderr.contains("package build phase finished"), "the build's log lines reach the client: {}", served.stderr);
    assert!(served.stdout.starts_with("package=served/model.ipuexe tiles=16 "), "{}", served.stdout);
    let plain = build("plain", &[]);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    assert!(package("served") == package("plain"), "the served package differs from a plain build's");
    let again = build("served", &[&incremental[..], &["--timings"]].concat());
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert!(again.stderr.contains("application package unchanged"), "{}", again.stderr);
    assert_eq!(again.stdout, served.stdout);
    std::fs::write(dir.path().join("mlp.toml"), original.replacen("op = \"gelu\"", "op = \"scale\"\nfactor = 0.5", 1)).unwrap();
    let edited = build("served", &[&incremental[..], &["--timings"]].concat());
    assert_eq!(edited.code, 0, "{}", edited.stderr);
    assert!(edited.stderr.contains(SERVED) && edited.stderr.contains("lower_mid"), "served builds print their timings: {}", edited.stderr);
    assert!(build("plain", &[]).code == 0 && package("served") == package("plain"), "the served edit differs from a plain build of the edited workload");

    // `--no-server` builds here; so does another compiler build (here: another executable
    // file), saying why; both make the same package.
    let alone = build("alone", &[&incremental[..], &["--no-server"]].concat());
    assert_eq!(alone.code, 0, "{}", alone.stderr);
    assert!(!alone.stderr.contains(SERVED) && package("alone") == package("plain"), "{}", alone.stderr);
    let other = dir.path().join("ipuq-copy");
    std::fs::copy(binary(), &other).unwrap();
    let out = Command::new(&other).args(["build", "mlp.toml", "--target", "small16", "-o", "other"]).args(incremental).current_dir(dir.path()).env("IPUQ_LOG", "info").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("runs another compiler build") && !stderr.contains(SERVED), "{stderr}");
    assert!(package("other") == package("plain"));

    // A compile error in the server reaches the client as a process's would: one `error:`
    // line, exit 2; the server goes on.
    let bad = ipuq(&["build", &fixture("bad/no-plan-fits.toml"), "--target", "small16", "-o", "bad", "--incremental", "--cache-dir", &cache_arg], dir.path());
    assert_eq!(bad.code, 2, "{}", bad.stderr);
    let errors: Vec<&str> = bad.stderr.lines().filter(|l| l.starts_with("error: ")).collect();
    assert!(errors.len() == 1 && errors[0].contains("fits in tile memory"), "{}", bad.stderr);
    assert!(!bad.stderr.contains(SERVED), "{}", bad.stderr);
    let ran = ipuq(&["run", "mlp.toml", "--target", "small16", "-o", "run", "--incremental", "--cache-dir", &cache_arg], dir.path());
    common::assert_pass(&ran);
    assert!(ran.stderr.contains(SERVED), "{}", ran.stderr);

    // Stopped: the process ends and its socket is gone; builds are made here again.
    let stop = ipuq(&["serve", "--stop", "--cache-dir", &cache_arg], dir.path());
    assert!(stop.code == 0 && stop.stdout.starts_with("stopped the build server"), "{}{}", stop.stdout, stop.stderr);
    let status = server.0.wait().unwrap();
    assert!(status.success());
    assert!(!cache.join("server.sock").exists());
    let after = build("after", &incremental);
    assert!(after.code == 0 && !after.stderr.contains(SERVED), "{}", after.stderr);
    let stop = ipuq(&["serve", "--stop", "--cache-dir", &cache_arg], dir.path());
    assert!(stop.code == 0 && stop.stdout.starts_with("no build server answers"), "{}", stop.stdout);
}

#[test]
fn a_killed_servers_socket_is_passed_over_and_replaced() {
    let (dir, cache, cache_arg) = workdir();
    let killed = serve(&binary(), &cache);
    // A second server for the same folder is refused while the first answers.
    let second = ipuq(&["serve", "--cache-dir", &cache_arg], dir.path());
    assert!(second.code == 2 && second.stderr.contains("a build server already answers there"), "{}", second.stderr);
    drop(killed);
    assert!(cache.join("server.sock").exists(), "a killed server leaves its socket");
    let out = ipuq(&["build", "mlp.toml", "--target", "small16", "-o", "out", "--incremental", "--cache-dir", &cache_arg], dir.path());
    assert!(out.code == 0 && out.stderr.contains("no build server answers") && !out.stderr.contains(SERVED), "{}", out.stderr);
    let _server = serve(&binary(), &cache);
    let out = ipuq(&["build", "mlp.toml", "--target", "small16", "-o", "out2", "--incremental", "--cache-dir", &cache_arg], dir.path());
    assert!(out.code == 0 && out.stderr.contains(SERVED), "{}", out.stderr);
}

#[test]
fn server_starts_a_server_where_none_answers_and_builds_through_it() {
    let (dir, cache, cache_arg) = workdir();
    let build = |out: &str| ipuq(&["build", "mlp.toml", "--target", "small16", "-o", out, "--incremental", "--cache-dir", &cache_arg, "--server"], dir.path());
    let first = build("first");
    assert!(first.code == 0 && first.stderr.contains("started a build server") && first.stderr.contains(SERVED), "{}", first.stderr);
    let second = build("second");
    assert!(second.code == 0 && !second.stderr.contains("started a build server") && second.stderr.contains(SERVED), "{}", second.stderr);
    assert!(std::fs::read_to_string(cache.join("server.log")).unwrap().contains("serving --incremental builds"));
    let stop = ipuq(&["serve", "--stop", "--cache-dir", &cache_arg], dir.path());
    assert!(stop.code == 0 && stop.stdout.starts_with("stopped the build server"), "{}", stop.stdout);
    let deadline = Instant::now() + Duration::from_secs(30);
    while cache.join("server.sock").exists() {
        assert!(Instant::now() < deadline, "the started server did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Without --incremental there is no cache to serve: refused as a usage error; so is a
    // watch asked to build through a server (it keeps a session of its own).
    let out = ipuq(&["build", "mlp.toml", "--target", "small16", "-o", "x", "--server"], dir.path());
    assert_eq!(out.code, 2, "{}", out.stderr);
    let out = ipuq(&["watch", "mlp.toml", "--target", "small16", "-o", "x", "--incremental", "--cache-dir", &cache_arg, "--server"], dir.path());
    assert!(out.code == 2 && out.stderr.contains("ipuq watch keeps a compiler session of its own"), "{}", out.stderr);
}

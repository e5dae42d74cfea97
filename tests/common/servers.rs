//! Real cache servers for the shared-cache tests: nginx (WebDAV) and redis-server on
//! 127.0.0.1. `.ci/run` starts them and passes `IPUQ_TEST_NGINX_URL` / `IPUQ_TEST_REDIS_URL`.
//! Without those variables a test starts its own server when the binary is installed, and
//! otherwise prints a SKIPPED line; under `CI=true` a missing variable fails the test.

#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Server {
    pub url: String,
    child: Option<Child>,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn installed(candidates: &[&str]) -> Option<String> {
    candidates.iter().find(|p| Path::new(p).is_file()).map(|p| p.to_string())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("address").port()
}

fn wait_for(port: u16) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

fn from_env_or(var: &str, what: &str, start: impl FnOnce() -> Option<Server>) -> Option<Server> {
    if let Ok(url) = std::env::var(var) {
        return Some(Server { url, child: None, _dir: None });
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{var} is not set: under CI, .ci/run must start {what} and export its URL");
    }
    let server = start();
    if server.is_none() {
        eprintln!("SKIPPED: {what} is not installed and {var} is not set (run .ci/run, or apt-get install nginx-light redis-server)");
    }
    server
}

/// An nginx serving the Bazel layout under `/ipuq`.
pub fn nginx() -> Option<Server> {
    from_env_or("IPUQ_TEST_NGINX_URL", "nginx", || {
        let binary = installed(&["/usr/sbin/nginx", "/usr/bin/nginx"])?;
        let dir = tempfile::tempdir().expect("tempdir");
        for sub in ["data/ipuq", "body"] {
            std::fs::create_dir_all(dir.path().join(sub)).expect("server dirs");
        }
        let _ = Command::new("chmod").args(["-R", "a+rwX"]).arg(dir.path()).status();
        let port = free_port();
        let config = include_str!("../../.ci/nginx-cache.conf").replace("@DIR@", &dir.path().display().to_string()).replace("@PORT@", &port.to_string());
        let config_path = dir.path().join("nginx.conf");
        std::fs::write(&config_path, config).expect("nginx.conf");
        // One process (no master and workers), so killing the child stops the whole server.
        let child = Command::new(binary)
            .arg("-e")
            .arg(dir.path().join("error.log"))
            .arg("-c")
            .arg(&config_path)
            .args(["-g", "daemon off; master_process off;"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let server = Server { url: format!("http://127.0.0.1:{port}/ipuq"), child: Some(child), _dir: Some(dir) };
        wait_for(port).then_some(server)
    })
}

/// A redis-server; `db` picks the database so tests do not share keys.
pub fn redis(db: u8) -> Option<Server> {
    let mut server = from_env_or("IPUQ_TEST_REDIS_URL", "redis-server", || {
        let binary = installed(&["/usr/bin/redis-server", "/usr/sbin/redis-server", "/usr/local/bin/redis-server"])?;
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let child = Command::new(binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let server = Server { url: format!("redis://127.0.0.1:{port}/0"), child: Some(child), _dir: Some(dir) };
        wait_for(port).then_some(server)
    })?;
    let base = server.url.rsplit_once('/').map_or(server.url.clone(), |(base, _)| base.to_string());
    server.url = format!("{base}/{db}");
    Some(server)
}

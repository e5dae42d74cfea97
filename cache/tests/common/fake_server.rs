//! An in-process TCP server for the remote-cache tests: a small HTTP store in
//! the Bazel layout, or a misbehaving peer (junk, garbage, slow, dropping the
//! connection mid-body). Listens on 127.0.0.1 only; every connection thread
//! ends by itself (read timeouts), and the accept thread ends when the server
//! is dropped.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

/// How the server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A working HTTP store: GET, HEAD, PUT by path.
    Store,
    /// Valid HTTP, 200 with a junk body for every request.
    Junk,
    /// Bytes that are not HTTP (or RESP) at all, then close.
    Garbage,
    /// Reads the request and answers nothing for this long.
    Slow(Duration),
    /// GET answers the stored body's full length but sends half, then closes.
    DropMidBody,
}

pub struct FakeServer {
    pub port: u16,
    pub mode: Arc<Mutex<Mode>>,
    pub entries: Arc<Mutex<HashMap<String, Vec<u8>>>>,
    pub requests: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl FakeServer {
    pub fn start(mode: Mode) -> FakeServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let port = listener.local_addr().expect("address").port();
        let server = FakeServer {
            port,
            mode: Arc::new(Mutex::new(mode)),
            entries: Arc::default(),
            requests: Arc::default(),
            stop: Arc::default(),
        };
        let (mode, entries, requests, stop) = (server.mode.clone(), server.entries.clone(), server.requests.clone(), server.stop.clone());
        thread::spawn(move || {
            for stream in listener.incoming() {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let (mode, entries, requests) = (mode.clone(), entries.clone(), requests.clone());
                thread::spawn(move || serve(stream, &mode, &entries, &requests));
            }
        });
        server
    }

    pub fn url(&self, prefix: &str) -> String {
        format!("http://127.0.0.1:{}/{prefix}", self.port)
    }

    pub fn set_mode(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// A port with nothing listening on it.
pub fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("address").port()
}

fn serve(stream: TcpStream, mode: &Mutex<Mode>, entries: &Mutex<HashMap<String, Vec<u8>>>, requests: &AtomicU64) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut writer = stream.try_clone().expect("clone stream");
    let mut reader = BufReader::new(stream);
    loop {
        let mode = *mode.lock().unwrap();
        if mode == Mode::Garbage {
            let mut first = [0u8; 1];
            if reader.read(&mut first).unwrap_or(0) == 0 {
                return;
            }
            requests.fetch_add(1, Ordering::Relaxed);
            let _ = writer.write_all(b"\x00\xff garbage, not a protocol \xfe\r\n\r\n");
            return;
        }
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, path) = (parts.next().unwrap_or("").to_owned(), parts.next().unwrap_or("").to_owned());
        let mut length = 0usize;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            if header.trim().is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        requests.fetch_add(1, Ordering::Relaxed);
        let stored = entries.lock().unwrap().get(&path).cloned();
        let result = match (mode, method.as_str()) {
            (Mode::Slow(pause), _) => {
                thread::sleep(pause);
                return;
            }
            (Mode::Junk, "HEAD") => writer.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n"),
            (Mode::Junk, _) => writer.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot cache"),
            (Mode::DropMidBody, "GET") if stored.is_some() => {
                let body = stored.unwrap();
                let _ = write!(writer, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
                let _ = writer.write_all(&body[..body.len() / 2]);
                return;
            }
            (_, "PUT") => {
                entries.lock().unwrap().insert(path, body);
                writer.write_all(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
            }
            (_, "GET") | (_, "HEAD") => match stored {
                Some(body) => {
                    let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
                    writer.write_all(head.as_bytes()).and_then(|()| if method == "GET" { writer.write_all(&body) } else { Ok(()) })
                }
                None => writer.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"),
            },
            _ => writer.write_all(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n"),
        };
        if result.is_err() {
            return;
        }
    }
}

//! A one-line progress display on standard error, drawn only when standard error is a
//! terminal (CI logs and redirected output stay clean). Log lines go through [`Writer`],
//! which clears the progress line before a log line and redraws it after, so both stay
//! readable on one terminal. While a build server builds for a client (`server.rs`), log
//! lines and the phases reached go to that client instead, which draws the line itself.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::Instant;

/// The line being shown ("" when none).
static LINE: Mutex<String> = Mutex::new(String::new());

/// Where log lines and progress go instead of standard error while a build server builds for
/// a client.
pub trait Forward: Send {
    /// A log line's bytes.
    fn log(&mut self, bytes: &[u8]);
    /// Phase `index` (from 0) of `total` is running.
    fn phase(&mut self, index: usize, total: usize, name: &str);
}

static FORWARD: Mutex<Option<Box<dyn Forward>>> = Mutex::new(None);

fn forward() -> std::sync::MutexGuard<'static, Option<Box<dyn Forward>>> {
    FORWARD.lock().unwrap_or_else(|e| e.into_inner())
}

/// Send every log line and phase to `to` (a build server's client) until `forward_to(None)`;
/// meanwhile this process draws no progress line.
pub fn forward_to(to: Option<Box<dyn Forward>>) {
    *forward() = to;
}

fn line() -> std::sync::MutexGuard<'static, String> {
    LINE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Progress through the phases of one build; clears its line when dropped.
pub struct Progress {
    enabled: bool,
    total: usize,
    start: Instant,
}

impl Progress {
    pub fn start(total: usize) -> Progress {
        Progress { enabled: std::io::stderr().is_terminal() && forward().is_none(), total, start: Instant::now() }
    }

    /// Show that phase `index` (from 0) is running.
    pub fn phase(&self, index: usize, name: &str) {
        if !self.enabled {
            if let Some(to) = forward().as_mut() {
                to.phase(index, self.total, name);
            }
            return;
        }
        let text = format!("[{}/{}] {name} ({:.1} s)", index + 1, self.total, self.start.elapsed().as_secs_f64());
        let mut current = line();
        let _ = write!(std::io::stderr(), "\r\x1b[2K{text}");
        *current = text;
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if self.enabled {
            let mut current = line();
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
            current.clear();
        }
    }
}

/// Standard error for log lines: clears and redraws the progress line around each write.
pub struct Writer;

impl Write for Writer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(to) = forward().as_mut() {
            to.log(buf);
            return Ok(buf.len());
        }
        let current = line();
        let mut err = std::io::stderr().lock();
        if !current.is_empty() {
            err.write_all(b"\r\x1b[2K")?;
        }
        err.write_all(buf)?;
        if !current.is_empty() && buf.ends_with(b"\n") {
            err.write_all(current.as_bytes())?;
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

//! Log set-up: `tracing` to standard error, filtered by `IPUQ_LOG` (else `RUST_LOG`, else info).
//! Result lines go to standard output, so logs and results can be separated; log lines
//! share standard error with the progress line (`progress.rs`). `IPUQ_LOG_SPANS=1` adds a line
//! when each span closes, with its busy and idle time (the timing spans used to profile runs).

use std::sync::OnceLock;

use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::EnvFilter;

/// Replaces the log filter of the subscriber `init` installed.
type Reload = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

static RELOAD: OnceLock<Reload> = OnceLock::new();

/// The filter this process's environment asks for.
pub fn filter() -> String {
    std::env::var("IPUQ_LOG").or_else(|_| std::env::var("RUST_LOG")).unwrap_or_else(|_| "info,salsa=warn".into())
}

pub fn init() {
    let spans = if std::env::var_os("IPUQ_LOG_SPANS").is_some_and(|v| v == "1") { FmtSpan::CLOSE } else { FmtSpan::NONE };
    let builder = tracing_subscriber::fmt()
        .with_span_events(spans)
        .with_env_filter(EnvFilter::new(filter()))
        .with_writer(|| crate::progress::Writer)
        .with_ansi(false)
        .with_target(false)
        .with_filter_reloading();
    let handle = builder.reload_handle();
    if builder.try_init().is_ok() {
        let _ = RELOAD.set(Box::new(move |filter| handle.reload(EnvFilter::new(filter)).map_err(|e| e.to_string())));
    }
}

/// Filter log lines by `filter` from now on (a build server takes each client's filter for
/// its build). False where `init` installed no subscriber (tests).
pub fn set_filter(filter: &str) -> bool {
    RELOAD.get().is_some_and(|reload| reload(filter).is_ok())
}

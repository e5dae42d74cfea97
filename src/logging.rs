//! Log set-up: `tracing` to standard error, filtered by `IPUQ_LOG` (else `RUST_LOG`, else info).
//! Result lines go to standard output, so logs and results can be separated; log lines
//! share standard error with the progress line (`progress.rs`). `IPUQ_LOG_SPANS=1` adds a line
//! when each span closes, with its busy and idle time (the timing spans used to profile runs).

use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::EnvFilter;

pub fn init() {
    let filter = std::env::var("IPUQ_LOG").or_else(|_| std::env::var("RUST_LOG")).unwrap_or_else(|_| "info,salsa=warn".into());
    let spans = if std::env::var_os("IPUQ_LOG_SPANS").is_some_and(|v| v == "1") { FmtSpan::CLOSE } else { FmtSpan::NONE };
    let _ = tracing_subscriber::fmt().with_span_events(spans).with_env_filter(EnvFilter::new(filter)).with_writer(|| crate::progress::Writer).with_ansi(false).with_target(false).try_init();
}

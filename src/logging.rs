//! Log set-up: `tracing` to standard error, filtered by `IPUQ_LOG` (else `RUST_LOG`, else info).
//! Result lines go to standard output, so logs and results can be separated; log lines
//! share standard error with the progress line (`progress.rs`).

use tracing_subscriber::EnvFilter;

pub fn init() {
    let filter = std::env::var("IPUQ_LOG").or_else(|_| std::env::var("RUST_LOG")).unwrap_or_else(|_| "info,salsa=warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(EnvFilter::new(filter)).with_writer(|| crate::progress::Writer).with_ansi(false).with_target(false).try_init();
}

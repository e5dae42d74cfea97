//! The `ipuq` binary: logging set-up, then the command line in `ipuq::cli`.

fn main() -> std::process::ExitCode {
    ipuq::logging::init();
    ipuq::cli::main()
}

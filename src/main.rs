//! The `ipuq` binary: allocator and logging set-up, then the command line in `ipuq::cli`.

fn main() -> std::process::ExitCode {
    ipuq::alloc::tune();
    ipuq::logging::init();
    ipuq::cli::main()
}

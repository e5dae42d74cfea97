//! The `ipuq` binary: allocator and logging set-up, then the command line in `ipuq::cli`.

fn main() -> std::process::ExitCode {
    // First: in `ipuq watch` and `ipuq serve` this executes the program again, with malloc on
    // huge pages.
    ipuq::alloc::huge_pages();
    ipuq::alloc::tune();
    ipuq::logging::init();
    ipuq::cli::main()
}

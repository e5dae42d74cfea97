//! Allocator settings for the compiler's working pattern.
//!
//! A build allocates and frees many large vectors (an exchange phase's requests and tables
//! are megabytes each, made again by every stage that reads them). glibc's malloc serves
//! blocks above its mmap threshold with fresh mappings and returns freed memory above its
//! trim threshold to the kernel, so every such vector was faulted in and zeroed by the kernel
//! anew: a quarter of the samples of the four-block MLP's `ipuq watch` edit (last GELU made a
//! scale) were the kernel clearing pages. Raising both thresholds keeps freed memory in the
//! process for the next vector. Memory that a build frees stays mapped (the process's
//! resident size does not shrink). Measured in session 47 (release, 2 cores, medians): that
//! watch edit 1.12 s against 1.20 s, later edits of the same process 0.82 s against 0.90 s,
//! cold builds and simulator runs within noise, peak resident size a few per cent higher.
//!
//! Transparent huge pages for malloc's heap (glibc's tunable `glibc.malloc.hugetlb=1`) are asked
//! for only by the long-lived commands, `ipuq watch` and `ipuq serve` (`huge_pages`). From
//! session 48 to session 63 every command executed itself once at start with that tunable set
//! (session 48 measured 5–20 % faster); session 64 measured it on this machine (a Firecracker
//! guest, Linux 6.18; release, 2 cores, alternating, medians) and it made one-shot commands
//! slower, the more so the more memory they touch: ten full-size encoder layers built in
//! 47.0–50.8 s with it (five runs) against 40.3–46.1 s without (seven; system time 16–20 s
//! against 7–15 s, though both fault in about 6.7 GB; the gap was 7–20 % in each pair, as the
//! machine's page faults grew dearer and cheaper), four layers in 10.4 s against 9.2 s, the run
//! of four layers' package 24.4 s against 22.0 s, the seed MLP's run 2.7 s against 2.3 s (three
//! each). A long-lived process faults its memory in once and reuses it through many builds:
//! there the four-block MLP's edit through `ipuq serve` took 0.70–0.73 s with them (four sets of
//! three) against 0.71–0.83 s without (four sets), and under `ipuq watch` 0.69–0.93 s against
//! 0.70–0.78 s (noise either way). A user's own `glibc.malloc.hugetlb` is kept:
//! `GLIBC_TUNABLES=glibc.malloc.hugetlb=1 ipuq build ...` asks for them in a one-shot command,
//! `=0` turns them off in the long-lived ones.

/// Raise glibc malloc's mmap and trim thresholds (see the module note). Elsewhere, nothing.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // glibc's `mallopt` parameters (malloc.h): M_TRIM_THRESHOLD and M_MMAP_THRESHOLD.
        const M_TRIM_THRESHOLD: std::os::raw::c_int = -1;
        const M_MMAP_THRESHOLD: std::os::raw::c_int = -3;
        // The largest mmap threshold glibc accepts on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX).
        const MMAP_THRESHOLD: std::os::raw::c_int = 32 * 1024 * 1024;
        const TRIM_THRESHOLD: std::os::raw::c_int = 1 << 30;
        extern "C" {
            fn mallopt(param: std::os::raw::c_int, value: std::os::raw::c_int) -> std::os::raw::c_int;
        }
        // SAFETY: mallopt only changes malloc's tuning parameters; it is called before any
        // other thread exists (at the start of main), as glibc asks.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD);
            mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD);
        }
    }
}

/// The glibc tunable that has malloc back the memory it takes from the kernel with transparent
/// huge pages (`madvise(MADV_HUGEPAGE)`; glibc 2.35 and later, ignored by older ones).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const HUGE_PAGES: &str = "glibc.malloc.hugetlb=1";

/// In a long-lived command (`cli::long_lived`), execute this program again (the same process,
/// arguments and environment) with glibc's malloc backing its heap with transparent huge pages.
/// glibc reads its tunables only at start, so the process executes itself once, first thing in
/// `main`, with `GLIBC_TUNABLES` extended. Session 48 measured `ipuq watch` on the four-block MLP
/// (a cold build, the last GELU made a scale, then two factor changes; six processes each, the
/// tunable set against unset): first edit 0.76 s against 0.96 s, later edits 0.69 s against
/// 0.76 s; four encoder layers' first watch edit 1.76–1.78 s against 1.96–1.98 s.
///
/// Nothing happens in other commands, where the environment already names
/// `glibc.malloc.hugetlb` (the user's choice), where this process is the one executed again
/// (`REEXECUTED` in its environment, so that a glibc that drops the tunable, as it may for a
/// set-user-ID program, cannot make it execute itself without end), where `GLIBC_TUNABLES` is
/// not UTF-8, off glibc on Linux, or where the program cannot be executed again (it then goes
/// on as it is, silently: nothing is wrong with the build).
pub fn huge_pages() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;
        if std::env::var_os(REEXECUTED).is_some() {
            return;
        }
        let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
        if !crate::cli::long_lived(&args) {
            return;
        }
        let tunables = match std::env::var_os("GLIBC_TUNABLES") {
            None => String::new(),
            Some(t) => match t.into_string() {
                Ok(t) if !t.contains("glibc.malloc.hugetlb") => t,
                _ => return,
            },
        };
        let Some((program, rest)) = args.split_first() else { return };
        let value = if tunables.is_empty() { HUGE_PAGES.to_string() } else { format!("{tunables}:{HUGE_PAGES}") };
        // `exec` returns only when it fails; the process then goes on as it is.
        let _ = std::process::Command::new("/proc/self/exe").arg0(program).args(rest).env("GLIBC_TUNABLES", value).env(REEXECUTED, "1").exec();
    }
}

/// Set in the environment of the process `huge_pages` executes (and so of its children).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const REEXECUTED: &str = "IPUQ_HUGE_PAGES_EXECUTED";

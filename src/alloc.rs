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
//! Since session 48 the program also executes itself once at start with glibc's malloc asked
//! for transparent huge pages (`huge_pages`), so that fresh memory is faulted in 2 MiB at a time.

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

/// Execute this program again (the same process, arguments and environment) with glibc's
/// malloc backing its heap with transparent huge pages. glibc reads its tunables only at start,
/// so the process executes itself once, first thing in `main`, with `GLIBC_TUNABLES` extended.
/// A build touches far more memory than it keeps (the four-block MLP's `ipuq watch` edit makes
/// its program, tables and placements while the previous build's are still kept, and grows the
/// process by about 240 MB; a four-layer build faults in 1.6 GB); where transparent huge pages
/// are granted on request (`madvise`, the usual setting, and this machine's), that memory is
/// faulted in 2 MiB at a time instead of 4 KiB. Measured in session 48 (release, 2 cores,
/// medians, alternating with the tunable unset): `ipuq watch` on the four-block MLP (a cold
/// build, the last GELU made a scale, then two factor changes; six processes each), first edit
/// 0.76 s against 0.96 s, later edits 0.69 s against 0.76 s; four encoder layers' first watch
/// edit 1.76–1.78 s against 1.96–1.98 s (two each); cold `ipuq build` (four each) of four
/// encoder layers 6.30 s against 6.60 s, one layer 2.54 s against 2.58 s, four MLP blocks
/// 3.0 s both, with 30–50 % fewer page faults; `ipuq run` of built packages (three each) four
/// layers 11.8 s against 12.7 s, the seed MLP 1.63 s against 1.74 s; peak resident size the
/// same within 3 %.
///
/// Nothing happens where the environment already names `glibc.malloc.hugetlb` (the user's
/// choice: `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` turns this off), where this process is the
/// one executed again (`REEXECUTED` in its environment, so that a glibc that drops the tunable,
/// as it may for a set-user-ID program, cannot make it execute itself without end), where
/// `GLIBC_TUNABLES` is not UTF-8, off glibc on Linux, or where the program cannot be executed
/// again (it then goes on as it is, silently: nothing is wrong with the build).
pub fn huge_pages() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;
        if std::env::var_os(REEXECUTED).is_some() {
            return;
        }
        let tunables = match std::env::var_os("GLIBC_TUNABLES") {
            None => String::new(),
            Some(t) => match t.into_string() {
                Ok(t) if !t.contains("glibc.malloc.hugetlb") => t,
                _ => return,
            },
        };
        let mut args = std::env::args_os();
        let Some(program) = args.next() else { return };
        let value = if tunables.is_empty() { HUGE_PAGES.to_string() } else { format!("{tunables}:{HUGE_PAGES}") };
        // `exec` returns only when it fails; the process then goes on as it is.
        let _ = std::process::Command::new("/proc/self/exe").arg0(program).args(args).env("GLIBC_TUNABLES", value).env(REEXECUTED, "1").exec();
    }
}

/// Set in the environment of the process `huge_pages` executes (and so of its children).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const REEXECUTED: &str = "IPUQ_HUGE_PAGES_EXECUTED";

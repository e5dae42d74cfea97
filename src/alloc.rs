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
//! Transparent huge pages for malloc's heap (glibc's tunable `glibc.malloc.hugetlb=1`) are not
//! asked for. From session 48 to session 63 the program executed itself once at start with that
//! tunable set; session 64 measured it on this machine (a Firecracker guest, Linux 6.18; release,
//! 2 cores, alternating, medians) and it made one-shot commands slower, the more so the more memory
//! they touch: ten full-size encoder layers built in 47.0–50.8 s with it (five runs) against
//! 40.3–46.1 s without (seven; system time 16–20 s against 7–15 s, though both fault in about
//! 6.7 GB; the gap was 7–20 % in each pair, as the machine's page faults grew dearer and cheaper),
//! four layers in 10.4 s against 9.2 s, the run of four layers' package 24.4 s against 22.0 s, the
//! seed MLP's run 2.7 s against 2.3 s (three each); the four-block MLP's edits under `ipuq watch` and
//! `ipuq serve` moved within noise (0.69–0.87 s either way). Session 48 had measured the
//! opposite (5–20 % faster) on the same kind of machine in another state. A user who
//! wants them sets the tunable: `GLIBC_TUNABLES=glibc.malloc.hugetlb=1 ipuq ...`.

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

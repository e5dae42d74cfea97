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

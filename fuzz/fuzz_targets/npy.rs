//! `.npy` files (`init = { npy = … }`, `--input NAME=FILE.npy`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ipuq::workload::npy::parse_npy(data, "fuzz.npy");
});

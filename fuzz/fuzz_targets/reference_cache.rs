//! The host-reference cache beside a package (`reference.bin`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ipuq::reference_cache::decode(&[7; 32], data);
});

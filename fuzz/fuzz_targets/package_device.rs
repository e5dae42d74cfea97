//! Decoded packages on the device: edits to a valid package's payload (under a recomputed
//! checksum; the first byte picks the MLP, attention or encoder-layer fixture) that still
//! decode are loaded and run on the simulator (load-time checks, exchange rules, kernels, host
//! tables). No package may panic or hang the device.
#![no_main]

use ipuq_queries::package::Package;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&which, edits)) = data.split_first() else { return };
    let base = ipuq_fuzz::base_for(which);
    let bytes = ipuq_fuzz::with_header(&ipuq_fuzz::mutated_payload(&base.payload, edits), &base.digest);
    if let Ok(p) = Package::from_bytes(&bytes, "fuzz.ipuexe") {
        let _ = ipuq::runtime::execute(&p, &base.inputs, &ipuq::runtime::RunOptions::default());
    }
});

//! Package files: header, length, checksum and rkyv validation, then `ipuq inspect`'s
//! description. An even first byte hands the rest to the reader as a whole file; an odd one
//! applies the rest as edits to a valid package's payload (the MLP, attention or encoder-layer
//! fixture, by the first byte's other bits) under a recomputed checksum, so the
//! inputs reach rkyv's validation and the decoded structure.
#![no_main]

use ipuq_queries::package::Package;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let bytes = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        let base = ipuq_fuzz::base_for(mode >> 1);
        ipuq_fuzz::with_header(&ipuq_fuzz::mutated_payload(&base.payload, rest), &base.digest)
    };
    if let Ok(p) = Package::from_bytes(&bytes, "fuzz.ipuexe") {
        let _ = ipuq::inspect::describe(&p);
    }
});

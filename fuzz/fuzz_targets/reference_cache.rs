//! The host-reference cache beside a package (`reference.bin`). Even first byte: the rest is
//! the file as read. Odd first byte: the rest is a payload framed under a valid header and
//! checksum, so the fuzzer reaches the payload's parser behind the blake3 check.
#![no_main]

const KEY: [u8; 32] = [7; 32];

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else { return };
    if first & 1 == 0 {
        let _ = ipuq::reference_cache::decode(&KEY, rest);
        return;
    }
    // The header `encode` writes for an empty payload: magic, key, blake3, length.
    let empty = ipuq::reference_cache::encode(&KEY, &Default::default());
    let mut file = empty[..40].to_vec();
    file.extend_from_slice(blake3::hash(rest).as_bytes());
    file.extend_from_slice(&(rest.len() as u64).to_le_bytes());
    file.extend_from_slice(rest);
    let _ = ipuq::reference_cache::decode(&KEY, &file);
});

//! Hugging Face checkpoint metadata (`ipuq import`): `config.json` (odd first byte) and a
//! sharded checkpoint's `model.safetensors.index.json` (even first byte). No file may panic.
#![no_main]

use std::path::Path;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else { return };
    if first & 1 == 1 {
        let _ = ipuq::import::config::parse_config(rest, "fuzz/config.json");
    } else {
        let _ = ipuq::import::checkpoint::parse_index(rest, "fuzz/model.safetensors.index.json", Path::new("fuzz"));
    }
});

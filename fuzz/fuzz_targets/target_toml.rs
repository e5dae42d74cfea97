//! Target descriptions (`--target FILE`, `--device-target FILE`, the package's embedded text).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(t) = ipuq_queries::target::Target::from_toml(&text, "fuzz.toml") {
        let _ = (t.delay_range(), t.delay(0, t.chip.tiles.saturating_sub(1)), t.digest(), t.peak_tflops());
        let _ = ipuq_queries::provenance::Provenance::from_target_text(&text);
    }
});

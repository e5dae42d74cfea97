//! Workload files: any bytes give a graph or a clear error, never a panic or a hang.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(graph) = ipuq_queries::ir::Graph::parse(&text, "fuzz.toml") {
        // What the runtime does next with a valid workload: its canonical text parses again.
        let _ = ipuq_queries::ir::Graph::parse(&graph.canonical_toml(), "canonical.toml");
    }
});

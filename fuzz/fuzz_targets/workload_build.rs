//! Workload files that parse, compiled for small16 and run on the simulator: any graph the
//! parser accepts must build or fail with a clear error, and a package it builds must run or
//! be refused, never panic or hang. Graphs are kept small (at most 40 operations, 2^16
//! elements a value, 2^18 in all) so that each input takes milliseconds.
#![no_main]

use ipuq_queries::ir::Graph;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let Ok(graph) = Graph::parse(&text, "fuzz.toml") else { return };
    let total: u64 = graph.values.iter().map(|v| v.elements()).fold(0, u64::saturating_add);
    if graph.operations.len() > 40 || graph.values.iter().any(|v| v.elements() > 1 << 16) || total > 1 << 18 {
        return;
    }
    let dir = tempfile::tempdir().expect("temporary directory");
    let workload = dir.path().join("fuzz.toml");
    std::fs::write(&workload, text.as_bytes()).expect("workload written");
    let Ok(built) = ipuq::build::build(&workload, &ipuq_fuzz::small16_options(&dir.path().join("out"))) else { return };
    let package = ipuq::build::read_package(&built.path).expect("a package the build wrote reads back");
    let Ok(data) = ipuq::workload::tensor_data(&graph, dir.path()) else { return };
    let inputs = data.into_iter().map(|(name, d)| (name, d.bytes)).collect();
    let _ = ipuq::runtime::execute(&package, &inputs, &ipuq::runtime::RunOptions::default());
});

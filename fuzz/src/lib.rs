//! Shared pieces of the fuzz targets: the build options for small16, valid small packages (the
//! small MLP, attention and encoder-layer fixtures) built once per process, their run inputs,
//! and structured mutation of a payload so that the fuzzer starts from bytes that pass the
//! checksum and rkyv's validation.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use ipuq_queries::package::*;

/// The base package's rkyv payload, its target digest and the input bytes a run needs.
pub struct Base {
    pub payload: Vec<u8>,
    pub digest: [u8; 32],
    pub inputs: BTreeMap<String, Vec<u8>>,
}

/// The fixtures the package targets start from, all built for small16: the small MLP (matrix
/// products, GELU), the small grouped attention (softmax with deferred normalisation, its
/// reciprocal epilogue) and one small encoder layer (LayerNorm split into row segments, bias
/// epilogues, residual adds, grouped Q/K/V products, word copies).
const BASE_FIXTURES: [&str; 3] = [
    "siglip-mlp-f16-b1-t37-d64-h96-n1.toml",
    "attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8.toml",
    "siglip-encoder-f16-b1-t5-d256-h4-m96-l1.toml",
];

/// The base that `selector` picks (modulo the number of fixtures).
pub fn base_for(selector: u8) -> &'static Base {
    let all = bases();
    &all[selector as usize % all.len()]
}

/// Every fixture of `BASE_FIXTURES` built for small16, once per process (a few hundred
/// milliseconds).
pub fn bases() -> &'static [Base] {
    static BASES: OnceLock<Vec<Base>> = OnceLock::new();
    BASES.get_or_init(|| BASE_FIXTURES.iter().map(|name| build_base(name)).collect())
}

/// A plain build for small16 into `out_dir`: no cache, the default finalists and table budget.
pub fn small16_options(out_dir: &Path) -> ipuq::build::BuildOptions {
    ipuq::build::BuildOptions {
        target: Some("small16".into()),
        out_dir: out_dir.to_path_buf(),
        incremental: false,
        cache_dir: None,
        cache_read_only: false,
        cache_max_bytes: None,
        plan_finalists: ipuq_queries::lower::search::DEFAULT_FINALISTS,
        table_budget: None,
        remote: None,
    }
}

fn build_base(name: &str) -> Base {
    let dir = tempfile::tempdir().expect("temporary directory");
    let workload = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/workloads").join(name);
    let built = ipuq::build::build(&workload, &small16_options(dir.path())).expect("the fixture builds");
    let package = ipuq::build::read_package(&built.path).expect("the fixture's package reads");
    let graph = ipuq_queries::ir::Graph::parse(&package.workload_toml, "embedded").expect("embedded workload");
    let data = ipuq::workload::tensor_data(&graph, dir.path()).expect("input data");
    let bytes = package.to_bytes();
    Base { payload: bytes[HEADER_BYTES..].to_vec(), digest: package.target_digest.0, inputs: data.into_iter().map(|(n, d)| (n, d.bytes)).collect() }
}

/// The header `Package::to_bytes` writes, over `payload`.
pub fn with_header(payload: &[u8], digest: &[u8; 32]) -> Vec<u8> {
    ipuq_queries::package::Package::frame(payload, digest)
}

/// The base payload with `edits` applied: each 5 bytes are (little-endian u32 offset, byte),
/// the byte XORed in at the offset modulo the payload length; a trailing 1-4 bytes truncate
/// the payload to that many bytes fewer times 7.
pub fn mutated_payload(base: &[u8], edits: &[u8]) -> Vec<u8> {
    let mut out = base.to_vec();
    let chunks = edits.chunks_exact(5);
    let rest = chunks.remainder();
    for c in chunks {
        let at = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize % out.len().max(1);
        if let Some(b) = out.get_mut(at) {
            *b ^= c[4];
        }
    }
    if !rest.is_empty() {
        let cut = rest.iter().map(|&b| b as usize).sum::<usize>() * 7;
        out.truncate(out.len().saturating_sub(cut));
    }
    out
}

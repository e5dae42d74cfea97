//! proptest properties of the readers of outside bytes: any input gives `Ok` or a clear
//! `Err`, never a panic, and valid inputs round-trip. Few cases by default so the suite stays
//! fast (`PROPTEST_CASES=N` runs more); the cargo-fuzz targets in `fuzz/` run the long
//! campaigns. Shrunk failures are kept by proptest under `tests/proptest_readers.proptest-regressions`.

use std::io::Cursor;
use std::path::Path;

use ipuq::workload::npy::{encode_npy, parse_npy};
use ipuq::workload::safetensors::Header;
use ipuq_queries::ir::{DType, Graph};
use ipuq_queries::package::Package;
use ipuq_queries::target::{fixtures, Target};
use proptest::prelude::*;

const MLP: &str = include_str!("../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");

fn config() -> ProptestConfig {
    // ProptestConfig::default() reads PROPTEST_CASES; without it, 48 cases keep the suite fast.
    let defaults = ProptestConfig::default();
    let cases = if std::env::var_os("PROPTEST_CASES").is_some() { defaults.cases } else { 48 };
    ProptestConfig { cases, failure_persistence: None, ..defaults }
}

/// A valid text with one span replaced by arbitrary text.
fn spliced(base: &'static str) -> impl Strategy<Value = String> {
    (0..base.len(), 0..40usize, ".{0,24}").prop_map(move |(at, len, insert)| {
        let bytes = base.as_bytes();
        let end = (at + len).min(bytes.len());
        let mut out = bytes[..at].to_vec();
        out.extend_from_slice(insert.as_bytes());
        out.extend_from_slice(&bytes[end..]);
        String::from_utf8_lossy(&out).into_owned()
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn workload_text_never_panics(text in spliced(MLP)) {
        if let Ok(g) = Graph::parse(&text, "prop.toml") {
            // A valid workload's canonical text is valid and canonical again.
            let again = Graph::parse(&g.canonical_toml(), "canonical.toml").expect("canonical text parses");
            prop_assert_eq!(again.canonical_toml(), g.canonical_toml());
        }
    }

    #[test]
    fn target_text_never_panics(text in spliced(fixtures::SMALL16)) {
        if let Ok(t) = Target::from_toml(&text, "prop.toml") {
            let _ = (t.delay_range(), t.digest());
        }
    }

    #[test]
    fn npy_round_trips_and_arbitrary_bytes_never_panic(
        shape in proptest::collection::vec(1u64..6, 1..4),
        seed in any::<u32>(),
        junk in proptest::collection::vec(any::<u8>(), 0..200),
        cut in any::<prop::sample::Index>(),
    ) {
        let elements: u64 = shape.iter().product();
        let values: Vec<f32> = (0..elements).map(|i| ((i as u32 ^ seed) % 64) as f32 * 0.25).collect();
        let bytes = encode_npy(DType::F16, &shape, &values, "prop").expect("encode");
        let array = parse_npy(&bytes, "prop.npy").expect("a written file reads back");
        prop_assert_eq!(array.values, values);
        let _ = parse_npy(&bytes[..cut.index(bytes.len())], "cut.npy");
        let mut spliced = bytes[..10.min(bytes.len())].to_vec();
        spliced.extend_from_slice(&junk);
        let _ = parse_npy(&spliced, "junk.npy");
        let _ = parse_npy(&junk, "junk.npy");
    }

    #[test]
    fn reference_cache_round_trips_and_damage_is_a_miss(
        names in proptest::collection::btree_map("[a-z_]{1,8}", proptest::collection::vec(-4.0f32..4.0, 0..20), 0..4),
        flip in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let key = [9u8; 32];
        let bytes = ipuq::reference_cache::encode(&key, &names);
        prop_assert_eq!(ipuq::reference_cache::decode(&key, &bytes), Some(names));
        let mut damaged = bytes.clone();
        let i = flip.index(damaged.len());
        damaged[i] ^= 1 << bit;
        prop_assert_eq!(ipuq::reference_cache::decode(&key, &damaged), None);
    }

    #[test]
    fn package_reader_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400), magic in any::<bool>()) {
        let mut file = bytes;
        if magic {
            file.splice(0..0, ipuq_queries::package::PACKAGE_MAGIC);
        }
        prop_assert!(Package::from_bytes(&file, "prop.ipuexe").is_err());
    }
    #[test]
    fn safetensors_round_trips_and_damaged_files_never_panic(
        tensors in proptest::collection::btree_map("[a-z.]{1,10}", (0usize..3, proptest::collection::vec(1usize..5, 0..3)), 1..4),
        flip in any::<prop::sample::Index>(),
        byte in any::<u8>(),
        cut in any::<prop::sample::Index>(),
    ) {
        use safetensors::tensor::{Dtype, TensorView};
        let dtypes = [Dtype::F32, Dtype::F16, Dtype::BF16];
        let data: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|(name, (d, shape))| {
                let dtype = dtypes[*d];
                let bytes = shape.iter().product::<usize>() * dtype.bitsize() / 8;
                (name.clone(), dtype, shape.clone(), (0..bytes).map(|i| (i as u8).wrapping_mul(37)).collect())
            })
            .collect();
        let views: Vec<(String, TensorView<'_>)> =
            data.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).expect("view"))).collect();
        let file = safetensors::tensor::serialize(views, None).expect("serialize");
        let path = Path::new("prop.safetensors");
        let header = Header::parse(&mut Cursor::new(&file), file.len() as u64, path).expect("a written file reads back");
        for (name, _, shape, bytes) in &data {
            let tensor = header.read_from(&mut Cursor::new(&file), name).expect("a written tensor reads back");
            prop_assert_eq!(&tensor.bytes, bytes);
            prop_assert_eq!(tensor.shape, shape.iter().map(|&d| d as u64).collect::<Vec<_>>());
        }
        // A flipped byte or a truncation reads or fails cleanly, never panics.
        let mut damaged = file.clone();
        let i = flip.index(damaged.len());
        damaged[i] ^= byte;
        for bytes in [damaged.as_slice(), &file[..cut.index(file.len())]] {
            if let Ok(h) = Header::parse(&mut Cursor::new(bytes), bytes.len() as u64, path) {
                for name in h.names() {
                    if let Ok(t) = h.read_from(&mut Cursor::new(bytes), &name) {
                        let _ = t.values();
                    }
                }
            }
        }
    }

    #[test]
    fn checkpoint_metadata_never_panics(text in ".{0,200}", config in spliced(r#"{"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "hidden_act": "gelu", "layer_norm_eps": 1e-12}"#)) {
        let _ = ipuq::import::config::parse_config(text.as_bytes(), "prop/config.json");
        let _ = ipuq::import::config::parse_config(config.as_bytes(), "prop/config.json");
        let _ = ipuq::import::checkpoint::parse_index(text.as_bytes(), "prop/index.json", Path::new("prop"));
    }
}

//! Shapes of the three workload families drawn at random (seeded, so a failure names its
//! case and reproduces), each generated with `ipuq workload`, built for small16 and run on the
//! simulator: every one must build, run and pass against the host reference. Odd widths,
//! one-row or one-column operands, heads one element wide, batches and repeated blocks or
//! layers are where lowering's edge cases live; the seed workloads never reach them.
//!
//! Ranges: the MLP 1-90 tokens, 1-160 wide, hidden 1-200, batch 1-3, 1-3 blocks, biases or
//! not; attention 1-70 tokens, 1-4 key/value heads and 1-4 query heads each, heads 1-40 wide,
//! batch 1-2; the encoder 1-40 tokens, 1-6 heads 2-24 elements wide and the layer at least 8
//! wide, MLP 1-160 wide, one or two layers, batch 1-2. A release sweep of 600 cases over these
//! ranges (a script, other seeds, heads from one element wide) passed but for one encoder two
//! elements wide: a LayerNorm over two elements whose values are a rounding apart is
//! ill-conditioned (one rounding of its input moves its output by half a unit), so the device
//! and the f64 reference rightly disagree there; hence the 8.

mod common;

use common::{field, ipuq, tail, Rng};

/// The `ipuq workload` arguments of one case of `family`.
fn case(family: &str, rng: &mut Rng) -> Vec<String> {
    let mut args: Vec<String> = match family {
        "siglip-mlp" => {
            let mut a = vec![
                format!("--tokens={}", rng.range(1, 90)),
                format!("--dim={}", rng.range(1, 160)),
                format!("--hidden={}", rng.range(1, 200)),
                format!("--batch={}", rng.range(1, 3)),
                format!("--blocks={}", rng.range(1, 3)),
            ];
            if rng.range(0, 2) == 0 {
                a.push("--biases".into());
            }
            a
        }
        "attention" => {
            let kv = rng.range(1, 4);
            vec![
                format!("--tokens={}", rng.range(1, 70)),
                format!("--heads={}", kv * rng.range(1, 4)),
                format!("--kv-heads={kv}"),
                format!("--head-dim={}", rng.range(1, 40)),
                format!("--batch={}", rng.range(1, 2)),
            ]
        }
        _ => {
            let heads = rng.range(1, 6);
            let width = rng.range(2, 24).max(8u64.div_ceil(heads));
            vec![
                format!("--tokens={}", rng.range(1, 40)),
                format!("--dim={}", heads * width),
                format!("--heads={heads}"),
                format!("--hidden={}", rng.range(1, 160)),
                format!("--layers={}", rng.range(1, 2)),
                format!("--batch={}", rng.range(1, 2)),
            ]
        }
    };
    args.insert(0, family.to_string());
    args
}

/// `cases` shapes of `family` from `seed`, each generated, built for small16 and run.
fn sweep(family: &str, seed: u64, cases: usize) {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(seed);
    for i in 0..cases {
        let mut args = case(family, &mut rng);
        let workload = dir.path().join(format!("case{i}.toml"));
        let generate: Vec<String> = std::iter::once("workload".to_string()).chain(args.drain(..)).chain(["-o".into(), workload.display().to_string()]).collect();
        let generate: Vec<&str> = generate.iter().map(String::as_str).collect();
        let shape = generate[1..generate.len() - 2].join(" ");
        eprintln!("case {i}: {shape}");
        let made = ipuq(&generate, dir.path());
        assert_eq!(made.code, 0, "case {i} of {family} (seed {seed}): `ipuq {}` failed: {}", generate.join(" "), made.stderr);
        let out_dir = dir.path().join(format!("out{i}"));
        let run = ipuq(&["run", &workload.display().to_string(), "--target", "small16", "-j1", "-o", &out_dir.display().to_string()], dir.path());
        assert_eq!(run.code, 0, "case {i} ({shape}, seed {seed}) failed:\nstdout:\n{}\nstderr:\n{}", run.stdout, tail(&run.stderr));
        assert_eq!(field(&run.stdout, "workload=", "numericalTest").as_deref(), Some("PASS"), "case {i} ({shape}, seed {seed}):\n{}", run.stdout);
        assert_eq!(field(&run.stdout, "package=", "simulatorTest").as_deref(), Some("PASS"), "case {i} ({shape}, seed {seed}):\n{}", run.stdout);
        // The package is the largest file the case writes; the next case needs none of it.
        let _ = std::fs::remove_dir_all(&out_dir);
    }
}

#[test]
fn random_mlp_shapes_build_run_and_pass() {
    sweep("siglip-mlp", 0x5EED_0001, 40);
}

#[test]
fn random_attention_shapes_build_run_and_pass() {
    sweep("attention", 0x5EED_0002, 40);
}

#[test]
fn random_encoder_shapes_build_run_and_pass() {
    sweep("siglip-encoder", 0x5EED_0003, 40);
}

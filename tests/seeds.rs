//! The two seed workloads at full size on the 1472-tile ipu21 target: build, run on the
//! simulator, verify, and check that builds are byte-identical across thread counts.

mod common;

use std::process::Command;

use common::{assert_pass, field, fixture, ipuq};

const MLP: &str = "workloads/siglip-mlp-f16-b1-t729-d1152-h4304-n1.toml";
const ATTENTION: &str = "workloads/attention-grouped-materialized-gaussian-f16-b1-t729-h16-kv4-d72.toml";

#[test]
fn the_seed_mlp_passes_on_1472_simulated_tiles() {
    let dir = tempfile::tempdir().unwrap();
    let out = ipuq(&["run", &fixture(MLP), "-o", "out", "--checkpoints"], dir.path());
    assert_pass(&out);
    assert_eq!(field(&out.stdout, "workload=", "workload").as_deref(), Some("siglip-mlp-f16-b1-t729-d1152-h4304-n1"));
    assert_eq!(field(&out.stdout, "workload=", "executionTiles").as_deref(), Some("1472"));
    let cycles: u64 = field(&out.stdout, "workload=", "cycles").unwrap().parse().unwrap();
    // The compute-bound limit on 1472 tiles is 76,730 cycles: nothing can beat it.
    assert!(cycles > 76_730, "cycles={cycles}");
    assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"));

    // The profile: a summary, and a Chrome trace with one track per tile group and one slice
    // per superstep on each.
    let profile = field(&out.stdout, "profile=", "profile").unwrap();
    let summary = ipuq(&["profile", &profile, "--chrome-trace", "trace.json"], dir.path());
    assert_eq!(summary.code, 0, "{}", summary.stderr);
    assert!(summary.stdout.contains("slowest supersteps") && summary.stdout.contains("exchange share"), "{}", summary.stdout);
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.path().join("trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let slices: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    let mut per_track = std::collections::BTreeMap::new();
    for e in &slices {
        *per_track.entry(e["tid"].as_u64().unwrap()).or_insert(0) += 1;
        assert!(e["ts"].as_f64().is_some() && e["dur"].as_f64().is_some());
    }
    let steps = events.iter().filter(|e| e["ph"] == "X" && e["tid"] == 0).count();
    assert!(per_track.len() >= 92, "{} tracks", per_track.len());
    assert!(per_track.values().all(|&n| n == steps), "every track has one slice per superstep");
}

#[test]
fn the_seed_attention_passes_and_builds_identically_on_one_and_two_threads() {
    let dir = tempfile::tempdir().unwrap();
    let out = ipuq(&["run", &fixture(ATTENTION), "-o", "out", "--checkpoints"], dir.path());
    assert_pass(&out);
    // scores and context: the 1/sqrt(d) scale is folded into the softmax, so `scaled_scores`
    // is never stored, and the softmax's normalisation is deferred to the context product, so
    // the probabilities never exist on the device: neither has a checkpoint.
    assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "diagnosticCheckpoints").as_deref(), Some("2"));
    let mut packages = Vec::new();
    for threads in ["1", "2"] {
        let status = Command::new(env!("CARGO_BIN_EXE_ipuq"))
            .args(["build", &fixture(ATTENTION), "-o", &format!("t{threads}")])
            .current_dir(dir.path())
            .env("RAYON_NUM_THREADS", threads)
            .env("IPUQ_LOG", "warn")
            .status()
            .unwrap();
        assert!(status.success());
        packages.push(std::fs::read(dir.path().join(format!("t{threads}/model.ipuexe"))).unwrap());
    }
    assert!(packages[0] == packages[1], "packages differ between 1 and 2 threads");
    assert!(packages[0] == std::fs::read(dir.path().join("out/model.ipuexe")).unwrap());
}

#[test]
fn odd_shapes_pass_on_1472_simulated_tiles() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[&[&str]] = &[
        &["siglip-mlp", "--tokens", "257", "--dim", "1000", "--hidden", "3001"],
        &["attention", "--tokens", "211", "--heads", "12", "--kv-heads", "4", "--head-dim", "33"],
        &["attention", "--tokens", "1", "--heads", "1", "--kv-heads", "1", "--head-dim", "1"],
    ];
    for (i, args) in cases.iter().enumerate() {
        let file = format!("w{i}.toml");
        let mut generate = vec!["workload"];
        generate.extend_from_slice(args);
        generate.extend_from_slice(&["-o", &file]);
        assert_eq!(ipuq(&generate, dir.path()).code, 0);
        assert_pass(&ipuq(&["run", &file, "-o", &format!("out{i}")], dir.path()));
    }
}

#[test]
fn builds_killed_at_random_points_leave_the_cache_correct() {
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let cold = ipuq(&["build", &fixture(ATTENTION), "-o", "cold"], dir.path());
    assert_eq!(cold.code, 0, "{}", cold.stderr);
    let expected = std::fs::read(dir.path().join("cold/model.ipuexe")).unwrap();
    // Deterministic "random" kill points spread over a cold build (about half a second).
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for round in 0..6 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let mut child = Command::new(env!("CARGO_BIN_EXE_ipuq"))
            .args(["build", &fixture(ATTENTION), "-o", &format!("k{round}"), "--incremental", "--cache-dir", "cache"])
            .current_dir(dir.path())
            .env("IPUQ_LOG", "warn")
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(50 + state % 600));
        let _ = child.kill();
        let _ = child.wait();
    }
    let out = ipuq(&["build", &fixture(ATTENTION), "-o", "after", "--incremental", "--cache-dir", "cache"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(std::fs::read(dir.path().join("after/model.ipuexe")).unwrap() == expected, "a build after killed builds differs from a cold build");
    let verify = ipuq(&["cache", "verify", "--cache-dir", "cache"], dir.path());
    assert_eq!(verify.code, 0, "{}", verify.stdout);
}

#[test]
fn two_runs_on_the_same_artifacts_take_turns_on_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let built = ipuq(&["build", &fixture(ATTENTION), "-o", "out"], dir.path());
    assert_eq!(built.code, 0, "{}", built.stderr);
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_ipuq"))
            .args(["run", "out/model.ipuexe"])
            .current_dir(dir.path())
            .env("IPUQ_LOG", "info")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (first, second) = (spawn(), spawn());
    let outputs = [first.wait_with_output().unwrap(), second.wait_with_output().unwrap()];
    for out in &outputs {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("simulatorTest=PASS"));
    }
    // Usually one of the two waits for the other (the deterministic version of this check, with
    // the lock held by the test itself, is in end_to_end.rs); never may both have waited.
    let waited = outputs.iter().filter(|o| String::from_utf8_lossy(&o.stderr).contains("device is owned by another run")).count();
    assert!(waited <= 1, "both runs waited for each other");
    for out in &outputs {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("waiting for hardware ownership") && stderr.contains("acquired hardware ownership"), "{stderr}");
    }
}

#[test]
fn four_seed_blocks_fit_whole_program() {
    // Four blocks of weights stay resident from the start: each product is planned within what
    // the others keep on its tiles (whole-program feasibility), replicated when that fits (the
    // planner's choice since the re-planning rounds), else with each weight block homed once and
    // multicast (the fallback the log line names).
    let dir = tempfile::tempdir().unwrap();
    let generated = ipuq(&["workload", "siglip-mlp", "--blocks", "4", "-o", "mlp4.toml"], dir.path());
    assert_eq!(generated.code, 0);
    let out = ipuq(&["run", "mlp4.toml", "-o", "out"], dir.path());
    assert_pass(&out);
    assert_eq!(field(&out.stdout, "workload=", "blocks").as_deref(), Some("4"));
    assert!(out.stderr.contains("retained operator-plan finalist"), "{}", common::tail(&out.stderr));
}

/// One full-size SigLIP encoder layer with its MLP products constrained to swapped (the up
/// product in 23 row partitions, so its replicated weights fit beside the layer's others): the
/// MLP's result reaches the residual add written out transposed, and the layer passes
/// (measured: 359,677; 377,474 before the LayerNorms split their rows over idle tiles and the
/// products' tiles were numbered for paired gathers). A workload with plan constraints plans
/// Q, K and V one after another, as the constraints were made against (side by side its
/// tiles' standard memory overflows), so since session 34 the generated workload, which the
/// planner swaps by itself with Q, K and V side by side, is faster (345,911).
#[test]
fn a_full_size_encoder_layer_with_swapped_mlp_products_passes_faster() {
    let dir = tempfile::tempdir().unwrap();
    let out = ipuq(&["workload", "siglip-encoder", "-o", "enc.toml"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    let mut text = std::fs::read_to_string(dir.path().join("enc.toml")).unwrap();
    text += "\n[[constraint]]\noperation = \"l0.mlp_up.product\"\norientation = \"swapped\"\nrow_partitions = 23\n";
    text += "\n[[constraint]]\noperation = \"l0.mlp_down.product\"\norientation = \"swapped\"\n";
    std::fs::write(dir.path().join("enc.toml"), text).unwrap();
    let out = ipuq(&["run", "enc.toml", "-o", "out"], dir.path());
    assert_pass(&out);
    let cycles: u64 = field(&out.stdout, "workload=", "cycles").unwrap().parse().unwrap();
    assert!(cycles <= 365_000, "cycles={cycles}");
}

/// One full-size SigLIP encoder layer within issue 9's 350,000 simulated cycles: the planner
/// swaps both MLP products by itself (the second ends a swapped chain, so its result is
/// written out transposed for the residual add) and replicates their weights on at most 24
/// tiles each, the most that fit (measured: 342,290 since the planner counts paired gathers,
/// session 62; 345,911 before; 373,175 with the MLP in normal orientation).
///
/// Four layers: replicated at the planner's own partitions their weights do not fit, and kept
/// once on home tiles every layer multicasts its weights at each product (4.37 x one layer).
/// Replicated on fewer tiles each (five since session 43: the first cap claims the margin it
/// used to leave), they fit and pass (measured: 1,477,112 cycles since session 62; 1,491,756
/// before; four replicas 1,509,048;
/// 1,577,328 before Q, K and V ran side by side; 1,769,352 before the LayerNorms split their
/// rows and the products' tiles were numbered for paired gathers). Four layers' weights leave
/// no room for the swapped MLP's replicas (capped at four or five replicas, swapped MLPs run
/// 1,694,232 and 1,736,670 cycles), so they keep the MLP normal, and since one layer took the
/// swapped MLP they run 4.32 x one layer's cycles, over issue 9's 4.2 x (4.04 x before). The
/// bound below guards the four-layer program itself. Their fullest tile is so full that
/// separating exchange buffers by memory element fragments it; placing that tile again
/// largest buffers first finds room, so `select_finalist` keeps the planner's program
/// (before, it steered `l0.q.product` away and planned again).
#[test]
fn one_full_size_encoder_layer_runs_within_350000_cycles_and_four_fit_replicated_on_fewer_tiles() {
    let dir = tempfile::tempdir().unwrap();
    let mut cycles = Vec::new();
    for layers in ["1", "4"] {
        let file = format!("enc{layers}.toml");
        let out = ipuq(&["workload", "siglip-encoder", "--layers", layers, "-o", &file], dir.path());
        assert_eq!(out.code, 0, "{}", out.stderr);
        let out = ipuq(&["run", &file, "-o", &format!("out{layers}")], dir.path());
        assert_pass(&out);
        if layers == "1" {
            assert!(out.stderr.contains("l0.mlp_up.product:swapped[") && out.stderr.contains("l0.mlp_down.product:swapped[") && out.stderr.contains("l0.mlp_down.rows:transpose_copy"), "{}", common::tail(&out.stderr));
        }
        if layers == "4" {
            assert!(out.stderr.contains("replicated weights fit on fewer tiles each"), "{}", common::tail(&out.stderr));
            assert!(!out.stderr.contains("no finalist can be placed"), "{}", common::tail(&out.stderr));
        }
        cycles.push(field(&out.stdout, "workload=", "cycles").unwrap().parse::<u64>().unwrap());
    }
    assert!(cycles[0] <= 350_000, "one layer {}", cycles[0]);
    assert!(cycles[1] <= 1_500_000, "four layers {}", cycles[1]);
}

/// Three full-size layers: since the planner counts the words that supertile pairs receive
/// together (session 62), the beam's program keeps every weight replicated at the planner's
/// own partitions and fits with no capped program and no steer (measured: 1,102,230 cycles,
/// PASS; before, capped at seven replicas, the most that left room to keep every exchange
/// phase's buffers apart: 1,121,346).
#[test]
fn three_full_size_encoder_layers_fit_with_every_weight_replicated_at_the_planners_partitions() {
    let (stderr, cycles) = build_layers_unsteered("3");
    assert!(!stderr.contains("replicated weights fit on fewer tiles each"), "{}", common::tail(&stderr));
    assert!(cycles <= 1_110_000, "three layers {cycles}");
}

/// Builds `layers` full-size encoder layers, checks that `select_finalist` did not steer and
/// plan again, and gives the build's log and its exact (scheduled) cycles.
fn build_layers_unsteered(layers: &str) -> (String, u64) {
    let dir = tempfile::tempdir().unwrap();
    let out = ipuq(&["workload", "siglip-encoder", "--layers", layers, "-o", "enc.toml"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = ipuq(&["build", "enc.toml", "-o", "out"], dir.path());
    assert_eq!(out.code, 0, "{}", common::tail(&out.stderr));
    assert!(!out.stderr.contains("no finalist can be placed"), "{}", common::tail(&out.stderr));
    let cycles = field(&out.stdout, "package=", "estimatedCycles").unwrap().parse().unwrap();
    (out.stderr, cycles)
}

/// Five full-size layers: four replicas do not fit, and three fit with too little room to keep
/// each phase's sending and receiving buffers apart, so `select_finalist` steered a product and
/// planned the whole program again (2,103,032 cycles, about 48 s). No capped program is taken
/// now, and the home-tile weights' program runs faster (measured: 1,992,272 cycles).
#[test]
fn five_full_size_encoder_layers_take_no_capped_program_that_placement_cannot_separate() {
    let (_, cycles) = build_layers_unsteered("5");
    assert!(cycles <= 2_000_000, "five layers {cycles}");
}

/// Fourteen full-size layers, the most that fit at f16 since session 69 (twelve since session
/// 65, ten since session 62, eight before): every weight is kept once on a home tile, homes
/// rotating with the layers (each block of layer r sits r row partitions on from layer 0's,
/// from the row partition that leaves its tiles least loaded), so layers a whole number of row
/// partitions apart share their multicast patterns and exchange tables: the tables stay
/// within the compiler's 48 KiB budget (measured: 40,152 bytes on the fullest tile, 5,495,982
/// cycles, built and run in 92 s release, 7.3 GB; twelve layers take 39,572 bytes of tables
/// on their fullest tile, where homes rotating with every weight took 81,376).
#[test]
fn fourteen_full_size_encoder_layers_fit_at_f16_unsteered_with_their_tables_in_the_budget() {
    let (cycles, stderr) = run_layers_unsteered("14");
    assert!(cycles <= 5_510_000, "fourteen layers {cycles}");
    assert!(!stderr.contains("exchange tables over the budget"), "{}", common::tail(&stderr));
}

/// Fifteen full-size layers do not fit: the build exits 2 naming the tile, the buffer, its
/// bytes, the regions with the bytes taken there, and the code and tables past the planner's
/// code reserve (measured: 31 s release, 6.4 GB: the MLP up product's gathered block of a
/// LayerNorm output, on tile 2, whose code and tables take 71,088 bytes, 21,936 past the
/// reserve). Planning again with 32 KiB more set aside on every tile was tried and did not
/// help: the re-plan took another weight arrangement and tile 0's tables grew to 92,680 bytes.
#[test]
fn fifteen_full_size_encoder_layers_do_not_fit_and_say_where() {
    let dir = tempfile::tempdir().unwrap();
    let out = ipuq(&["workload", "siglip-encoder", "--layers", "15", "-o", "enc.toml"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = ipuq(&["build", "enc.toml", "-o", "out"], dir.path());
    assert_eq!(out.code, 2, "{}", common::tail(&out.stderr));
    let error = out.stderr.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("no error line: {}", common::tail(&out.stderr)));
    assert!(error.starts_with("error: tile ") && error.contains(" needs ") && error.contains(" bytes of ") && error.contains(" memory") && error.contains("taken then"), "{error}");
    assert!(error.contains("'l") && !out.stderr.contains("panicked"), "{error}");
    // A tile's code and exchange tables outgrew the planner's 48 KiB code reserve (since
    // session 71, with vertex state shared by the layers: tile 6's, 9,024 bytes past it;
    // before, tile 2's, 21,936), memory the planner had laid data out in: the error says so,
    // with the bytes.
    assert!(error.contains("the code and exchange tables beside it take ") && error.contains(" more than the 49152 the planner set aside for them on every tile"), "{error}");
}

/// Runs `layers` full-size encoder layers, checks that they pass and that `select_finalist`
/// did not steer and plan again, and gives the simulated cycles and the log.
fn run_layers_unsteered(layers: &str) -> (u64, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = ipuq(&["workload", "siglip-encoder", "--layers", layers, "-o", "enc.toml"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = ipuq(&["run", "enc.toml", "-o", "out"], dir.path());
    assert_pass(&out);
    assert!(!out.stderr.contains("steered away from its plan"), "{}", common::tail(&out.stderr));
    (field(&out.stdout, "workload=", "cycles").unwrap().parse().unwrap(), out.stderr)
}

/// A BERT-base-sized layer (128 tokens, width 768, 12 heads, MLP 3072) on the 1472 tiles: its
/// 128 LayerNorm rows would leave 1344 tiles idle, so each row is split into eight segments
/// (1024 tiles) whose statistics are exchanged; each tile receives the other segments'
/// statistics into another buffer than the one it sends its own from, so exchange placement
/// can keep the memory-element rule (one buffer for both failed it: `memory-element conflicts
/// remain`). Its Q, K and V products run side by side on thirds of the tiles. The layer passes
/// well under its earlier cycles (measured: 63,373 with its MLP swapped, which the planner
/// chooses since session 34; 67,256 with the MLP normal; 71,332 with Q, K and V one after
/// another, 87,135 with whole LayerNorm rows and the earlier tile numbering).
#[test]
fn a_bert_base_sized_layer_splits_its_layer_norm_rows_over_1024_tiles_and_passes() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["workload", "siglip-encoder", "--layers", "1", "--tokens", "128", "--dim", "768", "--heads", "12", "--hidden", "3072", "-o", "base.toml"];
    let out = ipuq(&args, dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    let plans = ipuq(&["plans", "base.toml"], dir.path());
    assert_eq!(plans.code, 0, "{}", plans.stderr);
    for plan in ["l0.ln1:layer_normx1024", "l0.residual1:addx1024", "l0.ln2:layer_normx1024"] {
        assert!(plans.stdout.contains(plan), "{plan}: {}", plans.stdout);
    }
    // Q, K and V read one LayerNorm output through weights of one shape: they run side by
    // side, each on a third of the tiles (its partitions multiply to at most 1472 / 3).
    for product in ["l0.q.product", "l0.k.product", "l0.v.product"] {
        let at = plans.stdout.find(&format!("{product}:normal[")).unwrap_or_else(|| panic!("{product}: {}", plans.stdout));
        let rest = &plans.stdout[at..];
        let parts: u32 = rest[rest.find('[').unwrap() + 1..rest.find(']').unwrap()].split(',').map(|p| p.parse::<u32>().unwrap()).product();
        assert!(parts <= 1472 / 3, "{product} on {parts} tiles: {}", plans.stdout);
    }
    let out = ipuq(&["run", "base.toml", "-o", "out"], dir.path());
    assert_pass(&out);
    let cycles: u64 = field(&out.stdout, "workload=", "cycles").unwrap().parse().unwrap();
    assert!(cycles < 66_000, "cycles={cycles}");
}

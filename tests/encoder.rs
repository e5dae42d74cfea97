//! Transformer encoder operations and stacks on the 16-tile test target: each new operation
//! alone (LayerNorm, bias add, exact GELU, a product with [out, in] weights), tiny two-layer
//! encoders of both layer styles, against the host reference; and their validation errors.

mod common;

use common::{assert_pass, field, ipuq};
use ipuq::workload::encoder::{build, random_parameter, Activation, EncoderSpec, LayerStyle};
use ipuq_queries::ir::Graph;

/// A workload of one operation over `x` [rows, cols] (Gaussian) and its parameters.
fn single(op: &str, extra: &str, params: &[(&str, Vec<u32>, &str)], rows: u32, cols: u32) -> String {
    let mut text = format!("name = \"single-{op}\"\noutputs = [\"y\"]\n\n[[tensor]]\nname = \"x\"\nshape = [{rows}, {cols}]\ndtype = \"f16\"\nrole = \"input\"\n[tensor.init.gaussian]\nseed = 1\nstd = 2.0\n");
    let mut names = vec!["\"x\"".to_string()];
    for (i, (name, shape, init)) in params.iter().enumerate() {
        text += &format!("\n[[tensor]]\nname = \"{name}\"\nshape = {shape:?}\ndtype = \"f16\"\nrole = \"weight\"\n[tensor.init.{init}]\nseed = {}\n", 10 + i);
        text += if *init == "gaussian" { "std = 0.5\n" } else { "low = 0.5\nhigh = 1.5\n" };
        names.push(format!("\"{name}\""));
    }
    text += &format!("\n[[operation]]\nname = \"y\"\nop = \"{op}\"\ninputs = [{}]\n{extra}", names.join(", "));
    text
}

fn run_file(dir: &std::path::Path, file: &str, text: &str) -> common::Output {
    std::fs::write(dir.join(file), text).unwrap();
    ipuq(&["run", file, "--target", "small16", "-o", &format!("out-{file}"), "--checkpoints"], dir)
}

#[test]
fn each_new_operation_runs_and_matches_the_host_reference() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        single("layer_norm", "eps = 1e-6\n", &[("gamma", vec![40], "uniform"), ("beta", vec![40], "gaussian")], 21, 40),
        // Without eps: the default 1e-5; rows narrower than a tile's share.
        single("layer_norm", "", &[("gamma", vec![24], "uniform"), ("beta", vec![24], "gaussian")], 5, 24),
        single("bias_add", "", &[("bias", vec![36], "gaussian")], 19, 36),
        single("gelu", "approximate = \"none\"\n", &[], 23, 30),
        single("gelu", "approximate = \"tanh\"\n", &[], 23, 30),
        // A product with weights stored [out, in], as checkpoints store them.
        single("matmul", "transpose_b = true\n", &[("w", vec![28, 40], "gaussian")], 21, 40),
    ];
    for (i, text) in cases.iter().enumerate() {
        let out = run_file(dir.path(), &format!("op{i}.toml"), text);
        assert_pass(&out);
        assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"), "{text}");
    }
}

/// A tiny encoder of `style`, written as a workload file.
fn tiny(style: LayerStyle, activation: Activation, final_norm: bool, batch: u32) -> String {
    tiny_of(style, activation, final_norm, batch, (11, 24, 3, 40))
}

/// [`tiny`] of (tokens, hidden width, heads, MLP width).
fn tiny_of(style: LayerStyle, activation: Activation, final_norm: bool, batch: u32, (tokens, hidden, heads, intermediate): (u32, u32, u32, u32)) -> String {
    let spec = EncoderSpec { batch, tokens, hidden, heads, intermediate, layers: 2, style, activation, eps: 1e-5, final_norm };
    let encoder = build(&spec, |p| Ok::<_, String>(random_parameter(p))).unwrap();
    let file = encoder.into_file(format!("tiny-{style:?}-{batch}").to_lowercase(), Default::default());
    Graph::from_file(file.clone(), "tiny").expect("the builder's workload validates");
    ipuq::workload::to_toml(&file)
}

#[test]
fn two_layer_tiny_encoders_of_both_styles_match_the_host_reference() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        tiny(LayerStyle::PreNorm, Activation::GeluTanh, false, 1),
        tiny(LayerStyle::PostNorm, Activation::GeluErf, false, 1),
        tiny(LayerStyle::PreNorm, Activation::GeluErf, true, 2),
    ];
    for (i, text) in cases.iter().enumerate() {
        let out = run_file(dir.path(), &format!("enc{i}.toml"), text);
        assert_pass(&out);
        assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"));
    }
}

/// LayerNorm rows that leave tiles idle are split into segments on those tiles (each
/// segment's statistics, one exchange of them, each segment normalised from all of them):
/// three rows of 256 on the 16 tiles run on 12 and agree with the host reference; rows enough
/// for every tile stay whole; a rank-3 LayerNorm splits its rows too. Encoders whose few
/// tokens leave tiles idle store the residual adds that feed their LayerNorms in those
/// segments, in both layer styles, and agree too.
#[test]
fn layer_norm_rows_split_over_idle_tiles_match_the_host_reference() {
    let dir = tempfile::tempdir().unwrap();
    let params = |cols: u32| [("gamma", vec![cols], "uniform"), ("beta", vec![cols], "gaussian")];
    for (rows, cols, tiles) in [(3, 256, 12), (16, 64, 16)] {
        let file = format!("ln{rows}.toml");
        let text = single("layer_norm", "", &params(cols), rows, cols);
        std::fs::write(dir.path().join(&file), &text).unwrap();
        let plans = ipuq(&["plans", &file, "--target", "small16"], dir.path());
        assert_eq!(plans.code, 0, "{}", plans.stderr);
        assert!(plans.stdout.contains(&format!("y:layer_normx{tiles}")), "{rows} rows: {}", plans.stdout);
        let out = run_file(dir.path(), &file, &text);
        assert_pass(&out);
        assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"), "{text}");
    }
    // Rank 3: two batches of three rows, one batch index a cell, each row in two segments.
    let text = single("layer_norm", "", &params(256), 3, 256).replacen("shape = [3, 256]", "shape = [2, 3, 256]", 1);
    std::fs::write(dir.path().join("ln3d.toml"), &text).unwrap();
    let plans = ipuq(&["plans", "ln3d.toml", "--target", "small16"], dir.path());
    assert!(plans.stdout.contains("y:layer_normx12"), "rank 3: {}", plans.stdout);
    let out = run_file(dir.path(), "ln3d.toml", &text);
    assert_pass(&out);
    assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"), "{text}");
    for style in [LayerStyle::PreNorm, LayerStyle::PostNorm] {
        let text = tiny_of(style, Activation::GeluTanh, true, 1, (5, 256, 4, 96));
        let file = format!("few-{style:?}.toml");
        let out = run_file(dir.path(), &file, &text);
        assert_pass(&out);
        assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"), "{style:?}");
        let plans = ipuq(&["plans", &file, "--target", "small16"], dir.path());
        assert!(plans.stdout.contains("layer_normx15"), "{style:?}: {}", plans.stdout);
    }
}

/// Heads 2 mod 4 f16 elements wide (6, 10, 14) put every other row of a head's block 4 bytes
/// past the 8-byte alignment: the blocks a tile holds itself copy one 32-bit word at a time
/// (`CopyWords`). Heads of an odd width (5, 3; odd model widths too) start inside a word: the
/// exchange moves the words that hold a piece into a staging buffer and a copy of halves
/// (`CopyHalves`) takes it from there. All agree with the host reference in both layer styles.
#[test]
fn heads_of_any_width_copy_in_words_or_halves_and_match_the_host_reference() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (LayerStyle::PreNorm, (11, 18, 3, 40), "CopyWords"),
        (LayerStyle::PostNorm, (11, 30, 3, 40), "CopyWords"),
        (LayerStyle::PreNorm, (11, 28, 2, 40), "CopyWords"),
        (LayerStyle::PostNorm, (11, 40, 4, 40), "CopyWords"),
        (LayerStyle::PreNorm, (9, 20, 4, 40), "CopyHalves"),
        (LayerStyle::PostNorm, (9, 15, 3, 24), "CopyHalves"),
        (LayerStyle::PreNorm, (13, 21, 7, 24), "CopyHalves"),
    ];
    for (i, (style, shape, kind)) in cases.into_iter().enumerate() {
        let text = tiny_of(style, Activation::GeluTanh, false, 1, shape);
        let file = format!("heads{i}.toml");
        let out = run_file(dir.path(), &file, &text);
        assert_pass(&out);
        assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"), "{style:?} {shape:?}");
        let inspected = ipuq(&["inspect", &format!("out-{file}/model.ipuexe")], dir.path());
        let calls = field(&inspected.stdout, "vertices ", kind).and_then(|n| n.parse::<usize>().ok()).unwrap_or(0);
        assert!(calls > 0, "{style:?} {shape:?}: no {kind} call in the package: {}", inspected.stdout);
    }
}

/// One row of `ipuq profile … --operations`.
struct OperationRow {
    name: String,
    cycles: u64,
    compute: u64,
    /// Percent of peak; none for rows without matrix products.
    efficiency: Option<f64>,
}

fn operation_rows(stdout: &str) -> Vec<OperationRow> {
    stdout
        .lines()
        .filter(|l| l.starts_with("| l") || l.starts_with("| last_hidden_state"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let efficiency = cells[7].strip_suffix(" %").map(|e| e.parse().unwrap());
            OperationRow { name: cells[1].to_string(), cycles: cells[3].parse().unwrap(), compute: cells[5].parse().unwrap(), efficiency }
        })
        .collect()
}

#[test]
fn the_generator_writes_a_named_pre_norm_encoder_that_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = ipuq(&["workload", "siglip-encoder", "--layers", "2", "--tokens", "9", "--dim", "32", "--heads", "4", "--hidden", "48", "-o", "enc.toml"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("workload=siglip-encoder-f16-b1-t9-d32-h4-m48-l2"), "{}", out.stdout);
    let text = std::fs::read_to_string(dir.path().join("enc.toml")).unwrap();
    let graph = Graph::parse(&text, "enc.toml").unwrap();
    assert_eq!(graph.value(graph.outputs[0]).name, "last_hidden_state");
    assert!(graph.find("hidden_states").is_some());
    let count = |kind: &str| graph.operations.iter().filter(|o| o.kind.name() == kind).count();
    assert_eq!((count("layer_norm"), count("bias_add"), count("matmul"), count("gelu")), (4, 12, 16, 2));
    // The name stands for the same workload.
    let again = ipuq::workload::from_name("siglip-encoder-f16-b1-t9-d32-h4-m48-l2").unwrap();
    assert_eq!(ipuq::workload::to_toml(&again), text);
    let out = ipuq(&["run", "enc.toml", "--target", "small16", "-o", "out"], dir.path());
    assert_pass(&out);
    // The run's cycles split by operation kind add up to the run's cycles.
    let cycles = field(&out.stdout, "workload=", "cycles").unwrap();
    let split = ipuq(&["profile", "out/execution.ipuprofile", "--package", "out/model.ipuexe"], dir.path());
    assert_eq!(split.code, 0, "{}", split.stderr);
    // Each softmax's normalisation is deferred to the context product that reads it, so the
    // two have one checkpoint and one row: 14 other products, 2 softmax-and-context pairs.
    for kind in ["| matmul | 14 |", "| layer_norm | 4 |", "| softmax (normalisation deferred) + matmul | 2 |", "| gelu | 2 |"] {
        assert!(split.stdout.contains(kind), "{kind}: {}", split.stdout);
    }
    assert!(split.stdout.contains(&format!("| all | | {cycles} | 100 % ({cycles} attributed)")), "{}", split.stdout);
    // Per operation, in program order: the rows add up to the run's cycles too, and an
    // operation without steps of its own (GELU in the up product's reduction) shares the row
    // of the operation whose steps it runs in.
    let per = ipuq(&["profile", "out/execution.ipuprofile", "--package", "out/model.ipuexe", "--operations"], dir.path());
    assert_eq!(per.code, 0, "{}", per.stderr);
    let rows = operation_rows(&per.stdout);
    assert!(rows.first().is_some_and(|r| r.name == "l0.ln1 (layer_norm)") && rows.last().is_some_and(|r| r.name == "last_hidden_state (add)"), "{}", per.stdout);
    assert!(rows.iter().any(|r| r.name == "l1.mlp_up.product + l1.mlp_act (matmul)"), "{}", per.stdout);
    assert_eq!(rows.iter().map(|r| r.cycles).sum::<u64>().to_string(), cycles, "{}", per.stdout);
    assert!(per.stdout.contains(&format!("| all | | {cycles} | 100 % ({cycles} attributed)")), "{}", per.stdout);
    // A shape the family cannot take is refused with the parameter named.
    let out = ipuq(&["workload", "siglip-encoder", "--dim", "30", "--heads", "4"], dir.path());
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("4 heads do not divide the hidden width 30"), "{}", out.stderr);
}


#[test]
fn the_profile_splits_a_compute_set_two_operations_share_by_their_calls() {
    // Q, K and V constrained to the same plan with two inner partitions run one after the
    // other (not side by side): K's products run in the compute set of Q's reduction, V's in
    // K's. A split by superstep gave Q K's matrix calls and V only its reduction.
    let dir = tempfile::tempdir().unwrap();
    let out = ipuq(&["workload", "siglip-encoder", "--layers", "1", "--tokens", "9", "--dim", "32", "--heads", "4", "--hidden", "48", "-o", "enc.toml"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    let mut text = std::fs::read_to_string(dir.path().join("enc.toml")).unwrap().replacen("-l1\"", "-l1-qkv\"", 1);
    for p in ["q", "k", "v"] {
        text += &format!("\n[[constraint]]\noperation = \"l0.{p}.product\"\nrow_partitions = 4\ncolumn_partitions = 2\ninner_partitions = 2\n");
    }
    std::fs::write(dir.path().join("enc.toml"), text).unwrap();
    let out = ipuq(&["run", "enc.toml", "--target", "small16", "-o", "out"], dir.path());
    assert_pass(&out);
    let cycles = field(&out.stdout, "workload=", "cycles").unwrap();
    let per = ipuq(&["profile", "out/execution.ipuprofile", "--package", "out/model.ipuexe", "--operations"], dir.path());
    assert_eq!(per.code, 0, "{}", per.stderr);
    let rows = operation_rows(&per.stdout);
    let compute = |name: &str| rows.iter().find(|r| r.name == name).unwrap_or_else(|| panic!("{name}: {}", per.stdout)).compute;
    // The same plan on the same tiles: K and V compute alike, Q as much or more (its step also
    // stages the LayerNorm's output).
    let (q, k, v) = (compute("l0.q.product (matmul)"), compute("l0.k.product (matmul)"), compute("l0.v.product (matmul)"));
    assert!(k > 0 && k == v && q >= k, "q {q}, k {k}, v {v}: {}", per.stdout);
    assert!(rows.iter().all(|r| r.efficiency.is_none_or(|e| e <= 100.0)), "{}", per.stdout);
    assert!(per.stdout.contains(&format!("| all | | {cycles} | 100 % ({cycles} attributed)")), "{}", per.stdout);
    // By kind, the GELU that runs in the up product's reduction set has its own cycles.
    let split = ipuq(&["profile", "out/execution.ipuprofile", "--package", "out/model.ipuexe"], dir.path());
    let gelu = split.stdout.lines().find(|l| l.starts_with("| gelu |")).unwrap_or_else(|| panic!("{}", split.stdout));
    assert!(gelu.split('|').nth(5).is_some_and(|c| c.trim().parse::<u64>().is_ok_and(|c| c > 0)), "{}", split.stdout);
    assert!(split.stdout.contains(&format!("| all | | {cycles} | 100 % ({cycles} attributed)")), "{}", split.stdout);
}

#[test]
fn bad_parameters_of_the_new_operations_are_named() {
    let cases = [
        (single("layer_norm", "", &[("gamma", vec![7], "uniform"), ("beta", vec![40], "gaussian")], 3, 40), "gamma 'gamma' must have shape [40]"),
        (single("layer_norm", "eps = -1.0\n", &[("gamma", vec![40], "uniform"), ("beta", vec![40], "gaussian")], 3, 40), "'eps' must be finite and positive"),
        (single("layer_norm", "", &[("gamma", vec![40], "uniform")], 3, 40), "layer_norm takes 3 input(s), got 2"),
        (single("bias_add", "", &[("bias", vec![3, 40], "gaussian")], 3, 40), "bias 'bias' must have shape [40]"),
        (single("gelu", "approximate = \"fast\"\n", &[], 3, 40), "must be \"tanh\" or \"none\""),
        (single("gelu", "eps = 0.1\n", &[], 3, 40), "'eps' applies only to layer_norm"),
        (single("bias_add", "approximate = \"none\"\n", &[("bias", vec![40], "gaussian")], 3, 40), "'approximate' applies only to gelu"),
    ];
    for (text, expected) in cases {
        let error = Graph::parse(&text, "w.toml").unwrap_err().to_string();
        assert!(error.contains(expected) && error.contains("operation 'y'"), "{error}");
    }
}

/// A two-product MLP with 1-D biases, each product constrained to `orientation` (or free).
fn biased_mlp(orientation: Option<&str>) -> String {
    let mut text = String::from("name = \"biased-mlp\"\noutputs = [\"yb\"]\n");
    for (i, (name, shape, role)) in
        [("x", vec![13, 40], "input"), ("w1", vec![40, 56], "weight"), ("b1", vec![56], "weight"), ("w2", vec![56, 24], "weight"), ("b2", vec![24], "weight")].iter().enumerate()
    {
        text += &format!("\n[[tensor]]\nname = \"{name}\"\nshape = {shape:?}\ndtype = \"f16\"\nrole = \"{role}\"\n[tensor.init.gaussian]\nseed = {}\nstd = 0.5\n", 20 + i);
    }
    for (name, op, inputs) in [("h", "matmul", "\"x\", \"w1\""), ("hb", "bias_add", "\"h\", \"b1\""), ("g", "gelu", "\"hb\""), ("y", "matmul", "\"g\", \"w2\""), ("yb", "bias_add", "\"y\", \"b2\"")] {
        text += &format!("\n[[operation]]\nname = \"{name}\"\nop = \"{op}\"\ninputs = [{inputs}]\n");
    }
    if let Some(o) = orientation {
        for product in ["h", "y"] {
            text += &format!("\n[[constraint]]\noperation = \"{product}\"\norientation = \"{o}\"\n");
        }
    }
    text
}

#[test]
fn biases_fold_into_products_of_either_orientation_and_match_the_host_reference() {
    let dir = tempfile::tempdir().unwrap();
    for (i, orientation) in [Some("normal"), Some("swapped"), None].into_iter().enumerate() {
        let file = format!("mlp{i}.toml");
        let out = run_file(dir.path(), &file, &biased_mlp(orientation));
        assert_pass(&out);
        assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"), "{orientation:?}");
        // The bias adds run no pass of their own: their steps are the products'.
        let split = ipuq(&["profile", &format!("out-{file}/execution.ipuprofile"), "--package", &format!("out-{file}/model.ipuexe")], dir.path());
        assert_eq!(split.code, 0, "{}", split.stderr);
        assert!(split.stdout.contains("| matmul | 2 |") && !split.stdout.contains("bias_add"), "{orientation:?}: {}", split.stdout);
        if let Some(o) = orientation {
            let plans = ipuq(&["plans", &file, "--target", "small16"], dir.path());
            assert_eq!(plans.code, 0, "{}", plans.stderr);
            let chosen = plans.stdout.lines().find(|l| l.contains('*')).unwrap_or_default().to_string();
            assert!(chosen.contains(&format!("h:{o}")) && chosen.contains(&format!("y:{o}")), "{chosen}");
        }
    }
}

/// Encoder products the workload constrains to swapped whose results readers by rows read
/// (the residual adds, the attention products through head views, a normal product after a
/// swapped one): each such result is written out transposed on its tiles
/// (`transpose_copy`), and the runs match the host reference checkpoint by checkpoint.
#[test]
fn swapped_products_read_by_rows_are_written_out_transposed_and_match_the_host_reference() {
    let dir = tempfile::tempdir().unwrap();
    let sites: [&[&str]; 2] = [&["q", "k", "v", "attn_out", "mlp_down"], &["mlp_up"]];
    for (i, sites) in sites.into_iter().enumerate() {
        let mut text = tiny(LayerStyle::PreNorm, Activation::GeluTanh, false, 1);
        for layer in 0..2 {
            for site in sites {
                text += &format!("\n[[constraint]]\noperation = \"l{layer}.{site}.product\"\norientation = \"swapped\"\n");
            }
        }
        let file = format!("swapped{i}.toml");
        let out = run_file(dir.path(), &file, &text);
        assert_pass(&out);
        assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"), "{sites:?}");
        let plans = ipuq(&["plans", &file, "--target", "small16"], dir.path());
        assert_eq!(plans.code, 0, "{}", plans.stderr);
        let chosen = plans.stdout.lines().find(|l| l.contains('*')).unwrap_or_default().to_string();
        for layer in 0..2 {
            for site in sites {
                assert!(chosen.contains(&format!("l{layer}.{site}.product:swapped")), "{site}: {chosen}");
            }
        }
        assert!(chosen.contains("transpose_copy"), "{chosen}");
    }
}

//! The host reference on hand-computed cases for every operation, and verification's tolerance:
//! a correct but differently-rounded computation passes, wrong kernels fail.

use std::collections::BTreeMap;
use std::path::Path;

use ipuq::reference::{evaluate, evaluate_values, evaluate_values_memo, gelu, ReferenceMemo, Values};
use ipuq::verify::{check_samples, compare, compare_bytes, Tolerance};
use ipuq::workload::data::{encode, round_to, tensor_data, TensorData};
use ipuq::workload::{grouped_attention, siglip_mlp, GroupedAttention, SiglipMlp};
use ipuq_queries::ir::{DType, Graph};

/// A graph from TOML: `tensors` are (name, shape) pairs of zero-initialised f16 inputs.
fn graph(tensors: &[(&str, &str)], operations: &str, outputs: &str) -> Graph {
    let mut text = format!("name = \"case\"\noutputs = {outputs}\n");
    for (name, shape) in tensors {
        text += &format!("[[tensor]]\nname = \"{name}\"\nshape = {shape}\ndtype = \"f16\"\nrole = \"input\"\ninit = \"zeros\"\n");
    }
    Graph::parse(&(text + operations), "case").unwrap()
}

fn run(graph: &Graph, inputs: &[(&str, Vec<f32>)]) -> Values {
    let data: BTreeMap<String, TensorData> = inputs
        .iter()
        .map(|(name, values)| {
            let shape = graph.value(graph.find(name).unwrap()).shape.clone();
            (name.to_string(), TensorData::from_values(DType::F16, shape, values.clone()).unwrap())
        })
        .collect();
    evaluate(graph, &data).unwrap()
}

fn f16(values: &[f64]) -> Vec<f32> {
    values.iter().map(|&v| round_to(DType::F16, v)).collect()
}

#[test]
fn matmul_plain_and_grouped_with_transpose_b() {
    let g = graph(&[("a", "[2, 3]"), ("b", "[3, 2]")], "[[operation]]\nname = \"c\"\nop = \"matmul\"\ninputs = [\"a\", \"b\"]\n", "[\"c\"]");
    let values = run(&g, &[("a", vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), ("b", vec![7.0, 8.0, 9.0, 10.0, 11.0, 12.0])]);
    assert_eq!(values["c"], vec![58.0, 64.0, 139.0, 154.0]);

    // Four query heads share two key heads: heads 0 and 1 use key batch 0, heads 2 and 3 batch 1.
    let g = graph(
        &[("q", "[4, 1, 2]"), ("k", "[2, 3, 2]")],
        "[[operation]]\nname = \"s\"\nop = \"matmul\"\ninputs = [\"q\", \"k\"]\ntranspose_b = true\n",
        "[\"s\"]",
    );
    let k = vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 0.0, 0.0, 2.0, 1.0, -1.0];
    let values = run(&g, &[("q", vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]), ("k", k)]);
    assert_eq!(g.value(g.find("s").unwrap()).shape, vec![4, 1, 3]);
    assert_eq!(values["s"], vec![1.0, 2.0, 3.0, 3.0, 4.0, 7.0, 10.0, 12.0, -1.0, 14.0, 16.0, -1.0]);

    // Products of f16 values are exact and the sum is rounded once: 2049 is not an f16 value.
    let g = graph(&[("a", "[1, 2]"), ("b", "[2, 1]")], "[[operation]]\nname = \"c\"\nop = \"matmul\"\ninputs = [\"a\", \"b\"]\n", "[\"c\"]");
    assert_eq!(run(&g, &[("a", vec![2048.0, 1.0]), ("b", vec![1.0, 1.0])])["c"], vec![2048.0]);
    assert_eq!(run(&g, &[("a", vec![2048.0, 3.0]), ("b", vec![1.0, 1.0])])["c"], vec![2052.0]);
}

#[test]
fn elementwise_operations_round_every_stored_value() {
    let ops = "[[operation]]\nname = \"g\"\nop = \"gelu\"\ninputs = [\"x\"]\n\
               [[operation]]\nname = \"s\"\nop = \"scale\"\ninputs = [\"x\"]\nfactor = 0.5\n\
               [[operation]]\nname = \"a\"\nop = \"add\"\ninputs = [\"x\", \"y\"]\n\
               [[operation]]\nname = \"p\"\nop = \"softmax\"\ninputs = [\"x\"]\n";
    let g = graph(&[("x", "[2, 3]"), ("y", "[2, 3]")], ops, "[\"g\", \"s\", \"a\", \"p\"]");
    let x = vec![0.0, 1.0, -1.0, 3.0, 1.0, 2.0];
    let values = run(&g, &[("x", x), ("y", vec![2f32.powi(-11), 2f32.powi(-11), 0.0, 0.0, 0.0, 0.0])]);
    assert_eq!(values["g"], f16(&[0.0, 0.8411919906082768, -0.15880800939172324, 2.996362607918227, 0.8411919906082768, 1.954597694087775]));
    assert_eq!(values["s"], vec![0.0, 0.5, -0.5, 1.5, 0.5, 1.0]);
    // 0 + 2⁻¹¹ is an f16 value; 1 + 2⁻¹¹ would not be, and the tie rounds to 1.
    assert_eq!(values["a"], vec![2f32.powi(-11), 1.0, -1.0, 3.0, 1.0, 2.0]);
    let e = |v: f64| v.exp();
    let first: f64 = e(0.0) + e(1.0) + e(-1.0);
    let second: f64 = e(3.0) + e(1.0) + e(2.0);
    assert_eq!(values["p"], f16(&[1.0 / first, e(1.0) / first, e(-1.0) / first, e(3.0) / second, e(1.0) / second, e(2.0) / second]));
    assert!((gelu(-10.0)).abs() < 1e-20 && (gelu(10.0) - 10.0).abs() < 1e-12);
}

#[test]
fn views_move_elements_as_described() {
    let ops = "[[operation]]\nname = \"r\"\nop = \"reshape\"\ninputs = [\"x\"]\nshape = [2, 3, 2]\n\
               [[operation]]\nname = \"t\"\nop = \"transpose\"\ninputs = [\"r\"]\nperm = [1, 0, 2]\n\
               [[operation]]\nname = \"f\"\nop = \"reshape\"\ninputs = [\"t\"]\nshape = [3, 4]\n\
               [[operation]]\nname = \"y\"\nop = \"scale\"\ninputs = [\"f\"]\nfactor = 1.0\n";
    let g = graph(&[("x", "[4, 3]")], ops, "[\"y\"]");
    let values = run(&g, &[("x", (0..12).map(|v| v as f32).collect())]);
    assert_eq!(values["r"], (0..12).map(|v| v as f32).collect::<Vec<_>>());
    // t[i][j][k] = r[j][i][k]: r's two 3x2 blocks interleaved row by row.
    assert_eq!(values["t"], vec![0.0, 1.0, 6.0, 7.0, 2.0, 3.0, 8.0, 9.0, 4.0, 5.0, 10.0, 11.0]);
    assert_eq!(values["y"], values["t"]);
    let only = evaluate_values(&g, &BTreeMap::from([("x".to_string(), TensorData::from_values(DType::F16, vec![4, 3], vec![1.0; 12]).unwrap())]), &["y"]).unwrap();
    assert_eq!(only.keys().collect::<Vec<_>>(), ["y"]);
    assert!(evaluate(&g, &BTreeMap::new()).unwrap_err().to_string().contains("tensor 'x' has no data"));
}

/// Attention computed by plain loops over tokens and heads, rounding where the graph stores.
fn naive_attention(q: &[f32], k: &[f32], v: &[f32], tokens: usize, heads: usize, kv_heads: usize, d: usize) -> Vec<f32> {
    let r = |x: f64| round_to(DType::F16, x) as f64;
    let mut out = vec![0.0f32; tokens * heads * d];
    for h in 0..heads {
        let kv = h / (heads / kv_heads);
        for t in 0..tokens {
            let scores: Vec<f64> = (0..tokens)
                .map(|s| r(r((0..d).map(|i| q[t * heads * d + h * d + i] as f64 * k[s * kv_heads * d + kv * d + i] as f64).sum()) / (d as f64).sqrt()))
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
            let p: Vec<f64> = scores.iter().map(|s| r((s - max).exp() / sum)).collect();
            for i in 0..d {
                out[t * heads * d + h * d + i] = r((0..tokens).map(|s| p[s] * v[s * kv_heads * d + kv * d + i] as f64).sum()) as f32;
            }
        }
    }
    out
}

#[test]
fn grouped_attention_matches_plain_loops_and_batches_fold() {
    let params = GroupedAttention { batch: 1, tokens: 9, heads: 6, kv_heads: 2, head_dimension: 5 };
    let g = Graph::from_file(grouped_attention(&params).unwrap(), "attention").unwrap();
    let data = tensor_data(&g, Path::new(".")).unwrap();
    let values = evaluate(&g, &data).unwrap();
    let naive = naive_attention(&data["q"].values, &data["k"].values, &data["v"].values, 9, 6, 2, 5);
    let comparison = compare(&values["out"], &naive, Tolerance { relative: 0.0, floor: 1e-3 }).unwrap();
    assert!(comparison.passed, "{comparison:?}");

    // Batch 2 is two independent batch-1 problems stacked along the token rows.
    let batched = Graph::from_file(grouped_attention(&GroupedAttention { batch: 2, ..params.clone() }).unwrap(), "batched").unwrap();
    let data = tensor_data(&batched, Path::new(".")).unwrap();
    let out = &evaluate(&batched, &data).unwrap()["out"];
    for half in 0..2 {
        let slice = |name: &str| {
            let all = &data[name].values;
            all[half * all.len() / 2..(half + 1) * all.len() / 2].to_vec()
        };
        let single = run(&g, &[("q", slice("q")), ("k", slice("k")), ("v", slice("v"))]);
        assert_eq!(single["out"], out[half * out.len() / 2..(half + 1) * out.len() / 2], "batch {half}");
    }
}

/// What a device might do to a square MLP, correct or not.
#[derive(Default)]
struct Device {
    skip_gelu: bool,
    transpose_w1: bool,
    drop_chunk: bool,
    shift_rows: bool,
}

/// y = gelu(x·W1)·W2 the way a tiled device computes it: f32 products summed in K-chunks of 8,
/// each partial rounded to f16 and the partials summed in f16, then f32 tanh.
fn device_mlp(x: &[f32], w1: &[f32], w2: &[f32], n: usize, device: &Device) -> Vec<f32> {
    let round = |v: f32| half::f16::from_f32(v).to_f32();
    let matmul = |a: &[f32], b: &[f32], transpose: bool, drop: bool| {
        let mut out = vec![0.0f32; n * n];
        for i in 0..n {
            for j in 0..n {
                let mut total = 0.0f32;
                for chunk in (0..n).step_by(8).filter(|&c| !(drop && c == 8)) {
                    let partial: f32 = (chunk..chunk + 8).map(|k| a[i * n + k] * if transpose { b[j * n + k] } else { b[k * n + j] }).sum();
                    total = round(total + round(partial));
                }
                out[i * n + j] = total;
            }
        }
        out
    };
    let h = matmul(x, w1, device.transpose_w1, false);
    let g: Vec<f32> = if device.skip_gelu { h } else { h.iter().map(|&v| round(0.5 * v * (1.0 + (0.797_884_6 * (v + 0.044715 * v * v * v)).tanh()))).collect() };
    let mut y = matmul(&g, w2, false, device.drop_chunk);
    if device.shift_rows {
        y.rotate_left(n);
    }
    y
}

#[test]
fn the_tolerance_passes_a_differently_rounded_device_and_fails_wrong_kernels() {
    let n = 128;
    let params = SiglipMlp { tokens: n as u32, dimension: n as u32, hidden: n as u32, ..SiglipMlp::default() };
    let g = Graph::from_file(siglip_mlp(&params).unwrap(), "mlp").unwrap();
    let data = tensor_data(&g, Path::new(".")).unwrap();
    let reference = &evaluate_values(&g, &data, &["y_0"]).unwrap()["y_0"];
    let (x, w1, w2) = (&data["x"].values, &data["w1_0"].values, &data["w2_0"].values);
    let check = |device: Device| compare_bytes(reference, &encode(&device_mlp(x, w1, w2, n, &device), DType::F16), DType::F16).unwrap();

    let correct = check(Device::default());
    assert!(correct.passed && correct.max_abs_error > 0.0, "{correct:?}");
    assert!(correct.worst_ratio < 0.5, "a correct device should use under half the tolerance: {correct:?}");
    for (what, device) in [
        ("missing gelu", Device { skip_gelu: true, ..Device::default() }),
        ("transposed W1", Device { transpose_w1: true, ..Device::default() }),
        ("a dropped K-chunk of 8 of 128", Device { drop_chunk: true, ..Device::default() }),
        ("rows shifted by one", Device { shift_rows: true, ..Device::default() }),
    ] {
        let wrong = check(device);
        assert!(!wrong.passed && wrong.worst_ratio > 10.0, "{what} should fail clearly: {wrong:?}");
    }
}

#[test]
fn verification_reports_the_worst_element_and_rejects_non_finite_values() {
    let reference = vec![1.0, -2.0, 0.5, 4.0];
    let exact = compare(&reference, &reference, Tolerance::for_dtype(DType::F16)).unwrap();
    assert!(exact.passed && exact.max_abs_error == 0.0 && exact.elements == 4);

    let mut perturbed = reference.clone();
    perturbed[2] += 0.1;
    let result = compare(&reference, &perturbed, Tolerance::for_dtype(DType::F16)).unwrap();
    assert!(!result.passed && result.violations == 1, "{result:?}");
    assert_eq!((result.worst_index, result.worst_reference, result.worst_device), (2, 0.5, 0.6));
    assert!((result.max_abs_error - 0.1).abs() < 1e-6);
    // Within the limit: 2⁻⁷·|4| + 2⁻⁷·4 = 0.0625 for the largest element.
    perturbed = reference.clone();
    perturbed[3] += 0.06;
    assert!(compare(&reference, &perturbed, Tolerance::for_dtype(DType::F16)).unwrap().passed);

    for bad in [f32::NAN, f32::INFINITY] {
        let mut device = reference.clone();
        device[1] = bad;
        let result = compare(&reference, &device, Tolerance::for_dtype(DType::F16)).unwrap();
        assert!(!result.passed && result.non_finite == 1 && result.max_abs_error.is_infinite() && result.worst_index == 1, "{result:?}");
    }
    // An infinite reference (an infinite input reaches the output) matches nothing: neither
    // the same infinity on the device nor a finite value (the limit there is infinite, and a
    // ratio of infinities must not pass for agreement).
    let mut infinite = reference.clone();
    infinite[3] = f32::NEG_INFINITY;
    for device_value in [f32::NEG_INFINITY, 4.0, f32::NAN] {
        let mut device = reference.clone();
        device[3] = device_value;
        let result = compare(&infinite, &device, Tolerance::for_dtype(DType::F16)).unwrap();
        assert!(!result.passed && result.violations == 1 && result.max_abs_error.is_infinite() && result.worst_index == 3, "{device_value}: {result:?}");
        assert_eq!(result.non_finite, usize::from(!device_value.is_finite()));
    }
    assert!(compare(&reference, &reference[..3], Tolerance::for_dtype(DType::F16)).unwrap_err().to_string().contains("3 values"));
    assert!(compare_bytes(&reference, &[0u8; 7], DType::F16).is_err());

    let samples = check_samples(&reference, &[3, 0], &[4.0, 1.0], Tolerance::for_dtype(DType::F16)).unwrap();
    assert!(samples.passed && samples.elements == 2);
    let samples = check_samples(&reference, &[3, 0], &[4.0, 1.5], Tolerance::for_dtype(DType::F16)).unwrap();
    assert!(!samples.passed && samples.worst_index == 0 && (samples.max_abs_error - 0.5).abs() < 1e-9);
    assert!(check_samples(&reference, &[4], &[1.0], Tolerance::for_dtype(DType::F16)).unwrap_err().to_string().contains("index 4"));
    assert!(check_samples(&reference, &[0, 1], &[1.0], Tolerance::for_dtype(DType::F16)).is_err());
}

/// A memo of reference operations (`ipuq watch --run`) recomputes exactly the operations an
/// edit reaches, and its values are those of a fresh evaluation.
#[test]
fn the_reference_memo_recomputes_only_what_an_edit_reaches() {
    let text = include_str!("../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");
    let mut memo = ReferenceMemo::default();
    let mut check = |text: &str, reused: usize| {
        let g = Graph::parse(text, "small").unwrap();
        let data = tensor_data(&g, Path::new(".")).unwrap();
        let with_memo = evaluate_values_memo(&g, &data, &["y_0"], &mut memo).unwrap();
        assert_eq!(with_memo, evaluate_values(&g, &data, &["y_0"]).unwrap());
        assert_eq!(memo.reused, reused, "{text}");
    };
    check(text, 0);
    check(text, 3);
    // A new seed for the second weight: h_0 and g_0 are reused, y_0 is computed again.
    assert!(text.contains("seed = 102\n"));
    check(&text.replacen("seed = 102\n", "seed = 103\n", 1), 2);
    // Back again: the memo holds the last evaluation only, so y_0 is computed again.
    check(text, 2);
    // An edited operation: what comes before it is reused.
    check(&text.replacen("op = \"gelu\"", "op = \"gelu\"\napproximate = \"none\"", 1), 1);
    // A new input feeds every operation.
    check(&text.replacen("seed = 1\n", "seed = 7\n", 1), 0);
}

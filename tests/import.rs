//! `ipuq import` of Hugging Face checkpoints the tests write themselves (small random SigLIP
//! vision and BERT encoders in the Hugging Face layout), run on the simulator against the host
//! reference with `--input` and `--dump`; and every kind of bad file, each exiting 2 with a
//! message naming the file and the tensor or field.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{assert_pass, field, ipuq};
use ipuq::workload::npy::{read_npy, write_npy};
use ipuq::workload::safetensors::read_tensor;
use ipuq_queries::ir::DType;
use safetensors::tensor::{Dtype, TensorView};

/// Tiny dimensions: hidden 32, 2 heads, MLP 64, 2 layers, 16 tokens (image 16, patch 4).
const HIDDEN: usize = 32;
const INTER: usize = 64;
const LAYERS: usize = 2;

/// A deterministic stream of values in [-1, 1).
struct Stream(u64);

impl Stream {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// One tensor to write: name, dtype, shape, values.
struct Tensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    values: Vec<f32>,
}

fn encode(dtype: Dtype, values: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::F16 => values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
        Dtype::BF16 => values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
        Dtype::F64 => values.iter().flat_map(|&v| (v as f64).to_le_bytes()).collect(),
        other => panic!("the tests write no {other:?}"),
    }
}

fn safetensors_bytes(tensors: &[Tensor]) -> Vec<u8> {
    let data: Vec<Vec<u8>> = tensors.iter().map(|t| encode(t.dtype, &t.values)).collect();
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().zip(&data).map(|(t, d)| (t.name.clone(), TensorView::new(t.dtype, t.shape.clone(), d).unwrap())).collect();
    safetensors::tensor::serialize(views, None).unwrap()
}

/// The parameters of one dense layer or LayerNorm, as a checkpoint stores them.
fn dense(out: &mut Vec<Tensor>, stream: &mut Stream, name: &str, rows: usize, cols: usize, dtype: Dtype) {
    let scale = 1.0 / (cols as f32).sqrt();
    out.push(Tensor { name: format!("{name}.weight"), dtype, shape: vec![rows, cols], values: (0..rows * cols).map(|_| stream.next() * scale * 1.7).collect() });
    out.push(Tensor { name: format!("{name}.bias"), dtype, shape: vec![rows], values: (0..rows).map(|_| stream.next() * 0.1).collect() });
}

fn norm(out: &mut Vec<Tensor>, stream: &mut Stream, name: &str, dtype: Dtype, (gamma, beta): (&str, &str)) {
    out.push(Tensor { name: format!("{name}.{gamma}"), dtype, shape: vec![HIDDEN], values: (0..HIDDEN).map(|_| 1.0 + 0.2 * stream.next()).collect() });
    out.push(Tensor { name: format!("{name}.{beta}"), dtype, shape: vec![HIDDEN], values: (0..HIDDEN).map(|_| 0.1 * stream.next()).collect() });
}

/// A SigLIP checkpoint (`model_type` "siglip" with a vision_config), tensors of `dtype`, with
/// a few text-tower tensors beside the vision tower as real checkpoints have.
fn siglip_tensors(dtype: Dtype) -> Vec<Tensor> {
    let mut stream = Stream(0x5eed_0001);
    let mut t = Vec::new();
    for i in 0..LAYERS {
        let p = format!("vision_model.encoder.layers.{i}");
        norm(&mut t, &mut stream, &format!("{p}.layer_norm1"), dtype, ("weight", "bias"));
        for proj in ["q_proj", "k_proj", "v_proj", "out_proj"] {
            dense(&mut t, &mut stream, &format!("{p}.self_attn.{proj}"), HIDDEN, HIDDEN, dtype);
        }
        norm(&mut t, &mut stream, &format!("{p}.layer_norm2"), dtype, ("weight", "bias"));
        dense(&mut t, &mut stream, &format!("{p}.mlp.fc1"), INTER, HIDDEN, dtype);
        dense(&mut t, &mut stream, &format!("{p}.mlp.fc2"), HIDDEN, INTER, dtype);
    }
    norm(&mut t, &mut stream, "vision_model.post_layernorm", dtype, ("weight", "bias"));
    dense(&mut t, &mut stream, "text_model.final_layer_norm", HIDDEN, 1, dtype);
    t
}

const SIGLIP_CONFIG: &str = r#"{
  "architectures": ["SiglipModel"],
  "model_type": "siglip",
  "text_config": {"model_type": "siglip_text_model", "hidden_size": 32},
  "vision_config": {
    "model_type": "siglip_vision_model",
    "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
    "image_size": 16, "patch_size": 4, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"
  }
}"#;

/// BERT with a masked-LM head's naming (`bert.` prefix) and the old gamma/beta LayerNorms.
fn bert_tensors(dtype: Dtype) -> Vec<Tensor> {
    let mut stream = Stream(0x5eed_0002);
    let mut t = Vec::new();
    dense(&mut t, &mut stream, "bert.embeddings.word_embeddings", 8, HIDDEN, dtype);
    for i in 0..LAYERS {
        let p = format!("bert.encoder.layer.{i}");
        for proj in ["query", "key", "value"] {
            dense(&mut t, &mut stream, &format!("{p}.attention.self.{proj}"), HIDDEN, HIDDEN, dtype);
        }
        dense(&mut t, &mut stream, &format!("{p}.attention.output.dense"), HIDDEN, HIDDEN, dtype);
        norm(&mut t, &mut stream, &format!("{p}.attention.output.LayerNorm"), dtype, ("gamma", "beta"));
        dense(&mut t, &mut stream, &format!("{p}.intermediate.dense"), INTER, HIDDEN, dtype);
        dense(&mut t, &mut stream, &format!("{p}.output.dense"), HIDDEN, INTER, dtype);
        norm(&mut t, &mut stream, &format!("{p}.output.LayerNorm"), dtype, ("gamma", "beta"));
    }
    t
}

const BERT_CONFIG: &str = r#"{
  "architectures": ["BertForMaskedLM"], "model_type": "bert",
  "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
  "hidden_act": "gelu", "layer_norm_eps": 1e-12, "max_position_embeddings": 64
}"#;

/// Hugging Face's forward pass of the imported stack, written out here in f64 from the
/// checkpoint's values: independent of ipuq's builder and host reference, so a mis-mapped
/// tensor, a wrong LayerNorm placement or a missing post LayerNorm shows.
mod hf {
    use super::{Tensor, HIDDEN, INTER};
    use std::collections::BTreeMap;

    pub type Rows = Vec<Vec<f64>>;

    pub struct Model<'a> {
        by_name: BTreeMap<&'a str, &'a [f32]>,
    }

    impl<'a> Model<'a> {
        pub fn new(tensors: &'a [Tensor]) -> Model<'a> {
            Model { by_name: tensors.iter().map(|t| (t.name.as_str(), t.values.as_slice())).collect() }
        }
        fn get(&self, name: &str) -> Vec<f64> {
            self.by_name[name].iter().map(|&v| v as f64).collect()
        }
        /// y = x Wᵀ + b, W stored [out, in].
        fn linear(&self, x: &Rows, name: &str) -> Rows {
            let (w, b) = (self.get(&format!("{name}.weight")), self.get(&format!("{name}.bias")));
            let inp = x[0].len();
            x.iter().map(|row| (0..b.len()).map(|o| b[o] + (0..inp).map(|k| row[k] * w[o * inp + k]).sum::<f64>()).collect()).collect()
        }
        fn norm(&self, x: &Rows, name: &str, (g, b): (&str, &str), eps: f64) -> Rows {
            let (gamma, beta) = (self.get(&format!("{name}.{g}")), self.get(&format!("{name}.{b}")));
            x.iter()
                .map(|row| {
                    let n = row.len() as f64;
                    let mean = row.iter().sum::<f64>() / n;
                    let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
                    row.iter().enumerate().map(|(i, v)| (v - mean) / (var + eps).sqrt() * gamma[i] + beta[i]).collect()
                })
                .collect()
        }
        fn attention(&self, x: &Rows, [q, k, v, o]: [&str; 4], heads: usize) -> Rows {
            let (q, k, v) = (self.linear(x, q), self.linear(x, k), self.linear(x, v));
            let d = HIDDEN / heads;
            let t = x.len();
            let mut context = vec![vec![0.0; HIDDEN]; t];
            for h in 0..heads {
                for i in 0..t {
                    let scores: Vec<f64> = (0..t).map(|j| (0..d).map(|c| q[i][h * d + c] * k[j][h * d + c]).sum::<f64>() / (d as f64).sqrt()).collect();
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for c in 0..d {
                        context[i][h * d + c] = (0..t).map(|j| e[j] / sum * v[j][h * d + c]).sum();
                    }
                }
            }
            self.linear(&context, o)
        }
        pub fn siglip(&self, mut x: Rows, layers: usize, heads: usize, eps: f64) -> Rows {
            for i in 0..layers {
                let p = format!("vision_model.encoder.layers.{i}");
                let h = self.norm(&x, &format!("{p}.layer_norm1"), ("weight", "bias"), eps);
                let names = ["q_proj", "k_proj", "v_proj", "out_proj"].map(|n| format!("{p}.self_attn.{n}"));
                let a = self.attention(&h, names.each_ref().map(String::as_str), heads);
                x = add(&x, &a);
                let h = self.norm(&x, &format!("{p}.layer_norm2"), ("weight", "bias"), eps);
                let up = map(&self.linear(&h, &format!("{p}.mlp.fc1")), gelu_tanh);
                x = add(&x, &self.linear(&up, &format!("{p}.mlp.fc2")));
            }
            self.norm(&x, "vision_model.post_layernorm", ("weight", "bias"), eps)
        }
        pub fn bert(&self, mut x: Rows, layers: usize, heads: usize, eps: f64) -> Rows {
            for i in 0..layers {
                let p = format!("bert.encoder.layer.{i}");
                let names = ["self.query", "self.key", "self.value", "output.dense"].map(|n| format!("{p}.attention.{n}"));
                let a = self.attention(&x, names.each_ref().map(String::as_str), heads);
                x = self.norm(&add(&x, &a), &format!("{p}.attention.output.LayerNorm"), ("gamma", "beta"), eps);
                let up = map(&self.linear(&x, &format!("{p}.intermediate.dense")), gelu_erf);
                assert_eq!(up[0].len(), INTER);
                let down = self.linear(&up, &format!("{p}.output.dense"));
                x = self.norm(&add(&x, &down), &format!("{p}.output.LayerNorm"), ("gamma", "beta"), eps);
            }
            x
        }
    }

    fn add(a: &Rows, b: &Rows) -> Rows {
        a.iter().zip(b).map(|(x, y)| x.iter().zip(y).map(|(p, q)| p + q).collect()).collect()
    }
    fn map(a: &Rows, f: fn(f64) -> f64) -> Rows {
        a.iter().map(|r| r.iter().map(|&v| f(v)).collect()).collect()
    }
    fn gelu_tanh(x: f64) -> f64 {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    }
    /// erf by Abramowitz and Stegun 7.1.26 (error below 1.5e-7).
    fn gelu_erf(x: f64) -> f64 {
        let z = x / std::f64::consts::SQRT_2;
        let t = 1.0 / (1.0 + 0.3275911 * z.abs());
        let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
        let erf = (1.0 - poly * (-z * z).exp()).copysign(z);
        0.5 * x * (1.0 + erf)
    }

    /// The largest |device − model| over the largest |model|.
    pub fn relative_error(device: &[f32], model: &Rows) -> f64 {
        let flat: Vec<f64> = model.iter().flatten().cloned().collect();
        let scale = flat.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        device.iter().zip(&flat).map(|(d, m)| (*d as f64 - m).abs()).fold(0.0, f64::max) / scale
    }
}

fn rows(values: &[f32], width: usize) -> hf::Rows {
    values.chunks(width).map(|r| r.iter().map(|&v| half::f16::from_f32(v).to_f32() as f64).collect()).collect()
}

fn write_model(dir: &Path, config: &str, tensors: &[Tensor]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    std::fs::write(dir.join("model.safetensors"), safetensors_bytes(tensors)).unwrap();
}

/// The same tensors in two shards with a `model.safetensors.index.json`.
fn write_sharded(dir: &Path, config: &str, tensors: Vec<Tensor>) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    let half = tensors.len() / 2;
    let (first, second) = tensors.split_at(half);
    let mut map = BTreeMap::new();
    for (k, shard) in [first, second].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", k + 1);
        std::fs::write(dir.join(&file), safetensors_bytes(shard)).unwrap();
        for t in shard.iter() {
            map.insert(t.name.clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_string_pretty(&index).unwrap()).unwrap();
}

fn import(model: &Path, out: &Path, extra: &[&str]) -> common::Output {
    let mut args = vec!["import", model.to_str().unwrap(), "-o", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    ipuq(&args, model.parent().unwrap())
}

/// Exit 2 and one `error:` line containing every one of `needles`.
fn assert_error(out: &common::Output, needles: &[&str]) {
    assert_eq!(out.code, 2, "expected exit 2:\nstdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
    let line = out.stderr.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("no error line:\n{}", out.stderr));
    for needle in needles {
        assert!(line.contains(needle), "the error does not name {needle:?}:\n{line}");
    }
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
}

fn run(workload: &Path, extra: &[&str]) -> common::Output {
    let dir = workload.parent().unwrap();
    let mut args = vec!["run", workload.to_str().unwrap(), "--target", "small16", "-o", "pkg"];
    args.extend_from_slice(extra);
    ipuq(&args, dir)
}

#[test]
fn a_siglip_checkpoint_imports_runs_on_an_npy_input_and_matches_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("siglip-tiny");
    write_model(&model, SIGLIP_CONFIG, &siglip_tensors(Dtype::F32));
    let workload = dir.path().join("siglip.toml");
    let out = import(&model, &workload, &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(field(&out.stdout, "workload=", "workload").as_deref(), Some("siglip-vision-f16-b1-t16-d32-h2-m64-l2"));
    assert_eq!(field(&out.stdout, "workload=", "weights").as_deref(), Some("34"), "16 per layer and the post LayerNorm");
    assert_eq!(field(&out.stdout, "workload=", "postLayerNorm").as_deref(), Some("true"));
    let text = std::fs::read_to_string(&workload).unwrap();
    assert!(text.contains("path = \"siglip-tiny/model.safetensors\""), "paths are relative to the workload:\n{text}");
    assert!(!text.contains("text_model"), "the text tower is not imported");

    // Our own input, read back from the dump with the output.
    let tokens: Vec<f32> = {
        let mut s = Stream(99);
        (0..16 * HIDDEN).map(|_| s.next() * 2.0).collect()
    };
    write_npy(&dir.path().join("x.npy"), DType::F32, &[16, HIDDEN as u64], &tokens).unwrap();
    let out = run(&workload, &["--input", "hidden_states=x.npy", "--dump", "dump"]);
    assert_pass(&out);
    let output = read_npy(&dir.path().join("dump/last_hidden_state.npy")).unwrap();
    assert_eq!(output.shape, vec![16, HIDDEN as u64]);
    assert_eq!(output.dtype, DType::F16);
    let given = read_npy(&dir.path().join("dump/hidden_states.npy")).unwrap();
    let rounded: Vec<f32> = tokens.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
    assert_eq!(given.values, rounded, "the run used the supplied input");
    let tensors = siglip_tensors(Dtype::F32);
    let model_output = hf::Model::new(&tensors).siglip(rows(&tokens, HIDDEN), LAYERS, 2, 1e-6);
    let error = hf::relative_error(&output.values, &model_output);
    eprintln!("siglip: largest error against Hugging Face's forward pass {error:.5} of the largest value");
    assert!(error < 0.01, "the imported SigLIP differs from Hugging Face's forward pass by {error} of the largest value");
    assert!(output.values.iter().all(|v| v.is_finite()));

    // Another input gives another output (the input's bytes entered the run), still passing.
    let other: Vec<f32> = tokens.iter().map(|v| -v).collect();
    write_npy(&dir.path().join("y.npy"), DType::F16, &[16, HIDDEN as u64], &other).unwrap();
    let out = run(&workload, &["--input", "hidden_states=y.npy", "--dump", "dump2"]);
    assert_pass(&out);
    let second = read_npy(&dir.path().join("dump2/last_hidden_state.npy")).unwrap();
    assert_ne!(second.values, output.values);
    // A dump directory that cannot be made (under a file) exits 2 naming the option and path.
    let out = run(&workload, &["--input", "hidden_states=y.npy", "--dump", "x.npy/dump"]);
    assert_error(&out, &["--dump", "x.npy/dump", "cannot create the directory"]);

    // --layers imports a prefix of the stack.
    let one = dir.path().join("one.toml");
    let out = import(&model, &one, &["--layers", "1", "--tokens", "8"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(field(&out.stdout, "workload=", "workload").as_deref(), Some("siglip-vision-f16-b1-t8-d32-h2-m64-l1"));
}

#[test]
fn a_sharded_bert_checkpoint_in_bf16_imports_runs_and_matches_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("bert-tiny");
    write_sharded(&model, BERT_CONFIG, bert_tensors(Dtype::BF16));
    let workload = dir.path().join("bert.toml");
    let out = import(&model, &workload, &["--tokens", "16"]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(field(&out.stdout, "workload=", "workload").as_deref(), Some("bert-encoder-f16-b1-t16-d32-h2-m64-l2"));
    assert_eq!(field(&out.stdout, "workload=", "weights").as_deref(), Some("32"));
    let text = std::fs::read_to_string(&workload).unwrap();
    assert!(text.contains("model-00001-of-00002.safetensors") && text.contains("model-00002-of-00002.safetensors"), "{text}");
    assert!(text.contains("approximate = \"none\""), "BERT's gelu is exact:\n{text}");
    let out = run(&workload, &["--dump", "dump"]);
    assert_pass(&out);
    let output = read_npy(&dir.path().join("dump/last_hidden_state.npy")).unwrap();
    assert_eq!(output.shape, vec![16, HIDDEN as u64]);
    // The workload's own Gaussian input, as the run dumped it, through Hugging Face's BERT layers.
    let input = read_npy(&dir.path().join("dump/hidden_states.npy")).unwrap();
    let tensors: Vec<Tensor> = bert_tensors(Dtype::BF16)
        .into_iter()
        .map(|t| Tensor { values: t.values.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect(), ..t })
        .collect();
    let model_output = hf::Model::new(&tensors).bert(rows(&input.values, HIDDEN), LAYERS, 2, 1e-12);
    let error = hf::relative_error(&output.values, &model_output);
    eprintln!("bert: largest error against Hugging Face's forward pass {error:.5} of the largest value");
    assert!(error < 0.01, "the imported BERT differs from Hugging Face's forward pass by {error} of the largest value");

    // BERT's default is 128 tokens, capped by max_position_embeddings (64 here).
    let out = import(&model, &dir.path().join("default.toml"), &[]);
    assert_eq!(field(&out.stdout, "workload=", "tokens").as_deref(), Some("64"), "{}", out.stderr);
    let out = import(&model, &dir.path().join("long.toml"), &["--tokens", "65"]);
    assert_error(&out, &["config.json", "max_position_embeddings"]);
}

#[test]
fn bad_checkpoint_files_exit_2_naming_the_file_and_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let good = safetensors_bytes(&siglip_tensors(Dtype::F16));
    let case = |name: &str, bytes: &[u8]| {
        let model = dir.path().join(name);
        std::fs::create_dir_all(&model).unwrap();
        std::fs::write(model.join("config.json"), SIGLIP_CONFIG).unwrap();
        std::fs::write(model.join("model.safetensors"), bytes).unwrap();
        import(&model, &dir.path().join(format!("{name}.toml")), &[])
    };
    let file = |name: &str| format!("{name}/model.safetensors");

    let out = case("truncated", &good[..good.len() - 100]);
    assert_error(&out, &[&file("truncated"), "truncated"]);
    let out = case("short", &good[..5]);
    assert_error(&out, &[&file("short"), "not a valid safetensors file"]);
    let mut corrupt = good.clone();
    corrupt[8..40].copy_from_slice(&[b'#'; 32]);
    let out = case("corrupt", &corrupt);
    assert_error(&out, &[&file("corrupt"), "not a valid safetensors file", "header"]);

    let mut missing = siglip_tensors(Dtype::F16);
    missing.retain(|t| t.name != "vision_model.encoder.layers.1.mlp.fc2.bias");
    let out = case("missing", &safetensors_bytes(&missing));
    assert_error(&out, &[&file("missing"), "vision_model.encoder.layers.1.mlp.fc2.bias", "missing"]);

    let mut shaped = siglip_tensors(Dtype::F16);
    let fc1 = shaped.iter_mut().find(|t| t.name == "vision_model.encoder.layers.0.mlp.fc1.weight").unwrap();
    fc1.shape = vec![HIDDEN, INTER];
    let out = case("shape", &safetensors_bytes(&shaped));
    assert_error(&out, &[&file("shape"), "vision_model.encoder.layers.0.mlp.fc1.weight", "[32, 64]", "[64, 32]"]);

    let mut typed = siglip_tensors(Dtype::F16);
    typed.iter_mut().find(|t| t.name == "vision_model.encoder.layers.0.self_attn.k_proj.weight").unwrap().dtype = Dtype::F64;
    let out = case("dtype", &safetensors_bytes(&typed));
    assert_error(&out, &[&file("dtype"), "vision_model.encoder.layers.0.self_attn.k_proj.weight", "F64"]);

    // A shard the index names but that is not there.
    let model = dir.path().join("shard");
    write_sharded(&model, SIGLIP_CONFIG, siglip_tensors(Dtype::F32));
    std::fs::remove_file(model.join("model-00002-of-00002.safetensors")).unwrap();
    let out = import(&model, &dir.path().join("shard.toml"), &[]);
    assert_error(&out, &["model-00002-of-00002.safetensors", "cannot read"]);
}

#[test]
fn bad_configs_exit_2_naming_the_file_and_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = siglip_tensors(Dtype::F16);
    let case = |name: &str, config: &str| {
        let model = dir.path().join(name);
        write_model(&model, config, &tensors);
        import(&model, &dir.path().join(format!("{name}.toml")), &[])
    };
    let out = case("no-type", &SIGLIP_CONFIG.replace(r#""model_type": "siglip","#, ""));
    assert_error(&out, &["no-type/config.json", "field 'model_type'", "missing"]);
    let out = case("no-vision", r#"{"model_type": "siglip", "text_config": {}}"#);
    assert_error(&out, &["no-vision/config.json", "field 'vision_config'", "missing"]);
    let out = case("gpt2", r#"{"model_type": "gpt2", "n_layer": 2}"#);
    assert_error(&out, &["gpt2/config.json", "unknown model_type 'gpt2'"]);
    let out = case("typed", &SIGLIP_CONFIG.replace(r#""hidden_size": 32, "intermediate_size""#, r#""hidden_size": "32", "intermediate_size""#));
    assert_error(&out, &["typed/config.json", "field 'vision_config.hidden_size'", "positive integer"]);
    let out = case("act", &SIGLIP_CONFIG.replace("gelu_pytorch_tanh", "relu"));
    assert_error(&out, &["act/config.json", "field 'vision_config.hidden_act'", "relu"]);
    let out = case("layers", SIGLIP_CONFIG);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = import(&dir.path().join("layers"), &dir.path().join("three.toml"), &["--layers", "3"]);
    assert_error(&out, &["config.json", "num_hidden_layers", "--layers"]);
    // Dimensions past what ipuq supports name the tokens and layers they came with.
    let out = import(&dir.path().join("layers"), &dir.path().join("huge.toml"), &["--tokens", "100000000"]);
    assert_error(&out, &["layers/config.json", "field '(dimensions)'", "more than the 2147483648 ipuq supports", "with 100000000 tokens and 2 layers"]);
    let out = case("json", "{ not json");
    assert_error(&out, &["json/config.json", "not valid JSON"]);
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = import(&empty, &dir.path().join("empty.toml"), &[]);
    assert_error(&out, &["empty/config.json", "cannot read"]);
}

/// A hand-written workload whose weight is a checkpoint tensor (`init.safetensors`), with
/// only a matrix product, so that it runs whatever operations the encoder needs.
fn product_workload(model: &Path, digest: &str) -> String {
    format!(
        r#"name = "checkpoint-product"
outputs = ["y"]

[[tensor]]
name = "x"
shape = [16, 32]
dtype = "f16"
role = "input"
init = {{ gaussian = {{ seed = 1, std = 1.0 }} }}

[[tensor]]
name = "w"
shape = [64, 32]
dtype = "f16"
role = "weight"

[tensor.init.safetensors]
path = "{}/model.safetensors"
tensor = "vision_model.encoder.layers.0.mlp.fc1.weight"
digest = "{digest}"

[[operation]]
name = "y"
op = "matmul"
inputs = ["x", "w"]
transpose_b = true
"#,
        model.file_name().unwrap().to_str().unwrap()
    )
}

#[test]
fn checkpoint_weights_and_npy_inputs_enter_the_run_and_changed_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    let tensors = siglip_tensors(Dtype::F32);
    write_model(&model, SIGLIP_CONFIG, &tensors);
    let name = "vision_model.encoder.layers.0.mlp.fc1.weight";
    let stored = read_tensor(&model.join("model.safetensors"), name).unwrap();
    let workload = dir.path().join("w.toml");
    std::fs::write(&workload, product_workload(&model, &stored.digest())).unwrap();

    // Our input in, the product out: the device's output is x·Wᵀ with W from the checkpoint.
    let mut s = Stream(5);
    let x: Vec<f32> = (0..16 * HIDDEN).map(|_| s.next()).collect();
    write_npy(&dir.path().join("x.npy"), DType::F32, &[16, HIDDEN as u64], &x).unwrap();
    let out = run(&workload, &["--input", "x=x.npy", "--dump", "dump"]);
    assert_pass(&out);
    let y = read_npy(&dir.path().join("dump/y.npy")).unwrap();
    assert_eq!(y.shape, vec![16, INTER as u64]);
    let w = &tensors.iter().find(|t| t.name == name).unwrap().values;
    let f16 = |v: f32| half::f16::from_f32(v).to_f32();
    for (i, j) in [(0, 0), (3, 17), (15, 63)] {
        let expected: f32 = (0..HIDDEN).map(|k| f16(x[i * HIDDEN + k]) * f16(w[j * HIDDEN + k])).sum();
        let got = y.values[i * INTER + j];
        assert!((got - expected).abs() < 0.02, "y[{i},{j}] = {got}, x·Wᵀ = {expected}");
    }
    let dumped_x = read_npy(&dir.path().join("dump/x.npy")).unwrap();
    assert_eq!(dumped_x.values, x.iter().map(|&v| f16(v)).collect::<Vec<_>>(), "the run used the supplied input");

    // A wrong shape or an unknown name for --input: exit 2 naming the file and the tensor.
    write_npy(&dir.path().join("bad.npy"), DType::F32, &[15, HIDDEN as u64], &vec![0.0; 15 * HIDDEN]).unwrap();
    let out = run(&workload, &["--input", "x=bad.npy"]);
    assert_error(&out, &["bad.npy", "'x'", "[15, 32]", "[16, 32]"]);
    let out = run(&workload, &["--input", "pixels=bad.npy"]);
    assert_error(&out, &["bad.npy", "'pixels'", "inputs: x"]);
    let out = run(&workload, &["--input", "w=bad.npy"]);
    assert_error(&out, &["bad.npy", "not an input"]);
    let out = run(&workload, &["--input", "x"]);
    assert_error(&out, &["NAME=FILE.npy"]);
    // Values a run cannot take: a NaN, and a finite value beyond f16's range, each named by
    // its element; an infinity given as such is taken (the output is then not finite, and
    // the verdict fails, exit 1).
    let mut odd = x.clone();
    odd[HIDDEN + 2] = f32::NAN;
    write_npy(&dir.path().join("nan.npy"), DType::F32, &[16, HIDDEN as u64], &odd).unwrap();
    let out = run(&workload, &["--input", "x=nan.npy"]);
    assert_error(&out, &["--input x=nan.npy: nan.npy: element [1, 2] is NaN"]);
    odd[HIDDEN + 2] = -7.0e4;
    write_npy(&dir.path().join("big.npy"), DType::F32, &[16, HIDDEN as u64], &odd).unwrap();
    let out = run(&workload, &["--input", "x=big.npy"]);
    assert_error(&out, &["big.npy: element [1, 2] is -70000, beyond f16's range (largest finite 65504)"]);
    odd[HIDDEN + 2] = f32::NEG_INFINITY;
    write_npy(&dir.path().join("inf.npy"), DType::F32, &[16, HIDDEN as u64], &odd).unwrap();
    let out = run(&workload, &["--input", "x=inf.npy"]);
    assert_eq!(out.code, 1, "an infinite input is run and fails the check: {}", out.stderr);
    assert!(out.stdout.contains("numericalTest=FAIL"), "{}", out.stdout);

    // Other weights under the same name: the digest no longer matches.
    let mut changed = siglip_tensors(Dtype::F32);
    changed.iter_mut().find(|t| t.name == name).unwrap().values[3] += 0.5;
    std::fs::write(model.join("model.safetensors"), safetensors_bytes(&changed)).unwrap();
    let out = run(&workload, &[]);
    assert_error(&out, &["m/model.safetensors", name, "digest"]);
    // Truncated after the workload was written.
    let bytes = std::fs::read(model.join("model.safetensors")).unwrap();
    std::fs::write(model.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let out = run(&workload, &[]);
    assert_error(&out, &["m/model.safetensors", "truncated"]);
    // A checkpoint value beyond f16's range: refused at load, naming the workload's tensor,
    // the element and the checkpoint's tensor and file.
    let mut wide = siglip_tensors(Dtype::F32);
    wide.iter_mut().find(|t| t.name == name).unwrap().values[HIDDEN + 5] = 1.0e5;
    std::fs::write(model.join("model.safetensors"), safetensors_bytes(&wide)).unwrap();
    let digest = read_tensor(&model.join("model.safetensors"), name).unwrap().digest();
    std::fs::write(&workload, product_workload(&model, &digest)).unwrap();
    let out = run(&workload, &[]);
    assert_error(&out, &["tensor 'w': element [1, 5] is 100000, beyond f16's range", name, "m/model.safetensors"]);
    // A digest that is not blake3 hex is refused when the workload is read.
    std::fs::write(&workload, product_workload(&model, "abc")).unwrap();
    let out = run(&workload, &[]);
    assert_error(&out, &["w.toml", "tensor 'w'", "digest"]);
}

#[test]
fn the_reader_never_panics_on_mutated_files() {
    let dir = tempfile::tempdir().unwrap();
    let good = safetensors_bytes(&siglip_tensors(Dtype::BF16)[..6]);
    let path = dir.path().join("model.safetensors");
    let name = "vision_model.encoder.layers.0.self_attn.q_proj.weight";
    std::fs::write(&path, &good).unwrap();
    let stored = read_tensor(&path, name).unwrap();
    assert_eq!(stored.shape, vec![HIDDEN as u64, HIDDEN as u64]);
    let mut stream = Stream(7);
    let mut rejected = 0;
    for round in 0..2000u32 {
        let mut bytes = good.clone();
        match round % 4 {
            0 => bytes.truncate(((stream.next() + 1.0) * 0.5 * good.len() as f32) as usize),
            1 => {
                for _ in 0..1 + round % 5 {
                    let at = (((stream.next() + 1.0) * 0.5) * (bytes.len() - 1) as f32) as usize;
                    bytes[at] = (stream.next() * 128.0 + 128.0) as u8;
                }
            }
            2 => {
                // Within the header, where the structure is.
                let at = 8 + (((stream.next() + 1.0) * 0.5) * 200.0) as usize;
                bytes[at] ^= 1 << (round % 8);
            }
            _ => bytes[..8].copy_from_slice(&((stream.next().abs() * 1e6) as u64).to_le_bytes()),
        }
        std::fs::write(&path, &bytes).unwrap();
        if read_tensor(&path, name).is_err() {
            rejected += 1;
        }
    }
    assert!(rejected > 500, "most mutations are caught ({rejected} of 2000)");
}

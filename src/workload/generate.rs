//! Generators for the seed's two workload families: the SigLIP MLP and grouped attention.
//!
//! Each family is a parameter struct whose `Default` is the seed's shape; a generator turns the
//! parameters into a `WorkloadFile` whose name is derived from them exactly as the seed named
//! its workloads, and whose `[family]` table holds the keys of the seed's result line. Every
//! generated file is validated with `Graph::from_file` before it is returned, so a generator
//! can never hand out a workload the compiler would reject. This module writes no files.
//!
//! Conventions a reader of a generated file should know:
//! - Names: `siglip-mlp-f16-b{batch}-t{tokens}-d{dim}-h{hidden}-n{blocks}`, with `-biases`
//!   appended when biases are on (the seed's workload had none), and
//!   `attention-grouped-materialized-gaussian-f16-b{batch}-t{tokens}-h{heads}-kv{kv}-d{dim}`.
//!   `from_name` inverts both, and takes a bare family name for the seed's shape.
//! - The dtype is always f16 and is not a parameter: the IR runs matmul on the AMP in f16 only.
//! - Inputs are Gaussian with standard deviation 1; weights are Gaussian with standard deviation
//!   1/sqrt(fan_in), so every matmul's output has a standard deviation near 1 and f16 values
//!   stay far from overflow however many blocks are chained.
//! - Seeds are fixed and distinct per tensor: inputs 1, 2, 3; block `i`'s tensors 100 + 10·i + j.
//! - The IR's `add` needs equal shapes, so MLP biases are stored pre-broadcast: `b1_i` has shape
//!   [rows, hidden] and `b2_i` [rows, dimension]. Their rows are independent Gaussian draws (a
//!   model's bias would repeat one row); the arithmetic and the data movement are the same.
//! - Attention with batch > 1 folds the batch into the head axis ([B·H, T, D]); the IR's grouped
//!   matmul then pairs query head b·H + h with key/value head b·KV + h / (H / KV), as grouping
//!   requires, so no new operation is needed.

use std::collections::BTreeMap;

use ipuq_queries::ir::{DType, Graph, Init, OperationDecl, Role, TensorDecl, WorkloadError, WorkloadFile};

pub const SIGLIP_MLP_BENCHMARK: &str = "siglip-mlp-f16";
pub const ATTENTION_BENCHMARK: &str = "attention-grouped-materialized-gaussian";

/// One or more SigLIP MLP blocks: `y = gelu_tanh(x · W1 [+ b1]) · W2 [+ b2]`, chained.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiglipMlp {
    pub batch: u32,
    pub tokens: u32,
    pub dimension: u32,
    pub hidden: u32,
    pub blocks: u32,
    pub biases: bool,
}

impl Default for SiglipMlp {
    /// The seed's `siglip-mlp-f16-b1-t729-d1152-h4304-n1`.
    fn default() -> SiglipMlp {
        SiglipMlp { batch: 1, tokens: 729, dimension: 1152, hidden: 4304, blocks: 1, biases: false }
    }
}

impl SiglipMlp {
    pub fn name(&self) -> String {
        let SiglipMlp { batch, tokens, dimension, hidden, blocks, biases } = self;
        let suffix = if *biases { "-biases" } else { "" };
        format!("{SIGLIP_MLP_BENCHMARK}-b{batch}-t{tokens}-d{dimension}-h{hidden}-n{blocks}{suffix}")
    }
}

/// Grouped-head attention with the score matrix materialised: `softmax(Q·Kᵀ/√D)·V`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupedAttention {
    pub batch: u32,
    pub tokens: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dimension: u32,
}

impl Default for GroupedAttention {
    /// SigLIP's shape (729 tokens, 16 heads of 72) with 4 key/value heads, as the design asks.
    fn default() -> GroupedAttention {
        GroupedAttention { batch: 1, tokens: 729, heads: 16, kv_heads: 4, head_dimension: 72 }
    }
}

impl GroupedAttention {
    pub fn name(&self) -> String {
        let GroupedAttention { batch, tokens, heads, kv_heads, head_dimension } = self;
        format!("{ATTENTION_BENCHMARK}-f16-b{batch}-t{tokens}-h{heads}-kv{kv_heads}-d{head_dimension}")
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GenerateError {
    #[error("{family}: parameter '{parameter}': {message}")]
    Parameter { family: &'static str, parameter: &'static str, message: String },
    #[error("{family}: the generated workload does not validate: {source}")]
    Invalid { family: &'static str, source: WorkloadError },
    #[error("'{name}' is not a generated workload name: {message}")]
    UnknownName { name: String, message: String },
}

/// The SigLIP MLP workload for `params`.
pub fn siglip_mlp(params: &SiglipMlp) -> Result<WorkloadFile, GenerateError> {
    let family = SIGLIP_MLP_BENCHMARK;
    for (parameter, value) in [("batch", params.batch), ("tokens", params.tokens), ("dimension", params.dimension), ("hidden", params.hidden), ("blocks", params.blocks)] {
        positive(family, parameter, value)?;
    }
    let rows = product(family, "tokens", &[params.batch, params.tokens])?;
    let (dimension, hidden) = (params.dimension, params.hidden);
    let mut tensors = vec![gaussian_tensor("x", vec![rows, dimension], Role::Input, 1, 1.0)];
    let mut operations = Vec::new();
    let mut current = "x".to_string();
    for block in 0..params.blocks {
        let seed = 100 + 10 * block as u64;
        let (w1, w2, b1, b2) = (format!("w1_{block}"), format!("w2_{block}"), format!("b1_{block}"), format!("b2_{block}"));
        let (h, g, y) = (format!("h_{block}"), format!("g_{block}"), format!("y_{block}"));
        tensors.push(gaussian_tensor(&w1, vec![dimension, hidden], Role::Weight, seed + 1, 1.0 / (dimension as f64).sqrt()));
        tensors.push(gaussian_tensor(&w2, vec![hidden, dimension], Role::Weight, seed + 2, 1.0 / (hidden as f64).sqrt()));
        if params.biases {
            // Pre-broadcast to [rows, ..]: the IR's add is elementwise over equal shapes.
            tensors.push(gaussian_tensor(&b1, vec![rows, hidden], Role::Weight, seed + 3, 0.5));
            tensors.push(gaussian_tensor(&b2, vec![rows, dimension], Role::Weight, seed + 4, 0.5));
            let (xw1, gw2) = (format!("xw1_{block}"), format!("gw2_{block}"));
            operations.push(operation(&xw1, "matmul", &[&current, &w1]));
            operations.push(operation(&h, "add", &[&xw1, &b1]));
            operations.push(operation(&g, "gelu", &[&h]));
            operations.push(operation(&gw2, "matmul", &[&g, &w2]));
            operations.push(operation(&y, "add", &[&gw2, &b2]));
        } else {
            operations.push(operation(&h, "matmul", &[&current, &w1]));
            operations.push(operation(&g, "gelu", &[&h]));
            operations.push(operation(&y, "matmul", &[&g, &w2]));
        }
        current = y;
    }
    let family_table = BTreeMap::from([
        ("benchmark".to_string(), toml::Value::String(family.into())),
        ("batch".to_string(), integer(params.batch)),
        ("tokens".to_string(), integer(params.tokens)),
        ("rows".to_string(), integer(rows)),
        ("dimension".to_string(), integer(dimension)),
        ("hiddenDimension".to_string(), integer(hidden)),
        ("blocks".to_string(), integer(params.blocks)),
        ("biases".to_string(), toml::Value::Boolean(params.biases)),
    ]);
    let file = WorkloadFile { name: params.name(), family: family_table, tensors, operations, outputs: vec![current], constraints: Vec::new() };
    validated(family, file)
}

/// The grouped attention workload for `params`.
pub fn grouped_attention(params: &GroupedAttention) -> Result<WorkloadFile, GenerateError> {
    let family = ATTENTION_BENCHMARK;
    let GroupedAttention { batch, tokens, heads, kv_heads, head_dimension } = *params;
    for (parameter, value) in [("batch", batch), ("tokens", tokens), ("heads", heads), ("kv_heads", kv_heads), ("head_dimension", head_dimension)] {
        positive(family, parameter, value)?;
    }
    if heads % kv_heads != 0 {
        return Err(GenerateError::Parameter {
            family,
            parameter: "kv_heads",
            message: format!("{kv_heads} key/value heads do not divide {heads} query heads evenly"),
        });
    }
    let rows = product(family, "tokens", &[batch, tokens])?;
    let query_width = product(family, "heads", &[heads, head_dimension])?;
    let key_width = product(family, "kv_heads", &[kv_heads, head_dimension])?;
    // The score matrix [B·H, T, T] is the largest value.
    product(family, "tokens", &[batch, heads, tokens, tokens])?;
    let tensors = vec![
        gaussian_tensor("q", vec![rows, query_width], Role::Input, 1, 1.0),
        gaussian_tensor("k", vec![rows, key_width], Role::Input, 2, 1.0),
        gaussian_tensor("v", vec![rows, key_width], Role::Input, 3, 1.0),
    ];
    let mut operations = Vec::new();
    // [B·T, n·D] → [B·n, T, D]: one matrix per (batch, head).
    let mut split_heads = |input: &str, count: u32| {
        let (rows_view, heads_view) = (format!("{input}_heads_rows"), format!("{input}_heads"));
        if batch == 1 {
            operations.push(reshape(&rows_view, input, vec![tokens, count, head_dimension]));
            operations.push(transpose(&heads_view, &rows_view, vec![1, 0, 2]));
        } else {
            let split = format!("{input}_heads_split");
            operations.push(reshape(&rows_view, input, vec![batch, tokens, count, head_dimension]));
            operations.push(transpose(&split, &rows_view, vec![0, 2, 1, 3]));
            operations.push(reshape(&heads_view, &split, vec![batch * count, tokens, head_dimension]));
        }
    };
    split_heads("q", heads);
    split_heads("k", kv_heads);
    split_heads("v", kv_heads);
    let mut scores = operation("scores", "matmul", &["q_heads", "k_heads"]);
    scores.transpose_b = true;
    operations.push(scores);
    let mut scaled = operation("scaled_scores", "scale", &["scores"]);
    scaled.factor = Some(1.0 / (head_dimension as f64).sqrt());
    operations.push(scaled);
    operations.push(operation("probabilities", "softmax", &["scaled_scores"]));
    operations.push(operation("context_heads", "matmul", &["probabilities", "v_heads"]));
    // [B·H, T, D] → [B·T, H·D]: heads side by side again, one row per token.
    if batch == 1 {
        operations.push(transpose("context_tokens", "context_heads", vec![1, 0, 2]));
    } else {
        operations.push(reshape("context_split", "context_heads", vec![batch, heads, tokens, head_dimension]));
        operations.push(transpose("context_tokens", "context_split", vec![0, 2, 1, 3]));
    }
    operations.push(reshape("out", "context_tokens", vec![rows, query_width]));
    let family_table = BTreeMap::from([
        ("benchmark".to_string(), toml::Value::String(family.into())),
        ("batch".to_string(), integer(batch)),
        ("tokens".to_string(), integer(tokens)),
        ("heads".to_string(), integer(heads)),
        ("kvHeads".to_string(), integer(kv_heads)),
        ("headDimension".to_string(), integer(head_dimension)),
    ]);
    let file = WorkloadFile { name: params.name(), family: family_table, tensors, operations, outputs: vec!["out".into()], constraints: Vec::new() };
    validated(family, file)
}

/// The workload a generated name stands for: a full name such as
/// `siglip-mlp-f16-b1-t729-d1152-h4304-n1`, or a bare family name for the seed's shape.
pub fn from_name(name: &str) -> Result<WorkloadFile, GenerateError> {
    let unknown = |message: String| GenerateError::UnknownName { name: name.to_string(), message };
    if name == SIGLIP_MLP_BENCHMARK {
        return siglip_mlp(&SiglipMlp::default());
    }
    if name == ATTENTION_BENCHMARK {
        return grouped_attention(&GroupedAttention::default());
    }
    if let Some(rest) = name.strip_prefix(&format!("{SIGLIP_MLP_BENCHMARK}-")) {
        let (rest, biases) = match rest.strip_suffix("-biases") {
            Some(rest) => (rest, true),
            None => (rest, false),
        };
        let [batch, tokens, dimension, hidden, blocks] = numbers(rest, ["b", "t", "d", "h", "n"]).map_err(unknown)?;
        return siglip_mlp(&SiglipMlp { batch, tokens, dimension, hidden, blocks, biases });
    }
    if name == super::encoder::SIGLIP_ENCODER_BENCHMARK {
        return super::encoder::siglip_encoder(&super::encoder::SiglipEncoder::default());
    }
    if let Some(rest) = name.strip_prefix(&format!("{}-", super::encoder::SIGLIP_ENCODER_BENCHMARK)) {
        let [batch, tokens, dimension, heads, hidden, layers] = numbers(rest, ["b", "t", "d", "h", "m", "l"]).map_err(unknown)?;
        return super::encoder::siglip_encoder(&super::encoder::SiglipEncoder { batch, tokens, dimension, heads, hidden, layers });
    }
    if let Some(rest) = name.strip_prefix(&format!("{ATTENTION_BENCHMARK}-f16-")) {
        let [batch, tokens, heads, kv_heads, head_dimension] = numbers(rest, ["b", "t", "h", "kv", "d"]).map_err(unknown)?;
        return grouped_attention(&GroupedAttention { batch, tokens, heads, kv_heads, head_dimension });
    }
    Err(unknown(format!(
        "known families are {SIGLIP_MLP_BENCHMARK}-b<batch>-t<tokens>-d<dim>-h<hidden>-n<blocks>[-biases] and \
         {ATTENTION_BENCHMARK}-f16-b<batch>-t<tokens>-h<heads>-kv<kv heads>-d<head dim> and \
         siglip-encoder-f16-b<batch>-t<tokens>-d<dim>-h<heads>-m<mlp width>-l<layers>"
    )))
}

/// The workload as TOML, with a comment line saying where it came from.
pub fn to_toml(file: &WorkloadFile) -> String {
    let body = toml::to_string(file).expect("a workload file always serialises to TOML");
    format!("# Generated by ipuq's workload generator: `{}`. Regenerate it rather than editing it.\n{body}", file.name)
}

/// `text` as dash-separated `<prefix><number>` parts with exactly the given prefixes.
fn numbers<const N: usize>(text: &str, prefixes: [&str; N]) -> Result<[u32; N], String> {
    let parts: Vec<&str> = text.split('-').collect();
    if parts.len() != N {
        return Err(format!("expected {N} parameters ({}), found {:?}", prefixes.join(", "), text));
    }
    let mut values = [0u32; N];
    for ((value, part), prefix) in values.iter_mut().zip(&parts).zip(prefixes) {
        let digits = part.strip_prefix(prefix).ok_or_else(|| format!("expected a '{prefix}<number>' part, found '{part}'"))?;
        *value = digits.parse().map_err(|_| format!("'{part}': '{digits}' is not a whole number"))?;
    }
    Ok(values)
}

fn positive(family: &'static str, parameter: &'static str, value: u32) -> Result<(), GenerateError> {
    if value == 0 {
        return Err(GenerateError::Parameter { family, parameter, message: "must be at least 1".into() });
    }
    Ok(())
}

/// The product of `factors`, or an error naming `parameter` if it overflows 32 bits.
fn product(family: &'static str, parameter: &'static str, factors: &[u32]) -> Result<u32, GenerateError> {
    factors.iter().try_fold(1u32, |acc, &f| acc.checked_mul(f)).ok_or_else(|| GenerateError::Parameter {
        family,
        parameter,
        message: format!("the tensor axis {} is too large", factors.iter().map(u32::to_string).collect::<Vec<_>>().join(" x ")),
    })
}

fn validated(family: &'static str, file: WorkloadFile) -> Result<WorkloadFile, GenerateError> {
    Graph::from_file(file.clone(), &file.name).map_err(|source| GenerateError::Invalid { family, source })?;
    Ok(file)
}

fn integer(value: u32) -> toml::Value {
    toml::Value::Integer(value as i64)
}

fn gaussian_tensor(name: &str, shape: Vec<u32>, role: Role, seed: u64, std: f64) -> TensorDecl {
    TensorDecl { name: name.into(), shape, dtype: DType::F16, role, init: Init::Gaussian { seed, std } }
}

pub(crate) fn operation(name: &str, op: &str, inputs: &[&str]) -> OperationDecl {
    OperationDecl {
        name: name.into(),
        op: op.into(),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        transpose_b: false,
        factor: None,
        shape: None,
        perm: None,
        eps: None,
        approximate: None,
    }
}

fn reshape(name: &str, input: &str, shape: Vec<u32>) -> OperationDecl {
    OperationDecl { shape: Some(shape), ..operation(name, "reshape", &[input]) }
}

fn transpose(name: &str, input: &str, perm: Vec<u32>) -> OperationDecl {
    OperationDecl { perm: Some(perm), ..operation(name, "transpose", &[input]) }
}

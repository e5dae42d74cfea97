//! The transformer encoder stack as IR operations: one builder for every encoder family
//! (the `siglip-encoder` generator, and Hugging Face imports of SigLIP and BERT checkpoints).
//!
//! The stack runs from `hidden_states` [batch·tokens, hidden] to `last_hidden_state` of the
//! same shape. Each layer is multi-head self-attention and an MLP, with residual adds and
//! LayerNorms placed by the layer style:
//! - `PreNorm` (SigLIP, ViT): `h = x + attn(LN1(x))`, then `y = h + mlp(LN2(h))`.
//! - `PostNorm` (BERT): `h = LN1(x + attn(x))`, then `y = LN2(h + mlp(h))`.
//!
//! Attention: Q, K, V = LN·Wᵀ + b with weights stored [out, in] as checkpoints store them
//! (`matmul` with `transpose_b`), heads split by reshape [B·T, H·D] → [B, T, H, D] and a
//! transpose to [B·H, T, D], scores = Q·Kᵀ (`transpose_b`), a `scale` by 1/√D that the planner
//! folds into the softmax, context = P·V, heads merged back to [B·T, H·D], then the output
//! projection. The MLP is `act(x·W1ᵀ + b1)·W2ᵀ + b2` with GELU (tanh or exact erf).
//!
//! The builder decides no tensor data: a callback names every parameter tensor and says how it
//! is initialised, so generators use seeded Gaussians and importers point at checkpoint files.
//! Value names are `l{layer}.{what}`; parameter names are the callback's.

use ipuq_queries::ir::{DType, Init, OperationDecl, Role, TensorDecl, WorkloadFile};

/// Where the LayerNorms sit relative to the residual adds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerStyle {
    /// SigLIP: `x + attn(LN1(x))`, then `+ mlp(LN2(·))`.
    PreNorm,
    /// BERT: `LN1(x + attn(x))`, then `LN2(· + mlp(·))`.
    PostNorm,
}

/// The MLP's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `gelu_pytorch_tanh`, `gelu_new`: GELU's tanh approximation.
    GeluTanh,
    /// `gelu`: exact GELU with erf.
    GeluErf,
}

/// The shape and style of an encoder stack.
#[derive(Clone, Debug, PartialEq)]
pub struct EncoderSpec {
    pub batch: u32,
    pub tokens: u32,
    pub hidden: u32,
    pub heads: u32,
    /// The MLP's inner width.
    pub intermediate: u32,
    pub layers: u32,
    pub style: LayerStyle,
    pub activation: Activation,
    /// LayerNorm epsilon (every LayerNorm of the stack).
    pub eps: f64,
    /// A LayerNorm after the last layer (SigLIP's `post_layernorm`).
    pub final_norm: bool,
}

/// The place of a parameter in a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    /// The LayerNorm of the attention half: before attention (PreNorm, SigLIP `layer_norm1`) or
    /// after its residual add (PostNorm, BERT `attention.output.LayerNorm`).
    AttentionNorm,
    Query,
    Key,
    Value,
    /// The attention output projection.
    AttentionOutput,
    /// The LayerNorm of the MLP half (SigLIP `layer_norm2`, BERT `output.LayerNorm`).
    MlpNorm,
    /// The MLP's first product, hidden → intermediate (SigLIP `fc1`, BERT `intermediate.dense`).
    MlpUp,
    /// The MLP's second product, intermediate → hidden (SigLIP `fc2`, BERT `output.dense`).
    MlpDown,
    /// The LayerNorm after the last layer (only when `final_norm`; `layer` is then `layers`).
    FinalNorm,
}

/// Which tensor of a site: a product's weight [out, in] or bias [out]; a LayerNorm's gamma
/// (`Weight`) or beta (`Bias`), both [hidden].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Weight,
    Bias,
}

/// One parameter tensor the builder needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parameter {
    pub layer: u32,
    pub site: Site,
    pub part: Part,
    pub shape: Vec<u32>,
}

impl Site {
    pub fn is_norm(self) -> bool {
        matches!(self, Site::AttentionNorm | Site::MlpNorm | Site::FinalNorm)
    }
}

/// The encoder's tensors and operations (parameters in the order the callback was asked).
#[derive(Clone, Debug, PartialEq)]
pub struct Encoder {
    pub tensors: Vec<TensorDecl>,
    pub operations: Vec<OperationDecl>,
}

/// The input and output names of every encoder stack.
pub const INPUT: &str = "hidden_states";
pub const OUTPUT: &str = "last_hidden_state";

impl Encoder {
    /// A workload of this encoder (not yet validated: `Graph::from_file` does that).
    pub fn into_file(self, name: String, family: std::collections::BTreeMap<String, toml::Value>) -> WorkloadFile {
        WorkloadFile { name, family, tensors: self.tensors, operations: self.operations, outputs: vec![OUTPUT.into()], constraints: Vec::new() }
    }
}

/// Check the spec's shape: every count positive, heads dividing the hidden width, and the
/// largest tensor (the scores, [B·H, T, T]) within 32-bit element offsets.
pub fn check(spec: &EncoderSpec) -> Result<(), String> {
    for (name, v) in [("batch", spec.batch), ("tokens", spec.tokens), ("hidden", spec.hidden), ("heads", spec.heads), ("intermediate", spec.intermediate), ("layers", spec.layers)] {
        if v == 0 {
            return Err(format!("{name} must be at least 1"));
        }
    }
    if spec.hidden % spec.heads != 0 {
        return Err(format!("{} heads do not divide the hidden width {}", spec.heads, spec.hidden));
    }
    if !(spec.eps.is_finite() && spec.eps > 0.0) {
        return Err(format!("eps must be finite and positive, got {}", spec.eps));
    }
    let scores = spec.batch as u64 * spec.heads as u64 * spec.tokens as u64 * spec.tokens as u64;
    let widest = spec.batch as u64 * spec.tokens as u64 * spec.hidden.max(spec.intermediate) as u64;
    if scores.max(widest) > ipuq_queries::ir::MAX_ELEMENTS {
        return Err(format!("the largest value has {} elements, more than the {} ipuq supports", scores.max(widest), ipuq_queries::ir::MAX_ELEMENTS));
    }
    Ok(())
}

/// Build the encoder stack. `parameter` names each parameter tensor and gives its initialiser;
/// an error from it is returned as is.
pub fn build<E>(spec: &EncoderSpec, mut parameter: impl FnMut(&Parameter) -> Result<(String, Init), E>) -> Result<Encoder, BuildError<E>> {
    check(spec).map_err(BuildError::Spec)?;
    let rows = spec.batch * spec.tokens;
    let mut b = Builder { tensors: Vec::new(), operations: Vec::new() };
    b.tensors.push(TensorDecl { name: INPUT.into(), shape: vec![rows, spec.hidden], dtype: DType::F16, role: Role::Input, init: Init::Gaussian { seed: 1, std: 1.0 } });
    let (h, m) = (spec.hidden, spec.intermediate);
    let mut x = INPUT.to_string();
    for layer in 0..spec.layers {
        let last = layer + 1 == spec.layers && !spec.final_norm;
        let p = |what: &str| format!("l{layer}.{what}");
        // Parameters, asked in checkpoint order: LN1, Q, K, V, attention output, LN2, up, down.
        let mut pair = |b: &mut Builder, site: Site, weight: Vec<u32>, bias: Vec<u32>| -> Result<(String, String), BuildError<E>> {
            Ok((ask(b, &mut parameter, layer, site, Part::Weight, weight)?, ask(b, &mut parameter, layer, site, Part::Bias, bias)?))
        };
        let ln1 = pair(&mut b, Site::AttentionNorm, vec![h], vec![h])?;
        let wq = pair(&mut b, Site::Query, vec![h, h], vec![h])?;
        let wk = pair(&mut b, Site::Key, vec![h, h], vec![h])?;
        let wv = pair(&mut b, Site::Value, vec![h, h], vec![h])?;
        let wo = pair(&mut b, Site::AttentionOutput, vec![h, h], vec![h])?;
        let ln2 = pair(&mut b, Site::MlpNorm, vec![h], vec![h])?;
        let w1 = pair(&mut b, Site::MlpUp, vec![m, h], vec![m])?;
        let w2 = pair(&mut b, Site::MlpDown, vec![h, m], vec![h])?;
        // Attention half.
        let attn_in = match spec.style {
            LayerStyle::PreNorm => b.layer_norm(&p("ln1"), &x, &ln1, spec.eps),
            LayerStyle::PostNorm => x.clone(),
        };
        let context = b.attention(spec, layer, &attn_in, [&wq, &wk, &wv]);
        let attn = b.dense(&p("attn_out"), &context, &wo);
        let sum1 = b.op(&p("residual1"), "add", &[&x, &attn]);
        let h1 = match spec.style {
            LayerStyle::PreNorm => sum1,
            LayerStyle::PostNorm => b.layer_norm(&p("ln1"), &sum1, &ln1, spec.eps),
        };
        // MLP half.
        let mlp_in = match spec.style {
            LayerStyle::PreNorm => b.layer_norm(&p("ln2"), &h1, &ln2, spec.eps),
            LayerStyle::PostNorm => h1.clone(),
        };
        let up = b.dense(&p("mlp_up"), &mlp_in, &w1);
        let act = b.op(&p("mlp_act"), "gelu", &[&up]);
        if spec.activation == Activation::GeluErf {
            b.operations.last_mut().expect("just pushed").approximate = Some("none".into());
        }
        let down = b.dense(&p("mlp_down"), &act, &w2);
        x = match spec.style {
            LayerStyle::PreNorm => {
                let name = if last { OUTPUT.to_string() } else { p("residual2") };
                b.op(&name, "add", &[&h1, &down])
            }
            LayerStyle::PostNorm => {
                let sum2 = b.op(&p("residual2"), "add", &[&h1, &down]);
                let name = if last { OUTPUT.to_string() } else { p("ln2") };
                b.layer_norm(&name, &sum2, &ln2, spec.eps)
            }
        };
    }
    if spec.final_norm {
        let gamma = ask(&mut b, &mut parameter, spec.layers, Site::FinalNorm, Part::Weight, vec![h])?;
        let beta = ask(&mut b, &mut parameter, spec.layers, Site::FinalNorm, Part::Bias, vec![h])?;
        b.layer_norm(OUTPUT, &x, &(gamma, beta), spec.eps);
    }
    Ok(Encoder { tensors: b.tensors, operations: b.operations })
}

/// Ask the callback for one parameter and declare it.
fn ask<E>(b: &mut Builder, parameter: &mut impl FnMut(&Parameter) -> Result<(String, Init), E>, layer: u32, site: Site, part: Part, shape: Vec<u32>) -> Result<String, BuildError<E>> {
    let (name, init) = parameter(&Parameter { layer, site, part, shape: shape.clone() }).map_err(BuildError::Parameter)?;
    b.tensors.push(TensorDecl { name: name.clone(), shape, dtype: DType::F16, role: Role::Weight, init });
    Ok(name)
}

/// Why a stack could not be built.
#[derive(Debug, PartialEq)]
pub enum BuildError<E> {
    /// The spec is not a valid encoder shape.
    Spec(String),
    /// The parameter callback failed.
    Parameter(E),
}

struct Builder {
    tensors: Vec<TensorDecl>,
    operations: Vec<OperationDecl>,
}

impl Builder {
    fn op(&mut self, name: &str, op: &str, inputs: &[&str]) -> String {
        self.operations.push(super::generate::operation(name, op, inputs));
        name.to_string()
    }

    fn layer_norm(&mut self, name: &str, x: &str, (gamma, beta): &(String, String), eps: f64) -> String {
        self.op(name, "layer_norm", &[x, gamma, beta]);
        self.operations.last_mut().expect("just pushed").eps = Some(eps);
        name.to_string()
    }

    /// `x · Wᵀ + b` with W stored [out, in].
    fn dense(&mut self, name: &str, x: &str, (w, bias): &(String, String)) -> String {
        let product = self.op(&format!("{name}.product"), "matmul", &[x, w]);
        self.operations.last_mut().expect("just pushed").transpose_b = true;
        self.op(name, "bias_add", &[&product, bias])
    }

    fn view(&mut self, name: &str, input: &str, shape: Option<Vec<u32>>, perm: Option<Vec<u32>>) -> String {
        let op = if shape.is_some() { "reshape" } else { "transpose" };
        self.op(name, op, &[input]);
        let last = self.operations.last_mut().expect("just pushed");
        last.shape = shape;
        last.perm = perm;
        name.to_string()
    }

    /// Multi-head attention up to (not including) the output projection: [B·T, H·D] context.
    fn attention(&mut self, spec: &EncoderSpec, layer: u32, x: &str, [wq, wk, wv]: [&(String, String); 3]) -> String {
        let p = |what: &str| format!("l{layer}.{what}");
        let (b, t, heads) = (spec.batch, spec.tokens, spec.heads);
        let d = spec.hidden / heads;
        let split = |this: &mut Builder, what: &str, w: &(String, String)| -> String {
            let flat = this.dense(&p(what), x, w);
            if b == 1 {
                let rows = this.view(&p(&format!("{what}_rows")), &flat, Some(vec![t, heads, d]), None);
                this.view(&p(&format!("{what}_heads")), &rows, None, Some(vec![1, 0, 2]))
            } else {
                let rows = this.view(&p(&format!("{what}_rows")), &flat, Some(vec![b, t, heads, d]), None);
                let split = this.view(&p(&format!("{what}_split")), &rows, None, Some(vec![0, 2, 1, 3]));
                this.view(&p(&format!("{what}_heads")), &split, Some(vec![b * heads, t, d]), None)
            }
        };
        let (q, k, v) = (split(self, "q", wq), split(self, "k", wk), split(self, "v", wv));
        let scores = self.op(&p("scores"), "matmul", &[&q, &k]);
        self.operations.last_mut().expect("just pushed").transpose_b = true;
        let scaled = self.op(&p("scaled_scores"), "scale", &[&scores]);
        self.operations.last_mut().expect("just pushed").factor = Some(1.0 / (d as f64).sqrt());
        let probabilities = self.op(&p("probabilities"), "softmax", &[&scaled]);
        let context = self.op(&p("context_heads"), "matmul", &[&probabilities, &v]);
        let tokens = if b == 1 {
            self.view(&p("context_tokens"), &context, None, Some(vec![1, 0, 2]))
        } else {
            let split = self.view(&p("context_split"), &context, Some(vec![b, heads, t, d]), None);
            self.view(&p("context_tokens"), &split, None, Some(vec![0, 2, 1, 3]))
        };
        self.view(&p("context"), &tokens, Some(vec![b * t, spec.hidden]), None)
    }
}

impl<E: std::fmt::Display> std::fmt::Display for BuildError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BuildError::Spec(m) => write!(f, "encoder shape: {m}"),
            BuildError::Parameter(e) => write!(f, "{e}"),
        }
    }
}

pub const SIGLIP_ENCODER_BENCHMARK: &str = "siglip-encoder-f16";

/// The `siglip-encoder` family: So400m/14's pre-LayerNorm layers with random weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiglipEncoder {
    pub batch: u32,
    pub tokens: u32,
    pub dimension: u32,
    pub heads: u32,
    pub hidden: u32,
    pub layers: u32,
}

impl Default for SiglipEncoder {
    /// SigLIP So400m/14 at 384 px: 729 patches, width 1152, 16 heads, MLP 4304, one layer.
    fn default() -> SiglipEncoder {
        SiglipEncoder { batch: 1, tokens: 729, dimension: 1152, heads: 16, hidden: 4304, layers: 1 }
    }
}

impl SiglipEncoder {
    /// `siglip-encoder-f16-b1-t729-d1152-h16-m4304-l1`.
    pub fn name(&self) -> String {
        let SiglipEncoder { batch, tokens, dimension, heads, hidden, layers } = self;
        format!("{SIGLIP_ENCODER_BENCHMARK}-b{batch}-t{tokens}-d{dimension}-h{heads}-m{hidden}-l{layers}")
    }

    pub fn spec(&self) -> EncoderSpec {
        EncoderSpec {
            batch: self.batch,
            tokens: self.tokens,
            hidden: self.dimension,
            heads: self.heads,
            intermediate: self.hidden,
            layers: self.layers,
            style: LayerStyle::PreNorm,
            activation: Activation::GeluTanh,
            eps: 1e-6,
            final_norm: false,
        }
    }
}

/// Seeded initialisers for a random encoder: the input is Gaussian (std 1, seed 1); layer `i`'s
/// parameters take seeds 100 + 20·i + 2·site + part (site 0-7 in checkpoint order, part 0 for
/// weights and gammas, 1 for biases and betas). Product weights have std
/// 1/√fan_in (outputs near unit variance, as in the MLP generator), biases and betas std 0.1,
/// gammas are uniform in [0.8, 1.2]: values stay far from f16's range however many layers.
pub fn random_parameter(p: &Parameter) -> (String, Init) {
    let (site, index) = match p.site {
        Site::AttentionNorm => ("ln1", 0),
        Site::Query => ("q", 1),
        Site::Key => ("k", 2),
        Site::Value => ("v", 3),
        Site::AttentionOutput => ("attn_out", 4),
        Site::MlpNorm => ("ln2", 5),
        Site::MlpUp => ("mlp_up", 6),
        Site::MlpDown => ("mlp_down", 7),
        Site::FinalNorm => ("final_ln", 0),
    };
    let part = match (p.site.is_norm(), p.part) {
        (true, Part::Weight) => "gamma",
        (true, Part::Bias) => "beta",
        (false, Part::Weight) => "weight",
        (false, Part::Bias) => "bias",
    };
    let seed = 100 + 20 * p.layer as u64 + 2 * index + (p.part == Part::Bias) as u64;
    let init = match (p.site.is_norm(), p.part) {
        (true, Part::Weight) => Init::Uniform { seed, low: 0.8, high: 1.2 },
        (false, Part::Weight) => Init::Gaussian { seed, std: 1.0 / (p.shape[1] as f64).sqrt() },
        (_, Part::Bias) => Init::Gaussian { seed, std: 0.1 },
    };
    (format!("l{}.{site}.{part}", p.layer), init)
}

/// The `siglip-encoder` workload for `params`, validated.
pub fn siglip_encoder(params: &SiglipEncoder) -> Result<WorkloadFile, super::GenerateError> {
    let family = SIGLIP_ENCODER_BENCHMARK;
    let spec = params.spec();
    let encoder = build(&spec, |p| Ok::<_, String>(random_parameter(p)))
        .map_err(|e| super::GenerateError::Parameter { family, parameter: "shape", message: e.to_string() })?;
    let integer = |v: u32| toml::Value::Integer(v as i64);
    let family_table = std::collections::BTreeMap::from([
        ("benchmark".to_string(), toml::Value::String(family.into())),
        ("batch".to_string(), integer(params.batch)),
        ("tokens".to_string(), integer(params.tokens)),
        ("dimension".to_string(), integer(params.dimension)),
        ("heads".to_string(), integer(params.heads)),
        ("hiddenDimension".to_string(), integer(params.hidden)),
        ("layers".to_string(), integer(params.layers)),
    ]);
    let file = encoder.into_file(params.name(), family_table);
    ipuq_queries::ir::Graph::from_file(file.clone(), &file.name).map_err(|source| super::GenerateError::Invalid { family, source })?;
    Ok(file)
}

//! `ipuq import MODEL_DIR`: a Hugging Face checkpoint directory (`config.json` and
//! `model.safetensors`, or shards with `model.safetensors.index.json`) as a workload.
//!
//! The workload is the encoder stack from `hidden_states` [tokens, hidden] to
//! `last_hidden_state`, built by the shared encoder builder (`workload::encoder`): SigLIP's
//! vision tower (pre-LayerNorm, `post_layernorm` at the end when the checkpoint has it) or BERT
//! (post-LayerNorm). Embeddings, patch convolution, pooling heads and the text tower are not
//! imported. Every weight is referenced by file, tensor name and blake3 digest
//! (`init = { safetensors = … }`), never copied: the tensor's name in the workload is its name
//! in the checkpoint. Each tensor is read here once, to check its shape and dtype and hash it.

pub mod checkpoint;
pub mod config;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ipuq_queries::ir::{Graph, Init, WorkloadFile};

use crate::workload::encoder::{self, Activation, EncoderSpec, LayerStyle, Parameter, Part, Site};
use crate::workload::safetensors::ImportError;
use checkpoint::Checkpoint;
use config::{Family, Gelu, ModelConfig};

/// What `ipuq import` was asked.
#[derive(Clone, Debug, Default)]
pub struct ImportRequest {
    pub model_dir: PathBuf,
    /// Rows of `hidden_states` (default: the config's, see [`ModelConfig::default_tokens`]).
    pub tokens: Option<u32>,
    /// Import only the first N layers (default: all).
    pub layers: Option<u32>,
    /// The workload file to write (default: `<name>.toml` in the current folder).
    pub out: Option<PathBuf>,
}

/// The workload written.
#[derive(Clone, Debug)]
pub struct Imported {
    pub file: WorkloadFile,
    pub path: PathBuf,
    pub config: ModelConfig,
    pub tokens: u32,
    pub layers: u32,
    /// Weight tensors referenced.
    pub tensors: usize,
    pub final_norm: bool,
}

/// The workload name in the seed style: `siglip-vision-f16-b1-t729-d1152-h16-m4304-l27`,
/// `bert-encoder-f16-b1-t128-d768-h12-m3072-l12`.
pub fn workload_name(config: &ModelConfig, tokens: u32, layers: u32) -> String {
    format!("{}-b1-t{tokens}-d{}-h{}-m{}-l{layers}", benchmark(config.family), config.hidden, config.heads, config.intermediate)
}

fn benchmark(family: Family) -> &'static str {
    match family {
        Family::SiglipVision => "siglip-vision-f16",
        Family::Bert => "bert-encoder-f16",
    }
}

/// Read the checkpoint, build the workload and write it.
pub fn import(request: &ImportRequest) -> Result<Imported, ImportError> {
    let dir = &request.model_dir;
    let config_path = dir.join("config.json");
    let config = config::read_config(&config_path)?;
    let shown = config_path.display().to_string();
    let layers = match request.layers {
        None => config.layers,
        Some(0) => return Err(ImportError::Other("--layers must be at least 1".into())),
        Some(n) if n > config.layers => {
            return Err(ImportError::Field { file: shown, field: "num_hidden_layers".into(), message: format!("the model has {} layers, --layers asks for {n}", config.layers) })
        }
        Some(n) => n,
    };
    let tokens = request.tokens.unwrap_or(config.default_tokens);
    if tokens == 0 {
        return Err(ImportError::Other("--tokens must be at least 1".into()));
    }
    if let Some(max) = config.max_tokens.filter(|&max| tokens > max) {
        return Err(ImportError::Field { file: shown, field: "max_position_embeddings".into(), message: format!("the model takes at most {max} tokens, --tokens asks for {tokens}") });
    }
    let mut checkpoint = Checkpoint::open(dir)?;
    let names = TensorNames::detect(&config, &mut checkpoint)?;
    let final_norm = config.family == Family::SiglipVision && checkpoint.contains(&names.final_norm(Part::Weight))?;
    let spec = EncoderSpec {
        batch: 1,
        tokens,
        hidden: config.hidden,
        heads: config.heads,
        intermediate: config.intermediate,
        layers,
        style: match config.family {
            Family::SiglipVision => LayerStyle::PreNorm,
            Family::Bert => LayerStyle::PostNorm,
        },
        activation: match config.gelu {
            Gelu::Tanh => Activation::GeluTanh,
            Gelu::Erf => Activation::GeluErf,
        },
        eps: config.eps,
        final_norm,
    };
    let out = request.out.clone().unwrap_or_else(|| PathBuf::from(format!("{}.toml", workload_name(&config, tokens, layers))));
    let out_dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&out_dir).map_err(|source| ImportError::Write { file: out_dir.display().to_string(), source })?;
    let mut referenced = 0usize;
    let built = encoder::build(&spec, |p: &Parameter| -> Result<(String, Init), ImportError> {
        let tensor = names.name(p)?;
        let found = checkpoint.fetch(&tensor, &p.shape)?;
        let path = relative_to(&found.file, &out_dir).map_err(|source| ImportError::Read { file: found.file.display().to_string(), source })?;
        tracing::debug!(tensor = %tensor, dtype = found.dtype.name(), digest = %found.digest, "referenced checkpoint tensor");
        referenced += 1;
        Ok((tensor, Init::Safetensors { path, tensor: found.tensor, digest: found.digest }))
    })
    .map_err(|e| match e {
        encoder::BuildError::Spec(message) => ImportError::Field { file: config_path.display().to_string(), field: "(dimensions)".into(), message: format!("{message} (with {tokens} tokens and {layers} layers)") },
        encoder::BuildError::Parameter(e) => e,
    })?;
    let name = workload_name(&config, tokens, layers);
    let family = BTreeMap::from([
        ("benchmark".to_string(), toml::Value::String(benchmark(config.family).into())),
        ("batch".to_string(), toml::Value::Integer(1)),
        ("tokens".to_string(), toml::Value::Integer(tokens as i64)),
        ("dimension".to_string(), toml::Value::Integer(config.hidden as i64)),
        ("heads".to_string(), toml::Value::Integer(config.heads as i64)),
        ("hiddenDimension".to_string(), toml::Value::Integer(config.intermediate as i64)),
        ("layers".to_string(), toml::Value::Integer(layers as i64)),
        ("modelType".to_string(), toml::Value::String(config.model_type.clone())),
    ]);
    let file = built.into_file(name.clone(), family);
    Graph::from_file(file.clone(), &name).map_err(|e| ImportError::Other(format!("the imported workload does not validate: {e}")))?;
    let body = toml::to_string(&file).map_err(|e| ImportError::Other(format!("cannot write the workload: {e}")))?;
    let text = format!("# Imported by ipuq from {} ({}): weights are referenced by file, tensor and blake3 digest. Re-import rather than edit.\n{body}", dir.display(), config.model_type);
    std::fs::write(&out, text).map_err(|source| ImportError::Write { file: out.display().to_string(), source })?;
    Ok(Imported { file, path: out, config, tokens, layers, tensors: referenced, final_norm })
}

/// The checkpoint's naming of each parameter.
struct TensorNames {
    family: Family,
    /// BERT: "" (BertModel) or "bert." (a model with a head).
    prefix: String,
    /// BERT LayerNorms: `weight`/`bias`, or the older `gamma`/`beta`.
    gamma_beta: bool,
}

impl TensorNames {
    fn detect(config: &ModelConfig, checkpoint: &mut Checkpoint) -> Result<TensorNames, ImportError> {
        let mut names = TensorNames { family: config.family, prefix: String::new(), gamma_beta: false };
        if config.family == Family::Bert {
            for prefix in ["", "bert."] {
                if checkpoint.contains(&format!("{prefix}encoder.layer.0.attention.self.query.weight"))? {
                    names.prefix = prefix.to_string();
                }
            }
            let ln = format!("{}encoder.layer.0.attention.output.LayerNorm", names.prefix);
            names.gamma_beta = !checkpoint.contains(&format!("{ln}.weight"))? && checkpoint.contains(&format!("{ln}.gamma"))?;
        }
        Ok(names)
    }

    fn final_norm(&self, part: Part) -> String {
        format!("vision_model.post_layernorm.{}", part_name(part, false))
    }

    fn name(&self, p: &Parameter) -> Result<String, ImportError> {
        let i = p.layer;
        Ok(match self.family {
            Family::SiglipVision => {
                let site = match p.site {
                    Site::AttentionNorm => "layer_norm1",
                    Site::Query => "self_attn.q_proj",
                    Site::Key => "self_attn.k_proj",
                    Site::Value => "self_attn.v_proj",
                    Site::AttentionOutput => "self_attn.out_proj",
                    Site::MlpNorm => "layer_norm2",
                    Site::MlpUp => "mlp.fc1",
                    Site::MlpDown => "mlp.fc2",
                    Site::FinalNorm => return Ok(self.final_norm(p.part)),
                };
                format!("vision_model.encoder.layers.{i}.{site}.{}", part_name(p.part, false))
            }
            Family::Bert => {
                let site = match p.site {
                    Site::Query => "attention.self.query",
                    Site::Key => "attention.self.key",
                    Site::Value => "attention.self.value",
                    Site::AttentionOutput => "attention.output.dense",
                    Site::AttentionNorm => "attention.output.LayerNorm",
                    Site::MlpUp => "intermediate.dense",
                    Site::MlpDown => "output.dense",
                    Site::MlpNorm => "output.LayerNorm",
                    Site::FinalNorm => return Err(ImportError::Other("BERT has no final LayerNorm".into())),
                };
                format!("{}encoder.layer.{i}.{site}.{}", self.prefix, part_name(p.part, p.site.is_norm() && self.gamma_beta))
            }
        })
    }
}

fn part_name(part: Part, gamma_beta: bool) -> &'static str {
    match (part, gamma_beta) {
        (Part::Weight, false) => "weight",
        (Part::Bias, false) => "bias",
        (Part::Weight, true) => "gamma",
        (Part::Bias, true) => "beta",
    }
}

/// Where `path` lies, as written into a workload in `workload_dir`: relative when the two
/// share more than the root, else absolute.
pub fn relative_to(path: &Path, workload_dir: &Path) -> std::io::Result<String> {
    let path = path.canonicalize()?;
    let base = workload_dir.canonicalize()?;
    let (p, b): (Vec<_>, Vec<_>) = (path.components().collect(), base.components().collect());
    let common = p.iter().zip(&b).take_while(|(x, y)| x == y).count();
    if common <= 1 {
        return Ok(path.display().to_string());
    }
    let mut relative = PathBuf::new();
    for _ in common..b.len() {
        relative.push("..");
    }
    for c in &p[common..] {
        relative.push(c);
    }
    Ok(relative.display().to_string())
}

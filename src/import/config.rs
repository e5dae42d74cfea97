//! `config.json` of a Hugging Face checkpoint: the model family and the encoder's dimensions.
//!
//! Fields absent from the file take the defaults Hugging Face's own config classes give them
//! (`SiglipVisionConfig`, `BertConfig`), because checkpoints are saved relying on those
//! defaults; `model_type` (and, for `siglip`, `vision_config`) are required. A field of the
//! wrong type or out of range is an error naming the file and the field (with its path, as in
//! `vision_config.hidden_size`). Dimensions are cross-checked against the tensors later.

use std::path::Path;

use serde_json::{Map, Value};

use crate::workload::safetensors::ImportError;

/// The two encoder families ipuq imports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// SigLIP's vision tower: pre-LayerNorm layers, optional post LayerNorm.
    SiglipVision,
    /// BERT: post-LayerNorm layers.
    Bert,
}

/// GELU forms a config may ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gelu {
    /// `gelu_pytorch_tanh`, `gelu_new`, `gelu_fast`: the tanh approximation.
    Tanh,
    /// `gelu`: exact, through erf.
    Erf,
}

impl Gelu {
    pub fn approximate(self) -> &'static str {
        match self {
            Gelu::Tanh => "tanh",
            Gelu::Erf => "none",
        }
    }
}

/// What the importer needs from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    /// The `model_type` as written.
    pub model_type: String,
    pub hidden: u32,
    pub intermediate: u32,
    pub heads: u32,
    pub layers: u32,
    pub eps: f64,
    pub gelu: Gelu,
    /// Tokens when `--tokens` is not given: SigLIP's patch count, BERT's [`BERT_DEFAULT_TOKENS`].
    pub default_tokens: u32,
    /// The most tokens the model takes (BERT's `max_position_embeddings`).
    pub max_tokens: Option<u32>,
}

/// BERT has no natural sequence length: 128 is a common serving length, capped at the model's
/// `max_position_embeddings`; `--tokens` overrides it.
pub const BERT_DEFAULT_TOKENS: u32 = 128;

struct Fields<'a> {
    file: String,
    prefix: &'a str,
    map: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn error(&self, field: &str, message: String) -> ImportError {
        ImportError::Field { file: self.file.clone(), field: format!("{}{field}", self.prefix), message }
    }

    fn positive(&self, field: &str, default: u32) -> Result<u32, ImportError> {
        match self.map.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .filter(|&n| n >= 1 && n <= u32::MAX as u64)
                .map(|n| n as u32)
                .ok_or_else(|| self.error(field, format!("must be a positive integer, got {v}"))),
        }
    }

    fn eps(&self, field: &str, default: f64) -> Result<f64, ImportError> {
        match self.map.get(field) {
            None => Ok(default),
            Some(v) => v.as_f64().filter(|e| e.is_finite() && *e > 0.0).ok_or_else(|| self.error(field, format!("must be a positive number, got {v}"))),
        }
    }

    fn gelu(&self, field: &str, default: Gelu) -> Result<Gelu, ImportError> {
        match self.map.get(field) {
            None => Ok(default),
            Some(Value::String(s)) => match s.as_str() {
                "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Ok(Gelu::Tanh),
                "gelu" => Ok(Gelu::Erf),
                other => Err(self.error(field, format!("activation '{other}' is not supported; ipuq has gelu (erf) and gelu_pytorch_tanh / gelu_new (tanh)"))),
            },
            Some(v) => Err(self.error(field, format!("must be a string, got {v}"))),
        }
    }
}

/// Read and interpret `path` (a `config.json`).
pub fn read_config(path: &Path) -> Result<ModelConfig, ImportError> {
    let file = path.display().to_string();
    let text = std::fs::read(path).map_err(|source| ImportError::Read { file: file.clone(), source })?;
    parse_config(&text, &file)
}

/// Interpret the bytes of a `config.json`; `file` names it in errors. Never panics.
pub fn parse_config(text: &[u8], file: &str) -> Result<ModelConfig, ImportError> {
    let file = file.to_string();
    let value: Value = serde_json::from_slice(&text).map_err(|e| ImportError::Field { file: file.clone(), field: "(file)".into(), message: format!("not valid JSON: {e}") })?;
    let Value::Object(root) = &value else {
        return Err(ImportError::Field { file, field: "(file)".into(), message: "the top level must be a JSON object".into() });
    };
    let top = Fields { file: file.clone(), prefix: "", map: root };
    let model_type = match root.get("model_type") {
        Some(Value::String(s)) => s.clone(),
        Some(v) => return Err(top.error("model_type", format!("must be a string, got {v}"))),
        None => return Err(top.error("model_type", "missing: ipuq needs it to know the model family".into())),
    };
    match model_type.as_str() {
        "siglip" => match root.get("vision_config") {
            Some(Value::Object(vision)) => siglip(Fields { file, prefix: "vision_config.", map: vision }, model_type),
            Some(v) => Err(top.error("vision_config", format!("must be an object, got {v}"))),
            None => Err(top.error("vision_config", "missing: ipuq imports SigLIP's vision tower and needs its config".into())),
        },
        "siglip_vision_model" => siglip(top, model_type),
        "bert" => bert(top, model_type),
        _ => Err(ImportError::ModelType { file, model_type }),
    }
}

/// SiglipVisionConfig's defaults: hidden 768, intermediate 3072, 12 layers, 12 heads, image
/// 224, patch 16, gelu_pytorch_tanh, eps 1e-6.
fn siglip(f: Fields<'_>, model_type: String) -> Result<ModelConfig, ImportError> {
    let image = f.positive("image_size", 224)?;
    let patch = f.positive("patch_size", 16)?;
    if patch > image {
        return Err(f.error("patch_size", format!("{patch} is larger than image_size {image}")));
    }
    let side = image / patch;
    let default_tokens = side.checked_mul(side).ok_or_else(|| f.error("image_size", "too many patches".into()))?;
    finish(&f, ModelConfig {
        family: Family::SiglipVision,
        model_type,
        hidden: f.positive("hidden_size", 768)?,
        intermediate: f.positive("intermediate_size", 3072)?,
        heads: f.positive("num_attention_heads", 12)?,
        layers: f.positive("num_hidden_layers", 12)?,
        eps: f.eps("layer_norm_eps", 1e-6)?,
        gelu: f.gelu("hidden_act", Gelu::Tanh)?,
        default_tokens,
        max_tokens: None,
    })
}

/// BertConfig's defaults: hidden 768, intermediate 3072, 12 layers, 12 heads, gelu, eps 1e-12,
/// 512 positions.
fn bert(f: Fields<'_>, model_type: String) -> Result<ModelConfig, ImportError> {
    let positions = f.positive("max_position_embeddings", 512)?;
    finish(&f, ModelConfig {
        family: Family::Bert,
        model_type,
        hidden: f.positive("hidden_size", 768)?,
        intermediate: f.positive("intermediate_size", 3072)?,
        heads: f.positive("num_attention_heads", 12)?,
        layers: f.positive("num_hidden_layers", 12)?,
        eps: f.eps("layer_norm_eps", 1e-12)?,
        gelu: f.gelu("hidden_act", Gelu::Erf)?,
        default_tokens: BERT_DEFAULT_TOKENS.min(positions),
        max_tokens: Some(positions),
    })
}

fn finish(f: &Fields<'_>, config: ModelConfig) -> Result<ModelConfig, ImportError> {
    if config.hidden % config.heads != 0 {
        return Err(f.error("num_attention_heads", format!("{} heads do not divide hidden_size {}", config.heads, config.hidden)));
    }
    Ok(config)
}

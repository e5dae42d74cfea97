//! A checkpoint directory's tensors: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json` (`weight_map`: tensor name → shard file).
//!
//! The importer asks for each tensor by name with the shape the config implies; the answer is
//! the file that holds it and the blake3 digest of its stored bytes, which the workload then
//! references. Every tensor is read once here (to hash it) and again when a run loads it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::workload::safetensors::{Headers, ImportError, StoredDType};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A tensor found in the checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Found {
    /// The file holding it.
    pub file: PathBuf,
    pub tensor: String,
    pub digest: String,
    pub dtype: StoredDType,
}

pub struct Checkpoint {
    /// The single file, or the index.
    pub origin: PathBuf,
    /// For a sharded checkpoint, each tensor's shard.
    weight_map: Option<BTreeMap<String, PathBuf>>,
    headers: Headers,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint, ImportError> {
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        if single.is_file() {
            return Ok(Checkpoint { origin: single, weight_map: None, headers: Headers::default() });
        }
        if !index.is_file() {
            return Err(ImportError::Other(format!("{}: neither {SINGLE_FILE} nor {INDEX_FILE} is there", dir.display())));
        }
        let file = index.display().to_string();
        let bytes = std::fs::read(&index).map_err(|source| ImportError::Read { file: file.clone(), source })?;
        let weight_map = parse_index(&bytes, &file, dir)?;
        Ok(Checkpoint { origin: index, weight_map: Some(weight_map), headers: Headers::default() })
    }

    fn file_of(&self, tensor: &str) -> Option<&Path> {
        match &self.weight_map {
            None => Some(&self.origin),
            Some(map) => map.get(tensor).map(PathBuf::as_path),
        }
    }

    /// Whether the checkpoint has a tensor of this name (reads headers only).
    pub fn contains(&mut self, tensor: &str) -> Result<bool, ImportError> {
        let Some(file) = self.file_of(tensor).map(Path::to_path_buf) else { return Ok(false) };
        Ok(self.headers.get(&file)?.contains(tensor))
    }

    /// Find, check the shape of, and hash one tensor.
    pub fn fetch(&mut self, tensor: &str, shape: &[u32]) -> Result<Found, ImportError> {
        let file = self
            .file_of(tensor)
            .map(Path::to_path_buf)
            .ok_or_else(|| ImportError::MissingTensor { file: self.origin.display().to_string(), tensor: tensor.to_string() })?;
        let stored = self.headers.get(&file)?.read_tensor(tensor)?;
        let expected: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        if stored.shape != expected {
            return Err(ImportError::Shape { file: file.display().to_string(), tensor: tensor.to_string(), found: stored.shape, expected });
        }
        Ok(Found { digest: stored.digest(), dtype: stored.dtype, file, tensor: tensor.to_string() })
    }
}

/// The `weight_map` of a sharded checkpoint's index (`file` names it in errors): each tensor's
/// shard, a file name beside the index in `dir`. Never panics.
pub fn parse_index(bytes: &[u8], file: &str, dir: &Path) -> Result<BTreeMap<String, PathBuf>, ImportError> {
    let field = |field: &str, message: String| ImportError::Field { file: file.to_string(), field: field.into(), message };
    let value: Value = serde_json::from_slice(bytes).map_err(|e| field("(file)", format!("not valid JSON: {e}")))?;
    let map = match value.get("weight_map") {
        Some(Value::Object(map)) => map,
        Some(v) => return Err(field("weight_map", format!("must be an object, got {v}"))),
        None => return Err(field("weight_map", "missing".into())),
    };
    let mut weight_map = BTreeMap::new();
    for (tensor, shard) in map {
        let shard = shard.as_str().ok_or_else(|| field(&format!("weight_map.{tensor}"), format!("must be a file name, got {shard}")))?;
        // Shards live beside the index: a name that climbs out of the folder is refused.
        if shard.is_empty() || Path::new(shard).components().any(|c| !matches!(c, std::path::Component::Normal(_))) {
            return Err(field(&format!("weight_map.{tensor}"), format!("{shard:?} is not a file name in the checkpoint folder")));
        }
        weight_map.insert(tensor.clone(), dir.join(shard));
    }
    Ok(weight_map)
}

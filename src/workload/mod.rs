//! Workloads on the host: reading workload files, generating the seed families, and producing
//! the tensors' values.
//!
//! The file format and its validation belong to the compiler (`ipuq_queries::ir`); this module
//! only reads files, generates `WorkloadFile`s and fills tensors. It must not make decisions the
//! compiler makes (layouts, tiles, schedules), and nothing here depends on a device.

pub mod data;
pub mod encoder;
pub mod generate;
pub mod given;
pub mod npy;
pub mod safetensors;

use std::path::{Path, PathBuf};

use ipuq_queries::ir::{Graph, WorkloadError};

pub use data::{tensor_data, tensor_data_cached, tensor_data_with, DataError, TensorCache, TensorData};
pub use encoder::{siglip_encoder, SiglipEncoder};
pub use generate::{from_name, grouped_attention, siglip_mlp, to_toml, GenerateError, GroupedAttention, SiglipMlp};

/// A validated workload and the folder its `npy` initialisers are resolved against.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    pub graph: Graph,
    pub folder: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("workload {path}: cannot read: {source}")]
    Read { path: String, source: std::io::Error },
    #[error(transparent)]
    Invalid(#[from] WorkloadError),
}

/// Read and validate the workload file at `path`.
pub fn load(path: &Path) -> Result<Workload, LoadError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read { path: origin.clone(), source })?;
    let graph = Graph::parse(&text, &origin)?;
    let folder = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok(Workload { graph, folder })
}

//! Reading tensors from safetensors files (Hugging Face checkpoints) through the `safetensors`
//! crate, without ever panicking on the bytes.
//!
//! A file is an 8-byte little-endian header length, a JSON header (name → dtype, shape, data
//! offsets) and the data. The header is parsed and validated by the crate (`Metadata`: offsets
//! contiguous, sizes matching shape and dtype); this module then checks that the data the
//! header declares is exactly what the file holds (a truncated file is caught before any
//! tensor is read) and reads only the bytes of the tensor asked for, so a multi-gigabyte
//! checkpoint is never held in memory whole. Every error names the file and, where there is
//! one, the tensor. f32, bf16 and f16 tensors are read; other dtypes are refused by name.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::{Dtype, Metadata};

/// The safetensors crate's own limit on the JSON header (bytes).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Element types ipuq reads from checkpoints; all convert exactly to f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDType {
    F32,
    BF16,
    F16,
}

impl StoredDType {
    pub fn bytes(self) -> u64 {
        match self {
            StoredDType::F32 => 4,
            StoredDType::BF16 | StoredDType::F16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            StoredDType::F32 => "F32",
            StoredDType::BF16 => "BF16",
            StoredDType::F16 => "F16",
        }
    }
}

/// One tensor as stored: its dtype, shape and raw little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredTensor {
    pub dtype: StoredDType,
    pub shape: Vec<u64>,
    pub bytes: Vec<u8>,
}

impl StoredTensor {
    /// blake3 of the stored bytes, lowercase hex: the `digest` of a `safetensors` init.
    pub fn digest(&self) -> String {
        blake3::hash(&self.bytes).to_hex().to_string()
    }

    /// The values, exactly (every stored dtype converts to f32 without rounding).
    pub fn values(&self) -> Vec<f32> {
        match self.dtype {
            StoredDType::F32 => self.bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            StoredDType::BF16 => self.bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            StoredDType::F16 => self.bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        }
    }
}

/// Problems with checkpoint files: each names the file and the tensor or field.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("{file}: cannot read: {source}")]
    Read { file: String, source: std::io::Error },
    #[error("{file}: not a valid safetensors file: {message}")]
    Corrupt { file: String, message: String },
    #[error("{file}: tensor '{tensor}' is missing")]
    MissingTensor { file: String, tensor: String },
    #[error("{file}: tensor '{tensor}' has shape {found:?}, expected {expected:?}")]
    Shape { file: String, tensor: String, found: Vec<u64>, expected: Vec<u64> },
    #[error("{file}: tensor '{tensor}' has dtype {dtype}, which ipuq does not read (it reads F32, BF16 and F16)")]
    DType { file: String, tensor: String, dtype: String },
    #[error("{file}: tensor '{tensor}' has blake3 digest {found}, the workload names {expected}: the checkpoint changed since the workload was written")]
    Digest { file: String, tensor: String, found: String, expected: String },
    #[error("{file}: field '{field}': {message}")]
    Field { file: String, field: String, message: String },
    #[error("{file}: unknown model_type '{model_type}'; ipuq imports siglip (with a vision_config), siglip_vision_model and bert")]
    ModelType { file: String, model_type: String },
    #[error("{file}: cannot write: {source}")]
    Write { file: String, source: std::io::Error },
    #[error("{0}")]
    Other(String),
}

/// A safetensors file's validated header: where the data starts and each tensor's place.
#[derive(Clone, Debug)]
pub struct Header {
    pub file: PathBuf,
    metadata: Metadata,
    data_start: u64,
}

impl Header {
    /// Read and validate the header of the file at `path` (reads only the header).
    pub fn read(path: &Path) -> Result<Header, ImportError> {
        let origin = path.display().to_string();
        let mut file = File::open(path).map_err(|source| ImportError::Read { file: origin.clone(), source })?;
        let length = file.metadata().map_err(|source| ImportError::Read { file: origin.clone(), source })?.len();
        Header::parse(&mut file, length, path)
    }

    /// The header of the `length` bytes `reader` holds; `path` names them in errors.
    pub fn parse(reader: &mut impl Read, length: u64, path: &Path) -> Result<Header, ImportError> {
        let origin = path.display().to_string();
        let corrupt = |message: String| ImportError::Corrupt { file: origin.clone(), message };
        if length < 8 {
            return Err(corrupt(format!("{length} bytes, shorter than the 8-byte header length")));
        }
        let mut prefix = [0u8; 8];
        reader.read_exact(&mut prefix).map_err(|source| ImportError::Read { file: origin.clone(), source })?;
        let header_bytes = u64::from_le_bytes(prefix);
        if header_bytes > MAX_HEADER_BYTES {
            return Err(corrupt(format!("the header claims {header_bytes} bytes, more than the {MAX_HEADER_BYTES} allowed")));
        }
        if header_bytes > length - 8 {
            return Err(corrupt(format!("the header claims {header_bytes} bytes but the file has {} after the length (truncated?)", length - 8)));
        }
        let mut text = vec![0u8; header_bytes as usize];
        reader.read_exact(&mut text).map_err(|source| ImportError::Read { file: origin.clone(), source })?;
        let metadata: Metadata = serde_json::from_slice(&text).map_err(|e| corrupt(format!("header: {e}")))?;
        let data_start = 8 + header_bytes;
        let declared = metadata.data_len() as u64;
        if data_start.checked_add(declared) != Some(length) {
            return Err(corrupt(format!(
                "the header declares {declared} data bytes, the file holds {} (truncated or padded)",
                length - data_start
            )));
        }
        Ok(Header { file: path.to_path_buf(), metadata, data_start })
    }

    /// Names of the tensors in the file, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.metadata.tensors().into_keys().collect();
        names.sort();
        names
    }

    pub fn contains(&self, name: &str) -> bool {
        self.metadata.info(name).is_some()
    }

    /// Dtype, shape, and the byte range (in the file) of tensor `name`.
    fn locate(&self, name: &str) -> Result<(StoredDType, Vec<u64>, u64, u64), ImportError> {
        let file = self.file.display().to_string();
        let info = self.metadata.info(name).ok_or_else(|| ImportError::MissingTensor { file: file.clone(), tensor: name.to_string() })?;
        let dtype = match info.dtype {
            Dtype::F32 => StoredDType::F32,
            Dtype::BF16 => StoredDType::BF16,
            Dtype::F16 => StoredDType::F16,
            other => return Err(ImportError::DType { file, tensor: name.to_string(), dtype: format!("{other:?}") }),
        };
        let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
        let (start, end) = info.data_offsets;
        Ok((dtype, shape, self.data_start + start as u64, (end - start) as u64))
    }

    /// Read tensor `name`'s bytes from `reader` (the same file the header came from).
    pub fn read_from(&self, reader: &mut (impl Read + Seek), name: &str) -> Result<StoredTensor, ImportError> {
        let origin = self.file.display().to_string();
        let (dtype, shape, offset, length) = self.locate(name)?;
        let mut bytes = vec![0u8; length as usize];
        reader
            .seek(SeekFrom::Start(offset))
            .and_then(|_| reader.read_exact(&mut bytes))
            .map_err(|source| ImportError::Read { file: format!("{origin} (tensor '{name}')"), source })?;
        Ok(StoredTensor { dtype, shape, bytes })
    }

    /// Read tensor `name` from the file.
    pub fn read_tensor(&self, name: &str) -> Result<StoredTensor, ImportError> {
        self.locate(name)?;
        let origin = self.file.display().to_string();
        let mut file = File::open(&self.file).map_err(|source| ImportError::Read { file: origin, source })?;
        self.read_from(&mut file, name)
    }
}

/// Read one tensor of the safetensors file at `path`. Never panics, whatever the file holds.
pub fn read_tensor(path: &Path, name: &str) -> Result<StoredTensor, ImportError> {
    Header::read(path)?.read_tensor(name)
}

/// Headers of the files a load touches, each read once.
#[derive(Default)]
pub struct Headers {
    headers: BTreeMap<PathBuf, Header>,
}

impl Headers {
    pub fn get(&mut self, path: &Path) -> Result<&Header, ImportError> {
        if !self.headers.contains_key(path) {
            let header = Header::read(path)?;
            self.headers.insert(path.to_path_buf(), header);
        }
        Ok(&self.headers[path])
    }

    /// Tensor `name` of `path` with its digest checked against `digest` and its shape against
    /// `shape`: what a `safetensors` init loads.
    pub fn load_checked(&mut self, path: &Path, name: &str, digest: &str, shape: &[u32]) -> Result<StoredTensor, ImportError> {
        let file = path.display().to_string();
        let stored = self.get(path)?.read_tensor(name)?;
        let expected: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        if stored.shape != expected {
            return Err(ImportError::Shape { file, tensor: name.to_string(), found: stored.shape, expected });
        }
        let found = stored.digest();
        if found != digest {
            return Err(ImportError::Digest { file, tensor: name.to_string(), found, expected: digest.to_string() });
        }
        Ok(stored)
    }
}

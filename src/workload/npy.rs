//! Reading and writing NumPy `.npy` files: the format of `init = { npy = ... }` tensors.
//!
//! Only what ipuq's workloads need is accepted: format version 1.0, little-endian `<f2` (f16)
//! or `<f4` (f32) elements, C order. Anything else is an error naming the file and the problem,
//! never a silent conversion. This module knows the container, not workloads: matching a
//! file's shape and dtype against a tensor declaration is `data`'s job.

use std::path::Path;

use ipuq_queries::ir::DType;

use crate::workload::data::{decode, encode};

/// The six magic bytes every `.npy` file starts with.
const MAGIC: &[u8; 6] = b"\x93NUMPY";
/// Magic, two version bytes and the 16-bit header length.
const PREAMBLE: usize = 10;

/// A decoded array: its element type, its shape, and its elements as f32 in C order.
#[derive(Clone, Debug, PartialEq)]
pub struct NpyArray {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub values: Vec<f32>,
}

#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    #[error("{path}: cannot read: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path}: cannot write: {source}")]
    Write { path: String, source: std::io::Error },
    #[error("{path}: not a .npy file: {message}")]
    Format { path: String, message: String },
    #[error("{path}: unsupported .npy file: {message}")]
    Unsupported { path: String, message: String },
    #[error("{path}: {message}")]
    Shape { path: String, message: String },
}

/// Read a `.npy` file.
pub fn read_npy(path: &Path) -> Result<NpyArray, NpyError> {
    let origin = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| NpyError::Read { path: origin.clone(), source })?;
    parse_npy(&bytes, &origin)
}

/// Write `values` (rounded to `dtype`) as a version 1.0 `.npy` file of the given shape.
pub fn write_npy(path: &Path, dtype: DType, shape: &[u64], values: &[f32]) -> Result<(), NpyError> {
    let origin = path.display().to_string();
    let bytes = encode_npy(dtype, shape, values, &origin)?;
    std::fs::write(path, bytes).map_err(|source| NpyError::Write { path: origin, source })
}

/// The bytes of a version 1.0 `.npy` file; `origin` names the file in errors.
pub fn encode_npy(dtype: DType, shape: &[u64], values: &[f32], origin: &str) -> Result<Vec<u8>, NpyError> {
    let elements = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
    if elements != Some(values.len() as u64) {
        return Err(NpyError::Shape {
            path: origin.to_string(),
            message: format!("shape {shape:?} does not hold the {} values given", values.len()),
        });
    }
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '{}', 'fortran_order': False, 'shape': {shape_text}, }}", descr(dtype));
    // The header is padded with spaces and ends in a newline so the data starts 64-byte aligned.
    let unpadded = PREAMBLE + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let header_length = u16::try_from(header.len()).map_err(|_| NpyError::Unsupported {
        path: origin.to_string(),
        message: format!("a header of {} bytes needs format version 2.0", header.len()),
    })?;
    let mut bytes = Vec::with_capacity(PREAMBLE + header.len() + values.len() * dtype.bytes() as usize);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&[1, 0]);
    bytes.extend_from_slice(&header_length.to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&encode(values, dtype));
    Ok(bytes)
}

/// Decode the bytes of a `.npy` file; `origin` names the file in errors.
pub fn parse_npy(bytes: &[u8], origin: &str) -> Result<NpyArray, NpyError> {
    let format = |message: String| NpyError::Format { path: origin.to_string(), message };
    let unsupported = |message: String| NpyError::Unsupported { path: origin.to_string(), message };
    if bytes.len() < PREAMBLE || &bytes[..6] != MAGIC {
        return Err(format("it does not start with the .npy magic bytes".into()));
    }
    if (bytes[6], bytes[7]) != (1, 0) {
        return Err(unsupported(format!("format version {}.{}; ipuq reads version 1.0", bytes[6], bytes[7])));
    }
    let header_length = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header_bytes = bytes
        .get(PREAMBLE..PREAMBLE + header_length)
        .ok_or_else(|| format(format!("the header claims {header_length} bytes but the file ends first")))?;
    let header = std::str::from_utf8(header_bytes).map_err(|_| format("the header is not text".into()))?;
    let descr_text = dictionary_entry(header, "descr").ok_or_else(|| format(format!("the header has no 'descr': {header:?}")))?;
    let dtype = match descr_text.trim_matches(|c| c == '\'' || c == '"') {
        "<f2" => DType::F16,
        "<f4" => DType::F32,
        other => return Err(unsupported(format!("element type '{other}'; ipuq reads '<f2' (f16) and '<f4' (f32)"))),
    };
    match dictionary_entry(header, "fortran_order") {
        Some("False") => {}
        Some("True") => return Err(unsupported("Fortran order; ipuq reads C-order arrays".into())),
        _ => return Err(format(format!("the header has no valid 'fortran_order': {header:?}"))),
    }
    let shape_text = dictionary_entry(header, "shape").ok_or_else(|| format(format!("the header has no 'shape': {header:?}")))?;
    let shape = parse_shape(shape_text).ok_or_else(|| format(format!("cannot read the shape {shape_text:?}")))?;
    let elements = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format(format!("the shape {shape:?} overflows")))?;
    let data = &bytes[PREAMBLE + header_length..];
    let expected = elements.checked_mul(dtype.bytes() as u64);
    if expected != Some(data.len() as u64) {
        return Err(format(format!(
            "shape {shape:?} of {} needs {} data bytes, the file has {}",
            dtype.name(),
            elements.saturating_mul(dtype.bytes() as u64),
            data.len()
        )));
    }
    let values = decode(data, dtype).map_err(|e| format(e.to_string()))?;
    Ok(NpyArray { dtype, shape, values })
}

fn descr(dtype: DType) -> &'static str {
    match dtype {
        DType::F16 => "<f2",
        DType::F32 => "<f4",
    }
}

/// The raw text of `key`'s value in the header's Python dictionary literal. Values in the
/// headers NumPy writes are a quoted string, a boolean or a parenthesised tuple, so the value
/// ends at the first comma outside parentheses or at the closing brace.
fn dictionary_entry<'h>(header: &'h str, key: &str) -> Option<&'h str> {
    let body = header.trim().strip_prefix('{')?.strip_suffix('}')?;
    let mut rest = body;
    loop {
        rest = rest.trim_start().trim_start_matches(',').trim_start();
        if rest.is_empty() {
            return None;
        }
        let quote = rest.chars().next()?;
        if quote != '\'' && quote != '"' {
            return None;
        }
        let end_of_key = rest[1..].find(quote)? + 1;
        let name = &rest[1..end_of_key];
        rest = rest[end_of_key + 1..].trim_start().strip_prefix(':')?.trim_start();
        let mut depth = 0i32;
        let mut in_quote: Option<char> = None;
        let mut end = rest.len();
        for (i, c) in rest.char_indices() {
            match (in_quote, c) {
                (Some(q), c) if c == q => in_quote = None,
                (Some(_), _) => {}
                (None, '\'' | '"') => in_quote = Some(c),
                (None, '(') => depth += 1,
                (None, ')') => depth -= 1,
                (None, ',') if depth == 0 => {
                    end = i;
                    break;
                }
                _ => {}
            }
        }
        let value = rest[..end].trim();
        if name == key {
            return Some(value);
        }
        rest = &rest[end..];
    }
}

/// `(3, 4)`, `(5,)` or `()` as a list of axis lengths.
fn parse_shape(text: &str) -> Option<Vec<u64>> {
    let inner = text.trim().strip_prefix('(')?.strip_suffix(')')?;
    inner
        .split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .map(|part| part.trim_end_matches('L').parse::<u64>().ok())
        .collect()
}

//! A file cache of host reference values beside a package (`reference.bin`), so that running
//! a prebuilt package again does not recompute the f64 matrix products.
//!
//! The key is a blake3 digest of the workload's canonical text, the names asked for and every
//! tensor's bytes: any change of the workload or its data misses. The file is outside bytes:
//! a short, damaged or foreign file is a miss (recomputed and rewritten), never a panic, and
//! the payload carries its own blake3 so a flipped bit is caught. Writes are atomic
//! (temporary file, then rename); a write that fails only costs the next run a recomputation.

use std::collections::BTreeMap;
use std::path::Path;

use ipuq_queries::ir::Graph;

use crate::reference::{evaluate_values, evaluate_values_memo, ReferenceError, ReferenceMemo, Values};
use crate::workload::TensorData;

const MAGIC: &[u8; 8] = b"IPUQREF1";
const HEADER: usize = 8 + 32 + 32 + 8;

/// The digest that names one reference computation.
pub fn key(graph: &Graph, data: &BTreeMap<String, TensorData>, wanted: &[&str]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"ipuq reference v1\0");
    h.update(graph.canonical_toml().as_bytes());
    for name in wanted {
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
    }
    for (name, d) in data {
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(&(d.bytes.len() as u64).to_le_bytes());
        h.update(&d.bytes);
    }
    *h.finalize().as_bytes()
}

/// Serialise values under `key`.
pub fn encode(key: &[u8; 32], values: &Values) -> Vec<u8> {
    let mut payload = Vec::new();
    for (name, v) in values {
        payload.extend_from_slice(&(name.len() as u64).to_le_bytes());
        payload.extend_from_slice(name.as_bytes());
        payload.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for x in v {
            payload.extend_from_slice(&x.to_le_bytes());
        }
    }
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(key);
    out.extend_from_slice(blake3::hash(&payload).as_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

/// The values stored under `key`, or `None` for any other, short or damaged input.
pub fn decode(key: &[u8; 32], bytes: &[u8]) -> Option<Values> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC || bytes[8..40] != key[..] {
        return None;
    }
    let length = u64::from_le_bytes(bytes[72..80].try_into().ok()?);
    let payload = &bytes[HEADER..];
    if payload.len() as u64 != length || blake3::hash(payload).as_bytes()[..] != bytes[40..72] {
        return None;
    }
    let mut values = Values::new();
    let mut at = 0usize;
    fn take<'a>(payload: &'a [u8], at: &mut usize, n: u64) -> Option<&'a [u8]> {
        let n = usize::try_from(n).ok()?;
        let end = at.checked_add(n).filter(|&e| e <= payload.len())?;
        let slice = &payload[*at..end];
        *at = end;
        Some(slice)
    }
    while at < payload.len() {
        let name_len = u64::from_le_bytes(take(payload, &mut at, 8)?.try_into().ok()?);
        let name = String::from_utf8(take(payload, &mut at, name_len)?.to_vec()).ok()?;
        let count = u64::from_le_bytes(take(payload, &mut at, 8)?.try_into().ok()?);
        let raw = take(payload, &mut at, count.checked_mul(4)?)?;
        values.insert(name, raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect());
    }
    Some(values)
}

/// The reference values of `wanted`, from `folder/reference.bin` when it holds them, else
/// computed and stored there.
pub fn evaluate_cached(folder: &Path, graph: &Graph, data: &BTreeMap<String, TensorData>, wanted: &[&str]) -> Result<Values, ReferenceError> {
    evaluate_cached_memo(folder, graph, data, wanted, None)
}

/// As [`evaluate_cached`]; a computation reuses the operations `memo` holds (see
/// [`ReferenceMemo`]).
pub fn evaluate_cached_memo(
    folder: &Path,
    graph: &Graph,
    data: &BTreeMap<String, TensorData>,
    wanted: &[&str],
    memo: Option<&mut ReferenceMemo>,
) -> Result<Values, ReferenceError> {
    let key = key(graph, data, wanted);
    let path = folder.join("reference.bin");
    if let Some(values) = std::fs::read(&path).ok().and_then(|bytes| decode(&key, &bytes)) {
        tracing::info!(path = %path.display(), "reused cached host reference");
        return Ok(values);
    }
    let values = match memo {
        Some(memo) => {
            let values = evaluate_values_memo(graph, data, wanted, memo)?;
            tracing::info!(reused = memo.reused, operations = graph.operations.len(), "computed host reference, reusing unchanged operations");
            values
        }
        None => evaluate_values(graph, data, wanted)?,
    };
    let tmp = folder.join(format!(".reference.bin.{}.tmp", std::process::id()));
    if std::fs::write(&tmp, encode(&key, &values)).and_then(|_| std::fs::rename(&tmp, &path)).is_err() {
        let _ = std::fs::remove_file(&tmp);
        tracing::warn!(path = %path.display(), "could not store the host reference");
    }
    Ok(values)
}

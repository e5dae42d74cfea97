//! The host reference: every IR operation computed independently on the CPU, to check devices.
//!
//! Each operation accumulates in f64 and stores its result rounded to the value's dtype, as a
//! device stores it (an f16 value is rounded to f16 after every operation, so the reference
//! sees the same stored intermediates a device does). Matmul operands are f16 values, whose
//! products are exact in f64, and the sums are f64: the only rounding per output element is the
//! final one, far more accurate than any device's f32 (or f16-partial) accumulation.
//!
//! This module must share no code with the devices' kernels (`src/device/`): a reference that
//! reused them would confirm their bugs. Views (reshape, transpose) are materialised as copies.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use ipuq_queries::ir::{split3, DType, Graph, OpKind, Operation, Producer, ValueId};
use rayon::prelude::*;

use crate::workload::data::{round_to, TensorData};

/// Values by name, row-major, each exactly representable in its value's dtype.
pub type Values = BTreeMap<String, Vec<f32>>;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ReferenceError {
    #[error("reference for {workload}: tensor '{tensor}' has no data")]
    MissingTensor { workload: String, tensor: String },
    #[error("reference for {workload}: tensor '{tensor}': the data is {found}, the workload declares {declared}")]
    TensorMismatch { workload: String, tensor: String, found: String, declared: String },
    #[error("reference for {workload}: operation '{operation}': {message}")]
    Operation { workload: String, operation: String, message: String },
    #[error("reference for {workload}: '{name}' is not a value of the workload")]
    UnknownValue { workload: String, name: String },
}

/// Every value of `graph` (tensors, intermediates, outputs), computed from `data`.
pub fn evaluate(graph: &Graph, data: &BTreeMap<String, TensorData>) -> Result<Values, ReferenceError> {
    let all: Vec<&str> = graph.values.iter().map(|v| v.name.as_str()).collect();
    evaluate_values(graph, data, &all)
}

/// Only the named values of `graph`; intermediates are dropped after their last use, so
/// asking for the outputs alone needs far less memory than `evaluate`.
pub fn evaluate_values(graph: &Graph, data: &BTreeMap<String, TensorData>, wanted: &[&str]) -> Result<Values, ReferenceError> {
    evaluate_inner(graph, data, wanted, None)
}

/// Operation values of the last evaluation, by a digest of everything that determines them
/// (the operation's kind and parameters, its output's dtype and shape, and the same digest of
/// each input, down to the bytes of the tensors), so that a long-lived session
/// (`ipuq watch --run`) recomputes only the operations an edit reached. It keeps every
/// intermediate of the last evaluation alive.
#[derive(Default)]
pub struct ReferenceMemo {
    entries: BTreeMap<[u8; 32], Arc<Vec<f32>>>,
    /// Operations of the last evaluation taken from the memo rather than computed.
    pub reused: usize,
}

/// As [`evaluate_values`], reusing (and refreshing) `memo`: afterwards it holds exactly the
/// operation values of this evaluation.
pub fn evaluate_values_memo(graph: &Graph, data: &BTreeMap<String, TensorData>, wanted: &[&str], memo: &mut ReferenceMemo) -> Result<Values, ReferenceError> {
    evaluate_inner(graph, data, wanted, Some(memo))
}

fn evaluate_inner(graph: &Graph, data: &BTreeMap<String, TensorData>, wanted: &[&str], mut memo: Option<&mut ReferenceMemo>) -> Result<Values, ReferenceError> {
    let workload = graph.name.clone();
    let mut keep = BTreeSet::new();
    for name in wanted {
        let id = graph.find(name).ok_or_else(|| ReferenceError::UnknownValue { workload: workload.clone(), name: name.to_string() })?;
        keep.insert(id);
    }
    // The index of the last operation that reads each value.
    let mut last_use: BTreeMap<ValueId, usize> = BTreeMap::new();
    for (index, operation) in graph.operations.iter().enumerate() {
        for &input in &operation.inputs {
            last_use.insert(input, index);
        }
    }
    let mut slots: Vec<Option<Arc<Vec<f32>>>> = vec![None; graph.values.len()];
    // With a memo: the digest of every value (see `ReferenceMemo`).
    let mut digests: Vec<[u8; 32]> = vec![[0; 32]; graph.values.len()];
    for ((slot, digest), value) in slots.iter_mut().zip(digests.iter_mut()).zip(&graph.values) {
        if !matches!(value.producer, Producer::Tensor { .. }) {
            continue;
        }
        let tensor = data.get(&value.name).ok_or_else(|| ReferenceError::MissingTensor { workload: workload.clone(), tensor: value.name.clone() })?;
        let elements = value.elements() as usize;
        if tensor.dtype != value.dtype || tensor.shape != value.shape || tensor.values.len() != elements {
            return Err(ReferenceError::TensorMismatch {
                workload: workload.clone(),
                tensor: value.name.clone(),
                found: format!("{} {:?} with {} values", tensor.dtype.name(), tensor.shape, tensor.values.len()),
                declared: format!("{} {:?}", value.dtype.name(), value.shape),
            });
        }
        if memo.is_some() {
            let mut h = blake3::Hasher::new();
            h.update(format!("tensor {} {:?}\0", value.dtype.name(), value.shape).as_bytes());
            h.update(&tensor.bytes);
            *digest = *h.finalize().as_bytes();
        }
        *slot = Some(Arc::new(tensor.values.clone()));
    }
    let mut fresh = ReferenceMemo::default();
    for (index, operation) in graph.operations.iter().enumerate() {
        let output = graph.value(operation.output);
        let _span = tracing::debug_span!("reference.operation", operation = %output.name, kind = operation.kind.name()).entered();
        let fail = |message: String| ReferenceError::Operation { workload: workload.clone(), operation: output.name.clone(), message };
        let mut inputs = Vec::with_capacity(operation.inputs.len());
        for &id in &operation.inputs {
            let values = slots[id.0 as usize].as_deref().ok_or_else(|| fail(format!("input '{}' was not computed", graph.value(id).name)))?;
            inputs.push((values.as_slice(), graph.value(id).shape.as_slice()));
        }
        let digest = memo.is_some().then(|| {
            let mut h = blake3::Hasher::new();
            h.update(format!("operation {:?} {} {:?}\0", operation.kind, output.dtype.name(), output.shape).as_bytes());
            for &id in &operation.inputs {
                h.update(&digests[id.0 as usize]);
            }
            *h.finalize().as_bytes()
        });
        let remembered = digest.and_then(|d| memo.as_ref().and_then(|m| m.entries.get(&d)).cloned());
        let result = match remembered {
            Some(values) => {
                fresh.reused += 1;
                values
            }
            None => Arc::new(compute(operation, output.dtype, &inputs).map_err(fail)?),
        };
        if result.len() as u64 != output.elements() {
            return Err(fail(format!("computed {} values for shape {:?}", result.len(), output.shape)));
        }
        if let Some(d) = digest {
            digests[operation.output.0 as usize] = d;
            fresh.entries.insert(d, result.clone());
        }
        slots[operation.output.0 as usize] = Some(result);
        // Free what no later operation reads and nobody asked for.
        for &input in &operation.inputs {
            if last_use.get(&input) == Some(&index) && !keep.contains(&input) {
                slots[input.0 as usize] = None;
            }
        }
    }
    if let Some(memo) = memo.as_deref_mut() {
        *memo = fresh;
    }
    let mut values = Values::new();
    for id in keep {
        let computed = slots[id.0 as usize].take().ok_or_else(|| ReferenceError::UnknownValue { workload: workload.clone(), name: graph.value(id).name.clone() })?;
        values.insert(graph.value(id).name.clone(), Arc::try_unwrap(computed).unwrap_or_else(|shared| shared.as_ref().clone()));
    }
    Ok(values)
}

/// One operation's values from its inputs' (values, shape), each rounded to `dtype`.
fn compute(operation: &Operation, dtype: DType, inputs: &[(&[f32], &[u32])]) -> Result<Vec<f32>, String> {
    Ok(match (&operation.kind, inputs) {
        (OpKind::MatMul { transpose_b }, [(a, a_shape), (b, b_shape)]) => matmul(a, a_shape, b, b_shape, *transpose_b, dtype)?,
        (OpKind::Gelu, [(x, _)]) => elementwise(x, |v| round_to(dtype, gelu(v as f64))),
        (OpKind::Softmax, [(x, shape)]) => softmax(x, shape, dtype),
        (OpKind::Scale { factor }, [(x, _)]) => elementwise(x, |v| round_to(dtype, v as f64 * factor)),
        (OpKind::Add, [(a, _), (b, _)]) => {
            if a.len() != b.len() {
                return Err(format!("operands hold {} and {} values", a.len(), b.len()));
            }
            a.par_iter().zip(b.par_iter()).map(|(&x, &y)| round_to(dtype, x as f64 + y as f64)).collect()
        }
        (OpKind::GeluErf, [(x, _)]) => elementwise(x, |v| round_to(dtype, gelu_erf(v as f64))),
        (OpKind::BiasAdd, [(x, shape), (bias, _)]) => rows_with(x, shape, |row, out| {
            for ((o, &v), &b) in out.iter_mut().zip(row).zip(bias.iter()) {
                *o = round_to(dtype, v as f64 + b as f64);
            }
        }),
        (OpKind::LayerNorm { eps }, [(x, shape), (gamma, _), (beta, _)]) => rows_with(x, shape, |row, out| {
            let n = row.len() as f64;
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
            let variance = row.iter().map(|&v| (v as f64 - mean) * (v as f64 - mean)).sum::<f64>() / n;
            let inverse = 1.0 / (variance + eps).sqrt();
            for (((o, &v), &g), &b) in out.iter_mut().zip(row).zip(gamma.iter()).zip(beta.iter()) {
                *o = round_to(dtype, (v as f64 - mean) * inverse * g as f64 + b as f64);
            }
        }),
        (OpKind::Reshape { .. }, [(x, _)]) => x.to_vec(),
        (OpKind::Transpose { perm }, [(x, shape)]) => transpose(x, shape, perm)?,
        (OpKind::TransposeCopy, [(x, shape)]) => transpose(x, shape, &[1, 0])?,
        (kind, _) => return Err(format!("{} got {} inputs", kind.name(), inputs.len())),
    })
}

fn elementwise(x: &[f32], f: impl Fn(f32) -> f32 + Sync) -> Vec<f32> {
    x.par_iter().map(|&v| f(v)).collect()
}

/// GELU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
pub fn gelu(x: f64) -> f64 {
    let inner = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
    0.5 * x * (1.0 + inner.tanh())
}

/// Each row of the last axis of `x` mapped by `f(row, out_row)`.
fn rows_with(x: &[f32], shape: &[u32], f: impl Fn(&[f32], &mut [f32]) + Sync) -> Vec<f32> {
    let length = (*shape.last().unwrap_or(&1) as usize).max(1);
    let mut out = vec![0.0f32; x.len()];
    out.par_chunks_mut(length).zip(x.par_chunks(length)).for_each(|(out_row, row)| f(row, out_row));
    out
}

/// Exact GELU: 0.5·x·(1 + erf(x/√2)).
pub fn gelu_erf(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
}

/// erf by its everywhere-convergent series of positive terms,
/// erf(x) = 2/√π · e^(−x²) · Σ 2ⁿ x^(2n+1) / (1·3·…·(2n+1)), which has no cancellation;
/// beyond |x| = 6, erf is ±1 to within 1e-17.
pub fn erf(x: f64) -> f64 {
    let a = x.abs();
    if a >= 6.0 {
        return x.signum();
    }
    let (mut term, mut sum, mut n) = (a, a, 0.0f64);
    while term > sum * 1e-17 {
        n += 1.0;
        term *= 2.0 * a * a / (2.0 * n + 1.0);
        sum += term;
    }
    x.signum() * (2.0 / std::f64::consts::PI.sqrt()) * (-a * a).exp() * sum
}

/// Softmax over the last axis, max-subtracted, in f64.
fn softmax(x: &[f32], shape: &[u32], dtype: DType) -> Vec<f32> {
    let length = *shape.last().unwrap_or(&1) as usize;
    let mut out = vec![0.0f32; x.len()];
    out.par_chunks_mut(length).zip(x.par_chunks(length)).for_each(|(out_row, row)| {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let exponentials: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
        let sum: f64 = exponentials.iter().sum();
        for (o, e) in out_row.iter_mut().zip(&exponentials) {
            *o = round_to(dtype, e / sum);
        }
    });
    out
}

/// Batched A·B (or A·Bᵀ) with grouped batches: batch `i` of A uses batch `i / (Ba / Bb)` of B.
fn matmul(a: &[f32], a_shape: &[u32], b: &[f32], b_shape: &[u32], transpose_b: bool, dtype: DType) -> Result<Vec<f32>, String> {
    if !(2..=3).contains(&a_shape.len()) || !(2..=3).contains(&b_shape.len()) {
        return Err(format!("operands must have 2 or 3 axes, got {a_shape:?} and {b_shape:?}"));
    }
    let (a_batches, m, k) = split3(a_shape);
    let (b_batches, b_rows, b_columns) = split3(b_shape);
    let (kb, n) = if transpose_b { (b_columns, b_rows) } else { (b_rows, b_columns) };
    if k != kb || b_batches == 0 || a_batches % b_batches != 0 {
        return Err(format!("shapes {a_shape:?} and {b_shape:?} (transpose_b = {transpose_b}) do not multiply"));
    }
    let (m, k, n) = (m as usize, k as usize, n as usize);
    let group = (a_batches / b_batches) as usize;
    let mut out = vec![0.0f32; a_batches as usize * m * n];
    if m == 0 || n == 0 || k == 0 {
        // Empty sums are zero, which every dtype holds exactly.
        return Ok(out);
    }
    // Every B batch in column panels of f64 (see `pack_panels`).
    let panels: Vec<Vec<f64>> = b.par_chunks(k * n).map(|matrix| pack_panels(matrix, k, n, transpose_b)).collect();
    out.par_chunks_mut(m * n).enumerate().for_each(|(batch, out_batch)| {
        let a_matrix = &a[batch * m * k..(batch + 1) * m * k];
        let b_panels = &panels[batch / group];
        out_batch
            .par_chunks_mut(ROW_CHUNK * n)
            .enumerate()
            .for_each(|(chunk, out_rows)| row_chunk(&a_matrix[chunk * ROW_CHUNK * k..], b_panels, out_rows, k, n, dtype));
    });
    Ok(out)
}

/// B (row-major [k, n], or [n, k] when transposed) as f64 in panels of [`PANEL`] columns:
/// panel `p` holds, for each `kk` in order, columns `p·PANEL..` of row `kk`, so a pass over `kk`
/// reads one panel front to back. Columns past `n` are zero (their sums are never stored).
fn pack_panels(matrix: &[f32], k: usize, n: usize, transposed: bool) -> Vec<f64> {
    let panels = n.div_ceil(PANEL);
    let mut packed = vec![0.0f64; panels * k * PANEL];
    packed.par_chunks_mut(k * PANEL).enumerate().for_each(|(p, panel)| {
        for (kk, row) in panel.chunks_exact_mut(PANEL).enumerate() {
            for (c, slot) in row.iter_mut().enumerate().take(n.saturating_sub(p * PANEL)) {
                let column = p * PANEL + c;
                *slot = if transposed { matrix[column * k + kk] } else { matrix[kk * n + column] } as f64;
            }
        }
    });
    packed
}

/// Output rows in chunks of this many (one parallel task each, A's rows converted once).
const ROW_CHUNK: usize = 32;
/// Output rows and columns whose f64 sums stay in registers for a whole pass over K.
const BLOCK_ROWS: usize = 4;
const PANEL: usize = 8;

/// Up to [`ROW_CHUNK`] output rows: f64 sums of exact f16 products over `kk` in increasing
/// order from zero, each rounded once to `dtype`. On x86-64 CPUs with AVX2 the same loops run
/// on 256-bit vectors (selected at run time; no FMA, so every sum is rounded as in the
/// portable code and the results are identical).
fn row_chunk(a_rows: &[f32], panels: &[f64], out_rows: &mut [f32], k: usize, n: usize, dtype: DType) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        unsafe { row_chunk_avx2(a_rows, panels, out_rows, k, n, dtype) };
        return;
    }
    row_chunk_portable(a_rows, panels, out_rows, k, n, dtype)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_chunk_avx2(a_rows: &[f32], panels: &[f64], out_rows: &mut [f32], k: usize, n: usize, dtype: DType) {
    row_chunk_portable(a_rows, panels, out_rows, k, n, dtype)
}

#[inline(always)]
fn row_chunk_portable(a_rows: &[f32], panels: &[f64], out_rows: &mut [f32], k: usize, n: usize, dtype: DType) {
    let rows = out_rows.len() / n;
    let a: Vec<f64> = a_rows[..rows * k].iter().map(|&v| v as f64).collect();
    for (p, panel) in panels.chunks_exact(k * PANEL).enumerate() {
        let first_column = p * PANEL;
        let width = PANEL.min(n - first_column);
        let mut row = 0;
        while row < rows {
            let count = if rows - row >= BLOCK_ROWS { BLOCK_ROWS } else { 1 };
            let mut store = |r: usize, sums: &[f64; PANEL]| {
                let target = &mut out_rows[(row + r) * n + first_column..(row + r) * n + first_column + width];
                for (o, &sum) in target.iter_mut().zip(sums) {
                    *o = round_to(dtype, sum);
                }
            };
            if count == BLOCK_ROWS {
                block::<BLOCK_ROWS>(&a[row * k..], panel, k).iter().enumerate().for_each(|(r, sums)| store(r, sums));
            } else {
                block::<1>(&a[row * k..], panel, k).iter().enumerate().for_each(|(r, sums)| store(r, sums));
            }
            row += count;
        }
    }
}

/// The sums of R rows of `a` (row-major, `k` per row) times one panel.
#[inline(always)]
fn block<const R: usize>(a: &[f64], panel: &[f64], k: usize) -> [[f64; PANEL]; R] {
    let rows: [&[f64]; R] = std::array::from_fn(|r| &a[r * k..(r + 1) * k]);
    let mut sums = [[0.0f64; PANEL]; R];
    for (kk, b) in panel.chunks_exact(PANEL).enumerate() {
        let b: &[f64; PANEL] = b.try_into().expect("a panel row");
        for (sum, row) in sums.iter_mut().zip(&rows) {
            let x = row[kk];
            for (s, &bv) in sum.iter_mut().zip(b) {
                *s += x * bv;
            }
        }
    }
    sums
}

/// Permuted axes: output axis `a` is input axis `perm[a]`.
fn transpose(x: &[f32], shape: &[u32], perm: &[u32]) -> Result<Vec<f32>, String> {
    let rank = shape.len();
    let mut seen = vec![false; rank];
    if perm.len() != rank || perm.iter().any(|&p| (p as usize) >= rank || std::mem::replace(&mut seen[p as usize], true)) {
        return Err(format!("perm {perm:?} is not a permutation of the axes of {shape:?}"));
    }
    let mut input_strides = vec![1usize; rank];
    for axis in (0..rank.saturating_sub(1)).rev() {
        input_strides[axis] = input_strides[axis + 1] * shape[axis + 1] as usize;
    }
    let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p as usize] as usize).collect();
    let source_strides: Vec<usize> = perm.iter().map(|&p| input_strides[p as usize]).collect();
    Ok((0..x.len())
        .into_par_iter()
        .map(|flat| {
            let (mut rest, mut source) = (flat, 0usize);
            for axis in (0..rank).rev() {
                source += (rest % out_shape[axis]) * source_strides[axis];
                rest /= out_shape[axis];
            }
            x[source]
        })
        .collect())
}

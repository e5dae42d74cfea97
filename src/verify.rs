//! Verification: a device's values against the host reference, with a stated tolerance.
//!
//! An element passes when `|device − reference| ≤ relative·|reference| + floor·largest`, where
//! `largest` is the largest finite magnitude in the reference tensor. Any NaN or infinity in the
//! device's values fails, whatever the reference says, and so does any element whose reference
//! is not finite (a run's inputs are refused if they hold NaN or overflow their dtype; an
//! infinity given as such reaches the outputs it touches, and those fail). The figure reported
//! is the maximum absolute error, with the index and both values of the worst element.
//!
//! Why these numbers, for f16 values (relative = floor = 2⁻⁷ ≈ 0.0078):
//! - One f16 ulp is between 2⁻¹¹ and 2⁻¹⁰ of a value's magnitude. The reference rounds each
//!   stored value once from an almost exact f64 result; a device that accumulates in a
//!   different order (f32 sums, partial sums kept in f16 when K is split across tiles, its own
//!   exp and tanh) lands within a few ulps of it, and an intermediate stored one ulp off moves
//!   the next result by well under one ulp after averaging over K terms.
//! - Errors of a dot product or a softmax scale with the values being summed, not with the
//!   result: an output that cancels to nearly zero carries the rounding error of its large
//!   terms. So the absolute part of the tolerance is a fraction of the tensor's own largest
//!   magnitude, which makes the check independent of the workload's scale (MLP outputs of
//!   magnitude 1, attention probabilities of 1/729 are held to the same standard).
//! - 2⁻⁷ of the largest value is 8 ulps of it; the relative part adds up to another 8 ulps for
//!   the largest elements. That covers f16 partial sums over dozens of K-chunks (a random walk
//!   of half-ulp roundings) with room to spare: `tests/reference.rs` runs an MLP the way a tiled
//!   device might (f32 products, 16 K-chunks whose partials and running total are rounded to
//!   f16, f32 tanh) and it uses 13 % of the tolerance.
//! - The seed's MLP reported a maximum absolute error of 0.0117. Our generated seed MLP has
//!   outputs of root-mean-square 0.65 and largest magnitude 3.3, where the limit is 0.033 at
//!   |reference| = 1 and 0.051 at the largest: the seed's figure would use about a third of
//!   it (three quarters even if its largest output had been 1).
//! - A wrong kernel moves elements by the spread of the output itself. In the same test a
//!   missing GELU, a transposed W1 and rows shifted by one exceed the limit over 100 times,
//!   and dropping one K-chunk of 8 (6 % of the sum) 36 times.
//!
//! For f32 values (today only data movement produces them, which is exact) both fractions are
//! 2⁻¹⁶: room for f32 accumulation order over up to 2¹⁶ terms should f32 arithmetic be added.
//!
//! This module compares numbers; it must not know how a device or the reference made them.

use ipuq_queries::ir::DType;

use crate::workload::data::{decode, DataError};

/// `|device − reference| ≤ relative·|reference| + floor·largest |reference| of the tensor`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub relative: f64,
    pub floor: f64,
}

impl Tolerance {
    /// The tolerance for values stored in `dtype` (see the module documentation for why).
    pub fn for_dtype(dtype: DType) -> Tolerance {
        match dtype {
            DType::F16 => Tolerance { relative: 1.0 / 128.0, floor: 1.0 / 128.0 },
            DType::F32 => Tolerance { relative: 1.0 / 65536.0, floor: 1.0 / 65536.0 },
        }
    }

    /// The largest error allowed for an element whose reference is `reference`, in a tensor
    /// whose largest finite magnitude is `largest`.
    pub fn limit(&self, reference: f64, largest: f64) -> f64 {
        self.relative * reference.abs() + self.floor * largest
    }
}

/// The outcome of comparing a device's values (all, or samples) with the reference.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    /// Elements compared.
    pub elements: usize,
    /// The largest |device − reference|; infinite if a device value is NaN or infinite.
    pub max_abs_error: f64,
    /// The tensor index of the element with the largest error, and its two values.
    pub worst_index: u64,
    pub worst_device: f32,
    pub worst_reference: f32,
    /// The largest error as a fraction of its element's limit (≤ 1 when every element passes).
    pub worst_ratio: f64,
    /// Elements outside the tolerance, NaN and infinite device values included.
    pub violations: usize,
    /// Device values that are NaN or infinite.
    pub non_finite: usize,
    pub tolerance: Tolerance,
    pub passed: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("the device produced {device} values, the reference has {reference}")]
    Length { device: usize, reference: usize },
    #[error("{samples} sample indices but {values} sample values")]
    Samples { samples: usize, values: usize },
    #[error("sample index {index} is outside the tensor's {elements} elements")]
    SampleIndex { index: u64, elements: usize },
    #[error("device output: {0}")]
    Decode(#[from] DataError),
}

/// Compare a whole tensor.
pub fn compare(reference: &[f32], device: &[f32], tolerance: Tolerance) -> Result<Comparison, VerifyError> {
    if reference.len() != device.len() {
        return Err(VerifyError::Length { device: device.len(), reference: reference.len() });
    }
    let pairs = reference.iter().zip(device).enumerate().map(|(i, (&r, &d))| (i as u64, r, d));
    Ok(tally(pairs, largest_magnitude(reference), tolerance))
}

/// Compare a device's output bytes (little-endian `dtype`) with the reference, at `dtype`'s tolerance.
pub fn compare_bytes(reference: &[f32], device_bytes: &[u8], dtype: DType) -> Result<Comparison, VerifyError> {
    let device = decode(device_bytes, dtype)?;
    compare(reference, &device, Tolerance::for_dtype(dtype))
}

/// Compare sampled device values (a checkpoint) with the full reference tensor: `values[i]` is
/// the device's element `indices[i]`. The floor uses the whole reference tensor's largest value.
pub fn check_samples(reference: &[f32], indices: &[u64], values: &[f32], tolerance: Tolerance) -> Result<Comparison, VerifyError> {
    if indices.len() != values.len() {
        return Err(VerifyError::Samples { samples: indices.len(), values: values.len() });
    }
    if let Some(&index) = indices.iter().find(|&&i| i >= reference.len() as u64) {
        return Err(VerifyError::SampleIndex { index, elements: reference.len() });
    }
    let pairs = indices.iter().zip(values).map(|(&i, &d)| (i, reference[i as usize], d));
    Ok(tally(pairs, largest_magnitude(reference), tolerance))
}

fn largest_magnitude(values: &[f32]) -> f64 {
    values.iter().filter(|v| v.is_finite()).fold(0.0f64, |m, &v| m.max(v.abs() as f64))
}

fn tally(pairs: impl Iterator<Item = (u64, f32, f32)>, largest: f64, tolerance: Tolerance) -> Comparison {
    let mut comparison = Comparison {
        elements: 0,
        max_abs_error: 0.0,
        worst_index: 0,
        worst_device: 0.0,
        worst_reference: 0.0,
        worst_ratio: 0.0,
        violations: 0,
        non_finite: 0,
        tolerance,
        passed: true,
    };
    for (index, reference, device) in pairs {
        comparison.elements += 1;
        if !device.is_finite() {
            comparison.non_finite += 1;
        }
        // A non-finite device value fails, and a non-finite reference can only be matched by
        // one: either way the element is outside the tolerance (its limit would be infinite
        // or undefined there, so the ratio is not taken).
        let finite = device.is_finite() && reference.is_finite();
        let error = if finite { (device as f64 - reference as f64).abs() } else { f64::INFINITY };
        let limit = tolerance.limit(reference as f64, largest);
        let ratio = if !finite {
            f64::INFINITY
        } else if error == 0.0 {
            0.0
        } else if limit > 0.0 {
            error / limit
        } else {
            f64::INFINITY
        };
        if ratio > 1.0 {
            comparison.violations += 1;
        }
        if comparison.elements == 1 || error > comparison.max_abs_error {
            comparison.max_abs_error = error;
            comparison.worst_index = index;
            comparison.worst_device = device;
            comparison.worst_reference = reference;
        }
        comparison.worst_ratio = comparison.worst_ratio.max(ratio);
    }
    comparison.passed = comparison.violations == 0;
    comparison
}

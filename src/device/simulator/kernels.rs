//! The arithmetic of the vertex kernels, on contiguous f32 buffers.
//!
//! Operands arrive already converted from tile memory (f16 widened exactly to f32) and leave
//! through the caller, which rounds f16 results to nearest even. All arithmetic is f32, as on
//! the tile: the AMP accumulates matrix products in fp32, and the vector kernels widen f16 to
//! f32 before computing. Loops run over slices with a contiguous inner dimension so that the
//! compiler vectorises them; nothing here interprets one element at a time through a dispatch.
//!
//! This module must not touch tile memory, costs or the package: it is pure arithmetic, and
//! the accumulation order of each kernel is part of its contract (stated per function).

/// `c[m x n] = a[m x k] . b[k x n]`, all row-major and contiguous. Each `c[i][j]` is the fp32
/// sum over `kk` in increasing order of `a[i][kk] * b[kk][j]`, starting from zero. Blocks of
/// four rows by sixteen columns keep their sums in registers for the whole pass over `kk`
/// (narrower blocks at the right and bottom edges). On x86-64 CPUs with AVX2 the same loops
/// are compiled for 256-bit vectors (selected at run time); FMA is not enabled, so every
/// product and sum is rounded exactly as in the portable code and the results are
/// bit-identical.
pub fn matmul(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        unsafe { matmul_avx2(a, b, c, m, k, n) };
        return;
    }
    matmul_portable(a, b, c, m, k, n)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn matmul_avx2(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    matmul_portable(a, b, c, m, k, n)
}

/// Rows and columns of the output block whose sums stay in registers.
const BLOCK_ROWS: usize = 4;
const BLOCK_COLUMNS: usize = 16;

#[inline(always)]
fn matmul_portable(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    assert!(a.len() == m * k && b.len() == k * n && c.len() == m * n, "matmul operands do not match {m} x {k} x {n}");
    if n == 0 {
        return;
    }
    let mut first_row = 0;
    while first_row < m {
        if m - first_row >= BLOCK_ROWS {
            block_row::<BLOCK_ROWS>(a, b, c, first_row, k, n);
            first_row += BLOCK_ROWS;
        } else {
            block_row::<1>(a, b, c, first_row, k, n);
            first_row += 1;
        }
    }
}

/// Output rows `first_row..first_row + R`, column block by column block.
#[inline(always)]
fn block_row<const R: usize>(a: &[f32], b: &[f32], c: &mut [f32], first_row: usize, k: usize, n: usize) {
    let mut first_column = 0;
    while first_column < n {
        let left = n - first_column;
        first_column += if left >= BLOCK_COLUMNS {
            block::<R, BLOCK_COLUMNS>(a, b, c, first_row, first_column, k, n)
        } else if left >= 8 {
            block::<R, 8>(a, b, c, first_row, first_column, k, n)
        } else {
            block::<R, 1>(a, b, c, first_row, first_column, k, n)
        };
    }
}

/// One R x W block of `c`: every sum starts at zero and adds its products in increasing `kk`.
/// Returns W.
#[inline(always)]
fn block<const R: usize, const W: usize>(a: &[f32], b: &[f32], c: &mut [f32], first_row: usize, first_column: usize, k: usize, n: usize) -> usize {
    let rows: [&[f32]; R] = std::array::from_fn(|r| &a[(first_row + r) * k..(first_row + r + 1) * k]);
    let mut sums = [[0.0f32; W]; R];
    for (kk, b_row) in b.chunks_exact(n).enumerate() {
        let b_part: &[f32; W] = b_row[first_column..first_column + W].try_into().expect("W columns");
        for (sum, row) in sums.iter_mut().zip(&rows) {
            let x = row[kk];
            for (s, &bv) in sum.iter_mut().zip(b_part) {
                *s += x * bv;
            }
        }
    }
    for (r, sum) in sums.iter().enumerate() {
        let at = (first_row + r) * n + first_column;
        c[at..at + W].copy_from_slice(sum);
    }
    W
}

/// Transpose a row-major `rows` x `cols` buffer into `out` (`cols` x `rows`).
pub fn transpose(input: &[f32], rows: usize, cols: usize, out: &mut Vec<f32>) {
    out.clear();
    out.resize(rows * cols, 0.0);
    for (r, row) in input.chunks_exact(cols.max(1)).enumerate().take(rows) {
        for (c, &v) in row.iter().enumerate() {
            out[c * rows + r] = v;
        }
    }
}

/// `acc += part`, element by element (a reduction adds its parts in package order).
pub fn accumulate(acc: &mut [f32], part: &[f32]) {
    for (a, &p) in acc.iter_mut().zip(part) {
        *a += p;
    }
}

/// GELU, tanh approximation, in f32: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu(values: &mut [f32]) {
    let sqrt_2_over_pi = std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2;
    for x in values.iter_mut() {
        let v = *x;
        *x = 0.5 * v * (1.0 + (sqrt_2_over_pi * (v + 0.044715 * v * v * v)).tanh());
    }
}

/// GELU, exact form, in f32: `0.5 x (1 + erf(x / sqrt 2))`, with erf by Abramowitz and Stegun
/// 7.1.26 (a rational-exponential fit, absolute error below 1.5e-7, far under f16's step).
pub fn gelu_erf(values: &mut [f32]) {
    for x in values.iter_mut() {
        let v = *x;
        let z = (v * std::f32::consts::FRAC_1_SQRT_2).abs();
        let t = 1.0 / (1.0 + 0.327_591_1 * z);
        let poly = t * (0.254_829_6 + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152_1 + t * 1.061_405_4))));
        let erf = (1.0 - poly * (-z * z).exp()).copysign(v);
        *x = 0.5 * v * (1.0 + erf);
    }
}

/// `values[r][c] += row[c]` for every row of `row.len()` elements.
pub fn add_row(values: &mut [f32], row: &[f32]) {
    if row.is_empty() {
        return;
    }
    for chunk in values.chunks_exact_mut(row.len()) {
        for (v, &b) in chunk.iter_mut().zip(row) {
            *v += b;
        }
    }
}

/// `values[r][c] += column[r]` for every row r (`column.len()` rows).
pub fn add_column(values: &mut [f32], column: &[f32]) {
    if column.is_empty() {
        return;
    }
    let cols = values.len() / column.len();
    for (row, &b) in values.chunks_exact_mut(cols.max(1)).zip(column) {
        for v in row.iter_mut() {
            *v += b;
        }
    }
}

/// LayerNorm of each row (`gamma.len()` elements) in f32: the mean is the sum in increasing
/// column order over the length; the variance the same sum of squared deviations (two passes);
/// `(x - mean) * (1 / sqrt(var + eps)) * gamma + beta`.
pub fn layer_norm_rows(values: &mut [f32], gamma: &[f32], beta: &[f32], eps: f32) {
    let cols = gamma.len();
    if cols == 0 {
        return;
    }
    for row in values.chunks_exact_mut(cols) {
        let mean = row.iter().sum::<f32>() / cols as f32;
        let variance = row.iter().map(|&x| (x - mean) * (x - mean)).sum::<f32>() / cols as f32;
        let inverse = 1.0 / (variance + eps).sqrt();
        for ((x, &g), &b) in row.iter_mut().zip(gamma).zip(beta) {
            *x = (*x - mean) * inverse * g + b;
        }
    }
}

/// fp32 elements of one row's statistics of a LayerNorm segment: count, mean, sum of squared
/// deviations from the mean, 0.
pub const STATISTICS: u32 = 4;

/// The statistics of each row (`cols` elements) of a LayerNorm segment into `out`, four fp32
/// elements a row (`STATISTICS`): the count, the mean (the sum in increasing column order over
/// the count), the sum of the squared deviations from it in the same order (two passes, as
/// `layer_norm_rows`), and 0. A segment of no columns has `rows` records of zeros (no
/// elements: count, mean and squares 0).
pub fn layer_norm_statistics(values: &[f32], rows: usize, cols: usize, out: &mut Vec<f32>) {
    out.clear();
    if cols == 0 {
        out.resize(rows * STATISTICS as usize, 0.0);
        return;
    }
    for row in values.chunks_exact(cols) {
        let mean = row.iter().sum::<f32>() / cols as f32;
        let squares = row.iter().map(|&x| (x - mean) * (x - mean)).sum::<f32>();
        out.extend([cols as f32, mean, squares, 0.0]);
    }
}

/// LayerNorm of each row of one segment (`gamma.len()` elements a row) from the statistics of
/// all `segments` segments of those rows (`statistics`: `segments` blocks of one
/// `STATISTICS`-element record per row), merged in block order by the pairwise update of
/// Chan, Golub and LeVeque (1979): n = n_a + n_b, mean = mean_a + (mean_b - mean_a) n_b / n,
/// m2 = m2_a + m2_b + (mean_b - mean_a)^2 n_a n_b / n; the variance is m2 / n. Then
/// `(x - mean) * (1 / sqrt(var + eps)) * gamma + beta`, as `layer_norm_rows`.
pub fn layer_norm_segment(values: &mut [f32], statistics: &[f32], segments: usize, gamma: &[f32], beta: &[f32], eps: f32) {
    let cols = gamma.len();
    let width = STATISTICS as usize;
    if cols == 0 || segments == 0 {
        return;
    }
    let rows = values.len() / cols;
    for (r, row) in values.chunks_exact_mut(cols).enumerate() {
        let record = |p: usize| &statistics[(p * rows + r) * width..(p * rows + r + 1) * width];
        let first = record(0);
        let (mut n, mut mean, mut m2) = (first[0], first[1], first[2]);
        for p in 1..segments {
            let next = record(p);
            let (nb, mean_b, m2_b) = (next[0], next[1], next[2]);
            let total = n + nb;
            if total == 0.0 {
                continue;
            }
            let delta = mean_b - mean;
            let weight = nb / total;
            mean += delta * weight;
            m2 += m2_b + delta * delta * n * weight;
            n = total;
        }
        let variance = if n > 0.0 { m2 / n } else { 0.0 };
        let inverse = 1.0 / (variance + eps).sqrt();
        for ((x, &g), &b) in row.iter_mut().zip(gamma).zip(beta) {
            *x = (*x - mean) * inverse * g + b;
        }
    }
}

pub fn scale(values: &mut [f32], factor: f32) {
    for x in values.iter_mut() {
        *x *= factor;
    }
}

/// Round each value to the nearest f16 (ties to even), as a write to tile memory would.
pub fn round_to_f16(values: &mut [f32]) {
    for x in values.iter_mut() {
        *x = half::f16::from_f32(*x).to_f32();
    }
}

/// Softmax over each row of `cols` elements: subtract the row maximum, exponentiate, sum in
/// increasing column order, divide.
pub fn softmax_rows(values: &mut [f32], cols: usize) {
    if cols == 0 {
        return;
    }
    for row in values.chunks_exact_mut(cols) {
        let sum = exp_row(row);
        for x in row.iter_mut() {
            *x /= sum;
        }
    }
}

/// Subtract the row's maximum and exponentiate in place; the sum, accumulated in increasing
/// column order.
fn exp_row(row: &mut [f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    sum
}

/// Softmax over each row of `cols` elements with the normalisation deferred: subtract the row
/// maximum and exponentiate, summing in increasing column order (as `softmax_rows`), and leave
/// the values unnormalised; `reciprocals` receives 1 / sum per row, in row order.
pub fn softmax_rows_unnormalised(values: &mut [f32], rows: usize, cols: usize, reciprocals: &mut Vec<f32>) {
    reciprocals.clear();
    if cols == 0 {
        // Rows of no elements: each sums to 0, whose reciprocal is infinite.
        reciprocals.resize(rows, f32::INFINITY);
        return;
    }
    for row in values.chunks_exact_mut(cols) {
        reciprocals.push(1.0 / exp_row(row));
    }
}

/// `values[r][c] *= factors[r]` for every row r (`factors.len()` rows).
pub fn scale_rows(values: &mut [f32], factors: &[f32]) {
    if factors.is_empty() {
        return;
    }
    let cols = values.len() / factors.len();
    for (row, &f) in values.chunks_exact_mut(cols.max(1)).zip(factors) {
        for v in row.iter_mut() {
            *v *= f;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_matches_the_textbook_sum_for_blocked_and_remainder_rows() {
        // Every block kind: full 4 x 16 blocks, 8-column and single-column edges, single rows.
        for (m, k, n) in [(6, 5, 3), (9, 37, 43), (4, 1, 16), (1, 3, 25), (7, 0, 5)] {
            let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut c = vec![f32::NAN; m * n];
            matmul(&a, &b, &mut c, m, k, n);
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0.0f32;
                    for kk in 0..k {
                        s += a[i * k + kk] * b[kk * n + j];
                    }
                    assert_eq!(c[i * n + j].to_bits(), s.to_bits(), "{m} x {k} x {n}: ({i}, {j})");
                }
            }
        }
    }

    #[test]
    fn softmax_rows_sum_to_one_and_gelu_is_odd_around_its_shift() {
        let mut v = vec![1.0, 2.0, 3.0, -1.0, 0.0, 1.0];
        softmax_rows(&mut v, 3);
        assert!((v[..3].iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let mut u = vec![1.0, 2.0, 3.0, -1.0, 0.0, 1.0];
        let mut reciprocals = Vec::new();
        softmax_rows_unnormalised(&mut u, 2, 3, &mut reciprocals);
        assert_eq!(reciprocals.len(), 2);
        assert_eq!(u[2], 1.0, "the row maximum exponentiates to one");
        scale_rows(&mut u, &reciprocals);
        for (a, b) in u.iter().zip(&v) {
            assert!((a - b).abs() < 1e-6, "deferred {a} vs normalised {b}");
        }
        let mut g = vec![0.0, 1.0, -1.0];
        gelu(&mut g);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - g[2] - 1.0).abs() < 1e-6, "gelu(x) - gelu(-x) = x");
    }

    /// Rows split into segments of unequal widths (as a tile's share may be), each segment's
    /// statistics merged from every segment's, normalise as the whole rows do.
    #[test]
    fn layer_norm_from_merged_segment_statistics_matches_whole_rows() {
        let (rows, cols) = (3usize, 37usize);
        let x: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.71).sin() * 3.0 + (i / cols) as f32 * 10.0).collect();
        let gamma: Vec<f32> = (0..cols).map(|c| 0.5 + c as f32 / cols as f32).collect();
        let beta: Vec<f32> = (0..cols).map(|c| (c as f32 * 0.3).cos()).collect();
        let mut whole = x.clone();
        layer_norm_rows(&mut whole, &gamma, &beta, 1e-5);
        for cuts in [vec![0, 37], vec![0, 20, 37], vec![0, 4, 8, 36, 37], vec![0, 12, 24, 36, 37]] {
            let segment = |p: usize| -> (usize, usize) { (cuts[p], cuts[p + 1]) };
            let block = |p: usize| -> Vec<f32> {
                let (c0, c1) = segment(p);
                (0..rows).flat_map(|r| x[r * cols + c0..r * cols + c1].to_vec()).collect()
            };
            // Segment-major statistics: every segment's records of the three rows, in order.
            let mut statistics = Vec::new();
            for p in 0..cuts.len() - 1 {
                let mut records = Vec::new();
                layer_norm_statistics(&block(p), rows, segment(p).1 - segment(p).0, &mut records);
                assert_eq!(records.len(), rows * STATISTICS as usize);
                statistics.extend(records);
            }
            for p in 0..cuts.len() - 1 {
                let (c0, c1) = segment(p);
                let mut values = block(p);
                layer_norm_segment(&mut values, &statistics, cuts.len() - 1, &gamma[c0..c1], &beta[c0..c1], 1e-5);
                assert_eq!(statistics.len(), (cuts.len() - 1) * rows * STATISTICS as usize);
                for r in 0..rows {
                    for c in c0..c1 {
                        let (got, want) = (values[r * (c1 - c0) + c - c0], whole[r * cols + c]);
                        assert!((got - want).abs() < 1e-5 * (1.0 + want.abs()), "cuts {cuts:?} row {r} column {c}: {got} vs {want}");
                    }
                }
            }
        }
    }
}

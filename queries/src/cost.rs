//! Cost formulas of the machine model: cycles of each vertex call and of an exchange phase.
//!
//! The constants come from the target description; the formulas are those of
//! `shared/design/machine-model.md` (hardware-measured where the seed's compiler measured them,
//! poplibs' cycle estimators elsewhere). The planner estimates with them and the simulator
//! charges them for the vertex calls it executes, so the two can only disagree where the
//! planner's picture of a call differs from the call the package really makes.

use crate::package::{Addend, Broadcast, Operand, VertexCall};
use crate::target::Target;

fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b.max(1))
}

/// Where a matrix product's weights (B operand) sit: 128-bit loads need interleaved memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightClass {
    Interleaved,
    Standard,
}

/// One AMP call: C[m x n] = A[m x k] . B[k x n] (fp32 accumulation).
pub fn gemm(t: &Target, m: u32, k: u32, n: u32, weights: WeightClass, b_transposed: bool) -> u64 {
    let c = &t.costs;
    let blocks = ceil_div(k as u64, c.gemm_block) * ceil_div(n as u64, c.gemm_block);
    let mut per_block = c.gemm_per_row * m as u64 + c.gemm_per_block;
    if weights == WeightClass::Standard {
        per_block += c.gemm_standard_weight_extra_per_block;
    }
    if b_transposed {
        per_block += c.gemm_transposed_weight_extra_per_block;
    }
    c.kernel_launch + c.gemm_base + blocks * per_block
}

/// Sum of `parts` fp32 partial blocks of `n` elements into f16.
pub fn reduce(t: &Target, parts: u32, n: u64) -> u64 {
    let c = &t.costs;
    let extra = parts.saturating_sub(1) as u64;
    c.kernel_launch + c.reduce_base + 6 * ceil_div(n, c.reduce_chunk) * (c.reduce_chunk_base + c.reduce_per_partial * extra)
}

pub fn gelu(t: &Target, n: u64) -> u64 {
    let c = &t.costs;
    c.kernel_launch + c.gelu_base + c.gelu_per_chunk * ceil_div(n, c.gelu_chunk)
}

fn workers(t: &Target) -> u64 {
    t.chip.workers as u64
}

/// poplibs' unary elementwise estimate over n half elements with `cpl` cycles per loop.
pub fn unary_half(t: &Target, n: u64, cpl: u64, is_exp: bool) -> u64 {
    let c = &t.costs;
    let w = workers(t);
    let per_worker = ceil_div(n, w);
    let body = ceil_div(per_worker, t.compute.vector_f16_lanes as u64) * (cpl + 4);
    let base = if is_exp { c.unary_exp_base } else { c.unary_base };
    c.kernel_launch + w * (base + body) + c.unary_tail
}

/// GELU's exact (erf) form over n elements: the measured tanh form's shape with its own
/// per-chunk cost (`gelu_erf_per_chunk`, an assumption: no erf instruction, a polynomial).
pub fn gelu_erf(t: &Target, n: u64) -> u64 {
    let c = &t.costs;
    c.kernel_launch + c.gelu_base + c.gelu_erf_per_chunk * ceil_div(n, c.gelu_chunk)
}

/// poplibs' unary elementwise estimate over n float elements (fp32 vectors of
/// `vector_f32_lanes`, plus the float setup), for fp32 statistics.
pub fn unary_float(t: &Target, n: u64, cpl: u64) -> u64 {
    let c = &t.costs;
    let w = workers(t);
    let body = ceil_div(ceil_div(n, w), t.compute.vector_f32_lanes as u64) * (cpl + 4);
    c.kernel_launch + w * (c.unary_base + c.float_setup + body) + c.unary_tail
}

/// LayerNorm over rows, composed (like softmax) of elementwise passes at the poplibs per-element
/// costs: the row sums for the mean and the sums of squared deviations in fp32 (add; subtract,
/// multiply, add), one fp32 reciprocal square root per row (a divide, rows spread over the
/// workers), normalisation in f16 (subtract, multiply), and the affine gamma/beta (two binary
/// passes, multiply and add).
pub fn layer_norm(t: &Target, rows: u32, cols: u32) -> u64 {
    // Its two halves over whole rows: the statistics, then one segment's normalisation (no
    // other segment to merge).
    layer_norm_statistics(t, rows, cols) + layer_norm_segment(t, rows, cols, 1)
}

/// The statistics of one segment of LayerNorm rows (`LayerNormStatistics`): the first two
/// passes of [`layer_norm`] over the segment, the row sums and the sums of squared deviations
/// in fp32.
pub fn layer_norm_statistics(t: &Target, rows: u32, cols: u32) -> u64 {
    let c = &t.costs;
    let n = rows as u64 * cols as u64;
    unary_float(t, n, c.cpl_add_float) + unary_float(t, n, 2 * c.cpl_add_float + c.cpl_mul_float)
}

/// LayerNorm of one segment of rows from the statistics of `segments` segments
/// (`LayerNormSegment`): per row (rows spread over the workers, as [`layer_norm`]'s reciprocal
/// square root), each further segment merged in fp32 (the counts' add, the weight's divide,
/// the mean's subtract, multiply and add, the squared deviations' two multiplies and two adds:
/// one divide, three multiplies and five adds), then the reciprocal square root (a divide);
/// then [`layer_norm`]'s last three passes over the segment (normalise, gamma, beta). The
/// composition is an assumption (`[INF]`); every per-element term is the target file's.
pub fn layer_norm_segment(t: &Target, rows: u32, cols: u32, segments: u32) -> u64 {
    let c = &t.costs;
    let n = rows as u64 * cols as u64;
    let w = workers(t);
    let merge = c.cpl_divide_float + 3 * c.cpl_mul_float + 5 * c.cpl_add_float;
    w * ceil_div(rows as u64, w) * (segments.saturating_sub(1) as u64 * merge + c.cpl_divide_float)
        + unary_half(t, n, c.cpl_add_half + c.cpl_mul_half, false)
        + binary_half(t, n, c.cpl_mul_half)
        + binary_half(t, n, c.cpl_add_half)
}

/// poplibs' binary elementwise estimate over n half elements.
pub fn binary_half(t: &Target, n: u64, cpl: u64) -> u64 {
    let c = &t.costs;
    let w = workers(t);
    let body = ceil_div(ceil_div(n, w), t.compute.vector_f16_lanes as u64) * (cpl + 2);
    c.kernel_launch + w * (c.binary_base + body) + c.binary_tail
}

/// Softmax over rows, composed of four elementwise passes (max, exp, sum, scale by the
/// reciprocal) at the poplibs costs; the row structure adds no cost of its own in this model.
pub fn softmax(t: &Target, rows: u32, cols: u32) -> u64 {
    let c = &t.costs;
    let n = rows as u64 * cols as u64;
    unary_half(t, n, c.cpl_max_half, false)
        + unary_half(t, n, c.cpl_exp_half, true)
        + unary_half(t, n, c.cpl_add_half, false)
        + unary_half(t, n, c.cpl_mul_half, false)
}

/// Softmax of a scaled input, the scale folded in: the exponential pass multiplies each
/// vector by the scale before its subtract-and-exponentiate (exp(s*x - s*max), the maximum of
/// s*x being s*max(x) for s > 0), so it pays the scale pass's per-vector multiply term
/// (`cpl_mul_half`) and saves that pass's launch, worker base, loads, stores and tail.
pub fn scaled_softmax(t: &Target, rows: u32, cols: u32) -> u64 {
    let c = &t.costs;
    let n = rows as u64 * cols as u64;
    unary_half(t, n, c.cpl_max_half, false)
        + unary_half(t, n, c.cpl_exp_half + c.cpl_mul_half, true)
        + unary_half(t, n, c.cpl_add_half, false)
        + unary_half(t, n, c.cpl_mul_half, false)
}

/// Softmax with its normalisation deferred to the product that consumes it: the maximum pass,
/// then one exponential pass that also accumulates each row's sum (the sum pass's per-vector
/// add term, `cpl_add_half`, joins the exponential's loop; that pass's launch, worker base,
/// loads, stores and tail are saved), then one fp32 reciprocal per row (a divide, rows spread
/// over the workers, as LayerNorm's). The normalise pass is not run here: the consumer's
/// epilogue multiplies its rows by the reciprocals (`epilogue_scale`). With `scaled`, the
/// exponential pass also pays the folded scale's multiply term (as `scaled_softmax`). The
/// composition is an assumption (`[INF]`); every term is the target file's.
pub fn deferred_softmax(t: &Target, rows: u32, cols: u32, scaled: bool) -> u64 {
    let c = &t.costs;
    let n = rows as u64 * cols as u64;
    let w = workers(t);
    let multiply = if scaled { c.cpl_mul_half } else { 0 };
    unary_half(t, n, c.cpl_max_half, false) + unary_half(t, n, c.cpl_exp_half + multiply + c.cpl_add_half, true) + w * ceil_div(rows as u64, w) * c.cpl_divide_float
}

/// A row scale folded into the epilogue of a product (or of the reduction that finishes it)
/// over `n` output elements: the normalise pass's per-vector multiply body (`cpl_mul_half`
/// plus the binary loop's 2 cycles per vector, over the workers, as `epilogue_add`); its
/// launch, worker base and tail are the pass it saves. The composition is an assumption
/// (`[INF]`), every term is the target file's.
pub fn epilogue_scale(t: &Target, n: u64) -> u64 {
    let w = workers(t);
    w * ceil_div(ceil_div(n, w), t.compute.vector_f16_lanes as u64) * (t.costs.cpl_mul_half + 2)
}

/// The epilogue cost of an addend (or row scale) `broadcast` on a call writing `n` elements.
pub fn epilogue(t: &Target, broadcast: Broadcast, n: u64) -> u64 {
    match broadcast {
        Broadcast::RowScale => epilogue_scale(t, n),
        Broadcast::Row | Broadcast::Column | Broadcast::Full => epilogue_add(t, n),
    }
}

/// An addend folded into the epilogue of a product (or of the reduction that finishes it) over
/// `n` output elements: the separate binary add pass's per-vector body (`cpl_add_half` plus the
/// binary loop's 2 cycles per vector, over the workers) is paid; its launch, worker base and
/// tail are the pass it saves. The composition is an assumption (`[INF]`), every term is the
/// target file's.
pub fn epilogue_add(t: &Target, n: u64) -> u64 {
    let w = workers(t);
    w * ceil_div(ceil_div(n, w), t.compute.vector_f16_lanes as u64) * (t.costs.cpl_add_half + 2)
}

/// The epilogue cost of an optional addend on a call writing `rows` x `cols` elements.
fn addend_cost<O>(t: &Target, add: &Option<Addend<O>>, rows: u32, cols: u32) -> u64 {
    add.as_ref().map_or(0, |x| epilogue(t, x.broadcast, rows as u64 * cols as u64))
}

pub fn copy(t: &Target, bytes: u64, both_interleaved: bool) -> u64 {
    let c = &t.costs;
    let rate = if both_interleaved { c.copy_interleaved_bytes_per_cycle } else { c.copy_standard_bytes_per_cycle };
    c.kernel_launch + c.copy_overhead + ceil_div(bytes, rate)
}

/// A local copy one 32-bit word at a time (`CopyWords`: rows that start on a word but not on
/// the data alignment): the measured copy's call overhead, then `copy_word_cycles` per word
/// (the 64-bit path does not apply; each word is loaded and stored alone). The per-word term
/// is an assumption (`[INF]` in the target).
pub fn copy_words(t: &Target, bytes: u64) -> u64 {
    let c = &t.costs;
    c.kernel_launch + c.copy_overhead + ceil_div(bytes, 4) * c.copy_word_cycles
}

/// A local copy of f16 elements one at a time (`CopyHalves`: rows that start or end inside a
/// 32-bit word): the measured copy's call overhead, then `copy_word_cycles` per element (one
/// 16-bit load and one 16-bit store each, as the word copy's one 32-bit load and store). The
/// per-element term is the word copy's assumption (`[INF]` in the target).
pub fn copy_halves(t: &Target, elements: u64) -> u64 {
    let c = &t.costs;
    c.kernel_launch + c.copy_overhead + elements * c.copy_word_cycles
}

/// A local transpose of rows x cols f16 elements: the measured copy's call overhead, then
/// `transpose_cycles_per_element` per element (no 64-bit loads or stores apply: each element
/// is loaded and stored alone). The per-element term is an assumption (`[INF]` in the target).
pub fn transpose(t: &Target, rows: u32, cols: u32) -> u64 {
    let c = &t.costs;
    c.kernel_launch + c.copy_overhead + rows as u64 * cols as u64 * c.transpose_cycles_per_element
}

/// Cycles of an exchange phase with the given horizon, sync included.
pub fn exchange_phase(t: &Target, horizon: u32) -> u64 {
    t.exchange.sync_cycles + horizon as u64
}

/// Cycles of one vertex call as the package states it: the weight class of a matrix product
/// and the copy rate follow from the operands' addresses.
pub fn vertex(t: &Target, call: &VertexCall) -> u64 {
    if let VertexCall::MatMul { m, k, n, b, b_transposed, add, .. } = call {
        return gemm(t, *m, *k, *n, weight_class(t, b), *b_transposed) + addend_cost(t, add, *m, *n);
    }
    vertex_with(t, call, |o| o.address >= t.memory.interleaved_start)
}

/// The weight-load path of a placed B operand (f16): 128-bit loads need interleaved memory and
/// an address and row pitch aligned to `memory.weight_load_alignment`; anything else loads
/// 64 bits at a time, at the standard-memory cost.
pub fn weight_class(t: &Target, b: &Operand) -> WeightClass {
    let m = &t.memory;
    let align = m.weight_load_alignment.max(1) as u64;
    let aligned = (b.address as u64).is_multiple_of(align) && (b.row_stride as u64 * 2).is_multiple_of(align);
    if b.address >= m.interleaved_start && aligned {
        WeightClass::Interleaved
    } else {
        WeightClass::Standard
    }
}

/// The target constants (`section.key`) that [`vertex`] reads to price a placed call: what the
/// simulator checks against the target file's provenance tags.
pub fn vertex_constants(t: &Target, call: &VertexCall) -> Vec<&'static str> {
    let mut keys = vec!["costs.kernel_launch"];
    match call {
        VertexCall::MatMul { b, b_transposed, add, .. } => {
            keys.extend(["costs.gemm_base", "costs.gemm_block", "costs.gemm_per_row", "costs.gemm_per_block"]);
            keys.extend(epilogue_constants(add));
            if weight_class(t, b) == WeightClass::Standard {
                keys.push("costs.gemm_standard_weight_extra_per_block");
            }
            if *b_transposed {
                keys.push("costs.gemm_transposed_weight_extra_per_block");
            }
        }
        VertexCall::Reduce { add, .. } => {
            keys.extend(["costs.reduce_base", "costs.reduce_chunk", "costs.reduce_chunk_base", "costs.reduce_per_partial"]);
            keys.extend(epilogue_constants(add));
        }
        VertexCall::Gelu { .. } => keys.extend(["costs.gelu_base", "costs.gelu_chunk", "costs.gelu_per_chunk"]),
        VertexCall::Scale { .. } => keys.extend(["costs.unary_base", "costs.unary_tail", "costs.cpl_mul_half", "compute.vector_f16_lanes", "chip.workers"]),
        VertexCall::Add { .. } => keys.extend(["costs.binary_base", "costs.binary_tail", "costs.cpl_add_half", "compute.vector_f16_lanes", "chip.workers"]),
        VertexCall::Softmax { reciprocals: Some(_), scale, .. } => {
            keys.extend(["costs.unary_base", "costs.unary_exp_base", "costs.unary_tail", "costs.cpl_max_half", "costs.cpl_exp_half", "costs.cpl_add_half", "costs.cpl_divide_float", "compute.vector_f16_lanes", "chip.workers"]);
            if *scale != 1.0 {
                keys.push("costs.cpl_mul_half");
            }
        }
        VertexCall::Softmax { .. } => keys.extend([
            "costs.unary_base",
            "costs.unary_exp_base",
            "costs.unary_tail",
            "costs.cpl_max_half",
            "costs.cpl_exp_half",
            "costs.cpl_add_half",
            "costs.cpl_mul_half",
            "compute.vector_f16_lanes",
            "chip.workers",
        ]),
        VertexCall::GeluErf { .. } => keys.extend(["costs.gelu_base", "costs.gelu_chunk", "costs.gelu_erf_per_chunk"]),
        VertexCall::BiasAdd { .. } => keys.extend(["costs.binary_base", "costs.binary_tail", "costs.cpl_add_half", "compute.vector_f16_lanes", "chip.workers"]),
        // The whole-row LayerNorm reads what its two halves, statistics and normalisation, read.
        VertexCall::LayerNorm { .. } => {
            keys.extend(LAYER_NORM_STATISTICS_CONSTANTS);
            keys.extend(LAYER_NORM_SEGMENT_CONSTANTS.iter().filter(|k| !LAYER_NORM_STATISTICS_CONSTANTS.contains(k)));
        }
        VertexCall::LayerNormStatistics { .. } => keys.extend(LAYER_NORM_STATISTICS_CONSTANTS),
        VertexCall::LayerNormSegment { .. } => keys.extend(LAYER_NORM_SEGMENT_CONSTANTS),
        VertexCall::Copy { .. } => keys.extend(["costs.copy_overhead", "costs.copy_standard_bytes_per_cycle", "costs.copy_interleaved_bytes_per_cycle"]),
        VertexCall::CopyWords { .. } | VertexCall::CopyHalves { .. } => keys.extend(["costs.copy_overhead", "costs.copy_word_cycles"]),
        VertexCall::Transpose { .. } => keys.extend(["costs.copy_overhead", "costs.transpose_cycles_per_element"]),
    }
    keys
}

/// The target constants [`layer_norm_statistics`] reads (besides the launch).
const LAYER_NORM_STATISTICS_CONSTANTS: [&str; 7] =
    ["costs.unary_base", "costs.unary_tail", "costs.float_setup", "costs.cpl_add_float", "costs.cpl_mul_float", "compute.vector_f32_lanes", "chip.workers"];

/// The target constants [`layer_norm_segment`] reads (besides the launch).
const LAYER_NORM_SEGMENT_CONSTANTS: [&str; 11] = [
    "costs.unary_base",
    "costs.unary_tail",
    "costs.binary_base",
    "costs.binary_tail",
    "costs.cpl_add_float",
    "costs.cpl_mul_float",
    "costs.cpl_divide_float",
    "costs.cpl_add_half",
    "costs.cpl_mul_half",
    "compute.vector_f16_lanes",
    "chip.workers",
];

/// The target constants [`epilogue`] reads for a call's addend or row scale.
fn epilogue_constants<O>(add: &Option<Addend<O>>) -> Vec<&'static str> {
    match add.as_ref().map(|x| x.broadcast) {
        None => Vec::new(),
        Some(Broadcast::RowScale) => vec!["costs.cpl_mul_half", "compute.vector_f16_lanes", "chip.workers"],
        Some(_) => vec!["costs.cpl_add_half", "compute.vector_f16_lanes", "chip.workers"],
    }
}

/// The target constants an exchange phase's cycles read: the sync and the route delays that
/// set the horizon.
pub const EXCHANGE_CONSTANTS: &[&str] =
    &["exchange.sync_cycles", "exchange.delay_base", "exchange.delay_per_column", "exchange.delay_per_row_group", "exchange.row_group", "exchange.delay_turn"];

/// Cycles of a call over any operands; `interleaved(operand)` says where an operand lies (the
/// planner, before placement, assumes what it will ask placement for).
pub fn vertex_with<O>(t: &Target, call: &VertexCall<O>, interleaved: impl Fn(&O) -> bool) -> u64 {
    match call {
        VertexCall::MatMul { m, k, n, b, b_transposed, add, .. } => {
            let class = if interleaved(b) { WeightClass::Interleaved } else { WeightClass::Standard };
            gemm(t, *m, *k, *n, class, *b_transposed) + addend_cost(t, add, *m, *n)
        }
        VertexCall::Reduce { rows, cols, parts, add, .. } => reduce(t, parts.len() as u32, *rows as u64 * *cols as u64) + addend_cost(t, add, *rows, *cols),
        VertexCall::Gelu { rows, cols, .. } => gelu(t, *rows as u64 * *cols as u64),
        VertexCall::Scale { rows, cols, .. } => unary_half(t, *rows as u64 * *cols as u64, t.costs.cpl_mul_half, false),
        VertexCall::Add { rows, cols, .. } => binary_half(t, *rows as u64 * *cols as u64, t.costs.cpl_add_half),
        VertexCall::Softmax { rows, cols, scale, reciprocals: Some(_), .. } => deferred_softmax(t, *rows, *cols, *scale != 1.0),
        VertexCall::Softmax { rows, cols, scale, .. } if *scale != 1.0 => scaled_softmax(t, *rows, *cols),
        VertexCall::Softmax { rows, cols, .. } => softmax(t, *rows, *cols),
        VertexCall::GeluErf { rows, cols, .. } => gelu_erf(t, *rows as u64 * *cols as u64),
        VertexCall::BiasAdd { rows, cols, .. } => binary_half(t, *rows as u64 * *cols as u64, t.costs.cpl_add_half),
        VertexCall::LayerNorm { rows, cols, .. } => layer_norm(t, *rows, *cols),
        VertexCall::LayerNormStatistics { rows, cols, .. } => layer_norm_statistics(t, *rows, *cols),
        VertexCall::LayerNormSegment { rows, cols, segments, .. } => layer_norm_segment(t, *rows, *cols, *segments),
        VertexCall::Copy { rows, cols, dtype, input, output } => {
            copy(t, *rows as u64 * *cols as u64 * dtype.bytes() as u64, interleaved(input) && interleaved(output))
        }
        VertexCall::CopyWords { rows, cols, dtype, .. } => copy_words(t, *rows as u64 * *cols as u64 * dtype.bytes() as u64),
        VertexCall::CopyHalves { rows, cols, .. } => copy_halves(t, *rows as u64 * *cols as u64),
        VertexCall::Transpose { rows, cols, .. } => transpose(t, *rows, *cols),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::{fixtures, Target};

    #[test]
    fn gemm_matches_the_measured_formula() {
        let t = Target::from_toml(fixtures::IPU21, "ipu21").unwrap();
        // 294 + ceil(288/16) * ceil(48/16) * (4 * 183 + 160) + launch 11
        assert_eq!(gemm(&t, 183, 288, 48, WeightClass::Interleaved, false), 11 + 294 + 18 * 3 * (4 * 183 + 160));
        assert!(gemm(&t, 183, 288, 48, WeightClass::Standard, false) > gemm(&t, 183, 288, 48, WeightClass::Interleaved, false));
    }

    #[test]
    fn a_folded_scale_costs_its_multiply_term_and_saves_the_rest_of_its_pass() {
        let t = Target::from_toml(fixtures::IPU21, "ipu21").unwrap();
        let (rows, cols) = (8u32, 729u32);
        let n = rows as u64 * cols as u64;
        let separate = unary_half(&t, n, t.costs.cpl_mul_half, false) + softmax(&t, rows, cols);
        let folded = scaled_softmax(&t, rows, cols);
        let multiply = t.chip.workers as u64 * n.div_ceil(t.chip.workers as u64).div_ceil(t.compute.vector_f16_lanes as u64) * t.costs.cpl_mul_half;
        assert_eq!(folded, softmax(&t, rows, cols) + multiply);
        assert!(folded < separate);
    }

    #[test]
    fn a_folded_bias_costs_the_add_pass_per_vector_body_and_saves_the_rest() {
        let t = Target::from_toml(fixtures::IPU21, "ipu21").unwrap();
        let (m, k, n) = (46u32, 1152u32, 32u32);
        let elements = m as u64 * n as u64;
        let separate = gemm(&t, m, k, n, WeightClass::Interleaved, true) + binary_half(&t, elements, t.costs.cpl_add_half);
        let folded = gemm(&t, m, k, n, WeightClass::Interleaved, true) + epilogue_add(&t, elements);
        // The pass saved: its launch, six worker bases and its tail; nothing else changes.
        assert_eq!(separate - folded, t.costs.kernel_launch + t.chip.workers as u64 * t.costs.binary_base + t.costs.binary_tail);
        let vectors = elements.div_ceil(t.chip.workers as u64).div_ceil(t.compute.vector_f16_lanes as u64);
        assert_eq!(epilogue_add(&t, elements), t.chip.workers as u64 * vectors * (t.costs.cpl_add_half + 2));
    }

    #[test]
    fn a_deferred_normalisation_saves_the_sum_and_normalise_passes_but_their_per_vector_terms() {
        let t = Target::from_toml(fixtures::IPU21, "ipu21").unwrap();
        let (rows, cols) = (8u32, 729u32);
        let n = rows as u64 * cols as u64;
        let w = t.chip.workers as u64;
        let vectors = n.div_ceil(w).div_ceil(t.compute.vector_f16_lanes as u64);
        // The sum pass's per-vector add joins the exponential loop; its launch, bases, loop
        // overhead and tail go; one fp32 divide per row is added; the normalise pass goes.
        let sum_pass = unary_half(&t, n, t.costs.cpl_add_half, false);
        let reciprocals = w * (rows as u64).div_ceil(w) * t.costs.cpl_divide_float;
        let normalise = unary_half(&t, n, t.costs.cpl_mul_half, false);
        for scaled in [false, true] {
            let full = if scaled { scaled_softmax(&t, rows, cols) } else { softmax(&t, rows, cols) };
            let deferred = deferred_softmax(&t, rows, cols, scaled);
            assert_eq!(deferred, full - sum_pass - normalise + w * vectors * t.costs.cpl_add_half + reciprocals);
        }
        // The consumer pays the normalise pass's per-vector multiply (binary body) on its output.
        let out = 67u64 * 9;
        assert_eq!(epilogue_scale(&t, out), w * out.div_ceil(w).div_ceil(t.compute.vector_f16_lanes as u64) * (t.costs.cpl_mul_half + 2));
        assert_eq!(epilogue(&t, Broadcast::RowScale, out), epilogue_scale(&t, out));
        assert_eq!(epilogue(&t, Broadcast::Column, out), epilogue_add(&t, out));
    }

    #[test]
    fn reduction_and_gelu_match_the_measured_formulas() {
        let t = Target::from_toml(fixtures::IPU21, "ipu21").unwrap();
        assert_eq!(reduce(&t, 4, 96), 11 + 282 + 6 * 2 * (9 + 6 * 3));
        assert_eq!(gelu(&t, 97), 11 + 300 + 558 * 2);
    }
}

//! Compute steps: checking each vertex call's operands against its tile's allocation map at
//! load time, then running the calls on tile memory.
//!
//! A call's operands are read into f32 buffers before anything is written, so in-place calls
//! (output over input) behave as the kernels intend. Cycles are `cost::vertex` per call,
//! summed per tile and compute set: the simulator charges exactly what the cost model states
//! for the call the package makes, never a constant of its own.
//!
//! Every operand must lie in an allocation of the right kind that is live at each step the set
//! runs, start at the target's data alignment (partials: in interleaved memory at the partial
//! alignment), and so must each of its rows: rows at a pitch of their own, and every row of a
//! matrix product's operands (a contiguous block of another vertex is one vector). A matrix
//! product's input A and its output C must not share a memory element: the AMP loop loads
//! input and partials and stores partials in one instruction, whose accesses must hit
//! different elements (the target's `element_bytes`, and `interleaved_element_bytes` pairs in
//! the interleaved window). This module must not run a call that `check_set` has not
//! accepted: execution indexes memory without further checks (an empty operand, which the
//! checks skip, touches nothing: see `TileMemory::range`).

use half::f16;
use ipuq_queries::cost;
use ipuq_queries::package::{Addend, Broadcast, ComputeSet, Operand, VertexCall};
use ipuq_queries::provenance::Provenance;
use ipuq_queries::target::Target;

use super::kernels;
use super::memory::{extent, Need, TileMemory};
use crate::device::DeviceError;

/// Bytes of the machine word a `CopyWords` call moves at a time (32 bits, the exchange's word).
const WORD_BYTES: u64 = 4;

/// One tile's calls of one compute set, checked, with their cycles.
pub struct CheckedSet {
    pub calls: Vec<VertexCall>,
    pub cycles: u64,
    /// Cycles priced by formulas whose constants are not all `[MEAS]` in the target file.
    pub unmeasured: u64,
    /// Floating-point operations of the set's matrix products (2 m k n each).
    pub flops: u64,
}

/// Reused buffers, one set per tile and step.
#[derive(Default)]
pub struct Scratch {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    t: Vec<f32>,
    bits: Vec<u16>,
    halves: Vec<f16>,
    bytes: Vec<u8>,
}

/// One operand access of a call, as the checks see it.
struct Access {
    name: &'static str,
    op: Operand,
    rows: u32,
    cols: u32,
    element_bytes: u32,
    need: Need,
}

fn accesses(call: &VertexCall) -> Vec<Access> {
    let half = |name, op, rows, cols| Access { name, op, rows, cols, element_bytes: 2, need: Need::Data };
    match call {
        VertexCall::MatMul { m, k, n, a, a_panel, b, b_transposed, c, c_panel, partials, add } => {
            let (b_rows, b_cols) = if *b_transposed { (*n, *k) } else { (*k, *n) };
            // Panelled A (C): ceil(k / w) (ceil(n / w)) panels of m rows, one (panels * m) x w block.
            let (a_rows, a_cols) = if *a_panel > 0 { (k.div_ceil(*a_panel).saturating_mul(*m), *a_panel) } else { (*m, *k) };
            let (c_rows, c_cols) = if *c_panel > 0 { (n.div_ceil(*c_panel).saturating_mul(*m), *c_panel) } else { (*m, *n) };
            let out = if *partials {
                Access { name: "c", op: *c, rows: c_rows, cols: c_cols, element_bytes: 4, need: Need::Partials }
            } else {
                half("c", *c, c_rows, c_cols)
            };
            let mut list = vec![half("a", *a, a_rows, a_cols), half("b", *b, b_rows, b_cols), out];
            list.extend(addend_access(add, *m, *n));
            list
        }
        VertexCall::Reduce { rows, cols, parts, out, add } => {
            let mut list: Vec<Access> = parts
                .iter()
                .map(|p| Access { name: "parts", op: *p, rows: *rows, cols: *cols, element_bytes: 4, need: Need::Partials })
                .collect();
            list.push(half("out", *out, *rows, *cols));
            list.extend(addend_access(add, *rows, *cols));
            list
        }
        VertexCall::Gelu { rows, cols, input, output } | VertexCall::Scale { rows, cols, input, output, .. } => {
            vec![half("input", *input, *rows, *cols), half("output", *output, *rows, *cols)]
        }
        VertexCall::Softmax { rows, cols, input, input_panel, output, reciprocals, .. } => {
            // A panelled input: cols / w full panels of `rows` rows (row stride input.row_stride),
            // then a narrower last panel at its own stride, one contiguous span.
            let input_access = if *input_panel > 0 {
                let (w, rest) = (*input_panel, cols % *input_panel);
                let span = (cols / w).saturating_mul(*rows).saturating_mul(input.row_stride).saturating_add(rows.saturating_mul(rest.div_ceil(4) * 4));
                half("input", Operand { address: input.address, row_stride: span }, 1, span)
            } else {
                half("input", *input, *rows, *cols)
            };
            let mut list = vec![input_access, half("output", *output, *rows, *cols)];
            if let Some(r) = reciprocals {
                list.push(Access { name: "reciprocals", op: *r, rows: *rows, cols: 1, element_bytes: 4, need: Need::Data });
            }
            list
        }
        VertexCall::Add { rows, cols, a, b, output } => {
            vec![half("a", *a, *rows, *cols), half("b", *b, *rows, *cols), half("output", *output, *rows, *cols)]
        }
        VertexCall::GeluErf { rows, cols, input, output } => {
            vec![half("input", *input, *rows, *cols), half("output", *output, *rows, *cols)]
        }
        VertexCall::BiasAdd { rows, cols, input, bias, output } => {
            vec![half("input", *input, *rows, *cols), half("bias", *bias, 1, *cols), half("output", *output, *rows, *cols)]
        }
        VertexCall::LayerNorm { rows, cols, input, gamma, beta, output, .. } => vec![
            half("input", *input, *rows, *cols),
            half("gamma", *gamma, 1, *cols),
            half("beta", *beta, 1, *cols),
            half("output", *output, *rows, *cols),
        ],
        VertexCall::LayerNormStatistics { rows, cols, input, statistics } => vec![
            half("input", *input, *rows, *cols),
            Access { name: "statistics", op: *statistics, rows: *rows, cols: kernels::STATISTICS, element_bytes: 4, need: Need::Data },
        ],
        VertexCall::LayerNormSegment { rows, cols, segments, input, statistics, others, gamma, beta, output, .. } => vec![
            half("input", *input, *rows, *cols),
            Access { name: "statistics", op: *statistics, rows: *rows, cols: kernels::STATISTICS, element_bytes: 4, need: Need::Data },
            // The other segments' blocks follow each other at the row stride: one block of
            // (segments - 1) x rows rows.
            Access { name: "others", op: *others, rows: segments.saturating_sub(1).saturating_mul(*rows), cols: kernels::STATISTICS, element_bytes: 4, need: Need::Data },
            half("gamma", *gamma, 1, *cols),
            half("beta", *beta, 1, *cols),
            half("output", *output, *rows, *cols),
        ],
        VertexCall::Copy { rows, cols, dtype, input, output } | VertexCall::CopyWords { rows, cols, dtype, input, output } => {
            let bytes = dtype.bytes();
            let tensor = |name, op| Access { name, op, rows: *rows, cols: *cols, element_bytes: bytes, need: Need::Tensor };
            vec![tensor("input", *input), tensor("output", *output)]
        }
        VertexCall::CopyHalves { rows, cols, input, output } => {
            let tensor = |name, op| Access { name, op, rows: *rows, cols: *cols, element_bytes: 2, need: Need::Tensor };
            vec![tensor("input", *input), tensor("output", *output)]
        }
        VertexCall::Transpose { rows, cols, input, output } => vec![half("input", *input, *rows, *cols), half("output", *output, *cols, *rows)],
    }
}

/// The epilogue addend of a call writing `rows` x `cols` (f16 data): one row, one element per
/// row, or the whole block.
fn addend_access(add: &Option<Addend<Operand>>, rows: u32, cols: u32) -> Option<Access> {
    let x = add.as_ref()?;
    let (r, c) = x.broadcast.extent(rows, cols);
    Some(Access { name: "add", op: x.operand, rows: r, cols: c, element_bytes: x.broadcast.element_bytes(), need: Need::Data })
}

/// Check every call of a tile's compute set, which runs at program steps `steps`, and add up
/// its cycles: in all, and those priced by formulas that are not hardware-measured.
pub fn check_set(
    target: &Target,
    provenance: &Provenance,
    memory: &TileMemory,
    set: &ComputeSet,
    labels: &[String],
    steps: &[u32],
) -> Result<CheckedSet, DeviceError> {
    let m = &target.memory;
    let (mut cycles, mut unmeasured, mut flops) = (0, 0, 0u64);
    for (index, call) in set.calls.iter().enumerate() {
        if let VertexCall::LayerNormSegment { segments, segment, rows, cols, input, .. } = call {
            // The call's own statistics go in at `segment` among the `segments`.
            if segment >= segments {
                let (start, end) = extent(*input, *rows, *cols, 2);
                return Err(DeviceError::Access {
                    tile: memory.tile,
                    compute_set: set.index,
                    call: index,
                    vertex: call.kind_name(),
                    operand: "input",
                    start,
                    end,
                    problem: format!("is segment {segment} of a row cut into {segments} segments"),
                });
            }
        }
        if let VertexCall::MatMul { partials: true, add: Some(x), .. } = call {
            // The addend belongs to the reduction that finishes the product: added to every
            // partial it would be counted once per member.
            return Err(DeviceError::Access {
                tile: memory.tile,
                compute_set: set.index,
                call: index,
                vertex: call.kind_name(),
                operand: "add",
                start: x.operand.address as u64,
                end: x.operand.address as u64,
                problem: "is an epilogue addend on a call that writes fp32 partials".into(),
            });
        }
        let list = accesses(call);
        if let VertexCall::MatMul { .. } = call {
            check_input_output_elements(target, memory.tile, set.index, index, call, &list)?;
        }
        for access in list {
            let (start, end) = extent(access.op, access.rows, access.cols, access.element_bytes);
            let fail = |problem: String| DeviceError::Access {
                tile: memory.tile,
                compute_set: set.index,
                call: index,
                vertex: call.kind_name(),
                operand: access.name,
                start,
                end,
                problem,
            };
            if start == end {
                continue;
            }
            // Rows may overlap (a stride below the row length re-reads memory), but a call never
            // handles more elements than a tile can hold: that bounds the host buffers too.
            // (Rows and columns near 2^32 make more than 2^64 bytes: saturated, still refused.)
            let elements = access.rows as u64 * access.cols as u64;
            if elements.saturating_mul(access.element_bytes as u64) > m.size as u64 {
                return Err(fail(format!("spans {} x {} elements, more than a tile's memory holds", access.rows, access.cols)));
            }
            if start % access.element_bytes as u64 != 0 {
                return Err(fail(format!("is not aligned to its {}-byte elements", access.element_bytes)));
            }
            // A word copy moves 32-bit words: its rows start on a word and hold whole words.
            let words = matches!(call, VertexCall::CopyWords { .. });
            // A copy of halves moves f16 elements one at a time: each row starts on 2 bytes.
            let halves = matches!(call, VertexCall::CopyHalves { .. });
            let data_alignment = if halves { 2 } else if words { WORD_BYTES } else { m.data_alignment as u64 };
            if words && !(access.cols as u64 * access.element_bytes as u64).is_multiple_of(WORD_BYTES) {
                return Err(fail(format!("has rows of {} bytes, not whole 32-bit words (a word copy moves words)", access.cols as u64 * access.element_bytes as u64)));
            }
            if access.need == Need::Partials {
                if start < m.interleaved_start as u64 {
                    return Err(fail(format!("holds AMP partials but lies in standard memory (interleaved memory starts at {:#x})", m.interleaved_start)));
                }
                if start % m.partial_alignment as u64 != 0 {
                    return Err(fail(format!("holds AMP partials but is not {}-byte aligned", m.partial_alignment)));
                }
            } else if start % data_alignment != 0 {
                return Err(fail(if words || halves {
                    format!("starts at an address that is not {data_alignment}-byte aligned (a copy of {} moves them one at a time)", if words { "32-bit words" } else { "f16 elements" })
                } else {
                    format!("starts at an address that is not {}-byte aligned (the target's data alignment: 64-bit loads)", m.data_alignment)
                }));
            }
            // Every row starts aligned too: rows at a pitch of their own are separate vectors
            // (2-D vertex fields align each inner vector), and a matrix product reads each row
            // of its operands with 64-bit loads whatever the pitch. A contiguous block of another
            // vertex is one vector.
            let strided = access.rows > 1 && (access.op.row_stride != access.cols || matches!(call, VertexCall::MatMul { .. }));
            let pitch = access.op.row_stride as u64 * access.element_bytes as u64;
            let row_alignment = if access.need == Need::Partials { m.partial_alignment as u64 } else { data_alignment };
            if strided && !pitch.is_multiple_of(row_alignment) {
                return Err(fail(format!(
                    "has rows {pitch} bytes apart ({} elements), not a multiple of the {row_alignment}-byte alignment: row 1 starts unaligned",
                    access.op.row_stride
                )));
            }
            memory.check(start, end, access.need, steps, labels).map_err(|problem| {
                let at = steps.first().map(|s| format!(" at step {s}")).unwrap_or_default();
                fail(format!("{problem}{at}"))
            })?;
        }
        let c = cost::vertex(target, call);
        cycles += c;
        if !provenance.measured(&cost::vertex_constants(target, call)) {
            unmeasured += c;
        }
        if let VertexCall::MatMul { m, k, n, .. } = call {
            flops += 2 * *m as u64 * *k as u64 * *n as u64;
        }
    }
    Ok(CheckedSet { calls: set.calls.clone(), cycles, unmeasured, flops })
}

/// A matrix product's input A and output C must lie in different memory elements: the first
/// element both extents touch is the error, named with both operands' extents.
fn check_input_output_elements(target: &Target, tile: u32, compute_set: u32, index: usize, call: &VertexCall, list: &[Access]) -> Result<(), DeviceError> {
    // Extents outside the tile's memory are left to the per-operand checks that follow.
    let memory_end = target.memory.base as u64 + target.memory.size as u64;
    let extent_of = |name: &str| list.iter().find(|a| a.name == name).map(|a| extent(a.op, a.rows, a.cols, a.element_bytes)).filter(|&(s, e)| s < e && e <= memory_end);
    let (Some(a), Some(c)) = (extent_of("a"), extent_of("c")) else { return Ok(()) };
    let span = |(s, e): (u64, u64)| (super::elements::element(target, s).0, super::elements::element(target, e - 1).1);
    let (ea, ec) = (span(a), span(c));
    if ea.0 < ec.1 && ec.0 < ea.1 {
        let shared = ea.0.max(ec.0);
        return Err(DeviceError::Access {
            tile,
            compute_set,
            call: index,
            vertex: call.kind_name(),
            operand: "c",
            start: c.0,
            end: c.1,
            problem: format!(
                "shares the memory element at {shared:#x} with input a [{:#x}, {:#x}): a matrix product's input and output must lie in different memory elements",
                a.0, a.1
            ),
        });
    }
    Ok(())
}

/// Run one checked call on a tile's memory.
pub fn execute(memory: &mut TileMemory, call: &VertexCall, s: &mut Scratch) {
    match call {
        VertexCall::MatMul { m, k, n, a, a_panel, b, b_transposed, c, c_panel, partials, add } => {
            if *a_panel == 0 {
                memory.read_f16(*a, *m, *k, &mut s.bits, &mut s.a);
            } else {
                read_panels(memory, *a, *a_panel, *m, *k, false, s);
            }
            if *b_transposed {
                memory.read_f16(*b, *n, *k, &mut s.bits, &mut s.t);
                kernels::transpose(&s.t, *n as usize, *k as usize, &mut s.b);
            } else {
                memory.read_f16(*b, *k, *n, &mut s.bits, &mut s.b);
            }
            s.c.clear();
            s.c.resize(*m as usize * *n as usize, 0.0);
            kernels::matmul(&s.a, &s.b, &mut s.c, *m as usize, *k as usize, *n as usize);
            add_epilogue(memory, add, *m, *n, s);
            if *c_panel == 0 {
                if *partials {
                    memory.write_f32(*c, *m, *n, &s.c);
                } else {
                    memory.write_f16(*c, *m, *n, &s.c, &mut s.halves);
                }
                return;
            }
            let bytes = if *partials { 4 } else { 2 };
            let w = *c_panel;
            for p in 0..n.div_ceil(w) {
                let width = w.min(n - p * w);
                let panel = Operand { address: c.address + p * m * c.row_stride * bytes, row_stride: c.row_stride };
                s.t.clear();
                for r in 0..*m as usize {
                    let from = r * *n as usize + (p * w) as usize;
                    s.t.extend_from_slice(&s.c[from..from + width as usize]);
                }
                if *partials {
                    memory.write_f32(panel, *m, width, &s.t);
                } else {
                    memory.write_f16(panel, *m, width, &s.t, &mut s.halves);
                }
            }
        }
        VertexCall::Reduce { rows, cols, parts, out, add } => {
            s.c.clear();
            s.c.resize(*rows as usize * *cols as usize, 0.0);
            for (i, part) in parts.iter().enumerate() {
                if i == 0 {
                    memory.read_f32(*part, *rows, *cols, &mut s.c);
                } else {
                    memory.read_f32(*part, *rows, *cols, &mut s.a);
                    kernels::accumulate(&mut s.c, &s.a);
                }
            }
            add_epilogue(memory, add, *rows, *cols, s);
            memory.write_f16(*out, *rows, *cols, &s.c, &mut s.halves);
        }
        VertexCall::Gelu { rows, cols, input, output } => {
            memory.read_f16(*input, *rows, *cols, &mut s.bits, &mut s.a);
            kernels::gelu(&mut s.a);
            memory.write_f16(*output, *rows, *cols, &s.a, &mut s.halves);
        }
        VertexCall::Scale { rows, cols, factor, input, output } => {
            memory.read_f16(*input, *rows, *cols, &mut s.bits, &mut s.a);
            kernels::scale(&mut s.a, *factor);
            memory.write_f16(*output, *rows, *cols, &s.a, &mut s.halves);
        }
        VertexCall::Add { rows, cols, a, b, output } => {
            memory.read_f16(*a, *rows, *cols, &mut s.bits, &mut s.a);
            memory.read_f16(*b, *rows, *cols, &mut s.bits, &mut s.b);
            kernels::accumulate(&mut s.a, &s.b);
            memory.write_f16(*output, *rows, *cols, &s.a, &mut s.halves);
        }
        VertexCall::Softmax { rows, cols, scale, input, input_panel, output, reciprocals } => {
            if *input_panel > 0 {
                read_panels(memory, *input, *input_panel, *rows, *cols, true, s);
            } else {
                memory.read_f16(*input, *rows, *cols, &mut s.bits, &mut s.a);
            }
            if *scale != 1.0 {
                kernels::scale(&mut s.a, *scale);
                kernels::round_to_f16(&mut s.a);
            }
            match reciprocals {
                Some(r) => {
                    kernels::softmax_rows_unnormalised(&mut s.a, *rows as usize, *cols as usize, &mut s.b);
                    memory.write_f32(*r, *rows, 1, &s.b);
                }
                None => kernels::softmax_rows(&mut s.a, *cols as usize),
            }
            memory.write_f16(*output, *rows, *cols, &s.a, &mut s.halves);
        }
        VertexCall::GeluErf { rows, cols, input, output } => {
            memory.read_f16(*input, *rows, *cols, &mut s.bits, &mut s.a);
            kernels::gelu_erf(&mut s.a);
            memory.write_f16(*output, *rows, *cols, &s.a, &mut s.halves);
        }
        VertexCall::BiasAdd { rows, cols, input, bias, output } => {
            memory.read_f16(*input, *rows, *cols, &mut s.bits, &mut s.a);
            memory.read_f16(*bias, 1, *cols, &mut s.bits, &mut s.b);
            kernels::add_row(&mut s.a, &s.b);
            memory.write_f16(*output, *rows, *cols, &s.a, &mut s.halves);
        }
        VertexCall::LayerNorm { rows, cols, eps, input, gamma, beta, output } => {
            memory.read_f16(*input, *rows, *cols, &mut s.bits, &mut s.a);
            memory.read_f16(*gamma, 1, *cols, &mut s.bits, &mut s.b);
            memory.read_f16(*beta, 1, *cols, &mut s.bits, &mut s.t);
            kernels::layer_norm_rows(&mut s.a, &s.b, &s.t, *eps);
            memory.write_f16(*output, *rows, *cols, &s.a, &mut s.halves);
        }
        VertexCall::LayerNormStatistics { rows, cols, input, statistics } => {
            memory.read_f16(*input, *rows, *cols, &mut s.bits, &mut s.a);
            kernels::layer_norm_statistics(&s.a, *rows as usize, *cols as usize, &mut s.b);
            memory.write_f32(*statistics, *rows, kernels::STATISTICS, &s.b);
        }
        VertexCall::LayerNormSegment { rows, cols, segments, segment, eps, input, statistics, others, gamma, beta, output } => {
            memory.read_f16(*input, *rows, *cols, &mut s.bits, &mut s.a);
            // The statistics of every segment in segment order: the others' with this one's
            // slotted in at `segment`.
            memory.read_f32(*others, segments.saturating_sub(1) * rows, kernels::STATISTICS, &mut s.c);
            memory.read_f32(*statistics, *rows, kernels::STATISTICS, &mut s.b);
            let at = (*segment * *rows * kernels::STATISTICS) as usize;
            s.c.splice(at..at, s.b.iter().copied());
            memory.read_f16(*gamma, 1, *cols, &mut s.bits, &mut s.b);
            memory.read_f16(*beta, 1, *cols, &mut s.bits, &mut s.t);
            kernels::layer_norm_segment(&mut s.a, &s.c, *segments as usize, &s.b, &s.t, *eps);
            memory.write_f16(*output, *rows, *cols, &s.a, &mut s.halves);
        }
        VertexCall::Copy { rows, cols, dtype, input, output } | VertexCall::CopyWords { rows, cols, dtype, input, output } => {
            memory.copy(*input, *output, *rows, *cols, dtype.bytes(), &mut s.bytes);
        }
        VertexCall::CopyHalves { rows, cols, input, output } => {
            memory.copy(*input, *output, *rows, *cols, 2, &mut s.bytes);
        }
        VertexCall::Transpose { rows, cols, input, output } => {
            memory.read_f16(*input, *rows, *cols, &mut s.bits, &mut s.a);
            kernels::transpose(&s.a, *rows as usize, *cols as usize, &mut s.b);
            memory.write_f16(*output, *cols, *rows, &s.b, &mut s.halves);
        }
    }
}

/// Add a call's epilogue addend to its fp32 result `s.c` (`rows` x `cols`, row-major) before
/// the result is rounded and written.
fn add_epilogue(memory: &TileMemory, add: &Option<Addend<Operand>>, rows: u32, cols: u32, s: &mut Scratch) {
    let Some(x) = add else { return };
    let (r, c) = x.broadcast.extent(rows, cols);
    // A row scale is fp32 and multiplies; an addend is f16 and adds.
    if x.broadcast == Broadcast::RowScale {
        memory.read_f32(x.operand, r, c, &mut s.t);
    } else {
        memory.read_f16(x.operand, r, c, &mut s.bits, &mut s.t);
    }
    match x.broadcast {
        Broadcast::Row => kernels::add_row(&mut s.c, &s.t),
        Broadcast::Column => kernels::add_column(&mut s.c, &s.t),
        Broadcast::Full => kernels::accumulate(&mut s.c, &s.t),
        Broadcast::RowScale => kernels::scale_rows(&mut s.c, &s.t),
    }
}

/// Read a panelled operand (A of `VertexCall::MatMul`, a softmax input) of m rows and k
/// columns into a row-major m x k buffer in `s.a`. `tight_last`: a last panel narrower than w
/// has its width rounded up to 4 elements as its row stride (a softmax input).
fn read_panels(memory: &TileMemory, a: Operand, w: u32, m: u32, k: u32, tight_last: bool, s: &mut Scratch) {
    s.a.clear();
    s.a.resize(m as usize * k as usize, 0.0);
    for p in 0..k.div_ceil(w) {
        let width = w.min(k - p * w);
        let stride = if tight_last && width < w { width.div_ceil(4) * 4 } else { a.row_stride };
        let panel = Operand { address: a.address + p * m * a.row_stride * 2, row_stride: stride };
        memory.read_f16(panel, m, width, &mut s.bits, &mut s.t);
        for r in 0..m as usize {
            let dst = r * k as usize + (p * w) as usize;
            s.a[dst..dst + width as usize].copy_from_slice(&s.t[r * width as usize..(r + 1) * width as usize]);
        }
    }
}

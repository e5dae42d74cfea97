//! The vertex calls of the elementwise and row-wise operations, and what their lowering needs
//! to know about each kind: which kinds need whole rows on a tile (softmax, LayerNorm), which
//! inputs are 1-D parameters broadcast over the rows (a bias, LayerNorm's gamma and beta), and
//! which kinds keep their first input's layout (so a row consumer further on still matters).

use super::grid::ViewChain;
use super::{Call, Loc};
use crate::cost;
use crate::ir::{Graph, OpKind, Producer, ValueId};
use crate::target::Target;

/// Whether the operation needs each row of its input whole on one tile.
pub fn needs_whole_rows(kind: &OpKind) -> bool {
    matches!(kind, OpKind::Softmax | OpKind::LayerNorm { .. })
}

/// Into how many segments a LayerNorm splits each row of `cols` columns when its `row_cells`
/// blocks of up to `rows` rows leave tiles idle: each segment on a tile of its own computes its
/// rows' statistics (`LayerNormStatistics`), the segments of a row exchange them (one phase,
/// four fp32 words per row and segment), and each normalises its columns from all of them
/// (`LayerNormSegment`). The count with the lowest estimate (the cost formulas, plus the
/// phase's sync, longest delay and received words) among those the idle tiles allow, at
/// least four columns (one 64-bit word) a segment; 1 (whole rows, one `LayerNorm` call) when
/// splitting does not pay. Ties go to fewer segments.
pub fn layer_norm_segments(t: &Target, row_cells: u32, rows: u32, cols: u32) -> u32 {
    let most = (t.chip.tiles / row_cells.max(1)).min(cols / 4).clamp(1, MOST_LAYER_NORM_SEGMENTS);
    let (_, max_delay) = t.delay_range();
    let mut best = (cost::layer_norm(t, rows, cols), 1);
    for segments in 2..=most {
        let width = cols.div_ceil(segments).div_ceil(4) * 4;
        let words = (segments as u64 - 1) * rows as u64 * STATISTICS_WORDS;
        let estimate = cost::layer_norm_statistics(t, rows, width) + t.exchange.sync_cycles + max_delay as u64 + words + cost::layer_norm_segment(t, rows, width, segments);
        if estimate < best.0 {
            best = (estimate, segments);
        }
    }
    best.1
}

/// The most segments a LayerNorm row is split into (each normalising segment merges every
/// segment's statistics, so the merge grows with their number).
pub const MOST_LAYER_NORM_SEGMENTS: u32 = 16;

/// fp32 words of one row's statistics of a LayerNorm segment (count, mean, squared
/// deviations, 0: `VertexCall::LayerNormStatistics`).
pub const STATISTICS_WORDS: u64 = 4;

/// Whether the operation's output has its first input's layout, element for element.
pub fn keeps_layout(kind: &OpKind) -> bool {
    matches!(kind, OpKind::Gelu | OpKind::GeluErf | OpKind::Scale { .. } | OpKind::Add | OpKind::BiasAdd)
}

/// Whether input `position` of the operation is a 1-D row parameter, broadcast over the rows.
pub fn is_row_parameter(kind: &OpKind, position: usize) -> bool {
    position > 0 && matches!(kind, OpKind::BiasAdd | OpKind::LayerNorm { .. })
}

/// Whether the kind's call can read its first input in panels of columns: a softmax,
/// whose rows then gather from cells one panel wide in one run per cell instead of one per row.
pub fn reads_panels(kind: &OpKind) -> bool {
    matches!(kind, OpKind::Softmax)
}

/// The call over `rows` x `cols` elements for one elementwise kind, with `scale` the factor a
/// softmax reads its input with (1 when none was folded in) and `panel` the panel width its
/// input is stored in (0: row-major; only for kinds that [`reads_panels`]), `reciprocals` where
/// a softmax stores its row reciprocals when its normalisation is deferred. `None` for kinds
/// that are not elementwise.
pub fn call(kind: &OpKind, rows: u32, cols: u32, ins: &[Loc], output: Loc, scale: f32, panel: u32, reciprocals: Option<Loc>) -> Option<Call> {
    Some(match kind {
        OpKind::Gelu => Call::Gelu { rows, cols, input: ins[0], output },
        OpKind::GeluErf => Call::GeluErf { rows, cols, input: ins[0], output },
        OpKind::Scale { factor } => Call::Scale { rows, cols, factor: *factor as f32, input: ins[0], output },
        OpKind::Softmax => Call::Softmax { rows, cols, scale, input: ins[0], input_panel: panel, output, reciprocals },
        OpKind::Add => Call::Add { rows, cols, a: ins[0], b: ins[1], output },
        OpKind::BiasAdd => Call::BiasAdd { rows, cols, input: ins[0], bias: ins[1], output },
        OpKind::LayerNorm { eps } => Call::LayerNorm { rows, cols, eps: *eps as f32, input: ins[0], gamma: ins[1], beta: ins[2], output },
        _ => return None,
    })
}

/// An add folded into the epilogue of the matrix product that feeds it: the product (or the
/// reduction that finishes it) writes `product output + addend` and the add runs no pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fold {
    /// The add's operation index.
    pub add: usize,
    /// The host tensor (or a view of one) that is added.
    pub addend: ValueId,
    /// A bias (`bias_add`, one row broadcast); otherwise an `add` of a whole block.
    pub bias: bool,
}

/// The add folded into product `product`'s epilogue, if any: a `bias_add` of a host bias, or an
/// `add` of a host tensor (through views), that is the only computing reader of the rank-2
/// product's output, which is no graph output. Views that nobody computes from do not count.
pub fn folded_add(graph: &Graph, product: usize) -> Option<Fold> {
    let op = &graph.operations[product];
    if !matches!(op.kind, OpKind::MatMul { .. }) || graph.value(op.output).shape.len() != 2 || op.inputs.iter().any(|&v| graph.value(v).shape.len() != 2) {
        return None;
    }
    if graph.outputs.iter().any(|&o| ViewChain::resolve(graph, o).base == op.output) {
        return None;
    }
    let readers: Vec<usize> = graph
        .operations
        .iter()
        .enumerate()
        .filter(|(_, o)| !o.kind.is_view() && o.inputs.iter().any(|&v| ViewChain::resolve(graph, v).base == op.output))
        .map(|(i, _)| i)
        .collect();
    let [add] = readers[..] else { return None };
    let reader = &graph.operations[add];
    let host = |v: ValueId| matches!(graph.value(ViewChain::resolve(graph, v).base).producer, Producer::Tensor { .. });
    match reader.kind {
        OpKind::BiasAdd if reader.inputs[0] == op.output && host(reader.inputs[1]) => Some(Fold { add, addend: reader.inputs[1], bias: true }),
        OpKind::Add => {
            let (a, b) = (reader.inputs[0], reader.inputs[1]);
            let addend = if a == op.output && b != op.output { b } else if b == op.output && a != op.output { a } else { return None };
            host(addend).then_some(Fold { add, addend, bias: false })
        }
        _ => None,
    }
}

/// Every fold of `graph`: product operation index -> its fold.
pub fn folded_adds(graph: &Graph) -> std::collections::BTreeMap<usize, Fold> {
    (0..graph.operations.len()).filter_map(|i| folded_add(graph, i).map(|f| (i, f))).collect()
}

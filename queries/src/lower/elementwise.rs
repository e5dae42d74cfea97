//! The vertex calls of the elementwise and row-wise operations, and what their lowering needs
//! to know about each kind: which kinds need whole rows on a tile (softmax, LayerNorm), which
//! inputs are 1-D parameters broadcast over the rows (a bias, LayerNorm's gamma and beta), and
//! which kinds keep their first input's layout (so a row consumer further on still matters).

use super::{Call, Loc};
use crate::ir::OpKind;

/// Whether the operation needs each row of its input whole on one tile.
pub fn needs_whole_rows(kind: &OpKind) -> bool {
    matches!(kind, OpKind::Softmax | OpKind::LayerNorm { .. })
}

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
/// input is stored in (0: row-major; only for kinds that [`reads_panels`]). `None` for kinds
/// that are not elementwise.
pub fn call(kind: &OpKind, rows: u32, cols: u32, ins: &[Loc], output: Loc, scale: f32, panel: u32) -> Option<Call> {
    Some(match kind {
        OpKind::Gelu => Call::Gelu { rows, cols, input: ins[0], output },
        OpKind::GeluErf => Call::GeluErf { rows, cols, input: ins[0], output },
        OpKind::Scale { factor } => Call::Scale { rows, cols, factor: *factor as f32, input: ins[0], output },
        OpKind::Softmax => Call::Softmax { rows, cols, scale, input: ins[0], input_panel: panel, output },
        OpKind::Add => Call::Add { rows, cols, a: ins[0], b: ins[1], output },
        OpKind::BiasAdd => Call::BiasAdd { rows, cols, input: ins[0], bias: ins[1], output },
        OpKind::LayerNorm { eps } => Call::LayerNorm { rows, cols, eps: *eps as f32, input: ins[0], gamma: ins[1], beta: ins[2], output },
        _ => return None,
    })
}

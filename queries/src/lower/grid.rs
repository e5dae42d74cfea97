//! Grid distributions and view resolution: where each element of a value lives, and how a
//! consumer's block maps through reshapes and transposes back to the stored value.
//!
//! A computed value is stored as the cells of a grid (cuts per axis); each cell sits on one
//! tile in one buffer, row-major with its last axis padded to a stride of whole 8-byte units.
//! Views (reshape, transpose) store nothing: consumers read through them.

use crate::ir::{DType, Graph, OpKind, Producer, ValueId};

/// Cuts per axis: axis a is split at cuts[a] = [0, c1, ..., dim].
#[derive(Clone, Debug, PartialEq)]
pub struct Grid {
    pub cuts: Vec<Vec<u32>>,
    /// Tile of each cell, row-major over cells.
    pub tiles: Vec<u32>,
    /// Buffer of each cell (index into the lowering's buffers).
    pub buffers: Vec<u32>,
}

impl Grid {
    pub fn cells_per_axis(&self) -> Vec<usize> {
        self.cuts.iter().map(|c| c.len() - 1).collect()
    }
    pub fn cell_index(&self, coords: &[usize]) -> usize {
        let per = self.cells_per_axis();
        coords.iter().zip(&per).fold(0, |acc, (&c, &n)| acc * n + c)
    }
    /// The cell containing an element, and the cell's block.
    pub fn locate(&self, index: &[u32]) -> (usize, Vec<(u32, u32)>) {
        let mut coords = Vec::with_capacity(index.len());
        let mut block = Vec::with_capacity(index.len());
        for (axis, &i) in index.iter().enumerate() {
            let cuts = &self.cuts[axis];
            let c = cuts.partition_point(|&x| x <= i) - 1;
            coords.push(c);
            block.push((cuts[c], cuts[c + 1]));
        }
        (self.cell_index(&coords), block)
    }
    pub fn cell_block(&self, cell: usize) -> Vec<(u32, u32)> {
        let per = self.cells_per_axis();
        let mut rest = cell;
        let mut coords = vec![0; per.len()];
        for a in (0..per.len()).rev() {
            coords[a] = rest % per[a];
            rest /= per[a];
        }
        coords.iter().enumerate().map(|(a, &c)| (self.cuts[a][c], self.cuts[a][c + 1])).collect()
    }
}

/// Elements per row of a stored block: the last axis rounded up to a multiple of four
/// elements, so f16 rows start 8-byte aligned (64-bit loads, paired exchange) and fp32
/// partial rows 16-byte aligned (the AMP's partial alignment), whichever row a block starts at.
/// Four elements serve both dtypes (8 bytes of f16, 16 bytes of f32), so the stride does not
/// depend on the dtype; the parameter keeps call sites explicit about what they store.
pub fn row_stride(cols: u32, _dtype: DType) -> u32 {
    cols.div_ceil(4) * 4
}

/// Offset (elements) of an element inside a stored block [lo, hi) per axis.
pub fn offset_in_block(block: &[(u32, u32)], index: &[u32], dtype: DType) -> u32 {
    let rank = block.len();
    let stride = row_stride(block[rank - 1].1 - block[rank - 1].0, dtype);
    let mut offset = 0u64;
    let mut scale = stride as u64;
    offset += (index[rank - 1] - block[rank - 1].0) as u64;
    for a in (0..rank - 1).rev() {
        offset += (index[a] - block[a].0) as u64 * scale;
        scale *= (block[a].1 - block[a].0) as u64;
    }
    offset as u32
}

pub fn block_elements_stored(block: &[(u32, u32)], dtype: DType) -> u64 {
    let rank = block.len();
    let rows: u64 = block[..rank - 1].iter().map(|&(l, h)| (h - l) as u64).product();
    rows * row_stride(block[rank - 1].1 - block[rank - 1].0, dtype) as u64
}

/// One step from a view back towards its source.
#[derive(Clone, Debug)]
enum ViewStep {
    Reshape { from: Vec<u32>, to: Vec<u32> },
    Transpose { perm: Vec<u32> },
}

/// A value seen through a chain of views, resolved to the value that stores it.
#[derive(Clone, Debug)]
pub struct ViewChain {
    pub base: ValueId,
    /// From the viewed value back to the base.
    steps: Vec<ViewStep>,
    pub view_shape: Vec<u32>,
    pub base_shape: Vec<u32>,
}

impl ViewChain {
    pub fn resolve(graph: &Graph, value: ValueId) -> ViewChain {
        let view_shape = graph.value(value).shape.clone();
        let mut steps = Vec::new();
        let mut current = value;
        while let Producer::Operation(op) = graph.value(current).producer {
            let operation = &graph.operations[op];
            let input = operation.inputs[0];
            match &operation.kind {
                OpKind::Reshape { shape } => steps.push(ViewStep::Reshape { from: graph.value(input).shape.clone(), to: shape.clone() }),
                OpKind::Transpose { perm } => steps.push(ViewStep::Transpose { perm: perm.clone() }),
                _ => break,
            }
            current = input;
        }
        ViewChain { base: current, steps, view_shape, base_shape: graph.value(current).shape.clone() }
    }

    pub fn is_identity(&self) -> bool {
        self.steps.is_empty()
    }

    /// Map a view index to the base index, and how many consecutive elements along the view's
    /// last axis stay consecutive along the base's last axis from there.
    pub fn map_run(&self, index: &[u32], max_run: u32) -> (Vec<u32>, u32) {
        let mut idx = index.to_vec();
        let mut shape = self.view_shape.clone();
        let mut run = max_run.min(shape[shape.len() - 1] - idx[idx.len() - 1]);
        for step in &self.steps {
            match step {
                ViewStep::Transpose { perm } => {
                    let mut src = vec![0; idx.len()];
                    let mut src_shape = vec![0; idx.len()];
                    for (a, &p) in perm.iter().enumerate() {
                        src[p as usize] = idx[a];
                        src_shape[p as usize] = shape[a];
                    }
                    idx = src;
                    shape = src_shape;
                }
                ViewStep::Reshape { from, to } => {
                    let mut flat = 0u64;
                    for (a, &d) in to.iter().enumerate() {
                        flat = flat * d as u64 + idx[a] as u64;
                    }
                    let mut src = vec![0u32; from.len()];
                    for a in (0..from.len()).rev() {
                        src[a] = (flat % from[a] as u64) as u32;
                        flat /= from[a] as u64;
                    }
                    idx = src;
                    shape = from.clone();
                }
            }
            run = run.min(shape[shape.len() - 1] - idx[idx.len() - 1]);
        }
        (idx, run)
    }
}

/// Even splits of `extent` into `parts` pieces whose inner cuts are multiples of `align`.
pub fn split(extent: u32, parts: u32, align: u32) -> Vec<u32> {
    let parts = parts.max(1);
    let mut cuts = vec![0];
    for i in 1..parts {
        let raw = (extent as u64 * i as u64 / parts as u64) as u32;
        let c = (raw / align * align).max(*cuts.last().unwrap());
        cuts.push(c);
    }
    cuts.push(extent);
    cuts.dedup();
    cuts
}

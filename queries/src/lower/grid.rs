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
        let mut cell = 0;
        let mut block = Vec::with_capacity(index.len());
        for (axis, &i) in index.iter().enumerate() {
            let cuts = &self.cuts[axis];
            let c = cuts.partition_point(|&x| x <= i) - 1;
            cell = cell * (cuts.len() - 1) + c;
            block.push((cuts[c], cuts[c + 1]));
        }
        (cell, block)
    }
    /// The cell containing an element.
    pub fn cell_of(&self, index: &[u32]) -> usize {
        index.iter().zip(&self.cuts).fold(0, |cell, (&i, cuts)| cell * (cuts.len() - 1) + cuts.partition_point(|&x| x <= i) - 1)
    }
    /// The cell that holds all of `block`, if one does.
    pub fn cell_holding(&self, block: &[(u32, u32)]) -> Option<usize> {
        let mut cell = 0;
        for (r, cuts) in block.iter().zip(&self.cuts) {
            let c = cuts.partition_point(|&x| x <= r.0) - 1;
            if r.1 > cuts[c + 1] {
                return None;
            }
            cell = cell * (cuts.len() - 1) + c;
        }
        Some(cell)
    }
    pub fn cell_block(&self, cell: usize) -> Vec<(u32, u32)> {
        let mut block = vec![(0, 0); self.cuts.len()];
        let mut rest = cell;
        for (a, cuts) in self.cuts.iter().enumerate().rev() {
            let per = cuts.len() - 1;
            let c = rest % per;
            rest /= per;
            block[a] = (cuts[c], cuts[c + 1]);
        }
        block
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
    /// The chain without the base's identity: equal for the same views over equal shapes.
    pub fn signature(&self) -> String {
        format!("{:?} {:?} {:?}", self.steps, self.view_shape, self.base_shape)
    }

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

    /// Whether the view is exactly the transpose of a rank-2 value (a swapped product's
    /// operand or result): element (r, c) of the view is element (c, r) of the base.
    pub fn is_matrix_transpose(&self) -> bool {
        matches!(&self.steps[..], [ViewStep::Transpose { perm }] if perm[..] == [1, 0])
    }

    /// Map a view index to the base index, and how many consecutive elements along the view's
    /// last axis stay consecutive along the base's last axis from there.
    pub fn map_run(&self, index: &[u32], max_run: u32) -> (Vec<u32>, u32) {
        let mut out = Vec::new();
        let run = self.map_run_into(index, max_run, &mut out);
        (out, run)
    }

    /// [`ViewChain::map_run`] into `out` (cleared first), returning the run. The lowering calls
    /// it once per row piece it gathers, so it works on fixed arrays where every shape along
    /// the chain has at most `INLINE_RANK` axes (the IR allows four), on heap tables otherwise.
    pub fn map_run_into(&self, index: &[u32], max_run: u32, out: &mut Vec<u32>) -> u32 {
        const INLINE_RANK: usize = 8;
        let rank = self.steps.iter().fold(index.len().max(self.view_shape.len()), |r, s| match s {
            ViewStep::Transpose { perm } => r.max(perm.len()),
            ViewStep::Reshape { from, to } => r.max(from.len()).max(to.len()),
        });
        if rank <= INLINE_RANK {
            let mut t = [[0u32; INLINE_RANK]; 4];
            let [a, b, c, d] = &mut t;
            self.map_on(index, max_run, out, [a, b, c, d])
        } else {
            let mut t = vec![vec![0u32; rank]; 4];
            let [a, b, c, d] = &mut t[..] else { unreachable!("four tables") };
            self.map_on(index, max_run, out, [a, b, c, d])
        }
    }

    /// `map_run_into` on four tables of at least the chain's largest rank: the index and its
    /// shape, and room for their permutation by a transpose.
    fn map_on(&self, index: &[u32], max_run: u32, out: &mut Vec<u32>, tables: [&mut [u32]; 4]) -> u32 {
        let [mut idx, mut shape, mut src, mut src_shape] = tables;
        // The index and the shape it lies in, each with its length.
        let (mut ni, mut ns) = (index.len(), self.view_shape.len());
        idx[..ni].copy_from_slice(index);
        shape[..ns].copy_from_slice(&self.view_shape);
        let mut run = max_run.min(shape[ns - 1] - idx[ni - 1]);
        for step in &self.steps {
            match step {
                ViewStep::Transpose { perm } => {
                    // A transpose that moves the innermost axis (the planner's swapped
                    // products read host tensors so) leaves runs of one element.
                    if perm[perm.len() - 1] as usize != perm.len() - 1 {
                        run = 1;
                    }
                    for (a, &p) in perm.iter().enumerate() {
                        src[p as usize] = idx[a];
                        src_shape[p as usize] = shape[a];
                    }
                    std::mem::swap(&mut idx, &mut src);
                    std::mem::swap(&mut shape, &mut src_shape);
                    ns = ni;
                }
                ViewStep::Reshape { from, to } => {
                    let mut flat = 0u64;
                    for (a, &d) in to.iter().enumerate() {
                        flat = flat * d as u64 + idx[a] as u64;
                    }
                    for a in (0..from.len()).rev() {
                        idx[a] = (flat % from[a] as u64) as u32;
                        flat /= from[a] as u64;
                    }
                    (ni, ns) = (from.len(), from.len());
                    shape[..ns].copy_from_slice(from);
                }
            }
            run = run.min(shape[ns - 1] - idx[ni - 1]);
        }
        out.clear();
        out.extend_from_slice(&idx[..ni]);
        run
    }
}

/// Balanced splits of `extent` into at most `parts` pieces whose inner cuts are multiples of
/// `align`: the ceil(extent / align) aligned units are dealt out evenly (piece sizes differ
/// by at most one unit, the first piece one of the largest), so the partial unit at the end, if any,
/// lands in one of the smaller pieces. Empty pieces are dropped.
pub fn split(extent: u32, parts: u32, align: u32) -> Vec<u32> {
    let align = align.max(1) as u64;
    let units = (extent as u64).div_ceil(align);
    let parts = (parts.max(1) as u64).min(units.max(1));
    let mut cuts = vec![0];
    for i in 1..parts {
        let c = ((units * i).div_ceil(parts) * align).min(extent as u64) as u32;
        cuts.push(c);
    }
    cuts.push(extent);
    cuts.dedup();
    cuts
}

#[cfg(test)]
mod tests {
    use super::{split, ViewChain, ViewStep};
    use crate::ir::ValueId;

    /// Row-major flat position of `index` in `shape`, and back.
    fn flat(index: &[u32], shape: &[u32]) -> u32 {
        index.iter().zip(shape).fold(0, |f, (&i, &d)| f * d + i)
    }
    fn unflat(mut f: u32, shape: &[u32]) -> Vec<u32> {
        let mut index = vec![0; shape.len()];
        for a in (0..shape.len()).rev() {
            index[a] = f % shape[a];
            f /= shape[a];
        }
        index
    }

    #[test]
    fn views_map_indices_and_runs_as_the_materialised_views_do() {
        // Chains from the viewed value back to the base (no axis of size 1): none, a matrix
        // transpose, a reshape (the heads split), a reshape then a transpose of the inner
        // axes, and a rank-3 transpose under a reshape that merges axes. Each is checked
        // against the view materialised from the base (every base element holding its own
        // flat position): the base index exactly, and the run as the longest stretch along the
        // view's last axis whose elements are consecutive in one row of the base (a transpose
        // moving the innermost axis leaves runs of one).
        let chains: Vec<(Vec<ViewStep>, Vec<u32>, Vec<u32>)> = vec![
            (vec![], vec![3, 5], vec![3, 5]),
            (vec![ViewStep::Transpose { perm: vec![1, 0] }], vec![5, 3], vec![3, 5]),
            (vec![ViewStep::Reshape { from: vec![6, 4], to: vec![6, 2, 2] }], vec![6, 2, 2], vec![6, 4]),
            (vec![ViewStep::Transpose { perm: vec![0, 2, 1] }, ViewStep::Reshape { from: vec![6, 4], to: vec![6, 2, 2] }], vec![6, 2, 2], vec![6, 4]),
            (vec![ViewStep::Reshape { from: vec![2, 3, 4], to: vec![6, 4] }, ViewStep::Transpose { perm: vec![1, 0, 2] }], vec![6, 4], vec![3, 2, 4]),
        ];
        let mut out = vec![99];
        for (steps, view_shape, base_shape) in chains {
            // Materialise: from the base (values = flat positions) forward through the steps.
            let mut values: Vec<u32> = (0..base_shape.iter().product()).collect();
            let mut shape = base_shape.clone();
            for step in steps.iter().rev() {
                match step {
                    ViewStep::Reshape { to, .. } => shape = to.clone(),
                    ViewStep::Transpose { perm } => {
                        // View axis a is base axis perm[a].
                        let viewed: Vec<u32> = perm.iter().map(|&p| shape[p as usize]).collect();
                        values = (0..values.len() as u32)
                            .map(|f| {
                                let v = unflat(f, &viewed);
                                let mut b = vec![0; v.len()];
                                for (a, &p) in perm.iter().enumerate() {
                                    b[p as usize] = v[a];
                                }
                                values[flat(&b, &shape) as usize]
                            })
                            .collect();
                        shape = viewed;
                    }
                }
            }
            assert_eq!(shape, view_shape);
            let moves_inner = steps.iter().any(|s| matches!(s, ViewStep::Transpose { perm } if perm[perm.len() - 1] as usize != perm.len() - 1));
            let chain = ViewChain { base: ValueId(0), steps, view_shape: view_shape.clone(), base_shape: base_shape.clone() };
            let last = view_shape.len() - 1;
            let row = base_shape[base_shape.len() - 1];
            for f in 0..values.len() as u32 {
                let index = unflat(f, &view_shape);
                let base = values[f as usize];
                for max_run in 1..=view_shape[last] + 1 {
                    let mut longest = 1;
                    while !moves_inner && longest < max_run && index[last] + longest < view_shape[last] && values[(f + longest) as usize] == base + longest && (base % row) + longest < row {
                        longest += 1;
                    }
                    let run = chain.map_run_into(&index, max_run, &mut out);
                    assert_eq!(out, unflat(base, &base_shape), "{chain:?} at {index:?}");
                    assert_eq!(run, longest, "{chain:?} at {index:?}, runs of at most {max_run}");
                    assert_eq!(chain.map_run(&index, max_run), (out.clone(), run));
                }
            }
        }
    }

    fn extents(c: &[u32]) -> Vec<u32> {
        c.windows(2).map(|w| w[1] - w[0]).collect()
    }

    #[test]
    fn splits_are_balanced_in_aligned_units() {
        // 729 over 23 parts in 16-element units: 46 units, two per part (the last one 25 wide).
        let c = split(729, 23, 16);
        assert_eq!(c.len(), 24);
        assert!(extents(&c).iter().all(|&e| e <= 32), "{:?}", extents(&c));
        assert!(c[1..c.len() - 1].iter().all(|&x| x % 16 == 0));
        // Rows: sizes differ by at most one, the first piece the largest (the planner's
        // gather bound reads the first piece).
        let r = extents(&split(729, 23, 1));
        assert_eq!(r.iter().max().unwrap() - r.iter().min().unwrap(), 1);
        assert_eq!(r[0], *r.iter().max().unwrap());
        // More parts than units: one part per unit.
        assert_eq!(split(20, 8, 16), vec![0, 16, 20]);
        assert_eq!(split(5, 1, 4), vec![0, 5]);
        assert_eq!(split(1, 3, 1), vec![0, 1]);
    }
}

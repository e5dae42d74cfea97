//! `lower_mid` for matrix products: enumerate partitions (batch, row, column, inner), cost each
//! with the target's formulas (AMP calls, reduction, exchange words, sync), drop the ones that
//! do not fit in tile memory, keep the cheapest.
//!
//! Simpler than the seed's planner: one plan per operation chosen greedily in program order,
//! no finalists, no output-column blocking or weight-staging knobs (see the README's status).

use crate::cost::{self, WeightClass};
use crate::ir::PlanConstraint;
use crate::lower::grid::split;
use crate::package::Broadcast;
use crate::target::Target;

/// A matrix product's partition and its cuts.
#[derive(Clone, Debug, PartialEq)]
pub struct MatMulPlan {
    pub pb: u32,
    pub pm: u32,
    pub pn: u32,
    pub pk: u32,
    pub b_cuts: Vec<u32>,
    pub m_cuts: Vec<u32>,
    pub n_cuts: Vec<u32>,
    pub k_cuts: Vec<u32>,
    pub compute_cycles: u64,
    pub exchange_cycles: u64,
    pub peak_bytes: u64,
    /// The weights were costed in standard memory (64-bit weight loads).
    pub weights_standard: bool,
    /// Which partitions are innermost in the tile numbering (`tile_of`).
    pub order: TileOrder,
    /// The first tile of the plan's range: products lowered side by side take disjoint ranges
    /// (0 for a product that has the chip).
    pub first_tile: u32,
}

/// Which partition index of a matrix product's work items is innermost in its tile numbering
/// (`MatMulPlan::tile_of`). Tiles that read the same gathered block should be neighbours: a
/// supertile pair (tiles 2k and 2k + 1) then receives it together at 64 bits a cycle (paired
/// exchange). A gathered A block is read by every column partition of its row and inner
/// partition; a gathered B block (a stored value, a home-tile weight's multicast, an input's
/// copies) by every row partition of its column and inner partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileOrder {
    /// Column partitions innermost (A blocks shared by neighbours).
    Columns,
    /// Row partitions innermost (B blocks shared by neighbours).
    Rows,
}

impl MatMulPlan {
    pub fn tiles(&self) -> u32 {
        (self.b_cuts.len() - 1) as u32 * (self.m_cuts.len() - 1) as u32 * (self.n_cuts.len() - 1) as u32 * (self.k_cuts.len() - 1) as u32
    }
    pub fn total(&self) -> u64 {
        self.compute_cycles + self.exchange_cycles
    }
    /// Tile of work item (ib, im, in, ik), numbered with the partitions of `order` innermost,
    /// then the other of rows and columns, then the inner partitions, then the batch.
    pub fn tile_of(&self, ib: usize, im: usize, i_n: usize, ik: usize) -> u32 {
        let (nm, nn, nk) = (self.m_cuts.len() - 1, self.n_cuts.len() - 1, self.k_cuts.len() - 1);
        self.first_tile
            + match self.order {
                TileOrder::Columns => (((ib * nm + im) * nk + ik) * nn + i_n) as u32,
                TileOrder::Rows => (((ib * nk + ik) * nn + i_n) * nm + im) as u32,
            }
    }

    /// The work item (ib, im, in, ik) of `tile`: the inverse of [`MatMulPlan::tile_of`].
    pub fn coords(&self, tile: u32) -> (usize, usize, usize, usize) {
        let (nm, nn, nk) = (self.m_cuts.len() - 1, self.n_cuts.len() - 1, self.k_cuts.len() - 1);
        let t = (tile - self.first_tile) as usize;
        match self.order {
            TileOrder::Columns => (t / (nk * nn * nm), t / (nk * nn) % nm, t % nn, t / nn % nk),
            TileOrder::Rows => (t / (nm * nn * nk), t % nm, t / nm % nn, t / (nm * nn) % nk),
        }
    }
}

pub struct MatMulProblem<'a> {
    pub batches: u32,
    pub m: u32,
    pub k: u32,
    pub n: u32,
    pub b_transposed: bool,
    /// A consumer needs whole rows (softmax): column partitions then cost a re-gather of the
    /// output by rows before that consumer.
    pub whole_rows: bool,
    /// Row cuts fall on multiples of this (2 when the product's result is written out
    /// transposed for a reader by rows: its rows become that value's columns, which move in
    /// whole 32-bit words only from even offsets).
    pub m_align: u32,
    /// An add folded into the epilogue (a bias broadcast by rows or columns, or a whole
    /// block): the product's call, or the reduction finishing it, pays its per-vector add and
    /// holds the addend's block.
    pub epilogue: Option<Broadcast>,
    /// Words a tile must receive to hold A's block [b, m, k]: gathered from a producer, or a
    /// host-input block that other tiles hold too (the input phase copies it); 0 when the host
    /// writes it (a weight, or an input block no other tile holds).
    pub remote_a_words: &'a dyn Fn(&MatMulPlan, u32) -> u64,
    pub remote_b_words: &'a dyn Fn(&MatMulPlan, u32) -> u64,
    /// No tile receives more words of A, and of B, than these (the search stops there).
    pub gather_bound: &'a dyn Fn(&MatMulPlan) -> (u64, u64),
    /// A's blocks (B's) arrive by exchange, each read by several tiles when there are several
    /// column (row) partitions: they decide the tile numbering (`TileOrder`).
    pub a_gathered: bool,
    pub b_gathered: bool,
    /// A's blocks (B's) are gathered from a computed value's cells, not copied from a host
    /// input by the input phase: the two tiles of a supertile pair that need the same block
    /// receive it together, `paired_words_per_cycle` words a cycle (`paired_gathers`).
    pub a_stored: bool,
    pub b_stored: bool,
    /// Bytes a tile may use for this operation's buffers.
    pub memory_budget: u64,
    /// Interleaved bytes a tile may use beside what other operations keep there (partials
    /// must sit in interleaved memory; weights load 128 bits at a time only from there).
    pub interleaved_budget: u64,
    /// Standard bytes a tile may use (code and other operations' standard demand deducted).
    pub standard_budget: u64,
    /// The user's constraint on this product's plan, if any.
    pub constraint: Option<&'a PlanConstraint>,
    /// At most this many row (column) partitions where the constraint does not set them: a
    /// replicated weight's replicas, capped (`Partial::replication_capped`; u32::MAX: none).
    pub max_row_partitions: u32,
    pub max_column_partitions: u32,
    /// At most this many bytes a tile for the A block and for the B block (partials have their
    /// own region, interleaved memory) (`Partial::block_capped`; u64::MAX: none).
    pub max_block_bytes: u64,
    /// The tiles the plan may use: `tiles` from `first_tile` (the chip, or a product's share
    /// when sibling products run side by side).
    pub first_tile: u32,
    pub tiles: u32,
}

/// Why no plan was chosen: the reason (for a user's constraint, what fits without it), and
/// without a constraint the fewest bytes per tile of the plans refused only for their size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoPlan {
    pub reason: String,
    pub least: Option<u64>,
}

/// The plan chosen, and how many feasible candidates matched the user's constraint.
#[derive(Clone, Debug)]
pub struct Planned {
    pub plan: MatMulPlan,
    pub matching_plans: u32,
}

/// Whether the inner partials of a plan reduce by column panels instead of row chunks: every
/// column block holds exactly one AMP block (`block` columns) per member of its reduction
/// group. The product then writes its partials as panels (`c_panel`, the AMP's output-channel
/// groups: the same call and cycles), member j owns panel j, receives the others' panel j as
/// one contiguous run each, and the reduced value is stored in cells one panel wide, which a
/// consumer taking AMP-aligned column blocks gathers in runs of whole rows instead of one
/// transfer per row.
pub fn column_reduction(n_cuts: &[u32], pk: u32, block: u32) -> bool {
    pk > 1 && n_cuts.windows(2).all(|w| (w[1] - w[0]).div_ceil(block.max(1)) == pk)
}

fn distinct_partitions(blocks: u32, limit: u32) -> Vec<u32> {
    // For each distinct block size ceil(blocks / p), the smallest p that gives it: the same
    // per-tile work on the fewest tiles.
    let mut out: Vec<u32> = Vec::new();
    let mut last_size = 0;
    for p in 1..=blocks.min(limit).max(1) {
        let size = blocks.div_ceil(p);
        if size != last_size {
            out.push(p);
            last_size = size;
        }
    }
    out
}

fn cuts_len(c: &[u32]) -> u32 {
    (c.len() - 1) as u32
}

fn max_extent(c: &[u32]) -> u32 {
    c.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0)
}

/// The cheapest feasible plan (ties: fewer tiles) that honours the constraint, or why none does.
pub fn plan_matmul(t: &Target, p: &MatMulProblem) -> Result<Planned, NoPlan> {
    let mut matching = 0u32;
    let mut best: Option<MatMulPlan> = None;
    let mut least: Option<u64> = None;
    search(t, p, p.constraint, &mut |c| {
        matching += 1;
        if best.as_ref().is_none_or(|b| (c.total(), c.tiles()) < (b.total(), b.tiles())) {
            best = Some(c);
        }
    }, &mut least);
    if let Some(plan) = best {
        return Ok(Planned { plan, matching_plans: if p.constraint.is_some() { matching } else { 0 } });
    }
    let Some(constraint) = p.constraint else { return Err(NoPlan { reason: "no plan fits in tile memory".into(), least }) };
    let fail = |reason: String| NoPlan { reason, least: None };
    // Say what fits without the constraint, per field the user gave.
    let mut feasible: Vec<[u32; 3]> = Vec::new();
    let mut standard_only = true;
    search(t, p, None, &mut |c| {
        feasible.push([c.pm, c.pn, c.pk]);
        standard_only &= c.weights_standard;
    }, &mut None);
    if feasible.is_empty() {
        return Err(fail(format!("the constraint ({}) cannot help: no plan fits in tile memory", constraint.describe())));
    }
    let mut reasons = Vec::new();
    let block = t.costs.gemm_block as u32;
    for (i, (name, value, extent, unit)) in
        [("row_partitions", constraint.row_partitions, p.m, 1), ("column_partitions", constraint.column_partitions, p.n, block), ("inner_partitions", constraint.inner_partitions, p.k, block)].into_iter().enumerate()
    {
        let Some(v) = value else { continue };
        let units = extent.div_ceil(unit);
        if v > units {
            reasons.push(format!("{name}={v} exceeds the {units} pieces the axis of {extent} splits into"));
            continue;
        }
        let values: Vec<u32> = feasible.iter().map(|f| f[i]).collect();
        let (lo, hi) = (values.iter().min().unwrap(), values.iter().max().unwrap());
        reasons.push(format!("{name}={v} (plans that fit use {lo}..={hi})"));
    }
    if constraint.weight_memory.as_deref() == Some("interleaved") && standard_only {
        reasons.push("weight_memory=interleaved (no plan's weights fit in interleaved memory beside its other buffers)".into());
    }
    if reasons.is_empty() {
        reasons.push("the combination of fields".into());
    }
    Err(fail(format!("no plan fits with {}: {}", constraint.describe(), reasons.join("; "))))
}

/// Every feasible candidate, restricted to `constraint`'s partitions when given; `least`: the
/// fewest bytes per tile of the candidates refused only for needing more than the budget.
fn search(t: &Target, p: &MatMulProblem, constraint: Option<&PlanConstraint>, found: &mut dyn FnMut(MatMulPlan), least: &mut Option<u64>) {
    let tiles = p.tiles.min(t.chip.tiles);
    let block = t.costs.gemm_block as u32;
    let sync = t.exchange.sync_cycles;
    let (_, max_delay) = t.delay_range();
    let k_blocks = p.k.div_ceil(block);
    let n_blocks = p.n.div_ceil(block);
    for pb in distinct_partitions(p.batches, tiles) {
        let b_cuts = split(p.batches, pb, 1);
        let pk_limit = if max_extent(&b_cuts) > 1 { 1 } else { k_blocks.min(32) };
        let pks = match constraint.and_then(|c| c.inner_partitions) {
            Some(v) if v <= k_blocks && (v == 1 || pk_limit > 1) => vec![v],
            Some(_) => vec![],
            None => distinct_partitions(k_blocks, pk_limit),
        };
        for pk in pks {
            let k_cuts = split(p.k, pk, block);
            let n_limit = n_blocks;
            let pns = match constraint.and_then(|c| c.column_partitions) {
                Some(v) if v <= n_limit => vec![v],
                Some(_) => vec![],
                None => distinct_partitions(n_limit, (tiles / (cuts_len(&b_cuts) * cuts_len(&k_cuts)).max(1)).min(p.max_column_partitions)),
            };
            for pn in pns {
                let n_cuts = split(p.n, pn, block);
                let used = cuts_len(&b_cuts) * cuts_len(&k_cuts) * cuts_len(&n_cuts);
                if used > tiles {
                    continue;
                }
                let pm_max = (tiles / used).min(p.m).max(1);
                // Unconstrained rows: at most the replication cap (a replicated B's replicas).
                let pm_top = pm_max.min(p.max_row_partitions.max(1));
                let pms = match constraint.and_then(|c| c.row_partitions) {
                    Some(v) if v <= pm_max => vec![v],
                    Some(_) => vec![],
                    None if pm_top > 1 => vec![pm_top, pm_top.div_ceil(2)],
                    None => vec![pm_top],
                };
                for pm in pms {
                    let m_cuts = split(p.m, pm, p.m_align);
                    let weights = constraint.and_then(|c| c.weight_memory.as_deref());
                    match cost_plan(t, p, b_cuts.clone(), m_cuts, n_cuts.clone(), k_cuts.clone(), sync, max_delay, weights) {
                        Ok(candidate) => found(candidate),
                        Err(Some(bytes)) => *least = Some(least.map_or(bytes, |l| l.min(bytes))),
                        Err(None) => {}
                    }
                }
            }
        }
    }
}

/// A candidate's plan, or why not: `Err(Some(bytes))` when it needs `bytes` a tile, more than the
/// budget, `Err(None)` for any other reason (a block or partials over their caps, weights
/// constrained to a region they do not fit).
#[allow(clippy::too_many_arguments)]
fn cost_plan(t: &Target, p: &MatMulProblem, b_cuts: Vec<u32>, m_cuts: Vec<u32>, n_cuts: Vec<u32>, k_cuts: Vec<u32>, sync: u64, max_delay: u32, weights: Option<&str>) -> Result<MatMulPlan, Option<u64>> {
    let (bs, ms, ns, ks) = (max_extent(&b_cuts), max_extent(&m_cuts), max_extent(&n_cuts), max_extent(&k_cuts));
    let pk = cuts_len(&k_cuts);
    let mut plan = MatMulPlan {
        pb: cuts_len(&b_cuts),
        pm: cuts_len(&m_cuts),
        pn: cuts_len(&n_cuts),
        pk,
        b_cuts,
        m_cuts,
        n_cuts,
        k_cuts,
        compute_cycles: 0,
        exchange_cycles: 0,
        peak_bytes: 0,
        weights_standard: false,
        order: TileOrder::Columns,
        first_tile: p.first_tile,
    };
    // Neighbours share B's gathered blocks when A arrives by no exchange (a swapped product,
    // whose A is a resident weight); otherwise A's. (Where A is gathered but not shared, the
    // numbering also decides which of its blocks are already in place: it stays.)
    if p.b_gathered && plan.pm > 1 && !p.a_gathered {
        plan.order = TileOrder::Rows;
    }
    let ns_f16 = ns.div_ceil(4) * 4;
    let ks_f16 = ks.div_ceil(4) * 4;
    let ns_f32 = ns.div_ceil(4) * 4;
    let a_bytes = bs as u64 * ms as u64 * ks_f16 as u64 * 2;
    let b_bytes = bs as u64 * if p.b_transposed { ns as u64 * ks_f16 as u64 } else { ks as u64 * ns_f16 as u64 } * 2;
    // Weights load 128 bits at a time only from interleaved memory. An A block too large for
    // standard memory takes interleaved space first; if the weights no longer fit beside it,
    // they sit in standard memory and every 16-column pass pays for 64-bit loads.
    // Partials (and the partial rows a reduction receives) must sit in interleaved memory.
    let standard = p.standard_budget;
    let interleaved = p.interleaved_budget;
    let block = t.costs.gemm_block as u32;
    let by_columns = column_reduction(&plan.n_cuts, pk, block);
    // Per member: the rows and columns it reduces (a panel of `block` columns, or a row chunk).
    let (chunk_rows, chunk_cols, chunk_cols_f32) = if by_columns { (ms, block.min(ns), block) } else { (ms.div_ceil(pk), ns, ns_f32) };
    let receive_words = (pk - 1) as u64 * chunk_rows as u64 * chunk_cols_f32 as u64;
    let stored_f32: u64 = if by_columns { pk as u64 * block as u64 } else { ns_f32 as u64 };
    let partials_bytes = if pk > 1 { bs as u64 * ms as u64 * stored_f32 * 4 + receive_words * 4 } else { 0 };
    if partials_bytes > interleaved || a_bytes.max(b_bytes) > p.max_block_bytes {
        return Err(None);
    }
    let a_in_interleaved = if a_bytes > standard { a_bytes } else { 0 };
    let fits_interleaved = a_in_interleaved + b_bytes + partials_bytes <= interleaved;
    let class = match weights {
        Some("standard") => WeightClass::Standard,
        Some(_) if !fits_interleaved => return Err(None),
        _ if fits_interleaved => WeightClass::Interleaved,
        _ => WeightClass::Standard,
    };
    let mut compute = bs as u64 * cost::gemm(t, ms, ks, ns, class, p.b_transposed);
    let mut exchange = 0u64;
    let mut bytes = a_bytes + b_bytes;
    // The epilogue addend's f16 block for an output block of `rows` x `cols` (rows padded to
    // 8 bytes), or a row scale's fp32 factors (one per stored row, padded to 4 elements).
    let addend_bytes = |rows: u32, cols: u32| match p.epilogue {
        None => 0,
        Some(Broadcast::RowScale) => rows as u64 * 4 * 4,
        Some(b) => {
            let (r, c) = b.extent(rows, cols);
            r as u64 * c.div_ceil(4) as u64 * 4 * 2
        }
    };
    if pk > 1 {
        bytes += partials_bytes + chunk_rows as u64 * chunk_cols.div_ceil(4) as u64 * 4 * 2;
        compute += cost::reduce(t, pk, chunk_rows as u64 * chunk_cols as u64);
        if let Some(b) = p.epilogue {
            compute += cost::epilogue(t, b, chunk_rows as u64 * chunk_cols as u64);
            bytes += addend_bytes(chunk_rows, chunk_cols);
        }
        exchange += sync + max_delay as u64 + receive_words;
    } else {
        bytes += bs as u64 * ms as u64 * ns_f16 as u64 * 2;
        if let Some(b) = p.epilogue {
            compute += bs as u64 * cost::epilogue(t, b, ms as u64 * ns as u64);
            bytes += addend_bytes(ms, ns);
        }
    }
    if bytes > p.memory_budget {
        return Err(Some(bytes));
    }
    let mut gather = 0u64;
    let (a_rate, b_rate) = paired_gathers(t, p, &plan);
    let bound = {
        let (a, b) = (p.gather_bound)(&plan);
        a.div_ceil(a_rate) + b.div_ceil(b_rate)
    };
    for tile in plan.first_tile..plan.first_tile + plan.tiles() {
        if gather >= bound {
            break;
        }
        let (a, b) = ((p.remote_a_words)(&plan, tile), (p.remote_b_words)(&plan, tile));
        gather = gather.max(a.div_ceil(a_rate) + b.div_ceil(b_rate));
    }
    if gather > 0 {
        exchange += sync + max_delay as u64 + gather;
    }
    if p.whole_rows && plan.pn > 1 {
        // The row consumer re-gathers the output evenly over the tiles (f16, two per word).
        let elements = p.batches as u64 * p.m as u64 * p.n as u64;
        exchange += sync + max_delay as u64 + elements.div_ceil(p.tiles.min(t.chip.tiles) as u64 * 2);
    }
    plan.compute_cycles = compute;
    plan.exchange_cycles = exchange;
    plan.peak_bytes = bytes;
    plan.weights_standard = class == WeightClass::Standard;
    Ok(plan)
}

/// The words a cycle in which a tile receives its A and its B block: `paired_words_per_cycle`
/// where both tiles of every supertile pair (tiles 2j and 2j + 1) need the same block and it
/// is gathered from a computed value (`MatMulProblem::a_stored`), else one. With `TileOrder::
/// Columns` neighbours are column partitions of one A block, so an even count of them from an
/// even first tile pairs every tile (an odd count leaves a tile whose partner needs another
/// block, and the busiest tile bounds the phase); likewise rows of one B block with
/// `TileOrder::Rows`. The exchange scheduler pairs such receivers (`$INCOMING_MUXPAIR`,
/// machine-model.md): the MLP up product [1,4,90,4] of four full-size encoder layers receives
/// 26,352 words a tile in a 14,066-cycle phase.
fn paired_gathers(t: &Target, p: &MatMulProblem, plan: &MatMulPlan) -> (u64, u64) {
    let paired = (t.exchange.paired_words_per_cycle as u64).max(1);
    let even = plan.first_tile.is_multiple_of(2);
    let a = even && p.a_stored && plan.order == TileOrder::Columns && plan.pn.is_multiple_of(2);
    let b = even && p.b_stored && plan.order == TileOrder::Rows && plan.pm.is_multiple_of(2);
    (if a { paired } else { 1 }, if b { paired } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::{fixtures, Target};

    /// The 256 x 512 x 512 product on small16's 16 tiles within `budget` bytes a tile (the
    /// regions' budgets are the target's), A's remote words `a_words`, B's none, and `bound`.
    fn problem<'a>(t: &Target, budget: u64, a_words: &'a dyn Fn(&MatMulPlan, u32) -> u64, none: &'a dyn Fn(&MatMulPlan, u32) -> u64, bound: &'a dyn Fn(&MatMulPlan) -> (u64, u64)) -> MatMulProblem<'a> {
        let m = &t.memory;
        MatMulProblem {
            batches: 1,
            m: 256,
            k: 512,
            n: 512,
            b_transposed: false,
            whole_rows: false,
            m_align: 1,
            epilogue: None,
            remote_a_words: a_words,
            remote_b_words: none,
            gather_bound: bound,
            a_gathered: false,
            b_gathered: false,
            a_stored: false,
            b_stored: false,
            memory_budget: budget,
            interleaved_budget: (m.loader_limit - m.interleaved_start) as u64,
            standard_budget: (m.interleaved_start - m.base) as u64,
            constraint: None,
            max_row_partitions: u32::MAX,
            max_column_partitions: u32::MAX,
            max_block_bytes: u64::MAX,
            first_tile: 0,
            tiles: 16,
        }
    }

    /// The product with operands the host writes (no gathers), planned within `budget`.
    fn plan(t: &Target, budget: u64) -> Result<Planned, NoPlan> {
        let none = |_: &MatMulPlan, _: u32| 0u64;
        let bound = |_: &MatMulPlan| (0u64, 0u64);
        plan_matmul(t, &problem(t, budget, &none, &none, &bound))
    }

    /// The product with A gathered (each tile receives its A block) and the weights written
    /// by the host, planned as `[1, rows, columns, 1]` on tiles `first..16`; `stored`: A is a
    /// computed value's cells, not a host input's copies.
    fn gathered(t: &Target, stored: bool, rows: u32, columns: u32, first: u32) -> MatMulPlan {
        let a_words = |p: &MatMulPlan, _: u32| (max_extent(&p.m_cuts) as u64 * max_extent(&p.k_cuts) as u64 * 2).div_ceil(4);
        let none = |_: &MatMulPlan, _: u32| 0u64;
        let bound = |p: &MatMulPlan| (a_words(p, 0), 0u64);
        let constraint = PlanConstraint { operation: "y".into(), orientation: None, row_partitions: Some(rows), column_partitions: Some(columns), inner_partitions: Some(1), weight_memory: None, weights: None };
        let budget = (t.memory.loader_limit - t.memory.base) as u64;
        let problem = MatMulProblem { a_gathered: true, a_stored: stored, constraint: Some(&constraint), first_tile: first, tiles: 16 - first, ..problem(t, budget, &a_words, &none, &bound) };
        plan_matmul(t, &problem).expect("the constrained plan fits").plan
    }

    /// A gathered A block that both tiles of every supertile pair read (column partitions
    /// innermost, an even count of them from an even first tile, A a computed value) is
    /// counted at the paired rate (`paired_words_per_cycle`); a host input's copies, an odd
    /// count of column partitions and an odd first tile at one word a cycle.
    #[test]
    fn gathers_that_supertile_pairs_share_are_counted_at_the_paired_rate() {
        let t = Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap();
        let fixed = t.exchange.sync_cycles + t.delay_range().1 as u64;
        // 64 rows x 512 inner f16 a tile: 16,384 words.
        let paired = gathered(&t, true, 4, 4, 0);
        assert_eq!(paired.order, TileOrder::Columns);
        assert_eq!(paired.exchange_cycles, fixed + 16_384 / t.exchange.paired_words_per_cycle as u64);
        assert_eq!(gathered(&t, false, 4, 4, 0).exchange_cycles, fixed + 16_384);
        // 16 rows a tile (4,096 words) at one column partition; 86 rows a tile (22,016 words)
        // at three row partitions, on the 12 tiles from tile 4, then from tile 1.
        assert_eq!(gathered(&t, true, 16, 1, 0).exchange_cycles, fixed + 4_096);
        assert_eq!(gathered(&t, true, 3, 4, 4).exchange_cycles, fixed + 22_016 / 2);
        let odd = gathered(&t, true, 3, 4, 1);
        assert_eq!(odd.exchange_cycles, fixed + 22_016);
    }

    /// A product no plan of which fits says how many bytes its smallest plan needs, and that
    /// is exactly the budget from which a plan fits.
    #[test]
    fn a_product_that_fits_nowhere_says_what_its_smallest_plan_needs() {
        let t = Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap();
        let refused = plan(&t, 4096).expect_err("no plan of this product fits in 4 KiB a tile");
        let least = refused.least.expect("plans refused for their size alone");
        assert!(least > 4096, "{least}");
        let fits = plan(&t, least).expect("the smallest plan fits its own bytes");
        assert_eq!(fits.plan.peak_bytes, least);
        assert_eq!(plan(&t, least - 1).expect_err("one byte less").least, Some(least));
    }
}

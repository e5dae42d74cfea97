//! `size_tile_code` over compact tables: each tile's exchange tables encoded as they will be
//! in its image (`tables.rs`), over sizing addresses, and the per-tile exchange-table budget.
//!
//! Sizing runs before storage is placed, so it encodes the tables over sizing addresses: per
//! tile, each buffer after the previous one plus an irregular gap. Runs within a buffer keep
//! their strides wherever the buffer lands, and buffers sit at irregular distances, so no run
//! or shared segment is counted that only a coincidence of these addresses would make. The
//! package stage checks that the final tables fit what was sized (an error otherwise).
//!
//! The budget is a planner input: a program whose tables exceed it on some tile is infeasible
//! (`select_finalist` drops such a finalist; the build fails naming tile and bytes when none
//! is left).

use rayon::prelude::*;

use crate::emit::{support_memory, tile_tables, SupportMemory};
use crate::exchange::{self, Schedule};
use crate::lower::Lowered;
use crate::pipeline::requests;
use crate::tables::{pack_phase, PackedPhase};
use crate::target::Target;

/// Exchange-table bytes one tile may hold: a compiler policy, not a machine constant (the
/// SDK's exchange code on a full So400m layer is 37 KB at most on a tile).
pub const EXCHANGE_TABLE_BUDGET_BYTES: u32 = 48 * 1024;

/// Sizing addresses (see the module header), wrapping.
pub fn sizing_bases(lowered: &Lowered) -> Vec<u32> {
    let mut next = vec![0u32; lowered.tiles as usize];
    lowered
        .buffers
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let mix = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let gap = ((mix >> 40) as u32 % 4096) * 16;
            let base = next[b.tile as usize].wrapping_add(gap);
            next[b.tile as usize] = base.wrapping_add(b.bytes.div_ceil(16) * 16);
            base
        })
        .collect()
}

/// Every phase's compact tables over sizing addresses.
pub fn sizing_tables(target: &Target, lowered: &Lowered, schedules: &[Schedule]) -> Result<Vec<PackedPhase>, String> {
    let bases = sizing_bases(lowered);
    let requests = requests(lowered, |buffer, offset| bases[buffer as usize].wrapping_add(offset));
    requests
        .par_iter()
        .zip(schedules.par_iter())
        .map(|(r, schedule)| exchange::relocate(target, r, schedule, false).map(|p| pack_phase(&p)).map_err(|e| e.to_string()))
        .collect()
}

/// Support memory per tile with compact tables; an error names the first tile (lowest) whose
/// tables exceed `budget` bytes.
pub fn support_with_tables(target: &Target, lowered: &Lowered, schedules: &[Schedule], budget: u32) -> Result<Vec<SupportMemory>, String> {
    let packed = sizing_tables(target, lowered, schedules)?;
    let table_bytes: Vec<u32> = tile_tables(lowered.tiles as usize, &packed).iter().map(|b| b.len() as u32).collect();
    if let Some((tile, bytes)) = table_bytes.iter().enumerate().find(|(_, b)| **b > budget) {
        return Err(format!("tile {tile}: exchange tables need {bytes} bytes, over the per-tile exchange-table budget of {budget} bytes"));
    }
    Ok(support_memory(lowered, &table_bytes))
}

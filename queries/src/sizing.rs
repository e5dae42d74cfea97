//! `size_tile_code` over compact tables: each tile's exchange tables encoded as they will be
//! in its image (`tables.rs`), over sizing addresses, and the per-tile exchange-table budget.
//!
//! Sizing runs before storage is placed, so it encodes the tables over sizing addresses: per
//! tile, each buffer after the previous one plus an irregular gap. Runs are cut per buffer and
//! descriptors hold offsets from their buffer's start (`tables.rs`), so a phase's segments do
//! not depend on where its buffers lie: the same phase of repeated layers shares one segment
//! here as it will in the image. Only base lists could coincide by placement (buffers of two
//! phases at the same final addresses), which makes the final tables smaller, never larger.
//! The package stage checks that the final tables fit what was sized (an error otherwise).
//!
//! The budget is a planner input. By default it is a policy: a program whose tables exceed it
//! on some tile is feasible where it still places with them (every tile's code at its size,
//! tables included, beside the program's data: `places_with_tables`); where it does not, the
//! placement failure blames the product owning the buffer that does not fit. A user's budget
//! is a hard limit: `select_finalist` drops a finalist over it, and when none is left, the
//! operation whose phase holds most of the oversized tables is planned again, steered away
//! from its plan. A stack of encoder layers holds a
//! table for each of its phases on a tile, so its tables grow with its depth: eleven
//! full-size layers need 66,508 bytes on tile 0, where their standard memory has room.

use std::sync::Arc;

use rayon::prelude::*;

use crate::emit::{support_memory, tile_tables, SupportMemory};
use crate::exchange::{self, Schedule};
use crate::exchange_placement::{relocation_memoized, shared_relocation, RelativeMemo};
use crate::hash::Digest;
use crate::lower::Lowered;
use crate::package::ExchangePhase;
use crate::pipeline::requests;
use crate::tables::{encode_tile, pack_phase, PackedPhase, PhaseBuffers};
use crate::target::Target;

/// Exchange-table bytes a tile should hold: a compiler policy, not a machine constant (the
/// SDK's exchange code on a full So400m layer is 37 KB at most on a tile). By default a program
/// over it is kept where it places with its tables (module docs); given by the user
/// (`Database::with_table_budget`), it is a hard limit.
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

/// The buffers phase `phase` of `lowered` touches on each tile, by tile: (start, bytes) with
/// starts from `starts` (per buffer), in order of first use among the phase's transfers (each
/// transfer's source, then its destinations): the base slots of its tables (`tables::pack_phase`).
pub fn phase_buffers(lowered: &Lowered, phase: usize, starts: &[u32]) -> PhaseBuffers {
    let mut seen = vec![false; lowered.buffers.len()];
    let mut order: Vec<(u32, u32)> = Vec::new();
    for t in lowered.phases[phase].iter() {
        for b in std::iter::once(t.source.0).chain(t.destinations.iter().map(|d| d.0)) {
            if !std::mem::replace(&mut seen[b as usize], true) {
                order.push((lowered.buffers[b as usize].tile, b));
            }
        }
    }
    // Stable: first-use order within each tile.
    order.sort_by_key(|&(tile, _)| tile);
    let mut out: PhaseBuffers = Vec::new();
    for (tile, b) in order {
        if out.last().is_none_or(|l| l.0 != tile) {
            out.push((tile, Vec::new()));
        }
        out.last_mut().expect("a tile was just pushed").1.push((starts[b as usize], lowered.buffers[b as usize].bytes as u64));
    }
    out
}

/// Every phase's compact tables over sizing addresses. With the schedules' digests
/// (`digests`), phases that share a pattern and schedule (the same phase of repeated layers)
/// are written from relative tables made once for them (`exchange_placement::shared_relocation`:
/// the same tables, sorted and joined once); each phase is packed as soon as it is written.
/// Relative tables come from `memo` where an earlier relocation made them, and are left there;
/// with a memo, a phase alone in its group is written from relative tables too, made here
/// once for `select_finalist`, which relocates the same program at every placement it tries
/// (without one, such a phase is written whole: its relative tables would serve once).
///
/// Packings are shared (`Arc`): those taken from the memo are not copied.
pub fn sizing_tables(target: &Target, lowered: &Lowered, schedules: &[Schedule], digests: Option<&[Digest]>, memo: Option<&RelativeMemo>) -> Result<Vec<Arc<PackedPhase>>, String> {
    let bases = sizing_bases(lowered);
    if let Some(digests) = digests {
        // Each phase written and packed in one go (its tables are dropped once packed).
        let relocation = match memo {
            Some(_) => relocation_memoized(target, lowered, schedules, digests, memo),
            None => shared_relocation(target, lowered, schedules, digests, None),
        }
        .map_err(|e| e.0)?;
        let address = |buffer: u32, offset: u32| bases[buffer as usize].wrapping_add(offset);
        if relocation.len() != digests.len() {
            return Err(format!("{} relocated phases for {} schedule digests", relocation.len(), digests.len()));
        }
        // With a memo, each phase's packing made by an earlier sizing under the same key
        // (`packed_key`: everything the packing reads) is taken, and the others are kept there.
        let memo = memo.filter(|m| m.keeps_packings());
        let keys: Option<Vec<Digest>> = memo.map(|_| {
            let target_digest = target.digest();
            (0..digests.len()).into_par_iter().map(|i| packed_key(&target_digest, &digests[i], lowered, i, &bases)).collect()
        });
        let made: Vec<Option<Arc<PackedPhase>>> = match (memo, &keys) {
            (Some(m), Some(keys)) => keys.iter().map(|k| m.packed(k)).collect(),
            _ => vec![None; digests.len()],
        };
        // The first phase of each schedule is written and packed; another phase of it (the
        // same phase of repeated layers) takes the first's packing moved to its buffers where
        // its tables are the first's moved buffer by buffer (`tables::rebased_phase`: the
        // packing `pack_phase` gives), else it is packed too. Phases found made are neither.
        let first = crate::phases::first_of_schedule(digests);
        let mut shared = vec![false; first.len()];
        first.iter().enumerate().filter(|(i, f)| *i != **f && made[*i].is_none()).for_each(|(_, &f)| shared[f] = true);
        let write = |i: usize| -> Result<(ExchangePhase, PhaseBuffers), String> {
            Ok((relocation.phase_at(target, lowered, schedules, i, &address).map_err(|e| e.0)?, phase_buffers(lowered, i, &bases)))
        };
        // Firsts kept for the others: (tables, buffers, packing), by phase.
        type Kept = (ExchangePhase, PhaseBuffers, Arc<PackedPhase>);
        let firsts: Vec<Option<Result<Kept, String>>> = (0..first.len())
            .into_par_iter()
            .map(|i| {
                (first[i] == i && shared[i]).then(|| {
                    let (tables, buffers) = write(i)?;
                    let packed = Arc::new(pack_phase(&tables, &buffers)?);
                    Ok((tables, buffers, packed))
                })
            })
            .collect();
        let packed: Result<Vec<Arc<PackedPhase>>, String> = (0..first.len())
            .into_par_iter()
            .map(|i| -> Result<Arc<PackedPhase>, String> {
                if let Some(made) = &made[i] {
                    return Ok(made.clone());
                }
                let f = first[i];
                if let Some(kept) = &firsts[f] {
                    let (rep_tables, rep_buffers, rep_packed) = kept.as_ref().map_err(|e| e.clone())?;
                    if f == i {
                        return Ok(rep_packed.clone());
                    }
                    let (tables, buffers) = write(i)?;
                    return match crate::tables::rebased_phase((rep_tables, rep_buffers, rep_packed), &tables, &buffers) {
                        Some(packed) => Ok(Arc::new(packed)),
                        None => pack_phase(&tables, &buffers).map(Arc::new),
                    };
                }
                let (tables, buffers) = write(i)?;
                pack_phase(&tables, &buffers).map(Arc::new)
            })
            .collect();
        if let (Some(m), Some(keys), Ok(packed)) = (memo, &keys, &packed) {
            for ((key, p), made) in keys.iter().zip(packed).zip(&made) {
                if made.is_none() {
                    m.keep_packed(*key, p.clone());
                }
            }
        }
        return packed;
    }
    let requests = requests(lowered, |buffer, offset| bases[buffer as usize].wrapping_add(offset));
    requests
        .par_iter()
        .zip(schedules.par_iter())
        .enumerate()
        .map(|(i, (r, schedule))| {
            let p = exchange::relocate(target, r, schedule, false, None).map_err(|e| e.to_string())?;
            pack_phase(&p, &phase_buffers(lowered, i, &bases)).map(Arc::new)
        })
        .collect()
}

/// The key of phase `i`'s packed sizing (`sizing_tables` with a memo): the target, the
/// schedule's digest, the phase index, every transfer's source tile and address, words,
/// destination tiles and addresses at the sizing addresses `bases`, and the phase's buffers
/// (`phase_buffers`) — everything writing and packing the phase reads.
fn packed_key(target: &Digest, schedule: &Digest, lowered: &Lowered, i: usize, bases: &[u32]) -> Digest {
    let mut h = crate::hash::KeyHasher::new("ipuq packed sizing v1");
    let phase = &lowered.phases[i];
    let tile = |b: u32| lowered.buffers[b as usize].tile;
    let address = |b: u32, offset: u32| bases[b as usize].wrapping_add(offset);
    h.add(target).add(schedule).add(&(i as u64)).add(&(phase.len() as u64));
    for t in phase.iter() {
        h.add(&tile(t.source.0)).add(&address(t.source.0, t.source.1)).add(&t.words).add(&(t.destinations.len() as u64));
        for d in &t.destinations {
            h.add(&tile(d.0)).add(&address(d.0, d.1));
        }
    }
    let buffers = phase_buffers(lowered, i, bases);
    h.add(&(buffers.len() as u64));
    for (tile, list) in &buffers {
        h.add(tile).add(&(list.len() as u64));
        for (start, bytes) in list {
            h.add(start).add(bytes);
        }
    }
    h.finish()
}

/// Digest of what [`table_bytes_checked`] reads of a program besides the target and the
/// schedules: the tile count, each buffer's tile and size (its sizing address) and every
/// phase's transfers (the requests). Far cheaper than the digest of the whole program.
pub fn sizing_digest(lowered: &Lowered) -> crate::hash::Digest {
    // The digest of one byte string (its length, then little-endian words), streamed into the
    // hasher word by word: the length is counted first, so no buffer of the words is built.
    let transfers: usize = lowered.phases.iter().map(|phase| phase.iter().map(|t| 4 + 2 * t.destinations.len()).sum::<usize>()).sum();
    let words = 3 + 2 * lowered.buffers.len() + lowered.phases.len() + transfers;
    let mut h = crate::hash::KeyHasher::new("ipuq table sizing input v1");
    h.add(&(4 * words as u64));
    h.add(&lowered.tiles).add(&(lowered.buffers.len() as u32));
    for b in &lowered.buffers {
        h.add(&b.tile).add(&b.bytes);
    }
    h.add(&(lowered.phases.len() as u32));
    for phase in &lowered.phases {
        h.add(&(phase.len() as u32));
        for t in phase.iter() {
            h.add(&t.source.0).add(&t.source.1).add(&t.words).add(&(t.destinations.len() as u32));
            for d in &t.destinations {
                h.add(&d.0).add(&d.1);
            }
        }
    }
    h.finish()
}

/// Whether two programs give the same [`sizing_digest`]: what sizing reads of them (the tile
/// count, each buffer's tile and size, every phase's transfers) is equal. Compared in place,
/// stopping at the first difference: neither program is hashed.
pub fn same_sizing_input(a: &Lowered, b: &Lowered) -> bool {
    a.tiles == b.tiles
        && a.buffers.len() == b.buffers.len()
        && a.buffers.iter().zip(&b.buffers).all(|(x, y)| x.tile == y.tile && x.bytes == y.bytes)
        && a.phases == b.phases
}

/// A tile whose exchange tables exceed the budget, and the phase contributing most of them.
#[derive(Clone, Debug)]
pub struct TableOverflow {
    pub tile: u32,
    pub bytes: u32,
    pub budget: u32,
    /// The phase whose tables on that tile are largest (index into `Lowered::phases`).
    pub phase: Option<u32>,
    pub phase_bytes: u32,
    /// Every tile's table bytes, as the sizing found them: a program over the budget is still
    /// feasible where it places with its tables (`select_finalist`, `lower_mid`'s screen).
    pub table_bytes: Arc<Vec<u32>>,
}

impl std::fmt::Display for TableOverflow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tile {}: exchange tables need {} bytes, over the per-tile exchange-table budget of {} bytes", self.tile, self.bytes, self.budget)?;
        if let Some(p) = self.phase {
            write!(f, " (exchange phase {p} holds {} of them)", self.phase_bytes)?;
        }
        Ok(())
    }
}

/// Whether `lowered` places (`storage::place_storage`) with each tile's code at its size for
/// these table bytes: a program whose tables exceed the budget is kept where it does (the
/// placement error otherwise).
pub fn places_with_tables(target: &Target, lowered: &Lowered, table_bytes: &[u32]) -> Result<(), crate::storage::PlacementError> {
    crate::storage::place_storage(target, lowered, &crate::emit::size_tile_code(lowered, table_bytes)).map(|_| ())
}

/// Support memory per tile with compact tables, or the first tile (lowest) whose tables
/// exceed `budget` bytes (inner error) with the phase holding most of its table bytes.
pub fn support_checked(target: &Target, lowered: &Lowered, schedules: &[Schedule], digests: Option<&[Digest]>, budget: u32) -> Result<Result<Vec<SupportMemory>, TableOverflow>, String> {
    Ok(table_bytes_checked(target, lowered, schedules, digests, budget)?.map(|bytes| support_memory(lowered, &bytes)))
}

/// `support_checked` given each tile's table bytes as an earlier sizing of this program over
/// these schedules found them (`known`, when at hand), else sized here. Known bytes over the
/// budget (a finalist `lower_mid`'s screen kept under the compiler's budget policy, where it
/// places with its tables) give the overflow without the phase holding most of them, which
/// only a hard budget's steer reads (and the screen keeps no such finalist under one).
pub fn support_checked_known(target: &Target, lowered: &Lowered, schedules: &[Schedule], digests: Option<&[Digest]>, budget: u32, known: Option<&[u32]>) -> Result<Result<Vec<SupportMemory>, TableOverflow>, String> {
    match known {
        Some(bytes) if bytes.len() == lowered.tiles as usize => Ok(match bytes.iter().enumerate().find(|(_, b)| **b > budget) {
            None => Ok(support_memory(lowered, bytes)),
            Some((tile, &over)) => Err(TableOverflow { tile: tile as u32, bytes: over, budget, phase: None, phase_bytes: 0, table_bytes: Arc::new(bytes.to_vec()) }),
        }),
        _ => support_checked(target, lowered, schedules, digests, budget),
    }
}

/// Each tile's exchange-table bytes over sizing addresses (as `size_tile_code` encodes them),
/// or the first tile (lowest) whose tables exceed `budget` bytes, with the phase holding most
/// of its table bytes.
pub fn table_bytes_checked(target: &Target, lowered: &Lowered, schedules: &[Schedule], digests: Option<&[Digest]>, budget: u32) -> Result<Result<Vec<u32>, TableOverflow>, String> {
    table_bytes_memoized(target, lowered, schedules, digests, budget, None)
}

/// `table_bytes_checked`, the relative tables from and into `memo` (`sizing_tables`).
pub fn table_bytes_memoized(target: &Target, lowered: &Lowered, schedules: &[Schedule], digests: Option<&[Digest]>, budget: u32, memo: Option<&RelativeMemo>) -> Result<Result<Vec<u32>, TableOverflow>, String> {
    let packed = sizing_tables(target, lowered, schedules, digests, memo)?;
    let table_bytes: Vec<u32> = tile_tables(lowered.tiles as usize, &packed)?.iter().map(|b| b.len() as u32).collect();
    if let Some((tile, &bytes)) = table_bytes.iter().enumerate().find(|(_, b)| **b > budget) {
        // Each phase's share: its tables on that tile encoded alone (largest first, lowest index on ties).
        let mut worst: Option<(u32, u32)> = None;
        for phase in &packed {
            for t in phase.tiles.iter().filter(|t| t.tile as usize == tile) {
                let b = encode_tile(&[(phase.index, t)])?.len() as u32;
                if worst.is_none_or(|w| b > w.1) {
                    worst = Some((phase.index, b));
                }
            }
        }
        return Ok(Err(TableOverflow { tile: tile as u32, bytes, budget, phase: worst.map(|w| w.0), phase_bytes: worst.map_or(0, |w| w.1), table_bytes: Arc::new(table_bytes) }));
    }
    Ok(Ok(table_bytes))
}

/// Support memory per tile with compact tables; an error names the first tile (lowest) whose
/// tables exceed `budget` bytes.
pub fn support_with_tables(target: &Target, lowered: &Lowered, schedules: &[Schedule], digests: Option<&[Digest]>, budget: u32) -> Result<Vec<SupportMemory>, String> {
    support_checked(target, lowered, schedules, digests, budget)?.map_err(|o| o.to_string())
}

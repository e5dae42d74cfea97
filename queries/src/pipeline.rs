//! The pipeline: every stage in order, one line each. The driver (crate `ipuq`) calls them in
//! this order so that each phase is timed and logged as the seed's are.
//!
//! lower_mid                    plan each operation and lower to buffers, calls, transfers
//! lower_exchanges_provisional  schedule each exchange phase (address-free, cached per pattern)
//! size_tile_code               bytes of vertex state and exchange tables per tile
//! place_storage                addresses for every buffer, by region, alignment and lifetime
//! lower_exchanges              patch final addresses into the schedules and validate them
//! build_tile_images            tile images, programs and host tables: the package
//!
//! What each stage reads of the target (its key holds that view's digest, and the stage gets
//! only that view): lower_mid the lowering view (all but host), the schedules and
//! lower_exchanges the exchange view (grid, delays, pairing, port widths), place_storage the
//! memory view, build_tile_images the whole target (it embeds it). Every key also holds the
//! compiler fingerprint (`Database::key`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use rayon::prelude::*;

use crate::db::{exchange_target, graph, lowering_target, memory_target, target, CompileError, Database, Db, Sources, StageResult, Staged};
use crate::emit::{build_package, size_tile_code};
use crate::exchange::{self, Destination, PhaseRequest, Schedule};
use crate::hash::{Digest, KeyHasher};
use crate::lower::{lower, Lowered};
use crate::package::{ExchangePhase, Package};
use crate::storage::{place_storage, Placement};

/// The phases in order, as the driver runs and logs them.
pub const PHASES: &[&str] = &["lower_mid", "lower_exchanges_provisional", "size_tile_code", "place_storage", "lower_exchanges", "build_tile_images"];

const LOWER_VERSION: u32 = 7;
const SCHEDULE_VERSION: u32 = 4;
const CODE_VERSION: u32 = 1;
const PLACE_VERSION: u32 = 1;
const TABLES_VERSION: u32 = 1;
const PACKAGE_VERSION: u32 = 4;

/// Run one phase by name (the driver's entry point); returns the digest of its output.
pub fn run_phase(db: &dyn Db, sources: Sources, phase: &str) -> Result<Digest, CompileError> {
    Ok(match phase {
        "lower_mid" => lowered(db, sources)?.digest,
        "lower_exchanges_provisional" => schedules(db, sources)?.digest,
        "size_tile_code" => code_sizes(db, sources)?.digest,
        "place_storage" => placement(db, sources)?.digest,
        "lower_exchanges" => tables(db, sources)?.digest,
        "build_tile_images" => package(db, sources)?.digest,
        other => return Err(CompileError(format!("unknown phase '{other}'"))),
    })
}

#[salsa::tracked(returns(clone))]
pub fn lowered(db: &dyn Db, sources: Sources) -> StageResult<Lowered> {
    let t = lowering_target(db, sources)?;
    let g = graph(db, sources)?;
    let key = db.ipuq().key("lower_mid", LOWER_VERSION, &[t.digest, g.digest]);
    db.ipuq().cached("lower_mid", LOWER_VERSION, key, || lower(&g.value, &t.value).map_err(CompileError::from))
}

/// The exchange requests of every phase, with addresses from `address(buffer, offset)`.
pub fn requests(lowered: &Lowered, address: impl Fn(u32, u32) -> u32) -> Vec<PhaseRequest> {
    lowered
        .phases
        .iter()
        .enumerate()
        .map(|(index, transfers)| PhaseRequest {
            index: index as u32,
            transfers: transfers
                .iter()
                .map(|t| exchange::Transfer {
                    source: lowered.buffers[t.source.0 as usize].tile,
                    source_address: address(t.source.0, t.source.1),
                    words: t.words,
                    destinations: t.destinations.iter().map(|d| Destination { tile: lowered.buffers[d.0 as usize].tile, address: address(d.0, d.1) }).collect(),
                })
                .collect(),
        })
        .collect()
}

/// A non-overlapping provisional base address for every buffer (per tile, 16-byte aligned).
pub fn provisional_bases(lowered: &Lowered) -> Vec<u32> {
    let mut next = vec![0u64; lowered.tiles as usize];
    lowered
        .buffers
        .iter()
        .map(|b| {
            let base = next[b.tile as usize];
            next[b.tile as usize] = (base + b.bytes as u64).div_ceil(16) * 16;
            base.min(u32::MAX as u64) as u32
        })
        .collect()
}

#[salsa::tracked(returns(clone))]
pub fn schedules(db: &dyn Db, sources: Sources) -> StageResult<Vec<Schedule>> {
    let t = exchange_target(db, sources)?;
    let l = lowered(db, sources)?;
    // Provisional addresses: every buffer gets its own 16-byte aligned range in a per-tile
    // address space, so rows of different buffers never alias and alignment classes match
    // the final placement (which also aligns every buffer to at least 8 bytes).
    let provisional = provisional_bases(&l.value);
    let requests = requests(&l.value, |buffer, offset| provisional[buffer as usize] + offset);
    schedule_all(db.ipuq(), &t, &requests)
}

/// Schedule every phase, one entry per distinct pattern: identical patterns are scheduled once
/// (found in this process's memo, then the disk store, else computed). Missing patterns are
/// scheduled in parallel over plain data (no query runs on a rayon worker) and collected in
/// phase order, so the result is the same at any thread count.
fn schedule_all(db: &Database, t: &Staged<crate::target::Target>, requests: &[PhaseRequest]) -> StageResult<Vec<Schedule>> {
    const STAGE: &str = "exchange_schedule";
    let patterns: Vec<Digest> = requests.par_iter().map(exchange::pattern_digest).collect();
    let keys: Vec<Digest> = patterns.iter().map(|p| db.key(STAGE, SCHEDULE_VERSION, &[t.digest, *p])).collect();
    let previous = std::mem::take(&mut *db.schedule_memo.lock().expect("schedule memo lock"));
    let mut found: HashMap<Digest, Staged<Schedule>> = HashMap::new();
    let mut missing: Vec<usize> = Vec::new();
    let mut pending: HashSet<Digest> = HashSet::new();
    let mut result = Ok(());
    for (index, key) in keys.iter().enumerate() {
        if found.contains_key(key) || pending.contains(key) {
            continue;
        }
        if db.verifying() {
            match db.cached(STAGE, SCHEDULE_VERSION, *key, || exchange::schedule_phase(&t.value, &requests[index]).map_err(CompileError::from)) {
                Ok(s) => found.insert(*key, s),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
        } else if let Some(s) = previous.get(key).cloned().or_else(|| db.load(STAGE, SCHEDULE_VERSION, key)) {
            found.insert(*key, s);
        } else {
            pending.insert(*key);
            missing.push(index);
        }
    }
    if result.is_ok() {
        let span = tracing::Span::current();
        let fresh: Vec<_> = missing
            .par_iter()
            .map(|&index| {
                let _span = span.enter();
                exchange::schedule_phase(&t.value, &requests[index])
            })
            .collect();
        for (&index, schedule) in missing.iter().zip(fresh) {
            match schedule.map_err(CompileError::from).and_then(|s| db.save(STAGE, SCHEDULE_VERSION, keys[index], s)) {
                Ok(s) => {
                    found.insert(keys[index], s);
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
    }
    let mut h = KeyHasher::new("ipuq schedules v1");
    let out = result.map(|()| {
        keys.iter()
            .map(|key| {
                let s = &found[key];
                h.add(&s.digest);
                (*s.value).clone()
            })
            .collect()
    });
    *db.schedule_memo.lock().expect("schedule memo lock") = if out.is_ok() { found } else { previous };
    Ok(Staged { digest: h.finish(), value: Arc::new(out?) })
}

#[salsa::tracked(returns(clone))]
pub fn code_sizes(db: &dyn Db, sources: Sources) -> StageResult<Vec<u32>> {
    let l = lowered(db, sources)?;
    let s = schedules(db, sources)?;
    let key = db.ipuq().key("size_tile_code", CODE_VERSION, &[l.digest, s.digest]);
    db.ipuq().cached("size_tile_code", CODE_VERSION, key, || {
        let mut entries = vec![0u32; l.value.tiles as usize];
        for (phase, schedule) in l.value.phases.iter().zip(s.value.iter()) {
            for piece in &schedule.pieces {
                let t = &phase[piece.transfer as usize];
                entries[l.value.buffers[t.source.0 as usize].tile as usize] += 1;
                for d in &t.destinations {
                    entries[l.value.buffers[d.0 as usize].tile as usize] += 1;
                }
            }
        }
        Ok(size_tile_code(&l.value, &entries))
    })
}

#[salsa::tracked(returns(clone))]
pub fn placement(db: &dyn Db, sources: Sources) -> StageResult<Placement> {
    let t = memory_target(db, sources)?;
    let l = lowered(db, sources)?;
    let c = code_sizes(db, sources)?;
    let key = db.ipuq().key("place_storage", PLACE_VERSION, &[t.digest, l.digest, c.digest]);
    db.ipuq().cached("place_storage", PLACE_VERSION, key, || place_storage(&t.value, &l.value, &c.value).map_err(CompileError::from))
}

#[salsa::tracked(returns(clone))]
pub fn tables(db: &dyn Db, sources: Sources) -> StageResult<Vec<ExchangePhase>> {
    let t = exchange_target(db, sources)?;
    let l = lowered(db, sources)?;
    let s = schedules(db, sources)?;
    let p = placement(db, sources)?;
    let key = db.ipuq().key("lower_exchanges", TABLES_VERSION, &[t.digest, l.digest, s.digest, p.digest]);
    db.ipuq().cached("lower_exchanges", TABLES_VERSION, key, || {
        let addresses = &p.value.addresses;
        let requests = requests(&l.value, |buffer, offset| addresses[buffer as usize] + offset);
        requests.iter().zip(s.value.iter()).map(|(r, sched)| exchange::reuse(&t.value, r, sched).map_err(CompileError::from)).collect()
    })
}

#[salsa::tracked(returns(clone))]
pub fn package(db: &dyn Db, sources: Sources) -> StageResult<Package> {
    let t = target(db, sources)?;
    let g = graph(db, sources)?;
    let l = lowered(db, sources)?;
    let p = placement(db, sources)?;
    let x = tables(db, sources)?;
    // The package embeds the workload text (initialisers included), so its key reads it too.
    let text = Digest::of_bytes(sources.workload_text(db).as_bytes());
    let key = db.ipuq().key("build_tile_images", PACKAGE_VERSION, &[t.digest, g.digest, text, l.digest, p.digest, x.digest]);
    db.ipuq().cached("build_tile_images", PACKAGE_VERSION, key, || Ok(build_package(&t.value, &g.value, &l.value, &p.value, (*x.value).clone())))
}

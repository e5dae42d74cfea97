//! Execution profiles: the per-tile, per-superstep cycles of a run, on disk
//! (`execution.ipuprofile`), summarised for people, and exported for Perfetto.
//!
//! File format (version 1), all integers little endian, no padding:
//! ```text
//! header   magic "IPUQPROF" (8 B) | version u32 | tiles u32 | steps u32 | reserved u32 (0) | clock_hz u64
//! tiles    tiles x u32                          tile ids, in the package's tile order
//! steps    steps x (kind u32 | index u32 | cycles u64)
//!          kind 0 = compute (index = compute set), 1 = exchange (index = phase)
//! records  steps x tiles x (compute u64 | exchange u64 | sync u64 | idle u64), step-major
//! ```
//! One record is one sample; for every tile, compute + exchange + sync + idle equals its step's
//! cycles. The reader rejects a file whose length disagrees with its header.
//!
//! This module must not run anything: it reads and writes [`Timeline`]s.

use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use ipuq_queries::package::Step;
use serde_json::{json, Value};

use crate::device::{TileStepRecord, Timeline};

pub const PROFILE_FILE_NAME: &str = "execution.ipuprofile";
const MAGIC: [u8; 8] = *b"IPUQPROF";
const VERSION: u32 = 1;
const HEADER_BYTES: usize = 32;
/// Above this many tiles the trace shows groups of [`TRACE_GROUP`] tiles, one track each.
const TRACE_TILE_LIMIT: usize = 128;
const TRACE_GROUP: usize = 16;
/// How many supersteps the summary lists.
const SLOWEST_SHOWN: usize = 5;

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("profile {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("profile {path}: {message}")]
    Format { path: PathBuf, message: String },
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> ProfileError + '_ {
    move |source| ProfileError::Io { path: path.to_path_buf(), source }
}

/// Write a timeline; returns the number of samples ((tile, step) records).
pub fn write(path: &Path, timeline: &Timeline) -> Result<u64, ProfileError> {
    let mut out = Vec::with_capacity(HEADER_BYTES + timeline.tiles.len() * 4 + timeline.steps.len() * 16 + timeline.records.len() * 32);
    out.extend_from_slice(&MAGIC);
    for word in [VERSION, timeline.tiles.len() as u32, timeline.steps.len() as u32, 0] {
        out.extend_from_slice(&word.to_le_bytes());
    }
    out.extend_from_slice(&timeline.clock_hz.to_le_bytes());
    for tile in &timeline.tiles {
        out.extend_from_slice(&tile.to_le_bytes());
    }
    for (step, cycles) in &timeline.steps {
        let (kind, index) = match step {
            Step::Compute { index } => (0u32, *index),
            Step::Exchange { phase } => (1u32, *phase),
        };
        out.extend_from_slice(&kind.to_le_bytes());
        out.extend_from_slice(&index.to_le_bytes());
        out.extend_from_slice(&cycles.to_le_bytes());
    }
    for r in &timeline.records {
        for value in [r.compute, r.exchange, r.sync, r.idle] {
            out.extend_from_slice(&value.to_le_bytes());
        }
    }
    std::fs::write(path, out).map_err(io_error(path))?;
    Ok(timeline.records.len() as u64)
}

/// Read a profile written by [`write`].
pub fn read(path: &Path) -> Result<Timeline, ProfileError> {
    let bytes = std::fs::read(path).map_err(io_error(path))?;
    let bad = |message: String| ProfileError::Format { path: path.to_path_buf(), message };
    if bytes.len() < HEADER_BYTES || bytes[..8] != MAGIC {
        return Err(bad("not an ipuq execution profile (bad magic)".into()));
    }
    let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap_or_default());
    let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap_or_default());
    if u32_at(8) != VERSION {
        return Err(bad(format!("format version {}, this ipuq reads {VERSION}", u32_at(8))));
    }
    let (tiles, steps) = (u32_at(12) as usize, u32_at(16) as usize);
    let expected = (HEADER_BYTES as u128) + tiles as u128 * 4 + steps as u128 * 16 + (tiles * steps) as u128 * 32;
    if bytes.len() as u128 != expected {
        return Err(bad(format!("{} bytes, but {tiles} tiles and {steps} steps need {expected}", bytes.len())));
    }
    let clock_hz = u64_at(24);
    let mut at = HEADER_BYTES;
    let tile_ids = (0..tiles).map(|i| u32_at(at + 4 * i)).collect();
    at += tiles * 4;
    let mut step_list = Vec::with_capacity(steps);
    for i in 0..steps {
        let o = at + 16 * i;
        let step = match u32_at(o) {
            0 => Step::Compute { index: u32_at(o + 4) },
            1 => Step::Exchange { phase: u32_at(o + 4) },
            kind => return Err(bad(format!("step {i} has unknown kind {kind}"))),
        };
        step_list.push((step, u64_at(o + 8)));
    }
    at += steps * 16;
    let records = (0..tiles * steps)
        .map(|i| {
            let o = at + 32 * i;
            TileStepRecord { compute: u64_at(o), exchange: u64_at(o + 8), sync: u64_at(o + 16), idle: u64_at(o + 24) }
        })
        .collect();
    Ok(Timeline { clock_hz, tiles: tile_ids, steps: step_list, records })
}

/// The people-facing digest of a profile.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileSummary {
    pub tiles: usize,
    pub steps: usize,
    pub cycles: u64,
    pub clock_hz: u64,
    /// (step index, step, cycles), slowest first.
    pub slowest: Vec<(usize, Step, u64)>,
    /// Tiles that run no vertex in the whole program.
    pub idle_tiles: usize,
    /// Busy cycles (compute, own exchange, sync) of the tiles that compute: least, mean, most.
    pub busy_min: u64,
    pub busy_mean: f64,
    pub busy_max: u64,
    /// Cycles of exchange supersteps (sync included), and of their syncs alone.
    pub exchange_cycles: u64,
    pub sync_cycles: u64,
}

pub fn summary_of(timeline: &Timeline) -> ProfileSummary {
    let mut slowest: Vec<(usize, Step, u64)> = timeline.steps.iter().enumerate().map(|(i, (s, c))| (i, *s, *c)).collect();
    slowest.sort_by_key(|(i, _, c)| (std::cmp::Reverse(*c), *i));
    slowest.truncate(SLOWEST_SHOWN);
    // Balance is judged over the tiles that compute: idle tiles only sync.
    let computes = |t: usize| (0..timeline.steps.len()).any(|s| timeline.record(s, t).compute > 0);
    let active: Vec<usize> = (0..timeline.tiles.len()).filter(|&t| computes(t)).collect();
    let idle_tiles = timeline.tiles.len() - active.len();
    let measured: Vec<usize> = if active.is_empty() { (0..timeline.tiles.len()).collect() } else { active };
    let busy: Vec<u64> = measured.iter().map(|&t| timeline.tile_busy(t)).collect();
    let exchange_steps = timeline.steps.iter().enumerate().filter(|(_, (s, _))| matches!(s, Step::Exchange { .. }));
    let (mut exchange_cycles, mut sync_cycles) = (0, 0);
    for (i, (_, cycles)) in exchange_steps {
        exchange_cycles += cycles;
        sync_cycles += if timeline.tiles.is_empty() { 0 } else { timeline.record(i, 0).sync };
    }
    ProfileSummary {
        tiles: timeline.tiles.len(),
        steps: timeline.steps.len(),
        cycles: timeline.cycles(),
        clock_hz: timeline.clock_hz,
        slowest,
        idle_tiles,
        busy_min: busy.iter().copied().min().unwrap_or(0),
        busy_mean: if busy.is_empty() { 0.0 } else { busy.iter().sum::<u64>() as f64 / busy.len() as f64 },
        busy_max: busy.iter().copied().max().unwrap_or(0),
        exchange_cycles,
        sync_cycles,
    }
}

/// Read and summarise a profile file.
pub fn summarize(path: &Path) -> Result<ProfileSummary, ProfileError> {
    Ok(summary_of(&read(path)?))
}

fn step_name(step: Step) -> String {
    match step {
        Step::Compute { index } => format!("compute set {index}"),
        Step::Exchange { phase } => format!("exchange phase {phase}"),
    }
}

fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 { 0.0 } else { 100.0 * part as f64 / whole as f64 }
}

impl fmt::Display for ProfileSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let micros = self.cycles as f64 * 1e6 / self.clock_hz.max(1) as f64;
        writeln!(f, "profile: {} tiles, {} supersteps, {} cycles ({micros:.3} us)", self.tiles, self.steps, self.cycles)?;
        writeln!(
            f,
            "exchange share: {:.1}% of cycles ({:.1}% in syncs)",
            percent(self.exchange_cycles, self.cycles),
            percent(self.sync_cycles, self.cycles)
        )?;
        writeln!(
            f,
            "busy cycles of the {} computing tiles: min {} / mean {:.0} / max {} (min/max {:.1}%)",
            self.tiles - self.idle_tiles,
            self.busy_min,
            self.busy_mean,
            self.busy_max,
            percent(self.busy_min, self.busy_max)
        )?;
        writeln!(f, "slowest supersteps:")?;
        for (i, step, cycles) in &self.slowest {
            writeln!(f, "  step {i:>4}  {:<20} {cycles:>10} cycles  {:>5.1}%", step_name(*step), percent(*cycles, self.cycles))?;
        }
        Ok(())
    }
}

/// The Chrome trace-event JSON of a timeline: one track per tile (per group of 16 tiles above
/// 128 tiles), one complete ("X") slice per superstep on each track, spanning the track's
/// busy part of the step (for a group, its busiest tile); times in microseconds.
pub fn chrome_trace_json(timeline: &Timeline) -> Value {
    let tiles = timeline.tiles.len();
    let group = if tiles > TRACE_TILE_LIMIT { TRACE_GROUP } else { 1 };
    let micros = |cycles: u64| cycles as f64 * 1e6 / timeline.clock_hz.max(1) as f64;
    let mut events = vec![json!({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "ipuq simulator"}})];
    for (track, members) in timeline.tiles.chunks(group).enumerate() {
        let name = match members {
            [one] => format!("tile {one}"),
            _ => format!("tiles {}..={}", members[0], members[members.len() - 1]),
        };
        events.push(json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": track, "args": {"name": name}}));
    }
    let mut start = 0u64;
    for (s, (step, cycles)) in timeline.steps.iter().enumerate() {
        let (category, name) = (if matches!(step, Step::Compute { .. }) { "compute" } else { "exchange" }, step_name(*step));
        for track in 0..tiles.div_ceil(group) {
            let records: Vec<TileStepRecord> = (track * group..((track + 1) * group).min(tiles)).map(|t| timeline.record(s, t)).collect();
            let busiest = records.iter().copied().max_by_key(|r| r.busy()).unwrap_or_default();
            let least = records.iter().map(|r| r.busy()).min().unwrap_or(0);
            events.push(json!({
                "name": name, "cat": category, "ph": "X", "pid": 0, "tid": track,
                "ts": micros(start), "dur": micros(busiest.busy()),
                "args": {"step": s, "step_cycles": cycles, "compute": busiest.compute, "exchange": busiest.exchange,
                         "sync": busiest.sync, "idle": busiest.idle, "least_busy": least},
            }));
        }
        start += cycles;
    }
    json!({"traceEvents": events, "displayTimeUnit": "ns"})
}

/// Export a profile file as Chrome trace-event JSON (Perfetto, chrome://tracing).
pub fn chrome_trace(path: &Path, out_json: &Path) -> Result<(), ProfileError> {
    let trace = chrome_trace_json(&read(path)?);
    let file = File::create(out_json).map_err(io_error(out_json))?;
    let mut writer = BufWriter::new(file);
    serde_json::to_writer(&mut writer, &trace).map_err(|e| io_error(out_json)(e.into()))?;
    writer.flush().map_err(io_error(out_json))
}

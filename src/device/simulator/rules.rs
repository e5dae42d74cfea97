//! The exchange rules of `shared/design/exchange.md` that concern bytes rather than ports:
//! checked at load time, beside the table executor (`exchange.rs`), each violation an error
//! naming the phase, the tile and the cycle.
//!
//! - **Overlapping receive writes:** no two receive entries of one tile write the same byte in
//!   a phase (on hardware the later word silently wins; in a compiled program it is a bug).
//! - **Read-after-write hazards:** a word is read when it is sent, not when the phase begins.
//!   A send that reads a byte which a receive of the same tile has already written in this
//!   phase (landed at or before the send cycle) would forward the new value; ipuq's programs
//!   never forward within a phase, so this is an error rather than something to emulate.
//! - **Unreceived sends:** every word a tile sends must be heard by at least one receive; a
//!   word nobody receives costs port time for nothing and points at a dropped receive.
//!
//! Receives into bytes that no live buffer owns are rejected by the bounds check in
//! `exchange.rs` (through `TileMemory::check` with the phase's steps). This module must not
//! decode tables or move words: it sees entries and word ranges.

use std::collections::BTreeMap;

use ipuq_queries::package::{ReceiveEntry, SendEntry};

use crate::device::DeviceError;

/// Bytes in one exchange word.
const WORD_BYTES: u64 = 4;

fn fail(phase: u32, tile: u32, cycle: u64, message: String) -> DeviceError {
    DeviceError::Exchange { phase, tile, cycle, message }
}

fn rate(paired: bool, paired_rate: u64) -> u64 {
    if paired { paired_rate } else { 1 }
}

/// No byte written twice by one tile's receives in one phase.
pub fn receive_overlaps(phase: u32, tile: u32, receives: &[ReceiveEntry]) -> Result<(), DeviceError> {
    let mut ranges: Vec<(u64, u64, &ReceiveEntry)> =
        receives.iter().map(|r| (r.address as u64, r.address as u64 + r.words as u64 * WORD_BYTES, r)).collect();
    ranges.sort_by_key(|&(start, end, _)| (start, end));
    for pair in ranges.windows(2) {
        let ((_, end, a), (start, _, b)) = (pair[0], pair[1]);
        if start < end {
            let later = a.cycle.max(b.cycle) as u64;
            return Err(fail(
                phase,
                tile,
                later,
                format!(
                    "receives overlap in memory: the receive from tile {} at cycle {} writes [{:#x}, {:#x}) and the receive from tile {} at cycle {} writes from {:#x}",
                    a.source, a.cycle, a.address, end, b.source, b.cycle, start
                ),
            ));
        }
    }
    Ok(())
}

/// No send reads a byte that a receive of the same tile wrote earlier in the phase.
/// `receives` must be free of overlaps ([`receive_overlaps`]).
pub fn read_after_write(phase: u32, tile: u32, sends: &[SendEntry], receives: &[ReceiveEntry], paired_rate: u64) -> Result<(), DeviceError> {
    if sends.is_empty() || receives.is_empty() {
        return Ok(());
    }
    let mut by_address: Vec<&ReceiveEntry> = receives.iter().collect();
    by_address.sort_by_key(|r| r.address);
    for s in sends {
        let (s_start, s_end) = (s.address as u64, s.address as u64 + s.words as u64 * WORD_BYTES);
        let first = by_address.partition_point(|r| r.address as u64 + r.words as u64 * WORD_BYTES <= s_start);
        for r in by_address[first..].iter().take_while(|r| (r.address as u64) < s_end) {
            let (r_start, r_end) = (r.address as u64, r.address as u64 + r.words as u64 * WORD_BYTES);
            let (lo, hi) = (s_start.max(r_start), s_end.min(r_end));
            // Word by word over the overlap, which a correct program never has.
            let mut byte = lo;
            while byte < hi {
                let read = s.cycle as u64 + (byte - s_start) / WORD_BYTES / rate(s.paired, paired_rate);
                let written = r.cycle as u64 + (byte - r_start) / WORD_BYTES / rate(r.paired, paired_rate);
                if written <= read {
                    return Err(fail(
                        phase,
                        tile,
                        read,
                        format!(
                            "read-after-write hazard: the send at cycle {} reads the word at {byte:#x} at cycle {read}, after the receive from tile {} wrote it at cycle {written} in this phase (a word is read when it is sent)",
                            s.cycle, r.source
                        ),
                    ));
                }
                byte += WORD_BYTES;
            }
        }
    }
    Ok(())
}

/// Word ranges `[first, end)` of each send entry (by tile and index into that tile's sends
/// sorted by cycle) that some receive hears.
#[derive(Default)]
pub struct Coverage {
    heard: BTreeMap<(u32, usize), Vec<(u64, u64)>>,
}

impl Coverage {
    pub fn hear(&mut self, tile: u32, send: usize, first: u64, words: u64) {
        self.heard.entry((tile, send)).or_default().push((first, first + words));
    }

    /// Every word of every send is heard; `sorted_sends[tile]` are the tiles' sends by cycle.
    pub fn check_all_heard(mut self, phase: u32, sorted_sends: &BTreeMap<u32, Vec<SendEntry>>, paired_rate: u64) -> Result<(), DeviceError> {
        for (&tile, sends) in sorted_sends {
            for (i, s) in sends.iter().enumerate() {
                let mut ranges = self.heard.remove(&(tile, i)).unwrap_or_default();
                ranges.sort_unstable();
                let mut reached = 0u64;
                for (first, end) in ranges {
                    if first > reached {
                        break;
                    }
                    reached = reached.max(end);
                }
                if reached < s.words as u64 {
                    let cycle = s.cycle as u64 + reached / rate(s.paired, paired_rate);
                    return Err(fail(
                        phase,
                        tile,
                        cycle,
                        format!(
                            "unreceived send: word {reached} of the {}-word send from {:#x} at cycle {} is heard by no receive",
                            s.words, s.address, s.cycle
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

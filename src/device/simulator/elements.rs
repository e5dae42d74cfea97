//! The memory-element rule, checked strictly at load time: a tile cannot send from and
//! receive into the same memory element in one cycle. Elements are `element_bytes` (16 KiB)
//! below the interleaved window and `interleaved_element_bytes` (32 KiB pairs) inside it,
//! both read from the target.
//!
//! A send entry reads its words on consecutive cycles from its cycle on (paired: two words a
//! cycle); a receive entry writes them on consecutive cycles from its arrival cycle. Each entry
//! becomes runs of (element, first cycle, end cycle); a tile whose send and receive runs on one
//! element share a cycle breaks the rule, and the error names phase, tile, cycle and element.
//! This code is the simulator's own: it shares nothing with the compiler's placement scoring.
//! `compute.rs` takes `element` for the matrix-product rule (input and output in different
//! elements).

use std::collections::BTreeMap;

use ipuq_queries::package::ExchangePhase;
use ipuq_queries::target::Target;

use crate::device::DeviceError;

/// Bytes in one exchange word (an ISA fact).
const WORD_BYTES: u64 = 4;

/// [first byte, end) of the element holding `address`.
pub(super) fn element(target: &Target, address: u64) -> (u64, u64) {
    let m = &target.memory;
    let (base, split) = (m.base as u64, m.interleaved_start as u64);
    let small = (m.element_bytes as u64).max(1);
    let pair = (m.interleaved_element_bytes as u64).max(1);
    if address < split {
        let start = base + address.saturating_sub(base) / small * small;
        (start, (start + small).min(split))
    } else {
        let start = split + (address - split) / pair * pair;
        (start, start + pair)
    }
}

/// Runs (element, start cycle, end cycle) of one entry: `words` words from `address`,
/// `rate` words a cycle from `cycle` on.
fn runs(target: &Target, cycle: u32, address: u32, words: u32, rate: u32, out: &mut BTreeMap<(u64, u64), Vec<(u64, u64)>>) {
    let rate = rate.max(1) as u64;
    let mut done = 0u64;
    while done < words as u64 {
        let at = address as u64 + done * WORD_BYTES;
        let (start, end) = element(target, at);
        let here = (end - at).div_ceil(WORD_BYTES).min(words as u64 - done);
        let first = cycle as u64 + done / rate;
        let last = cycle as u64 + (done + here - 1) / rate;
        out.entry((start, end)).or_default().push((first, last + 1));
        done += here;
    }
}

/// Check every tile of a phase; the first violation (lowest tile, then earliest cycle) is the error.
pub fn check(target: &Target, phase: &ExchangePhase) -> Result<(), DeviceError> {
    let x = &target.exchange;
    for table in &phase.tiles {
        let (mut sends, mut receives) = (BTreeMap::new(), BTreeMap::new());
        for s in &table.sends {
            runs(target, s.cycle, s.address, s.words, if s.paired { x.paired_words_per_cycle } else { x.send_words_per_cycle }, &mut sends);
        }
        for r in &table.receives {
            runs(target, r.cycle, r.address, r.words, if r.paired { x.paired_words_per_cycle } else { x.receive_words_per_cycle }, &mut receives);
        }
        let mut worst: Option<(u64, (u64, u64))> = None;
        for (index, reads) in &mut sends {
            let Some(writes) = receives.get_mut(index) else { continue };
            reads.sort_unstable();
            writes.sort_unstable();
            // Two sorted run lists: the earliest common cycle, if any.
            let (mut i, mut j) = (0, 0);
            while i < reads.len() && j < writes.len() {
                let (a, b) = (reads[i], writes[j]);
                let lo = a.0.max(b.0);
                if lo < a.1.min(b.1) {
                    if worst.is_none_or(|(c, _)| lo < c) {
                        worst = Some((lo, *index));
                    }
                    break;
                }
                if a.1 <= b.1 {
                    i += 1;
                } else {
                    j += 1;
                }
            }
        }
        if let Some((cycle, (start, end))) = worst {
            return Err(DeviceError::Exchange {
                phase: phase.index,
                tile: table.tile,
                cycle,
                message: format!("memory element [{start:#x}, {end:#x}) is sent from and received into in the same cycle (a tile cannot read its exchange words from and write them into one element at once)"),
            });
        }
    }
    Ok(())
}

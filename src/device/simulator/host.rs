//! Host transfers of the simulator: scattering a tensor's row-major bytes into its segments,
//! gathering them back, and sampling single elements for checkpoints.
//!
//! Every segment is checked before any byte moves: its elements must lie inside the tensor,
//! its tile must be loaded, and its bytes must lie in tensor storage on that tile. A tensor
//! read must cover every element. This module must not know what a tensor means (inputs,
//! weights, outputs are all the same to it) and must not choose which elements to sample.

use half::f16;
use ipuq_queries::ir::DType;
use ipuq_queries::package::{HostSegment, HostTensor};

use super::memory::{Need, TileMemory};
use crate::device::DeviceError;

/// Elements and bytes of a host tensor, checked against overflow.
pub fn tensor_size(tensor: &HostTensor) -> Result<(u64, u64), DeviceError> {
    let elements = tensor.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64));
    let elements = elements.ok_or_else(|| host_error(tensor, "shape overflows 64 bits".into()))?;
    let bytes = elements.checked_mul(tensor.dtype.bytes() as u64).ok_or_else(|| host_error(tensor, "size in bytes overflows 64 bits".into()))?;
    Ok((elements, bytes))
}

fn host_error(tensor: &HostTensor, message: String) -> DeviceError {
    DeviceError::Host { tensor: tensor.name.clone(), message }
}

/// Check every segment of a tensor, moved by the host at program step `step` (0 before the
/// run, the step count after it), where its storage must be live; returns the memory slot of
/// each.
pub fn check_segments(
    tensor: &HostTensor,
    slots: &[Option<usize>],
    memories: &[TileMemory],
    labels: &[String],
    step: u32,
) -> Result<Vec<usize>, DeviceError> {
    let (elements, _) = tensor_size(tensor)?;
    let element_bytes = tensor.dtype.bytes() as u64;
    // A segment's runs must not overlap in memory nor reach past the tensor, computed in 64
    // bits before they are listed: a hostile row count cannot make the list huge or wrap.
    for s in &tensor.segments {
        let what = format!("segment of {} runs on tile {} at {:#x}", s.rows, s.tile, s.address);
        if s.element_step == 0 && s.count > 1 {
            return Err(host_error(tensor, format!("{what}: its element step is 0")));
        }
        if s.rows == 0 || s.count == 0 {
            continue;
        }
        let last = s.rows as u64 - 1;
        let step = s.element_step as u64;
        let span = (s.count as u64 - 1) * step;
        if s.rows > 1 {
            // Runs must not overlap in memory, nor share elements: either each run ends before
            // the next starts, or the runs interleave inside one step.
            let apart = s.element_stride as u64 > span;
            let interleaved = step > 1 && s.element_stride >= 1 && last * s.element_stride as u64 + 1 <= step;
            if (s.address_stride as u64) < s.count as u64 * element_bytes || !(apart || interleaved) {
                return Err(host_error(tensor, format!("{what}: its runs overlap (address stride {}, element stride {}, step {})", s.address_stride, s.element_stride, s.element_step)));
            }
        }
        if s.element as u64 + last * s.element_stride as u64 + span >= elements || s.address as u64 + last * s.address_stride as u64 > u32::MAX as u64 {
            return Err(host_error(tensor, format!("{what} reaches past the tensor's {elements} elements or the address space")));
        }
    }
    let runs = tensor.runs();
    let mut found = Vec::with_capacity(runs.len());
    for s in &runs {
        let end = s.element_at(0, s.count.saturating_sub(1)) + 1;
        let what = format!("segment of elements [{}, {end}) step {} on tile {} at {:#x}", s.element, s.element_step, s.tile, s.address);
        if end > elements {
            return Err(host_error(tensor, format!("{what} reaches past the tensor's {elements} elements")));
        }
        let slot = slots
            .get(s.tile as usize)
            .copied()
            .flatten()
            .ok_or_else(|| host_error(tensor, format!("{what}: the tile is not in the package")))?;
        let start = s.address as u64;
        let end = start + s.count as u64 * element_bytes;
        memories[slot]
            .check(start, end, Need::Tensor, &[step], labels)
            .map_err(|problem| host_error(tensor, format!("{what}: range [{start:#x}, {end:#x}) {problem}")))?;
        found.push(slot);
    }
    Ok(found)
}

/// Write the tensor's row-major bytes into every segment; returns the bytes streamed. A run
/// whose elements lie `element_step` apart is gathered (transposed) on the host first, so it
/// streams as contiguous bytes like any other.
pub fn write(tensor: &HostTensor, slots: &[usize], memories: &mut [TileMemory], bytes: &[u8]) -> u64 {
    let element_bytes = tensor.dtype.bytes() as usize;
    let mut streamed = 0u64;
    let mut staged: Vec<u8> = Vec::new();
    // Runs a whole row apart element by element are columns: the host transposes the tensor
    // (as [elements / cols, cols]) once, and each such run is then one contiguous copy.
    let cols = tensor.shape.last().copied().unwrap_or(1).max(1) as usize;
    let rows = bytes.len() / element_bytes / cols;
    let mut transposed: Option<Vec<u8>> = None;
    for (s, &slot) in tensor.runs().iter().zip(slots) {
        let from = s.element as usize * element_bytes;
        let len = s.count as usize * element_bytes;
        if s.element_step <= 1 || s.count == 1 {
            memories[slot].range_mut(s.address, len).copy_from_slice(&bytes[from..from + len]);
        } else if s.element_step as usize == cols {
            let t = transposed.get_or_insert_with(|| transpose(bytes, rows, cols, element_bytes));
            let (row, col) = (s.element as usize / cols, s.element as usize % cols);
            let at = (col * rows + row) * element_bytes;
            memories[slot].range_mut(s.address, len).copy_from_slice(&t[at..at + len]);
        } else {
            let step = s.element_step as usize * element_bytes;
            staged.clear();
            for i in 0..s.count as usize {
                staged.extend_from_slice(&bytes[from + i * step..from + i * step + element_bytes]);
            }
            memories[slot].range_mut(s.address, len).copy_from_slice(&staged);
        }
        streamed += len as u64;
    }
    streamed
}

/// The bytes of a row-major [rows, cols] tensor in column-major order.
fn transpose(bytes: &[u8], rows: usize, cols: usize, element_bytes: usize) -> Vec<u8> {
    let mut out = vec![0u8; rows * cols * element_bytes];
    for r in 0..rows {
        for c in 0..cols {
            let from = (r * cols + c) * element_bytes;
            let to = (c * rows + r) * element_bytes;
            out[to..to + element_bytes].copy_from_slice(&bytes[from..from + element_bytes]);
        }
    }
    out
}

/// Gather the tensor's row-major bytes; every element must be covered by some segment.
pub fn read(tensor: &HostTensor, slots: &[usize], memories: &[TileMemory]) -> Result<Vec<u8>, DeviceError> {
    let (elements, total) = tensor_size(tensor)?;
    // Every element must be stored on some tile, so a shape with more elements than the
    // segments hold cannot be read: refused before anything the size of the shape is made.
    let stored = tensor.segments.iter().fold(0u64, |n, s| n.saturating_add(s.count as u64 * s.rows as u64));
    if stored < elements {
        return Err(host_error(tensor, format!("its shape {:?} has {elements} elements but its segments store {stored}, so the tensor cannot be read", tensor.shape)));
    }
    let element_bytes = tensor.dtype.bytes() as usize;
    let runs = tensor.runs();
    // Coverage, one bit per element (runs may be strided, so intervals do not describe them).
    let mut covered = vec![0u64; elements.div_ceil(64) as usize];
    for s in &runs {
        if s.element_step <= 1 {
            for e in s.element as u64..s.element as u64 + s.count as u64 {
                covered[(e / 64) as usize] |= 1 << (e % 64);
            }
        } else {
            for i in 0..s.count {
                let e = s.element_at(0, i);
                covered[(e / 64) as usize] |= 1 << (e % 64);
            }
        }
    }
    let full = |w: usize| if (w as u64 + 1) * 64 <= elements { u64::MAX } else { (1u64 << (elements % 64)) - 1 };
    let gap = covered.iter().enumerate().find(|&(w, &bits)| bits != full(w));
    if let Some(missing) = gap.map(|(w, &bits)| w as u64 * 64 + (!bits).trailing_zeros() as u64) {
        return Err(host_error(tensor, format!("element {missing} is stored on no tile, so the tensor cannot be read")));
    }
    let mut out = vec![0u8; total as usize];
    for (s, &slot) in runs.iter().zip(slots) {
        let from = s.element as usize * element_bytes;
        let len = s.count as usize * element_bytes;
        let source = memories[slot].range(s.address, len);
        if s.element_step <= 1 || s.count == 1 {
            out[from..from + len].copy_from_slice(source);
        } else {
            let step = s.element_step as usize * element_bytes;
            for (i, element) in source.chunks_exact(element_bytes).enumerate() {
                let at = from + i * step;
                out[at..at + element_bytes].copy_from_slice(element);
            }
        }
    }
    Ok(out)
}

/// Read single elements (flat indices) as f32.
pub fn sample(tensor: &HostTensor, slots: &[usize], memories: &[TileMemory], indices: &[u64]) -> Result<Vec<f32>, DeviceError> {
    let runs = tensor.runs();
    let mut order: Vec<(&HostSegment, usize)> = runs.iter().zip(slots.iter().copied()).collect();
    order.sort_by_key(|(s, _)| s.element);
    let element_bytes = tensor.dtype.bytes();
    indices
        .iter()
        .map(|&index| {
            let at = order.partition_point(|(s, _)| s.element as u64 <= index);
            let hit = order[..at].iter().rev().find_map(|(s, slot)| s.position_of(index).map(|p| (s, slot, p)));
            let (segment, slot, position) = hit.ok_or_else(|| host_error(tensor, format!("sampled element {index} is stored on no tile")))?;
            let address = segment.address + position * element_bytes;
            let bytes = memories[*slot].range(address, element_bytes as usize);
            Ok(match tensor.dtype {
                DType::F16 => f16::from_le_bytes([bytes[0], bytes[1]]).to_f32(),
                DType::F32 => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            })
        })
        .collect()
}

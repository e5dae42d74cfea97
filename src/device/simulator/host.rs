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
    Ok((elements, elements * tensor.dtype.bytes() as u64))
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
        if s.rows <= 1 {
            continue;
        }
        let last = s.rows as u64 - 1;
        let what = format!("segment of {} runs on tile {} at {:#x}", s.rows, s.tile, s.address);
        if (s.address_stride as u64) < s.count as u64 * element_bytes || (s.element_stride as u64) < s.count as u64 {
            return Err(host_error(tensor, format!("{what}: its runs overlap (address stride {}, element stride {})", s.address_stride, s.element_stride)));
        }
        if s.element as u64 + last * s.element_stride as u64 + s.count as u64 > elements || s.address as u64 + last * s.address_stride as u64 > u32::MAX as u64 {
            return Err(host_error(tensor, format!("{what} reaches past the tensor's {elements} elements or the address space")));
        }
    }
    // One slot per segment. A segment whose whole span lies in one live allocation has every
    // run there; otherwise each run is checked, so the error names the run that fails.
    let mut found = Vec::with_capacity(tensor.segments.len());
    for s in &tensor.segments {
        let slot = slots.get(s.tile as usize).copied().flatten();
        let count = s.count as u64 * element_bytes;
        let last = s.rows.max(1) as u64 - 1;
        let span = (s.address as u64, s.address as u64 + last * s.address_stride as u64 + count);
        let fits_tensor = s.element as u64 + last * s.element_stride as u64 + s.count as u64 <= elements;
        if let Some(slot) = slot.filter(|_| fits_tensor) {
            if memories[slot].check(span.0, span.1, Need::Tensor, &[step], labels).is_ok() {
                found.push(slot);
                continue;
            }
        }
        for r in 0..s.rows {
            let element = s.element as u64 + r as u64 * s.element_stride as u64;
            let start = s.address as u64 + r as u64 * s.address_stride as u64;
            let end = start + count;
            let what = || format!("segment of elements [{element}, {}) on tile {} at {start:#x}", element + s.count as u64, s.tile);
            if element + s.count as u64 > elements {
                return Err(host_error(tensor, format!("{} reaches past the tensor's {elements} elements", what())));
            }
            let slot = slot.ok_or_else(|| host_error(tensor, format!("{}: the tile is not in the package", what())))?;
            memories[slot]
                .check(start, end, Need::Tensor, &[step], labels)
                .map_err(|problem| host_error(tensor, format!("{}: range [{start:#x}, {end:#x}) {problem}", what())))?;
        }
        // Every run passed although the span did not: runs in different allocations.
        found.push(slot.unwrap_or_default());
    }
    Ok(found)
}

/// Each run of each segment with its memory slot: (slot, tile address, first element, count).
fn runs<'a>(tensor: &'a HostTensor, slots: &'a [usize]) -> impl Iterator<Item = (usize, u32, usize, usize)> + 'a {
    tensor.segments.iter().zip(slots).flat_map(|(s, &slot)| {
        (0..s.rows).map(move |r| (slot, s.address + r * s.address_stride, (s.element + r * s.element_stride) as usize, s.count as usize))
    })
}

/// Write the tensor's row-major bytes into every segment; returns the bytes streamed.
pub fn write(tensor: &HostTensor, slots: &[usize], memories: &mut [TileMemory], bytes: &[u8]) -> u64 {
    let element_bytes = tensor.dtype.bytes() as usize;
    let mut streamed = 0u64;
    for (slot, address, element, count) in runs(tensor, slots) {
        let (from, len) = (element * element_bytes, count * element_bytes);
        memories[slot].range_mut(address, len).copy_from_slice(&bytes[from..from + len]);
        streamed += len as u64;
    }
    streamed
}

/// Gather the tensor's row-major bytes; every element must be covered by some segment.
pub fn read(tensor: &HostTensor, slots: &[usize], memories: &[TileMemory]) -> Result<Vec<u8>, DeviceError> {
    let (elements, total) = tensor_size(tensor)?;
    let element_bytes = tensor.dtype.bytes() as usize;
    let mut covered: Vec<(u64, u64)> = runs(tensor, slots).map(|(_, _, e, c)| (e as u64, (e + c) as u64)).collect();
    covered.sort_unstable();
    let mut reached = 0u64;
    for (start, end) in covered {
        if start > reached {
            break;
        }
        reached = reached.max(end);
    }
    if reached < elements {
        return Err(host_error(tensor, format!("element {reached} is stored on no tile, so the tensor cannot be read")));
    }
    let mut out = vec![0u8; total as usize];
    for (slot, address, element, count) in runs(tensor, slots) {
        let (from, len) = (element * element_bytes, count * element_bytes);
        out[from..from + len].copy_from_slice(memories[slot].range(address, len));
    }
    Ok(out)
}

/// Read single elements (flat indices) as f32.
pub fn sample(tensor: &HostTensor, slots: &[usize], memories: &[TileMemory], indices: &[u64]) -> Result<Vec<f32>, DeviceError> {
    let runs = tensor.runs();
    let slots: Vec<usize> = tensor.segments.iter().zip(slots).flat_map(|(s, &slot)| std::iter::repeat_n(slot, s.rows as usize)).collect();
    let mut order: Vec<(&HostSegment, usize)> = runs.iter().zip(slots).collect();
    order.sort_by_key(|(s, _)| s.element);
    let element_bytes = tensor.dtype.bytes();
    indices
        .iter()
        .map(|&index| {
            let at = order.partition_point(|(s, _)| s.element as u64 <= index);
            let hit = order[..at].iter().rev().find(|(s, _)| index < s.element as u64 + s.count as u64);
            let (segment, slot) = hit.ok_or_else(|| host_error(tensor, format!("sampled element {index} is stored on no tile")))?;
            let address = segment.address + (index - segment.element as u64) as u32 * element_bytes;
            let bytes = memories[*slot].range(address, element_bytes as usize);
            Ok(match tensor.dtype {
                DType::F16 => f16::from_le_bytes([bytes[0], bytes[1]]).to_f32(),
                DType::F32 => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            })
        })
        .collect()
}

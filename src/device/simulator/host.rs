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
    let runs = tensor.runs();
    let mut found = Vec::with_capacity(runs.len());
    for s in &runs {
        let what = format!("segment of elements [{}, {}) on tile {} at {:#x}", s.element, s.element as u64 + s.count as u64, s.tile, s.address);
        if s.element as u64 + s.count as u64 > elements {
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

/// Write the tensor's row-major bytes into every segment; returns the bytes streamed.
pub fn write(tensor: &HostTensor, slots: &[usize], memories: &mut [TileMemory], bytes: &[u8]) -> u64 {
    let element_bytes = tensor.dtype.bytes() as usize;
    let mut streamed = 0u64;
    for (s, &slot) in tensor.runs().iter().zip(slots) {
        let from = s.element as usize * element_bytes;
        let len = s.count as usize * element_bytes;
        memories[slot].range_mut(s.address, len).copy_from_slice(&bytes[from..from + len]);
        streamed += len as u64;
    }
    streamed
}

/// Gather the tensor's row-major bytes; every element must be covered by some segment.
pub fn read(tensor: &HostTensor, slots: &[usize], memories: &[TileMemory]) -> Result<Vec<u8>, DeviceError> {
    let (elements, total) = tensor_size(tensor)?;
    let element_bytes = tensor.dtype.bytes() as usize;
    let runs = tensor.runs();
    let mut covered: Vec<(u64, u64)> = runs.iter().map(|s| (s.element as u64, s.element as u64 + s.count as u64)).collect();
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
    for (s, &slot) in runs.iter().zip(slots) {
        let from = s.element as usize * element_bytes;
        let len = s.count as usize * element_bytes;
        out[from..from + len].copy_from_slice(memories[slot].range(s.address, len));
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

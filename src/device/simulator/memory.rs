//! One tile's SRAM as bytes, its allocation map, and the typed row reads and writes that the
//! kernels, the exchange and the host go through.
//!
//! Loading follows the package's image: every allocated range is first filled with
//! [`POISON`] (an all-ones byte, so any f16 or f32 read of a byte that was never written is a
//! NaN that survives to the outputs), then `zero_fill` ranges are cleared and segments are
//! written. Storage shared by buffers with disjoint lifetimes is refilled with [`POISON`] when
//! each allocation's lifetime starts ([`TileMemory::begin_step`]). Bytes outside every allocation stay zero and are never read: every access is
//! checked against the allocation map before the program runs ([`TileMemory::check`]).
//!
//! This module must not interpret vertex calls or exchange tables: it knows ranges and bytes.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::f16;
use ipuq_queries::package::{Allocation, AllocationKind, Operand, TileImage};
use ipuq_queries::target::Target;

use crate::device::DeviceError;

/// Fill pattern of allocated bytes that nothing wrote: 0xFFFF is an f16 NaN, 0xFFFFFFFF an
/// f32 NaN.
pub const POISON: u8 = 0xFF;

/// What an access needs from the allocation that holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// f16 tensor data.
    Data,
    /// AMP fp32 partials.
    Partials,
    /// Any tensor storage (data or partials): copies, exchange, host transfers.
    Tensor,
}

impl Need {
    fn admits(self, kind: AllocationKind) -> bool {
        match self {
            Need::Data => kind == AllocationKind::Data,
            Need::Partials => kind == AllocationKind::Partials,
            Need::Tensor => kind != AllocationKind::Code,
        }
    }
}

pub struct TileMemory {
    pub tile: u32,
    base: u32,
    bytes: Vec<u8>,
    /// Sorted by start; ranges may overlap (storage reuse across lifetimes).
    allocations: Vec<Allocation>,
}

impl TileMemory {
    /// Build a tile's memory from its image, checking the allocation rules of the target.
    pub fn load(target: &Target, image: &TileImage, shared: &[Vec<u8>], labels: &[String]) -> Result<TileMemory, DeviceError> {
        let m = &target.memory;
        let tile = image.tile;
        let fail = |message: String| DeviceError::Load { tile, message };
        let label = |a: &Allocation| labels.get(a.label as usize).map(String::as_str).unwrap_or("?");
        let mut allocations = image.allocations.clone();
        allocations.sort_by_key(|a| (a.start, a.end));
        for a in &allocations {
            let what = format!("allocation `{}` [{:#x}, {:#x}) ({:?})", label(a), a.start, a.end, a.kind);
            if a.label as usize >= labels.len() {
                return Err(fail(format!("{what} has label index {} but the package has {} labels", a.label, labels.len())));
            }
            if a.start > a.end || a.start < m.base || a.end > m.loader_limit {
                return Err(fail(format!("{what} lies outside the loadable memory [{:#x}, {:#x})", m.base, m.loader_limit)));
            }
            if a.kind == AllocationKind::Code && a.end > m.instruction_fetch_limit {
                return Err(fail(format!("{what} holds code above the instruction fetch limit {:#x}", m.instruction_fetch_limit)));
            }
            if a.kind == AllocationKind::Partials && (a.start < m.interleaved_start || a.start % m.partial_alignment != 0) {
                return Err(fail(format!(
                    "{what} holds AMP partials, which need interleaved memory (from {:#x}) and {}-byte alignment",
                    m.interleaved_start, m.partial_alignment
                )));
            }
        }
        let mut memory = TileMemory { tile, base: m.base, bytes: vec![0; m.size as usize], allocations };
        // Allocations whose lifetime starts later are filled when it starts (`begin_step`):
        // their pages are not touched before then.
        for a in memory.allocations.clone() {
            if a.first_step == 0 || a.kind == AllocationKind::Code {
                memory.range_mut(a.start, (a.end - a.start) as usize).fill(POISON);
            }
        }
        for z in &image.zero_fill {
            if z.start > z.end || z.start < m.base || z.end > m.loader_limit {
                return Err(fail(format!("zero fill [{:#x}, {:#x}) lies outside the loadable memory", z.start, z.end)));
            }
            memory.range_mut(z.start, (z.end - z.start) as usize).fill(0);
        }
        let mut segments: Vec<(u32, &[u8])> = image.segments.iter().map(|s| (s.address, s.bytes.as_slice())).collect();
        for s in &image.shared {
            let bytes = shared.get(s.index as usize).ok_or_else(|| fail(format!("shared segment {} named at {:#x}, but the package has {}", s.index, s.address, shared.len())))?;
            segments.push((s.address, bytes.as_slice()));
        }
        for (address, bytes) in segments {
            let end = address as u64 + bytes.len() as u64;
            if address < m.base || end > m.loader_limit as u64 {
                return Err(fail(format!("segment [{address:#x}, {end:#x}) lies outside the loadable memory [{:#x}, {:#x})", m.base, m.loader_limit)));
            }
            memory.range_mut(address, bytes.len()).copy_from_slice(bytes);
        }
        Ok(memory)
    }

    /// `Ok` when `[start, end)` lies inside one allocation whose kind `need` admits and that is
    /// live at every step of `steps` (no liveness requirement when `steps` is empty);
    /// otherwise the problem, naming the allocation involved and the step.
    pub fn check(&self, start: u64, end: u64, need: Need, steps: &[u32], labels: &[String]) -> Result<(), String> {
        if start >= end {
            return Ok(());
        }
        let inside = |a: &&Allocation| a.start as u64 <= start && end <= a.end as u64;
        let live = |a: &&Allocation| steps.iter().all(|&s| a.live_at(s));
        if self.allocations.iter().filter(inside).any(|a| need.admits(a.kind) && live(&a)) {
            return Ok(());
        }
        let label = |a: &Allocation| labels.get(a.label as usize).cloned().unwrap_or_else(|| "?".into());
        if let Some(a) = self.allocations.iter().filter(inside).find(|a| need.admits(a.kind)) {
            let step = steps.iter().find(|&&s| !a.live_at(s)).copied().unwrap_or_default();
            return Err(format!(
                "lies in buffer `{}` [{:#x}, {:#x}), which is live at steps {}..={} but not at step {step}: no live buffer owns these bytes",
                label(a),
                a.start,
                a.end,
                a.first_step,
                a.last_step
            ));
        }
        if let Some(a) = self.allocations.iter().find(inside) {
            return Err(format!("lies in {:?} allocation `{}` [{:#x}, {:#x}) but needs {:?} storage", a.kind, label(a), a.start, a.end, need));
        }
        let holder = self.allocations.iter().find(|a| a.start as u64 <= start && start < a.end as u64);
        match holder {
            Some(a) => Err(format!("runs past the end of allocation `{}` [{:#x}, {:#x})", label(a), a.start, a.end)),
            None => Err("lies in no allocation".into()),
        }
    }

    /// Refill with [`POISON`] every allocation whose lifetime starts at `step` (> 0; step 0's
    /// allocations were filled at load, before the host wrote them): storage that is reused
    /// never shows the previous owner's bytes.
    pub fn begin_step(&mut self, step: u32) {
        if step == 0 {
            return;
        }
        for i in 0..self.allocations.len() {
            let a = self.allocations[i];
            if a.first_step == step && a.kind != AllocationKind::Code && a.first_step <= a.last_step {
                self.range_mut(a.start, (a.end - a.start) as usize).fill(POISON);
            }
        }
    }

    /// The `len` bytes from `address`. An empty range is empty wherever it points: a call's
    /// empty operand (a zero dimension) is not checked against the tile's memory
    /// (`compute::check_set` skips empty extents), so its address may be anything.
    pub fn range(&self, address: u32, len: usize) -> &[u8] {
        if len == 0 {
            return &[];
        }
        let offset = (address - self.base) as usize;
        &self.bytes[offset..offset + len]
    }

    pub fn range_mut(&mut self, address: u32, len: usize) -> &mut [u8] {
        if len == 0 {
            return &mut [];
        }
        let offset = (address - self.base) as usize;
        &mut self.bytes[offset..offset + len]
    }

    /// Read `rows` x `cols` f16 elements into `out` (row-major, contiguous), as f32.
    pub fn read_f16(&self, op: Operand, rows: u32, cols: u32, bits: &mut Vec<u16>, out: &mut Vec<f32>) {
        let cols = cols as usize;
        bits.clear();
        bits.resize(rows as usize * cols, 0);
        // Row by row into a sized buffer (a loop the compiler turns into vector moves).
        for (r, out_row) in bits.chunks_exact_mut(cols.max(1)).enumerate() {
            let row = self.range(row_address(op, r as u32, 2), cols * 2);
            for (b, c) in out_row.iter_mut().zip(row.chunks_exact(2)) {
                *b = u16::from_le_bytes([c[0], c[1]]);
            }
        }
        out.clear();
        out.resize(bits.len(), 0.0);
        let halves: &[f16] = bits.reinterpret_cast();
        halves.convert_to_f32_slice(out);
    }

    /// Read `rows` x `cols` f32 elements into `out` (row-major, contiguous).
    pub fn read_f32(&self, op: Operand, rows: u32, cols: u32, out: &mut Vec<f32>) {
        let cols = cols as usize;
        out.clear();
        out.resize(rows as usize * cols, 0.0);
        for (r, out_row) in out.chunks_exact_mut(cols.max(1)).enumerate() {
            let row = self.range(row_address(op, r as u32, 4), cols * 4);
            for (v, c) in out_row.iter_mut().zip(row.chunks_exact(4)) {
                *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }

    /// Write `values` (row-major `rows` x `cols`) as f16, rounding to nearest even.
    pub fn write_f16(&mut self, op: Operand, rows: u32, cols: u32, values: &[f32], halves: &mut Vec<f16>) {
        if rows == 0 || cols == 0 {
            // An empty operand: nothing to write, wherever it points (see `range`).
            return;
        }
        halves.clear();
        halves.resize(values.len(), f16::ZERO);
        halves.convert_from_f32_slice(values);
        let cols = cols as usize;
        for r in 0..rows {
            let row = self.range_mut(row_address(op, r, 2), cols * 2);
            let source = &halves[r as usize * cols..(r as usize + 1) * cols];
            for (out, h) in row.chunks_exact_mut(2).zip(source) {
                out.copy_from_slice(&h.to_le_bytes());
            }
        }
    }

    /// Write `values` (row-major `rows` x `cols`) as f32.
    pub fn write_f32(&mut self, op: Operand, rows: u32, cols: u32, values: &[f32]) {
        if rows == 0 || cols == 0 {
            // An empty operand: nothing to write, wherever it points (see `range`).
            return;
        }
        let cols = cols as usize;
        for r in 0..rows {
            let row = self.range_mut(row_address(op, r, 4), cols * 4);
            let source = &values[r as usize * cols..(r as usize + 1) * cols];
            for (out, v) in row.chunks_exact_mut(4).zip(source) {
                out.copy_from_slice(&v.to_le_bytes());
            }
        }
    }

    /// Copy `rows` x `cols` elements of `element_bytes` each between two operands of this
    /// tile, reading everything before writing anything.
    pub fn copy(&mut self, input: Operand, output: Operand, rows: u32, cols: u32, element_bytes: u32, staging: &mut Vec<u8>) {
        if rows == 0 || cols == 0 {
            // An empty operand: nothing to write, wherever it points (see `range`).
            return;
        }
        let row_bytes = (cols * element_bytes) as usize;
        staging.clear();
        for r in 0..rows {
            staging.extend_from_slice(self.range(row_address(input, r, element_bytes), row_bytes));
        }
        for r in 0..rows {
            let at = r as usize * row_bytes;
            let target = self.range_mut(row_address(output, r, element_bytes), row_bytes);
            target.copy_from_slice(&staging[at..at + row_bytes]);
        }
    }
}

/// Raw views of every tile's bytes, for copies between tiles that run in parallel
/// ([`TileMemory::raw_parts`]).
pub struct RawTiles<'a> {
    /// Per slot: the first byte, the address it holds, the length.
    parts: Vec<(*mut u8, u32, usize)>,
    _memories: std::marker::PhantomData<&'a mut [TileMemory]>,
}

// SAFETY: `RawTiles` only hands out copies through `copy`, whose callers guarantee that no
// byte is written by one thread while another reads or writes it.
unsafe impl Sync for RawTiles<'_> {}

impl TileMemory {
    /// Raw views of all tiles' bytes, holding the exclusive borrow of `memories` while in use.
    pub fn raw_parts(memories: &mut [TileMemory]) -> RawTiles<'_> {
        let parts = memories.iter_mut().map(|m| (m.bytes.as_mut_ptr(), m.base, m.bytes.len())).collect();
        RawTiles { parts, _memories: std::marker::PhantomData }
    }
}

impl RawTiles<'_> {
    /// Copy `len` bytes from `source_address` of slot `source` to `address` of slot `target`.
    /// Both ranges are bounds-checked (a panic, not undefined behaviour, if they are not inside
    /// their tiles).
    ///
    /// # Safety
    /// The two ranges must not overlap, and while the copy runs no other thread may write
    /// either range nor read the target range.
    pub unsafe fn copy(&self, source: usize, source_address: u32, target: usize, address: u32, len: usize) {
        let at = |(pointer, base, size): (*mut u8, u32, usize), address: u32| {
            let offset = address.checked_sub(base).map(|o| o as usize).filter(|&o| o.checked_add(len).is_some_and(|end| end <= size));
            let offset = offset.unwrap_or_else(|| panic!("exchange copy of {len} bytes at {address:#x} lies outside the tile's memory"));
            // SAFETY: `offset + len` is within the tile's allocation, checked just above.
            unsafe { pointer.add(offset) }
        };
        let from = at(self.parts[source], source_address);
        let to = at(self.parts[target], address);
        // SAFETY: both ranges lie inside live allocations (checked above) and the caller
        // guarantees they do not overlap and that no other thread races with them.
        unsafe { std::ptr::copy_nonoverlapping(from, to, len) };
    }
}

/// Address of row `r` of a strided operand with elements of `element_bytes`.
pub fn row_address(op: Operand, r: u32, element_bytes: u32) -> u32 {
    // Wrapping: for a checked operand the sum lies within tile memory (its extent, taken in 64
    // bits, was checked); for an empty one it is never used (`range` of nothing is empty).
    op.address.wrapping_add(r.wrapping_mul(op.row_stride).wrapping_mul(element_bytes))
}

/// The byte range `[start, end)` a `rows` x `cols` strided operand touches (empty when either
/// dimension is zero), in 64 bits so that a hostile package cannot overflow it.
pub fn extent(op: Operand, rows: u32, cols: u32, element_bytes: u32) -> (u64, u64) {
    let start = op.address as u64;
    if rows == 0 || cols == 0 {
        return (start, start);
    }
    // Saturating: rows and a row stride near 2^32 with 4-byte elements exceed 64 bits; such an
    // extent ends at u64::MAX, past any tile's memory, and is refused as lying outside it.
    let elements = (rows as u64 - 1).saturating_mul(op.row_stride as u64).saturating_add(cols as u64);
    (start, start.saturating_add(elements.saturating_mul(element_bytes as u64)))
}

//! Tile images are the program: the runtime header, the vertex-state records, and the codec
//! that the compiler writes them with and the device reads them back with.
//!
//! A tile's code allocation holds, from its start, little-endian 32-bit words:
//! - the runtime header (`RUNTIME_HEADER_BYTES`): magic `IPUT`, tile, program steps, host
//!   records, compute sets, vertex-state bytes, table bindings, table bytes, then zeros;
//! - the host-exchange records (`HOST_RECORD_BYTES` each; the host's own tables drive the
//!   transfers, the device does not read these);
//! - the vertex state: per compute set the tile takes part in, a record `[set index, segment
//!   offset]`; then the sets' base lists back to back, in record order (every operand's
//!   address, in call order and the order of `VertexCall::operands`); then the distinct
//!   segments, each `[call count]` and per call `kind | scalars << 8 | operands << 16`, the
//!   scalar words (shapes, flags, f32 bits of factors) and each operand's row stride. A
//!   segment holds no address, so the same compute set of repeated layers (the same calls
//!   over other buffers) shares one, each set supplying its own addresses; its size is known
//!   before placement;
//! - the exchange tables (`tables::encode_tile`: bindings, then base lists, then run-descriptor
//!   segments with addresses relative to their buffers' bases).
//!
//! The device decodes all of it from tile memory once per load (`decode_program`); any
//! malformed byte is an error naming the tile, the address and the record, never a panic.
//! A new vertex kind needs one arm in `scalars` and one in `decode_call`.

use crate::emit::{HOST_RECORD_BYTES, RUNTIME_HEADER_BYTES};
use crate::ir::DType;
use crate::package::{Addend, AddressRange, AllocationKind, Broadcast, ComputeSet, Operand, Package, Segment, TileImage, VertexCall};
use crate::tables::{self, PackedTile};

/// "IPUT", the first word of every runtime header.
pub const IMAGE_MAGIC: u32 = u32::from_le_bytes(*b"IPUT");
/// Bytes of a compute-set record (set index, segment offset) in the vertex state.
pub const SET_RECORD_BYTES: u32 = 8;

/// The runtime header's fields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub tile: u32,
    pub steps: u32,
    pub host_records: u32,
    pub sets: u32,
    pub vertex_bytes: u32,
    pub bindings: u32,
    pub table_bytes: u32,
}

impl Header {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(RUNTIME_HEADER_BYTES as usize);
        for w in [IMAGE_MAGIC, self.tile, self.steps, self.host_records, self.sets, self.vertex_bytes, self.bindings, self.table_bytes] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.resize(RUNTIME_HEADER_BYTES as usize, 0);
        out
    }

    /// Byte offset of the tile number in an encoded header (the word after the magic).
    const TILE_OFFSET: usize = 4;

    /// The header at the start of `code` (the code allocation's bytes, at `address`).
    pub fn decode(code: &[u8], address: u32) -> Result<Header, String> {
        if code.len() < RUNTIME_HEADER_BYTES as usize {
            return Err(format!("code allocation at {address:#x} holds {} bytes, fewer than the {RUNTIME_HEADER_BYTES}-byte runtime header", code.len()));
        }
        let w = |i: usize| u32::from_le_bytes(code[i * 4..i * 4 + 4].try_into().unwrap());
        if w(0) != IMAGE_MAGIC {
            return Err(format!("runtime header at {address:#x}: magic {:#010x} is not `IPUT` ({IMAGE_MAGIC:#010x})", w(0)));
        }
        Ok(Header { tile: w(1), steps: w(2), host_records: w(3), sets: w(4), vertex_bytes: w(5), bindings: w(6), table_bytes: w(7) })
    }

    /// Offset of the vertex state from the code start.
    pub fn vertex_offset(&self) -> u64 {
        RUNTIME_HEADER_BYTES as u64 + self.host_records as u64 * HOST_RECORD_BYTES as u64
    }

    /// Offset of the exchange tables from the code start.
    pub fn table_offset(&self) -> u64 {
        self.vertex_offset() + self.vertex_bytes as u64
    }

    /// Bytes the header says the code holds.
    pub fn end(&self) -> u64 {
        self.table_offset() + self.table_bytes as u64
    }
}

/// A tile's program as its image holds it: its compute sets and its exchange tables, one
/// (phase, runs) per binding.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TileProgram {
    pub compute_sets: Vec<ComputeSet>,
    pub tables: Vec<(u32, PackedTile)>,
}

/// A call's kind and scalar words (its operands are `VertexCall::operands`).
fn scalars<O>(call: &VertexCall<O>) -> (u32, Vec<u32>) {
    match call {
        VertexCall::MatMul { m, k, n, a_panel, b_transposed, c_panel, partials, add, .. } => {
            (1, vec![*m, *k, *n, *a_panel, *c_panel, *b_transposed as u32 | (*partials as u32) << 1 | addend_mode(add) << 2])
        }
        VertexCall::Reduce { rows, cols, add, .. } => (2, vec![*rows, *cols, addend_mode(add)]),
        VertexCall::Gelu { rows, cols, .. } => (3, vec![*rows, *cols]),
        VertexCall::Scale { rows, cols, factor, .. } => (4, vec![*rows, *cols, factor.to_bits()]),
        VertexCall::Add { rows, cols, .. } => (5, vec![*rows, *cols]),
        VertexCall::Softmax { rows, cols, scale, input_panel, .. } => (6, vec![*rows, *cols, scale.to_bits(), *input_panel]),
        VertexCall::Copy { rows, cols, dtype, .. } => (7, vec![*rows, *cols, dtype.bytes()]),
        VertexCall::CopyWords { rows, cols, dtype, .. } => (14, vec![*rows, *cols, dtype.bytes()]),
        VertexCall::CopyHalves { rows, cols, .. } => (15, vec![*rows, *cols]),
        VertexCall::GeluErf { rows, cols, .. } => (8, vec![*rows, *cols]),
        VertexCall::BiasAdd { rows, cols, .. } => (9, vec![*rows, *cols]),
        VertexCall::LayerNorm { rows, cols, eps, .. } => (10, vec![*rows, *cols, eps.to_bits()]),
        VertexCall::Transpose { rows, cols, .. } => (11, vec![*rows, *cols]),
        VertexCall::LayerNormStatistics { rows, cols, .. } => (12, vec![*rows, *cols]),
        VertexCall::LayerNormSegment { rows, cols, segments, segment, eps, .. } => (13, vec![*rows, *cols, *segments, *segment, eps.to_bits()]),
    }
}

/// The epilogue addend's broadcast in a record (its operand is the call's last): 0 none, 1 row,
/// 2 column, 3 a whole block, 4 an fp32 factor per row.
fn addend_mode<O>(add: &Option<Addend<O>>) -> u32 {
    match add.as_ref().map(|x| x.broadcast) {
        None => 0,
        Some(Broadcast::Row) => 1,
        Some(Broadcast::Column) => 2,
        Some(Broadcast::Full) => 3,
        Some(Broadcast::RowScale) => 4,
    }
}

/// The addend of mode `mode` whose operand is `operand`.
fn addend(mode: u32, operand: Option<Operand>) -> Result<Option<Addend<Operand>>, String> {
    let broadcast = match mode {
        0 => return Ok(None),
        1 => Broadcast::Row,
        2 => Broadcast::Column,
        3 => Broadcast::Full,
        4 => Broadcast::RowScale,
        m => return Err(format!("epilogue addend mode {m} (only 0-4)")),
    };
    let operand = operand.ok_or_else(|| "an epilogue addend without its operand".to_string())?;
    Ok(Some(Addend { operand, broadcast }))
}

/// The call a record describes, or what is wrong with it.
fn decode_call(kind: u32, s: &[u32], o: &[Operand]) -> Result<VertexCall, String> {
    let shape = |ns: usize, no: usize| -> Result<(), String> {
        if s.len() == ns && o.len() == no {
            Ok(())
        } else {
            Err(format!("a kind-{kind} record carries {} scalar words and {} operands, not {ns} and {no}", s.len(), o.len()))
        }
    };
    let unary = |make: fn(u32, u32, Operand, Operand) -> VertexCall| -> Result<VertexCall, String> {
        shape(2, 2)?;
        Ok(make(s[0], s[1], o[0], o[1]))
    };
    Ok(match kind {
        1 => {
            if s.len() != 6 {
                return Err(format!("a kind-1 record carries {} scalar words, not 6", s.len()));
            }
            if s[5] > 31 {
                return Err(format!("matrix-product flags {:#x} set bits other than b_transposed (1), partials (2) and the addend mode (4, 8, 16)", s[5]));
            }
            let mode = s[5] >> 2;
            shape(6, 3 + (mode != 0) as usize)?;
            let add = addend(mode, o.get(3).copied())?;
            VertexCall::MatMul { m: s[0], k: s[1], n: s[2], a: o[0], a_panel: s[3], b: o[1], b_transposed: s[5] & 1 != 0, c: o[2], c_panel: s[4], partials: s[5] & 2 != 0, add }
        }
        2 => {
            let with_addend = s.get(2).is_some_and(|&m| m != 0) as usize;
            if s.len() != 3 || o.len() < 2 + with_addend {
                return Err(format!("a reduce record carries {} scalar words and {} operands, not 3 and at least {}", s.len(), o.len(), 2 + with_addend));
            }
            let (rest, add) = if with_addend == 1 { (&o[..o.len() - 1], addend(s[2], o.last().copied())?) } else { (o, None) };
            VertexCall::Reduce { rows: s[0], cols: s[1], parts: rest[..rest.len() - 1].to_vec(), out: rest[rest.len() - 1], add }
        }
        3 => unary(|rows, cols, input, output| VertexCall::Gelu { rows, cols, input, output })?,
        4 => {
            shape(3, 2)?;
            VertexCall::Scale { rows: s[0], cols: s[1], factor: f32::from_bits(s[2]), input: o[0], output: o[1] }
        }
        5 => {
            shape(2, 3)?;
            VertexCall::Add { rows: s[0], cols: s[1], a: o[0], b: o[1], output: o[2] }
        }
        6 => {
            // A third operand: the row reciprocals of a deferred normalisation.
            shape(4, o.len().clamp(2, 3))?;
            VertexCall::Softmax { rows: s[0], cols: s[1], scale: f32::from_bits(s[2]), input: o[0], input_panel: s[3], output: o[1], reciprocals: o.get(2).copied() }
        }
        7 | 14 => {
            shape(3, 2)?;
            let dtype = match s[2] {
                2 => DType::F16,
                4 => DType::F32,
                b => return Err(format!("copy of {b}-byte elements (only 2 and 4)")),
            };
            let (rows, cols, input, output) = (s[0], s[1], o[0], o[1]);
            if kind == 7 {
                VertexCall::Copy { rows, cols, dtype, input, output }
            } else {
                VertexCall::CopyWords { rows, cols, dtype, input, output }
            }
        }
        8 => unary(|rows, cols, input, output| VertexCall::GeluErf { rows, cols, input, output })?,
        9 => {
            shape(2, 3)?;
            VertexCall::BiasAdd { rows: s[0], cols: s[1], input: o[0], bias: o[1], output: o[2] }
        }
        10 => {
            shape(3, 4)?;
            VertexCall::LayerNorm { rows: s[0], cols: s[1], eps: f32::from_bits(s[2]), input: o[0], gamma: o[1], beta: o[2], output: o[3] }
        }
        11 => unary(|rows, cols, input, output| VertexCall::Transpose { rows, cols, input, output })?,
        12 => unary(|rows, cols, input, statistics| VertexCall::LayerNormStatistics { rows, cols, input, statistics })?,
        13 => {
            shape(5, 6)?;
            if s[3] >= s[2] {
                return Err(format!("a LayerNorm segment numbered {} of {} segments", s[3], s[2]));
            }
            VertexCall::LayerNormSegment { rows: s[0], cols: s[1], segments: s[2], segment: s[3], eps: f32::from_bits(s[4]), input: o[0], statistics: o[1], others: o[2], gamma: o[3], beta: o[4], output: o[5] }
        }
        15 => unary(|rows, cols, input, output| VertexCall::CopyHalves { rows, cols, input, output })?,
        _ => return Err(format!("unknown vertex kind {kind}")),
    })
}

/// A compute set's segment on a tile, as words: its call count, then per call
/// `kind | scalars << 8 | operands << 16`, the scalar words and each operand's row stride.
/// Everything of the calls but their operands' addresses (`stride` gives an operand's row
/// stride), so that the same compute set of repeated layers, whose calls differ only in where
/// their buffers lie, has the same segment: before placement as after it.
pub fn segment_words<'a, O: 'a>(calls: impl IntoIterator<Item = &'a VertexCall<O>>, stride: impl Fn(&O) -> u32) -> (Vec<u32>, u32) {
    let mut words = vec![0u32];
    let mut operands = 0u32;
    for call in calls {
        let (kind, s) = scalars(call);
        let o = call.operands();
        words[0] += 1;
        words.push(kind | (s.len() as u32) << 8 | (o.len() as u32) << 16);
        words.extend_from_slice(&s);
        words.extend(o.iter().map(|x| stride(x)));
        operands += o.len() as u32;
    }
    (words, operands)
}

/// Bytes of a tile's vertex state whose compute sets hold these segments (`segment_words`:
/// the words and the operand count of each set, in set order): a record per set, a base per
/// operand and each distinct segment once. Exact before placement, since none of it depends
/// on addresses.
pub fn vertex_state_bytes(sets: &[(Vec<u32>, u32)]) -> u32 {
    let mut distinct: std::collections::HashSet<&[u32]> = std::collections::HashSet::new();
    let mut bytes = 0u32;
    for (words, operands) in sets {
        bytes += SET_RECORD_BYTES + 4 * operands;
        if distinct.insert(words) {
            bytes += 4 * words.len() as u32;
        }
    }
    bytes
}

fn to_bytes(words: &[u32], out: &mut Vec<u8>) {
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

/// A tile's vertex state: a record per compute set (set index, segment offset), then the
/// sets' base lists back to back in record order (each operand's address, in call order; a
/// list's length is its segment's operand count), then the distinct segments
/// (`segment_words`); offsets from the start of the vertex state. Sets whose segments are
/// equal (the same compute set of repeated layers) share one.
pub fn encode_vertex_state(sets: &[ComputeSet]) -> Vec<u8> {
    let mut segments: Vec<Vec<u32>> = Vec::new();
    let mut index: std::collections::HashMap<Vec<u32>, usize> = std::collections::HashMap::new();
    let mut records: Vec<(u32, usize)> = Vec::with_capacity(sets.len());
    let mut bases: Vec<u32> = Vec::new();
    for set in sets {
        let (words, _) = segment_words(&set.calls, |o: &Operand| o.row_stride);
        let i = tables::intern(&mut segments, &mut index, words);
        bases.extend(set.calls.iter().flat_map(|c| c.operands().into_iter().map(|o| o.address)));
        records.push((set.index, i));
    }
    let mut at = sets.len() as u32 * SET_RECORD_BYTES + 4 * bases.len() as u32;
    let segment_offsets: Vec<u32> = segments
        .iter()
        .map(|s| {
            let o = at;
            at += 4 * s.len() as u32;
            o
        })
        .collect();
    let mut out = Vec::with_capacity(at as usize);
    for (set, segment) in &records {
        to_bytes(&[*set, segment_offsets[*segment]], &mut out);
    }
    to_bytes(&bases, &mut out);
    for segment in &segments {
        to_bytes(segment, &mut out);
    }
    out
}

/// Little-endian words of a byte range at `address`, read with errors naming the address.
struct Words<'a> {
    bytes: &'a [u8],
    at: usize,
    address: u32,
}

impl Words<'_> {
    fn here(&self) -> u32 {
        self.address.wrapping_add(self.at as u32)
    }
    fn next(&mut self, what: &str) -> Result<u32, String> {
        let Some(b) = self.bytes.get(self.at..self.at + 4) else {
            return Err(format!("{what} at {:#x} runs past the end of the region ({} bytes from {:#x})", self.here(), self.bytes.len(), self.address));
        };
        self.at += 4;
        Ok(u32::from_le_bytes(b.try_into().unwrap()))
    }
}

/// Decode `sets` compute sets from the vertex state `bytes` at `address`
/// (`encode_vertex_state`): every byte must belong to the records, the base lists or a
/// segment, each once. Errors name the address and the record; segments that several sets
/// share are decoded once.
pub fn decode_vertex_state(bytes: &[u8], address: u32, sets: u32) -> Result<Vec<ComputeSet>, String> {
    let records = sets as u64 * SET_RECORD_BYTES as u64;
    if records > bytes.len() as u64 {
        return Err(format!("compute-set records at {address:#x}: {sets} records need {records} bytes, the vertex state holds {}", bytes.len()));
    }
    let word = |at: u64| -> u32 { u32::from_le_bytes(bytes[at as usize..at as usize + 4].try_into().unwrap()) };
    // A segment: per call the address of its record, its kind, scalar words and operand row
    // strides; and the operands of all its calls.
    type Call = (u32, u32, Vec<u32>, Vec<u32>);
    let mut segments: std::collections::HashMap<u32, (Vec<Call>, u64, u64)> = std::collections::HashMap::new();
    let mut read: Vec<(u32, u32)> = Vec::with_capacity(sets as usize);
    let mut seen: std::collections::HashSet<u32> = std::collections::HashSet::new();
    let mut operands = 0u64;
    // Bytes of the distinct segments decoded so far: they must lie apart after the records,
    // so more than that means overlapping segments (refused before decoding more, which keeps
    // the work linear in the bytes however many records point into them).
    let mut decoded_bytes = 0u64;
    for i in 0..sets {
        let at = i as u64 * SET_RECORD_BYTES as u64;
        let (index, offset) = (word(at), word(at + 4));
        let fail = |m: String| format!("compute-set record {i} (compute set {index}) at {:#x}: {m}", address as u64 + at);
        if !seen.insert(index) {
            return Err(fail(format!("compute set {index} appears twice")));
        }
        if (offset as u64) < records {
            return Err(fail(format!("segment offset {offset} points into the {sets} records")));
        }
        if !segments.contains_key(&offset) {
            let mut r = Words { bytes, at: offset as usize, address };
            let calls = r.next("segment header").map_err(fail)?;
            let mut decoded = Vec::new();
            let mut count = 0u64;
            for c in 0..calls {
                let here = r.here();
                let call_fail = |m: String| fail(format!("vertex record {c} of compute set {index} at {here:#x}: {m}"));
                let head = r.next("vertex record").map_err(call_fail)?;
                let (kind, ns, no) = (head & 0xFF, (head >> 8) & 0xFF, head >> 16);
                let mut s = Vec::with_capacity(ns as usize);
                for _ in 0..ns {
                    s.push(r.next("scalar word").map_err(call_fail)?);
                }
                let mut strides = Vec::new();
                for _ in 0..no {
                    strides.push(r.next("operand row stride").map_err(call_fail)?);
                }
                if no == 0 {
                    return Err(call_fail("a call without operands".into()));
                }
                count += no as u64;
                decoded.push((here, kind, s, strides));
            }
            decoded_bytes += r.at as u64 - offset as u64;
            if decoded_bytes > bytes.len() as u64 - records {
                return Err(fail(format!("its segment at offset {offset} overlaps another: the distinct segments decoded so far take {decoded_bytes} bytes of the {} after the records", bytes.len() as u64 - records)));
            }
            segments.insert(offset, (decoded, count, r.at as u64));
        }
        operands += segments[&offset].1;
        read.push((index, offset));
    }
    // The base lists follow the records, one per record in record order, then the segments,
    // back to back, each once, to the end.
    let lists_end = records + 4 * operands;
    if lists_end > bytes.len() as u64 {
        return Err(format!("vertex state at {address:#x}: its {sets} compute sets' calls have {operands} operands, whose base addresses need {} bytes after the records, of {}", 4 * operands, bytes.len() as u64 - records));
    }
    let mut spans: Vec<(u64, u64)> = segments.iter().map(|(&o, s)| (o as u64, s.2)).collect();
    if let Err((from, to)) = tables::spans_cover(&mut spans, lists_end, bytes.len() as u64) {
        return Err(format!("vertex state at {address:#x}: bytes {from} to {to} of {} do not hold exactly the base lists ({records} to {lists_end}) and the segments", bytes.len()));
    }
    let mut next = records;
    let mut out: Vec<ComputeSet> = Vec::with_capacity(sets as usize);
    for (i, (index, offset)) in read.into_iter().enumerate() {
        let segment = &segments[&offset].0;
        let mut calls = Vec::with_capacity(segment.len());
        for (c, (here, kind, s, strides)) in segment.iter().enumerate() {
            let mut o = Vec::with_capacity(strides.len());
            for &row_stride in strides {
                o.push(Operand { address: word(next), row_stride });
                next += 4;
            }
            let record = address as u64 + i as u64 * SET_RECORD_BYTES as u64;
            calls.push(decode_call(*kind, s, &o).map_err(|m| format!("compute-set record {i} (compute set {index}) at {record:#x}: vertex record {c} of compute set {index} at {here:#x}: {m}"))?);
        }
        out.push(ComputeSet { index, calls });
    }
    Ok(out)
}

/// The header, host records, vertex state and tables of a tile, as its code begins.
pub fn encode_code(tile: u32, steps: u32, host_records: &[u8], sets: &[ComputeSet], tables: &[u8], bindings: u32) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let vertex = encode_vertex_state(sets);
    let header = Header {
        tile,
        steps,
        host_records: host_records.len() as u32 / HOST_RECORD_BYTES,
        sets: sets.len() as u32,
        vertex_bytes: vertex.len() as u32,
        bindings,
        table_bytes: tables.len() as u32,
    };
    let mut head = header.encode();
    head.extend_from_slice(host_records);
    (head, vertex, tables.to_vec())
}

/// Write `tile` into the runtime header at the start of `code` (an image built once for every
/// tile with the same content gets each tile's number at assembly). `code` starts with a header.
pub fn stamp_tile(code: &mut [u8], tile: u32) {
    code[Header::TILE_OFFSET..Header::TILE_OFFSET + 4].copy_from_slice(&tile.to_le_bytes());
}

/// Decode a tile's program from its code bytes (`code`, the code allocation's contents from
/// `address`), for a package of `steps` program steps.
pub fn decode_program(code: &[u8], address: u32, tile: u32, steps: u32) -> Result<(Header, TileProgram), String> {
    let header = Header::decode(code, address)?;
    if header.tile != tile {
        return Err(format!("runtime header at {address:#x} is tile {}'s", header.tile));
    }
    if header.steps != steps {
        return Err(format!("runtime header at {address:#x} says the program has {} steps, the package has {steps}", header.steps));
    }
    if header.end() > code.len() as u64 {
        return Err(format!("runtime header at {address:#x} says its code runs {} bytes, past the end of its {}-byte code allocation", header.end(), code.len()));
    }
    let (v, t) = (header.vertex_offset() as usize, header.table_offset() as usize);
    let vertex_address = address.wrapping_add(v as u32);
    let compute_sets = decode_vertex_state(&code[v..t], vertex_address, header.sets)?;
    let tables = tables::decode_tile(&code[t..header.end() as usize], address.wrapping_add(t as u32), tile, header.bindings)?;
    Ok((header, TileProgram { compute_sets, tables }))
}

/// The tile's code allocation as a range, if it has exactly one.
pub fn code_range(image: &TileImage) -> Result<(u32, u32), String> {
    let mut code = image.allocations.iter().filter(|a| a.kind == AllocationKind::Code);
    match (code.next(), code.next()) {
        (Some(a), None) => Ok((a.start, a.end)),
        (None, _) => Err("no code allocation: the tile has no runtime header to start from".into()),
        (Some(a), Some(b)) => Err(format!("two code allocations, [{:#x}, {:#x}) and [{:#x}, {:#x})", a.start, a.end, b.start, b.end)),
    }
}

/// A tile's code bytes as loading writes them (nothing written: 0xFF; zero fill; segments;
/// shared segments), without a device: for reports and for tests that edit programs.
pub fn code_bytes(shared: &[Vec<u8>], image: &TileImage) -> Result<(u32, Vec<u8>), String> {
    let (start, end) = code_range(image)?;
    if start > end || end - start > 1 << 24 {
        return Err(format!("code allocation [{start:#x}, {end:#x}) is not a code range"));
    }
    let mut bytes = vec![0xFFu8; (end - start) as usize];
    let mut put = |address: u32, data: &[u8], fill: Option<u8>| {
        let (a, b) = (address as u64, address as u64 + data.len() as u64);
        let (lo, hi) = (a.max(start as u64), b.min(end as u64));
        if lo < hi {
            let dst = &mut bytes[(lo - start as u64) as usize..(hi - start as u64) as usize];
            match fill {
                Some(f) => dst.fill(f),
                None => dst.copy_from_slice(&data[(lo - a) as usize..(hi - a) as usize]),
            }
        }
    };
    for z in &image.zero_fill {
        let len = z.end.saturating_sub(z.start).min(1 << 24) as usize;
        put(z.start, &vec![0; len], Some(0));
    }
    for s in &image.segments {
        put(s.address, &s.bytes, None);
    }
    for s in &image.shared {
        let data = shared.get(s.index as usize).ok_or_else(|| format!("shared segment {} is not in the package", s.index))?;
        put(s.address, data, None);
    }
    Ok((start, bytes))
}

/// The runtime header of a tile's image, read from the segment written at its code start
/// (without assembling the code): `None` when there is none or it is malformed.
pub fn header_of(shared: &[Vec<u8>], image: &TileImage) -> Option<Header> {
    let (start, _) = code_range(image).ok()?;
    let own = image.segments.iter().filter(|s| s.address == start).map(|s| s.bytes.as_slice());
    let pooled = image.shared.iter().filter(|s| s.address == start).filter_map(|s| shared.get(s.index as usize)).map(Vec::as_slice);
    own.chain(pooled).last().and_then(|bytes| Header::decode(bytes, start).ok())
}

/// Every tile's program, decoded from the package's images (in image order); errors name the
/// tile.
pub fn decode_package(p: &Package) -> Result<Vec<TileProgram>, String> {
    let steps = p.steps.len() as u32;
    p.tiles
        .iter()
        .map(|image| {
            let (start, code) = code_bytes(&p.shared_segments, image).map_err(|m| format!("tile {}: {m}", image.tile))?;
            decode_program(&code, start, image.tile, steps).map(|(_, program)| program).map_err(|m| format!("tile {}: {m}", image.tile))
        })
        .collect()
}

/// Bytes a program takes in a code allocation (header, vertex state, tables), without host
/// records; an error when its tables do not encode (`tables::encode_tile`).
pub fn program_bytes(program: &TileProgram) -> Result<u32, String> {
    let refs: Vec<(u32, &PackedTile)> = program.tables.iter().map(|(p, t)| (*p, t)).collect();
    let tables = if refs.is_empty() { 0 } else { tables::encode_tile(&refs)?.len() as u32 };
    Ok(RUNTIME_HEADER_BYTES + encode_vertex_state(&program.compute_sets).len() as u32 + tables)
}

/// Write `program` into `image`'s code allocation (for tests and tools that build or edit
/// programs): the host records of a valid header already there are kept, the rest of the
/// code range is rewritten (one segment, then zero fill). An error when it does not fit.
pub fn write_program(shared: &[Vec<u8>], image: &mut TileImage, steps: u32, program: &TileProgram) -> Result<(), String> {
    let (start, end) = code_range(image)?;
    let (_, old) = code_bytes(shared, image)?;
    let host: Vec<u8> = match Header::decode(&old, start) {
        Ok(h) if h.vertex_offset() <= old.len() as u64 => old[RUNTIME_HEADER_BYTES as usize..h.vertex_offset() as usize].to_vec(),
        _ => Vec::new(),
    };
    let refs: Vec<(u32, &PackedTile)> = program.tables.iter().map(|(p, t)| (*p, t)).collect();
    let tables = if refs.is_empty() { Vec::new() } else { tables::encode_tile(&refs).map_err(|m| format!("tile {}: {m}", image.tile))? };
    let (mut code, vertex, tables) = encode_code(image.tile, steps, &host, &program.compute_sets, &tables, refs.len() as u32);
    code.extend_from_slice(&vertex);
    code.extend_from_slice(&tables);
    if code.len() as u64 > (end - start) as u64 {
        return Err(format!("tile {}: the program needs {} bytes, its code allocation [{start:#x}, {end:#x}) holds {}", image.tile, code.len(), end - start));
    }
    let inside = |a: u32| start <= a && a < end;
    image.segments.retain(|s| !inside(s.address));
    image.shared.retain(|s| !inside(s.address));
    image.zero_fill.retain(|z| !inside(z.start));
    let written = start + code.len() as u32;
    if written < end {
        image.zero_fill.push(AddressRange { start: written, end });
    }
    image.segments.push(Segment { address: start, bytes: code });
    Ok(())
}

/// A package's programs in structured form, for reports, tools and tests that edit them:
/// per image (in image order) its compute sets, and per phase of `Package::phases` (in that
/// order) the tables of every tile that binds it, sorted by tile.
#[derive(Clone, Debug, PartialEq)]
pub struct Programs {
    pub compute_sets: Vec<Vec<ComputeSet>>,
    pub exchanges: Vec<tables::PackedPhase>,
}

impl Programs {
    /// Decode every image of `p` (errors name the tile or the phase).
    pub fn of(p: &Package) -> Result<Programs, String> {
        let decoded = decode_package(p)?;
        let mut exchanges: Vec<tables::PackedPhase> =
            p.phases.iter().map(|s| tables::PackedPhase { index: s.index, tiles: Vec::new(), horizon: s.horizon, endpoint_lower_bound: s.endpoint_lower_bound }).collect();
        let mut compute_sets = Vec::with_capacity(decoded.len());
        for (image, program) in p.tiles.iter().zip(decoded) {
            for (phase, t) in program.tables {
                let x = exchanges.iter_mut().find(|x| x.index == phase).ok_or_else(|| format!("tile {}: tables bind phase {phase}, which the package does not have", image.tile))?;
                x.tiles.push(t);
            }
            compute_sets.push(program.compute_sets);
        }
        for x in &mut exchanges {
            x.tiles.sort_by_key(|t| t.tile);
        }
        Ok(Programs { compute_sets, exchanges })
    }

    /// Write these programs into `p`'s images (`write_program` per tile; the phases' compiler
    /// figures are left as they are).
    pub fn write(&self, p: &mut Package) -> Result<(), String> {
        let steps = p.steps.len() as u32;
        for (i, image) in p.tiles.iter_mut().enumerate() {
            let tables = self.exchanges.iter().flat_map(|x| x.tiles.iter().filter(|t| t.tile == image.tile).map(|t| (x.index, t.clone()))).collect();
            let program = TileProgram { compute_sets: self.compute_sets.get(i).cloned().unwrap_or_default(), tables };
            write_program(&p.shared_segments, image, steps, &program)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tables::{ReceiveRun, SendRun};

    fn op(address: u32, row_stride: u32) -> Operand {
        Operand { address, row_stride }
    }

    fn every_kind() -> Vec<VertexCall> {
        vec![
            VertexCall::MatMul { m: 3, k: 64, n: 16, a: op(0x100, 64), a_panel: 16, b: op(0x200, 64), b_transposed: true, c: op(0x80000, 16), c_panel: 16, partials: true, add: None },
            VertexCall::Reduce { rows: 3, cols: 16, parts: vec![op(1, 2), op(3, 4), op(5, 6), op(7, 8), op(9, 10), op(11, 12)], out: op(13, 14), add: None },
            VertexCall::MatMul { m: 3, k: 64, n: 16, a: op(0x100, 64), a_panel: 0, b: op(0x200, 64), b_transposed: false, c: op(0x80000, 16), c_panel: 0, partials: false, add: Some(Addend { operand: op(0x300, 16), broadcast: Broadcast::Row }) },
            VertexCall::MatMul { m: 3, k: 64, n: 16, a: op(0x100, 64), a_panel: 0, b: op(0x200, 64), b_transposed: true, c: op(0x80000, 16), c_panel: 0, partials: false, add: Some(Addend { operand: op(0x300, 3), broadcast: Broadcast::Column }) },
            VertexCall::Reduce { rows: 3, cols: 16, parts: vec![op(1, 2), op(3, 4)], out: op(13, 14), add: Some(Addend { operand: op(15, 16), broadcast: Broadcast::Full }) },
            VertexCall::Gelu { rows: 1, cols: 2, input: op(3, 4), output: op(5, 6) },
            VertexCall::Scale { rows: 1, cols: 2, factor: 0.125, input: op(3, 4), output: op(5, 6) },
            VertexCall::Add { rows: 1, cols: 2, a: op(3, 4), b: op(5, 6), output: op(7, 8) },
            VertexCall::Softmax { rows: 1, cols: 2, scale: -1.5, input: op(3, 4), input_panel: 16, output: op(5, 6), reciprocals: None },
            VertexCall::Softmax { rows: 3, cols: 2, scale: 1.0, input: op(3, 4), input_panel: 0, output: op(5, 6), reciprocals: Some(op(7, 3)) },
            VertexCall::Reduce { rows: 3, cols: 16, parts: vec![op(1, 2), op(3, 4)], out: op(13, 14), add: Some(Addend { operand: op(15, 3), broadcast: Broadcast::RowScale }) },
            VertexCall::Copy { rows: 1, cols: 2, dtype: DType::F32, input: op(3, 4), output: op(5, 6) },
            VertexCall::CopyWords { rows: 3, cols: 6, dtype: DType::F16, input: op(3, 18), output: op(5, 8) },
            VertexCall::CopyHalves { rows: 3, cols: 5, input: op(3, 20), output: op(5, 8) },
            VertexCall::GeluErf { rows: 1, cols: 2, input: op(3, 4), output: op(5, 6) },
            VertexCall::BiasAdd { rows: 1, cols: 2, input: op(3, 4), bias: op(5, 6), output: op(7, 8) },
            VertexCall::LayerNorm { rows: 1, cols: 2, eps: 1e-6, input: op(3, 4), gamma: op(5, 6), beta: op(7, 8), output: op(9, 10) },
            VertexCall::Transpose { rows: 3, cols: 5, input: op(3, 6), output: op(5, 4) },
            VertexCall::LayerNormStatistics { rows: 2, cols: 8, input: op(3, 8), statistics: op(5, 4) },
            VertexCall::LayerNormSegment { rows: 2, cols: 8, segments: 3, segment: 1, eps: 1e-6, input: op(3, 8), statistics: op(5, 4), others: op(13, 4), gamma: op(7, 8), beta: op(9, 8), output: op(11, 8) },
        ]
    }

    #[test]
    fn stamping_a_tile_number_gives_that_tiles_header() {
        let header = |tile| Header { tile, steps: 11, host_records: 2, sets: 3, vertex_bytes: 96, bindings: 4, table_bytes: 200 };
        let mut code = header(0).encode();
        code.extend_from_slice(&[7u8; 64]);
        stamp_tile(&mut code, 1471);
        let mut expected = header(1471).encode();
        expected.extend_from_slice(&[7u8; 64]);
        assert_eq!(code, expected);
        assert_eq!(Header::decode(&code, 0).unwrap(), header(1471));
    }

    #[test]
    fn every_kind_round_trips_with_its_size() {
        let sets = vec![ComputeSet { index: 4, calls: every_kind() }, ComputeSet { index: 9, calls: vec![every_kind()[2].clone()] }];
        let bytes = encode_vertex_state(&sets);
        let segments: Vec<(Vec<u32>, u32)> = sets.iter().map(|s| segment_words(&s.calls, |o: &Operand| o.row_stride)).collect();
        let operands: u32 = sets.iter().flat_map(|s| &s.calls).map(|c| c.operands().len() as u32).sum();
        let words: u32 = segments.iter().map(|s| s.0.len() as u32).sum();
        assert_eq!(bytes.len() as u32, 2 * SET_RECORD_BYTES + 4 * operands + 4 * words);
        assert_eq!(bytes.len() as u32, vertex_state_bytes(&segments));
        assert_eq!(decode_vertex_state(&bytes, 0x4C040, 2).unwrap(), sets);
    }

    /// The same compute set of repeated layers: the same calls over buffers elsewhere.
    fn moved(sets: &[ComputeSet], index: u32, by: u32) -> ComputeSet {
        ComputeSet { index, calls: sets[0].calls.iter().map(|c| c.map(|o| Operand { address: o.address + by, ..*o })).collect() }
    }

    #[test]
    fn repeated_sets_share_one_segment_and_keep_their_own_addresses() {
        let first = vec![ComputeSet { index: 0, calls: every_kind() }];
        let sets = vec![first[0].clone(), moved(&first, 1, 0x1000), moved(&first, 2, 0x2000)];
        let bytes = encode_vertex_state(&sets);
        let segments: Vec<(Vec<u32>, u32)> = sets.iter().map(|s| segment_words(&s.calls, |o: &Operand| o.row_stride)).collect();
        assert!(segments.windows(2).all(|w| w[0] == w[1]), "moved calls have the same segment");
        let (words, operands) = (segments[0].0.len() as u32, segments[0].1);
        assert_eq!(bytes.len() as u32, 3 * SET_RECORD_BYTES + 3 * 4 * operands + 4 * words);
        assert_eq!(bytes.len() as u32, vertex_state_bytes(&segments));
        assert_eq!(decode_vertex_state(&bytes, 0x4C040, 3).unwrap(), sets);
        // Records that need more base addresses than the bytes hold.
        let e = decode_vertex_state(&bytes[..3 * SET_RECORD_BYTES as usize + 8], 0x4C040, 3).unwrap_err();
        assert!(e.contains("runs past the end") || e.contains("base addresses need"), "{e}");
        // Two records of one compute set are refused.
        let mut twice = bytes.clone();
        twice[SET_RECORD_BYTES as usize..SET_RECORD_BYTES as usize + 4].copy_from_slice(&0u32.to_le_bytes());
        assert!(decode_vertex_state(&twice, 0x4C040, 3).unwrap_err().contains("compute set 0 appears twice"));
        // Bytes no record reaches are refused.
        let mut extra = bytes.clone();
        extra.extend_from_slice(&[0; 4]);
        assert!(decode_vertex_state(&extra, 0x4C040, 3).unwrap_err().contains("do not hold exactly"));
    }

    #[test]
    fn records_pointing_into_one_another_s_segments_are_refused_after_linear_work() {
        // Every word 0x0001_0000: read as a segment's call count, 65,536 calls; read as a
        // call, one operand and no scalars, two words. A thousand records each point at their
        // own word of one long run, each a valid segment by itself; decoding them all would be
        // a thousand half-megabyte segments. The second already overlaps past what the bytes
        // hold, and is refused there.
        let sets = 1000u32;
        let records = sets * SET_RECORD_BYTES;
        let run = 2 * 65_536 + 1 + 2 * sets;
        let mut bytes = Vec::new();
        for i in 0..sets {
            to_bytes(&[i, records + 8 * i], &mut bytes);
        }
        to_bytes(&vec![0x0001_0000; run as usize], &mut bytes);
        let e = decode_vertex_state(&bytes, 0x4C040, sets).unwrap_err();
        assert!(e.contains("compute-set record 1 (compute set 1)") && e.contains("overlaps another"), "{e}");
    }

    #[test]
    fn a_program_round_trips_through_its_code_bytes() {
        let run = PackedTile {
            tile: 5,
            bases: vec![0x60000, 0x61000],
            sends: vec![SendRun { cycle: 3, slot: 0, address: 0x60000, words: 4, paired: false, count: 3, cycle_stride: 4, address_stride: 16 }],
            receives: vec![ReceiveRun { cycle: 9, source: 2, slot: 1, address: 0x61000, words: 2, paired: true, count: 1, cycle_stride: 0, address_stride: 0 }],
        };
        // Phase 3's buffers lie elsewhere: the same segment, its own base list.
        let moved = PackedTile {
            bases: vec![0x70000, 0x50000],
            sends: vec![SendRun { address: 0x70000, ..run.sends[0] }],
            receives: vec![ReceiveRun { address: 0x50000, ..run.receives[0] }],
            ..run.clone()
        };
        let program = TileProgram { compute_sets: vec![ComputeSet { index: 1, calls: every_kind() }], tables: vec![(0, run.clone()), (3, moved)] };
        let refs: Vec<(u32, &PackedTile)> = program.tables.iter().map(|(p, t)| (*p, t)).collect();
        let tables = tables::encode_tile(&refs).unwrap();
        let segment = tables::encode_segment(&run).unwrap();
        assert_eq!(tables.len() as u32, 2 * tables::BINDING_BYTES + 4 * tables::BASE_BYTES + segment.len() as u32);
        let host = vec![7u8; HOST_RECORD_BYTES as usize * 2];
        let (mut code, vertex, tables) = encode_code(5, 11, &host, &program.compute_sets, &tables, 2);
        code.extend_from_slice(&vertex);
        code.extend_from_slice(&tables);
        assert_eq!(code.len() as u32, program_bytes(&program).unwrap() + 2 * HOST_RECORD_BYTES);
        let (header, decoded) = decode_program(&code, 0x4C000, 5, 11).unwrap();
        assert_eq!((header.host_records, header.bindings), (2, 2));
        assert_eq!(decoded, program);
        assert!(decode_program(&code, 0x4C000, 6, 11).unwrap_err().contains("tile 5's"));
        assert!(decode_program(&code, 0x4C000, 5, 12).unwrap_err().contains("the package has 12"));
    }

    #[test]
    fn malformed_records_are_errors_naming_the_record() {
        let sets = vec![ComputeSet { index: 2, calls: every_kind() }];
        let good = encode_vertex_state(&sets);
        // The first call's record: after the segment's call count.
        let first = u32::from_le_bytes(good[4..8].try_into().unwrap()) as usize + 4;
        let mut bad = good.clone();
        bad[first] = 77; // first record's kind
        let e = decode_vertex_state(&bad, 0x1000, 1).unwrap_err();
        assert!(e.contains(&format!("vertex record 0 of compute set 2 at {:#x}", 0x1000 + first)) && e.contains("unknown vertex kind 77"), "{e}");
        let e = decode_vertex_state(&good[..good.len() - 4], 0x1000, 1).unwrap_err();
        assert!(e.contains("runs past the end"), "{e}");
        // A second record read from the base lists' bytes: refused, naming the record.
        let e = decode_vertex_state(&good, 0x1000, 2).unwrap_err();
        assert!(e.contains("compute-set record"), "{e}");
        let mut flags = good.clone();
        flags[first + 4 * 6..first + 4 * 7].copy_from_slice(&32u32.to_le_bytes()); // MatMul flags word
        assert!(decode_vertex_state(&flags, 0x1000, 1).unwrap_err().contains("flags"));
        // Any single corrupted byte is an error or a call, never a panic.
        for i in 0..good.len() {
            for v in [0u8, 0xFF, 0x80] {
                let mut b = good.clone();
                b[i] = v;
                let _ = decode_vertex_state(&b, 0x1000, 1);
            }
        }
    }
}

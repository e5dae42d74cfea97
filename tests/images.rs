//! Tile images (#12): identical vertex state and exchange tables are stored once in the
//! package, the code reserve past the written bytes is a load-time zero fill, host-streamed
//! data never sits in an image, and repeated blocks share exchange-table segments on a tile.

mod common;

use common::ipuq;
use ipuq_queries::package::*;
use ipuq_queries::image::{self, Programs};
use ipuq_queries::tables::{BASE_BYTES, BINDING_BYTES};

fn built(dir: &std::path::Path) -> Package {
    let w = dir.join("mlp3.toml");
    let out = ipuq(&["workload", "siglip-mlp", "--tokens", "37", "--dim", "64", "--hidden", "96", "--blocks", "3", "-o", w.to_str().unwrap()], dir);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = ipuq(&["build", w.to_str().unwrap(), "--target", "small16", "-o", "out"], dir);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stderr.contains("eliminated finite GEMM padding clears using load-time SRAM initialization removed="), "{}", common::tail(&out.stderr));
    Package::from_bytes(&std::fs::read(dir.join("out/model.ipuexe")).unwrap(), "out").unwrap()
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

#[test]
fn identical_tiles_share_image_segments_and_zero_fill_replaces_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let p = built(dir.path());
    let mut uses = vec![0u32; p.shared_segments.len()];
    for t in &p.tiles {
        for s in &t.shared {
            uses[s.index as usize] += 1;
        }
    }
    assert!(uses.iter().all(|&u| u >= 1), "every shared segment is used: {uses:?}");
    assert!(uses.iter().any(|&u| u >= 2), "identical tiles share a segment: {uses:?}");
    let loaded: usize = p.tiles.iter().map(|t| t.segments.iter().map(|s| s.bytes.len()).sum::<usize>() + t.shared.iter().map(|s| p.shared_segments[s.index as usize].len()).sum::<usize>()).sum();
    let stored: usize = p.tiles.iter().flat_map(|t| t.segments.iter()).map(|s| s.bytes.len()).sum::<usize>() + p.shared_segments.iter().map(Vec::len).sum::<usize>();
    assert!(stored < loaded, "shared segments are stored once: {stored} stored, {loaded} loaded");

    let mut filled = 0u64;
    for t in &p.tiles {
        let code = t.allocations.iter().find(|a| a.kind == AllocationKind::Code).expect("a code allocation");
        let mut ranges: Vec<(u32, u32)> = t.segments.iter().map(|s| (s.address, s.address + s.bytes.len() as u32)).collect();
        ranges.extend(t.shared.iter().map(|s| (s.address, s.address + p.shared_segments[s.index as usize].len() as u32)));
        // Host-streamed inputs and weights are never image bytes: every written byte is code.
        for &(a, b) in &ranges {
            assert!(code.start <= a && b <= code.end, "tile {}: image bytes [{a:#x}, {b:#x}) outside its code", t.tile);
        }
        let written: u32 = ranges.iter().map(|r| r.1 - r.0).sum();
        let fill: u32 = t.zero_fill.iter().map(|z| z.end - z.start).sum();
        assert!(t.zero_fill.iter().all(|z| code.start <= z.start && z.end <= code.end));
        assert_eq!(written + fill, code.end - code.start, "tile {}: written bytes and zero fill cover the code reserve exactly", t.tile);
        filled += fill as u64;
    }
    assert!(filled > 0, "the reserve past the written bytes is zero fill, not bytes");

    // Three identical blocks: on some tile two phases bind the same table segment (at the same
    // offset), patched only by their base lists, which differ (each block's buffers lie
    // elsewhere).
    let (mut shared_tables, mut moved_buffers) = (0, 0);
    for t in &p.tiles {
        let phases = image::header_of(&p.shared_segments, t).expect("a runtime header").bindings as usize;
        let Some(last) = t.shared.last() else { continue };
        if phases < 2 {
            continue;
        }
        let bytes = &p.shared_segments[last.index as usize];
        let offsets: Vec<u32> = (0..phases).map(|i| u32_at(bytes, i * BINDING_BYTES as usize + 4)).collect();
        let mut distinct = offsets.clone();
        distinct.sort();
        distinct.dedup();
        if distinct.len() < offsets.len() {
            shared_tables += 1;
        }
        // (segment offset, bases) per binding: the same segment under different bases.
        let bound: Vec<(u32, Vec<u32>)> = (0..phases)
            .map(|i| {
                let (list, count) = (u32_at(bytes, i * BINDING_BYTES as usize + 8) as usize, u32_at(bytes, i * BINDING_BYTES as usize + 12) as usize);
                (offsets[i], (0..count).map(|k| u32_at(bytes, list + k * BASE_BYTES as usize)).collect())
            })
            .collect();
        if bound.iter().any(|a| bound.iter().any(|b| a.0 == b.0 && a.1 != b.1)) {
            moved_buffers += 1;
        }
    }
    assert!(shared_tables > 0, "repeated blocks reuse table segments on some tile");
    assert!(moved_buffers > 0, "a shared segment serves buffers placed at different addresses");

    // The images are the program: every tile's calls and tables decode from its bytes, each
    // phase the package lists is bound by some tile, and writing the decoded programs back
    // reproduces the images byte for byte (nothing of the program lives outside them).
    let programs = Programs::of(&p).unwrap();
    assert!(programs.compute_sets.iter().flatten().map(|s| s.calls.len()).sum::<usize>() > 0);
    assert!(programs.exchanges.iter().all(|x| !x.tiles.is_empty()), "every phase is bound by a tile");
    let mut rewritten = p.clone();
    programs.write(&mut rewritten).unwrap();
    for (a, b) in p.tiles.iter().zip(&rewritten.tiles) {
        assert_eq!(image::code_bytes(&p.shared_segments, a).unwrap(), image::code_bytes(&rewritten.shared_segments, b).unwrap(), "tile {}", a.tile);
    }
}

//! The mutation suite: build one small package (small16), apply one mutation at a time, run the
//! mutated package through the `ipuq` binary, and assert that the device rejects it naming the
//! place (exchange: phase, tile and cycle; compute: tile, compute set and call; exit 2) or that
//! the verdict is `numericalTest=FAIL` (exit 1). Mutations of what the verdict must not trust
//! (the package's FLOP count, active tiles) must leave the verdict and its figures unchanged.
//!
//! Each mutation is found in the built package by a search that panics when the package has
//! no place for it, so a change of the compiler that removes the feature fails loudly here.

mod common;

use std::path::Path;

use common::{field, fixture, ipuq, Output};
use ipuq_queries::image::{self, Header, Programs};
use ipuq_queries::package::*;
use ipuq_queries::tables;
use ipuq_queries::target::{fixtures, Target};

const MLP: &str = "workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml";
const ATTENTION: &str = "workloads/attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8.toml";

fn build(dir: &Path, workload: &str) -> Package {
    let out = ipuq(&["build", &fixture(workload), "--target", "small16", "-o", "base"], dir);
    assert_eq!(out.code, 0, "{}", out.stderr);
    Package::from_bytes(&std::fs::read(dir.join("base/model.ipuexe")).unwrap(), "base").unwrap()
}

fn run(dir: &Path, name: &str, package: &Package, extra: &[&str]) -> Output {
    let folder = dir.join(name);
    std::fs::create_dir_all(&folder).unwrap();
    let path = folder.join("model.ipuexe");
    std::fs::write(&path, package.to_bytes()).unwrap();
    let mut args = vec!["run", path.to_str().unwrap()];
    args.extend_from_slice(extra);
    ipuq(&args, dir)
}

/// An exchange rejection names the phase, the tile and the cycle.
fn assert_exchange_error(out: &Output, what: &str) {
    assert_eq!(out.code, 2, "{what}: expected a device error\n{}\n{}", out.stdout, common::tail(&out.stderr));
    let line = out.stderr.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
    assert!(line.contains("exchange phase ") && line.contains(", tile ") && line.contains(", cycle "), "{what}: {line}");
    assert!(line.contains(what), "expected `{what}` in: {line}");
}

fn assert_error(out: &Output, what: &str) {
    assert_eq!(out.code, 2, "{what}: expected a device error\n{}\n{}", out.stdout, common::tail(&out.stderr));
    let line = out.stderr.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
    assert!(line.contains(what), "expected `{what}` in: {line}");
}

fn assert_fail(out: &Output, what: &str) {
    assert_eq!(out.code, 1, "{what}: expected numericalTest=FAIL\n{}\n{}", out.stdout, common::tail(&out.stderr));
    assert_eq!(field(&out.stdout, "workload=", "numericalTest").as_deref(), Some("FAIL"), "{what}: {}", out.stdout);
}

/// Rejected with phase, tile and cycle, or caught by the numbers.
fn assert_caught(out: &Output, what: &str) {
    match out.code {
        1 => assert_fail(out, what),
        2 => {
            let line = out.stderr.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
            assert!(line.contains("tile "), "{what}: {line}");
        }
        code => panic!("{what}: mutation not caught (exit {code})\n{}", out.stdout),
    }
}

/// The package's exchange tables as the device expands them: one entry per row, per phase
/// of `Package::phases`.
fn entries(p: &Package) -> Vec<ExchangePhase> {
    Programs::of(p).unwrap().exchanges.iter().map(|x| tables::unpack_phase(x, tables::MAX_PHASE_ENTRIES).unwrap()).collect()
}

/// Mutate the programs decoded from the images, then write them back into the images. A
/// program that outgrows its code allocation (the compiler reserves what it wrote) moves to
/// free standard memory just below the instruction fetch limit, header and all.
fn programs(p: &mut Package, f: impl FnOnce(&mut Programs)) {
    let mut programs = Programs::of(p).unwrap();
    f(&mut programs);
    let limit = Target::from_toml(&p.target_toml, "package").unwrap().memory.instruction_fetch_limit;
    for (i, image) in p.tiles.iter_mut().enumerate() {
        let tables = programs.exchanges.iter().flat_map(|x| x.tiles.iter().filter(|t| t.tile == image.tile).map(|t| (x.index, t.clone()))).collect();
        let program = image::TileProgram { compute_sets: programs.compute_sets[i].clone(), tables };
        let (start, end) = image::code_range(image).unwrap();
        let (_, old) = image::code_bytes(&p.shared_segments, image).unwrap();
        let host = Header::decode(&old, start).unwrap().host_records * ipuq_queries::emit::HOST_RECORD_BYTES;
        let needed = image::program_bytes(&program).unwrap() + host;
        if needed > end - start {
            let at = (limit - needed) / 16 * 16;
            assert!(image.allocations.iter().all(|a| a.kind == AllocationKind::Code || a.end <= at || a.start >= limit), "tile {}: no room to move its code", image.tile);
            // The old bytes go along (host records), then the program is rewritten there.
            image.segments.retain(|s| s.address != start);
            image.shared.clear();
            image.zero_fill.clear();
            image.segments.push(Segment { address: at, bytes: old });
            let code = image.allocations.iter_mut().find(|a| a.kind == AllocationKind::Code).unwrap();
            (code.start, code.end) = (at, limit);
            image.allocations.sort_by_key(|a| (a.start, a.end));
        }
        image::write_program(&p.shared_segments, image, p.steps.len() as u32, &program).unwrap();
    }
}

/// Mutate the tables entry by entry, then write them back into the images as runs.
fn edit(p: &mut Package, f: impl FnOnce(&mut Vec<ExchangePhase>)) {
    let mut x = entries(p);
    f(&mut x);
    programs(p, |programs| programs.exchanges = tables::pack(&x));
}

/// Every call of the package, decoded from its images, mutably.
fn calls(programs: &mut Programs) -> impl Iterator<Item = &mut VertexCall> {
    programs.compute_sets.iter_mut().flatten().flat_map(|s| s.calls.iter_mut())
}

/// Patch the loaded bytes of a tile's code allocation: `f` is tried on each tile's code in
/// turn until it returns true; that tile's whole code range is written back as one segment.
fn patch_code(p: &mut Package, f: impl Fn(&Header, &mut Vec<u8>) -> bool) -> u32 {
    for i in 0..p.tiles.len() {
        let (start, mut code) = image::code_bytes(&p.shared_segments, &p.tiles[i]).unwrap();
        let header = Header::decode(&code, start).unwrap();
        if !f(&header, &mut code) {
            continue;
        }
        let t = &mut p.tiles[i];
        t.shared.clear();
        t.zero_fill.clear();
        t.segments.retain(|s| s.address != start);
        t.segments.push(Segment { address: start, bytes: code });
        return t.tile;
    }
    panic!("no tile for this patch")
}

fn word(code: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(code[at..at + 4].try_into().unwrap())
}

/// (index into `Package::phases`, index into its tiles, index into that tile's receives) of the
/// first receive that satisfies `keep`.
fn find_receive(p: &Package, keep: impl Fn(&ExchangePhase, &TileExchange, &ReceiveEntry) -> bool) -> (usize, usize, usize) {
    for (e, phase) in entries(p).iter().enumerate() {
        for (t, table) in phase.tiles.iter().enumerate() {
            if let Some(r) = table.receives.iter().position(|r| keep(phase, table, r)) {
                return (e, t, r);
            }
        }
    }
    panic!("the package has no receive fit for this mutation")
}

fn step_of_phase(p: &Package, phase: u32) -> u32 {
    p.steps.iter().position(|s| *s == Step::Exchange { phase }).expect("phase is run") as u32
}

/// The allocation that owns `address` on `tile` at program step `step` (storage is shared
/// only by allocations whose lifetimes do not overlap).
fn allocation_at(p: &mut Package, tile: u32, address: u32, step: u32) -> &mut Allocation {
    let image = p.tiles.iter_mut().find(|i| i.tile == tile).unwrap();
    let owner = |a: &&mut Allocation| a.kind != AllocationKind::Code && a.start <= address && address < a.end && a.live_at(step);
    image.allocations.iter_mut().find(owner).expect("a live owner")
}

/// The end of the last send on a tile or its partner: a cycle where both send ports are free.
fn free_send_cycle(phase: &ExchangePhase, tile: u32) -> u32 {
    let ends = phase.tiles.iter().filter(|t| t.tile | 1 == tile | 1).flat_map(|t| t.sends.iter().map(|s| s.cycle + s.words));
    ends.max().unwrap_or(0) + 1
}

#[test]
fn every_mutation_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = build(d, MLP);
    let clean = run(d, "clean", &base, &[]);
    common::assert_pass(&clean);
    let mut kinds = 0;

    // 1. A doctored machine: the package's own target says GEMM rows cost 1 cycle.
    let mut p = base.clone();
    let doctored = Target::from_toml(&p.target_toml.replace("gemm_per_row = 4", "gemm_per_row = 1"), "doctored").unwrap();
    p.target_toml = doctored.canonical_toml();
    p.target_digest = doctored.digest();
    let out = run(d, "doctored-target", &p, &[]);
    assert_error(&out, &doctored.digest().short());
    let small16 = Target::from_toml(fixtures::SMALL16, "small16").unwrap();
    assert!(out.stderr.contains(&small16.digest().short()), "both digests named: {}", out.stderr);
    kinds += 1;

    // 2. The package's output list emptied: the workload still declares `y_0`.
    let mut p = base.clone();
    p.host.outputs.clear();
    let out = run(d, "no-outputs", &p, &[]);
    assert_fail(&out, "emptied output list");
    assert!(out.stderr.contains("declared by the workload"), "{}", out.stderr);
    kinds += 1;

    // 3. Doubled FLOP count and inflated active tiles: the verdict recomputes both.
    let mut p = base.clone();
    p.summary.gemm_flops *= 2;
    p.summary.active_tiles = 999;
    let out = run(d, "doubled-flops", &p, &[]);
    common::assert_pass(&out);
    for key in ["effectiveGemmTflops", "efficiencyPercent", "activeTiles"] {
        assert_eq!(field(&out.stdout, "workload=", key), field(&clean.stdout, "workload=", key), "{key}");
    }
    kinds += 1;

    // 4. A dropped receive: its words are sent to nobody (or, multicast, never arrive).
    let mut p = base.clone();
    let (e, t, r) = find_receive(&p, |_, _, _| true);
    edit(&mut p, |x| {
        x[e].tiles[t].receives.remove(r);
    });
    assert_caught(&run(d, "dropped-receive", &p, &[]), "dropped receive");
    kinds += 1;

    // 5. A shifted receive: the mux listens one cycle late.
    let mut p = base.clone();
    let (e, t, r) = find_receive(&p, |_, _, _| true);
    edit(&mut p, |x| x[e].tiles[t].receives[r].cycle += 1);
    assert_exchange_error(&run(d, "shifted-receive", &p, &[]), "receive");
    kinds += 1;

    // 6. A duplicated receive, moved to a free cycle: two receives write the same bytes.
    let mut p = base.clone();
    let (e, t, r) = find_receive(&p, |_, _, _| true);
    edit(&mut p, |x| {
        let mut copy = x[e].tiles[t].receives[r];
        copy.cycle = 1_000_000;
        x[e].tiles[t].receives.push(copy);
    });
    assert_exchange_error(&run(d, "duplicated-receive", &p, &[]), "receives overlap in memory");
    kinds += 1;

    // 7. A redirected receive: it names another source tile.
    let mut p = base.clone();
    let (e, t, r) = find_receive(&p, |_, _, _| true);
    edit(&mut p, |x| {
        let receive = &mut x[e].tiles[t].receives[r];
        receive.source = (receive.source + 2) % 16;
    });
    assert_exchange_error(&run(d, "redirected-receive", &p, &[]), "receive");
    kinds += 1;

    // 8. A truncated receive: the send's last words are heard by nobody (or, when other
    // tiles hear the same send, never arrive here).
    let mut p = base.clone();
    let (e, t, r) = find_receive(&p, |_, _, r| r.words > 2);
    edit(&mut p, |x| {
        let receive = &mut x[e].tiles[t].receives[r];
        receive.words -= if receive.paired { 2 } else { 1 };
    });
    assert_caught(&run(d, "truncated-receive", &p, &[]), "truncated receive");
    kinds += 1;

    // 9. An extra send that no receive hears.
    let mut p = base.clone();
    let (e, t, _) = find_receive(&p, |_, table, _| !table.sends.is_empty());
    edit(&mut p, |x| {
        let phase = x[e].clone();
        let table = &mut x[e].tiles[t];
        let source = table.sends[0];
        table.sends.push(SendEntry { cycle: free_send_cycle(&phase, table.tile), address: source.address, words: 1, paired: false });
    });
    assert_exchange_error(&run(d, "unreceived-send", &p, &[]), "unreceived send");
    kinds += 1;

    // 10. A read-after-write hazard: a tile sends a word it received earlier in the phase.
    let mut p = base.clone();
    let (e, t, r) = find_receive(&p, |_, _, _| true);
    edit(&mut p, |x| {
        let phase = x[e].clone();
        let table = &mut x[e].tiles[t];
        let written = table.receives[r];
        let cycle = free_send_cycle(&phase, table.tile).max(written.cycle + written.words);
        table.sends.push(SendEntry { cycle, address: written.address, words: 1, paired: false });
    });
    assert_exchange_error(&run(d, "hazard", &p, &[]), "read-after-write hazard");
    kinds += 1;

    // 11. A receive into bytes no live buffer owns: its buffer's lifetime starts a step later.
    let mut p = base.clone();
    let (e, t, r) = find_receive(&p, |_, _, _| true);
    let x = entries(&p);
    let (tile, address) = (x[e].tiles[t].tile, x[e].tiles[t].receives[r].address);
    let step = step_of_phase(&p, p.phases[e].index);
    allocation_at(&mut p, tile, address, step).first_step = step + 1;
    assert_exchange_error(&run(d, "receive-not-live", &p, &[]), "no live buffer owns");
    kinds += 1;

    // 12. A read of storage that is not live: a matrix product's A block starts living a step
    // after the product reads it.
    let mut p = base.clone();
    let decoded = Programs::of(&p).unwrap();
    let (tile, set, a) = p
        .tiles
        .iter()
        .zip(&decoded.compute_sets)
        .find_map(|(i, sets)| sets.iter().find_map(|s| s.calls.iter().find_map(|c| match c {
            VertexCall::MatMul { a, .. } => Some((i.tile, s.index, a.address)),
            _ => None,
        })))
        .expect("a matrix product");
    let step = p.steps.iter().position(|s| *s == Step::Compute { index: set }).unwrap() as u32;
    let allocation = allocation_at(&mut p, tile, a, step);
    allocation.first_step = step + 1;
    allocation.last_step = allocation.last_step.max(step + 1);
    let out = run(d, "read-not-live", &p, &[]);
    assert_error(&out, "no live buffer owns");
    assert!(out.stderr.contains(&format!("tile {tile}")) && out.stderr.contains(&format!("step {step}")), "{}", out.stderr);
    kinds += 1;

    // 13. Swapped operand addresses of a matrix product.
    let mut p = base.clone();
    programs(&mut p, |x| {
        if let Some(VertexCall::MatMul { a, b, .. }) = calls(x).find(|c| matches!(c, VertexCall::MatMul { .. })) {
            std::mem::swap(a, b);
        }
    });
    assert_caught(&run(d, "swapped-operands", &p, &[]), "swapped operand address");
    kinds += 1;

    // 14. An operand moved off the target's 8-byte data alignment (still element aligned).
    let mut p = base.clone();
    programs(&mut p, |x| {
        if let Some(VertexCall::Gelu { input, .. }) = calls(x).find(|c| matches!(c, VertexCall::Gelu { .. })) {
            input.address += 2;
        }
    });
    assert_error(&run(d, "misaligned-operand", &p, &[]), "-byte aligned");
    kinds += 1;

    // 14a. A matrix product's rows moved off the alignment: A's row stride one element longer.
    let mut p = base.clone();
    programs(&mut p, |x| {
        if let Some(VertexCall::MatMul { a, .. }) = calls(x).find(|c| matches!(c, VertexCall::MatMul { m, .. } if *m > 1)) {
            a.row_stride += 1;
        }
    });
    assert_error(&run(d, "misaligned-rows", &p, &[]), "row 1 starts unaligned");
    kinds += 1;

    // 14b. A matrix product whose input is moved into its output's memory element (the
    // AMP loads both and stores partials in one instruction: different elements).
    let mut p = base.clone();
    programs(&mut p, |x| {
        if let Some(VertexCall::MatMul { a, c, .. }) = calls(x).find(|c| matches!(c, VertexCall::MatMul { .. })) {
            a.address = c.address;
        }
    });
    assert_error(&run(d, "input-in-output-element", &p, &[]), "must lie in different memory elements");
    kinds += 1;

    // 15. A vertex writing into the tile's code and tables.
    let mut p = base.clone();
    programs(&mut p, |x| {
        let i = x.compute_sets.iter().position(|sets| sets.iter().any(|s| s.calls.iter().any(|c| matches!(c, VertexCall::Gelu { .. })))).unwrap();
        let code = base.tiles[i].allocations.iter().find(|a| a.kind == AllocationKind::Code).unwrap().start;
        if let Some(VertexCall::Gelu { output, .. }) = x.compute_sets[i].iter_mut().flat_map(|s| s.calls.iter_mut()).find(|c| matches!(c, VertexCall::Gelu { .. })) {
            output.address = code;
        }
    });
    assert_error(&run(d, "write-into-code", &p, &[]), "allocation `code`");
    kinds += 1;

    // 15b. A dropped exchange step: the values it moved never arrive.
    let mut p = base.clone();
    let at = p.steps.iter().position(|s| matches!(s, Step::Exchange { .. })).unwrap();
    p.steps.remove(at);
    assert_caught(&run(d, "dropped-exchange-step", &p, &[]), "dropped exchange step");
    kinds += 1;

    // 16. A dropped vertex call: its output keeps the NaN it was refilled with.
    let mut p = base.clone();
    programs(&mut p, |x| {
        let set = x.compute_sets.iter_mut().flatten().find(|s| s.calls.iter().any(|c| matches!(c, VertexCall::Gelu { .. }))).unwrap();
        set.calls.retain(|c| !matches!(c, VertexCall::Gelu { .. }));
    });
    assert_fail(&run(d, "dropped-call", &p, &[]), "dropped vertex call");
    kinds += 1;

    // 17. A send reading the wrong bytes (one word further on, inside its buffer).
    let mut p = base.clone();
    edit(&mut p, |x| {
        let send = x.iter_mut().flat_map(|e| e.tiles.iter_mut()).flat_map(|t| t.sends.iter_mut()).find(|s| s.words > 2).expect("a send");
        let step = if send.paired { 2 } else { 1 };
        send.words -= step;
        send.address += 4 * step;
    });
    assert_caught(&run(d, "shifted-send", &p, &[]), "shifted send address");
    kinds += 1;

    // 17b. A corrupted run descriptor: a receive's row count raised to 3 (rows back to back
    // after it), so the device listens for two rows that no send supplies.
    let mut p = base.clone();
    programs(&mut p, |x| {
        let run_at = x.exchanges.iter_mut().flat_map(|e| e.tiles.iter_mut()).flat_map(|t| t.receives.iter_mut()).next().expect("a receive");
        run_at.cycle_stride = if run_at.paired { run_at.words / 2 } else { run_at.words } + 7;
        run_at.address_stride = run_at.words * 4;
        run_at.count += 2;
    });
    assert_caught(&run(d, "corrupted-run", &p, &[]), "corrupted run descriptor");
    kinds += 1;

    // 17c. A run descriptor of zero rows, and one asking for more rows than any phase may
    // expand to: refused at load, naming the tile.
    let mut p = base.clone();
    programs(&mut p, |x| {
        let table = &mut x.exchanges[0].tiles[0];
        match table.sends.first_mut() {
            Some(s) => s.count = 0,
            None => table.receives[0].count = 0,
        }
    });
    assert_error(&run(d, "empty-run", &p, &[]), "a run descriptor of 0 entries");
    let mut p = base.clone();
    programs(&mut p, |x| {
        let table = &mut x.exchanges[0].tiles[0];
        match table.receives.first_mut() {
            Some(r) => r.count = u32::MAX,
            None => table.sends[0].count = u32::MAX,
        }
    });
    assert_error(&run(d, "huge-run", &p, &[]), "exceeds the entries left");
    kinds += 1;

    // 17d. Corrupted image bytes (under a valid checksum): a vertex record's kind, a vertex
    // record cut short by the header, a table binding pointing into the bindings, a descriptor
    // count past the tables, a runtime header's magic. Each is refused at load naming the
    // tile and the address; none is executed.
    let mut p = base.clone();
    let tile = patch_code(&mut p, |h, code| {
        // The first record's segment (its offset the record's second word), past its call count.
        let v = h.vertex_offset() as usize;
        if h.sets == 0 {
            return false;
        }
        let segment = u32::from_le_bytes(code[v + 4..v + 8].try_into().unwrap()) as usize;
        code[v + segment + 4] = 0xEE;
        true
    });
    let out = run(d, "corrupt-vertex-record", &p, &[]);
    assert_error(&out, "unknown vertex kind 238");
    assert!(out.stderr.contains(&format!("tile {tile}")) && out.stderr.contains("vertex record 0 of compute set"), "{}", out.stderr);
    let mut p = base.clone();
    patch_code(&mut p, |h, code| {
        // Four bytes moved from the vertex state to the tables: the last record is cut short.
        code[20..24].copy_from_slice(&h.vertex_bytes.wrapping_sub(4).to_le_bytes());
        code[28..32].copy_from_slice(&(h.table_bytes + 4).to_le_bytes());
        h.sets > 0
    });
    assert_error(&run(d, "vertex-state-short", &p, &[]), "runs past the end");
    let mut p = base.clone();
    let tile = patch_code(&mut p, |h, code| {
        let at = h.table_offset() as usize + 4;
        if h.bindings > 0 {
            code[at..at + 4].copy_from_slice(&0u32.to_le_bytes());
        }
        h.bindings > 0
    });
    let out = run(d, "corrupt-binding", &p, &[]);
    assert_error(&out, "points into the bindings");
    assert!(out.stderr.contains(&format!("tile {tile}")) && out.stderr.contains("exchange-table binding 0"), "{}", out.stderr);
    let mut p = base.clone();
    patch_code(&mut p, |h, code| {
        if h.bindings == 0 {
            return false;
        }
        let binding = h.table_offset() as usize;
        let segment = binding + word(code, binding + 4) as usize;
        code[segment..segment + 4].copy_from_slice(&0x0100_0000u32.to_le_bytes());
        true
    });
    assert_error(&run(d, "corrupt-descriptor-count", &p, &[]), "does not fit in the tables");
    // A descriptor naming a base slot its binding does not supply, and a binding's base list
    // running past the end of the tables.
    let mut p = base.clone();
    let tile = patch_code(&mut p, |h, code| {
        if h.bindings == 0 {
            return false;
        }
        let binding = h.table_offset() as usize;
        let address_word = binding + word(code, binding + 4) as usize + tables::SEGMENT_HEADER_BYTES as usize + 4;
        let patched = word(code, address_word) | (tables::MAX_SLOTS - 1) << tables::OFFSET_BITS;
        code[address_word..address_word + 4].copy_from_slice(&patched.to_le_bytes());
        true
    });
    let out = run(d, "corrupt-base-slot", &p, &[]);
    assert_error(&out, &format!("names base slot {}", tables::MAX_SLOTS - 1));
    assert!(out.stderr.contains(&format!("tile {tile}")) && out.stderr.contains("exchange-table binding 0"), "{}", out.stderr);
    let mut p = base.clone();
    let tile = patch_code(&mut p, |h, code| {
        if h.bindings == 0 {
            return false;
        }
        let binding = h.table_offset() as usize;
        code[binding + 8..binding + 12].copy_from_slice(&(h.table_bytes - 2).to_le_bytes());
        true
    });
    let out = run(d, "corrupt-base-list", &p, &[]);
    assert_error(&out, "runs past the end of the");
    assert!(out.stderr.contains(&format!("tile {tile}")) && out.stderr.contains("exchange-table binding 0") && out.stderr.contains("base list"), "{}", out.stderr);
    let mut p = base.clone();
    patch_code(&mut p, |_, code| {
        code[0] ^= 0x10;
        true
    });
    assert_error(&run(d, "corrupt-header", &p, &[]), "is not `IPUT`");
    kinds += 1;

    // 18. Tile images corrupted: the package's checksum no longer matches.
    let mut bytes = base.to_bytes();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xA5;
    std::fs::create_dir_all(d.join("corrupt")).unwrap();
    std::fs::write(d.join("corrupt/model.ipuexe"), &bytes).unwrap();
    let out = ipuq(&["run", "corrupt/model.ipuexe"], d);
    assert_error(&out, "checksum");
    kinds += 1;

    // 19. A wrong scale factor (attention's 1/sqrt(d)).
    let attention_dir = d.join("attention");
    std::fs::create_dir_all(&attention_dir).unwrap();
    let mut p = build(&attention_dir, ATTENTION);
    // The planner folds the scale into the softmax that consumes it; a separate pass when not.
    programs(&mut p, |x| {
        let call = calls(x)
            .find(|c| matches!(c, VertexCall::Scale { .. }) || matches!(c, VertexCall::Softmax { scale, .. } if *scale != 1.0))
            .expect("a scale pass or a softmax with the scale folded in");
        match call {
            VertexCall::Scale { factor, .. } => *factor *= 2.0,
            VertexCall::Softmax { scale, .. } => *scale *= 2.0,
            _ => unreachable!(),
        }
    });
    assert_fail(&run(&attention_dir, "wrong-scale", &p, &[]), "wrong scale");
    kinds += 1;

    assert!(kinds >= 15, "{kinds} mutation kinds");
}

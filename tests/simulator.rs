//! Integration tests of the simulated device and the runtime, on packages built by hand for
//! the 16-tile test target: numbers against a host reference (tolerances stated per check),
//! cycles against the cost formulas, rejection of broken packages (naming tile, phase, cycle),
//! the ownership lock, and the profile with its Chrome trace.
//!
//! These tests must stay fast (well under ten seconds together) and must not depend on the
//! compiler: every package here is written out explicitly. The file runs past 400 lines
//! because most checks mutate one shared hand-built pipeline, which belongs beside them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use half::f16;
use ipuq::device::lock::{DeviceLock, LockError};
use ipuq::device::{Device, DeviceError, Simulator};
use ipuq::profile;
use ipuq::runtime::{self, RunError, RunOptions};
use ipuq_queries::cost::{self, WeightClass};
use ipuq_queries::image::{self, Programs, TileProgram};
use ipuq_queries::ir::DType;
use ipuq_queries::package::*;
use ipuq_queries::target::{fixtures, Target};

const M: u32 = 8;
const K: u32 = 32;
const N: u32 = 8;
const H: u32 = K / 2;
const STD: u32 = 0x60000; // standard memory
const IL: u32 = 0x80000; // interleaved memory

fn target() -> Target {
    Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap()
}

/// A package under construction: tiles with allocations and calls, phases, host tables.
struct Build {
    target: Target,
    labels: Vec<String>,
    tiles: BTreeMap<u32, TileImage>,
    steps: Vec<Step>,
    exchanges: Vec<ExchangePhase>,
    /// Per tile: its compute sets, written into its image by `finish`.
    sets: BTreeMap<u32, Vec<ComputeSet>>,
    host: HostTables,
}

impl Build {
    fn new() -> Build {
        let host = HostTables { inputs: vec![], initialize: vec![], outputs: vec![], checkpoints: vec![] };
        Build { target: target(), labels: vec![], tiles: BTreeMap::new(), steps: vec![], exchanges: vec![], sets: BTreeMap::new(), host }
    }
    fn tile(&mut self, tile: u32) -> &mut TileImage {
        self.tiles.entry(tile).or_insert_with(|| TileImage { tile, segments: vec![], shared: vec![], zero_fill: vec![], allocations: vec![] })
    }
    fn alloc(&mut self, tile: u32, name: &str, start: u32, bytes: u32, kind: AllocationKind) {
        self.labels.push(name.to_string());
        let label = self.labels.len() as u32 - 1;
        self.tile(tile).allocations.push(Allocation { start, end: start + bytes, kind, label, first_step: 0, last_step: u32::MAX });
    }
    fn call(&mut self, tile: u32, set: u32, call: VertexCall) {
        self.tile(tile);
        let sets = self.sets.entry(tile).or_default();
        match sets.iter_mut().find(|s| s.index == set) {
            Some(s) => s.calls.push(call),
            None => sets.push(ComputeSet { index: set, calls: vec![call] }),
        }
    }
    fn phase(&mut self, index: u32, tables: Vec<TileExchange>) {
        self.exchanges.push(ExchangePhase { index, tiles: tables, horizon: 0, endpoint_lower_bound: 0 });
    }
    /// The package, with each tile's program written into its image: into its code
    /// allocation (grown to at least 1 KiB), or a new one at the bottom of memory.
    fn finish(mut self) -> Package {
        let packed = ipuq_queries::tables::pack(&self.exchanges);
        for tile in self.tiles.keys().copied().collect::<Vec<_>>() {
            let tables = packed.iter().flat_map(|x| x.tiles.iter().filter(|t| t.tile == tile).map(|t| (x.index, t.clone()))).collect();
            let program = TileProgram { compute_sets: self.sets.remove(&tile).unwrap_or_default(), tables };
            let bytes = image::program_bytes(&program).unwrap().max(1024).div_ceil(16) * 16;
            if !self.tiles[&tile].allocations.iter().any(|a| a.kind == AllocationKind::Code) {
                self.alloc(tile, "code", 0x4C000, bytes, AllocationKind::Code);
            }
            let image = self.tiles.get_mut(&tile).unwrap();
            let code = image.allocations.iter_mut().find(|a| a.kind == AllocationKind::Code).unwrap();
            code.end = code.end.max(code.start + bytes);
            image::write_program(&[], image, self.steps.len() as u32, &program).unwrap();
        }
        Package {
            compiler: "tests".into(),
            target_toml: self.target.canonical_toml(),
            target_digest: self.target.digest(),
            workload_name: "hand-built".into(),
            workload_toml: String::new(),
            tiles: self.tiles.into_values().collect(),
            shared_segments: vec![],
            steps: self.steps,
            phases: packed.iter().map(|x| PhaseSummary { index: x.index, horizon: x.horizon, endpoint_lower_bound: x.endpoint_lower_bound }).collect(),
            host: self.host,
            labels: self.labels,
            summary: Summary { operations: 0, active_tiles: 0, gemm_flops: 0, estimated_cycles: 0, estimated_exchange_cycles: 0, logical_shards: 0 },
        }
    }
}

/// Edit a package's programs (decoded from its images) and write them back.
fn edit(package: &mut Package, f: impl FnOnce(&mut Programs)) {
    let mut programs = Programs::of(package).unwrap();
    f(&mut programs);
    programs.write(package).unwrap();
}

/// The compute sets of a tile, in `Programs`.
fn sets_of<'a>(package: &Package, programs: &'a mut Programs, tile: u32) -> &'a mut Vec<ComputeSet> {
    &mut programs.compute_sets[package.tiles.iter().position(|t| t.tile == tile).unwrap()]
}

fn op(address: u32, row_stride: u32) -> Operand {
    Operand { address, row_stride }
}
fn send(cycle: u32, address: u32, words: u32, paired: bool) -> SendEntry {
    SendEntry { cycle, address, words, paired }
}
fn receive(cycle: u32, source: u32, address: u32, words: u32, paired: bool) -> ReceiveEntry {
    ReceiveEntry { cycle, source, address, words, paired }
}
fn table(tile: u32, sends: Vec<SendEntry>, receives: Vec<ReceiveEntry>) -> TileExchange {
    TileExchange { tile, sends, receives }
}
fn tensor(name: &str, shape: Vec<u32>, role: HostRole, segments: Vec<HostSegment>) -> HostTensor {
    HostTensor { name: name.into(), shape, dtype: DType::F16, role, segments }
}
fn segment(tile: u32, address: u32, element: u32, count: u32) -> HostSegment {
    HostSegment { tile, address, element, count, rows: 1, element_stride: 0, address_stride: 0, element_step: 1 }
}

/// Deterministic f16 values in [-1, 1).
fn values(count: usize, seed: u64) -> Vec<f16> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..count)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            f16::from_f32(((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}
fn to_bytes(v: &[f16]) -> Vec<u8> {
    v.iter().flat_map(|h| h.to_le_bytes()).collect()
}
fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
}

/// The reference pipeline: C = A . B split over two tiles in K (fp32 partials, B transposed on
/// tile 1), partials paired-exchanged to tile 0 and reduced, C multicast to tiles 9 and 2,
/// Y = gelu(C) on tile 9 and Z = 0.5 C on tile 2. Returns the package and its inputs.
fn pipeline() -> (Package, BTreeMap<String, Vec<u8>>) {
    let t = target();
    let mut b = Build::new();
    for tile in [0, 1, 2, 9] {
        b.alloc(tile, "code", 0x4C000, 256, AllocationKind::Code);
        b.tile(tile).segments.push(Segment { address: 0x4C000, bytes: vec![0x5A; 64] });
    }
    b.alloc(0, "a", STD, M * H * 2, AllocationKind::Data);
    b.alloc(0, "b", IL, H * N * 2, AllocationKind::Data);
    b.alloc(0, "partial0", IL + 0x1000, M * N * 4, AllocationKind::Partials);
    b.alloc(0, "partial1", IL + 0x2000, M * N * 4, AllocationKind::Partials);
    b.alloc(0, "c", IL + 0x3000, M * N * 2, AllocationKind::Data);
    b.alloc(1, "a", STD, M * H * 2, AllocationKind::Data);
    b.alloc(1, "b_transposed", IL, H * N * 2, AllocationKind::Data);
    b.alloc(1, "partial1", IL + 0x1000, M * N * 4, AllocationKind::Partials);
    for (tile, out) in [(9, "y"), (2, "z")] {
        b.alloc(tile, "c", IL + 0x3000, M * N * 2, AllocationKind::Data);
        b.alloc(tile, out, IL + 0x4000, M * N * 2, AllocationKind::Data);
    }
    b.alloc(2, "a_row_replica", STD, K * 2, AllocationKind::Data);
    let matmul = |b_address, b_stride, b_transposed| VertexCall::MatMul {
        m: M, k: H, n: N, a: op(STD, H), a_panel: 0, b: op(b_address, b_stride), b_transposed, c: op(IL + 0x1000, N), c_panel: 0, partials: true, add: None,
    };
    b.call(0, 0, matmul(IL, N, false));
    b.call(1, 0, matmul(IL, H, true));
    b.call(0, 1, VertexCall::Reduce { rows: M, cols: N, parts: vec![op(IL + 0x1000, N), op(IL + 0x2000, N)], out: op(IL + 0x3000, N), add: None });
    b.call(9, 2, VertexCall::Gelu { rows: M, cols: N, input: op(IL + 0x3000, N), output: op(IL + 0x4000, N) });
    b.call(2, 2, VertexCall::Scale { rows: M, cols: N, factor: 0.5, input: op(IL + 0x3000, N), output: op(IL + 0x4000, N) });
    // Phase 0: tile 1's partials, paired, into tile 0's second partials buffer.
    let words = M * N;
    b.phase(0, vec![
        table(0, vec![], vec![receive(t.delay(1, 0), 1, IL + 0x2000, words, true)]),
        table(1, vec![send(0, IL + 0x1000, words, true)], vec![]),
    ]);
    // Phase 1: C (words/2 words) in two back-to-back sends, multicast; tile 2 listens in two pieces.
    let c_words = M * N / 2;
    let half_words = c_words / 2;
    b.phase(1, vec![
        table(0, vec![send(0, IL + 0x3000, half_words, false), send(half_words, IL + 0x3000 + half_words * 4, half_words, false)], vec![]),
        table(2, vec![], vec![
            receive(t.delay(0, 2), 0, IL + 0x3000, half_words, false),
            receive(t.delay(0, 2) + half_words, 0, IL + 0x3000 + half_words * 4, half_words, false),
        ]),
        table(9, vec![], vec![receive(t.delay(0, 9), 0, IL + 0x3000, c_words, false)]),
    ]);
    b.steps = vec![Step::Compute { index: 0 }, Step::Exchange { phase: 0 }, Step::Compute { index: 1 }, Step::Exchange { phase: 1 }, Step::Compute { index: 2 }];
    // Host tables: A row-split over tiles 0 and 1 plus a replica of row 0 on tile 2; B as
    // rows on tile 0 and element by element, transposed, on tile 1.
    let mut a_segments = vec![segment(2, STD, 0, K)];
    for r in 0..M {
        a_segments.push(segment(0, STD + r * H * 2, r * K, H));
        a_segments.push(segment(1, STD + r * H * 2, r * K + H, H));
    }
    let mut b_segments = vec![segment(0, IL, 0, H * N)];
    for kk in H..K {
        for j in 0..N {
            b_segments.push(segment(1, IL + (j * H + (kk - H)) * 2, kk * N + j, 1));
        }
    }
    b.host.inputs = vec![tensor("a", vec![M, K], HostRole::Input, a_segments), tensor("b", vec![K, N], HostRole::Weight, b_segments)];
    b.host.outputs = vec![
        tensor("y", vec![M, N], HostRole::Output, vec![segment(9, IL + 0x4000, 0, M * N)]),
        tensor("z", vec![M, N], HostRole::Output, vec![segment(2, IL + 0x4000, 0, M * N)]),
    ];
    let c = tensor("c", vec![M, N], HostRole::Intermediate, vec![segment(0, IL + 0x3000, 0, M * N)]);
    b.host.checkpoints = vec![Checkpoint { operation: 0, after_step: 2, tensor: c }];
    let inputs = BTreeMap::from([("a".to_string(), to_bytes(&values((M * K) as usize, 1))), ("b".to_string(), to_bytes(&values((K * N) as usize, 2)))]);
    (b.finish(), inputs)
}

/// C as the package defines it: two fp32 partial sums in increasing k, added, rounded to f16.
fn reference_c(inputs: &BTreeMap<String, Vec<u8>>) -> Vec<f32> {
    let (a, b) = (from_bytes(&inputs["a"]), from_bytes(&inputs["b"]));
    let (k, n) = (K as usize, N as usize);
    let mut c = vec![0.0; (M * N) as usize];
    for i in 0..M as usize {
        for j in 0..n {
            let partial = |range: std::ops::Range<usize>| range.fold(0.0f32, |s, kk| s + a[i * k + kk] * b[kk * n + j]);
            c[i * n + j] = f16::from_f32(partial(0..H as usize) + partial(H as usize..k)).to_f32();
        }
    }
    c
}

fn run_options() -> RunOptions {
    RunOptions { checkpoints: true, sample_limit: 16, ..RunOptions::default() }
}

#[test]
fn pipeline_matches_the_host_reference_and_the_cost_formulas() {
    let t = target();
    let (package, inputs) = pipeline();
    let dir = tempfile::tempdir().unwrap();
    let options = RunOptions { profile_path: Some(dir.path().join("execution.ipuprofile")), ..run_options() };
    let result = runtime::execute(&package, &inputs, &options).unwrap();

    // C: the same fp32 order as the package's contract, so exact (tolerance 0).
    let c = reference_c(&inputs);
    let checkpoint = &result.checkpoints[0];
    assert_eq!(checkpoint.indices, (0..16).map(|i| i * 4).collect::<Vec<u64>>());
    for (&index, &value) in checkpoint.indices.iter().zip(&checkpoint.values) {
        assert_eq!(value, c[index as usize], "checkpoint element {index}");
    }
    // Y = gelu(C): f64 reference, tolerance half an f16 ulp plus f32 rounding (2^-10 relative + 2^-14).
    let y = from_bytes(&result.outputs["y"]);
    for (i, (&got, &x)) in y.iter().zip(&c).enumerate() {
        let x = x as f64;
        let want = 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh());
        assert!((got as f64 - want).abs() <= want.abs() / 1024.0 + 1.0 / 16384.0, "y[{i}] = {got}, reference {want}");
    }
    // Z = C / 2 is exact in f16 for these magnitudes.
    assert_eq!(from_bytes(&result.outputs["z"]), c.iter().map(|v| v * 0.5).collect::<Vec<_>>());

    // Bytes streamed: A once plus the replica of its first row; B once.
    assert_eq!((result.input_bytes, result.weight_bytes), ((M * K * 2 + K * 2) as u64, (K * N * 2) as u64));

    // Cycles: the BSP sum of the cost formulas, horizons written out by hand.
    let gemm = |transposed| cost::gemm(&t, M, H, N, WeightClass::Interleaved, transposed);
    let gelu = cost::gelu(&t, (M * N) as u64);
    let scale = cost::unary_half(&t, (M * N) as u64, t.costs.cpl_mul_half, false);
    let reduce = cost::reduce(&t, 2, (M * N) as u64);
    let horizon0 = t.delay(1, 0) + M * N / 2;
    let horizon1 = t.delay(0, 9).max(t.delay(0, 2)) + M * N / 2;
    let exchange = |h| cost::exchange_phase(&t, h);
    let expected = gemm(true) + exchange(horizon0) + reduce + exchange(horizon1) + gelu.max(scale);
    assert!(gemm(true) > gemm(false), "tile 1's transposed weights make it the slowest");
    assert_eq!(result.cycles, expected);
    // Least busy active tile: tile 2 (scale) or tile 9 (gelu); both sit out phase 0 but sync.
    let sync = t.exchange.sync_cycles;
    let busy = |compute: u64, own1: u32| compute + 2 * sync + (own1 + M * N / 2) as u64;
    let minimum = busy(scale, t.delay(0, 2)).min(busy(gelu, t.delay(0, 9)));
    assert_eq!(result.minimum_tile_cycles, minimum);
    assert_eq!(result.device, "simulator");

    let (path, tiles, samples) = result.profile.clone().unwrap();
    assert_eq!((tiles, samples), (4, 4 * 5));
    let summary = profile::summarize(&path).unwrap();
    assert_eq!((summary.tiles, summary.steps, summary.cycles), (4, 5, expected));
    assert_eq!(summary.exchange_cycles, exchange(horizon0) + exchange(horizon1));
    assert!(summary.to_string().contains("slowest supersteps"), "{summary}");
}

#[test]
fn chrome_trace_has_one_track_per_tile_and_one_slice_per_superstep() {
    let (package, inputs) = pipeline();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("execution.ipuprofile");
    runtime::execute(&package, &inputs, &RunOptions { profile_path: Some(path.clone()), ..run_options() }).unwrap();
    let out = dir.path().join("trace.json");
    profile::chrome_trace(&path, &out).unwrap();
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let mut slices: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for e in events.iter().filter(|e| e["ph"] == "X") {
        slices.entry(e["tid"].as_u64().unwrap()).or_default().push(e["ts"].as_f64().unwrap());
    }
    assert_eq!(slices.len(), 4, "one track per tile");
    for (tid, starts) in &slices {
        assert_eq!(starts.len(), 5, "track {tid}: one slice per superstep");
        assert!(starts.windows(2).all(|w| w[0] < w[1]), "track {tid}: supersteps in order");
    }
    let names = events.iter().filter(|e| e["ph"] == "M" && e["name"] == "thread_name").count();
    assert_eq!(names, 4);
}

/// Load a package into a fresh simulator: the error of the first failing step.
fn load(package: &Package) -> Result<Simulator, DeviceError> {
    let mut device = Simulator::open(target());
    device.initialize()?;
    device.load(package)?;
    Ok(device)
}

#[test]
fn overlapping_receives_on_one_tile_are_rejected_with_tile_phase_and_cycle() {
    let t = target();
    let (mut package, _) = pipeline();
    // Tile 1 also sends its partials plainly to tile 9, timed to arrive while tile 9 is
    // already listening to tile 0 in phase 1.
    let arrival = t.delay(0, 9) + 5;
    edit(&mut package, |x| {
        let phase = &mut x.exchanges[1];
        let buffer = |address: u32| vec![(address, 16u64)];
        phase.tiles.push(ipuq_queries::tables::pack_tile(&table(1, vec![send(arrival - t.delay(1, 9), IL + 0x1000, 4, false)], vec![]), &buffer(IL + 0x1000)).unwrap());
        phase.tiles.sort_by_key(|x| x.tile);
        let extra = ipuq_queries::tables::pack_tile(&table(9, vec![], vec![receive(arrival, 1, IL + 0x3000, 4, false)]), &buffer(IL + 0x3000)).unwrap();
        let nine = phase.tiles.iter_mut().find(|x| x.tile == 9).unwrap();
        nine.receives.push(ipuq_queries::tables::ReceiveRun { slot: nine.bases.len() as u32, ..extra.receives[0] });
        nine.bases.push(IL + 0x3000);
    });
    let err = load(&package).err().expect("a double-booked receive port must be rejected");
    assert!(matches!(err, DeviceError::Exchange { phase: 1, tile: 9, cycle, .. } if cycle == arrival as u64), "{err}");
    let text = err.to_string();
    assert!(text.contains("phase 1") && text.contains("tile 9") && text.contains(&format!("cycle {arrival}")) && text.contains("receive port"), "{text}");
}

#[test]
fn a_receive_without_a_matching_send_is_rejected() {
    let (mut package, _) = pipeline();
    // Tile 9 listens one cycle late: its last word would come from no send.
    edit(&mut package, |x| x.exchanges[1].tiles.iter_mut().find(|x| x.tile == 9).unwrap().receives[0].cycle += 1);
    let err = load(&package).err().expect("a late receive must be rejected");
    assert!(matches!(err, DeviceError::Exchange { phase: 1, tile: 9, .. }), "{err}");
    assert!(err.to_string().contains("from tile 0"), "{err}");
}

#[test]
fn paired_receives_share_a_supertile_only_when_both_hear_the_same_words() {
    let t = target();
    let d = t.delay(0, 8);
    assert_eq!(d, t.delay(0, 9), "tiles 8 and 9 sit in one row group of one column");
    // Tile 0 sends 16 words paired (8 cycles); tile 8 hears all of them; tile 9 as given;
    // tile 2 sends 4 words when tile 9 listens to it (a send nobody hears is an error).
    let build = |tile9: Vec<ReceiveEntry>| {
        let mut b = Build::new();
        for tile in [0, 8, 9, 2] {
            b.alloc(tile, "x", IL, 64, AllocationKind::Data);
        }
        let from2 = if tile9.iter().any(|r| r.source == 2) { vec![send(0, IL, 4, false)] } else { vec![] };
        b.phase(0, vec![
            table(0, vec![send(0, IL, 16, true)], vec![]),
            table(2, from2, vec![]),
            table(8, vec![], vec![receive(d, 0, IL, 16, true)]),
            table(9, vec![], tile9),
        ]);
        b.steps = vec![Step::Exchange { phase: 0 }];
        b.finish()
    };
    load(&build(vec![receive(d, 0, IL, 16, true)])).expect("a supertile hearing one paired stream together is legal");
    load(&build(vec![receive(d, 0, IL, 8, true), receive(d + 4, 0, IL + 32, 8, true)]))
        .expect("the partner may cut the same stream into other pieces");
    for (tile9, what) in [
        (vec![receive(t.delay(2, 9), 2, IL, 4, false)], "another source while the partner hears a paired stream"),
        (vec![receive(d, 0, IL, 16, true), receive(d, 0, IL + 32, 8, true)], "one tile storing the same words twice"),
    ] {
        let err = load(&build(tile9)).err().unwrap_or_else(|| panic!("accepted {what}"));
        assert!(matches!(err, DeviceError::Exchange { phase: 0, tile: 9, .. }), "{what}: {err}");
    }
}

#[test]
fn an_exchange_moves_the_words_as_they_were_when_the_phase_began() {
    let t = target();
    let mut b = Build::new();
    for tile in [0, 1] {
        b.alloc(tile, "x", IL, 8, AllocationKind::Data);
    }
    // Tiles 0 and 1 swap their 2-word buffers in place.
    b.phase(0, vec![
        table(0, vec![send(0, IL, 2, false)], vec![receive(t.delay(1, 0), 1, IL, 2, false)]),
        table(1, vec![send(0, IL, 2, false)], vec![receive(t.delay(0, 1), 0, IL, 2, false)]),
    ]);
    b.steps = vec![Step::Exchange { phase: 0 }];
    let x = |tile| tensor("x", vec![4], HostRole::Input, vec![segment(tile, IL, 0, 4)]);
    let package = b.finish();
    let mut device = load(&package).unwrap();
    device.write_tensor(&x(0), &to_bytes(&values(4, 10))).unwrap();
    device.write_tensor(&x(1), &to_bytes(&values(4, 11))).unwrap();
    device.run(&[]).unwrap();
    assert_eq!(device.read_tensor(&x(0)).unwrap(), to_bytes(&values(4, 11)));
    assert_eq!(device.read_tensor(&x(1)).unwrap(), to_bytes(&values(4, 10)));
}

#[test]
fn an_operand_outside_its_allocation_is_rejected_naming_the_tile() {
    let (mut package, _) = pipeline();
    let copy = package.clone();
    edit(&mut package, |x| {
        let VertexCall::Scale { rows, .. } = &mut sets_of(&copy, x, 2)[0].calls[0] else { panic!("tile 2 scales") };
        *rows = M + 1;
    });
    let err = load(&package).err().expect("an out-of-bounds read must be rejected");
    assert!(matches!(err, DeviceError::Access { tile: 2, compute_set: 2, call: 0, .. }), "{err}");
    assert!(err.to_string().contains("tile 2") && err.to_string().contains("allocation `c`"), "{err}");
}

#[test]
fn corrupted_image_records_are_load_errors_naming_tile_and_address() {
    // The calls are decoded from the image bytes: tile 9's first vertex record gets kind 99.
    // (No host records here: the vertex state starts after the 64-byte header, with the first
    // compute set's record, whose second word is its segment's offset; the first call's record
    // follows the segment's call count.)
    let (mut package, _) = pipeline();
    let image = package.tiles.iter_mut().find(|t| t.tile == 9).unwrap();
    let code = &mut image.segments.iter_mut().find(|s| s.address == 0x4C000).unwrap().bytes;
    let first = 64 + u32::from_le_bytes(code[64 + 4..64 + 8].try_into().unwrap()) as usize + 4;
    code[first] = 99;
    let err = load(&package).err().expect("an unknown vertex kind must be rejected");
    assert!(matches!(err, DeviceError::Load { tile: 9, .. }), "{err}");
    assert!(err.to_string().contains(&format!("vertex record 0 of compute set 2 at {:#x}", 0x4C000 + first)) && err.to_string().contains("unknown vertex kind 99"), "{err}");
    // A tile without a code allocation has no program to start from.
    let (mut package, _) = pipeline();
    package.tiles.iter_mut().find(|t| t.tile == 9).unwrap().allocations.retain(|a| a.kind != AllocationKind::Code);
    let err = load(&package).err().expect("a tile without code must be rejected");
    assert!(matches!(err, DeviceError::Load { tile: 9, .. }) && err.to_string().contains("no code allocation"), "{err}");
}

#[test]
fn partials_in_standard_memory_are_rejected() {
    let (mut package, _) = pipeline();
    // The matrix product on tile 1 writes its partials into standard memory, in the element
    // after its A buffer's (the input and output may not share one).
    let copy = package.clone();
    edit(&mut package, |x| {
        let VertexCall::MatMul { c, .. } = &mut sets_of(&copy, x, 1)[0].calls[0] else { panic!("tile 1 multiplies") };
        *c = op(STD + 0x4000, N);
    });
    let err = load(&package).err().expect("partials below the interleaved region must be rejected");
    assert!(matches!(err, DeviceError::Access { tile: 1, operand: "c", .. }), "{err}");
    assert!(err.to_string().contains("standard memory"), "{err}");

    // A partials allocation placed in standard memory is rejected at load.
    let (mut package, _) = pipeline();
    let tile0 = package.tiles.iter_mut().find(|t| t.tile == 0).unwrap();
    tile0.allocations.iter_mut().find(|a| a.kind == AllocationKind::Partials).unwrap().start = STD + 0x1000;
    let err = load(&package).err().expect("a partials allocation in standard memory must be rejected");
    assert!(matches!(err, DeviceError::Load { tile: 0, .. }) && err.to_string().contains("interleaved"), "{err}");
}

#[test]
fn a_product_whose_input_shares_its_outputs_memory_element_is_rejected() {
    // Tile 1's product reads A in standard memory and writes partials in interleaved memory:
    // it loads. With A moved next to its partials (the same 32 KiB element pair) it does not.
    let (package, _) = pipeline();
    load(&package).expect("the pipeline's products keep input and output apart");
    let mut package = package;
    let copy = package.clone();
    edit(&mut package, |x| {
        let VertexCall::MatMul { a, c, .. } = &mut sets_of(&copy, x, 1)[0].calls[0] else { panic!("tile 1 multiplies") };
        *a = Operand { address: c.address + 0x1000, row_stride: a.row_stride };
    });
    let err = load(&package).err().expect("an input in its output's element must be rejected");
    assert!(matches!(err, DeviceError::Access { tile: 1, compute_set: 0, call: 0, operand: "c", .. }), "{err}");
    assert!(err.to_string().contains("must lie in different memory elements"), "{err}");
}

#[test]
fn rows_off_the_alignment_are_rejected_unless_a_contiguous_block_is_one_vector() {
    let gelu = |cols: u32, stride: u32| {
        let mut b = Build::new();
        b.alloc(3, "t", IL, 64, AllocationKind::Data);
        b.call(3, 0, VertexCall::Gelu { rows: 2, cols, input: op(IL, stride), output: op(IL, stride) });
        b.steps = vec![Step::Compute { index: 0 }];
        load(&b.finish()).err()
    };
    assert!(gelu(6, 6).is_none(), "a contiguous block is one vector");
    assert!(gelu(6, 8).is_none(), "rows 16 bytes apart");
    let err = gelu(6, 7).expect("rows 14 bytes apart must be rejected");
    assert!(matches!(err, DeviceError::Access { tile: 3, operand: "input", .. }) && err.to_string().contains("row 1 starts unaligned"), "{err}");
    // A matrix product reads every row of its operands with 64-bit loads: contiguous rows of
    // 6 elements (12 bytes) are rejected, rows padded to 8 elements load.
    let product = |k: u32, stride: u32| {
        let mut b = Build::new();
        b.alloc(4, "a", STD, 64, AllocationKind::Data);
        b.alloc(4, "b", IL, 128, AllocationKind::Data);
        b.alloc(4, "c", STD + 0x4000, 64, AllocationKind::Data);
        b.call(4, 0, VertexCall::MatMul { m: 2, k, n: 4, a: op(STD, stride), a_panel: 0, b: op(IL, 4), b_transposed: false, c: op(STD + 0x4000, 4), c_panel: 0, partials: false, add: None });
        b.steps = vec![Step::Compute { index: 0 }];
        load(&b.finish()).err()
    };
    assert!(product(6, 8).is_none(), "rows padded to 8 elements");
    let err = product(6, 6).expect("contiguous product rows of 12 bytes must be rejected");
    assert!(matches!(err, DeviceError::Access { tile: 4, operand: "a", .. }) && err.to_string().contains("row 1 starts unaligned"), "{err}");
}

#[test]
fn never_written_memory_reads_as_poison_and_zero_fill_as_zero() {
    let mut b = Build::new();
    // One allocation: its first row cleared at load, its second never written.
    b.alloc(3, "t", IL, 32, AllocationKind::Data);
    b.tile(3).zero_fill.push(AddressRange { start: IL, end: IL + 16 });
    b.call(3, 0, VertexCall::Gelu { rows: 2, cols: 8, input: op(IL, 8), output: op(IL, 8) });
    b.steps = vec![Step::Compute { index: 0 }];
    let mut device = load(&b.finish()).unwrap();
    device.run(&[]).unwrap();
    let read = |address| from_bytes(&device.read_tensor(&tensor("t", vec![8], HostRole::Output, vec![segment(3, address, 0, 8)])).unwrap());
    assert!(read(IL).iter().all(|&v| v == 0.0), "gelu(0) = 0");
    assert!(read(IL + 16).iter().all(|v| v.is_nan()), "the poison pattern reads as NaN");
}

#[test]
fn a_product_adds_its_epilogue_addend_by_rows_columns_or_whole_block_before_rounding() {
    // c = a . b + addend for each broadcast, on tile 5: a [2 x 4], b [4 x 8], c [2 x 8]; a in
    // the next 32 KiB element pair (a product's input and output never share an element).
    let (m, k, n) = (2u32, 4u32, 8u32);
    let mut b = Build::new();
    for (name, offset, bytes) in [("a", 0x8000, 16), ("b", 0x100, 64), ("row", 0x200, 16), ("column", 0x240, 8), ("full", 0x280, 32), ("c1", 0x300, 32), ("c2", 0x340, 32), ("c3", 0x380, 32)] {
        b.alloc(5, name, IL + offset, bytes, AllocationKind::Data);
    }
    let call = |c: u32, add: Operand, broadcast: Broadcast| VertexCall::MatMul {
        m, k, n, a: op(IL + 0x8000, k), a_panel: 0, b: op(IL + 0x100, n), b_transposed: false, c: op(IL + c, n), c_panel: 0, partials: false,
        add: Some(Addend { operand: add, broadcast }),
    };
    b.call(5, 0, call(0x300, op(IL + 0x200, n), Broadcast::Row));
    b.call(5, 0, call(0x340, op(IL + 0x240, m), Broadcast::Column));
    b.call(5, 0, call(0x380, op(IL + 0x280, n), Broadcast::Full));
    b.steps = vec![Step::Compute { index: 0 }];
    let t = |name: &str, address: u32, rows: u32, cols: u32| {
        tensor(name, vec![rows, cols], HostRole::Input, (0..rows).map(|r| segment(5, address + r * cols * 2, r * cols, cols)).collect())
    };
    let package = b.finish();
    let mut device = load(&package).unwrap();
    let (av, bv, row, column, full) = (values(8, 5), values(32, 6), values(8, 7), values(2, 8), values(16, 9));
    for (name, address, rows, cols, v) in [("a", 0x8000, m, k, &av), ("b", 0x100, k, n, &bv), ("row", 0x200, 1, n, &row), ("column", 0x240, 1, m, &column), ("full", 0x280, m, n, &full)] {
        device.write_tensor(&t(name, IL + address, rows, cols), &to_bytes(v)).unwrap();
    }
    let report = device.run(&[]).unwrap();
    for (name, address, addend) in [("c1", 0x300u32, 0usize), ("c2", 0x340, 1), ("c3", 0x380, 2)] {
        let got = from_bytes(&device.read_tensor(&t(name, IL + address, m, n)).unwrap());
        for i in 0..m as usize {
            for j in 0..n as usize {
                let product: f32 = (0..k as usize).map(|kk| av[i * k as usize + kk].to_f32() * bv[kk * n as usize + j].to_f32()).sum();
                let extra = [row[j], column[i], full[i * n as usize + j]][addend].to_f32();
                // One rounding to f16 of the fp32 sum (f32 sums of four products: exact enough).
                let want = f16::from_f32(product + extra).to_f32();
                assert!((got[i * n as usize + j] - want).abs() <= want.abs() / 1024.0 + 1e-3, "{name}[{i}][{j}] = {}, want {want}", got[i * n as usize + j]);
            }
        }
    }
    let tc = target();
    let each = cost::gemm(&tc, m, k, n, cost::weight_class(&tc, &op(IL + 0x100, n)), false) + cost::epilogue_add(&tc, (m * n) as u64);
    assert_eq!(report.timeline.cycles(), 3 * each, "the product's cost plus the add's per-vector body");

    // An addend on a product that writes fp32 partials would be added once per reduction member.
    let mut package = package;
    let at = package.tiles.iter().position(|t| t.tile == 5).unwrap();
    edit(&mut package, |x| {
        let VertexCall::MatMul { partials, .. } = &mut x.compute_sets[at][0].calls[0] else { panic!("tile 5 multiplies") };
        *partials = true;
    });
    let err = load(&package).err().expect("an addend on partials must be rejected");
    assert!(matches!(err, DeviceError::Access { tile: 5, operand: "add", .. }) && err.to_string().contains("partials"), "{err}");
}

#[test]
fn add_softmax_and_copy_match_the_reference() {
    // s = x + y, p = softmax(s) per row, q = p copied into rows of stride 12 (24 bytes: each
    // row starts on the 8-byte alignment).
    let mut b = Build::new();
    for (name, offset) in [("x", 0), ("y", 0x100), ("s", 0x200), ("p", 0x300), ("q", 0x400)] {
        b.alloc(4, name, IL + offset, 64, AllocationKind::Data);
    }
    b.call(4, 0, VertexCall::Add { rows: 2, cols: 8, a: op(IL, 8), b: op(IL + 0x100, 8), output: op(IL + 0x200, 8) });
    b.call(4, 0, VertexCall::Softmax { rows: 2, cols: 8, scale: 1.0, input: op(IL + 0x200, 8), input_panel: 0, output: op(IL + 0x300, 8), reciprocals: None });
    b.call(4, 0, VertexCall::Copy { rows: 2, cols: 8, dtype: DType::F16, input: op(IL + 0x300, 8), output: op(IL + 0x400, 12) });
    b.steps = vec![Step::Compute { index: 0 }];
    let t = |name: &str, address, stride: u32| {
        tensor(name, vec![2, 8], HostRole::Input, (0..2).map(|r| segment(4, address + r * stride * 2, r * 8, 8)).collect())
    };
    let mut device = load(&b.finish()).unwrap();
    let (x, y) = (values(16, 3), values(16, 4));
    device.write_tensor(&t("x", IL, 8), &to_bytes(&x)).unwrap();
    device.write_tensor(&t("y", IL + 0x100, 8), &to_bytes(&y)).unwrap();
    let report = device.run(&[]).unwrap();
    let p = from_bytes(&device.read_tensor(&t("p", IL + 0x300, 8)).unwrap());
    assert_eq!(from_bytes(&device.read_tensor(&t("q", IL + 0x400, 12)).unwrap()), p, "the copy is bit exact");
    // f64 reference from the f16-rounded sum; tolerance half an f16 ulp plus f32 rounding.
    let sum: Vec<f64> = x.iter().zip(&y).map(|(a, b)| f16::from_f32(a.to_f32() + b.to_f32()).to_f64()).collect();
    for row in 0..2 {
        let s = &sum[row * 8..row * 8 + 8];
        let max = s.iter().copied().fold(f64::MIN, f64::max);
        let total: f64 = s.iter().map(|v| (v - max).exp()).sum();
        for col in 0..8 {
            let want = (s[col] - max).exp() / total;
            let got = p[row * 8 + col] as f64;
            assert!((got - want).abs() <= want / 1024.0 + 1.0 / 65536.0, "p[{row}][{col}] = {got}, reference {want}");
        }
    }
    let t = target();
    let (n, c) = (16u64, &t.costs);
    let expected = cost::binary_half(&t, n, c.cpl_add_half) + cost::softmax(&t, 2, 8) + cost::copy(&t, n * 2, true);
    assert_eq!(report.timeline.cycles(), expected);
}

#[test]
fn a_word_copy_moves_rows_that_start_on_a_word_and_only_those() {
    // x: 4 rows of 6 f16 at stride 18 (a 3-head row's first head: rows 36 bytes apart, every
    // other row 4 bytes past the 8-byte alignment) copied into rows of stride 8 (16 bytes).
    // A 64-bit copy of it is rejected; a word copy moves it bit for bit at the target's
    // per-word cost.
    let (rows, cols) = (4u32, 6u32);
    let mut b = Build::new();
    b.alloc(3, "x", IL, 144, AllocationKind::Data);
    b.alloc(3, "y", IL + 0x100, 64, AllocationKind::Data);
    let call = |words: bool, input: Operand, output: Operand| {
        if words {
            VertexCall::CopyWords { rows, cols, dtype: DType::F16, input, output }
        } else {
            VertexCall::Copy { rows, cols, dtype: DType::F16, input, output }
        }
    };
    b.call(3, 0, call(true, op(IL, 18), op(IL + 0x100, 8)));
    b.steps = vec![Step::Compute { index: 0 }];
    let package = b.finish();
    let x_view = tensor("x", vec![rows, cols], HostRole::Input, (0..rows).map(|r| segment(3, IL + r * 36, r * cols, cols)).collect());
    let y_view = tensor("y", vec![rows, cols], HostRole::Input, (0..rows).map(|r| segment(3, IL + 0x100 + r * 16, r * cols, cols)).collect());
    let mut device = load(&package).unwrap();
    let x = values((rows * cols) as usize, 21);
    device.write_tensor(&x_view, &to_bytes(&x)).unwrap();
    let report = device.run(&[]).unwrap();
    let want: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    assert_eq!(from_bytes(&device.read_tensor(&y_view).unwrap()), want, "the word copy is bit exact");
    let t = target();
    let bytes = (rows * cols * 2) as u64;
    assert_eq!(report.timeline.cycles(), cost::copy_words(&t, bytes));
    assert_eq!(cost::copy_words(&t, bytes), t.costs.kernel_launch + t.costs.copy_overhead + bytes / 4 * t.costs.copy_word_cycles);
    assert!(cost::copy_words(&t, bytes) > cost::copy(&t, bytes, true), "a word copy is slower than a 64-bit one");

    let with = |c: VertexCall| {
        let mut package = package.clone();
        let at = package.tiles.iter().position(|t| t.tile == 3).unwrap();
        edit(&mut package, |x| x.compute_sets[at][0].calls[0] = c.clone());
        load(&package).err()
    };
    // The same rows through the 64-bit copy: row 1 starts 4 bytes past the alignment.
    let err = with(call(false, op(IL, 18), op(IL + 0x100, 8))).expect("a 64-bit copy of word-aligned rows must be rejected");
    assert!(matches!(err, DeviceError::Access { tile: 3, operand: "input", .. }) && err.to_string().contains("row 1 starts unaligned"), "{err}");
    // Half a word off: a start 2 bytes past a word, or rows 2 bytes apart.
    let err = with(call(true, op(IL + 2, 18), op(IL + 0x100, 8))).expect("a word copy from half a word must be rejected");
    assert!(err.to_string().contains("not 4-byte aligned"), "{err}");
    let err = with(call(true, op(IL, 17), op(IL + 0x100, 8))).expect("rows 34 bytes apart must be rejected");
    assert!(err.to_string().contains("row 1 starts unaligned"), "{err}");
    // Rows of 5 f16 (10 bytes) are not whole words.
    let err = with(VertexCall::CopyWords { rows, cols: 5, dtype: DType::F16, input: op(IL, 18), output: op(IL + 0x100, 8) }).expect("rows of half words must be rejected");
    assert!(err.to_string().contains("not whole 32-bit words"), "{err}");
}

#[test]
fn a_copy_of_halves_moves_rows_that_start_inside_a_word() {
    // x: 3 rows of 5 f16 at stride 15 (30 bytes: rows start 2 bytes into a word every other
    // row), from element 1 (2 bytes past the allocation's start), copied into rows of stride 8.
    // Only a copy of halves moves them; it is bit exact at the target's per-element cost.
    let (rows, cols) = (3u32, 5u32);
    let mut b = Build::new();
    b.alloc(6, "x", IL, 96, AllocationKind::Data);
    b.alloc(6, "y", IL + 0x100, 48, AllocationKind::Data);
    b.call(6, 0, VertexCall::CopyHalves { rows, cols, input: op(IL + 2, 15), output: op(IL + 0x100, 8) });
    b.steps = vec![Step::Compute { index: 0 }];
    let package = b.finish();
    let x_view = tensor("x", vec![rows, cols], HostRole::Input, (0..rows).map(|r| segment(6, IL + 2 + r * 30, r * cols, cols)).collect());
    let y_view = tensor("y", vec![rows, cols], HostRole::Input, (0..rows).map(|r| segment(6, IL + 0x100 + r * 16, r * cols, cols)).collect());
    let mut device = load(&package).unwrap();
    let x = values((rows * cols) as usize, 23);
    device.write_tensor(&x_view, &to_bytes(&x)).unwrap();
    let report = device.run(&[]).unwrap();
    let want: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    assert_eq!(from_bytes(&device.read_tensor(&y_view).unwrap()), want, "the copy of halves is bit exact");
    let t = target();
    let elements = (rows * cols) as u64;
    assert_eq!(report.timeline.cycles(), cost::copy_halves(&t, elements));
    assert_eq!(cost::copy_halves(&t, elements), t.costs.kernel_launch + t.costs.copy_overhead + elements * t.costs.copy_word_cycles);
    let with = |c: VertexCall| {
        let mut package = package.clone();
        let at = package.tiles.iter().position(|t| t.tile == 6).unwrap();
        edit(&mut package, |x| x.compute_sets[at][0].calls[0] = c.clone());
        load(&package).err()
    };
    // The same rows through a word copy or a 64-bit copy: rejected at the start.
    let err = with(VertexCall::CopyWords { rows, cols, dtype: DType::F16, input: op(IL + 2, 15), output: op(IL + 0x100, 8) }).expect("a word copy from inside a word must be rejected");
    assert!(err.to_string().contains("not 4-byte aligned") || err.to_string().contains("whole 32-bit words"), "{err}");
    let err = with(VertexCall::Copy { rows, cols, dtype: DType::F16, input: op(IL + 2, 15), output: op(IL + 0x100, 8) }).expect("a 64-bit copy from inside a word must be rejected");
    assert!(matches!(err, DeviceError::Access { tile: 6, operand: "input", .. }), "{err}");
    // A copy of halves outside the tile's memory is refused like any other call.
    let err = with(VertexCall::CopyHalves { rows, cols, input: op(IL + 2, 15), output: op(0x10, 8) }).expect("an output outside memory must be rejected");
    assert!(matches!(err, DeviceError::Access { tile: 6, operand: "output", .. }), "{err}");
}

#[test]
fn a_transpose_writes_each_element_at_its_mirrored_place() {
    // x: 3 rows of 5 at stride 8; t = xᵀ: 5 rows of 3 at stride 4. Costed as the target's
    // transpose: the copy's overhead and the per-element term.
    let (rows, cols) = (3u32, 5u32);
    let mut b = Build::new();
    b.alloc(2, "x", IL, 48, AllocationKind::Data);
    b.alloc(2, "t", IL + 0x100, 40, AllocationKind::Data);
    b.call(2, 0, VertexCall::Transpose { rows, cols, input: op(IL, 8), output: op(IL + 0x100, 4) });
    b.steps = vec![Step::Compute { index: 0 }];
    let x_view = tensor("x", vec![rows, cols], HostRole::Input, (0..rows).map(|r| segment(2, IL + r * 16, r * cols, cols)).collect());
    let t_view = tensor("t", vec![cols, rows], HostRole::Input, (0..cols).map(|c| segment(2, IL + 0x100 + c * 8, c * rows, rows)).collect());
    let mut device = load(&b.finish()).unwrap();
    let x = values((rows * cols) as usize, 11);
    device.write_tensor(&x_view, &to_bytes(&x)).unwrap();
    let report = device.run(&[]).unwrap();
    let got = from_bytes(&device.read_tensor(&t_view).unwrap());
    for r in 0..rows as usize {
        for c in 0..cols as usize {
            assert_eq!(got[c * rows as usize + r], x[r * cols as usize + c].to_f32(), "t[{c}][{r}]");
        }
    }
    let t = target();
    assert_eq!(report.timeline.cycles(), cost::transpose(&t, rows, cols));
    assert_eq!(cost::transpose(&t, rows, cols), t.costs.kernel_launch + t.costs.copy_overhead + 15 * t.costs.transpose_cycles_per_element);
}

#[test]
fn a_softmax_reads_a_panelled_input_with_a_tight_last_panel_as_its_row_major_twin() {
    // 3 rows of 10: one panel of 8 columns (stride 8), then the last 2 columns at their own
    // stride of 4 (72 bytes in all), against the same values row-major (stride 12).
    let (rows, cols, w) = (3u32, 10u32, 8u32);
    let mut b = Build::new();
    b.alloc(5, "xp", IL, 72, AllocationKind::Data);
    for (name, offset) in [("x", 0x100), ("p", 0x200), ("q", 0x300)] {
        b.alloc(5, name, IL + offset, 72, AllocationKind::Data);
    }
    b.call(5, 0, VertexCall::Softmax { rows, cols, scale: 0.5, input: op(IL, w), input_panel: w, output: op(IL + 0x200, 12), reciprocals: None });
    b.call(5, 0, VertexCall::Softmax { rows, cols, scale: 0.5, input: op(IL + 0x100, 12), input_panel: 0, output: op(IL + 0x300, 12), reciprocals: None });
    b.steps = vec![Step::Compute { index: 0 }];
    let row_major = |name: &str, address| tensor(name, vec![rows, cols], HostRole::Input, (0..rows).map(|r| segment(5, address + r * 24, r * cols, cols)).collect());
    let panelled = tensor(
        "xp",
        vec![rows, cols],
        HostRole::Input,
        (0..rows).flat_map(|r| [segment(5, IL + r * w * 2, r * cols, w), segment(5, IL + rows * w * 2 + r * 8, r * cols + w, cols - w)]).collect(),
    );
    let mut device = load(&b.finish()).unwrap();
    let x = values((rows * cols) as usize, 7);
    device.write_tensor(&panelled, &to_bytes(&x)).unwrap();
    device.write_tensor(&row_major("x", IL + 0x100), &to_bytes(&x)).unwrap();
    let report = device.run(&[]).unwrap();
    let p = from_bytes(&device.read_tensor(&row_major("p", IL + 0x200)).unwrap());
    let q = from_bytes(&device.read_tensor(&row_major("q", IL + 0x300)).unwrap());
    assert!(p.iter().all(|v| v.is_finite()));
    assert_eq!(p, q, "the layout of the input changes nothing but where it is read");
    let t = target();
    assert_eq!(report.timeline.cycles(), 2 * cost::scaled_softmax(&t, rows, cols), "the panel layout costs what the row-major one does");

    // The same call with an allocation one row of the last panel too short is rejected.
    let mut b = Build::new();
    b.alloc(5, "xp", IL, 64, AllocationKind::Data);
    b.alloc(5, "p", IL + 0x200, 72, AllocationKind::Data);
    b.call(5, 0, VertexCall::Softmax { rows, cols, scale: 0.5, input: op(IL, w), input_panel: w, output: op(IL + 0x200, 12), reciprocals: None });
    b.steps = vec![Step::Compute { index: 0 }];
    let err = load(&b.finish()).err().expect("a panelled input past its allocation must be rejected");
    assert!(matches!(err, DeviceError::Access { tile: 5, operand: "input", .. }), "{err}");
}

#[test]
fn the_lock_makes_a_second_run_wait_or_give_up() {
    let (package, inputs) = pipeline();
    let dir = tempfile::tempdir().unwrap();
    let lock = dir.path().join("device.lock");
    let held = DeviceLock::acquire(&lock, Duration::from_secs(1)).unwrap();

    let options = RunOptions { lock_path: Some(lock.clone()), lock_timeout: Duration::from_millis(100), ..run_options() };
    let err = runtime::execute(&package, &inputs, &options).expect_err("the lock is held");
    assert!(matches!(err, RunError::Lock(LockError::Timeout { .. })), "{err}");
    assert!(err.to_string().contains("device.lock") && err.to_string().contains("100ms"), "{err}");

    let started = Instant::now();
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(250));
        drop(held);
    });
    let options = RunOptions { lock_timeout: Duration::from_secs(10), ..options };
    runtime::execute(&package, &inputs, &options).expect("the second run waits for the first");
    assert!(started.elapsed() >= Duration::from_millis(200), "it ran before the lock was released");
    releaser.join().unwrap();
}

#[test]
fn bad_host_data_and_foreign_targets_are_errors() {
    let (package, mut inputs) = pipeline();
    inputs.get_mut("a").unwrap().pop();
    let err = runtime::execute(&package, &inputs, &run_options()).err().unwrap();
    assert!(matches!(err, RunError::Input { ref name, .. } if name == "a"), "{err}");

    let (package, _) = pipeline();
    let mut device = Simulator::open(Target::from_toml(fixtures::IPU21, "ipu21.toml").unwrap());
    device.initialize().unwrap();
    assert!(matches!(device.load(&package), Err(DeviceError::TargetMismatch { .. })));
}

#[test]
fn sample_indices_are_spread_evenly_and_capped() {
    assert_eq!(runtime::sample_indices(10, 4), vec![0, 2, 5, 7]);
    assert_eq!(runtime::sample_indices(3, 256), vec![0, 1, 2]);
    assert!(runtime::sample_indices(0, 8).is_empty());
}

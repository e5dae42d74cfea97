//! The simulated IPU: a faithful BSP execution of a package on the machine of a [`Target`].
//!
//! Loading builds the tile memories from the images, decodes each tile's program from its
//! code allocation (vertex records and exchange tables, `ipuq_queries::image`: the package
//! carries no other copy), and checks it against the machine model (allocation rules, every
//! vertex operand, every exchange table); running then executes the
//! steps in order, all tiles of a step in parallel (rayon): a compute step runs each tile's
//! calls of that compute set (`compute.rs`, arithmetic in `kernels.rs`), an exchange step moves
//! words as the tables say (`exchange.rs`). Cycles follow BSP: a compute step costs its
//! slowest tile (`cost::vertex` summed per tile), an exchange step `cost::exchange_phase` of
//! the horizon recomputed from the tables; the run is their sum.
//!
//! This module must not hold a machine constant of its own, must not read the workload, and
//! must not panic on a bad package: every rule violation is a [`DeviceError`].

mod compute;
mod elements;
pub(crate) mod exchange;
mod host;
mod kernels;
mod memory;
mod rules;

use std::collections::BTreeMap;

use ipuq_queries::cost;
use ipuq_queries::package::{HostTensor, Package, Step};
use ipuq_queries::provenance::Provenance;
use ipuq_queries::image::{self, TileProgram};
use ipuq_queries::tables::{self, PackedPhase};
use ipuq_queries::target::Target;
use rayon::prelude::*;

use self::compute::{CheckedSet, Scratch};
use self::exchange::PhasePlan;
use self::memory::TileMemory;
use crate::device::{Device, DeviceError, LoadReport, Probe, RunReport, TileStepRecord, Timeline};

pub use self::memory::POISON;

/// The simulator of one IPU.
pub struct Simulator {
    target: Target,
    /// Which of the target's constants are hardware-measured (from its file's tags).
    provenance: Provenance,
    path: String,
    initialized: bool,
    mark: u64,
    loaded: Option<Loaded>,
}

/// A loaded, checked application.
struct Loaded {
    tiles: Vec<u32>,
    /// Tile id to memory slot.
    slots: Vec<Option<usize>>,
    labels: Vec<String>,
    memories: Vec<TileMemory>,
    /// Per slot: compute set index to its checked calls.
    programs: Vec<BTreeMap<u32, CheckedSet>>,
    phases: BTreeMap<u32, PhasePlan>,
    steps: Vec<Step>,
    /// Exchange phases of the initialize call.
    initialize: Vec<u32>,
}

impl Loaded {
    /// The program step at which the host moves a tensor: inputs before the run (step 0),
    /// outputs after it (the step count).
    fn host_step(&self, after_run: bool) -> u32 {
        if after_run { self.steps.len() as u32 } else { 0 }
    }
}

/// The steps that run each compute set and each exchange phase.
fn step_lists(steps: &[Step]) -> (BTreeMap<u32, Vec<u32>>, BTreeMap<u32, Vec<u32>>) {
    let (mut sets, mut phases): (BTreeMap<u32, Vec<u32>>, BTreeMap<u32, Vec<u32>>) = Default::default();
    for (s, step) in steps.iter().enumerate() {
        match *step {
            Step::Compute { index } => sets.entry(index).or_default().push(s as u32),
            Step::Exchange { phase } => phases.entry(phase).or_default().push(s as u32),
        }
    }
    (sets, phases)
}

impl Simulator {
    /// Open a simulator of `target` ("simulator:<target name>"). Without provenance (see
    /// [`Simulator::with_provenance`]) every cycle counts as priced by an unmeasured formula.
    pub fn open(target: Target) -> Simulator {
        let path = format!("simulator:{}", target.name);
        tracing::info!(path = %path, "opening IPU device");
        tracing::info!(path = %path, "IPU device attached");
        Simulator { target, provenance: Provenance::default(), path, initialized: false, mark: 0, loaded: None }
    }

    /// The provenance tags of the target's constants, read from its description file.
    pub fn with_provenance(mut self, provenance: Provenance) -> Simulator {
        self.provenance = provenance;
        self
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    fn loaded(&self, action: &'static str) -> Result<&Loaded, DeviceError> {
        self.loaded.as_ref().ok_or(DeviceError::NotLoaded { action })
    }

    fn slot_table(&self, package: &Package) -> Result<Vec<Option<usize>>, DeviceError> {
        let mut slots = vec![None; self.target.chip.tiles as usize];
        for (slot, image) in package.tiles.iter().enumerate() {
            let entry = slots.get_mut(image.tile as usize).ok_or_else(|| DeviceError::Load {
                tile: image.tile,
                message: format!("the target has only {} tiles", self.target.chip.tiles),
            })?;
            if entry.replace(slot).is_some() {
                return Err(DeviceError::Load { tile: image.tile, message: "the package has two images for this tile".into() });
            }
        }
        Ok(slots)
    }
}

fn host_slots(loaded: &Loaded, tensor: &HostTensor, step: u32) -> Result<Vec<usize>, DeviceError> {
    host::check_segments(tensor, &loaded.slots, &loaded.memories, &loaded.labels, step)
}

impl Device for Simulator {
    fn name(&self) -> &str {
        "simulator"
    }

    fn path(&self) -> &str {
        &self.path
    }

    fn initialize(&mut self) -> Result<(), DeviceError> {
        tracing::info!("initializing IPU device");
        self.loaded = None;
        self.mark = 0;
        self.initialized = true;
        tracing::info!("IPU device initialized");
        Ok(())
    }

    /// The simulator's configuration is the tile map and each tile's exchange table binding
    /// per phase: one write per tile and one per (phase, tile) binding its runtime header counts
    /// (a header that cannot be read counts none here: loading rejects it).
    fn replay_configuration(&mut self, package: &Package) -> Result<u64, DeviceError> {
        let slots = self.slot_table(package)?;
        let tiles = slots.iter().flatten().count() as u64;
        let bindings: u64 = package.tiles.iter().filter_map(|t| image::header_of(&package.shared_segments, t)).map(|h| h.bindings as u64).sum();
        let register_writes = tiles + bindings;
        tracing::info!(register_writes, "replaying device configuration");
        Ok(register_writes)
    }

    fn load(&mut self, package: &Package) -> Result<LoadReport, DeviceError> {
        if !self.initialized {
            return Err(DeviceError::NotInitialized);
        }
        let _span = tracing::info_span!("ipuq.device.load").entered();
        let expected = self.target.digest();
        if package.target_digest != expected {
            return Err(DeviceError::TargetMismatch {
                package: package.target_digest.short(),
                device: format!("`{}`, target digest {}", self.target.name, expected.short()),
            });
        }
        let tile_count = package.tile_count();
        let final_mark = self.mark + 1;
        tracing::info!(tile_count, final_mark, "loading application");
        self.loaded = None;
        let target = &self.target;
        let provenance = &self.provenance;
        let labels = &package.labels;
        let slots = self.slot_table(package)?;
        let (set_steps, mut phase_steps) = step_lists(&package.steps);
        // The initialize call's phases run after the host writes, before step 0: storage
        // live at step 0 is what they may touch.
        for (i, &phase) in package.host.initialize.iter().enumerate() {
            if package.host.initialize[..i].contains(&phase) || phase_steps.contains_key(&phase) || !package.phases.iter().any(|p| p.index == phase) {
                let message = format!("initialize phase {phase} is repeated, also a step of the run, or not in the package");
                return Err(DeviceError::Program { step: 0, message });
            }
            phase_steps.insert(phase, vec![0]);
        }
        let no_steps = Vec::new();
        let memories: Vec<TileMemory> =
            package.tiles.par_iter().map(|image| TileMemory::load(target, image, &package.shared_segments, labels)).collect::<Result<_, _>>()?;
        // The tile images are the program: each tile's vertex records and exchange tables are
        // decoded from its loaded code allocation, once per load.
        let step_count = package.steps.len() as u32;
        let decoded: Vec<TileProgram> = package
            .tiles
            .par_iter()
            .zip(memories.par_iter())
            .map(|(image, memory)| {
                let fail = |message: String| DeviceError::Load { tile: image.tile, message };
                let (start, end) = image::code_range(image).map_err(fail)?;
                let code = memory.range(start, (end - start) as usize);
                image::decode_program(code, start, image.tile, step_count).map(|(_, program)| program).map_err(fail)
            })
            .collect::<Result<_, _>>()?;
        let programs: Vec<BTreeMap<u32, CheckedSet>> = package
            .tiles
            .par_iter()
            .zip(memories.par_iter())
            .zip(decoded.par_iter())
            .map(|((image, memory), program)| {
                let mut sets = BTreeMap::new();
                for set in &program.compute_sets {
                    let steps = set_steps.get(&set.index).unwrap_or(&no_steps);
                    let checked = compute::check_set(target, provenance, memory, set, labels, steps)?;
                    if sets.insert(set.index, checked).is_some() {
                        let message = format!("compute set {} appears twice", set.index);
                        return Err(DeviceError::Load { tile: image.tile, message });
                    }
                }
                Ok(sets)
            })
            .collect::<Result<_, _>>()?;
        // Each phase's tables, gathered from the tiles' bindings.
        let mut packed: BTreeMap<u32, PackedPhase> = BTreeMap::new();
        for p in &package.phases {
            let phase = PackedPhase { index: p.index, tiles: Vec::new(), horizon: p.horizon, endpoint_lower_bound: p.endpoint_lower_bound };
            if packed.insert(p.index, phase).is_some() {
                return Err(DeviceError::Exchange { phase: p.index, tile: 0, cycle: 0, message: "two exchange phases share this index".into() });
            }
        }
        for (image, program) in package.tiles.iter().zip(decoded) {
            for (phase, table) in program.tables {
                let Some(p) = packed.get_mut(&phase) else {
                    let message = format!("the tile's exchange tables bind phase {phase}, which the package does not have");
                    return Err(DeviceError::Exchange { phase, tile: image.tile, cycle: 0, message });
                };
                p.tiles.push(table);
            }
        }
        let checked: Vec<(u32, PhasePlan)> = packed
            .into_par_iter()
            .map(|(_, mut packed)| {
                packed.tiles.sort_by_key(|t| t.tile);
                let steps = phase_steps.get(&packed.index).unwrap_or(&no_steps);
                exchange::check_runs(target, &packed, &slots, &memories, labels, steps)?;
                // The device executes the run descriptors: it expands them itself.
                let phase = &tables::unpack_phase(&packed, tables::MAX_PHASE_ENTRIES)
                    .map_err(|(tile, message)| DeviceError::Exchange { phase: packed.index, tile, cycle: 0, message: format!("exchange table: {message}") })?;
                let plan = exchange::check_phase(target, phase, &slots, &memories, labels, steps)?;
                elements::check(target, phase)?;
                Ok((phase.index, plan))
            })
            .collect::<Result<_, DeviceError>>()?;
        let phases: BTreeMap<u32, PhasePlan> = checked.into_iter().collect();
        for (step, s) in package.steps.iter().enumerate() {
            if let Step::Exchange { phase } = s {
                if !phases.contains_key(phase) {
                    return Err(DeviceError::Program { step, message: format!("exchange phase {phase} is not in the package") });
                }
            }
        }
        let tiles = package.tiles.iter().map(|t| t.tile).collect();
        let initialize = package.host.initialize.clone();
        self.loaded = Some(Loaded { tiles, slots, labels: labels.clone(), memories, programs, phases, steps: package.steps.clone(), initialize });
        self.mark = final_mark;
        tracing::info!(tile_count, "application loaded and initial synchronization completed");
        Ok(LoadReport { tile_count, final_mark })
    }

    fn write_tensor(&mut self, tensor: &HostTensor, bytes: &[u8]) -> Result<u64, DeviceError> {
        let loaded = self.loaded.as_mut().ok_or(DeviceError::NotLoaded { action: "writing a tensor" })?;
        let (_, total) = host::tensor_size(tensor)?;
        if bytes.len() as u64 != total {
            let message = format!("host supplied {} bytes, the tensor has {total} ({:?} {})", bytes.len(), tensor.shape, tensor.dtype.name());
            return Err(DeviceError::Host { tensor: tensor.name.clone(), message });
        }
        let slots = host_slots(loaded, tensor, loaded.host_step(false))?;
        Ok(host::write(tensor, &slots, &mut loaded.memories, bytes))
    }

    fn read_tensor(&self, tensor: &HostTensor) -> Result<Vec<u8>, DeviceError> {
        let loaded = self.loaded("reading a tensor")?;
        host::read(tensor, &host_slots(loaded, tensor, loaded.host_step(true))?, &loaded.memories)
    }

    fn run_initialize(&mut self) -> Result<u64, DeviceError> {
        let loaded = self.loaded.as_mut().ok_or(DeviceError::NotLoaded { action: "running the initialize phases" })?;
        let mut cycles = 0u64;
        for phase in &loaded.initialize {
            let plan = &loaded.phases[phase];
            exchange::execute(plan, &mut loaded.memories);
            cycles += cost::exchange_phase(&self.target, plan.horizon);
            self.mark += 1;
        }
        Ok(cycles)
    }

    fn run(&mut self, probes: &[Probe<'_>]) -> Result<RunReport, DeviceError> {
        let _span = tracing::info_span!("ipuq.device.run").entered();
        let loaded = self.loaded.as_mut().ok_or(DeviceError::NotLoaded { action: "running" })?;
        let mut probe_slots = Vec::with_capacity(probes.len());
        for p in probes {
            if p.after_step as usize >= loaded.steps.len() {
                let message = format!("checkpoint `{}` is read after step {}, but the program has {} steps", p.tensor.name, p.after_step, loaded.steps.len());
                return Err(DeviceError::Program { step: p.after_step as usize, message });
            }
            probe_slots.push(host_slots(loaded, p.tensor, p.after_step)?);
        }
        let target = &self.target;
        let tiles = loaded.tiles.len();
        let mut steps = Vec::with_capacity(loaded.steps.len());
        let mut records = Vec::with_capacity(loaded.steps.len() * tiles);
        let mut samples = vec![Vec::new(); probes.len()];
        let (mut unmeasured_cycles, mut executed_flops) = (0u64, 0u64);
        let exchange_measured = self.provenance.measured(cost::EXCHANGE_CONSTANTS);
        for (s, step) in loaded.steps.iter().enumerate() {
            match *step {
                Step::Compute { index } => {
                    loaded.memories.par_iter_mut().zip(loaded.programs.par_iter()).for_each(|(memory, program)| {
                        memory.begin_step(s as u32);
                        if let Some(set) = program.get(&index) {
                            let mut scratch = Scratch::default();
                            for call in &set.calls {
                                compute::execute(memory, call, &mut scratch);
                            }
                        }
                    });
                    let own: Vec<u64> = loaded.programs.iter().map(|p| p.get(&index).map_or(0, |set| set.cycles)).collect();
                    let cycles = own.iter().copied().max().unwrap_or(0);
                    // The step costs its slowest tile: its share priced by unmeasured formulas.
                    let slowest = own.iter().position(|&c| c == cycles).and_then(|slot| loaded.programs[slot].get(&index));
                    unmeasured_cycles += slowest.map_or(0, |set| set.unmeasured);
                    executed_flops += loaded.programs.iter().filter_map(|p| p.get(&index)).map(|set| set.flops).sum::<u64>();
                    records.extend(own.iter().map(|&compute| TileStepRecord { compute, idle: cycles - compute, ..Default::default() }));
                    steps.push((*step, cycles));
                }
                Step::Exchange { phase } => {
                    let plan = &loaded.phases[&phase];
                    loaded.memories.par_iter_mut().for_each(|memory| memory.begin_step(s as u32));
                    exchange::execute(plan, &mut loaded.memories);
                    let sync = target.exchange.sync_cycles;
                    let cycles = cost::exchange_phase(target, plan.horizon);
                    if !exchange_measured {
                        unmeasured_cycles += cycles;
                    }
                    let horizon = plan.horizon as u64;
                    // A tile's own runs end by the horizon unless it sends words nobody receives.
                    records.extend(plan.busy.iter().map(|&own| {
                        let exchange = own.min(horizon);
                        TileStepRecord { exchange, sync, idle: horizon - exchange, compute: 0 }
                    }));
                    steps.push((*step, cycles));
                    self.mark += 1;
                }
            }
            for (i, p) in probes.iter().enumerate() {
                if p.after_step as usize == s {
                    samples[i] = host::sample(p.tensor, &probe_slots[i], &loaded.memories, p.indices)?;
                }
            }
        }
        let timeline = Timeline { clock_hz: target.chip.clock_hz, tiles: loaded.tiles.clone(), steps, records };
        Ok(RunReport { timeline, samples, unmeasured_cycles, executed_flops })
    }

    fn sync_mark(&self) -> u64 {
        self.mark
    }
}

//! Devices that run an application package: the interface, and the simulator behind it.
//!
//! A [`Device`] is opened, initialised, configured, loaded with a [`Package`], written by the
//! host, run, and read back: the same steps a hardware backend takes (`opening IPU device`, …),
//! so the runtime in `runtime.rs` drives any backend through this trait alone. The simulator
//! (`simulator/`) is the default and, for now, the only backend.
//!
//! Architecture Invariant: a device executes only what is in the package (tile images,
//! programs, exchange tables, host tables). It never reads the workload text, never computes a
//! reference, and never decides what to sample: the runtime asks for samples by index.

pub mod lock;
pub mod simulator;

use ipuq_queries::package::{HostTensor, Package, Step};
use ipuq_queries::provenance::Provenance;
use ipuq_queries::target::Target;

pub use simulator::Simulator;

/// What a device reports about a load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadReport {
    pub tile_count: u32,
    /// The device's global sync counter after the initial synchronisation.
    pub final_mark: u64,
}

/// A request to sample a host-visible tensor right after a step of the program.
#[derive(Clone, Copy, Debug)]
pub struct Probe<'a> {
    /// Index into `Package::steps`: the values are read after this step.
    pub after_step: u32,
    pub tensor: &'a HostTensor,
    /// Flat row-major element indices.
    pub indices: &'a [u64],
}

/// Cycles of one (tile, step) pair. Their sum equals the step's cycles for every tile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TileStepRecord {
    /// Vertex cycles of this tile in a compute step.
    pub compute: u64,
    /// In an exchange step: the end of this tile's own last send or receive.
    pub exchange: u64,
    /// The global sync that opens an exchange step.
    pub sync: u64,
    /// Waiting for the slowest tile.
    pub idle: u64,
}

impl TileStepRecord {
    pub fn busy(&self) -> u64 {
        self.compute + self.exchange + self.sync
    }
}

/// The cycle accounting of one run: per step its cost, per (tile, step) a record.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    pub clock_hz: u64,
    /// Tile ids, in the package's tile order.
    pub tiles: Vec<u32>,
    /// The program's steps and what each cost (the slowest tile, or sync plus horizon).
    pub steps: Vec<(Step, u64)>,
    /// Step-major: `records[step * tiles.len() + tile_slot]`.
    pub records: Vec<TileStepRecord>,
}

impl Timeline {
    /// BSP total: the sum of the steps' cycles.
    pub fn cycles(&self) -> u64 {
        self.steps.iter().map(|(_, c)| c).sum()
    }

    pub fn record(&self, step: usize, tile_slot: usize) -> TileStepRecord {
        self.records[step * self.tiles.len() + tile_slot]
    }

    /// A tile's own busy cycles: its compute, plus per exchange step the sync and the end of
    /// its own last send or receive (idle waiting for other tiles excluded).
    pub fn tile_busy(&self, tile_slot: usize) -> u64 {
        (0..self.steps.len()).map(|s| self.record(s, tile_slot).busy()).sum()
    }

    /// Tiles that ran at least one vertex call.
    pub fn active_tiles(&self) -> u32 {
        let tiles = self.tiles.len();
        (0..tiles).filter(|&t| (0..self.steps.len()).any(|s| self.record(s, t).compute > 0)).count() as u32
    }

    /// `minimumTileCycles`: the smallest [`Timeline::tile_busy`] over the tiles that run at
    /// least one vertex (over all tiles when none does). A tile without compute work would
    /// only measure the syncs, which says nothing about balance.
    pub fn minimum_tile_cycles(&self) -> u64 {
        let tiles = self.tiles.len();
        let active = |slot: usize| (0..self.steps.len()).any(|s| self.record(s, slot).compute > 0);
        let busy = (0..tiles).filter(|&t| active(t)).map(|t| self.tile_busy(t)).min();
        busy.or_else(|| (0..tiles).map(|t| self.tile_busy(t)).min()).unwrap_or(0)
    }
}

/// What `run` returns: the timeline and the sampled values, one vector per probe.
#[derive(Clone, Debug)]
pub struct RunReport {
    pub timeline: Timeline,
    pub samples: Vec<Vec<f32>>,
    /// Cycles of the run priced by formulas whose target constants are not all `[MEAS]`.
    pub unmeasured_cycles: u64,
    /// Floating-point operations of the matrix products the device executed (2 m k n each).
    pub executed_flops: u64,
}

/// Everything that can go wrong on a device. On hardware most of these would be a hang or
/// silent corruption; the simulator names the place instead.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("package was compiled for target digest {package} but the device models {device}: refused (run with --device-target naming the machine the package was built for)")]
    TargetMismatch { package: String, device: String },
    #[error("device not initialised: initialise it before loading a package")]
    NotInitialized,
    #[error("no application loaded: load a package before {action}")]
    NotLoaded { action: &'static str },
    #[error("loading tile {tile}: {message}")]
    Load { tile: u32, message: String },
    #[error("tile {tile}, compute set {compute_set}, call {call} ({vertex}): operand `{operand}` range [{start:#x}, {end:#x}) {problem}")]
    Access {
        tile: u32,
        compute_set: u32,
        call: usize,
        vertex: &'static str,
        operand: &'static str,
        start: u64,
        end: u64,
        problem: String,
    },
    #[error("exchange phase {phase}, tile {tile}, cycle {cycle}: {message}")]
    Exchange { phase: u32, tile: u32, cycle: u64, message: String },
    #[error("program step {step}: {message}")]
    Program { step: usize, message: String },
    #[error("host tensor `{tensor}`: {message}")]
    Host { tensor: String, message: String },
}

/// A device that can run ipuq packages. The runtime calls these in order: `initialize`,
/// `replay_configuration`, `load`, then any number of `write_tensor`, `run`, `read_tensor`.
pub trait Device: Send {
    /// Short name for reports ("simulator").
    fn name(&self) -> &str;
    /// The path the device was opened at ("simulator:ipu21" for the simulator).
    fn path(&self) -> &str;
    /// Bring the device to a known state.
    fn initialize(&mut self) -> Result<(), DeviceError>;
    /// Write the per-tile configuration the package needs; returns the number of writes.
    fn replay_configuration(&mut self, package: &Package) -> Result<u64, DeviceError>;
    /// Load the tile images and programs, then synchronise all tiles once.
    fn load(&mut self, package: &Package) -> Result<LoadReport, DeviceError>;
    /// Scatter a tensor's row-major little-endian bytes into every segment (replicas included);
    /// returns the bytes streamed to the device.
    fn write_tensor(&mut self, tensor: &HostTensor, bytes: &[u8]) -> Result<u64, DeviceError>;
    /// Run the initialize call's exchange phases (replicating what the host wrote once);
    /// returns their cycles, which are not part of the run's.
    fn run_initialize(&mut self) -> Result<u64, DeviceError>;
    /// Execute the package's steps once, sampling the probes after their steps.
    fn run(&mut self, probes: &[Probe<'_>]) -> Result<RunReport, DeviceError>;
    /// Gather a tensor's row-major little-endian bytes.
    fn read_tensor(&self, tensor: &HostTensor) -> Result<Vec<u8>, DeviceError>;
    /// The global sync counter: one per synchronisation since the device was initialised.
    fn sync_mark(&self) -> u64;
}

/// Open the default device for a target: the simulator of that machine.
pub fn open_default(target: &Target, provenance: &Provenance) -> Result<Box<dyn Device>, DeviceError> {
    Ok(Box::new(Simulator::open(target.clone()).with_provenance(provenance.clone())))
}

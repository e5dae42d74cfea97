//! The host side of a run: take the device, load the package, stream inputs and weights in
//! ("initialize"), execute ("run"), read outputs and checkpoint samples back, write the profile.
//!
//! The session follows the seed's host exchange protocol and log lines: `starting host
//! exchange session startup_mark=…`, `attaching host exchange pages pages=…` (the pages the
//! session's transfers fill: bytes streamed in and out over `target.host.page_bytes`),
//! `invoking streaming host exchange call call="initialize"|"run" command=… phases=…`
//! ("initialize" has one phase per host tensor written, "run" one per program step).
//!
//! This module must not make input data or compute a reference (the caller does, from the
//! workload), and must not depend on which backend runs the package: it drives a `Device`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ipuq_queries::package::{HostRole, Package};
use ipuq_queries::provenance::Provenance;
use ipuq_queries::target::{fixtures, Target, TargetError};

use crate::device::lock::{DeviceLock, LockError};
use crate::device::{self, DeviceError, Probe};
use crate::profile::{self, ProfileError};

/// The machine a device simulates: its description and the provenance tags of its constants.
#[derive(Clone, Debug)]
pub struct DeviceTarget {
    pub target: Target,
    pub provenance: Provenance,
    /// Where the description came from ("ipu21 (built in)", a file path).
    pub origin: String,
}

impl DeviceTarget {
    /// Parse a target description file's text (comments carry the provenance tags).
    pub fn from_text(text: &str, origin: &str) -> Result<DeviceTarget, TargetError> {
        let target = Target::from_toml(text, origin)?;
        Ok(DeviceTarget { target, provenance: Provenance::from_target_text(text), origin: origin.to_string() })
    }

    /// ipuq's own description of the machine a package names (by the name inside the
    /// package's target): the device never takes its machine from the package.
    pub fn built_in_for(package: &Package) -> Result<DeviceTarget, RunError> {
        let named = Target::from_toml(&package.target_toml, "the package's target")?;
        for (text, origin) in [(fixtures::IPU21, "ipu21 (built in)"), (fixtures::SMALL16, "small16 (built in)")] {
            let built_in = DeviceTarget::from_text(text, origin)?;
            if built_in.target.name == named.name {
                return Ok(built_in);
            }
        }
        Err(RunError::UnknownMachine { name: named.name })
    }
}

/// How to run a package.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The machine the device simulates; `None`: ipuq's built-in description of the machine
    /// the package names ([`DeviceTarget::built_in_for`]).
    pub device_target: Option<DeviceTarget>,
    /// Sample the package's checkpoint tensors right after the steps that complete them.
    pub checkpoints: bool,
    /// At most this many samples per checkpoint tensor.
    pub sample_limit: usize,
    /// Write the execution profile here (`execution.ipuprofile`).
    pub profile_path: Option<PathBuf>,
    /// Take exclusive ownership of the device through this lock file (`device.lock`).
    pub lock_path: Option<PathBuf>,
    /// How long to wait for the lock before giving up.
    pub lock_timeout: Duration,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions { device_target: None, checkpoints: false, sample_limit: 256, profile_path: None, lock_path: None, lock_timeout: Duration::from_secs(600) }
    }
}

/// Sampled elements of one checkpoint tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointSamples {
    pub operation: u32,
    pub name: String,
    /// Flat row-major element indices.
    pub indices: Vec<u64>,
    pub values: Vec<f32>,
}

/// What a run returns.
#[derive(Clone, Debug)]
pub struct RunResult {
    /// Row-major little-endian bytes of each output, by host tensor name.
    pub outputs: BTreeMap<String, Vec<u8>>,
    pub checkpoints: Vec<CheckpointSamples>,
    /// BSP total of the run.
    pub cycles: u64,
    /// See [`crate::device::Timeline::minimum_tile_cycles`].
    pub minimum_tile_cycles: u64,
    /// Cycles of the initialize call's exchange phases (weights replicated on the device at
    /// load time), not part of `cycles`.
    pub initialize_cycles: u64,
    /// Bytes streamed to the device for `Input` host tensors, replicas counted.
    pub input_bytes: u64,
    /// Bytes streamed to the device for `Weight` host tensors, replicas counted.
    pub weight_bytes: u64,
    /// Bytes read back from the device (outputs).
    pub output_bytes: u64,
    /// See [`crate::device::RunReport::unmeasured_cycles`].
    pub unmeasured_cycles: u64,
    /// See [`crate::device::RunReport::executed_flops`].
    pub executed_flops: u64,
    /// Tiles that ran at least one vertex call.
    pub active_tiles: u32,
    /// The machine the device simulated.
    pub target_name: String,
    pub target_digest: String,
    /// Bytes per second of the device target's host link.
    pub host_link_bytes_per_second: u64,
    /// The profile written: path, tiles, samples.
    pub profile: Option<(PathBuf, u32, u64)>,
    /// The device that ran ("simulator").
    pub device: String,
    /// Wall time of the whole run, lock wait included.
    pub wall: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("package's embedded target description: {0}")]
    Target(#[from] TargetError),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("device: {0}")]
    Device(#[from] DeviceError),
    #[error("input `{name}`: {message}")]
    Input { name: String, message: String },
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("the package names machine `{name}`, which ipuq has no built-in description of: name its target description with --device-target FILE")]
    UnknownMachine { name: String },
}

/// At most `limit` flat indices, evenly spread over `elements` (deterministic, increasing,
/// distinct, starting at 0).
pub fn sample_indices(elements: u64, limit: usize) -> Vec<u64> {
    let count = elements.min(limit as u64);
    (0..count).map(|i| (i as u128 * elements as u128 / count as u128) as u64).collect()
}

fn expected_bytes(shape: &[u32], element_bytes: u32) -> Option<u64> {
    shape.iter().try_fold(element_bytes as u64, |n, &d| n.checked_mul(d as u64))
}

fn check_inputs(package: &Package, inputs: &BTreeMap<String, Vec<u8>>) -> Result<(), RunError> {
    for tensor in &package.host.inputs {
        let input_error = |message: String| RunError::Input { name: tensor.name.clone(), message };
        let data = inputs.get(&tensor.name).ok_or_else(|| input_error("the package needs it but no data was given".into()))?;
        let expected = expected_bytes(&tensor.shape, tensor.dtype.bytes()).ok_or_else(|| input_error("shape overflows".into()))?;
        if data.len() as u64 != expected {
            return Err(input_error(format!("{} bytes given, shape {:?} of {} needs {expected}", data.len(), tensor.shape, tensor.dtype.name())));
        }
    }
    if let Some(extra) = inputs.keys().find(|name| !package.host.inputs.iter().any(|t| &t.name == *name)) {
        return Err(RunError::Input { name: extra.clone(), message: "the package has no such input".into() });
    }
    Ok(())
}

/// Run a package once on the default device (the simulator) of the device target.
pub fn execute(package: &Package, inputs: &BTreeMap<String, Vec<u8>>, options: &RunOptions) -> Result<RunResult, RunError> {
    let started = Instant::now();
    let _span = tracing::info_span!("ipuq.runtime.execute", tile_count = package.tile_count()).entered();
    let device_target = match &options.device_target {
        Some(t) => t.clone(),
        None => DeviceTarget::built_in_for(package)?,
    };
    let target = &device_target.target;
    tracing::info!(target = %target.name, origin = %device_target.origin, digest = %target.digest().short(), "device target");
    check_inputs(package, inputs)?;
    let _lock = options.lock_path.as_deref().map(|path| DeviceLock::acquire(path, options.lock_timeout)).transpose()?;

    let mut device = device::open_default(target, &device_target.provenance)?;
    device.initialize()?;
    device.replay_configuration(package)?;
    device.load(package)?;

    let element_bytes = |t: &ipuq_queries::package::HostTensor| t.streamed_elements() * t.dtype.bytes() as u64;
    let streamed_in: u64 = package.host.inputs.iter().map(element_bytes).sum();
    let streamed_out: u64 = package.host.outputs.iter().map(element_bytes).sum();
    let startup_mark = device.sync_mark();
    tracing::info!(startup_mark, "starting host exchange session");
    let pages = (streamed_in + streamed_out).div_ceil(target.host.page_bytes.max(1)).max(1);
    tracing::info!(pages, "attaching host exchange pages");
    tracing::info!("host exchange session started");

    let phases = package.host.inputs.len() + package.host.initialize.len();
    tracing::info!(call = "initialize", command = 0, phases, "invoking streaming host exchange call");
    let (mut input_bytes, mut weight_bytes) = (0u64, 0u64);
    let writes = tracing::info_span!("ipuq.runtime.write_tensors").entered();
    for tensor in &package.host.inputs {
        let bytes = device.write_tensor(tensor, &inputs[&tensor.name])?;
        match tensor.role {
            HostRole::Weight => weight_bytes += bytes,
            HostRole::Input | HostRole::Output | HostRole::Intermediate => input_bytes += bytes,
        }
    }
    drop(writes);
    let initialize_cycles = tracing::info_span!("ipuq.device.initialize_phases").in_scope(|| device.run_initialize())?;

    let checkpoints: Vec<_> = if options.checkpoints { package.host.checkpoints.iter().collect() } else { Vec::new() };
    let mut indices = Vec::with_capacity(checkpoints.len());
    for c in &checkpoints {
        let elements = expected_bytes(&c.tensor.shape, 1).ok_or_else(|| RunError::Input { name: c.tensor.name.clone(), message: "shape overflows".into() })?;
        indices.push(sample_indices(elements, options.sample_limit));
    }
    let probes: Vec<Probe<'_>> =
        checkpoints.iter().zip(&indices).map(|(c, i)| Probe { after_step: c.after_step, tensor: &c.tensor, indices: i }).collect();
    tracing::info!(call = "run", command = 1, phases = package.steps.len(), "invoking streaming host exchange call");
    let report = device.run(&probes)?;

    let mut outputs = BTreeMap::new();
    let mut output_bytes = 0u64;
    for tensor in &package.host.outputs {
        let bytes = device.read_tensor(tensor)?;
        output_bytes += bytes.len() as u64;
        outputs.insert(tensor.name.clone(), bytes);
    }
    let checkpoints = checkpoints
        .iter()
        .zip(indices)
        .zip(report.samples)
        .map(|((c, indices), values)| CheckpointSamples { operation: c.operation, name: c.tensor.name.clone(), indices, values })
        .collect();
    let timeline = report.timeline;
    let profile = match &options.profile_path {
        Some(path) => {
            let samples = profile::write(path, &timeline)?;
            let tiles = timeline.tiles.len() as u32;
            tracing::info!(profile = %path.display(), tiles, samples, "wrote execution profile");
            Some((path.clone(), tiles, samples))
        }
        None => None,
    };
    Ok(RunResult {
        outputs,
        checkpoints,
        cycles: timeline.cycles(),
        minimum_tile_cycles: timeline.minimum_tile_cycles(),
        initialize_cycles,
        input_bytes,
        weight_bytes,
        output_bytes,
        unmeasured_cycles: report.unmeasured_cycles,
        executed_flops: report.executed_flops,
        active_tiles: timeline.active_tiles(),
        target_name: target.name.clone(),
        target_digest: target.digest().short(),
        host_link_bytes_per_second: target.host.link_bytes_per_second,
        profile,
        device: device.name().to_string(),
        wall: started.elapsed(),
    })
}

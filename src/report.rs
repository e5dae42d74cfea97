//! `ipuq run`: make the inputs, execute the package on the device, compare with the host
//! reference, and print the seed's result, checkpoint and verdict lines.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipuq_queries::ir::{Graph, OpKind, Producer};
use ipuq_queries::package::Package;

use crate::reference::ReferenceMemo;
use crate::runtime::{execute, DeviceTarget, RunOptions};
use crate::verify::{check_samples, compare_bytes, Tolerance};
use crate::workload::data::{decode, tensor_data_cached, tensor_data_with, TensorCache};
use crate::workload::npy::write_npy;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Pass = 0,
    NumericalFailure = 1,
}

pub struct RunRequest {
    /// The machine the simulator models: the description `--device-target FILE|ipu21|small16`
    /// names, as read (text, origin; `ipuq watch` hands over the bytes its build read);
    /// `None`: the built-in machine the package names.
    pub device_target: Option<(String, String)>,
    pub checkpoints: bool,
    pub sample_limit: usize,
    pub dump: Option<PathBuf>,
    pub lock_timeout: Duration,
    pub workload_folder: PathBuf,
    /// `--input NAME=FILE.npy`: values that replace those inputs' initialisers.
    pub inputs: Vec<(String, PathBuf)>,
}

/// The seed's order of family fields in the result line; other fields follow alphabetically.
const FIELD_ORDER: &[&str] = &["benchmark", "batch", "tokens", "rows", "dimension", "hiddenDimension", "blocks", "biases", "heads", "kvHeads", "headDimension"];

fn family_fields(graph: &Graph) -> String {
    let family = &graph.file.family;
    let known = FIELD_ORDER.iter().filter_map(|k| family.get_key_value(*k));
    let others = family.iter().filter(|(k, _)| !FIELD_ORDER.contains(&k.as_str()));
    known.chain(others).map(|(k, v)| format!(" {k}={}", v.to_string().trim_matches('"'))).collect()
}

/// Floating-point operations of the workload's matrix products (2 m k n per output batch),
/// from the workload alone: what the efficiency figure divides by, whatever the package says.
pub fn workload_gemm_flops(graph: &Graph) -> u64 {
    graph
        .operations
        .iter()
        .filter(|o| matches!(o.kind, OpKind::MatMul { .. }))
        .map(|o| {
            let k = o.inputs.first().and_then(|&a| graph.value(a).shape.last().copied()).unwrap_or(0);
            2 * graph.value(o.output).elements() * k as u64
        })
        .sum()
}

pub fn run_and_verify(package: &Package, package_path: &Path, request: &RunRequest) -> Result<Outcome, String> {
    run_and_verify_cached(package, package_path, request, None)
}

/// What a long-lived session (`ipuq watch --run`) keeps from one run to the next: the
/// tensors drawn from seeded initialisers and the host reference's operation values.
#[derive(Default)]
pub struct RunCaches {
    pub tensors: TensorCache,
    pub reference: ReferenceMemo,
}

/// As [`run_and_verify`], reusing what `caches` holds from earlier runs: tensors whose
/// declarations did not change, reference operations whose inputs did not change.
pub fn run_and_verify_cached(package: &Package, package_path: &Path, request: &RunRequest, caches: Option<&mut RunCaches>) -> Result<Outcome, String> {
    let (cache, memo) = match caches {
        Some(c) => (Some(&mut c.tensors), Some(&mut c.reference)),
        None => (None, None),
    };
    let device_target = match &request.device_target {
        Some((text, origin)) => DeviceTarget::from_text(text, origin).map_err(|e| e.to_string())?,
        None => DeviceTarget::built_in_for(package).map_err(|e| e.to_string())?,
    };
    let target = device_target.target.clone();
    let graph = Graph::parse(&package.workload_toml, &format!("{} (embedded workload)", package_path.display())).map_err(|e| e.to_string())?;
    let given = crate::workload::given::given_inputs(&graph, &request.inputs)?;
    let data = tracing::info_span!("ipuq.run.tensor_data")
        .in_scope(|| match cache {
            Some(cache) => tensor_data_cached(&graph, &request.workload_folder, given, cache),
            None => tensor_data_with(&graph, &request.workload_folder, given),
        })
        .map_err(|e| e.to_string())?;
    let inputs: BTreeMap<String, Vec<u8>> = data.iter().map(|(name, d)| (name.clone(), d.bytes.clone())).collect();
    let folder = package_path.parent().map(Path::to_path_buf).unwrap_or_default();
    let options = RunOptions {
        device_target: Some(device_target),
        checkpoints: request.checkpoints,
        sample_limit: request.sample_limit,
        profile_path: Some(folder.join("execution.ipuprofile")),
        lock_path: Some(folder.join("device.lock")),
        lock_timeout: request.lock_timeout,
    };
    // The host reference: every output the workload declares (not the package's list), and
    // the checkpointed values when asked (the tensors the run samples: the package's
    // checkpoints, in its order).
    let mut wanted: Vec<String> = graph.outputs.iter().map(|&v| graph.value(v).name.clone()).collect();
    let declared = wanted.len();
    if request.checkpoints {
        wanted.extend(package.host.checkpoints.iter().map(|c| c.tensor.name.clone()));
    }
    let wanted_refs: Vec<&str> = wanted.iter().map(String::as_str).collect();
    // The device run and the reference share nothing but the inputs: they run side by side,
    // so that the serial parts of one overlap the other's work.
    let (result, reference) = rayon::join(
        || execute(package, &inputs, &options),
        || tracing::info_span!("ipuq.run.reference").in_scope(|| crate::reference_cache::evaluate_cached_memo(&folder, &graph, &data, &wanted_refs, memo)),
    );
    let result = result.map_err(|e| e.to_string())?;
    let reference = reference.map_err(|e| e.to_string())?;
    let mut passed = true;
    let mut max_error = 0f64;
    for name in &wanted[..declared] {
        let value = graph.value(graph.find(name).ok_or_else(|| format!("output '{name}' is not a value of the workload"))?);
        let table = package.host.outputs.iter().find(|t| &t.name == name);
        let Some((t, bytes)) = table.and_then(|t| result.outputs.get(name).map(|b| (t, b))) else {
            eprintln!("output '{name}', declared by the workload, is not among the package's outputs: the device returned nothing for it");
            passed = false;
            continue;
        };
        if t.shape != value.shape || t.dtype != value.dtype {
            eprintln!(
                "output '{name}': the package returns {} {:?}, the workload declares {} {:?}",
                t.dtype.name(),
                t.shape,
                value.dtype.name(),
                value.shape
            );
            passed = false;
            continue;
        }
        let comparison = compare_bytes(&reference[name], bytes, t.dtype).map_err(|e| e.to_string())?;
        if !comparison.passed {
            eprintln!(
                "output '{}' differs from the host reference: element {} is {} on the device, {} in the reference ({} of {} elements outside tolerance)",
                t.name, comparison.worst_index, comparison.worst_device, comparison.worst_reference, comparison.violations, comparison.elements
            );
        }
        passed &= comparison.passed;
        max_error = max_error.max(comparison.max_abs_error);
    }
    if let Some((path, tiles, samples)) = &result.profile {
        println!("profile={} tiles={tiles} samples={samples}", path.display());
    }
    let seconds = result.cycles as f64 / target.chip.clock_hz as f64;
    let flops = workload_gemm_flops(&graph);
    if result.executed_flops < flops {
        eprintln!("the device executed {} matrix-product flops, fewer than the workload's {flops}: work is missing", result.executed_flops);
        passed = false;
    }
    let effective = flops as f64 / seconds.max(f64::MIN_POSITIVE) / 1e12;
    let host_bytes = result.input_bytes + result.weight_bytes + result.output_bytes;
    let host_seconds = host_bytes as f64 / target.host.link_bytes_per_second.max(1) as f64;
    let unmeasured = 100.0 * result.unmeasured_cycles as f64 / result.cycles.max(1) as f64;
    let peak = target.peak_tflops();
    let mut checkpoint_pass = true;
    if request.checkpoints {
        for (i, c) in result.checkpoints.iter().enumerate() {
            let value = graph.find(&c.name).map(|v| graph.value(v).dtype).unwrap_or(ipuq_queries::ir::DType::F16);
            let cmp = check_samples(&reference[&c.name], &c.indices, &c.values, Tolerance::for_dtype(value)).map_err(|e| e.to_string())?;
            checkpoint_pass &= cmp.passed;
            println!("checkpoint={i} operation={} tensors=1 samples={} maximumAbsoluteError={:.6}", c.operation, c.values.len(), cmp.max_abs_error);
        }
        println!(
            "diagnosticCheckpoints={} sampleLimit={} numericalTest={}",
            result.checkpoints.len(),
            request.sample_limit,
            if checkpoint_pass { "PASS" } else { "FAIL" }
        );
    }
    let all_pass = passed && checkpoint_pass;
    // The tensors are written before the result lines, so that a reader of the lines (`ipuq
    // watch --run` goes on running) finds the dump of the run they report complete.
    if let Some(dir) = &request.dump {
        dump(dir, &graph, &data, package, &result.outputs)?;
    }
    println!(
        "workload={}{} activeTiles={} executionTiles={} inputBytes={} weightBytes={} cycles={} minimumTileCycles={} deviceMicroseconds={:.3} effectiveGemmTflops={:.3} peakTflops={:.3} efficiencyPercent={:.2} hostBytes={host_bytes} hostLinkMicroseconds={:.3} initializeCycles={} unmeasuredCyclePercent={unmeasured:.2} deviceTarget={} targetDigest={} maximumAbsoluteError={:.6} numericalTest={}",
        graph.name,
        family_fields(&graph),
        result.active_tiles,
        package.tile_count(),
        result.input_bytes,
        result.weight_bytes,
        result.cycles,
        result.minimum_tile_cycles,
        seconds * 1e6,
        effective,
        peak,
        100.0 * effective / peak,
        host_seconds * 1e6,
        result.initialize_cycles,
        result.target_name,
        result.target_digest,
        max_error,
        if passed { "PASS" } else { "FAIL" }
    );
    println!("package={} tiles={} device={} simulatorTest={}", package_path.display(), package.tile_count(), result.device, if all_pass { "PASS" } else { "FAIL" });
    Ok(if all_pass { Outcome::Pass } else { Outcome::NumericalFailure })
}

fn dump(dir: &Path, graph: &Graph, data: &BTreeMap<String, crate::workload::TensorData>, package: &Package, outputs: &BTreeMap<String, Vec<u8>>) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("--dump {}: cannot create the directory: {e}", dir.display()))?;
    for v in &graph.values {
        if let Producer::Tensor { .. } = v.producer {
            let d = &data[&v.name];
            let shape: Vec<u64> = v.shape.iter().map(|&x| x as u64).collect();
            write_npy(&dir.join(format!("{}.npy", v.name)), v.dtype, &shape, &d.values).map_err(|e| e.to_string())?;
        }
    }
    for t in &package.host.outputs {
        let Some(bytes) = outputs.get(&t.name) else { continue };
        let values = decode(bytes, t.dtype).map_err(|e| e.to_string())?;
        let shape: Vec<u64> = t.shape.iter().map(|&x| x as u64).collect();
        write_npy(&dir.join(format!("{}.npy", t.name)), t.dtype, &shape, &values).map_err(|e| e.to_string())?;
    }
    Ok(())
}

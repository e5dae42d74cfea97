//! The values of a workload's tensors, produced from their initialisers before a run.
//!
//! Every tensor's values are a pure function of its declaration (and, for `npy`, of the file):
//! the same seed gives the same bits on every machine and for every rayon thread count, because
//! random values are drawn in fixed chunks whose generators are seeded from (seed, chunk index).
//! Values are rounded to the tensor's dtype here, once, so that the host reference, the device
//! and the packaged bytes all see exactly the same numbers. This module must not depend on
//! anything the compiler decides (layouts, tiles): the data belongs to the workload alone.

use std::collections::BTreeMap;
use std::path::Path;

use half::f16;
use half::slice::HalfFloatSliceExt;
use ipuq_queries::ir::{DType, Graph, Init, TensorDecl};
use rayon::prelude::*;

use crate::workload::npy::{read_npy, NpyError};
use crate::workload::safetensors::{Headers, ImportError};

/// Random values are generated in chunks of this many elements, each with its own generator.
/// Even, so that Box–Muller pairs never straddle two chunks.
const CHUNK: usize = 1 << 16;

/// A tensor's values: `values` are exactly the numbers `bytes` encode (already rounded to `dtype`).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorData {
    pub dtype: DType,
    pub shape: Vec<u32>,
    /// Row-major values, each exactly representable in `dtype`.
    pub values: Vec<f32>,
    /// The same values, row-major, little-endian, in `dtype`'s encoding.
    pub bytes: Vec<u8>,
}

impl TensorData {
    /// Round `values` to `dtype` and encode them; the count must match the shape.
    pub fn from_values(dtype: DType, shape: Vec<u32>, values: Vec<f32>) -> Result<TensorData, DataError> {
        let elements: u64 = shape.iter().map(|&d| d as u64).product();
        if elements != values.len() as u64 {
            return Err(DataError::Count { tensor: "<values>".into(), shape, count: values.len() });
        }
        let rounded: Vec<f32> = values.par_iter().map(|&v| round_to(dtype, v as f64)).collect();
        unrepresentable(dtype, &shape, &values, &rounded)?;
        let bytes = encode(&rounded, dtype);
        Ok(TensorData { dtype, shape, values: rounded, bytes })
    }
}

/// The first element of `given` (with `rounded`, the same values rounded to `dtype`) that a
/// run cannot take: NaN (no verdict against the host reference could come of it: it reaches
/// every output it touches), or a finite value that rounded to infinity. Infinities given as
/// such are taken (an additive attention mask holds −∞).
fn unrepresentable(dtype: DType, shape: &[u32], given: &[f32], rounded: &[f32]) -> Result<(), DataError> {
    let bad = |(g, r): (&f32, &f32)| g.is_nan() || (g.is_finite() && r.is_infinite());
    let Some(at) = given.par_iter().zip(rounded).position_first(bad) else { return Ok(()) };
    let value = given[at];
    let problem = if value.is_nan() {
        "is NaN".to_string()
    } else {
        format!("is {value}, beyond {}'s range (largest finite {})", dtype.name(), largest_finite(dtype))
    };
    Err(DataError::Element { tensor: None, element: element_index(shape, at), problem })
}

/// The first element of a drawn initialiser's `values` (already rounded to `dtype`) that
/// rounded to infinity: its distribution reaches beyond the dtype's range.
fn drawn_overflow(declaration: &TensorDecl, values: &[f32]) -> Result<(), DataError> {
    let Some(at) = values.par_iter().position_first(|v| v.is_infinite()) else { return Ok(()) };
    let dtype = declaration.dtype;
    let problem = format!("drawn by its initialiser rounds to {} in {} (largest finite {}): the initialiser's range is too wide for the dtype", values[at], dtype.name(), largest_finite(dtype));
    Err(DataError::Element { tensor: Some(declaration.name.clone()), element: element_index(&declaration.shape, at), problem })
}

/// The largest finite value of `dtype`.
fn largest_finite(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => f16::MAX.to_f32(),
        DType::F32 => f32::MAX,
    }
}

/// The row-major index of flat element `at` of a tensor of `shape`.
fn element_index(shape: &[u32], mut at: usize) -> Vec<u64> {
    let mut index = vec![0u64; shape.len()];
    for (slot, &extent) in index.iter_mut().zip(shape).rev() {
        let extent = extent.max(1) as usize;
        *slot = (at % extent) as u64;
        at /= extent;
    }
    index
}

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("tensor '{tensor}': {source}")]
    Npy { tensor: String, source: NpyError },
    #[error("tensor '{tensor}': {file} has shape {found:?}, the tensor is declared with shape {declared:?}")]
    NpyShape { tensor: String, file: String, found: Vec<u64>, declared: Vec<u32> },
    #[error("tensor '{tensor}': {file} holds {found} values, the tensor is declared {declared}")]
    NpyDType { tensor: String, file: String, found: &'static str, declared: &'static str },
    #[error("tensor '{tensor}': shape {shape:?} does not hold {count} values")]
    Count { tensor: String, shape: Vec<u32>, count: usize },
    #[error("tensor '{tensor}': {source}")]
    Safetensors { tensor: String, source: ImportError },
    #[error("{length} bytes are not a whole number of {dtype} values")]
    ByteLength { length: usize, dtype: &'static str },
    /// An element a run cannot take (`unrepresentable`, `drawn_overflow`), with the tensor
    /// where it is known.
    #[error("{}element {element:?} {problem}", tensor.as_ref().map(|t| format!("tensor '{t}': ")).unwrap_or_default())]
    Element { tensor: Option<String>, element: Vec<u64>, problem: String },
}

impl DataError {
    /// A [`DataError::Element`] named after `tensor` (and what it was read from), others as
    /// they are.
    fn in_tensor(self, tensor: &str, origin: impl FnOnce() -> String) -> DataError {
        match self {
            DataError::Element { tensor: None, element, problem } => DataError::Element { tensor: Some(tensor.to_string()), element, problem: format!("{problem} (in {})", origin()) },
            other => other,
        }
    }
}

/// The values of every tensor (inputs and weights) of `graph`, by name. `workload_dir` is the
/// folder of the workload file, against which `npy` paths are resolved.
pub fn tensor_data(graph: &Graph, workload_dir: &Path) -> Result<BTreeMap<String, TensorData>, DataError> {
    tensor_data_with(graph, workload_dir, BTreeMap::new())
}

/// As [`tensor_data`], with the values of some tensors given (`ipuq run --input`): those are
/// taken as they are, their initialisers not evaluated.
pub fn tensor_data_with(graph: &Graph, workload_dir: &Path, given: BTreeMap<String, TensorData>) -> Result<BTreeMap<String, TensorData>, DataError> {
    tensor_data_inner(graph, workload_dir, given, None)
}

/// The values of seeded (and zero) initialisers from earlier calls, so that a long-lived
/// session (`ipuq watch --run`) does not draw again the tensors an edit left alone.
/// An entry is keyed by the whole declaration but its name (shape, dtype, role, initialiser):
/// the values are a pure function of that. Initialisers that read files are never cached (the
/// file may have changed), nor are values given with `--input`.
#[derive(Default)]
pub struct TensorCache {
    entries: Vec<(TensorDecl, TensorData)>,
}

impl TensorCache {
    fn key(declaration: &TensorDecl) -> Option<TensorDecl> {
        matches!(declaration.init, Init::Gaussian { .. } | Init::Uniform { .. } | Init::Zeros)
            .then(|| TensorDecl { name: String::new(), ..declaration.clone() })
    }

    fn find(&self, key: &TensorDecl) -> Option<&TensorData> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, data)| data)
    }

    fn take(&mut self, key: &TensorDecl) -> Option<TensorData> {
        let at = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.swap_remove(at).1)
    }
}

/// As [`tensor_data_with`], reusing (and refreshing) `cache`: afterwards it holds exactly the
/// cacheable tensors of this call.
pub fn tensor_data_cached(
    graph: &Graph,
    workload_dir: &Path,
    given: BTreeMap<String, TensorData>,
    cache: &mut TensorCache,
) -> Result<BTreeMap<String, TensorData>, DataError> {
    tensor_data_inner(graph, workload_dir, given, Some(cache))
}

/// Without a cache, nothing is copied into one.
fn tensor_data_inner(
    graph: &Graph,
    workload_dir: &Path,
    mut given: BTreeMap<String, TensorData>,
    mut cache: Option<&mut TensorCache>,
) -> Result<BTreeMap<String, TensorData>, DataError> {
    let mut data = BTreeMap::new();
    let mut headers = Headers::default();
    let mut kept = TensorCache::default();
    for declaration in &graph.file.tensors {
        let _span = tracing::debug_span!("tensor_data", tensor = %declaration.name).entered();
        let key = cache.as_ref().and_then(|_| TensorCache::key(declaration));
        let values = match (given.remove(&declaration.name), key) {
            (Some(values), _) => values,
            (None, None) => values_with(declaration, workload_dir, &mut headers)?,
            (None, Some(key)) => {
                if let Some(values) = kept.find(&key) {
                    values.clone()
                } else {
                    let values = match cache.as_mut().and_then(|c| c.take(&key)) {
                        Some(values) => values,
                        None => values_with(declaration, workload_dir, &mut headers)?,
                    };
                    kept.entries.push((key, values.clone()));
                    values
                }
            }
        };
        data.insert(declaration.name.clone(), values);
    }
    if let Some(cache) = cache {
        *cache = kept;
    }
    Ok(data)
}

/// The values of one declared tensor.
pub fn tensor_values(declaration: &TensorDecl, workload_dir: &Path) -> Result<TensorData, DataError> {
    values_with(declaration, workload_dir, &mut Headers::default())
}

fn values_with(declaration: &TensorDecl, workload_dir: &Path, headers: &mut Headers) -> Result<TensorData, DataError> {
    let dtype = declaration.dtype;
    let shape = declaration.shape.clone();
    let count = shape.iter().map(|&d| d as usize).product::<usize>();
    let values = match &declaration.init {
        Init::Gaussian { seed, std } => draw(*seed, count, dtype, |generator| {
            let (first, second) = generator.gaussian_pair();
            (first * std, second * std)
        }),
        Init::Uniform { seed, low, high } => draw(*seed, count, dtype, |generator| {
            let width = high - low;
            (low + width * generator.unit(), low + width * generator.unit())
        }),
        Init::Zeros => vec![0.0; count],
        Init::Npy { path } => return npy_values(declaration, &workload_dir.join(path)),
        Init::Safetensors { path, tensor, digest } => {
            let stored = headers
                .load_checked(&workload_dir.join(path), tensor, digest, &shape)
                .map_err(|source| DataError::Safetensors { tensor: declaration.name.clone(), source })?;
            // Every stored dtype is exact in f32; `from_values` rounds once, to the declared dtype.
            return TensorData::from_values(dtype, shape, stored.values()).map_err(|e| e.in_tensor(&declaration.name, || format!("'{tensor}' of {path}")));
        }
    };
    drawn_overflow(declaration, &values)?;
    let bytes = encode(&values, dtype);
    Ok(TensorData { dtype, shape, values, bytes })
}

fn npy_values(declaration: &TensorDecl, file: &Path) -> Result<TensorData, DataError> {
    let tensor = declaration.name.clone();
    let array = read_npy(file).map_err(|source| DataError::Npy { tensor: tensor.clone(), source })?;
    let declared: Vec<u64> = declaration.shape.iter().map(|&d| d as u64).collect();
    if array.shape != declared {
        return Err(DataError::NpyShape { tensor, file: file.display().to_string(), found: array.shape, declared: declaration.shape.clone() });
    }
    if array.dtype != declaration.dtype {
        return Err(DataError::NpyDType {
            tensor,
            file: file.display().to_string(),
            found: array.dtype.name(),
            declared: declaration.dtype.name(),
        });
    }
    // The file's dtype is the declared one: nothing is rounded, and only NaN is refused.
    unrepresentable(array.dtype, &declaration.shape, &array.values, &array.values).map_err(|e| e.in_tensor(&tensor, || file.display().to_string()))?;
    let bytes = encode(&array.values, array.dtype);
    Ok(TensorData { dtype: array.dtype, shape: declaration.shape.clone(), values: array.values, bytes })
}

/// `count` values drawn two at a time by `pair` and rounded to `dtype`, chunk by chunk in
/// parallel. Chunk `c` uses a generator seeded from (`seed`, `c`) alone, so the result is
/// independent of the thread count.
fn draw(seed: u64, count: usize, dtype: DType, pair: impl Fn(&mut Xoshiro256) -> (f64, f64) + Sync) -> Vec<f32> {
    let mut values = vec![0.0f32; count];
    values.par_chunks_mut(CHUNK).enumerate().for_each(|(chunk, out)| {
        let mut generator = Xoshiro256::for_chunk(seed, chunk as u64);
        for slot in out.chunks_mut(2) {
            let (first, second) = pair(&mut generator);
            slot[0] = round_to(dtype, first);
            if let Some(last) = slot.get_mut(1) {
                *last = round_to(dtype, second);
            }
        }
    });
    values
}

/// SplitMix64's step: used to expand seeds, as its authors recommend for seeding xoshiro.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256** (Blackman and Vigna): small, fast, and good enough for test data.
struct Xoshiro256 {
    state: [u64; 4],
}

impl Xoshiro256 {
    fn for_chunk(seed: u64, chunk: u64) -> Xoshiro256 {
        // Mix the seed and the chunk index through two SplitMix64 streams so that neighbouring
        // seeds and neighbouring chunks start far apart.
        let mut mixer = seed;
        let seed_mix = splitmix64(&mut mixer);
        let mut expander = seed_mix ^ chunk.wrapping_mul(0xD1B5_4A32_D192_ED03);
        let state = [(); 4].map(|_| splitmix64(&mut expander));
        Xoshiro256 { state }
    }

    fn next(&mut self) -> u64 {
        let s = &mut self.state;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1), 53 bits.
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Two independent standard normal values (Box–Muller).
    fn gaussian_pair(&mut self) -> (f64, f64) {
        // (0, 1]: the logarithm never sees zero.
        let u1 = ((self.next() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64);
        let u2 = self.unit();
        let radius = (-2.0 * u1.ln()).sqrt();
        let angle = std::f64::consts::TAU * u2;
        (radius * angle.cos(), radius * angle.sin())
    }
}

/// `value` rounded to nearest (ties to even) in `dtype`, as an f32 (exact for both dtypes).
pub fn round_to(dtype: DType, value: f64) -> f32 {
    match dtype {
        DType::F16 if value.is_nan() => f16::NAN.to_f32(),
        // Every f16 value (and infinity) is exact in f32.
        DType::F16 => f16_rounded(value) as f32,
        DType::F32 => value as f32,
    }
}

/// f64 to f16 with a single rounding. `half`'s own conversion may go through f32 first, and
/// rounding twice can differ from rounding once when a value lies just beside a midpoint.
pub fn f16_from_f64(value: f64) -> f16 {
    if value.is_nan() {
        return f16::NAN;
    }
    // The rounded value is an f16 value (or infinity), so this conversion is exact.
    f16::from_f64(f16_rounded(value))
}

/// 2^`exponent` as an f64, for exponents of normal f64 values (built from its bits: exact).
fn power_of_two(exponent: i32) -> f64 {
    f64::from_bits(((exponent + 1023) as u64) << 52)
}

/// `value` (not NaN) rounded once to the nearest f16 value, ties to even, as an f64: ±infinity
/// beyond f16's range, a signed zero below half its smallest subnormal.
fn f16_rounded(value: f64) -> f64 {
    let magnitude = value.abs();
    // 65520 is the midpoint between f16's largest finite value (65504) and the next step.
    let rounded = if magnitude >= 65520.0 {
        f64::INFINITY
    } else {
        // The spacing of f16 values around `magnitude`: 2^-24 among subnormals (below 2^-14),
        // else 2^(exponent - 10).
        let exponent = ((magnitude.to_bits() >> 52) & 0x7ff) as i32 - 1023;
        let quantum = if exponent < -14 { -24 } else { exponent - 10 };
        // Scaling by a power of two is exact (the scaled value is below 2^11), and adding then
        // subtracting 2^52 rounds a value in [0, 2^52) to an integer, ties to even, under the
        // default rounding mode: this is the one rounding.
        let scaled = magnitude * power_of_two(-quantum);
        let magic = 4_503_599_627_370_496.0f64; // 2^52
        ((scaled + magic) - magic) * power_of_two(quantum)
    };
    rounded.copysign(value)
}

/// Row-major little-endian bytes of `values` in `dtype` (values are rounded if not exact).
pub fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F16 => {
            // f32 to f16 is one rounding to nearest even (an f32 is exact in f64), as
            // `f16_from_f64` does; NaN is encoded as `f16::NAN`, whatever its payload.
            let mut out = vec![0u8; values.len() * 2];
            out.par_chunks_mut(2 * CHUNK).zip(values.par_chunks(CHUNK)).for_each(|(out, values)| {
                let mut halves = vec![f16::ZERO; values.len()];
                halves.convert_from_f32_slice(values);
                for ((bytes, h), v) in out.chunks_exact_mut(2).zip(&halves).zip(values) {
                    let h = if v.is_nan() { f16::NAN } else { *h };
                    bytes.copy_from_slice(&h.to_le_bytes());
                }
            });
            out
        }
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// The values little-endian `bytes` of `dtype` encode.
pub fn decode(bytes: &[u8], dtype: DType) -> Result<Vec<f32>, DataError> {
    let width = dtype.bytes() as usize;
    if !bytes.len().is_multiple_of(width) {
        return Err(DataError::ByteLength { length: bytes.len(), dtype: dtype.name() });
    }
    Ok(match dtype {
        DType::F16 => bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        DType::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain statement of one rounding (powers by `powi`, `round_ties_even`): the oracle.
    fn f16_from_f64_oracle(value: f64) -> f16 {
        if value.is_nan() {
            return f16::NAN;
        }
        let magnitude = value.abs();
        let rounded = if magnitude >= 65520.0 {
            f64::INFINITY
        } else {
            let smallest_normal = 2f64.powi(-14);
            let quantum = if magnitude < smallest_normal {
                2f64.powi(-24)
            } else {
                let exponent = ((magnitude.to_bits() >> 52) & 0x7ff) as i32 - 1023;
                2f64.powi(exponent - 10)
            };
            (magnitude / quantum).round_ties_even() * quantum
        };
        f16::from_f64(rounded.copysign(value))
    }

    /// Values on, beside and between every f16 value, their midpoints, and random bits.
    fn probes() -> Vec<f64> {
        let mut values = vec![0.0, -0.0, f64::INFINITY, f64::NEG_INFINITY, f64::MIN_POSITIVE, 5e-324, 65504.0, 65519.99, 65520.0, 1e300, -1e-300];
        for bits in 0..=0xffffu16 {
            let h = f16::from_bits(bits).to_f64();
            let next = f16::from_bits(bits.wrapping_add(1)).to_f64();
            if !h.is_finite() {
                continue;
            }
            let middle = if next.is_finite() { (h + next) / 2.0 } else { h };
            for v in [h, middle] {
                values.extend([v, f64::from_bits(v.to_bits() + 1), f64::from_bits(v.to_bits().saturating_sub(1)), (v as f32) as f64]);
            }
        }
        let mut state = 0x1234_5678_9abc_def0u64;
        for _ in 0..200_000 {
            let bits = splitmix64(&mut state);
            values.push(f64::from_bits(bits));
            values.push(f32::from_bits(bits as u32) as f64);
        }
        values
    }

    #[test]
    fn fast_rounding_to_f16_matches_the_plain_statement_bit_for_bit() {
        for v in probes() {
            let expected = f16_from_f64_oracle(v);
            assert_eq!(f16_from_f64(v).to_bits(), expected.to_bits(), "{v:e} ({:#x})", v.to_bits());
            let as_f32 = round_to(DType::F16, v);
            assert_eq!(as_f32.to_bits(), expected.to_f32().to_bits(), "round_to {v:e}");
        }
    }

    #[test]
    fn encoding_f32_values_as_f16_rounds_once_like_the_f64_path() {
        let values: Vec<f32> = probes().into_iter().map(|v| v as f32).collect();
        let bytes = encode(&values, DType::F16);
        for (v, b) in values.iter().zip(bytes.chunks_exact(2)) {
            assert_eq!(u16::from_le_bytes([b[0], b[1]]), f16_from_f64_oracle(*v as f64).to_bits(), "{v:e}");
        }
    }

    #[test]
    fn the_tensor_cache_reuses_only_unchanged_declarations_and_never_given_values() {
        let text = include_str!("../../fixtures/workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml");
        let graph = Graph::parse(text, "small").unwrap();
        let dir = Path::new(".");
        let fresh = tensor_data(&graph, dir).unwrap();
        let mut cache = TensorCache::default();
        assert_eq!(tensor_data_cached(&graph, dir, BTreeMap::new(), &mut cache).unwrap(), fresh);
        assert_eq!(cache.entries.len(), fresh.len());
        // Drawn from the cache: the same values.
        assert_eq!(tensor_data_cached(&graph, dir, BTreeMap::new(), &mut cache).unwrap(), fresh);
        // A new seed for the input: new input values, the weights as before.
        let edited = Graph::parse(&text.replacen("seed = 1\n", "seed = 7\n", 1), "small").unwrap();
        let after = tensor_data_cached(&edited, dir, BTreeMap::new(), &mut cache).unwrap();
        assert_eq!(after, tensor_data(&edited, dir).unwrap());
        assert_ne!(after["x"], fresh["x"]);
        assert!(after.iter().filter(|(name, _)| *name != "x").all(|(name, d)| fresh[name] == *d));
        assert_eq!(cache.entries.len(), fresh.len(), "the old input's entry is dropped");
        // A given input is used as given and not cached under the initialiser's key.
        let given = TensorData::from_values(fresh["x"].dtype, fresh["x"].shape.clone(), vec![0.5; fresh["x"].values.len()]).unwrap();
        let with_given = tensor_data_cached(&graph, dir, BTreeMap::from([("x".to_string(), given.clone())]), &mut cache).unwrap();
        assert_eq!(with_given["x"], given);
        assert_eq!(tensor_data_cached(&graph, dir, BTreeMap::new(), &mut cache).unwrap(), fresh);
    }

    /// A NaN, or a finite value that rounds beyond the dtype's range, is refused with its
    /// row-major element index; values that round into range and infinities given as such are
    /// taken.
    #[test]
    fn values_a_run_cannot_take_are_named_by_their_element() {
        let refused = |dtype, values: Vec<f32>| match TensorData::from_values(dtype, vec![2, 3], values) {
            Err(DataError::Element { tensor: None, element, problem }) => (element, problem),
            other => panic!("expected an element error, got {other:?}"),
        };
        let mut values = vec![0.5f32; 6];
        values[4] = f32::NAN;
        assert_eq!(refused(DType::F16, values.clone()), (vec![1, 1], "is NaN".to_string()));
        assert_eq!(refused(DType::F32, values.clone()), (vec![1, 1], "is NaN".to_string()));
        // 65520 is the midpoint above f16's largest finite value: it rounds (to even) to infinity.
        values[4] = 0.5;
        values[2] = 65520.0;
        values[5] = f32::NAN;
        assert_eq!(refused(DType::F16, values.clone()), (vec![0, 2], "is 65520, beyond f16's range (largest finite 65504)".to_string()));
        values[2] = -65519.0;
        values[5] = f32::NEG_INFINITY;
        let taken = TensorData::from_values(DType::F16, vec![2, 3], values.clone()).unwrap();
        assert_eq!((taken.values[2], taken.values[5]), (-65504.0, f32::NEG_INFINITY));
        values[2] = 1.0e30;
        assert!(TensorData::from_values(DType::F32, vec![2, 3], values).is_ok());
        assert_eq!(element_index(&[2, 3, 4], 23), vec![1, 2, 3]);
        assert_eq!(element_index(&[], 0), Vec::<u64>::new());

        // A drawn initialiser whose distribution reaches beyond f16's range.
        let wide = TensorDecl { name: "w".into(), shape: vec![64, 64], dtype: DType::F16, role: ipuq_queries::ir::Role::Weight, init: Init::Gaussian { seed: 3, std: 3.0e4 } };
        match tensor_values(&wide, Path::new(".")) {
            Err(error @ DataError::Element { .. }) => {
                let text = error.to_string();
                assert!(text.starts_with("tensor 'w': element [") && text.contains("rounds to") && text.contains("in f16 (largest finite 65504)"), "{text}");
            }
            other => panic!("expected an element error, got {other:?}"),
        }
        assert!(tensor_values(&TensorDecl { dtype: DType::F32, ..wide.clone() }, Path::new(".")).is_ok());
        assert!(tensor_values(&TensorDecl { init: Init::Gaussian { seed: 3, std: 1.0e3 }, ..wide }, Path::new(".")).is_ok());
    }
}

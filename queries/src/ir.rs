//! The workload IR: the TOML workload file, its validation, and the graph of values and operations.
//!
//! A workload names tensors (inputs and weights, each with an initialiser), operations over
//! values, and outputs. Parsing checks every name, shape and dtype and reports problems with
//! the operation or tensor they concern. Initialiser data is never read here: the runtime
//! produces it, so a seed change cannot disturb any compile stage.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::hash::{KeyHasher, StableHash};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
    rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F16,
    F32,
}

impl DType {
    pub fn bytes(self) -> u32 {
        match self {
            DType::F16 => 2,
            DType::F32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::F32 => "f32",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Input,
    Weight,
}

/// How the runtime fills a tensor before a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum Init {
    Gaussian { seed: u64, std: f64 },
    Uniform { seed: u64, low: f64, high: f64 },
    Zeros,
    /// A `.npy` file, relative to the workload file's folder.
    Npy { path: String },
    /// One tensor of a safetensors file (a Hugging Face checkpoint), referenced, not copied:
    /// `path` relative to the workload file's folder (or absolute), `tensor` its name in the
    /// file, `digest` the blake3 (hex) of its stored bytes, checked when the data is loaded.
    /// The digest is part of the workload text, so other weights make another workload.
    Safetensors { path: String, tensor: String, digest: String },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorDecl {
    pub name: String,
    pub shape: Vec<u32>,
    pub dtype: DType,
    pub role: Role,
    pub init: Init,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperationDecl {
    /// The name of the value this operation produces.
    pub name: String,
    pub op: String,
    pub inputs: Vec<String>,
    /// matmul: the second operand is given as [.., N, K].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transpose_b: bool,
    /// scale: the factor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// reshape: the new shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<u32>>,
    /// transpose: the permutation of axes (output axis a is input axis perm[a]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perm: Option<Vec<u32>>,
    /// layer_norm: the epsilon added to the variance (default 1e-5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<f64>,
    /// gelu: "tanh" (the default) or "none" (exact, with erf).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approximate: Option<String>,
}

/// The file as written: `name`, optional `[family]` parameters, `[[tensor]]`, `[[operation]]`, `outputs`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadFile {
    pub name: String,
    /// Parameters of the family the workload belongs to (printed in the result line).
    #[serde(default)]
    pub family: BTreeMap<String, toml::Value>,
    #[serde(rename = "tensor")]
    pub tensors: Vec<TensorDecl>,
    #[serde(rename = "operation")]
    pub operations: Vec<OperationDecl>,
    pub outputs: Vec<String>,
    /// User plan constraints for matrix products (`[[constraint]]`).
    #[serde(default, rename = "constraint", skip_serializing_if = "Vec::is_empty")]
    pub constraints: Vec<PlanConstraint>,
}

/// A user's constraint on one matrix product's plan (the seed's GemmPlanConstraint); every
/// field but `operation` is optional. Partitions are those of the product as computed (for a
/// swapped product, rows are B's columns), as the plan logs show them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanConstraint {
    pub operation: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub orientation: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row_partitions: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub column_partitions: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inner_partitions: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_memory: Option<String>,
    /// `"home"`: this product's weights, and those of every later product, are kept once on
    /// a home tile each and multicast to the tiles that need them; the earlier products keep
    /// theirs replicated where tile memory allows (a mixed program; the search homes earlier
    /// ones too when the replicated ones do not fit). Weights a product reads as its B operand
    /// (normal orientation): a swapped product's weights are its A operand, replicated on its
    /// column partitions either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<String>,
}

impl PlanConstraint {
    /// `orientation=swapped row_partitions=4`: the fields given, as logs show them.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(o) = &self.orientation {
            parts.push(format!("orientation={o}"));
        }
        for (name, v) in [("row_partitions", self.row_partitions), ("column_partitions", self.column_partitions), ("inner_partitions", self.inner_partitions)] {
            if let Some(v) = v {
                parts.push(format!("{name}={v}"));
            }
        }
        if let Some(w) = &self.weight_memory {
            parts.push(format!("weight_memory={w}"));
        }
        if let Some(w) = &self.weights {
            parts.push(format!("weights={w}"));
        }
        parts.join(",")
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ValueId(pub u32);

#[derive(Clone, Debug, PartialEq)]
pub enum OpKind {
    /// Batched matrix product; the leading axis of a rank-3 operand is the batch. When A has
    /// more batches than B (grouped heads), batch b of A uses batch b / (Ba / Bb) of B.
    MatMul { transpose_b: bool },
    /// GELU, tanh approximation (`approximate = "tanh"`, the default).
    Gelu,
    /// GELU, exact: `0.5 x (1 + erf(x / sqrt 2))` (`approximate = "none"`).
    GeluErf,
    /// LayerNorm over the last axis: inputs x, gamma and beta (both 1-D, the last axis's
    /// length); fp32 statistics, `(x - mean) / sqrt(var + eps) * gamma + beta`.
    LayerNorm { eps: f64 },
    /// x + bias, the 1-D bias broadcast over every leading axis.
    BiasAdd,
    /// Softmax over the last axis.
    Softmax,
    Scale { factor: f64 },
    Add,
    Reshape { shape: Vec<u32> },
    Transpose { perm: Vec<u32> },
    /// A rank-2 transpose written out in tile memory (not a view): only the orientation
    /// rewrite (`lower/orient.rs`) makes it, for a consumer that reads a swapped product's
    /// result by rows; workload files cannot name it.
    TransposeCopy,
}

impl OpKind {
    pub fn name(&self) -> &'static str {
        match self {
            OpKind::MatMul { .. } => "matmul",
            OpKind::Gelu => "gelu",
            OpKind::GeluErf => "gelu_erf",
            OpKind::LayerNorm { .. } => "layer_norm",
            OpKind::BiasAdd => "bias_add",
            OpKind::Softmax => "softmax",
            OpKind::Scale { .. } => "scale",
            OpKind::Add => "add",
            OpKind::Reshape { .. } => "reshape",
            OpKind::Transpose { .. } => "transpose",
            OpKind::TransposeCopy => "transpose_copy",
        }
    }
    /// Views move no data of their own: consumers read through them.
    pub fn is_view(&self) -> bool {
        matches!(self, OpKind::Reshape { .. } | OpKind::Transpose { .. })
    }
}

pub const KNOWN_OPERATIONS: &str = "matmul, gelu, softmax, scale, add, bias_add, layer_norm, reshape, transpose";

/// LayerNorm's epsilon when a workload gives none (PyTorch's default).
pub const DEFAULT_LAYER_NORM_EPS: f64 = 1e-5;

#[derive(Clone, Debug, PartialEq)]
pub enum Producer {
    Tensor { index: usize, role: Role },
    Operation(usize),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    pub name: String,
    pub shape: Vec<u32>,
    pub dtype: DType,
    pub producer: Producer,
}

impl Value {
    pub fn elements(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }

    /// A rank-2 weight tensor: what a matrix product can keep replicated or on home tiles.
    pub fn is_matrix_weight(&self) -> bool {
        self.shape.len() == 2 && matches!(self.producer, Producer::Tensor { role: Role::Weight, .. })
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Operation {
    pub kind: OpKind,
    pub inputs: Vec<ValueId>,
    pub output: ValueId,
}

/// A validated workload: values in definition order (tensors first), operations in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    pub name: String,
    pub file: WorkloadFile,
    pub values: Vec<Value>,
    pub operations: Vec<Operation>,
    pub outputs: Vec<ValueId>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone)]
pub enum WorkloadError {
    #[error("workload {origin}: malformed file: {message}")]
    Malformed { origin: String, message: String },
    #[error("workload {origin}: {location}: {message}")]
    Invalid { origin: String, location: String, message: String },
}

impl Graph {
    pub fn value(&self, id: ValueId) -> &Value {
        &self.values[id.0 as usize]
    }

    /// The rank-2 weight tensor operation `op` multiplies by, when it is a matrix product whose
    /// second operand is one (what the weight arrangements replicate or keep on home tiles).
    pub fn matrix_weight_of(&self, op: usize) -> Option<ValueId> {
        let operation = self.operations.get(op)?;
        let &weight = operation.inputs.get(1).filter(|_| matches!(operation.kind, OpKind::MatMul { .. }))?;
        self.value(weight).is_matrix_weight().then_some(weight)
    }
    pub fn find(&self, name: &str) -> Option<ValueId> {
        self.values.iter().position(|v| v.name == name).map(|i| ValueId(i as u32))
    }
    /// Operations other than views: the ones that compute.
    pub fn compute_operation_count(&self) -> usize {
        self.operations.iter().filter(|o| !o.kind.is_view()).count()
    }

    /// Parse and validate a workload file; `origin` names it in every error.
    pub fn parse(text: &str, origin: &str) -> Result<Graph, WorkloadError> {
        let file: WorkloadFile = toml::from_str(text).map_err(|e| WorkloadError::Malformed {
            origin: origin.to_string(),
            message: e.to_string().trim().replace('\n', " "),
        })?;
        Graph::from_file(file, origin)
    }

    pub fn from_file(file: WorkloadFile, origin: &str) -> Result<Graph, WorkloadError> {
        let invalid = |location: String, message: String| WorkloadError::Invalid { origin: origin.to_string(), location, message };
        if file.name.is_empty() || !file.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(invalid("name".into(), format!("workload name {:?} must be non-empty and use only letters, digits, '-', '_' and '.'", file.name)));
        }
        let mut values: Vec<Value> = Vec::new();
        let mut by_name: BTreeMap<String, ValueId> = BTreeMap::new();
        for (index, t) in file.tensors.iter().enumerate() {
            let location = format!("tensor '{}' (#{index})", t.name);
            check_name(&t.name).map_err(|m| invalid(location.clone(), m))?;
            check_shape(&t.shape).map_err(|m| invalid(location.clone(), m))?;
            if let Init::Gaussian { std, .. } = t.init {
                if !(std.is_finite() && std >= 0.0) {
                    return Err(invalid(location, format!("gaussian std must be finite and non-negative, got {std}")));
                }
            }
            if let Init::Uniform { low, high, .. } = t.init {
                if !(low.is_finite() && high.is_finite() && low <= high) {
                    return Err(invalid(location, format!("uniform bounds must be finite with low <= high, got [{low}, {high}]")));
                }
            }
            if let Init::Safetensors { path, tensor, digest } = &t.init {
                if path.is_empty() || tensor.is_empty() {
                    return Err(invalid(location, "safetensors init needs a non-empty 'path' and 'tensor'".into()));
                }
                if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
                    return Err(invalid(location, format!("safetensors digest must be 64 lowercase hex digits (blake3), got {digest:?}")));
                }
            }
            let id = ValueId(values.len() as u32);
            if by_name.insert(t.name.clone(), id).is_some() {
                return Err(invalid(location, format!("the name '{}' is defined twice", t.name)));
            }
            values.push(Value { name: t.name.clone(), shape: t.shape.clone(), dtype: t.dtype, producer: Producer::Tensor { index, role: t.role } });
        }
        let mut operations = Vec::new();
        for (index, o) in file.operations.iter().enumerate() {
            let location = format!("operation '{}' (#{index}, {})", o.name, o.op);
            check_name(&o.name).map_err(|m| invalid(location.clone(), m))?;
            let kind = match o.op.as_str() {
                "matmul" => OpKind::MatMul { transpose_b: o.transpose_b },
                "gelu" => match o.approximate.as_deref() {
                    None | Some("tanh") => OpKind::Gelu,
                    Some("none") => OpKind::GeluErf,
                    Some(other) => return Err(invalid(location, format!("gelu's 'approximate' must be \"tanh\" or \"none\", got {other:?}"))),
                },
                "layer_norm" => {
                    let eps = o.eps.unwrap_or(DEFAULT_LAYER_NORM_EPS);
                    if !(eps.is_finite() && eps > 0.0) {
                        return Err(invalid(location, format!("layer_norm's 'eps' must be finite and positive, got {eps}")));
                    }
                    OpKind::LayerNorm { eps }
                }
                "bias_add" => OpKind::BiasAdd,
                "softmax" => OpKind::Softmax,
                "scale" => OpKind::Scale {
                    factor: o.factor.filter(|f| f.is_finite()).ok_or_else(|| invalid(location.clone(), "scale needs a finite 'factor'".into()))?,
                },
                "add" => OpKind::Add,
                "reshape" => OpKind::Reshape { shape: o.shape.clone().ok_or_else(|| invalid(location.clone(), "reshape needs 'shape'".into()))? },
                "transpose" => OpKind::Transpose { perm: o.perm.clone().ok_or_else(|| invalid(location.clone(), "transpose needs 'perm'".into()))? },
                other => return Err(invalid(location, format!("unknown operation '{other}'; known operations: {KNOWN_OPERATIONS}"))),
            };
            if o.eps.is_some() && !matches!(kind, OpKind::LayerNorm { .. }) {
                return Err(invalid(location, format!("'eps' applies only to layer_norm, not {}", o.op)));
            }
            if o.approximate.is_some() && !matches!(kind, OpKind::Gelu | OpKind::GeluErf) {
                return Err(invalid(location, format!("'approximate' applies only to gelu, not {}", o.op)));
            }
            let mut inputs = Vec::new();
            for name in &o.inputs {
                let id = *by_name.get(name).ok_or_else(|| invalid(location.clone(), format!("input '{name}' is not defined before this operation")))?;
                inputs.push(id);
            }
            let input_values: Vec<&Value> = inputs.iter().map(|id| &values[id.0 as usize]).collect();
            let (shape, dtype) = infer(&kind, &input_values).map_err(|m| invalid(location.clone(), m))?;
            let id = ValueId(values.len() as u32);
            if by_name.insert(o.name.clone(), id).is_some() {
                return Err(invalid(location, format!("the name '{}' is defined twice", o.name)));
            }
            values.push(Value { name: o.name.clone(), shape, dtype, producer: Producer::Operation(index) });
            operations.push(Operation { kind, inputs, output: id });
        }
        if file.outputs.is_empty() {
            return Err(invalid("outputs".into(), "a workload needs at least one output".into()));
        }
        let mut outputs = Vec::new();
        for name in &file.outputs {
            let id = *by_name.get(name).ok_or_else(|| invalid("outputs".into(), format!("output '{name}' is not defined")))?;
            if !matches!(values[id.0 as usize].producer, Producer::Operation(_)) {
                return Err(invalid("outputs".into(), format!("output '{name}' is a tensor, not the result of an operation")));
            }
            if outputs.contains(&id) {
                return Err(invalid("outputs".into(), format!("output '{name}' is listed twice")));
            }
            outputs.push(id);
        }
        let mut constrained = std::collections::BTreeSet::new();
        for (index, c) in file.constraints.iter().enumerate() {
            let location = format!("constraint #{index} (operation '{}')", c.operation);
            let op = by_name.get(&c.operation).and_then(|id| match values[id.0 as usize].producer {
                Producer::Operation(o) => Some(&operations[o]),
                _ => None,
            });
            let Some(op) = op else { return Err(invalid(location, format!("'{}' is not an operation of this workload", c.operation))) };
            if !matches!(op.kind, OpKind::MatMul { .. }) {
                return Err(invalid(location, format!("'{}' is a {}, and only matrix products take plan constraints", c.operation, op.kind.name())));
            }
            if !constrained.insert(c.operation.clone()) {
                return Err(invalid(location, "a second constraint for the same operation".into()));
            }
            if let Some(o) = &c.orientation {
                if o != "normal" && o != "swapped" {
                    return Err(invalid(location, format!("orientation must be \"normal\" or \"swapped\", got {o:?}")));
                }
                if o == "swapped" && op.inputs.iter().any(|&v| values[v.0 as usize].shape.len() != 2) {
                    return Err(invalid(location, "only products of rank-2 operands can be swapped".into()));
                }
            }
            if let Some(w) = &c.weight_memory {
                if w != "interleaved" && w != "standard" {
                    return Err(invalid(location, format!("weight_memory must be \"interleaved\" or \"standard\", got {w:?}")));
                }
            }
            if let Some(w) = &c.weights {
                if w != "home" {
                    return Err(invalid(location, format!("weights must be \"home\" (this product's and the later products' weights kept on home tiles), got {w:?}")));
                }
                if !op.inputs.get(1).is_some_and(|&v| values[v.0 as usize].is_matrix_weight()) {
                    return Err(invalid(location, "weights = \"home\" needs a product whose second operand is a rank-2 weight tensor".into()));
                }
            }
            for (name, v) in [("row_partitions", c.row_partitions), ("column_partitions", c.column_partitions), ("inner_partitions", c.inner_partitions)] {
                if v == Some(0) {
                    return Err(invalid(location, format!("{name} must be at least 1")));
                }
            }
        }
        if operations.iter().all(|o: &Operation| o.kind.is_view()) {
            return Err(invalid("operation".into(), "a workload needs at least one operation that computes".into()));
        }
        Ok(Graph { name: file.name.clone(), file, values, operations, outputs })
    }

    /// Canonical text of the workload (no comments, fixed order): what keys and the package hold.
    pub fn canonical_toml(&self) -> String {
        toml::to_string(&self.file).expect("a workload always serialises")
    }
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        return Err(format!("name {name:?} must be non-empty and use only letters, digits, '-', '_' and '.'"));
    }
    Ok(())
}

/// The largest tensor ipuq accepts: element offsets are 32-bit in packages.
pub const MAX_ELEMENTS: u64 = 1 << 31;

fn check_shape(shape: &[u32]) -> Result<(), String> {
    if shape.is_empty() || shape.len() > 4 {
        return Err(format!("shape {shape:?} must have 1 to 4 axes"));
    }
    if shape.contains(&0) {
        return Err(format!("shape {shape:?} has an empty axis"));
    }
    let elements: u64 = shape.iter().map(|&d| d as u64).product();
    if elements > MAX_ELEMENTS {
        return Err(format!("shape {shape:?} has {elements} elements, more than the {MAX_ELEMENTS} ipuq supports"));
    }
    Ok(())
}

fn arity(kind: &OpKind, inputs: &[&Value], n: usize) -> Result<(), String> {
    if inputs.len() != n {
        return Err(format!("{} takes {n} input(s), got {}", kind.name(), inputs.len()));
    }
    Ok(())
}

fn infer(kind: &OpKind, inputs: &[&Value]) -> Result<(Vec<u32>, DType), String> {
    match kind {
        OpKind::MatMul { transpose_b } => {
            arity(kind, inputs, 2)?;
            let (a, b) = (inputs[0], inputs[1]);
            if a.dtype != DType::F16 || b.dtype != DType::F16 {
                return Err(format!("matmul runs on the AMP in f16; operands are {} and {}", a.dtype.name(), b.dtype.name()));
            }
            if a.dtype != b.dtype {
                return Err(format!("operands have dtypes {} and {}", a.dtype.name(), b.dtype.name()));
            }
            if !(2..=3).contains(&a.shape.len()) || !(2..=3).contains(&b.shape.len()) {
                return Err(format!("matmul operands must have 2 or 3 axes, got {:?} and {:?}", a.shape, b.shape));
            }
            let (ab, m, k) = split3(&a.shape);
            let (bb, b0, b1) = split3(&b.shape);
            let (kb, n) = if *transpose_b { (b1, b0) } else { (b0, b1) };
            if k != kb {
                return Err(format!("inner dimensions differ: A {:?} has K = {k}, B {:?}{} has K = {kb}", a.shape, b.shape, if *transpose_b { " (transposed)" } else { "" }));
            }
            if bb > ab || ab % bb != 0 {
                return Err(format!("batch of B ({bb}) must divide batch of A ({ab})"));
            }
            let shape = if a.shape.len() == 3 { vec![ab, m, n] } else { vec![m, n] };
            Ok((shape, a.dtype))
        }
        OpKind::LayerNorm { .. } | OpKind::BiasAdd => {
            let params = if matches!(kind, OpKind::LayerNorm { .. }) { 3 } else { 2 };
            arity(kind, inputs, params)?;
            let x = inputs[0];
            let cols = *x.shape.last().expect("shapes have at least one axis");
            let names = if params == 3 { &["gamma", "beta"][..] } else { &["bias"][..] };
            for (v, what) in inputs[1..].iter().zip(names) {
                if v.shape != [cols] {
                    return Err(format!("{what} '{}' must have shape [{cols}] (the last axis of {:?}), got {:?}", v.name, x.shape, v.shape));
                }
            }
            if inputs.iter().any(|v| v.dtype != DType::F16) {
                return Err(format!("{} is implemented for f16 values", kind.name()));
            }
            Ok((x.shape.clone(), x.dtype))
        }
        OpKind::Gelu | OpKind::GeluErf | OpKind::Softmax | OpKind::Scale { .. } => {
            arity(kind, inputs, 1)?;
            if inputs[0].dtype != DType::F16 {
                return Err(format!("{} is implemented for f16 values, got {}", kind.name(), inputs[0].dtype.name()));
            }
            Ok((inputs[0].shape.clone(), inputs[0].dtype))
        }
        OpKind::Add => {
            arity(kind, inputs, 2)?;
            if inputs[0].shape != inputs[1].shape || inputs[0].dtype != inputs[1].dtype {
                return Err(format!("add needs equal shapes and dtypes, got {:?} {} and {:?} {}", inputs[0].shape, inputs[0].dtype.name(), inputs[1].shape, inputs[1].dtype.name()));
            }
            if inputs[0].dtype != DType::F16 {
                return Err("add is implemented for f16 values".into());
            }
            Ok((inputs[0].shape.clone(), inputs[0].dtype))
        }
        OpKind::Reshape { shape } => {
            arity(kind, inputs, 1)?;
            check_shape(shape)?;
            let new: u64 = shape.iter().map(|&d| d as u64).product();
            if new != inputs[0].elements() {
                return Err(format!("cannot reshape {:?} ({} elements) to {shape:?} ({new} elements)", inputs[0].shape, inputs[0].elements()));
            }
            Ok((shape.clone(), inputs[0].dtype))
        }
        OpKind::Transpose { perm } => {
            arity(kind, inputs, 1)?;
            let rank = inputs[0].shape.len();
            let mut seen = vec![false; rank];
            if perm.len() != rank || perm.iter().any(|&p| (p as usize) >= rank || std::mem::replace(&mut seen[p as usize], true)) {
                return Err(format!("perm {perm:?} is not a permutation of the {rank} axes of {:?}", inputs[0].shape));
            }
            if perm[rank - 1] as usize != rank - 1 {
                return Err(format!("perm {perm:?} moves the innermost axis; ipuq moves whole words, so use matmul's transpose_b instead"));
            }
            Ok((perm.iter().map(|&p| inputs[0].shape[p as usize]).collect(), inputs[0].dtype))
        }
        OpKind::TransposeCopy => {
            arity(kind, inputs, 1)?;
            if inputs[0].shape.len() != 2 {
                return Err(format!("transpose_copy needs a rank-2 value, got {:?}", inputs[0].shape));
            }
            Ok((vec![inputs[0].shape[1], inputs[0].shape[0]], inputs[0].dtype))
        }
    }
}

/// (batch, rows, cols) of a rank-2 or rank-3 shape.
pub fn split3(shape: &[u32]) -> (u32, u32, u32) {
    match shape.len() {
        2 => (1, shape[0], shape[1]),
        3 => (shape[0], shape[1], shape[2]),
        _ => panic!("split3 on rank {}", shape.len()),
    }
}

impl StableHash for Graph {
    fn stable_hash(&self, h: &mut KeyHasher) {
        h.add(&self.canonical_toml());
    }
}

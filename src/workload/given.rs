//! Inputs supplied on the command line (`ipuq run --input NAME=FILE.npy`): parsed, read and
//! checked against the workload's declaration before they replace the tensor's initialiser.
//!
//! The file may hold f32 or f16 values; they are rounded once to the declared dtype. The shape
//! must be the declared shape exactly. A NaN, or a finite value beyond the dtype's range, is
//! refused with its element named (infinities given as such are taken). Only tensors with role
//! `input` may be given: weights come from the workload (its initialisers, or the checkpoint it
//! references by digest).

use std::collections::BTreeMap;
use std::path::PathBuf;

use ipuq_queries::ir::{Graph, Producer, Role};

use crate::workload::data::TensorData;
use crate::workload::npy::read_npy;

/// `NAME=FILE` as given to `--input`.
pub fn parse_assignment(text: &str) -> Result<(String, PathBuf), String> {
    match text.split_once('=') {
        Some((name, file)) if !name.is_empty() && !file.is_empty() => Ok((name.to_string(), PathBuf::from(file))),
        _ => Err(format!("--input {text:?}: expected NAME=FILE.npy")),
    }
}

/// The values of each `(name, file)` given, checked against `graph`; errors name the file and
/// the tensor.
pub fn given_inputs(graph: &Graph, given: &[(String, PathBuf)]) -> Result<BTreeMap<String, TensorData>, String> {
    let mut out = BTreeMap::new();
    for (name, file) in given {
        let shown = file.display();
        let id = graph.find(name).ok_or_else(|| {
            let inputs: Vec<&str> = graph.file.tensors.iter().filter(|t| t.role == Role::Input).map(|t| t.name.as_str()).collect();
            format!("--input {name}={shown}: the workload has no tensor '{name}' (its inputs: {})", inputs.join(", "))
        })?;
        let value = graph.value(id);
        if !matches!(value.producer, Producer::Tensor { role: Role::Input, .. }) {
            return Err(format!("--input {name}={shown}: '{name}' is not an input of the workload (only role = \"input\" tensors can be given)"));
        }
        let array = read_npy(file).map_err(|e| format!("--input {name}={shown}: {e}"))?;
        let declared: Vec<u64> = value.shape.iter().map(|&d| d as u64).collect();
        if array.shape != declared {
            return Err(format!("--input {name}={shown}: {shown} has shape {:?}, tensor '{name}' is declared with shape {:?}", array.shape, value.shape));
        }
        let data = TensorData::from_values(value.dtype, value.shape.clone(), array.values).map_err(|e| format!("--input {name}={shown}: {shown}: {e}"))?;
        if out.insert(name.clone(), data).is_some() {
            return Err(format!("--input {name}={shown}: '{name}' is given twice"));
        }
    }
    Ok(out)
}

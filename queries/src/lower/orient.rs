//! Orientation candidates for matrix products: a swapped product computes Cᵀ = Bᵀ·Aᵀ, so the
//! other operand streams through the AMP as rows (for the MLP: the hidden axis instead of the
//! tokens). It is expressed as a rewrite of the graph into views the lowering already knows:
//!
//! ```text
//! C = matmul(A, B)          C.swapped = matmul(Bᵀ, A, transpose_b)      C = transpose(C.swapped)
//! G = gelu(C)          ->   G.swapped = gelu(C.swapped)                 G = transpose(G.swapped)
//! Y = matmul(G, W)          Y.swapped = matmul(Wᵀ, G.swapped)           Y = transpose(Y.swapped)
//! ```
//!
//! Elementwise operations whose operands are all swapped values (or host tensors, which the
//! host writes in any layout) follow their producer's orientation, so no value is transposed
//! in tile memory. Only rank-2 products are swapped. A consumer that must read a swapped value
//! row-wise would move sub-word pieces; the lowering rejects such a candidate.

use std::collections::{BTreeMap, BTreeSet};

use super::grid::ViewChain;
use crate::ir::{DType, Graph, OpKind, Operation, Producer, Value, ValueId};

/// A graph with some products swapped, and how its operations relate to the original ones.
pub struct Oriented {
    pub graph: Graph,
    /// Per operation of `graph`: the index of the original operation it computes (views the
    /// rewrite adds get the index of the operation they serve).
    pub origin: Vec<u32>,
    /// Stored swapped value -> the view with the original name (checkpoints report that one).
    pub checkpoint_value: BTreeMap<ValueId, ValueId>,
    /// The stored swapped values whose original value some reader may read by rows (so it is
    /// written out transposed): their rows, the columns of what is written out, are cut at
    /// even offsets. Decided from the original graph alone ([`read_by_rows`]), so two
    /// orientations agree on every value they share.
    pub row_read: BTreeSet<ValueId>,
    /// Some value is written out transposed for a reader by rows because its product ends a
    /// swapped chain (`chain_ends`), not because the workload constrains that product: the
    /// search takes such orientations only where the weights can be replicated widely
    /// (`search.rs` `chains_allowed`).
    pub chain_written: bool,
}

/// Suffix of the stored value of a swapped operation.
pub const SWAPPED: &str = ".swapped";

/// Suffix of a swapped value's transpose written out for readers that read it by rows (and of
/// the views over it those readers read).
pub const MATERIALIZED: &str = ".rows";

/// Whether some reader of `value` (an original graph's value), directly or through GELUs,
/// scales and bias adds, reads it by rows: anything but the host and a rank-2 product that
/// the workload constrains to swapped (`swapped`; such a product reads a stored transpose as
/// it is). An add is counted as such a reader (its other operand is rarely swapped too).
pub fn read_by_rows(graph: &Graph, value: ValueId, swapped: &BTreeSet<usize>) -> bool {
    graph.operations.iter().enumerate().any(|(i, o)| {
        o.inputs.contains(&value)
            && match o.kind {
                OpKind::MatMul { .. } => !swapped.contains(&i) || o.inputs.iter().chain([&o.output]).any(|&v| graph.value(v).shape.len() != 2),
                OpKind::Gelu | OpKind::GeluErf | OpKind::Scale { .. } => read_by_rows(graph, o.output, swapped),
                OpKind::BiasAdd => o.inputs[0] != value || read_by_rows(graph, o.output, swapped),
                _ => true,
            }
    })
}

/// The value `value` is a view of, and the view operations from `value` back to it (nearest
/// first), in a graph being built.
fn view_ops(values: &[Value], operations: &[Operation], value: ValueId) -> (ValueId, Vec<usize>) {
    let mut chain = Vec::new();
    let mut current = value;
    while let Producer::Operation(op) = values[current.0 as usize].producer {
        if !operations[op].kind.is_view() {
            break;
        }
        chain.push(op);
        current = operations[op].inputs[0];
    }
    (current, chain)
}

/// The rank-2 matrix products of `graph` (operation indices) that may be swapped. A product
/// feeding a bias add only when the bias folds into its epilogue (`elementwise::folded_add`):
/// swapped, the bias is one element per row of Cᵀ, which the product adds as it writes; a
/// separate bias add would read the transposed view, whose f16 columns cannot be gathered in
/// whole words (so every such candidate would fail to lower).
pub fn swappable(graph: &Graph) -> Vec<usize> {
    // A sibling product after the first of its group (`sibling_groups`) stays normal: it may
    // run beside the first one, which the beam orients for the group.
    let followers: BTreeSet<usize> = sibling_groups(graph).into_values().flat_map(|m| m.into_iter().skip(1)).collect();
    rank2_products(graph).into_iter().filter(|i| !followers.contains(i)).collect()
}

/// The rank-2 matrix products whose orientation could change: a product feeding a bias add
/// only when the bias folds into its epilogue (see `swappable`).
fn rank2_products(graph: &Graph) -> Vec<usize> {
    let biased = |o: &crate::ir::Operation| graph.operations.iter().any(|c| matches!(c.kind, OpKind::BiasAdd) && c.inputs.first() == Some(&o.output));
    graph
        .operations
        .iter()
        .enumerate()
        .filter(|(i, o)| {
            matches!(o.kind, OpKind::MatMul { .. })
                && o.inputs.iter().all(|&v| graph.value(v).shape.len() == 2)
                && (!biased(o) || super::elementwise::folded_add(graph, *i).is_some_and(|f| f.bias))
        })
        .map(|(i, _)| i)
        .collect()
}

/// Sibling products: rank-2 products (as `swappable` takes them) of one A value by weights
/// of the same shape and dtype, read the same way (Q, K and V of a LayerNorm output), in a
/// graph whose products no plan constraint names. They may run side by side on disjoint tiles
/// (`build.rs` `matmul_group`). First member -> the members, in program order; groups of two
/// or more.
pub fn sibling_groups(graph: &Graph) -> BTreeMap<usize, Vec<usize>> {
    let constrained = |i: &usize| graph.file.constraints.iter().any(|c| c.operation == graph.value(graph.operations[*i].output).name);
    let products = rank2_products(graph);
    // A plan constraint on any product (the user's, made against products planned one after
    // another, or a steer of `select_finalist`, which plans a program that could not be placed
    // again) plans the siblings one after another, each as before.
    if products.iter().any(constrained) {
        return BTreeMap::new();
    }
    let mut by_key: BTreeMap<(ValueId, bool, Vec<u32>, DType), Vec<usize>> = BTreeMap::new();
    for i in products {
        let o = &graph.operations[i];
        let OpKind::MatMul { transpose_b } = o.kind else { continue };
        let b = graph.value(o.inputs[1]);
        if o.inputs.len() != 2 || !matches!(b.producer, Producer::Tensor { role: crate::ir::Role::Weight, .. }) {
            continue;
        }
        by_key.entry((o.inputs[0], transpose_b, b.shape.clone(), b.dtype)).or_default().push(i);
    }
    by_key.into_values().filter(|m| m.len() > 1).map(|m| (m[0], m)).collect()
}

/// The swapped products (`swapped`) of `graph` that end a swapped chain: their A operand is
/// the result of another swapped product, directly or through GELUs, scales and bias adds
/// (the MLP's second product when both are swapped). Their result may be written out
/// transposed for a reader by rows (`OpKind::TransposeCopy`) without a plan constraint: the
/// chain keeps the hidden axis as the AMP's rows in both products, and one transpose of the
/// chain's narrower result pays for it. A lone swapped product's result still may not be (the
/// search does not weigh a transpose against one product's gain: see the README).
pub fn chain_ends(graph: &Graph, swapped: &BTreeSet<usize>) -> Vec<usize> {
    let mut ends = Vec::new();
    for &p in swapped {
        let Some(o) = graph.operations.get(p).filter(|o| matches!(o.kind, OpKind::MatMul { .. })) else { continue };
        let mut value = o.inputs[0];
        while let Producer::Operation(q) = graph.value(value).producer {
            let producer = &graph.operations[q];
            match producer.kind {
                OpKind::Gelu | OpKind::GeluErf | OpKind::Scale { .. } | OpKind::BiasAdd => value = producer.inputs[0],
                OpKind::MatMul { .. } => {
                    if swapped.contains(&q) {
                        ends.push(p);
                    }
                    break;
                }
                _ => break,
            }
        }
    }
    ends
}

/// Suffix of the row reciprocals value of a softmax whose normalisation is deferred.
pub const RECIPROCALS: &str = ".row_reciprocals";

/// The softmax operations of `graph` whose normalisation the product consuming them applies
/// (softmax operation index -> product operation index): the probabilities are not an output,
/// their only reader is one product that is not swapped (`swapped`), reading them as A, with
/// no add folded into its epilogue. The softmax then stores exp(x - max) and 1 / sum per row;
/// the product (or the reduction finishing it) multiplies its rows by those reciprocals, and
/// the normalise pass over the probabilities is not run. The probabilities then never exist
/// on the device, so they have no checkpoint.
pub fn deferred_softmaxes(graph: &Graph, swapped: &BTreeSet<usize>) -> BTreeMap<usize, usize> {
    let mut out = BTreeMap::new();
    for (j, o) in graph.operations.iter().enumerate() {
        if !matches!(o.kind, OpKind::Softmax) || o.inputs.len() != 1 || graph.outputs.contains(&o.output) {
            continue;
        }
        let readers: Vec<usize> = graph.operations.iter().enumerate().filter(|(_, c)| c.inputs.contains(&o.output)).map(|(c, _)| c).collect();
        if let [c] = readers[..] {
            let product = &graph.operations[c];
            if matches!(product.kind, OpKind::MatMul { .. })
                && product.inputs.len() == 2
                && product.inputs[0] == o.output
                && product.inputs[1] != o.output
                && !swapped.contains(&c)
                && super::elementwise::folded_add(graph, c).is_none()
            {
                out.insert(j, c);
            }
        }
    }
    out
}

/// Rewrite `graph` with the products at `swapped` (operation indices) computed transposed.
/// The rewritten graph is built directly, not parsed: its transposes of host tensors move the
/// innermost axis, which the workload validation rejects for users (a gather through them
/// would move sub-word pieces) but which the host writes in any layout.
pub fn orient(graph: &Graph, swapped: &BTreeSet<usize>) -> Result<Oriented, String> {
    orient_until(graph, swapped, usize::MAX)
}

/// [`orient`], checking only the readers that compute original operations before `until`
/// (the search's partial programs: later products are decided later).
pub fn orient_until(graph: &Graph, swapped: &BTreeSet<usize>, until: usize) -> Result<Oriented, String> {
    let mut values: Vec<Value> = graph.values.iter().filter(|v| matches!(v.producer, Producer::Tensor { .. })).cloned().collect();
    let mut map: BTreeMap<ValueId, ValueId> = BTreeMap::new();
    for (i, v) in graph.values.iter().enumerate() {
        if matches!(v.producer, Producer::Tensor { .. }) {
            map.insert(ValueId(i as u32), ValueId(values.iter().position(|w| w.name == v.name).expect("copied") as u32));
        }
    }
    let mut operations: Vec<Operation> = Vec::new();
    let mut origin: Vec<u32> = Vec::new();
    // Original value -> the stored value (new graph) holding its transpose.
    let mut transposed: BTreeMap<ValueId, ValueId> = BTreeMap::new();
    let mut checkpoint_value = BTreeMap::new();
    // Stored swapped value -> its transpose written out (`OpKind::TransposeCopy`).
    let mut materialized: BTreeMap<ValueId, ValueId> = BTreeMap::new();
    let mut row_read: BTreeSet<ValueId> = BTreeSet::new();
    let mut chain_written = false;
    // Stored swapped value -> the original product it derives from; the products the
    // workload constrains to swapped, whose results readers by rows may read written out.
    let mut stored_product: BTreeMap<ValueId, usize> = BTreeMap::new();
    let (constrained, _) = super::search::orientation_constraints(graph);
    // The products whose results readers by rows may read written out: those the workload
    // constrains to swapped, and swapped products that end a swapped chain (`chain_ends`).
    let written: BTreeSet<usize> = constrained.iter().copied().chain(chain_ends(graph, swapped)).collect();
    let push = |values: &mut Vec<Value>, operations: &mut Vec<Operation>, origin: &mut Vec<u32>, kind: OpKind, inputs: Vec<ValueId>, name: String, shape: Vec<u32>, dtype: DType, index: usize| {
        let id = ValueId(values.len() as u32);
        values.push(Value { name, shape, dtype, producer: Producer::Operation(operations.len()) });
        operations.push(Operation { kind, inputs, output: id });
        origin.push(index as u32);
        id
    };
    let t2 = |s: &[u32]| vec![s[1], s[0]];
    // Deferred softmax normalisations: the softmax also produces its row reciprocals (a value
    // right after its output), which the consuming product reads as a third input.
    let deferred = deferred_softmaxes(graph, swapped);
    let mut reciprocals: BTreeMap<usize, ValueId> = BTreeMap::new();
    for (index, operation) in graph.operations.iter().enumerate() {
        let out = graph.value(operation.output);
        let swapped_name = format!("{}{SWAPPED}", out.name);
        let rank2 = operation.inputs.iter().all(|&v| graph.value(v).shape.len() == 2);
        if swapped.contains(&index) {
            let OpKind::MatMul { transpose_b } = operation.kind else { return Err(format!("operation '{}' is not a matrix product", out.name)) };
            if !rank2 {
                return Err(format!("operation '{}': only rank-2 products can be swapped", out.name));
            }
            let (a, b) = (operation.inputs[0], operation.inputs[1]);
            // Bᵀ as the new A: B itself when given transposed, its stored transpose, or a view.
            let new_a = if transpose_b {
                map[&b]
            } else if let Some(&t) = transposed.get(&b) {
                t
            } else {
                let bv = graph.value(b);
                push(&mut values, &mut operations, &mut origin, OpKind::Transpose { perm: vec![1, 0] }, vec![map[&b]], format!("{}.transposed_for_{}", bv.name, out.name), t2(&bv.shape), bv.dtype, index)
            };
            // Aᵀ as the new B: A's stored transpose as [k, m], or A itself given as [m, k].
            let (new_b, new_transpose_b) = match transposed.get(&a) {
                Some(&t) => (t, false),
                None => (map[&a], true),
            };
            let stored = push(&mut values, &mut operations, &mut origin, OpKind::MatMul { transpose_b: new_transpose_b }, vec![new_a, new_b], swapped_name, t2(&out.shape), out.dtype, index);
            let view = push(&mut values, &mut operations, &mut origin, OpKind::Transpose { perm: vec![1, 0] }, vec![stored], out.name.clone(), out.shape.clone(), out.dtype, index);
            map.insert(operation.output, view);
            transposed.insert(operation.output, stored);
            checkpoint_value.insert(stored, view);
            stored_product.insert(stored, index);
            if written.contains(&index) && read_by_rows(graph, operation.output, &constrained) {
                row_read.insert(stored);
            }
            continue;
        }
        let is_host = |v: ValueId| matches!(graph.value(v).producer, Producer::Tensor { .. });
        let follows = matches!(operation.kind, OpKind::Gelu | OpKind::Scale { .. } | OpKind::Add)
            && rank2
            && operation.inputs.iter().any(|i| transposed.contains_key(i))
            && operation.inputs.iter().all(|&i| transposed.contains_key(&i) || is_host(i));
        // A bias add over a swapped product adds its 1-D bias per row of the stored transpose
        // (the lowering folds it into the product's epilogue, the only way it lowers).
        let bias_follows = matches!(operation.kind, OpKind::BiasAdd) && transposed.contains_key(&operation.inputs[0]) && is_host(operation.inputs[1]);
        if follows || bias_follows {
            let mut inputs = Vec::new();
            for (position, &i) in operation.inputs.iter().enumerate() {
                match transposed.get(&i) {
                    Some(&t) => inputs.push(t),
                    None if bias_follows && position == 1 => inputs.push(map[&i]),
                    None => {
                        let iv = graph.value(i);
                        inputs.push(push(&mut values, &mut operations, &mut origin, OpKind::Transpose { perm: vec![1, 0] }, vec![map[&i]], format!("{}.transposed_for_{}", iv.name, out.name), t2(&iv.shape), iv.dtype, index));
                    }
                }
            }
            let stored = push(&mut values, &mut operations, &mut origin, operation.kind.clone(), inputs, swapped_name, t2(&out.shape), out.dtype, index);
            let view = push(&mut values, &mut operations, &mut origin, OpKind::Transpose { perm: vec![1, 0] }, vec![stored], out.name.clone(), out.shape.clone(), out.dtype, index);
            map.insert(operation.output, view);
            transposed.insert(operation.output, stored);
            checkpoint_value.insert(stored, view);
            // A follower derives from the product behind its first swapped input.
            let product = operation.inputs.iter().find_map(|i| transposed.get(i)).and_then(|t| stored_product.get(t)).copied().unwrap_or(usize::MAX);
            stored_product.insert(stored, product);
            if written.contains(&product) && read_by_rows(graph, operation.output, &constrained) {
                row_read.insert(stored);
            }
            continue;
        }
        let mut inputs: Vec<ValueId> = operation.inputs.iter().map(|i| map[i]).collect();
        if !operation.kind.is_view() && index < until {
            for input in inputs.iter_mut() {
                // A computing reader of a swapped value through its transpose (by rows: a
                // product in normal orientation, a residual add, a LayerNorm) reads the value
                // written out transposed, once, just before the first such reader, where the
                // workload constrains the product behind it to swapped or that product ends a
                // swapped chain (`chain_ends`; the search does not weigh a lone product's
                // transpose itself: see the README).
                let (base, chain) = view_ops(&values, &operations, *input);
                let Some(&view) = checkpoint_value.get(&base).filter(|_| !chain.is_empty()) else { continue };
                if !stored_product.get(&base).is_some_and(|p| written.contains(p)) {
                    continue;
                }
                chain_written |= !stored_product.get(&base).is_some_and(|p| constrained.contains(p));
                let rows = match materialized.get(&base) {
                    Some(&m) => m,
                    None => {
                        let v = values[view.0 as usize].clone();
                        let m = push(&mut values, &mut operations, &mut origin, OpKind::TransposeCopy, vec![base], format!("{}{MATERIALIZED}", v.name), v.shape.clone(), v.dtype, index);
                        materialized.insert(base, m);
                        m
                    }
                };
                // The views between the original value and the reader, over the written-out
                // value (the first, the transpose that was the original value, is dropped).
                let mut current = rows;
                for &op in chain.iter().rev().skip(1) {
                    let (kind, out) = (operations[op].kind.clone(), operations[op].output);
                    let v = values[out.0 as usize].clone();
                    current = push(&mut values, &mut operations, &mut origin, kind, vec![current], format!("{}{MATERIALIZED}", v.name), v.shape.clone(), v.dtype, index);
                }
                *input = current;
            }
        }
        if let Some((softmax, _)) = deferred.iter().find(|(_, &c)| c == index) {
            inputs.push(reciprocals[softmax]);
        }
        let id = push(&mut values, &mut operations, &mut origin, operation.kind.clone(), inputs, out.name.clone(), out.shape.clone(), out.dtype, index);
        map.insert(operation.output, id);
        if deferred.contains_key(&index) {
            let r = ValueId(values.len() as u32);
            // One element per row: each factor in its own aligned slot, so any block of rows
            // moves and copies in whole 64-bit-aligned pieces.
            let mut rows = out.shape[..out.shape.len() - 1].to_vec();
            rows.push(1);
            values.push(Value { name: format!("{}{RECIPROCALS}", out.name), shape: rows, dtype: DType::F32, producer: Producer::Operation(operations.len() - 1) });
            reciprocals.insert(index, r);
        }
    }
    let outputs = graph.outputs.iter().map(|o| map[o]).collect();
    let rewritten = Graph { name: graph.name.clone(), file: graph.file.clone(), values, operations, outputs };
    // A computing consumer that reads a swapped value through its transpose would gather
    // single f16 elements: such an orientation cannot lower, so it is no candidate.
    for (_, o) in rewritten.operations.iter().enumerate().filter(|(i, o)| !o.kind.is_view() && (origin[*i] as usize) < until) {
        for &input in &o.inputs {
            let chain = ViewChain::resolve(&rewritten, input);
            if !chain.is_identity() && checkpoint_value.contains_key(&chain.base) {
                let reader = &rewritten.value(o.output).name;
                return Err(format!("'{reader}' would read the swapped value '{}' across its rows", rewritten.value(chain.base).name));
            }
        }
    }
    Ok(Oriented { graph: rewritten, origin, checkpoint_value, row_read, chain_written })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MLP: &str = r#"
name = "mlp"
outputs = ["y"]
[[tensor]]
name = "x"
shape = [5, 8]
dtype = "f16"
role = "input"
init = "zeros"
[[tensor]]
name = "w1"
shape = [8, 12]
dtype = "f16"
role = "weight"
init = "zeros"
[[tensor]]
name = "w2"
shape = [12, 8]
dtype = "f16"
role = "weight"
init = "zeros"
[[operation]]
name = "h"
op = "matmul"
inputs = ["x", "w1"]
[[operation]]
name = "g"
op = "gelu"
inputs = ["h"]
[[operation]]
name = "y"
op = "matmul"
inputs = ["g", "w2"]
"#;

    /// The MLP with 1-D biases after each product; `extra` appends operations.
    fn biased(extra: &str) -> String {
        let (tensors, _) = MLP.split_at(MLP.find("[[operation]]").unwrap());
        let mut text = tensors.replace("outputs = [\"y\"]", "outputs = [\"yb\"]");
        for (name, n) in [("b1", 12), ("b2", 8)] {
            text += &format!("[[tensor]]\nname = \"{name}\"\nshape = [{n}]\ndtype = \"f16\"\nrole = \"weight\"\ninit = \"zeros\"\n");
        }
        for (name, op, inputs) in [("h", "matmul", "\"x\", \"w1\""), ("hb", "bias_add", "\"h\", \"b1\""), ("g", "gelu", "\"hb\""), ("y", "matmul", "\"g\", \"w2\""), ("yb", "bias_add", "\"y\", \"b2\"")] {
            text += &format!("[[operation]]\nname = \"{name}\"\nop = \"{op}\"\ninputs = [{inputs}]\n");
        }
        text + extra
    }

    #[test]
    fn a_product_whose_bias_folds_may_be_swapped_and_its_bias_add_follows() {
        let g = Graph::parse(&biased(""), "mlp").unwrap();
        let folds = super::super::elementwise::folded_adds(&g);
        assert_eq!(folds.len(), 2, "both bias adds fold into their products");
        assert!(folds.values().all(|f| f.bias));
        assert_eq!(swappable(&g), vec![0, 3]);
        let o = orient(&g, &[0, 3].into_iter().collect()).unwrap();
        // The bias add reads the stored transpose directly, with its 1-D bias as given.
        let hb = o.graph.find("hb.swapped").expect("the bias add follows its swapped product");
        let producer = match o.graph.value(hb).producer {
            Producer::Operation(i) => &o.graph.operations[i],
            _ => unreachable!(),
        };
        let names: Vec<&str> = producer.inputs.iter().map(|&v| o.graph.value(v).name.as_str()).collect();
        assert_eq!((producer.kind.clone(), names), (OpKind::BiasAdd, vec!["h.swapped", "b1"]));
        // In the rewritten graph the fold still holds (the view of the stored product is read by no one).
        assert_eq!(super::super::elementwise::folded_adds(&o.graph).len(), 2);
        // A product with a second reader besides its bias add does not fold, so it is not swapped.
        let g = Graph::parse(&biased("[[operation]]\nname = \"h2\"\nop = \"gelu\"\ninputs = [\"h\"]\n"), "mlp").unwrap();
        assert_eq!(swappable(&g), vec![3]);
    }

    fn attention(outputs: &str) -> String {
        let mut text = format!("name = \"att\"\noutputs = [{outputs}]\n");
        for name in ["q", "k", "v"] {
            text += &format!("[[tensor]]\nname = \"{name}\"\nshape = [6, 8]\ndtype = \"f16\"\nrole = \"input\"\ninit = \"zeros\"\n");
        }
        text += "[[operation]]\nname = \"s\"\nop = \"matmul\"\ninputs = [\"q\", \"k\"]\ntranspose_b = true\n";
        text += "[[operation]]\nname = \"p\"\nop = \"softmax\"\ninputs = [\"s\"]\n";
        text + "[[operation]]\nname = \"c\"\nop = \"matmul\"\ninputs = [\"p\", \"v\"]\n"
    }

    #[test]
    fn a_softmax_read_only_by_an_unswapped_product_defers_its_normalisation() {
        let g = Graph::parse(&attention("\"c\""), "att").unwrap();
        assert_eq!(deferred_softmaxes(&g, &BTreeSet::new()), [(1, 2)].into_iter().collect());
        let o = orient(&g, &BTreeSet::new()).unwrap();
        // The reciprocals follow the softmax's output, one fp32 element per row, and the
        // product reads them as its third input.
        let r = o.graph.find(&format!("p{RECIPROCALS}")).expect("the reciprocals value");
        let p = o.graph.find("p").unwrap();
        assert_eq!(r.0, p.0 + 1);
        assert_eq!((o.graph.value(r).shape.clone(), o.graph.value(r).dtype), (vec![6, 1], DType::F32));
        assert_eq!(o.graph.value(r).producer, Producer::Operation(1));
        assert_eq!(o.graph.operations[2].inputs, vec![p, o.graph.find("v").unwrap(), r]);
        // Not when the product is swapped (it reads the probabilities transposed), nor when
        // the probabilities are an output.
        assert!(deferred_softmaxes(&g, &[2].into_iter().collect()).is_empty());
        if let Ok(o) = orient(&g, &[2].into_iter().collect()) {
            assert!(o.graph.find(&format!("p{RECIPROCALS}")).is_none());
        }
        let g = Graph::parse(&attention("\"c\", \"p\""), "att").unwrap();
        assert!(deferred_softmaxes(&g, &BTreeSet::new()).is_empty());
        assert_eq!(orient(&g, &BTreeSet::new()).unwrap().graph.values.len(), g.values.len());
    }

    #[test]
    fn swapping_a_chain_keeps_every_value_and_stores_transposes() {
        let g = Graph::parse(MLP, "mlp").unwrap();
        assert_eq!(swappable(&g), vec![0, 2]);
        let o = orient(&g, &[0, 2].into_iter().collect()).unwrap();
        let shape = |n: &str| o.graph.value(o.graph.find(n).unwrap()).shape.clone();
        // Every original value keeps its name and shape; the swapped ones are stored transposed.
        for (name, s) in [("h", vec![5, 12]), ("g", vec![5, 12]), ("y", vec![5, 8]), ("h.swapped", vec![12, 5]), ("g.swapped", vec![12, 5]), ("y.swapped", vec![8, 5])] {
            assert_eq!(shape(name), s, "{name}");
        }
        // y.swapped = w2ᵀ · g.swapped: the gelu's stored transpose feeds the second product directly.
        let producer = |n: &str| &o.graph.operations[match o.graph.value(o.graph.find(n).unwrap()).producer {
            Producer::Operation(i) => i,
            _ => unreachable!(),
        }];
        let names = |op: &Operation| op.inputs.iter().map(|&v| o.graph.value(v).name.clone()).collect::<Vec<_>>();
        assert_eq!(names(producer("y.swapped")), vec!["w2.transposed_for_y", "g.swapped"]);
        assert_eq!(producer("y.swapped").kind, OpKind::MatMul { transpose_b: false });
        assert_eq!(names(producer("h.swapped")), vec!["w1.transposed_for_h", "x"]);
        assert_eq!(producer("h.swapped").kind, OpKind::MatMul { transpose_b: true });
        assert_eq!(o.checkpoint_value.len(), 3);
        assert_eq!(o.origin.len(), o.graph.operations.len());
        // Nothing swapped: the same operations.
        let same = orient(&g, &BTreeSet::new()).unwrap();
        assert_eq!(same.graph.operations, g.operations);
    }

    /// A reader by rows of a swapped value (here the second product in normal orientation
    /// reading the gelu of a swapped first product) reads it written out transposed, once,
    /// right before that reader; the stored transpose keeps its checkpoint view.
    #[test]
    fn a_reader_by_rows_reads_the_swapped_value_written_out() {
        // Only where the workload constrains the product to swapped (else, as before, the
        // orientation is no candidate).
        assert!(orient(&Graph::parse(MLP, "mlp").unwrap(), &[0].into_iter().collect()).is_err());
        let g = Graph::parse(&format!("{MLP}[[constraint]]\noperation = \"h\"\norientation = \"swapped\"\n"), "mlp").unwrap();
        let o = orient(&g, &[0].into_iter().collect()).unwrap();
        let id = |n: &str| o.graph.find(n).unwrap();
        let copies: Vec<usize> = (0..o.graph.operations.len()).filter(|&i| o.graph.operations[i].kind == OpKind::TransposeCopy).collect();
        assert_eq!(copies.len(), 1);
        let copy = &o.graph.operations[copies[0]];
        assert_eq!((copy.inputs.clone(), copy.output), (vec![id("g.swapped")], id(&format!("g{MATERIALIZED}"))));
        assert_eq!(o.graph.value(copy.output).shape, vec![5, 12]);
        // The next operation is the product, reading it as A; both serve the original product.
        let reader = &o.graph.operations[copies[0] + 1];
        assert_eq!((reader.kind.clone(), reader.inputs.clone(), reader.output), (OpKind::MatMul { transpose_b: false }, vec![copy.output, id("w2")], id("y")));
        assert_eq!((o.origin[copies[0]], o.origin[copies[0] + 1]), (2, 2));
        assert_eq!(o.checkpoint_value.get(&id("g.swapped")), Some(&id("g")));
        // The gelu's only reader is a product not constrained to swapped, which reads it by
        // rows: the first product's row cuts (and the gelu's, on its grid) fall on whole
        // 64-bit groups.
        assert_eq!(o.row_read, [id("h.swapped"), id("g.swapped")].into_iter().collect());
        // Both swapped: nothing is written out.
        let both = orient(&g, &[0, 2].into_iter().collect()).unwrap();
        assert!(both.graph.operations.iter().all(|op| op.kind != OpKind::TransposeCopy));
    }

    /// A swapped product (constrained so) whose result a residual add reads by rows: its stored
    /// transpose is row-read (its row cuts fall on whole 64-bit groups).
    #[test]
    fn a_residual_read_marks_the_swapped_product_row_read() {
        let text = MLP.replace("name = \"y\"\nop = \"matmul\"\ninputs = [\"g\", \"w2\"]", "name = \"y0\"\nop = \"matmul\"\ninputs = [\"g\", \"w2\"]\n[[operation]]\nname = \"y\"\nop = \"add\"\ninputs = [\"y0\", \"x\"]");
        let g = Graph::parse(&(text.clone() + "[[constraint]]\noperation = \"y0\"\norientation = \"swapped\"\n"), "mlp").unwrap();
        let y0 = g.find("y0").unwrap();
        let (constrained, _) = super::super::search::orientation_constraints(&g);
        // y0 reaches an add; g only the product, which the workload constrains to swapped.
        assert!(read_by_rows(&g, y0, &constrained) && !read_by_rows(&g, g.find("g").unwrap(), &constrained));
        assert!(read_by_rows(&g, g.find("g").unwrap(), &BTreeSet::new()));
        let o = orient(&g, &[2].into_iter().collect()).unwrap();
        // The add follows the swapped product (its other operand is a host input), so the
        // graph output is read by the host: nothing written out, but the value is row-read.
        assert_eq!(o.row_read, [o.graph.find("y0.swapped").unwrap()].into_iter().collect());
        // Unconstrained, nothing is row-read (the plans are those of before).
        let free = Graph::parse(&text, "mlp").unwrap();
        assert!(orient(&free, &[2].into_iter().collect()).unwrap().row_read.is_empty());
    }

    /// Both products of an MLP swapped, without constraints: the second ends a swapped chain
    /// (its A is the GELU of the first's stored transpose), so a reader by rows (here a
    /// residual add of a value computed on the tiles) reads its result written out
    /// transposed, once; the first product alone swapped is still no candidate.
    #[test]
    fn the_end_of_a_swapped_chain_is_written_out_for_a_reader_by_rows() {
        let text = MLP.replace("outputs = [\"y\"]", "outputs = [\"r\"]").replace("name = \"y\"\nop = \"matmul\"\ninputs = [\"g\", \"w2\"]", "name = \"y\"\nop = \"matmul\"\ninputs = [\"g\", \"w2\"]\n[[operation]]\nname = \"s\"\nop = \"gelu\"\ninputs = [\"x\"]\n[[operation]]\nname = \"r\"\nop = \"add\"\ninputs = [\"y\", \"s\"]");
        let g = Graph::parse(&text, "mlp").unwrap();
        assert_eq!(swappable(&g), vec![0, 2]);
        assert_eq!(chain_ends(&g, &[0, 2].into_iter().collect()), vec![2]);
        assert!(chain_ends(&g, &[2].into_iter().collect()).is_empty());
        let o = orient(&g, &[0, 2].into_iter().collect()).unwrap();
        let id = |n: &str| o.graph.find(n).unwrap();
        let copies: Vec<&Operation> = o.graph.operations.iter().filter(|op| op.kind == OpKind::TransposeCopy).collect();
        assert_eq!(copies.len(), 1);
        assert_eq!((copies[0].inputs.clone(), copies[0].output), (vec![id("y.swapped")], id(&format!("y{MATERIALIZED}"))));
        // The add reads the written-out value; the stored transpose's rows fall on whole words.
        let add = o.graph.operations.iter().find(|op| op.kind == OpKind::Add).unwrap();
        assert!(add.inputs.contains(&id(&format!("y{MATERIALIZED}"))));
        assert_eq!(o.row_read, [id("y.swapped")].into_iter().collect());
        assert!(o.chain_written);
        // The second product alone swapped (its A not a swapped result): rejected as before.
        assert!(orient(&g, &[2].into_iter().collect()).is_err());
        assert!(orient(&g, &[0].into_iter().collect()).is_err());
    }
}

//! The whole-program search in `lower_mid`: a beam over program order. At each rank-2 matrix
//! product the beam's partial programs (lowered prefixes, `build::Partial`) are extended with
//! the product normal and swapped (as the user's constraints allow), each extension lowering
//! only the operations up to the next product; the extensions are kept by Pareto retention on
//! estimated cycles, estimated exchange cycles and peak standard, interleaved and total bytes
//! per tile (the non-dominated ones first, best estimate first, up to the beam width). The
//! work grows linearly with the number of products (two extensions per state and product),
//! where an enumeration of orientation subsets grows with their count. The programs the beam
//! ends with are then made whole-program feasible (below); the best K by estimated cycles are
//! the finalists that `select_finalist` costs exactly.
//!
//! Once a program of the beam keeps weights on home tiles, each program that still replicates
//! them carries the same program lowered with home-tile weights, extended alongside; an
//! extension that outgrows tile memory with replicated weights (and `lower_feasible`'s first
//! home-weights attempt) then extends that prefix instead of lowering from the start: the same
//! program, as extending a prefix always gives the program lowered at once. The beam also
//! keeps a small pool of such prefixes for all its states (the states' own, the ones the last
//! step's home lowerings extended, and where a home lowering passed the start of the product
//! being extended, the prefix up to there, which the product's other orientations share): a
//! switch, or the start of carrying, extends the longest compatible one, so only the first
//! switch of a program lowers home-tile weights from the start, and the beam's work stays
//! linear in the number of operations. Before any program keeps weights on home tiles, a step
//! that leaves a thread idle (one program to extend) lowers that program's parent with
//! home-tile weights beside it, product by product while the step lasts, into the pool: the
//! first switch then extends that prefix too (speed only, as any pool prefix).
//!
//! Whole-program feasibility: a program is kept only if every tile's buffers,
//! all operations together, can be placed in their regions (the same placement the pipeline
//! runs later, with the code reserve standing in for the code). When they cannot, each
//! operation is planned again with a budget that deducts what the other operations keep live
//! on a tile while it runs (host-written weights are live from the start), in total and in
//! interleaved memory, until the program fits or the budgets stop changing. Weight
//! arrangements are tried in order: replicated, mixed (the products from some operation on keep
//! their weights on home tiles, the earlier ones replicated; `mixed_from` derives the start from
//! the overflow), every weight on aligned home tiles, then rotating homes.
//!
//! Resuming across builds: the beam leaves a trace (`BeamTrace`: per product step, the states
//! it kept, as swapped products and home start). The next build of an edited workload repeats
//! the steps that are provably identical on its graph (`identical_steps`, over
//! `build::prefix_identical_across_graphs`), lowers that step's states again (`replay`,
//! sharing their common prefixes) and searches on from the next product: the same programs
//! as a beam from the start, so an edit in the last block searches only that block's products.
//!
//! This file is long (about 1650 lines) because the beam, its trace and resumption, the
//! feasibility step and the mixed-weights start share their helpers and their small-program
//! tests.

use std::cell::Cell;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use rayon::prelude::*;

use tracing::{debug, info, warn};

use super::peaks;
use super::build::{complete, extend, lower_block_capped, lower_homing_from, lower_replication_capped, lower_with_period_homes, lower_with_rotated_homes, weights_repeat, prefix_compatible, prefix_identical_across_graphs, Attempt, Partial, Reserve, CODE_RESERVE_BYTES, REPLICAS_AT_MOST};
use super::orient::{orient, orient_until, swappable, Oriented};
use super::{BufferDecl, LHostTensor, LowerError, Lowered};
use crate::ir::Graph;
use crate::package::{AllocationKind, HostRole};
use crate::storage::{place_storage, PlacementError};
use crate::target::Target;

/// Rounds of re-planning with updated budgets per weight arrangement.
const ROUNDS: usize = 3;

/// Mixed programs `lower_feasible` tries when replicated weights do not fit (each one
/// lowering; each overflow left names the next, earlier start), before every weight is homed.
const MIXED_TRIES: usize = 3;

/// The share of a tile's bytes (1 / this) the fallback cap of `capped_program` leaves
/// unclaimed: the partitions of a product need not divide the tiles evenly (the fullest tile
/// holds more than the mean), and placement loses bytes to regions and alignment. The first
/// cap claims them all (`first_cap` without the margin), since the capped plans' own
/// transient bytes shrink as replicas grow (each tile gathers 1/r of the rows it multiplies);
/// where it does not fit, the cap with the margin is tried (session 43: four encoder layers
/// fit five replicas, 1,491,756 cycles against four's 1,509,048). `chains_allowed` keeps the
/// margin.
const CAP_MARGIN: u64 = 32;

/// Finalists kept by default (`--plan-finalists`).
pub const DEFAULT_FINALISTS: usize = 4;

/// What the plan beam decided, small enough to keep between builds, so that the next build of
/// an edited workload resumes the beam from the last product step the edit provably leaves
/// alike (`beam`), instead of searching from the first product.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct BeamTrace {
    /// The workload the beam ran on, as its structure (`Graph::parse` rebuilds the graph;
    /// initialisers blanked: the lowering never reads them).
    pub workload: String,
    /// The beam width.
    pub width: u64,
    /// `steps[0]`: the beam after lowering up to the first product; `steps[j + 1]`: after
    /// product j was extended (lowered up to the next product).
    pub steps: Vec<TraceStep>,
}

/// The beam after one step.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct TraceStep {
    /// The states kept, in beam order.
    pub states: Vec<TracedState>,
    /// Whether an error was noted up to and including this step (such a beam is not resumed
    /// past it: the error it reports is the first one met).
    pub noted: bool,
}

/// One state of the beam: enough to lower it again (`replay`).
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct TracedState {
    /// The products swapped (original operation indices), ascending.
    pub swapped: Vec<u64>,
    /// `Partial::home_from` (u64::MAX: every weight replicated).
    pub home_from: u64,
}

impl TracedState {
    fn of(state: &State) -> TracedState {
        TracedState { swapped: state.swapped.iter().map(|&p| p as u64).collect(), home_from: state.partial.home_from() as u64 }
    }

    fn swapped_set(&self) -> BTreeSet<usize> {
        self.swapped.iter().map(|&p| usize::try_from(p).unwrap_or(usize::MAX)).collect()
    }

    fn home_from(&self) -> usize {
        usize::try_from(self.home_from).unwrap_or(usize::MAX)
    }
}

/// The workload structure text a trace keeps (initialisers blanked, as the graph digest of
/// `db::graph`): `Graph::parse` of it gives the graph again.
fn workload_structure(graph: &Graph) -> String {
    let mut file = graph.file.clone();
    for t in &mut file.tensors {
        t.init = crate::ir::Init::Zeros;
    }
    toml::to_string(&file).unwrap_or_default()
}

/// Oriented operations (non-decreasing origins) before original operation `next` (all: none).
fn end_before(o: &Oriented, next: Option<usize>) -> usize {
    next.map_or(o.graph.operations.len(), |n| o.origin.partition_point(|&x| (x as usize) < n))
}

/// The options for a product: normal, swapped, as the user's constraints allow.
fn options_for(product: usize, must: &BTreeSet<usize>, must_not: &BTreeSet<usize>) -> Vec<bool> {
    [false, true].into_iter().filter(|&swap| if swap { !must_not.contains(&product) } else { !must.contains(&product) }).collect()
}

/// How many steps of the beam of `trace` (run on `old`) the beam on `graph` would repeat
/// exactly, from the start: step s counts only when every step before it does, no error was
/// noted up to it, and it is provably identical on both graphs: the products up to and
/// including its next product are the same, so are the user's orientation constraints on
/// them (the options per product), and each of its jobs (each state the trace kept at the
/// step before, times each option) orients both graphs alike up to the next product (both
/// rejected, or both accepted with the same prefix to lower, which lowers alike:
/// `prefix_identical_across_graphs`). Then each extension lowers the same program and scores
/// the same, so retention keeps the same states in the same order, and the errors noted are
/// the same (none). `target` and `width` must be those the trace was made with (the caller's
/// key holds the target; the width is checked).
#[allow(clippy::too_many_arguments)]
fn identical_steps(old: &Graph, trace: &BeamTrace, graph: &Graph, width: usize, products: &[usize], must: &BTreeSet<usize>, must_not: &BTreeSet<usize>, chains: (bool, bool)) -> usize {
    if trace.width != width as u64 || home_constraint(old) != home_constraint(graph) {
        return 0;
    }
    let old_products = swappable(old);
    let (old_must, old_must_not) = orientation_constraints(old);
    if !old_must.iter().all(|m| old_products.contains(m)) {
        return 0;
    }
    let mut done = 0;
    for (s, step) in trace.steps.iter().enumerate() {
        if s > products.len() || step.noted || step.states.len() > width || !products.iter().take(s + 1).eq(old_products.iter().take(s + 1)) {
            break;
        }
        let next = products.get(s).copied();
        let jobs: Vec<BTreeSet<usize>> = if s == 0 {
            vec![BTreeSet::new()]
        } else {
            let product = products[s - 1];
            if must.contains(&product) != old_must.contains(&product) || must_not.contains(&product) != old_must_not.contains(&product) {
                break;
            }
            let options = options_for(product, must, must_not);
            let parents = &trace.steps[s - 1].states;
            // The trace's own states: swapped products among those extended so far.
            if parents.iter().any(|r| !r.swapped_set().iter().all(|p| products[..s - 1].contains(p))) {
                break;
            }
            parents
                .iter()
                .flat_map(|r| {
                    options.iter().map(move |&swap| {
                        let mut swapped = r.swapped_set();
                        if swap {
                            swapped.insert(product);
                        }
                        swapped
                    })
                })
                .collect()
        };
        let until = next.unwrap_or(usize::MAX);
        let same = jobs.par_iter().all(|swapped| match (beam_orient(old, swapped, until, chains.0), beam_orient(graph, swapped, until, chains.1)) {
            (Err(_), Err(_)) => true,
            (Ok(a), Ok(b)) => {
                let end = end_before(&a, next);
                end == end_before(&b, next) && prefix_identical_across_graphs(&a, &b, end)
            }
            _ => false,
        });
        // Retention keeps a completable state beyond the width where none of the others is
        // (`retain`): a trace step with none completable on the new graph might keep another.
        if !same || !step.states.iter().any(|r| completable(graph, &products[s..], &r.swapped_set(), (must, must_not), chains.1)) {
            break;
        }
        done = s + 1;
    }
    done
}

/// The states trace step `last` kept, lowered again over `graph` (up to the step's next
/// product), as the beam had them: the same programs from the start as the beam built by
/// extensions (see `replayed_states_equal_the_beams`). With `carry`, a state whose weights are
/// not all on home tiles also gets its program lowered with home-tile weights (the beam's
/// carried prefix; a speed matter only, left out where it does not lower). None when a state
/// does not lower (then nothing is resumed).
fn replay(records: &[TracedState], products: &[usize], last: usize, graph: &Graph, target: &Target, carry: bool) -> Option<Vec<State>> {
    // The programs to lower: (swapped, home start), each once.
    let mut items: Vec<(BTreeSet<usize>, usize)> = Vec::new();
    let index = |items: &mut Vec<(BTreeSet<usize>, usize)>, item: (BTreeSet<usize>, usize)| match items.iter().position(|i| *i == item) {
        Some(i) => i,
        None => {
            items.push(item);
            items.len() - 1
        }
    };
    let wanted: Vec<(usize, Option<usize>)> = records
        .iter()
        .map(|r| {
            let own = index(&mut items, (r.swapped_set(), r.home_from()));
            let home = (carry && r.home_from() != 0).then(|| index(&mut items, (r.swapped_set(), 0)));
            (own, home)
        })
        .collect();
    let replay = Replay { items: &items, products, last, graph, target };
    let mut lowered: Vec<Option<Lowering>> = vec![None; items.len()];
    for (i, program) in replay.groups(&(0..items.len()).collect::<Vec<_>>(), 0).into_par_iter().map(|group| replay.lower_group(group, 0, None)).flatten().collect::<Vec<_>>() {
        lowered[i] = program;
    }
    wanted
        .into_iter()
        .zip(records)
        .map(|((own, home), r)| {
            let (oriented, partial) = lowered[own].clone()?;
            let home = home.and_then(|h| lowered[h].clone()).map(|(oriented, partial)| Arc::new(HomePrefix { oriented, partial }));
            Some(State { swapped: r.swapped_set(), oriented, partial, home, history: None })
        })
        .collect()
}

/// Programs of a trace step lowered again (`replay`), sharing their common prefixes as the
/// beam did: programs that agree on the products extended up to a step (and on their home
/// start) are lowered once up to that step's next product, then extended apart.
struct Replay<'a> {
    items: &'a [(BTreeSet<usize>, usize)],
    products: &'a [usize],
    /// The trace step of the programs.
    last: usize,
    graph: &'a Graph,
    target: &'a Target,
}

/// A lowered program prefix: its orientation and the prefix.
type Lowering = (Arc<Oriented>, Partial);

/// A replayed program as of a step: the products it swapped among those extended by then,
/// and its home start.
type ReplayKey = (Vec<usize>, usize);

impl Replay<'_> {
    /// Item `i` as of step `step`: its swapped products among those extended by then, and its
    /// home start.
    fn key(&self, i: usize, step: usize) -> ReplayKey {
        let (swapped, home) = &self.items[i];
        (swapped.iter().copied().filter(|p| self.products[..step.min(self.products.len())].contains(p)).collect(), *home)
    }

    /// `members` partitioned by their key at `step`, in order of first member.
    fn groups(&self, members: &[usize], step: usize) -> Vec<Vec<usize>> {
        let mut groups: Vec<(ReplayKey, Vec<usize>)> = Vec::new();
        for &i in members {
            let k = self.key(i, step);
            match groups.iter_mut().find(|g| g.0 == k) {
                Some(g) => g.1.push(i),
                None => groups.push((k, vec![i])),
            }
        }
        groups.into_iter().map(|g| g.1).collect()
    }

    /// The program of key `key` at `step`, lowered up to that step's next product: extending
    /// `start` where its prefix is compatible, else from the start.
    fn lower(&self, key: &ReplayKey, step: usize, start: Option<&Lowering>) -> Option<Lowering> {
        let next = self.products.get(step).copied();
        let swapped: BTreeSet<usize> = key.0.iter().copied().collect();
        let oriented = Arc::new(orient_until(self.graph, &swapped, next.unwrap_or(usize::MAX)).ok()?);
        let end = end_before(&oriented, next);
        let base = match start {
            Some((o, p)) if p.lowered_operations() <= end && prefix_compatible(o, &oriented, p.lowered_operations()) => p.clone(),
            _ => match key.1 {
                usize::MAX => Partial::new(false),
                0 => Partial::new(true),
                from => Partial::homing_from(from),
            },
        };
        let mut partial = extend(base, &oriented, self.target, &[], end).ok()?;
        // Its peak live bytes, as the beam scored it: the extensions of the resumed step then
        // update them (`Partial::peaks`) instead of each sweeping every buffer of the prefix.
        partial.peaks(self.target.chip.tiles);
        Some((oriented, partial))
    }

    /// The programs of `members` (the same key at `step`), from `start`: lowered once up to
    /// the last step they all agree on, then each group of them that agrees on the next step
    /// extended from there, in parallel.
    fn lower_group(&self, members: Vec<usize>, step: usize, start: Option<Lowering>) -> Vec<(usize, Option<Lowering>)> {
        let split = (step + 1..=self.last).find(|&s| self.groups(&members, s).len() > 1);
        let shared_step = split.map_or(self.last, |s| s - 1);
        let shared = self.lower(&self.key(members[0], shared_step), shared_step, start.as_ref());
        let Some(split) = split else {
            return members.into_iter().map(|i| (i, shared.clone())).collect();
        };
        let Some(shared) = shared else {
            return members.into_iter().map(|i| (i, None)).collect();
        };
        self.groups(&members, split).into_par_iter().map(|group| self.lower_group(group, split, Some(shared.clone()))).flatten().collect()
    }
}

/// The original operation from which the user's constraints keep products' weights on home
/// tiles (`weights = "home"`: the earliest such product), or None.
fn home_constraint(graph: &Graph) -> Option<usize> {
    constrained_operations(graph).filter(|(_, c)| c.weights.as_deref() == Some("home")).map(|(o, _)| o).min()
}

/// Each user plan constraint with the index of the operation it names.
fn constrained_operations(graph: &Graph) -> impl Iterator<Item = (usize, &crate::ir::PlanConstraint)> + '_ {
    graph.file.constraints.iter().filter_map(|c| match graph.value(graph.find(&c.operation)?).producer {
        crate::ir::Producer::Operation(o) => Some((o, c)),
        _ => None,
    })
}

/// The program the beam starts from: every weight replicated, or (the user's
/// `weights = "home"`) the products' weights from that operation on kept on home tiles, all
/// of them when no earlier product has a weight.
fn root_partial(graph: &Graph, products: &[usize]) -> Partial {
    let from = home_constraint(graph);
    if let Some(from) = from {
        debug!(home_from = from, "weights of the products from the constrained one on kept on home tiles");
    }
    match from {
        None => Partial::new(false),
        Some(from) if products.iter().any(|&p| p < from && graph.matrix_weight_of(p).is_some()) => Partial::homing_from(from),
        Some(_) => Partial::new(true),
    }
}

/// The user's orientation constraints: products that must, and that must not, be swapped.
pub(crate) fn orientation_constraints(graph: &Graph) -> (BTreeSet<usize>, BTreeSet<usize>) {
    let mut must: BTreeSet<usize> = BTreeSet::new();
    let mut must_not: BTreeSet<usize> = BTreeSet::new();
    for (index, c) in constrained_operations(graph) {
        match c.orientation.as_deref() {
            Some("swapped") => must.insert(index),
            Some("normal") => must_not.insert(index),
            _ => false,
        };
    }
    (must, must_not)
}

/// A partial program of the beam: the products swapped so far, the graph oriented so (later
/// products normal), and its lowered prefix.
#[derive(Clone)]
struct State {
    swapped: BTreeSet<usize>,
    oriented: Arc<Oriented>,
    partial: Partial,
    /// For a program with replicated weights, when the beam carries one: the same program
    /// lowered with home-tile weights over a prefix compatible with `oriented`, so that a
    /// switch to home-tile weights extends that prefix instead of lowering from the start
    /// (the same program either way: see `extended_prefixes_equal_whole_lowerings`).
    home: Option<Arc<HomePrefix>>,
    /// For a program whose weights are not all on home tiles: its replicated prefixes at the
    /// product boundaries passed (`Snapshot`), for a mixed program `lower_feasible` makes of it.
    history: Option<Arc<Snapshot>>,
}

/// The beam's states at each product step of a build (`TraceStep` by `TraceStep`), kept in a
/// process that builds again (`ipuq watch`) beside the trace it wrote: a resumed beam takes
/// the states of its last repeated step from here instead of lowering them again (`replay`).
/// They are the previous build's own: lowered over the previous graph, whose prefix up to that
/// step lowers identically over the edited one (what `identical_steps` checks); each is
/// oriented over the edited graph again. Steps taken over from an earlier build keep that
/// build's states (the same by the same argument, step by step).
pub struct KeptBeam {
    steps: Vec<Option<Arc<Vec<State>>>>,
    /// Per step, the extensions its jobs lowered through the step's product (`Through`), over
    /// that step's kept states: a build that resumes at the step from those states takes them
    /// where the graph lowers alike through the product, and lowers only what follows it (an
    /// edit between two products of a block).
    through: Vec<Option<Arc<Through>>>,
    /// The mixed programs' prefixes `lower_feasible` lowered (`MixedPrefixes`), for the next
    /// build's mixed lowerings to extend.
    mixed: Option<Arc<MixedPrefixes>>,
    /// The capped program's prefixes the build lowered beside its beam (`CappedAhead`), for
    /// the next build's capped lowering to extend.
    capped: Option<Arc<CappedPrefixes>>,
    /// Whether the build tried a capped program (`capped_program`, for a program of its beam
    /// whose replicated weights did not fit). A build that resumes this one's beam lowers the
    /// capped program beside its own only where this one tried it: the four-block MLP, whose
    /// finalist keeps every weight replicated and fits, lowered its last block's capped
    /// program beside each edit's resumed beam for nothing (about 0.2 s of a 1.1 s edit through
    /// a build server on two cores, session 63). A speed matter only: a build that tries it
    /// lowers it there all the same.
    capped_tried: bool,
}

/// A capped program's prefixes at its product boundaries, as `CappedAhead` lowered them (over
/// `oriented`, under `cap`): the next build's capped lowering under the same cap extends the
/// longest one that lowers alike over its graph (`prefix_identical_across_graphs`), which
/// gives the program lowered from the start, as the beam's resumed states do.
pub(crate) struct CappedPrefixes {
    oriented: Arc<Oriented>,
    cap: u32,
    prefixes: Vec<Partial>,
}

impl CappedPrefixes {
    /// The longest prefix that `oriented` extends alike.
    fn longest(&self, oriented: &Oriented, cap: u32) -> Option<&Partial> {
        if cap != self.cap {
            return None;
        }
        self.prefixes.iter().rev().find(|p| prefix_identical_across_graphs(&self.oriented, oriented, p.lowered_operations()))
    }
}

/// What a beam step's job extended its parent state to, through the step's product (the
/// operations up to and including it), by how the extension started (`ThroughKey`), with the
/// orientation it was lowered over: the same extension of the same parent over a graph whose
/// prefix through the product lowers alike (`prefix_identical_across_graphs`) is this prefix.
#[derive(Default)]
pub(crate) struct Through {
    entries: std::sync::Mutex<Vec<(ThroughKey, Arc<Oriented>, Partial)>>,
    /// How many extensions were taken from here (for tests).
    taken: AtomicUsize,
}

/// How a job's extension through its product started: from its parent's prefix (the parent's
/// index in the step's states, and the extension: replicated, the parent's prefix or a new
/// program; mixed, homing weights from an operation on), or the job's program lowered with
/// home-tile weights (the same from any compatible prefix, so by orientation alone).
#[derive(Clone, PartialEq, Eq)]
enum ThroughKey {
    Replicated { parent: usize, swapped: BTreeSet<usize>, from_parent: bool },
    Mixed { parent: usize, swapped: BTreeSet<usize>, from: usize },
    Home { swapped: BTreeSet<usize> },
}

impl Through {
    /// The prefix kept under `key` that `oriented` lowers alike through operation `end`.
    fn find(&self, key: &ThroughKey, oriented: &Oriented, end: usize) -> Option<Partial> {
        let entries = self.entries.lock().expect("through lock");
        let found = entries.iter().find(|(k, o, p)| k == key && p.lowered_operations() == end && prefix_identical_across_graphs(o, oriented, end)).map(|e| e.2.clone());
        if found.is_some() {
            self.taken.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    fn record(&self, key: ThroughKey, oriented: &Arc<Oriented>, partial: &Partial) {
        let mut entries = self.entries.lock().expect("through lock");
        if !entries.iter().any(|(k, _, _)| *k == key) {
            entries.push((key, oriented.clone(), partial.clone()));
        }
    }
}

/// Prefixes of mixed programs (`lower_feasible`'s first lowering of a mixed arrangement, no
/// reserves: a replicated prefix of the beam's lineage, then the weights of the products from
/// `home_from` on on home tiles) at the end of each product after the replicated prefix, with
/// the orientation they were lowered over and where the replicated prefix ended: a mixed
/// lowering of the same arrangement from the same point over a graph whose prefix lowers
/// alike (`prefix_identical_across_graphs`) extends the longest of them instead (the same
/// program: extensions compose).
#[derive(Default)]
pub(crate) struct MixedPrefixes {
    entries: std::sync::Mutex<Vec<MixedPrefix>>,
    /// How many lowerings extended one of these (for tests).
    taken: AtomicUsize,
}

#[derive(Clone)]
struct MixedPrefix {
    oriented: Arc<Oriented>,
    home_from: usize,
    start: usize,
    partial: Partial,
}

/// This build's mixed prefixes (kept for the next build) and the previous build's.
pub(crate) struct MixedMemo<'a> {
    now: &'a MixedPrefixes,
    before: Option<&'a MixedPrefixes>,
    /// Set where a capped program is tried (`KeptBeam::capped_tried`).
    capped_tried: &'a AtomicBool,
}

/// `snapshot`'s prefix with the weights of the products from `home_from` on on home tiles,
/// extended over `oriented` to its end: from the longest of the previous build's mixed prefixes
/// that lowers alike (`MixedPrefixes`), product end by product end, each kept for the next build.
fn extend_mixed(snapshot: &Snapshot, oriented: &Arc<Oriented>, target: &Target, home_from: usize, memo: Option<&MixedMemo>) -> Result<Partial, LowerError> {
    let operations = oriented.graph.operations.len();
    let Some(memo) = memo else {
        return extend(snapshot.partial.clone().home_later(home_from), oriented, target, &[], operations);
    };
    let start = snapshot.partial.lowered_operations();
    // The previous build's prefixes of this arrangement that lower alike here: carried into
    // this build's memo (a later build extends them too, though this one lowers none of them
    // again), the longest one extended.
    let found: Vec<MixedPrefix> = memo.before.map_or_else(Vec::new, |b| {
        let entries = b.entries.lock().expect("mixed prefixes lock");
        entries.iter().filter(|e| e.home_from == home_from && e.start == start && prefix_identical_across_graphs(&e.oriented, oriented, e.partial.lowered_operations())).cloned().collect()
    });
    let longest = found.iter().max_by_key(|e| e.partial.lowered_operations()).map(|e| e.partial.clone());
    if let (Some(_), Some(b)) = (&longest, memo.before) {
        b.taken.fetch_add(1, Ordering::Relaxed);
    }
    {
        let mut entries = memo.now.entries.lock().expect("mixed prefixes lock");
        for e in found {
            let n = e.partial.lowered_operations();
            if !entries.iter().any(|k| k.home_from == home_from && k.start == start && k.partial.lowered_operations() == n && prefix_identical_across_graphs(&k.oriented, &e.oriented, n)) {
                entries.push(e);
            }
        }
    }
    let mut partial = longest.unwrap_or_else(|| snapshot.partial.clone().home_later(home_from));
    let ends: Vec<usize> = (0..operations).filter(|&i| matches!(oriented.graph.operations[i].kind, crate::ir::OpKind::MatMul { .. })).map(|i| i + 1).collect();
    for end in ends {
        if end <= partial.lowered_operations() || end >= operations {
            continue;
        }
        partial = extend(partial, oriented, target, &[], end)?;
        let mut entries = memo.now.entries.lock().expect("mixed prefixes lock");
        if !entries.iter().any(|e| e.home_from == home_from && e.start == start && e.partial.lowered_operations() == end && Arc::ptr_eq(&e.oriented, oriented)) {
            entries.push(MixedPrefix { oriented: oriented.clone(), home_from, start, partial: partial.clone() });
        }
    }
    extend(partial, oriented, target, &[], operations)
}

impl KeptBeam {
    /// The states kept for trace step `step`, if they are the ones `records` lists.
    fn states(&self, step: usize, records: &[TracedState]) -> Option<&[State]> {
        let states = self.steps.get(step)?.as_deref()?;
        (states.len() == records.len() && states.iter().zip(records).all(|(s, r)| TracedState::of(s) == *r)).then_some(states.as_slice())
    }
}

/// The states `kept` holds for the last repeated trace step `last`, oriented over `graph` as
/// `replay` orients them (a state of that step swaps only products before it, and is lowered
/// up to that step's product): their prefixes, home-weights prefixes and replicated histories
/// are the previous build's. None when a state's orientation is rejected over `graph`, or its
/// prefix does not end where the orientation over `graph` puts that product.
fn reuse(kept: &[State], products: &[usize], last: usize, graph: &Graph) -> Option<Vec<State>> {
    let next = products.get(last).copied();
    kept.iter()
        .map(|s| {
            let oriented = Arc::new(orient_until(graph, &s.swapped, next.unwrap_or(usize::MAX)).ok()?);
            (s.partial.lowered_operations() == end_before(&oriented, next)).then(|| State { swapped: s.swapped.clone(), oriented, partial: s.partial.clone(), home: s.home.clone(), history: s.history.clone() })
        })
        .collect()
}

/// A prefix of a program of the beam, lowered with replicated weights up to a product (the
/// program before that product was extended), with the earlier ones of its lineage: a mixed
/// program (the weights of the products from some operation on on home tiles, the earlier
/// ones replicated) extends the longest one that ends before its start, instead of lowering
/// from the start (the same program: see `replayed_states_equal_the_beams`, which compares
/// such extensions with whole lowerings).
struct Snapshot {
    oriented: Arc<Oriented>,
    partial: Partial,
    earlier: Option<Arc<Snapshot>>,
}

impl Snapshot {
    /// The longest prefix of this lineage that `oriented` extends and that ends at or before
    /// oriented operation `end`.
    fn longest(&self, oriented: &Oriented, end: usize) -> Option<&Snapshot> {
        let mut at = Some(self);
        while let Some(s) = at {
            let n = s.partial.lowered_operations();
            if n <= end && prefix_compatible(&s.oriented, oriented, n) {
                return Some(s);
            }
            at = s.earlier.as_deref();
        }
        None
    }
}

/// A program's prefix lowered with home-tile weights, and the orientation it was lowered over.
struct HomePrefix {
    oriented: Arc<Oriented>,
    partial: Partial,
}

/// `base()` extended over `oriented` to operation `end` through `mid` (the end of the step's
/// product): with `memos` (this build's, the previous build's), the previous build's extension
/// of the same start (`key`) through `mid` where it lowers alike, else `base()` extended to
/// `mid`, kept in this build's memo either way, then extended to `end`. The same program as
/// `base()` extended to `end` at once (extensions compose: see
/// `extended_prefixes_equal_whole_lowerings`), which it is without memos or when nothing
/// follows the product.
fn extend_through(base: Box<dyn FnOnce() -> Result<Partial, LowerError> + '_>, oriented: &Arc<Oriented>, target: &Target, mid: usize, end: usize, key: ThroughKey, memos: Option<(&Through, Option<&Through>)>) -> Result<Partial, LowerError> {
    let Some((now, before)) = memos.filter(|_| mid < end) else {
        return extend(base()?, oriented, target, &[], end);
    };
    let prefix = match before.and_then(|b| b.find(&key, oriented, mid)) {
        Some(p) => p,
        None => {
            let start = base()?;
            if start.lowered_operations() >= mid {
                return extend(start, oriented, target, &[], end);
            }
            extend(start, oriented, target, &[], mid)?
        }
    };
    now.record(key, oriented, &prefix);
    extend(prefix, oriented, target, &[], end)
}

/// The program `oriented` lowered with home-tile weights up to operation `end`: extended from
/// `memo` when its prefix is compatible, else lowered from the start.
fn home_lowering(memo: Option<&HomePrefix>, oriented: &Oriented, target: &Target, end: usize) -> Result<Partial, LowerError> {
    let start = match memo {
        Some(m) if m.partial.lowered_operations() <= end && prefix_compatible(&m.oriented, oriented, m.partial.lowered_operations()) => m.partial.clone(),
        _ => Partial::new(true),
    };
    extend(start, oriented, target, &[], end)
}

/// The longest of `memos` (the first of equals) whose prefix `oriented` extends, up to `end`.
fn longest_compatible<'a>(memos: impl IntoIterator<Item = &'a Arc<HomePrefix>>, oriented: &Oriented, end: usize) -> Option<&'a Arc<HomePrefix>> {
    let mut best: Option<&Arc<HomePrefix>> = None;
    for m in memos {
        let n = m.partial.lowered_operations();
        if n <= end && best.is_none_or(|b| n > b.partial.lowered_operations()) && prefix_compatible(&m.oriented, oriented, n) {
            best = Some(m);
        }
    }
    best
}

/// What the beam compares partial programs by: estimated cycles, estimated exchange cycles,
/// and the peak standard, interleaved and total bytes on any tile (host-written buffers live
/// from the start, as in the finished program).
///
/// The peaks are those of `peaks` over every buffer, kept up to date from the prefix this one
/// extends (`Partial::peaks`, `peaks.rs`), so that scoring an extension sweeps only its recent
/// buffers.
fn score(partial: &mut Partial, tiles: u32) -> [u64; 5] {
    let cycles = partial.plans().map(|p| p.estimated_compute_cycles + p.estimated_exchange_cycles).sum();
    let exchange = partial.plans().map(|p| p.estimated_exchange_cycles).sum();
    let (standard, interleaved, total) = partial.peaks(tiles);
    [cycles, exchange, standard, interleaved, total]
}

/// Peak live bytes per tile over the steps, in standard and interleaved memory (buffers that
/// claim interleaved memory first: partials, and weights that prefer it) and in total.
#[cfg(test)]
fn peaks<'a>(buffers: impl Iterator<Item = &'a BufferDecl> + Clone, host: &[bool], tiles: u32) -> (u64, u64, u64) {
    let (mut ps, mut pi, mut pt) = (0u64, 0u64, 0u64);
    tile_peaks(buffers, host, tiles, |_, (s, i, t)| {
        ps = ps.max(s);
        pi = pi.max(i);
        pt = pt.max(t);
    });
    (ps, pi, pt)
}

/// [`peaks`] tile by tile: `each(tile, (standard, interleaved, total))` for every tile.
///
/// Each buffer is live from its first step to its last, inclusive (host-written ones from step
/// 0). Within a step the bytes ending there leave before those starting arrive, and each
/// region only shrinks, then only grows, so a tile's peaks are those of its live bytes at the
/// ends of steps: the buffers' starts and ends are bucketed by step (one counting pass, no
/// sort), then swept in step order over running per-tile sums.
fn tile_peaks<'a>(buffers: impl Iterator<Item = &'a BufferDecl> + Clone, host: &[bool], tiles: u32, mut each: impl FnMut(u32, (u64, u64, u64))) {
    // (first step, step after the last) of a buffer.
    let range = |i: usize, b: &BufferDecl| -> (usize, usize) {
        let (first, last) = peaks::range(b, host[i]);
        (first as usize, last as usize + 1)
    };
    let on_chip = || buffers.clone().enumerate().filter(|(_, b)| b.tile < tiles);
    // Events per step: counted, then placed step by step in one table (`starts[k + 1]` ends
    // step k's events once placed).
    let mut starts = peaks::event_offsets(on_chip().map(|(i, b)| range(i, b)));
    let steps = starts.len() - 1;
    let mut events = peaks::SPARE_EVENTS.with(Cell::take);
    events.clear();
    events.resize(starts[steps], (0, 0, 0));
    for (i, b) in on_chip() {
        let (first, end) = range(i, b);
        let (standard, interleaved) = peaks::bytes(b);
        events[starts[first]] = (b.tile, standard, interleaved);
        starts[first] += 1;
        events[starts[end]] = (b.tile, -standard, -interleaved);
        starts[end] += 1;
    }
    // Running (standard, interleaved) bytes and peaks (standard, interleaved, total) per tile.
    let mut live = vec![(0i64, 0i64); tiles as usize];
    let mut peak = vec![(0i64, 0i64, 0i64); tiles as usize];
    let mut from = 0;
    // `starts[k]` now ends step k's events.
    for &to in &starts[..steps] {
        let e = &events[from..to];
        from = to;
        peaks::apply(&mut live, e);
        for &(tile, _, _) in e {
            peaks::raise(&mut peak[tile as usize], live[tile as usize]);
        }
    }
    peaks::SPARE_EVENTS.with(|spare| spare.set(events));
    for (tile, &(ps, pi, pt)) in peak.iter().enumerate() {
        each(tile as u32, (ps as u64, pi as u64, pt as u64));
    }
}

/// Whether a partial program's peak bytes on a tile fit in tile memory beside the code
/// reserve (a screen: placement decides, in `lower_feasible`; buffers that prefer one region
/// may spill into the other, so only the total is screened).
fn within_memory(score: &[u64; 5], target: &Target) -> bool {
    score[4] <= tile_bytes(target)
}

/// The bytes a tile has for data beside the code reserve.
fn tile_bytes(target: &Target) -> u64 {
    let m = &target.memory;
    ((m.loader_limit - m.base) as u64).saturating_sub(CODE_RESERVE_BYTES)
}

/// A program of the beam whose peak live bytes on a tile exceed this many times the bytes a
/// tile has (`tile_bytes`) is far over tile memory: re-planning with the other operations'
/// resident bytes (`lower_feasible`) is for programs that nearly fit, so such a program is
/// made feasible only when none nearer fits (`feasible_finalists`). On the four-block MLP the
/// beam ends with three programs that keep every weight on home tiles at 1.2-2.5 MB per tile
/// against the 588,720 B a tile has; each failed every re-planning round in both home arrangements (about a
/// fifth of the build).
const FAR_OVER_MEMORY: u64 = 2;

/// Pareto retention, the extensions that fit in memory first: in each class, the extensions
/// no other one of the class dominates (no worse in every score, better in one), best estimate first (ties: fewer swapped products, then generation order), then
/// the dominated ones in the same order, up to `width`. Where none of those is `completable`
/// (`completable`, below) and a dropped one is, the first such one is kept too (`width` + 1):
/// a beam whose kept states all swap a product that a later reader rejects (a lone swapped Q
/// or K that the scores would read across its rows) would otherwise end with no program. A
/// three-layer encoder on small16 with a weights constraint (which plans Q, K and V one after
/// another) kept four such states at `l1.k` once the planner counted paired gathers.
fn retain(mut scored: Vec<(State, [u64; 5], bool)>, width: usize, completable: impl Fn(&State) -> bool) -> Vec<State> {
    let dominated: Vec<bool> = scored
        .iter()
        .map(|(_, a, fa)| scored.iter().any(|(_, b, fb)| fa == fb && b.iter().zip(a).all(|(x, y)| x <= y) && b.iter().zip(a).any(|(x, y)| x < y)))
        .collect();
    let mut order: Vec<usize> = (0..scored.len()).collect();
    order.sort_by_key(|&i| (!scored[i].2, dominated[i], scored[i].1[0], scored[i].0.swapped.len(), i));
    let rescue = (order.len() > width && !order[..width].iter().any(|&i| completable(&scored[i].0))).then(|| order[width..].iter().copied().find(|&i| completable(&scored[i].0))).flatten();
    order.truncate(width);
    order.extend(rescue);
    let mut taken: Vec<Option<State>> = scored.drain(..).map(|(s, _, _)| Some(s)).collect();
    order.into_iter().map(|i| taken[i].take().expect("each state taken once")).collect()
}

/// Whether some orientation that swaps the products in `swapped` is one the search accepts
/// (`beam_orient` over the whole graph): the other products as the user's constraints require
/// (`must`, `must_not`) and normal, or with one more of the products still to come (`later`)
/// swapped (a swapped chain ends at a later swapped product: the MLP's down product after its
/// up product). A state of the beam whose readers still to come reject it under both is not
/// completable (`retain`).
fn completable(graph: &Graph, later: &[usize], swapped: &BTreeSet<usize>, (must, must_not): (&BTreeSet<usize>, &BTreeSet<usize>), chains: bool) -> bool {
    let base: BTreeSet<usize> = swapped.union(must).copied().collect();
    let accepted = |s: &BTreeSet<usize>| beam_orient(graph, s, usize::MAX, chains).is_ok();
    accepted(&base)
        || later.iter().filter(|p| !base.contains(p) && !must_not.contains(p)).any(|&p| {
            let mut more = base.clone();
            more.insert(p);
            accepted(&more)
        })
}

/// The beam over program order (module docs): the lowered programs it ends with, as first
/// attempts of [`lower_feasible`] (each lowered with replicated weights, or, where replicated
/// weights outgrew tile memory or a replicated operation could not be planned at all, with the
/// weights of the products from the switch on, or of all, on home tiles: `Partial::home_from`,
/// handed on with the attempt), and the first error met.
///
/// `previous`: the trace of an earlier beam (on the graph given with it, over the same target
/// and width). The beam resumes from the last step of it that it would repeat exactly
/// (`identical_steps`): that step's states are lowered again (`replay`) and the beam goes on
/// from the next product, to the same programs as a beam from the start. The beam's own
/// trace comes back in [`Beam::steps`].
#[cfg(test)]
fn beam(graph: &Graph, target: &Target, width: usize, previous: Option<(&Graph, &BeamTrace)>) -> Beam {
    beam_keeping(graph, target, width, previous, None, false)
}

/// [`beam`], resuming from the states `kept_before` holds for the previous build's trace
/// (where they are that trace's) instead of lowering them again, and with `keep`, keeping
/// this beam's states per step (`Beam::kept`) for the next build in this process.
fn beam_keeping(graph: &Graph, target: &Target, width: usize, previous: Option<(&Graph, &BeamTrace)>, kept_before: Option<&KeptBeam>, keep: bool) -> Beam {
    let products = swappable(graph);
    let chains = chains_allowed(graph, target);
    let (must, must_not) = orientation_constraints(graph);
    // Products the user wants swapped that the search never swaps (not rank 2, or feeding a
    // bias add): that one orientation is the only program, and it is lowered as it is.
    if !must.iter().all(|m| products.contains(m)) {
        let (programs, first_error) = match orient(graph, &must) {
            Ok(o) => (vec![(Arc::new(o), None, None)], None),
            Err(message) => (Vec::new(), Some(LowerError::Unsupported { operation: graph.name.clone(), message })),
        };
        let far = vec![false; programs.len()];
        return Beam { programs, far, histories: Vec::new(), first_error, steps: Vec::new(), resumed: 0, searched: 0, capped_ahead: None, kept: None, reused: false };
    }
    let mut first_error: Option<LowerError> = None;
    let note = |e: LowerError, first_error: &mut Option<LowerError>| {
        debug!(error = %e, "partial program does not lower");
        // Report a constraint's reason first, else the first error met.
        let constraint = matches!(e, LowerError::Constraint { .. });
        if first_error.is_none() || (constraint && !matches!(first_error, Some(LowerError::Constraint { .. }))) {
            *first_error = Some(e);
        }
    };
    // Extend a state to the swapped set `swapped`, lowering up to original operation `next`.
    // Ok(None): the orientation itself is rejected (a consumer would read a swapped value
    // across its rows).
    // `carry`: a child that keeps replicated weights carries its home-weights prefix (else its
    // parent's, unextended). `pool`: the home-weights prefixes a home lowering may extend (see
    // the loop); with the grown state, the prefixes it keeps in the pool: the one its home
    // lowering extended, and where that passes this product's start, the prefix up to it,
    // which the other orientations of this product share.
    #[allow(clippy::type_complexity)]
    // `through`: this job's place in the step (its product and its parent's index) and the
    // step's `Through` memos (this build's, and the previous build's over the same states): the
    // extensions through the product are kept, and taken from the previous build where they
    // lower alike (see `extend_through`).
    let grow = |state: &State, swapped: BTreeSet<usize>, next: Option<usize>, carry: bool, pool: &[Arc<HomePrefix>], through: Option<(usize, usize, &Through, Option<&Through>)>| -> Result<(Option<(State, [u64; 5], bool)>, Vec<Arc<HomePrefix>>), LowerError> {
        // Oriented afresh (cheap beside lowering) so that the readers up to `next` are checked.
        let oriented = match beam_orient(graph, &swapped, next.unwrap_or(usize::MAX), chains) {
            Ok(o) => Arc::new(o),
            Err(message) => {
                debug!(%message, "orientation rejected");
                return Ok((None, Vec::new()));
            }
        };
        let end = end_before(&oriented, next);
        let lowered = state.partial.lowered_operations();
        let reuse = prefix_compatible(&state.oriented, &oriented, lowered);
        let mut kept: Vec<Arc<HomePrefix>> = Vec::new();
        // The end of the product's operations, and the memos of extensions through it.
        let (mid, parent, memos) = match through {
            Some((product, parent, now, before)) => (end_before(&oriented, Some(product + 1)).min(end), parent, Some((now, before))),
            None => (end, 0, None),
        };
        let this: &Arc<Oriented> = &oriented;
        let via = |key: ThroughKey, base: Box<dyn FnOnce() -> Result<Partial, LowerError> + '_>| extend_through(base, this, target, mid, end, key, memos);
        // This program lowered with home-tile weights up to `end`, from the longest compatible
        // prefix of the pool (the same program from any: `extended_prefixes_equal_whole_lowerings`),
        // with the prefixes it keeps in the pool.
        let lower_home = || -> (Result<Partial, LowerError>, Vec<Arc<HomePrefix>>) {
            let memo = longest_compatible(state.home.iter().chain(pool), &oriented, end);
            let from = memo.map_or(0, |m| m.partial.lowered_operations());
            let mut kept: Vec<Arc<HomePrefix>> = memo.cloned().into_iter().collect();
            debug!(from, end, "lowering with home-tile weights");
            let key = ThroughKey::Home { swapped: swapped.clone() };
            // The previous build's home-tile program through the product (the same from any
            // compatible prefix), kept in the pool too.
            if let Some((now, Some(before))) = memos.filter(|_| mid < end) {
                if let Some(prefix) = before.find(&key, &oriented, mid) {
                    kept.push(Arc::new(HomePrefix { oriented: oriented.clone(), partial: prefix.clone() }));
                    now.record(key, this, &prefix);
                    return (extend(prefix, this, target, &[], end), kept);
                }
            }
            if !reuse || from >= lowered || lowered >= end {
                if memos.is_none() || from >= mid {
                    return (home_lowering(memo.map(|m| &**m), &oriented, target, end), kept);
                }
                return (via(key, Box::new(move || home_lowering(memo.map(|m| &**m), this, target, from))), kept);
            }
            let prefix = match home_lowering(memo.map(|m| &**m), &oriented, target, lowered) {
                Ok(p) => p,
                Err(e) => return (Err(e), kept),
            };
            kept.push(Arc::new(HomePrefix { oriented: oriented.clone(), partial: prefix.clone() }));
            (via(key, Box::new(move || Ok(prefix))), kept)
        };
        let home = reuse && state.partial.home_weights();
        let start = if reuse { state.partial.clone() } else { Partial::new(false) };
        let replicated = || match via(ThroughKey::Replicated { parent, swapped: swapped.clone(), from_parent: reuse }, Box::new(move || Ok(start))) {
            Ok(p) => Ok(Some(p)),
            // A replicated weight that no plan fits: this program keeps (some) weights on
            // home tiles.
            Err(LowerError::NoPlan { .. }) if !home => Ok(None),
            Err(e) => Err(e),
        };
        // While the beam carries home-weights prefixes, a program with replicated weights
        // lowers its home-weights one too (carried, or switched to where the replicated
        // weights do not fit), unless a mixed program fits: both are lowered side by side.
        let (partial, mut ahead) = if carry && !home {
            let (partial, ahead) = rayon::join(replicated, lower_home);
            (partial, Some(ahead))
        } else {
            (replicated(), None)
        };
        let mut partial = partial?;
        let mut lower_home = |kept: &mut Vec<Arc<HomePrefix>>| -> Result<Partial, LowerError> {
            let (result, memos) = ahead.take().unwrap_or_else(lower_home);
            kept.extend(memos);
            result
        };
        let mut scored = partial.as_mut().map_or([0; 5], |p| score(p, target.chip.tiles));
        let mut fits = partial.is_some() && within_memory(&scored, target);
        let mut tried_home = false;
        if !fits && !partial.as_ref().is_some_and(|p| p.home_weights()) {
            // Replicated weights outgrow tile memory. First a mixed program: the prefix keeps
            // its weights replicated, this product and the later ones keep theirs on home
            // tiles (one more extension of the prefix); when that does not fit either, from
            // here on the program keeps each weight block once on a home tile (as
            // `lower_feasible` falls back to).
            tried_home = true;
            let from = oriented.origin.get(lowered).map_or(usize::MAX, |&o| o as usize);
            let mixed = (reuse && lowered > 0 && from < state.partial.home_from())
                .then(|| via(ThroughKey::Mixed { parent, swapped: swapped.clone(), from }, Box::new(|| Ok(state.partial.clone().home_later(from)))).ok())
                .flatten()
                .map(|mut p| {
                    let s = score(&mut p, target.chip.tiles);
                    (p, s)
                })
                .filter(|(_, s)| within_memory(s, target));
            if let Some((p, s)) = mixed {
                partial = Some(p);
                scored = s;
                fits = true;
            } else {
                match lower_home(&mut kept) {
                    Ok(mut p) => {
                        scored = score(&mut p, target.chip.tiles);
                        fits = within_memory(&scored, target);
                        partial = Some(p);
                    }
                    Err(e) if partial.is_none() => return Err(e),
                    Err(_) => {}
                }
            }
        }
        let partial = partial.expect("a lowered extension, or the error returned");
        debug!(swapped = ?swapped, home_weights = partial.home_weights(), home_from = partial.home_from(), ?scored, fits, "scored partial program");
        let home = match (partial.home_weights(), carry, tried_home) {
            (true, ..) => None,
            // Home-tile weights were tried and did not lower: none to carry.
            (false, _, true) => None,
            (false, true, false) => lower_home(&mut kept).ok().map(|partial| Arc::new(HomePrefix { oriented: oriented.clone(), partial })),
            (false, false, false) => state.home.clone(),
        };
        Ok((Some((State { swapped, oriented, partial, home, history: None }, scored, fits)), kept))
    };
    // Resuming: the steps of the previous beam this one repeats, and the last one's states.
    let mut reused = false;
    let resumed: Option<(usize, Vec<State>, bool)> = previous.and_then(|(old, trace)| {
        let done = identical_steps(old, trace, graph, width, &products, &must, &must_not, (chains_allowed(old, target), chains));
        let last = done.checked_sub(1)?;
        // Once a program kept weights on home tiles, the replicated ones carry home-weights
        // prefixes (as the loop below starts its carry).
        let carry = trace.steps[..done].iter().any(|s| s.states.iter().any(|r| r.home_from == 0));
        let next = products.get(last).copied();
        let records = &trace.steps[last].states;
        let taken = kept_before.and_then(|k| k.states(last, records)).and_then(|states| reuse(states, &products, last, graph));
        reused = taken.is_some();
        if let Some(states) = taken {
            debug!(step = last, states = records.len(), "took the resumed step's states from the previous build in this process");
            return Some((done, states, carry));
        }
        match replay(records, &products, last, graph, target, carry && next.is_some()) {
            Some(states) => Some((done, states, carry)),
            None => {
                debug!(steps = done, "a traced state does not lower again; searching the plan beam from the start");
                None
            }
        }
    });
    let mut steps: Vec<TraceStep> = Vec::new();
    // The states of each trace step, when kept (`KeptBeam`).
    let mut kept: Vec<Option<Arc<Vec<State>>>> = Vec::new();
    // The extensions each step's jobs lowered through its product, when kept (`Through`).
    let mut throughs: Vec<Option<Arc<Through>>> = Vec::new();
    let (mut states, mut carry, first_product) = match resumed {
        Some((done, states, carry)) => {
            steps.extend_from_slice(&previous.expect("resumed from a trace").1.steps[..done]);
            if keep {
                kept = (0..done - 1).map(|s| kept_before.and_then(|k| k.steps.get(s).cloned().flatten())).collect();
                throughs = (0..done - 1).map(|s| kept_before.and_then(|k| k.through.get(s).cloned().flatten())).collect();
                kept.push((done - 1 < products.len()).then(|| Arc::new(states.clone())));
            }
            (states, carry, done - 1)
        }
        None => {
            let root = match orient_until(graph, &BTreeSet::new(), products.first().copied().unwrap_or(usize::MAX)) {
                Ok(o) => State { swapped: BTreeSet::new(), oriented: Arc::new(o), partial: root_partial(graph, &products), home: None, history: None },
                Err(message) => {
                    let first_error = Some(LowerError::Unsupported { operation: graph.name.clone(), message });
                    return Beam { programs: Vec::new(), far: Vec::new(), histories: Vec::new(), first_error, steps, resumed: 0, searched: products.len(), capped_ahead: None, kept: None, reused: false };
                }
            };
            let states: Vec<State> = match grow(&root, BTreeSet::new(), products.first().copied(), false, &[], None) {
                Ok((s, _)) => s.into_iter().map(|s| s.0).collect(),
                Err(e) => {
                    note(e, &mut first_error);
                    Vec::new()
                }
            };
            steps.push(TraceStep { states: states.iter().map(TracedState::of).collect(), noted: first_error.is_some() });
            if keep {
                kept.push(Some(Arc::new(states.clone())));
            }
            (states, false, 0)
        }
    };
    let (resumed, searched) = (first_product, products.len() - first_product);
    let mut pool: Vec<Arc<HomePrefix>> = Vec::new();
    // The capped try (`lower_feasible`) is made only without a home-weights constraint; it is
    // lowered beside the beam only where the thread pool has a second thread (an idle core).
    // Where this beam resumes the kept beam of a build that tried no capped program, none is
    // lowered beside it (`KeptBeam::capped_tried`).
    let ahead_capped = home_constraint(graph).is_none() && rayon::current_num_threads() > 1 && !(first_product > 0 && kept_before.is_some_and(|k| !k.capped_tried));
    let mut capped_ahead: Option<CappedAhead> = None;
    // A home-weights prefix lowered ahead, beside steps that leave a core idle (see below).
    let mut shadow: Option<Arc<HomePrefix>> = None;
    for (j, &product) in products.iter().enumerate().skip(first_product) {
        let next = products.get(j + 1).copied();
        let options = options_for(product, &must, &must_not);
        let jobs: Vec<(usize, bool)> = (0..states.len()).flat_map(|i| options.iter().map(move |&o| (i, o))).collect();
        // Once a program of the beam keeps weights on home tiles, the replicated ones carry
        // their home-weights prefix along while products remain (a switch then extends it).
        carry |= states.iter().any(|s| s.partial.home_weights());
        let carry_now = carry && next.is_some();
        // The pool of home-weights prefixes a switch to home-tile weights (or the start of
        // carrying) extends rather than lowering from the start: the states' own, and those
        // the last step's home lowerings extended or passed (a prefix unused for a step is
        // dropped: a speed matter only). Read only during the step (no job's choice depends on
        // another's), renewed in job order after it.
        for h in states.iter().filter_map(|s| s.home.as_ref()).chain(&shadow) {
            if !pool.iter().any(|p| Arc::ptr_eq(p, h)) {
                pool.push(h.clone());
            }
        }
        let swapped_of = |&(i, swap): &(usize, bool)| {
            let mut swapped = states[i].swapped.clone();
            if swap {
                swapped.insert(product);
            }
            swapped
        };
        // Before the beam carries home-weights prefixes, a step whose orientations leave fewer
        // programs to extend than there are threads lowers, beside them and until they are
        // done, the one extended program's parent with home-tile weights towards where it was
        // lowered, product by product (extending the longest prefix of the pool, which holds
        // the last such one): a later switch to home-tile weights (or the start of carrying)
        // extends it instead of lowering from the start. Speed only: any compatible prefix
        // extends to the same program, and no choice of the beam reads the pool.
        let ahead_of = if carry || next.is_none() {
            None
        } else {
            let live: Vec<usize> = jobs.iter().filter(|job| beam_orient(graph, &swapped_of(job), next.unwrap_or(usize::MAX), chains).is_ok()).map(|&(i, _)| i).collect();
            live.first().copied().filter(|&i| live.len() < rayon::current_num_threads() && live.iter().all(|&l| l == i) && states[i].partial.home_from() == usize::MAX)
        };
        // This step's extensions through its product, kept for the next build; the previous
        // build's, where this step extends that build's kept states (the first step searched).
        let through_now = keep.then(|| Arc::new(Through::default()));
        let through_before = kept_before.filter(|_| reused && j == first_product).and_then(|k| k.through.get(j).cloned().flatten());
        let jobs_done = AtomicBool::new(false);
        let lower_ahead = |i: usize| -> Option<Arc<HomePrefix>> {
            let s = &states[i];
            let end = s.partial.lowered_operations();
            let memo = longest_compatible(&pool, &s.oriented, end);
            let mut partial = memo.map_or_else(|| Partial::new(true), |m| m.partial.clone());
            let start = partial.lowered_operations();
            for &p in &products {
                let to = end_before(&s.oriented, Some(p));
                if to <= partial.lowered_operations() {
                    continue;
                }
                if to > end || jobs_done.load(Ordering::Relaxed) {
                    break;
                }
                partial = extend(partial, &s.oriented, target, &[], to).ok()?;
            }
            (partial.lowered_operations() > start).then(|| Arc::new(HomePrefix { oriented: s.oriented.clone(), partial }))
        };
        #[allow(clippy::type_complexity)]
        let (grown, ahead): (Vec<Result<(Option<(State, [u64; 5], bool)>, Vec<Arc<HomePrefix>>), LowerError>>, Option<Arc<HomePrefix>>) = rayon::join(
            || {
                let grown = jobs.par_iter().map(|job| grow(&states[job.0], swapped_of(job), next, carry_now, &pool, through_now.as_deref().map(|now| (product, job.0, now, through_before.as_deref())))).collect();
                jobs_done.store(true, Ordering::Relaxed);
                grown
            },
            || ahead_of.and_then(lower_ahead),
        );
        if ahead.is_some() {
            shadow = ahead;
        }
        // The states' replicated prefixes (their programs before this product), which the
        // children that keep some weights replicated hold as their history.
        let snapshots: Vec<Option<Arc<Snapshot>>> = std::mem::take(&mut states)
            .into_iter()
            .map(|s| (s.partial.home_from() == usize::MAX).then(|| Arc::new(Snapshot { oriented: s.oriented, partial: s.partial, earlier: s.history })))
            .collect();
        let mut scored = Vec::new();
        pool.clear();
        for (g, &(parent, _)) in grown.into_iter().zip(&jobs) {
            match g {
                Ok((s, kept)) => {
                    scored.extend(s.map(|(mut child, score, fits)| {
                        if !child.partial.home_weights() {
                            child.history = snapshots[parent].clone();
                        }
                        (child, score, fits)
                    }));
                    for h in kept {
                        if !pool.iter().any(|p| Arc::ptr_eq(p, &h)) {
                            pool.push(h);
                        }
                    }
                }
                Err(e) => note(e, &mut first_error),
            }
        }
        states = retain(scored, width, |s| completable(graph, &products[j + 1..], &s.swapped, (&must, &must_not), chains));
        // The first step where any program of the beam keeps weights on home tiles: start the
        // capped program's lowering beside the beam (`CappedAhead`), over the best one's
        // orientation.
        if ahead_capped && capped_ahead.is_none() && next.is_some() {
            let homing = |s: &State| s.partial.home_from() < usize::MAX;
            if let Some(best) = states.first().filter(|_| states.iter().any(homing)) {
                let partials: Vec<&Partial> = states.iter().map(|s| &s.partial).collect();
                capped_ahead = CappedAhead::start(graph, target, &best.swapped, &partials, &products, kept_before.and_then(|k| k.capped.clone()), keep);
            }
        }
        steps.push(TraceStep { states: states.iter().map(TracedState::of).collect(), noted: first_error.is_some() });
        if keep {
            // Not the last step's: completing its programs would then copy what they share
            // with the kept ones (an edit after the last product lowers them again).
            kept.push(next.is_some().then(|| Arc::new(states.clone())));
            throughs.push(through_now);
        }
        debug!(product, states = states.len(), "extended the plan beam");
    }
    // The programs are completed in parallel; results (and errors) are taken in beam order.
    // A program that carries no home-weights prefix gets the pool's longest compatible one.
    let far_limit = tile_bytes(target).saturating_mul(FAR_OVER_MEMORY);
    #[allow(clippy::type_complexity)]
    let completed: Vec<(Arc<Oriented>, Option<Arc<HomePrefix>>, Result<(Attempt, usize), LowerError>, bool, Option<Arc<Snapshot>>)> = states
        .into_par_iter()
        .map(|mut s| {
            let home = s.partial.home_from();
            let far = score(&mut s.partial, target.chip.tiles)[4] > far_limit;
            let memo = s.home.or_else(|| longest_compatible(&pool, &s.oriented, s.oriented.graph.operations.len()).cloned());
            let attempt = complete(s.partial, &s.oriented, target, &[]).map(|a| (a, home));
            (s.oriented, memo, attempt, far, s.history)
        })
        .collect();
    let (mut programs, mut far_over, mut histories) = (Vec::new(), Vec::new(), Vec::new());
    for (oriented, memo, attempt, far, history) in completed {
        match attempt {
            Ok(a) => {
                programs.push((oriented, Some(a), memo));
                far_over.push(far);
                histories.push(history);
            }
            Err(e) => note(e, &mut first_error),
        }
    }
    Beam { programs, far: far_over, histories, first_error, steps, resumed, searched, capped_ahead, kept: keep.then_some(KeptBeam { steps: kept, through: throughs, mixed: None, capped: None, capped_tried: false }), reused }
}

/// What [`beam`] ends with.
struct Beam {
    /// The lowered programs, as first attempts of [`lower_feasible`] (with the home-weights
    /// prefix each may extend).
    #[allow(clippy::type_complexity)]
    programs: Vec<(Arc<Oriented>, Option<(Attempt, usize)>, Option<Arc<HomePrefix>>)>,
    /// Per program: whether its peak bytes on a tile, as the beam scored it, are far over tile
    /// memory (`FAR_OVER_MEMORY`).
    far: Vec<bool>,
    /// Per program: its replicated prefixes (`State::history`).
    histories: Vec<Option<Arc<Snapshot>>>,
    /// The first error met.
    first_error: Option<LowerError>,
    /// The beam's trace (`BeamTrace::steps`).
    steps: Vec<TraceStep>,
    /// Product steps taken from the previous beam's trace, and product steps searched.
    resumed: usize,
    searched: usize,
    /// The capped program lowered beside the beam, if one was started (`CappedAhead`).
    capped_ahead: Option<CappedAhead>,
    /// The states of each step, when asked to keep them (`beam_keeping`).
    kept: Option<KeptBeam>,
    /// Whether the resumed step's states were the kept ones (not lowered again).
    reused: bool,
}

/// The estimate the search ranks programs by: the sum of every operation's estimate.
pub fn estimated_cycles(lowered: &Lowered) -> u64 {
    lowered.plans.iter().map(|p| p.estimated_compute_cycles + p.estimated_exchange_cycles).sum()
}

/// Up to `keep` feasible programs, best estimate first (ties: fewer swapped products, then
/// candidate order). Fails with the first candidate's error when none lowers.
pub fn finalists(graph: &Graph, target: &Target, keep: usize) -> Result<Vec<Lowered>, LowerError> {
    finalists_resuming(graph, target, keep, None).0
}

/// [`finalists`], the plan beam resuming from `previous`, the trace of an earlier build's beam
/// over the same target and `keep` (the same finalists as without it: see `beam`), and this
/// build's trace, for the next build. A trace whose workload does not parse is ignored.
pub fn finalists_resuming(graph: &Graph, target: &Target, keep: usize, previous: Option<&BeamTrace>) -> (Result<Vec<Lowered>, LowerError>, BeamTrace) {
    finalists_warming(graph, target, keep, previous, None)
}

/// [`finalists_resuming`], handing `warm` the exchange phases of a program lowered beside the
/// beam while the search waits for it (`CappedAhead`): the same finalists and trace.
pub fn finalists_warming(graph: &Graph, target: &Target, keep: usize, previous: Option<&BeamTrace>, warm: Option<Arc<Warm>>) -> (Result<Vec<Lowered>, LowerError>, BeamTrace) {
    let (found, trace, _) = finalists_keeping(graph, target, keep, previous, None, warm, false);
    (found, trace)
}

/// [`finalists_warming`], the resumed step's states taken from `kept_before` (the states the
/// build that wrote `previous` kept, `KeptBeam`) where it holds them, and with `keep_states`
/// this beam's states kept for the next build in this process: the same finalists and trace.
pub fn finalists_keeping(graph: &Graph, target: &Target, keep: usize, previous: Option<&BeamTrace>, kept_before: Option<&KeptBeam>, warm: Option<Arc<Warm>>, keep_states: bool) -> (Result<Vec<Lowered>, LowerError>, BeamTrace, Option<KeptBeam>) {
    let width = keep.max(DEFAULT_FINALISTS);
    if let Some(e) = host_bytes_beyond_tiles(graph, target) {
        // Nothing was searched: the previous build's trace stays for the next build to resume
        // from (an edit that outgrew the chip and is taken back loses nothing).
        let trace = previous.cloned().unwrap_or_else(|| BeamTrace { workload: workload_structure(graph), width: width as u64, steps: Vec::new() });
        return (Err(e), trace, None);
    }
    let old = previous.and_then(|t| match Graph::parse(&t.workload, "the previous build's plan beam") {
        Ok(g) => Some((g, t)),
        Err(e) => {
            warn!(error = %e, "the previous plan beam's workload does not parse; searching from the start");
            None
        }
    });
    let mut run = beam_keeping(graph, target, width, old.as_ref().map(|(g, t)| (g, *t)), kept_before, keep_states);
    if let Some(ahead) = run.capped_ahead.as_mut() {
        ahead.warm = warm;
    }
    if previous.is_some() {
        info!(resumed_steps = run.resumed, searched_steps = run.searched, kept_states = run.reused, "resumed the plan beam from a previous build");
    } else {
        debug!(searched_steps = run.searched, "searched the plan beam from the start");
    }
    let trace = BeamTrace { workload: workload_structure(graph), width: width as u64, steps: run.steps };
    // The mixed programs' prefixes, kept for the next build in this process.
    let mixed_now = keep_states.then(|| Arc::new(MixedPrefixes::default()));
    let capped_tried = AtomicBool::new(false);
    let memo = mixed_now.as_deref().map(|now| MixedMemo { now, before: kept_before.and_then(|k| k.mixed.as_deref()), capped_tried: &capped_tried });
    let found = feasible_finalists(graph, target, keep, run.programs, &run.far, true, &run.histories, run.first_error, run.capped_ahead.as_ref(), memo.as_ref(), true).0;
    // The capped program's prefixes, for the next build in this process.
    let mut kept = run.kept;
    if let Some(k) = kept.as_mut() {
        // A build that lowered none keeps the previous build's (each is checked against the
        // graph it is extended over).
        k.capped = run.capped_ahead.as_ref().and_then(|a| a.prefixes.lock().ok().and_then(|mut p| p.take())).or_else(|| kept_before.and_then(|b| b.capped.clone()));
        k.mixed = mixed_now;
        k.capped_tried = capped_tried.into_inner();
    }
    (found, trace, kept)
}

/// The error for a workload whose tensors the host writes before the run (those some operation
/// reads), one copy of each, exceed every tile's memory beside the runtime header: no program
/// can hold them (ipuq streams no weights during a run), so the search is not run (forty
/// full-size encoder layers, 1.22 GB of weights against 939 MB, searched for more than six
/// minutes). None when they do not.
fn host_bytes_beyond_tiles(graph: &Graph, target: &Target) -> Option<LowerError> {
    let read: BTreeSet<usize> = graph.operations.iter().flat_map(|o| o.inputs.iter().map(|v| v.0 as usize)).collect();
    let tensors: Vec<(&str, u64)> = graph
        .values
        .iter()
        .enumerate()
        .filter(|(i, v)| matches!(v.producer, crate::ir::Producer::Tensor { .. }) && read.contains(i))
        .map(|(_, v)| (v.name.as_str(), v.elements() * v.dtype.bytes() as u64))
        .collect();
    let host: u64 = tensors.iter().map(|t| t.1).sum();
    let m = &target.memory;
    let tiles = target.chip.tiles;
    let header = crate::emit::RUNTIME_HEADER_BYTES;
    let per_tile = m.loader_limit.saturating_sub(m.base).saturating_sub(header);
    let room = per_tile as u64 * tiles as u64;
    if host <= room {
        return None;
    }
    let (largest, largest_bytes) = tensors.iter().max_by_key(|t| (t.1, std::cmp::Reverse(t.0))).map(|t| (t.0.to_string(), t.1)).unwrap_or_default();
    Some(LowerError::HostBytes { host, largest, largest_bytes, tiles, per_tile, base: m.base, limit: m.loader_limit, header, room, short: host - room })
}

/// [`finalists`] for a re-plan worth making only if it finds a program that fits as planned
/// (`select_finalist` steering a plan to beat a program it already holds that places and
/// runs): without the last resort of smaller operand blocks (`fit_block_capped`, which makes
/// some program fit where none does), and None when no finalist fits tile memory.
pub fn finalists_that_fit(graph: &Graph, target: &Target, keep: usize) -> Result<Option<Vec<Lowered>>, LowerError> {
    let run = beam_keeping(graph, target, keep.max(DEFAULT_FINALISTS), None, None, false);
    let (found, _, fits) = feasible_finalists(graph, target, keep, run.programs, &run.far, true, &run.histories, run.first_error, run.capped_ahead.as_ref(), None, false);
    found.map(|f| fits.then_some(f))
}

/// The beam's programs made feasible, the best `keep` of them (`finalists`). Programs far over
/// tile memory (`far`, `FAR_OVER_MEMORY`) are made feasible only when none of the others fits
/// (or, `skip_far` false, always, for tests), and only then with the try of replicated weights
/// on fewer tiles (`capped_program`); where none fits, with `last_resort` each is planned with
/// smaller operand blocks (`fit_block_capped`). With the finalists, how many were not made
/// feasible, and whether the first finalist fits tile memory.
#[allow(clippy::type_complexity)]
#[allow(clippy::too_many_arguments)]
fn feasible_finalists(graph: &Graph, target: &Target, keep: usize, programs: Vec<(Arc<Oriented>, Option<(Attempt, usize)>, Option<Arc<HomePrefix>>)>, far: &[bool], skip_far: bool, histories: &[Option<Arc<Snapshot>>], mut first_error: Option<LowerError>, ahead: Option<&CappedAhead>, mixed: Option<&MixedMemo>, last_resort: bool) -> (Result<Vec<Lowered>, LowerError>, usize, bool) {
    let mut found: Vec<(bool, u64, usize, usize, Feasible)> = Vec::new();
    let orientations: Vec<Arc<Oriented>> = programs.iter().map(|p| p.0.clone()).collect();
    // The beam's programs are made feasible in parallel, the far ones after the others and only
    // when none of those fits; results are taken in beam order.
    #[allow(clippy::type_complexity)]
    let (far_ones, near): (Vec<_>, Vec<_>) = programs.into_iter().enumerate().partition(|(i, _)| far.get(*i).copied().unwrap_or(false));
    #[allow(clippy::type_complexity)]
    let make_feasible = |items: Vec<(usize, (Arc<Oriented>, Option<(Attempt, usize)>, Option<Arc<HomePrefix>>))>, capped: bool| -> Vec<(usize, Result<Feasible, LowerError>)> {
        items.into_par_iter().map(|(i, (oriented, first, memo))| (i, lower_feasible(&oriented, target, first, memo.as_deref(), histories.get(i).and_then(|h| h.as_deref()), capped, ahead, mixed.map(|m| (m, &oriented))))).collect()
    };
    let mut feasible = make_feasible(near, true);
    let mut skipped = 0;
    if !far_ones.is_empty() {
        let near_fits = feasible.iter().any(|(_, r)| matches!(r, Ok((_, Some(_), _))));
        if near_fits && skip_far {
            skipped = far_ones.len();
            debug!(skipped, "programs far over tile memory are not planned again: a nearer one fits");
        } else {
            feasible.extend(make_feasible(far_ones, !near_fits));
        }
    }
    feasible.sort_by_key(|(i, _)| *i);
    for (index, result) in feasible {
        match result {
            Ok((l, peaks, from)) => {
                let swapped = l.plans.iter().filter(|p| p.orientation == "swapped").count();
                found.push((peaks.is_none(), estimated_cycles(&l), swapped, index, (l, peaks, from)))
            }
            Err(e) => {
                debug!(error = %e, "program does not lower");
                let constraint = matches!(e, LowerError::Constraint { .. });
                if first_error.is_none() || (constraint && !matches!(first_error, Some(LowerError::Constraint { .. }))) {
                    first_error = Some(e);
                }
            }
        }
    }
    if found.is_empty() {
        return (Err(first_error.unwrap_or_else(|| LowerError::Unsupported { operation: graph.name.clone(), message: "no orientation of the matrix products lowers".into() })), skipped, false);
    }
    // Programs that fit first; one that does not is kept only when none fits.
    found.sort_by_key(|f| (f.0, f.1, f.2, f.3));
    if found[0].0 && last_resort {
        // None fits: the last resort, each program's orientation planned with smaller
        // operand blocks (`fit_block_capped`); a build with a program that fits never gets here.
        let rescued: Vec<Option<(Lowered, (u64, u64), usize)>> = found.par_iter().map(|f| orientations.get(f.3).and_then(|o| fit_block_capped(o, target))).collect();
        for (f, r) in found.iter_mut().zip(rescued) {
            if let Some((l, peaks, from)) = r {
                let swapped = l.plans.iter().filter(|p| p.orientation == "swapped").count();
                *f = (false, estimated_cycles(&l), swapped, f.3, (l, Some(peaks), from));
            }
        }
        found.sort_by_key(|f| (f.0, f.1, f.2, f.3));
    }
    let fits = !found[0].0;
    if fits {
        found.retain(|f| !f.0);
    }
    found.truncate(keep.max(1));
    warn_given_up_home_constraint(graph, found[0].4 .2);
    #[allow(clippy::type_complexity)]
    let (finalists, peaks): (Vec<Lowered>, Vec<(Option<(u64, u64)>, usize)>) = found.into_iter().map(|f| (f.4 .0, (f.4 .1, f.4 .2))).unzip();
    for (i, (l, (peaks, home_from))) in finalists.iter().zip(peaks).enumerate() {
        // The peaks of the placement that found the program feasible (none: it does not fit).
        let (standard, interleaved) = peaks.unwrap_or((0, 0));
        let active: BTreeSet<u32> = l.plans.iter().map(|p| p.tiles).collect();
        info!(
            finalist = i,
            values = graph.values.len(),
            operations = graph.operations.len(),
            estimated_cycles = estimated_cycles(l),
            estimated_exchange_cycles = l.plans.iter().map(|p| p.estimated_exchange_cycles).sum::<u64>(),
            peak_standard_bytes = standard,
            peak_interleaved_bytes = interleaved,
            peak_total_bytes = standard + interleaved,
            active_tile_counts = ?active,
            home_weights_from = %home_from_name(graph, home_from),
            plans = %describe(l),
            "retained operator-plan finalist"
        );
    }
    (Ok(finalists), skipped, fits)
}

/// By name, the first product with a weight at or after original operation `from` (the first
/// whose weights a program homing from `from` keeps on home tiles); "none" when there is no
/// such product (every weight replicated).
fn home_from_name(graph: &Graph, from: usize) -> String {
    match (from..graph.operations.len()).find(|&op| graph.matrix_weight_of(op).is_some()) {
        Some(op) => graph.value(graph.operations[op].output).name.clone(),
        None => "none".into(),
    }
}

/// The user asked (`weights = "home"`) for the weights of the products before a product to
/// stay replicated, and the best program keeps earlier ones on home tiles too, because the
/// replicated ones did not fit in tile memory: say so, naming both operations.
fn warn_given_up_home_constraint(graph: &Graph, home_from: usize) {
    if let Some((constrained, kept)) = given_up_home_constraint(graph, home_from) {
        warn!(
            operation = %constrained,
            home_weights_from = %kept,
            "the weights constraint could not be kept as given: the weights replicated before operation {constrained} do not fit in tile memory, so the products' weights from operation {kept} on are kept on home tiles"
        );
    }
}

/// The constrained operation and the one a program homes weights from instead, when the
/// program (its products' weights homed from original operation `home_from`) keeps weights
/// on home tiles that the user's `weights = "home"` asked to stay replicated.
fn given_up_home_constraint(graph: &Graph, home_from: usize) -> Option<(String, String)> {
    home_constraint(graph).filter(|&c| home_from < c).map(|c| (home_from_name(graph, c), home_from_name(graph, home_from)))
}

/// A program `lower_feasible` made, and the peak standard and interleaved bytes per tile of
/// the placement that found it feasible (none: it does not fit).
/// With them, the original operation from which its products keep their weights on home
/// tiles (`Partial::home_from`; usize::MAX: every weight replicated).
type Feasible = (Lowered, Option<(u64, u64)>, usize);

/// Lower an oriented graph to a program whose buffers fit, whole-program. A program that fits
/// but whose placement pushes weights the planner costed as interleaved into standard memory
/// is planned once more with the other operations' resident bytes, so the estimate sees the
/// region pressure (and may pick plans that avoid it).
/// With the program, the peak standard and interleaved bytes per tile of the placement that
/// found it feasible (none: nothing fit; the last attempt is returned so that placement can
/// name the buffer that overflows).
///
/// `try_capped`: when the beam's program keeps weights on home tiles, first try every weight
/// replicated on fewer tiles (`capped_program`; not for programs far over tile memory while a
/// nearer one fits, `feasible_finalists`).
///
/// `first`: the program already lowered with no reserves (and the original operation from
/// which its products keep their weights on home tiles: `Partial::home_from`), which stands
/// for that first attempt. `memo`: a prefix of the program lowered with home-tile weights,
/// which the first home-weights attempt extends.
///
/// Weight arrangements, in order: every weight replicated; a mixed program (the products from
/// some operation on keep their weights on home tiles, the earlier ones replicated: the one
/// the beam chose, or, when replicated weights do not fit, the latest start that covers their
/// overflow by [`mixed_from`]); every weight on home tiles aligned to the program's period;
/// rotating with every weight.
#[allow(clippy::too_many_arguments)]
fn lower_feasible(oriented: &Oriented, target: &Target, first: Option<(Attempt, usize)>, memo: Option<&HomePrefix>, history: Option<&Snapshot>, try_capped: bool, ahead: Option<&CappedAhead>, mixed_memo: Option<(&MixedMemo, &Arc<Oriented>)>) -> Result<Feasible, LowerError> {
    let beam_from = first.as_ref().map_or(usize::MAX, |f| f.1);
    // The beam kept weights on home tiles because replicated ones did not fit at the planner's
    // own partitions: every weight replicated on fewer tiles may fit, and beat the multicasts
    // (not when the user asked for home-tile weights).
    // One estimated slower than the beam's program is kept in case no arrangement below fits.
    let mut capped_fallback: Option<Feasible> = None;
    let mut deferred: Option<Deferred> = None;
    if try_capped && beam_from < usize::MAX && home_constraint(&oriented.graph).is_none() {
        if let Some((m, _)) = mixed_memo {
            m.capped_tried.store(true, Ordering::Relaxed);
        }
        match first.as_ref().map(|(beam, _)| capped_program(oriented, target, beam, ahead)) {
            Some(CappedStart::Done(Some(done))) => match *done {
                (capped, true) => return Ok(capped),
                (capped, false) => capped_fallback = Some(capped),
            },
            Some(CappedStart::Fallback(d)) => deferred = Some(d),
            Some(CappedStart::Done(None)) | None => {}
        }
    }
    let arrange = |first, stop_at_swapped| arrangements(oriented, target, first, memo, history, mixed_memo, stop_at_swapped);
    let arranged = match deferred {
        None => arrange(first, capped_fallback.is_some()).0,
        // The first cap did not fit and the cap with the margin is still to lower: it and the
        // home-tile arrangements are independent, so they run side by side (five and ten
        // full-size encoder layers lowered the lower cap for 5 and 13 s, on one core, before
        // finding that it does not fit either). What is taken is what trying them one after
        // the other takes: the capped program when it fits and is estimated no slower than
        // the beam's, or when it fits and the arrangements met an overflow of a swapped
        // product's weights (where they would have stopped for it), else the arrangements'.
        Some(d) => {
            let (capped, (arranged, swapped_seen)) = rayon::join(|| capped_at(oriented, target, d), || arrange(first, false));
            match capped {
                Some((capped, true)) => return Ok(capped),
                Some((capped, false)) if swapped_seen => {
                    debug!("a swapped product's weights overflow, which home tiles cannot hold once; keeping the weights replicated on fewer tiles");
                    return Ok(capped);
                }
                Some((capped, false)) => capped_fallback = Some(capped),
                None => {}
            }
            arranged
        }
    };
    match (arranged, capped_fallback) {
        (Arranged::Fits(f), _) => Ok(f),
        (arranged, Some(capped)) => {
            if matches!(arranged, Arranged::Nothing { .. }) {
                debug!("no home-tile arrangement fits; keeping the weights replicated on fewer tiles");
            }
            Ok(capped)
        }
        // Nothing fits: hand on the last program so placement names the buffer that overflows.
        (Arranged::Nothing { last, first_error }, None) => last.map(|(l, from)| (l, None, from)).ok_or_else(|| first_error.expect("an attempt either lowers or fails")),
        (Arranged::SwappedOverflow, None) => unreachable!("the arrangements stop at a swapped product's overflow only beside a capped program"),
    }
}

/// What the home-tile arrangements of [`lower_feasible`] came to.
enum Arranged {
    /// A program that fits.
    Fits(Feasible),
    /// A swapped product's weights (its A operand, which no arrangement keeps on home tiles)
    /// overflowed, and the arrangements were asked to stop there (a capped program that fits
    /// is at hand: that program is what replicates them less).
    SwappedOverflow,
    /// None fits: the last program lowered (placement names its overflow), else the first error.
    Nothing { last: Option<(Lowered, usize)>, first_error: Option<LowerError> },
}

/// Where `arrangements` keeps each weight block once: on home tiles aligned to the program's
/// period (every repeat of a block on the same tiles), rotating with the period's repeats, or
/// rotating with every weight onto the least-loaded tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Homes {
    Aligned,
    Period,
    Rotated,
}

/// The weight arrangements [`lower_feasible`] tries after the capped program: the beam's own
/// (home tiles from its `home_from`, when it homed any), then every weight on home tiles
/// aligned to the program's period, then rotating with its repeats (a program of repeated
/// blocks), then rotated with every weight, with mixed programs between them, each
/// re-planned with the other operations' resident bytes. `first` is the beam's program and
/// its `home_from`. With `stop_at_swapped` they stop at the first placement overflow of a
/// swapped product's weights (`Arranged::SwappedOverflow`); also returned: whether they met
/// one before they ended.
fn arrangements(oriented: &Oriented, target: &Target, mut first: Option<(Attempt, usize)>, memo: Option<&HomePrefix>, history: Option<&Snapshot>, mixed_memo: Option<(&MixedMemo, &Arc<Oriented>)>, stop_at_swapped: bool) -> (Arranged, bool) {
    let operations = oriented.graph.operations.len();
    let mut last: Option<(Lowered, usize)> = None;
    let mut first_error: Option<LowerError> = None;
    let mut swapped_seen = false;
    // A program the beam already lowered with (some) home-tile weights found replicated ones
    // too big. Home tiles aligned to the program's period come first (repeated blocks then
    // share their multicast patterns); rotating with every weight, when those do not fit.
    // (home_from, homes, rounds).
    let beam_from = first.as_ref().map_or(usize::MAX, |f| f.1);
    let mut modes: Vec<(usize, Homes, usize)> = match beam_from {
        0 => vec![(0, Homes::Aligned, ROUNDS), (0, Homes::Period, ROUNDS), (0, Homes::Rotated, ROUNDS)],
        from => vec![(from, Homes::Aligned, ROUNDS), (0, Homes::Aligned, ROUNDS), (0, Homes::Period, ROUNDS), (0, Homes::Rotated, ROUNDS)],
    };
    // Homes rotating with the period's repeats are aligned ones where the period does not
    // repeat.
    if !weights_repeat(&oriented.graph) {
        modes.retain(|m| m.1 != Homes::Period);
    }
    // The user's `weights = "home"` asked for the weights of the products before one to stay
    // replicated, and the beam homed earlier ones (the mixed program it started from
    // overflowed): that mixed program comes first, then the latest earlier starts that cover
    // its overflow (`mixed_from`), before the beam's own arrangement.
    let constrained = home_constraint(&oriented.graph).map(|o| oriented.origin.get(o).map_or(o, |&x| x as usize));
    if let Some(constrained) = constrained.filter(|&c| beam_from < c) {
        debug!(beam_from, constrained, "the beam gave up the weights constraint; trying the constrained mixed program first");
        modes.insert(0, (constrained, Homes::Aligned, ROUNDS));
    }
    // Later starts: one lowering each, no reserve rounds (an overflow left names the next
    // start); with reserve rounds where the user asked for replicated weights (a constraint),
    // since a start may fit only with them and keeping the most weights replicated is what
    // was asked.
    let descent_rounds = if constrained.is_some() { ROUNDS } else { 1 };
    let mut mode = 0;
    let mut mixed_tries = 0;
    while let Some(&(home_from, homes, rounds)) = modes.get(mode) {
        mode += 1;
        let aligned = homes == Homes::Aligned;
        let home_weights = home_from == 0;
        let mut reserves = vec![Reserve::default(); operations];
        let mut fitting: Option<(Lowered, (u64, u64))> = None;
        // When the weights replicated so far do not fit: the mixed program that covers the
        // overflow (more weights on home tiles).
        let mut mixed: Option<usize> = None;
        for round in 0..rounds {
            let given = match first.take() {
                Some((a, from)) if round == 0 && from == home_from && aligned => Some(a),
                other => {
                    first = other;
                    None
                }
            };
            let attempt = match given.map(Ok).unwrap_or_else(|| match memo {
                // No reserves yet: the (aligned) home-weights prefix extends to the whole program.
                Some(m) if home_weights && aligned && round == 0 => home_lowering(Some(m), oriented, target, operations).and_then(|p| complete(p, oriented, target, &reserves)),
                // No reserves yet: a mixed program extends the longest replicated prefix of the
                // beam's lineage that ends before its start.
                _ if aligned && round == 0 && !home_weights && home_from < usize::MAX => match history.and_then(|h| h.longest(oriented, end_before(oriented, Some(home_from)))) {
                    Some(prefix) => match mixed_memo {
                        Some((m, arc)) => extend_mixed(prefix, arc, target, home_from, Some(m)),
                        None => extend(prefix.partial.clone().home_later(home_from), oriented, target, &reserves, operations),
                    }
                    .and_then(|p| complete(p, oriented, target, &reserves)),
                    None => lower_homing_from(oriented, target, home_from, &reserves),
                },
                _ if aligned => lower_homing_from(oriented, target, home_from, &reserves),
                _ if homes == Homes::Period => lower_with_period_homes(oriented, target, &reserves),
                _ => lower_with_rotated_homes(oriented, target, &reserves),
            }) {
                Ok(a) => a,
                Err(e) => {
                    debug!(home_from, homes = ?homes, round, error = %e, "the program does not lower with these resident bytes");
                    first_error.get_or_insert(e);
                    break;
                }
            };
            let Placed { peaks, displaced, failure } = place_attempt(&attempt, target);
            if let Some(peaks) = peaks.filter(|_| !displaced || round + 1 == ROUNDS || fitting.is_some()) {
                return (Arranged::Fits((attempt.lowered, Some(peaks), home_from)), swapped_seen);
            }
            let merged = merged_reserves(&reserves, &attempt, operations);
            match peaks {
                Some(peaks) => {
                    debug!("weights costed in interleaved memory were placed in standard memory; planning again with resident bytes");
                    fitting = Some((attempt.lowered, peaks));
                }
                None => {
                    // The overflow is a swapped product's weight (its A operand, which no
                    // arrangement keeps on home tiles) and the capped program fits: that
                    // program is what replicates it less; the home-tile arrangements would
                    // only lower it again at the planner's partitions.
                    if !swapped_seen && failure.as_ref().is_some_and(|f| swapped_weights(oriented).contains(&f.label)) {
                        swapped_seen = true;
                        if stop_at_swapped {
                            debug!(failure = ?failure, "a swapped product's weights overflow, which home tiles cannot hold once; keeping the weights replicated on fewer tiles");
                            return (Arranged::SwappedOverflow, true);
                        }
                    }
                    debug!(home_weights, home_from, homes = ?homes, failure = ?failure, "the program does not fit; planning again with other operations' resident bytes");
                    if let Some(failure) = failure.filter(|_| round == 0 && home_from > 0 && mixed_tries < MIXED_TRIES) {
                        mixed = mixed_from(oriented, &attempt.lowered.buffers, &attempt.lowered.inputs, &failure, target, home_from);
                    }
                    last = Some((attempt.lowered, home_from));
                }
            }
            if merged == reserves {
                break;
            }
            reserves = merged;
        }
        if let Some((l, peaks)) = fitting {
            return (Arranged::Fits((l, Some(peaks), home_from)), swapped_seen);
        }
        if let Some(from) = mixed {
            debug!(home_from, mixed_from = from, "replicated weights do not fit in tile memory; keeping the weight blocks of the products from this operation on once on a home tile");
            modes.insert(mode, (from, Homes::Aligned, descent_rounds));
            mixed_tries += 1;
        } else if home_from == usize::MAX {
            debug!("replicated weights do not fit in tile memory; keeping each weight block once on a home tile");
        } else if !home_weights {
            debug!(home_from, "the mixed program does not fit; keeping each weight block once on a home tile");
        } else if aligned && modes.get(mode).is_some_and(|m| m.1 == Homes::Period) {
            debug!("home tiles aligned to the program's period do not fit; rotating them with the period's repeats");
        } else if aligned {
            debug!("home tiles aligned to the program's period do not fit; rotating them with every weight");
        } else if homes == Homes::Period {
            debug!("home tiles rotating with the period's repeats do not fit; rotating them with every weight");
        }
    }
    (Arranged::Nothing { last, first_error }, swapped_seen)
}

/// The last resort of `feasible_finalists`, tried only when no program of the beam fits in
/// any weight arrangement of [`lower_feasible`] (so no build that succeeds without it changes,
/// nor its time): every matrix product planned with its A block and its B block each at most
/// a tile's standard region beside the code reserve, then half of it (`Partial::block_capped`), weights replicated, on aligned home tiles, then on
/// rotated ones, each made feasible like the arrangements (re-planned with the other
/// operations' resident bytes, up to `ROUNDS`). The planner's own partitions are the fastest
/// by its estimate, but where a gathered operand block or a weight block fills most of a
/// region (a 16-tile chip with weights of hundreds of kilobytes a tile) placement fails and
/// the re-planning rounds, whose reserves only grow, cannot shrink it again: a one-block MLP
/// of 882 rows, 306 wide, hidden 702 on small16 (a quarter of its memory) exited 2 and now
/// runs at 829,696 cycles. Returns the program, its placement's peak standard and
/// interleaved bytes and its `home_from`.
fn fit_block_capped(oriented: &Oriented, target: &Target) -> Option<(Lowered, (u64, u64), usize)> {
    let m = &target.memory;
    let standard = (m.interleaved_start.saturating_sub(m.base) as u64).saturating_sub(CODE_RESERVE_BYTES);
    // Blocks of the standard region, then of half of it; at each, weights replicated, on home
    // tiles aligned to the program's period, on rotated homes. The attempts are independent:
    // they run in parallel, and the first in this order that fits is taken (what trying them
    // one after another takes).
    let attempts: Vec<(u64, bool, bool)> = [1, 2].into_iter().flat_map(|divisor| [(false, true), (true, true), (true, false)].map(|(home, aligned)| (standard / divisor, home, aligned))).collect();
    attempts.into_par_iter().find_map_first(|(bytes, home, aligned)| {
        debug!(bytes, home_weights = home, aligned, "no weight arrangement fits at the planner's partitions; planning every product with smaller operand blocks");
        fit_rounds(oriented, target, "the block-capped program", bytes, |reserves| lower_block_capped(oriented, target, home, aligned, bytes, reserves), None).map(|(lowered, peaks)| (lowered, peaks, if home { 0 } else { usize::MAX }))
    })
}

/// The names of the weights that swapped products of `oriented` read as their A operand
/// (through views): replicated on the products' column partitions, never on home tiles.
fn swapped_weights(oriented: &Oriented) -> BTreeSet<String> {
    let g = &oriented.graph;
    g.operations
        .iter()
        .filter(|o| matches!(o.kind, crate::ir::OpKind::MatMul { .. }) && oriented.checkpoint_value.contains_key(&o.output))
        .filter_map(|o| {
            let base = super::grid::ViewChain::resolve(g, o.inputs[0]).base;
            let v = g.value(base);
            matches!(v.producer, crate::ir::Producer::Tensor { role: crate::ir::Role::Weight, .. }).then(|| v.name.clone())
        })
        .collect()
}

/// An attempt placed beside the code reserve (`place_attempt`): the peak standard and
/// interleaved bytes per tile (None: it does not fit, `failure` says where), and whether weights
/// the planner costed in interleaved memory were placed in standard memory.
struct Placed {
    peaks: Option<(u64, u64)>,
    displaced: bool,
    failure: Option<PlacementError>,
}

fn place_attempt(attempt: &Attempt, target: &Target) -> Placed {
    let code = vec![CODE_RESERVE_BYTES as u32; attempt.lowered.tiles as usize];
    let placed = place_storage(target, &attempt.lowered, &code);
    let displaced = placed.as_ref().is_ok_and(|p| weights_displaced(attempt, &p.addresses, target));
    let peaks = placed.as_ref().ok().map(|p| {
        let m = &target.memory;
        (p.peak_standard.iter().map(|&a| (a - m.base) as u64).max().unwrap_or(0), p.peak_interleaved.iter().map(|&a| (a - m.interleaved_start) as u64).max().unwrap_or(0))
    });
    Placed { peaks, displaced, failure: placed.err() }
}

/// `reserves` raised, operation by operation, to what `attempt`'s other operations keep resident
/// (`reserves_of`): the budgets of the next re-planning round.
fn merged_reserves(reserves: &[Reserve], attempt: &Attempt, operations: usize) -> Vec<Reserve> {
    reserves.iter().zip(reserves_of(attempt, operations)).map(|(a, b)| Reserve { total: a.total.max(b.total), interleaved: a.interleaved.max(b.interleaved) }).collect()
}

/// A program that fits, and the peak standard and interleaved bytes per tile of its placement.
type Fitted = (Lowered, (u64, u64));

/// Every weight replicated, on at most `cap` tiles each (`Partial::replication_capped`), made
/// feasible like a weight arrangement of [`lower_feasible`] (re-planned with the other
/// operations' resident bytes, up to `ROUNDS`): the program and its placement's peak standard
/// and interleaved bytes per tile, or None when it does not fit.
fn fit_capped(oriented: &Oriented, target: &Target, cap: u32, first: Option<Result<Attempt, LowerError>>) -> Option<Fitted> {
    fit_rounds(oriented, target, "the capped program", cap as u64, |reserves| lower_replication_capped(oriented, target, cap, reserves), first)
}

/// A program `lower` makes, made feasible: placed beside the code reserve and, while it does
/// not fit (or its interleaved weights were displaced), lowered again with the bytes its other
/// operations keep resident (`merged_reserves`), up to `ROUNDS`; `first`, when given, is the
/// first round's lowering. The program and its placement's peaks, or None. The log names the
/// program `what` and its `cap` (replicas, or bytes a block).
fn fit_rounds(oriented: &Oriented, target: &Target, what: &str, cap: u64, lower: impl Fn(&[Reserve]) -> Result<Attempt, LowerError>, mut first: Option<Result<Attempt, LowerError>>) -> Option<Fitted> {
    let operations = oriented.graph.operations.len();
    let mut reserves = vec![Reserve::default(); operations];
    let mut fitting: Option<Fitted> = None;
    for round in 0..ROUNDS {
        let attempt = match first.take().unwrap_or_else(|| lower(&reserves)) {
            Ok(a) => a,
            Err(e) => {
                debug!(cap, round, error = %e, "{what} does not lower with these resident bytes");
                break;
            }
        };
        let Placed { peaks, displaced, failure } = place_attempt(&attempt, target);
        if let Some(peaks) = peaks.filter(|_| !displaced || round + 1 == ROUNDS || fitting.is_some()) {
            return Some((attempt.lowered, peaks));
        }
        debug!(cap, round, fits = peaks.is_some(), failure = ?failure, "{what} does not fit as planned; planning again with other operations' resident bytes");
        let merged = merged_reserves(&reserves, &attempt, operations);
        if let Some(peaks) = peaks {
            fitting = Some((attempt.lowered, peaks));
        }
        if merged == reserves {
            break;
        }
        reserves = merged;
    }
    fitting
}

/// When the beam kept weights on home tiles (`beam`, its program) because replicated ones did
/// not fit at the planner's own partitions: the program with every weight replicated on fewer
/// tiles (`fit_capped`) when one fits, and whether its estimate is no worse than the beam's,
/// which pays a multicast of each homed weight block at every product that reads it (when it
/// is worse, [`lower_feasible`] keeps it only if no home-tile arrangement fits: a swapped
/// product's weights, its A operand, cannot be homed). The cap with the margin (below) is not
/// lowered here: it is handed back (`CappedStart::Fallback`), and `lower_feasible` lowers it
/// beside the home-tile arrangements (`capped_at`).
///
/// The first cap tried is what memory suggests: the most replicas r for which the program's
/// rank-2 weights, spread over tiles / r tiles (one replica set), fit in the bytes a tile has
/// beside the code reserve and the most that the beam's program keeps live on a tile in
/// buffers the host does not write (activations, partials, gathered operands: a replicated
/// program holds about as much, less as r grows). Where that cap does not fit, the same count
/// less a margin (`CAP_MARGIN`) is tried once, when it is lower (it was the first cap until
/// session 43; four encoder layers: 5, then 4). No cap lower than that is tried: fewer
/// replicas trade weight bytes for larger operand blocks and partials, so a lower cap seldom
/// fits where it does not (six full-size encoder layers: 3, 2 and 1 all overflow; trying 3 and
/// 2 side by side cost about 20 s of a 74 s build). Higher caps are (session 34): that first cap counts
/// every weight at the cap, so where some products keep fewer replicas than the cap (or run
/// side by side on a share of the tiles) more may fit; each about a fifth higher is lowered
/// while the weight bytes it could add fit in what the last one's placement left free, and
/// kept while it fits, leaves room to keep exchange buffers apart (`keeps_opposites_apart`)
/// and is estimated faster (one full-size encoder layer with its MLP
/// swapped: 20 replicas, 366,992 estimated, then 24, 350,711; 28 fits, estimated the same:
/// at 24 the MLP's plans take 23 replicas, and caps up to 39 fit with the same plans).
fn capped_program(oriented: &Oriented, target: &Target, beam: &Attempt, ahead: Option<&CappedAhead>) -> CappedStart {
    let weight_bytes = matrix_weight_bytes(&oriented.graph);
    if weight_bytes == 0 {
        return CappedStart::Done(None);
    }
    let l = &beam.lowered;
    let live = transient_peak(l.buffers.iter(), &host_written(l), l.tiles);
    let start = first_cap(weight_bytes, live, target, false);
    let beam_estimate = estimated_cycles(l);
    debug!(weight_bytes, transient_peak = live, start, beam_estimate, "replicated weights did not fit; trying fewer replicas");
    if start == 0 {
        return CappedStart::Done(None);
    }
    // The most replicas any product of the beam's program has (the ladder's top, below).
    let most = l.plans.iter().filter(|p| p.kind == "matmul").map(|p| if p.orientation == "swapped" { p.partitions[2] } else { p.partitions[1] }).max().unwrap_or(0);
    // The first lowering of this cap, when it was lowered beside the beam over this orientation.
    let first = ahead.and_then(|a| a.take(oriented, start));
    match usable(oriented, target, start, first) {
        Some(fitted) => CappedStart::Done(Some(Box::new(climb(oriented, target, start, fitted, most, beam_estimate)))),
        None => {
            // The cap with the margin, when it is lower.
            let fallback = first_cap(weight_bytes, live, target, true);
            debug!(cap = start, fallback, "replicated weights on this many tiles do not fit, or leave no room to keep exchange buffers apart");
            if fallback > 0 && fallback < start {
                CappedStart::Fallback(Deferred { cap: fallback, most, beam_estimate })
            } else {
                debug!("replicated weights on fewer tiles do not fit");
                CappedStart::Done(None)
            }
        }
    }
}

/// What [`capped_program`] found before it would lower a cap below its first.
enum CappedStart {
    /// Its answer: the capped program and whether it is estimated no slower than the beam's
    /// (None: no cap fits, or there is none to try).
    Done(Option<Box<(Feasible, bool)>>),
    /// The first cap does not fit; the cap with the margin is lower and still to be lowered
    /// ([`capped_at`]).
    Fallback(Deferred),
}

/// A replication cap [`capped_program`] leaves to [`capped_at`]: the cap, the most replicas any
/// product of the beam's program has and the beam program's estimate.
#[derive(Clone, Copy)]
struct Deferred {
    cap: u32,
    most: u32,
    beam_estimate: u64,
}

/// [`capped_program`] from its deferred cap on: the program at that cap when it fits, after
/// the larger caps that also fit and are estimated faster (`climb`).
fn capped_at(oriented: &Oriented, target: &Target, d: Deferred) -> Option<(Feasible, bool)> {
    let fitted = usable(oriented, target, d.cap, None);
    if fitted.is_none() {
        debug!("replicated weights on fewer tiles do not fit");
    }
    fitted.map(|f| climb(oriented, target, d.cap, f, d.most, d.beam_estimate))
}

/// A cap's program as [`capped_program`] takes it: where it fits and leaves room to keep
/// exchange buffers apart (`keeps_opposites_apart`): one that fits with less room makes
/// `select_finalist` steer and plan again, to a program slower than the home-tile weights'
/// (five full-size encoder layers at cap 3: 2,103,032 cycles after the steer, against
/// 1,992,272 homed).
fn usable(oriented: &Oriented, target: &Target, cap: u32, first: Option<Result<Attempt, LowerError>>) -> Option<Fitted> {
    fit_capped(oriented, target, cap, first).filter(|(l, _)| keeps_opposites_apart(l, target))
}

/// The capped program from the first cap that fits (`start`, its program and placement's
/// peaks), and whether it is estimated no slower than the beam's (`beam_estimate`).
/// `first_cap` counts every weight at the cap, but products that the planner gives fewer
/// replicas than the cap hold fewer (and products side by side share the tiles): more
/// replicas may fit. Larger caps, each about a fifth more, up to `most` (the most replicas any
/// product of the beam's program has), while the weight bytes they could add on a tile (the
/// most weight bytes the capped program keeps on one, grown by the cap's ratio) stay within
/// the bytes its placement left free, and while each fits and is estimated faster.
fn climb(oriented: &Oriented, target: &Target, start: u32, fitted: Fitted, most: u32, beam_estimate: u64) -> (Feasible, bool) {
    let (mut lowered, mut peaks) = fitted;
    let mut estimate = estimated_cycles(&lowered);
    let mut cap = start;
    // The next cap above `cap` worth lowering after the program `l` (placed at `p`): none past
    // `most`, or when the weight bytes it could add exceed what that placement left free.
    let next_after = |cap: u32, l: &Lowered, p: (u64, u64)| -> Option<u32> {
        let next = next_cap(cap);
        let free = tile_bytes(target).saturating_add(CODE_RESERVE_BYTES).saturating_sub(p.0 + p.1);
        let grown = host_written_peak(l) * (next - cap) as u64 / cap as u64;
        let worth = next <= most && grown <= free;
        if !worth {
            debug!(cap, next, most, grown, free, "no larger replication cap to try");
        }
        worth.then_some(next)
    };
    // The ladder lowers two caps at once (on two threads): the next one, and the one after it
    // as the program at `cap` would bound it; the second is kept only if the first is, and
    // only if the first's program would also have tried it, so the result is the one-by-one
    // ladder's.
    let mut pending: Option<(u32, Option<Fitted>)> = None;
    while let Some(next) = next_after(cap, &lowered, peaks) {
        let (first, second) = match pending.take().filter(|(c, _)| *c == next) {
            Some((_, done)) => (done, None),
            None => {
                let after = next_cap(next);
                rayon::join(|| fit_capped(oriented, target, next, None), || (after <= most).then(|| (after, fit_capped(oriented, target, after, None))))
            }
        };
        match first {
            Some((l, p)) if estimated_cycles(&l) < estimate && keeps_opposites_apart(&l, target) => {
                debug!(cap = next, estimate = estimated_cycles(&l), previous = estimate, "more replicas fit and are estimated faster");
                estimate = estimated_cycles(&l);
                (lowered, peaks, cap) = (l, p, next);
                pending = second;
            }
            other => {
                debug!(cap = next, fits = other.is_some(), "more replicas do not fit or are not estimated faster");
                break;
            }
        }
    }
    let better = estimate <= beam_estimate;
    if better {
        info!(replicas = cap, estimated_cycles = estimate, home_weights_estimated_cycles = beam_estimate, "replicated weights fit on fewer tiles each; keeping every weight resident where it is read");
    } else {
        debug!(cap, estimate, beam_estimate, "replicated weights on this many tiles fit but are estimated slower than home-tile weights");
    }
    ((lowered, Some(peaks), usize::MAX), better)
}

/// Whether `l`, placed with the code reserve in place of code, keeps every tile's sending and
/// receiving buffers of each exchange phase in different memory elements (strict exchange
/// rules, receive buffers from the region start, as `select_finalist`'s first exchange-placement
/// candidate places them). A larger cap is kept only then: `select_finalist` drops a program
/// whose memory-element conflicts placement cannot remove and plans again. Three full-size
/// encoder layers took cap 8 when it fitted with 336 bytes to spare, left 171,019 conflicting
/// tile-cycles, and were steered and planned again (11 s of a 17 s build) to 1,171,200 cycles;
/// kept at 7 they run 1,121,346 cycles and build in about 6 s (session 43).
fn keeps_opposites_apart(l: &Lowered, target: &Target) -> bool {
    let code = vec![CODE_RESERVE_BYTES as u32; l.tiles as usize];
    let rules = crate::storage::ExchangeRules { strict: true, ..crate::exchange_placement::exchange_rules(l, 0) };
    let apart = crate::storage::place_storage_with(target, l, &code, &rules);
    if let Err(e) = &apart {
        debug!(error = %e, "the program leaves no room to keep exchange buffers apart");
    }
    apart.is_ok()
}

/// The replication cap `capped_program` tries after `cap`: about a fifth more, at least one.
fn next_cap(cap: u32) -> u32 {
    (cap + 1).max(cap * 6 / 5)
}

/// Per buffer of a finished program: whether the host writes it (weights and inputs).
fn host_written(l: &Lowered) -> Vec<bool> {
    let mut host = vec![false; l.buffers.len()];
    for s in l.inputs.iter().flat_map(|t| &t.segments) {
        host[s.buffer as usize] = true;
    }
    host
}

/// The most bytes on any tile in buffers the host writes (weights and inputs).
fn host_written_peak(l: &Lowered) -> u64 {
    let mut per_tile = vec![0u64; l.tiles as usize];
    for (b, _) in l.buffers.iter().zip(host_written(l)).filter(|(_, h)| *h) {
        if let Some(t) = per_tile.get_mut(b.tile as usize) {
            *t += b.bytes as u64;
        }
    }
    per_tile.into_iter().max().unwrap_or(0)
}

/// The fewest replicas the graph's rank-2 weights must be able to take (`first_cap` with no
/// transient bytes) for the search to write a swapped chain's end out transposed
/// (`chains_allowed`). A compiler constant, not a machine cost: a swapped product's weights
/// are its A operand, replicated on its column partitions and never homed, so the chain pays
/// only where they can be replicated widely (one full-size encoder layer: 27 at most, the
/// swapped MLP fitting at 24 and running 7 % faster than normal; four layers: 6 at most, and
/// swapped MLPs capped at four or five replicas ran 12–15 % slower, while six layers ended
/// with no program that fits).
const CHAIN_REPLICAS: u32 = 12;

/// Whether the search may take orientations that write a swapped chain's end out transposed
/// for a reader by rows (`Oriented::chain_written`): where the graph's rank-2 weights fit on
/// every tile at `CHAIN_REPLICAS` replicas or more (`first_cap` with no transient bytes).
fn chains_allowed(graph: &Graph, target: &Target) -> bool {
    let weight_bytes = matrix_weight_bytes(graph);
    weight_bytes > 0 && first_cap(weight_bytes, 0, target, true) >= CHAIN_REPLICAS
}

/// `orient_until` for the search: an orientation that writes a swapped chain's end out
/// (`Oriented::chain_written`) is rejected where `chains` (`chains_allowed`) is false.
fn beam_orient(graph: &Graph, swapped: &BTreeSet<usize>, until: usize, chains: bool) -> Result<Oriented, String> {
    orient_until(graph, swapped, until).and_then(|o| if o.chain_written && !chains { Err("a swapped chain's end would be written out, and the weights cannot be replicated widely enough for that".into()) } else { Ok(o) })
}

/// The bytes of a graph's rank-2 weights.
fn matrix_weight_bytes(graph: &Graph) -> u64 {
    graph.values.iter().filter(|v| v.is_matrix_weight()).map(|v| v.shape.iter().map(|&d| d as u64).product::<u64>() * v.dtype.bytes() as u64).sum()
}

/// The most bytes live on any tile in the buffers the host does not write (`host`: per
/// buffer, whether it does): activations, partials, gathered operands.
fn transient_peak<'a>(buffers: impl Iterator<Item = &'a BufferDecl> + Clone, host: &[bool], tiles: u32) -> u64 {
    let transient: Vec<&BufferDecl> = buffers.enumerate().filter(|(i, _)| !host.get(*i).copied().unwrap_or(false)).map(|(_, b)| b).collect();
    let mut live = 0u64;
    tile_peaks(transient.iter().copied(), &vec![false; transient.len()], tiles, |_, (_, _, total)| live = live.max(total));
    live
}

/// The first replication cap `capped_program` tries (its docs): the most replicas r for which
/// `weight_bytes` spread over tiles / r tiles fit in a tile's bytes beside the code reserve,
/// less `live` transient bytes and, with `margin`, `CAP_MARGIN`'s share (the fallback cap);
/// 0 when not even one replica set fits.
fn first_cap(weight_bytes: u64, live: u64, target: &Target, margin: bool) -> u32 {
    let tiles = target.chip.tiles;
    let margin = if margin { tile_bytes(target) / CAP_MARGIN } else { 0 };
    let room = tile_bytes(target).saturating_sub(margin).saturating_sub(live);
    (1..=tiles).take_while(|&r| weight_bytes.div_ceil((tiles / r).max(1) as u64) <= room).last().unwrap_or(0)
}

/// The fewest threads in the pool (`rayon::current_num_threads`) for which the search spends
/// spare cores on speculative work that only shortens the wall time (the programs are the same
/// at any thread count): the exchange phases the capped program's lowering hands on are
/// scheduled on all threads but two while the search waits for it (`CappedAhead`). On a
/// 16-core machine (session 42) four encoder layers waited 2.5 s of their 7 s `lower_mid` for
/// that lowering after the beam had ended, with 15 cores idle. Until session 62 the lowering
/// itself also started at the first step where any program of the beam homes weights only on
/// such a pool (on fewer threads, where the best one does: on two, the four-block MLP started
/// a lowering there that was never used and built 0.1–0.8 s slower). Since the planner counts
/// paired gathers (`plan.rs` `paired_gathers`) four encoder layers' best program keeps its
/// weights replicated to the beam's last product, and lowering the capped program after the
/// beam made their build 9.7 s instead of 8.2 s on two cores; the four-block MLP's unused
/// lowering is within this machine's noise now (3.7–4.2 s either way), so it starts there on
/// any pool. Not in a build that resumes the kept beam of one that tried no capped program
/// (`KeptBeam::capped_tried`): the four-block MLP's edits under `ipuq watch` and `ipuq serve`
/// lowered it for nothing beside the resumed beam (session 63).
const WIDE_POOL: usize = 4;

/// Whether the current pool has `WIDE_POOL` threads or more.
fn wide_pool() -> bool {
    rayon::current_num_threads() >= WIDE_POOL
}

/// The first lowering of a capped program (`fit_capped`'s round without reserves), started on
/// a thread of its own at the first step where a program of the beam keeps weights on home
/// tiles: from there the beam likely ends with home-tile weights (or a mixed program), and then
/// `capped_program` tries replicas capped, a whole-program lowering on one core; the beam's
/// last steps mostly extend one or two programs and leave the other core idle. The
/// orientation is the best program's at that step (later products normal), the cap
/// `first_cap` of the most transient bytes of the beam's programs there (the best one's homed
/// products gather their weight blocks, transient bytes that the finished program's cap reads
/// too); `capped_program` takes the lowering only for the same orientation and cap, so the
/// programs are those of lowering it there (a speed matter only). Not taken, or dropped, the
/// thread is told to stop at its next product and joined.
///
/// The thread hands on the exchange phases it lowers as it goes (`HandedOn`); a thread that
/// waits for the lowering in `take` schedules them meanwhile through `warm` (the pipeline's
/// per-phase schedule memo, which the table screen reads next), so the screen finds the
/// patterns of the first layers scheduled on the core the wait would leave idle.
struct CappedAhead {
    oriented: Arc<Oriented>,
    cap: u32,
    cancel: Arc<AtomicBool>,
    #[allow(clippy::type_complexity)]
    handle: std::sync::Mutex<Option<std::thread::JoinHandle<(Option<Result<Attempt, LowerError>>, Vec<Partial>)>>>,
    /// The phases the thread has lowered, as it hands them on.
    lowering: std::sync::Mutex<Option<std::sync::mpsc::Receiver<HandedOn>>>,
    /// Told of each phase handed on while a thread waits in `take` (`finalists_warming`).
    warm: Option<Arc<Warm>>,
    /// The lowering's prefixes at its product boundaries, once taken (kept for a next build
    /// in a process that keeps the beam's states).
    prefixes: std::sync::Mutex<Option<Arc<CappedPrefixes>>>,
}

/// Told of exchange phases of a program being lowered (with provisional addresses, as
/// `select_finalist` and the table screen request them) while the thread that asked for the
/// program waits for it: the pipeline schedules them through its per-phase memo. Whatever it
/// does, the programs and their schedules are those made without it (a speed matter only).
pub type Warm = dyn Fn(&crate::exchange::PhaseRequest) + Send + Sync;

/// Exchange phases the capped lowering handed on: phases `first..` of the program, and its
/// buffers when they were lowered (their tiles and provisional addresses).
struct HandedOn {
    first: usize,
    phases: Vec<Arc<Vec<super::Transfer>>>,
    buffers: super::build::Buffers,
}

impl CappedAhead {
    /// Start lowering `graph` with the products in `swapped` swapped (later ones normal) under
    /// the cap `first_cap` gives for the most transient bytes of `partials`; `products`: the
    /// graph's products in order (the thread looks for a stop at each). None when there is no
    /// cap to try or no thread.
    /// `resume`: the previous build's capped prefixes (in a process that keeps them): the
    /// lowering extends the longest that lowers alike over this graph under this cap. `keep`:
    /// whether to keep this lowering's prefixes for a next build (`prefixes`).
    fn start(graph: &Graph, target: &Target, swapped: &BTreeSet<usize>, partials: &[&Partial], products: &[usize], resume: Option<Arc<CappedPrefixes>>, keep: bool) -> Option<CappedAhead> {
        let weight_bytes = matrix_weight_bytes(graph);
        let live = partials.iter().map(|p| transient_peak(p.buffers().iter(), &p.host_flags(), target.chip.tiles)).max().unwrap_or(0);
        let cap = first_cap(weight_bytes, live, target, false);
        if weight_bytes == 0 || cap == 0 {
            return None;
        }
        let oriented = Arc::new(orient_until(graph, swapped, usize::MAX).ok()?);
        let cancel = Arc::new(AtomicBool::new(false));
        let (o, t, c, products) = (oriented.clone(), target.clone(), cancel.clone(), products.to_vec());
        let (sender, receiver) = std::sync::mpsc::channel::<HandedOn>();
        let span = tracing::Span::current();
        let handle = std::thread::Builder::new()
            .name("ipuq-capped".into())
            .spawn(move || {
                let _span = span.enter();
                // Hand on the phases lowered since the last time (a dropped receiver is no
                // matter: nobody waits).
                let mut handed = 0;
                let mut hand_on = |partial: &Partial| {
                    let phases = partial.phase_lists();
                    if phases.len() > handed {
                        let _ = sender.send(HandedOn { first: handed, phases: phases[handed..].to_vec(), buffers: partial.buffers().clone() });
                        handed = phases.len();
                    }
                };
                // The prefixes kept for a next build: those taken over, then those lowered.
                let mut prefixes: Vec<Partial> = Vec::new();
                let mut partial = match resume.as_ref().and_then(|r| r.longest(&o, cap).map(|p| (r, p))) {
                    Some((r, p)) => {
                        let n = p.lowered_operations();
                        debug!(from = n, "the capped lowering extends the previous build's prefix");
                        if keep {
                            prefixes.extend(r.prefixes.iter().filter(|q| q.lowered_operations() <= n && prefix_identical_across_graphs(&r.oriented, &o, q.lowered_operations())).cloned());
                        }
                        let p = p.clone();
                        // What it holds of the program is handed on at once.
                        hand_on(&p);
                        p
                    }
                    None => Partial::replication_capped(cap),
                };
                for &p in &products {
                    let to = end_before(&o, Some(p));
                    if to <= partial.lowered_operations() {
                        continue;
                    }
                    if c.load(Ordering::Relaxed) {
                        return (None, prefixes);
                    }
                    partial = match extend(partial, &o, &t, &[], to) {
                        Ok(p) => p,
                        Err(e) => return (Some(Err(e)), prefixes),
                    };
                    hand_on(&partial);
                    if keep {
                        prefixes.push(partial.clone());
                    }
                }
                if c.load(Ordering::Relaxed) {
                    return (None, prefixes);
                }
                let partial = match extend(partial, &o, &t, &[], o.graph.operations.len()) {
                    Ok(p) => p,
                    Err(e) => return (Some(Err(e)), prefixes),
                };
                hand_on(&partial);
                (Some(complete(partial, &o, &t, &[])), prefixes)
            })
            .ok()?;
        debug!(cap, swapped = ?swapped, "lowering the capped program beside the beam");
        Some(CappedAhead { oriented, cap, cancel, handle: std::sync::Mutex::new(Some(handle)), lowering: std::sync::Mutex::new(Some(receiver)), warm: None, prefixes: std::sync::Mutex::new(None) })
    }

    /// The lowering, when it was made over `oriented` (a program that lowers exactly alike:
    /// `prefix_identical_across_graphs` over every operation) under `cap` and finished; None
    /// otherwise.
    fn take(&self, oriented: &Oriented, cap: u32) -> Option<Result<Attempt, LowerError>> {
        let n = oriented.graph.operations.len();
        let same = cap == self.cap && self.oriented.graph.operations.len() == n && self.oriented.graph.values.len() == oriented.graph.values.len() && self.oriented.graph.outputs == oriented.graph.outputs && prefix_identical_across_graphs(&self.oriented, oriented, n);
        if !same {
            return None;
        }
        let handle = self.handle.lock().ok()?.take()?;
        let lowering = self.lowering.lock().ok().and_then(|mut r| r.take());
        if let (Some(warm), Some(lowering)) = (&self.warm, lowering) {
            warm_while_lowering(&handle, &lowering, warm.as_ref());
        }
        let (taken, prefixes) = handle.join().ok().unwrap_or((None, Vec::new()));
        if !prefixes.is_empty() {
            if let Ok(mut p) = self.prefixes.lock() {
                *p = Some(Arc::new(CappedPrefixes { oriented: self.oriented.clone(), cap, prefixes }));
            }
        }
        debug!(cap, taken = taken.is_some(), "took the capped program lowered beside the beam");
        taken
    }
}

impl HandedOn {
    /// The provisional bases of the buffers declared since those of `bases`.
    fn declare(&self, bases: &mut crate::pipeline::ProvisionalBases) {
        let declared = bases.bases.len();
        bases.extend((declared..self.buffers.len()).filter_map(|b| self.buffers.get(b)));
    }

    /// The exchange request of the `k`th phase handed on, over `bases` (`declare`d).
    fn request(&self, k: usize, bases: &crate::pipeline::ProvisionalBases) -> crate::exchange::PhaseRequest {
        let tile = |b: u32| self.buffers.get(b as usize).map_or(u32::MAX, |d| d.tile);
        let address = |b: u32, offset: u32| bases.bases.get(b as usize).copied().unwrap_or(0) + offset;
        crate::pipeline::transfers_request(self.first + k, &self.phases[k], tile, &address)
    }
}

/// While `handle`'s lowering runs, each exchange phase it hands on (`lowering`), in program
/// order, to `warm`, with the provisional addresses `select_finalist` gives it (those of the
/// program's buffers declared so far are final: `ProvisionalBases`). Stops once the lowering
/// has finished (after the phase at hand). `warm` runs on a pool of one thread: the lowering
/// has the other core, and a scheduler spread over both would slow the lowering waited for.
///
/// Phases are queued on the warming pool as they come (this thread keeps receiving); one whose
/// turn comes after the lowering has ended is skipped. On a wide pool (`WIDE_POOL`) that pool
/// has all the pool's threads but two (the lowering's and this one's), so phases are scheduled
/// side by side.
fn warm_while_lowering<T>(handle: &std::thread::JoinHandle<T>, lowering: &std::sync::mpsc::Receiver<HandedOn>, warm: &Warm) {
    let threads = if wide_pool() { rayon::current_num_threads() - 2 } else { 1 };
    let Ok(pool) = rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|_| "ipuq-warm".into()).build() else {
        return;
    };
    let mut bases = crate::pipeline::ProvisionalBases::default();
    let warmed = AtomicUsize::new(0);
    let span = tracing::Span::current();
    let warm_one = |request: crate::exchange::PhaseRequest| {
        if handle.is_finished() {
            return;
        }
        let _span = span.enter();
        warm(&request);
        warmed.fetch_add(1, Ordering::Relaxed);
    };
    pool.in_place_scope_fifo(|scope| {
        'wait: while !handle.is_finished() {
            let next = match lowering.recv_timeout(std::time::Duration::from_millis(2)) {
                Ok(next) => next,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            };
            next.declare(&mut bases);
            for k in 0..next.phases.len() {
                if handle.is_finished() {
                    break 'wait;
                }
                let request = next.request(k, &bases);
                let warm_one = &warm_one;
                scope.spawn_fifo(move |_| warm_one(request));
            }
        }
    });
    debug!(warmed = warmed.into_inner(), threads, "exchange phases of the capped program handed on while it was lowered");
}

impl Drop for CappedAhead {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.get_mut().ok().and_then(|h| h.take()) {
            let _ = handle.join();
        }
    }
}

/// The replication cap a program was lowered under (`capped_program`), as its plans record it
/// (`REPLICAS_AT_MOST`); None for a program lowered without one.
pub(crate) fn replication_cap_of(l: &Lowered) -> Option<u32> {
    l.plans.iter().flat_map(|p| p.constraint.split(' ')).find_map(|c| c.strip_prefix(REPLICAS_AT_MOST)?.parse().ok())
}

/// A program lowered under replication cap `cap` (`capped_program`), lowered again alone in
/// `oriented` (its own orientation of the graph with steering constraints added), when it
/// fits: a steer re-plans the finalist, not the whole search (whose beam would end where it did
/// and whose capped try would lower this again).
pub(crate) fn lower_capped_alone(oriented: &Oriented, target: &Target, cap: u32) -> Option<Lowered> {
    let fitted = fit_capped(oriented, target, cap, None).map(|f| f.0);
    debug!(cap, fits = fitted.is_some(), "lowered the capped program again alone");
    fitted
}

/// [`lower_capped_alone`] for finalist `l` over `graph`: None when `l` has no replication cap,
/// cannot be oriented so, or no longer fits.
pub(crate) fn relower_capped(graph: &Graph, target: &Target, l: &Lowered) -> Option<Lowered> {
    let cap = replication_cap_of(l)?;
    lower_capped_alone(&orient(graph, &l.swapped_operations()).ok()?, target, cap)
}

/// [`lower_feasible`] with no beam attempt at hand, for the table screen's steered finalists
/// (`screen.rs`): with `home_from` below usize::MAX, from the program lowered with the weights
/// of the products from that original operation on kept on home tiles (as the beam hands on a
/// program it switched to them), else from replicated weights.
pub(crate) fn lower_feasible_alone(oriented: &Oriented, target: &Target, home_from: usize) -> Result<(Lowered, bool), LowerError> {
    let first = if home_from < usize::MAX { Some((lower_homing_from(oriented, target, home_from, &[])?, home_from)) } else { None };
    lower_feasible(oriented, target, first, None, None, true, None, None).map(|(l, peaks, _)| (l, peaks.is_some()))
}

/// The latest original operation before `before` from which keeping the products' weights on
/// home tiles (the earlier products' weights replicated) covers the overflow of a program that
/// does not fit with the weights of the products before `before` replicated (the later ones
/// homed), or None when even every product but the first would not cover it (the arrangement
/// with every weight on home tiles is next anyway). The overflow per tile: the
/// peak live bytes (host-written buffers from the start) beyond tile memory beside the code
/// reserve, and on the tile placement failed on, at least the bytes of the buffer it could not
/// place (placement also loses room to regions and alignment). A homed weight of r replicas
/// keeps one: it saves (r - 1) / r of its replicas' bytes on each tile (on average: its home
/// tiles, which this does not know, save nothing; the one lowering of the mixed program
/// decides).
fn mixed_from(oriented: &Oriented, buffers: &[BufferDecl], tensors: &[LHostTensor], failure: &PlacementError, target: &Target, before: usize) -> Option<usize> {
    let graph = &oriented.graph;
    let tiles = target.chip.tiles;
    // Each replicable weight's first product (original operation index).
    let mut first_use: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for (i, weight) in (0..graph.operations.len()).filter_map(|i| Some((i, graph.matrix_weight_of(i)?))) {
        let origin = oriented.origin.get(i).map_or(i, |&o| o as usize);
        let e = first_use.entry(graph.value(weight).name.as_str()).or_insert(origin);
        *e = (*e).min(origin);
    }
    let mut host = vec![false; buffers.len()];
    // Per first product: (tile, bytes) of its weights' replicas.
    let mut saved: std::collections::BTreeMap<usize, Vec<(u32, u64)>> = std::collections::BTreeMap::new();
    for t in tensors {
        let mut ids: Vec<u32> = t.segments.iter().map(|s| s.buffer).collect();
        ids.sort_unstable();
        ids.dedup();
        for &b in &ids {
            host[b as usize] = true;
        }
        if let (HostRole::Weight, Some(&from)) = (t.role, first_use.get(t.name.as_str())) {
            // Homed, one of its r copies stays (on a tile this does not know): each replica's
            // tile saves (r - 1) / r of it on average.
            let (written, once) = (t.streamed_elements(), t.elements());
            saved.entry(from).or_default().extend(ids.iter().map(|&b| (buffers[b as usize].tile, buffers[b as usize].bytes as u64 * written.saturating_sub(once) / written.max(1))));
        }
    }
    let m = &target.memory;
    let capacity = ((m.loader_limit - m.base) as u64).saturating_sub(CODE_RESERVE_BYTES);
    let mut overflow = vec![0u64; tiles as usize];
    tile_peaks(buffers.iter(), &host, tiles, |tile, (_, _, total)| overflow[tile as usize] = total.saturating_sub(capacity));
    if let Some(o) = overflow.get_mut(failure.tile as usize) {
        *o = (*o).max(failure.bytes as u64);
    }
    debug!(before, tiles_over = overflow.iter().filter(|&&o| o > 0).count(), most = overflow.iter().max().copied().unwrap_or(0), "replicated weights' overflow");
    let earliest = *saved.keys().next()?;
    for (&from, replicas) in saved.range(..before).rev() {
        if from == earliest {
            break;
        }
        for &(tile, bytes) in replicas {
            overflow[tile as usize] = overflow[tile as usize].saturating_sub(bytes);
        }
        if overflow.iter().all(|&o| o == 0) {
            return Some(from);
        }
    }
    None
}

/// Whether placement put weights of a product planned with interleaved weights (buffers that
/// prefer interleaved memory) into standard memory.
fn weights_displaced(attempt: &Attempt, addresses: &[u32], target: &Target) -> bool {
    attempt.lowered.buffers.iter().enumerate().any(|(i, b)| {
        b.prefer_interleaved && b.kind == AllocationKind::Data && addresses[i] < target.memory.interleaved_start && attempt.interleaved_weights.contains(&attempt.owners[i])
    })
}

/// Whether every tile's buffers can be placed, by region, beside the code reserve.
pub fn fits(lowered: &Lowered, target: &Target) -> bool {
    let code = vec![CODE_RESERVE_BYTES as u32; lowered.tiles as usize];
    place_storage(target, lowered, &code).is_ok()
}

/// Per operation index: the most bytes on any tile that other operations keep live during
/// one of its steps, in total and in the buffers that claim interleaved memory first
/// (partials, and weights that prefer it). Per tile, the bytes live at each step (all
/// buffers, from differences at their first and past their last step) less those of the
/// operation's own buffers at the steps of its span: linear in the buffers and steps, where
/// summing the other operations' buffers at every step of every span was quadratic (an eighth
/// of a twelve-layer encoder's `lower_mid`).
pub fn reserves_of(attempt: &Attempt, operations: usize) -> Vec<Reserve> {
    let l = &attempt.lowered;
    let mut per_tile: Vec<Vec<usize>> = vec![Vec::new(); l.tiles as usize];
    for (i, b) in l.buffers.iter().enumerate() {
        per_tile[b.tile as usize].push(i);
    }
    // The spans, and where each operation's steps start in one flat list of (span, step).
    let spans: Vec<(u32, u32, u32)> = attempt.spans.iter().filter(|(_, &(s0, s1))| s0 <= s1).map(|(&op, &(s0, s1))| (op, s0, s1)).collect();
    let mut slot_of: Vec<Option<(usize, usize)>> = vec![None; operations.max(spans.iter().map(|s| s.0 as usize + 1).max().unwrap_or(0))];
    let mut slots = 0usize;
    for (k, &(op, s0, s1)) in spans.iter().enumerate() {
        slot_of[op as usize] = Some((k, slots));
        slots += (s1 - s0 + 1) as usize;
    }
    let steps = l.buffers.iter().map(|b| b.last_step as usize + 1).chain(spans.iter().map(|s| s.2 as usize + 1)).max().unwrap_or(0);
    let claims_interleaved = |b: &BufferDecl| b.kind == AllocationKind::Partials || b.prefer_interleaved;
    let per_span: Vec<Vec<Reserve>> = per_tile
        .par_iter()
        .map(|ids| {
            let mut live = vec![(0i64, 0i64); steps + 1];
            let mut own = vec![(0u64, 0u64); slots];
            for &i in ids {
                let b = &l.buffers[i];
                let (bytes, inter) = (b.bytes as i64, if claims_interleaved(b) { b.bytes as i64 } else { 0 });
                live[b.first_step as usize].0 += bytes;
                live[b.first_step as usize].1 += inter;
                live[b.last_step as usize + 1].0 -= bytes;
                live[b.last_step as usize + 1].1 -= inter;
                if let Some(Some((k, at))) = slot_of.get(attempt.owners[i] as usize) {
                    let (_, s0, s1) = spans[*k];
                    for step in b.first_step.max(s0)..=b.last_step.min(s1) {
                        let o = &mut own[at + (step - s0) as usize];
                        o.0 += bytes as u64;
                        o.1 += inter as u64;
                    }
                }
            }
            for step in 1..=steps {
                live[step].0 += live[step - 1].0;
                live[step].1 += live[step - 1].1;
            }
            spans
                .iter()
                .map(|&(op, s0, s1)| {
                    let at = slot_of[op as usize].expect("every span has its slots").1;
                    let mut r = Reserve::default();
                    for step in s0..=s1 {
                        let (o, (t, i)) = (own[at + (step - s0) as usize], live[step as usize]);
                        r.total = r.total.max(t as u64 - o.0);
                        r.interleaved = r.interleaved.max(i as u64 - o.1);
                    }
                    r
                })
                .collect()
        })
        .collect();
    let mut out = vec![Reserve::default(); operations];
    for (k, &(op, ..)) in spans.iter().enumerate() {
        let r = per_span.iter().fold(Reserve::default(), |r, tile| Reserve { total: r.total.max(tile[k].total), interleaved: r.interleaved.max(tile[k].interleaved) });
        out[op as usize] = r;
    }
    out
}

/// One line per program: each operation's value, orientation and partitions.
pub fn describe(l: &Lowered) -> String {
    l.plans
        .iter()
        .map(|p| {
            let [b, r, c, i] = p.partitions;
            if p.kind == "matmul" {
                format!("{}:{}[{b},{r},{c},{i}]{}", p.value, p.orientation, if p.weight_memory == "standard" { "/w-standard" } else { "" })
            } else {
                format!("{}:{}x{b}", p.value, p.kind)
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
pub(super) mod tests_support {
    use super::{peaks, Partial};

    /// `Partial::peaks` as swept over every buffer of the program.
    pub fn full_peaks(partial: &Partial, tiles: u32) -> (u64, u64, u64) {
        peaks(partial.buffers().iter(), &partial.host_flags(), tiles)
    }
}

#[cfg(test)]
mod tests {
    use super::super::build::lower_with;
    use super::*;
    use crate::target::{fixtures, Target};

    /// Workload text of `blocks` MLP blocks `y_i = gelu(x_i · w1_i) · w2_i`, each feeding the
    /// next, over `tokens` rows, dimension `dim` and hidden dimension `hidden`.
    fn mlp_text(blocks: usize, tokens: u32, dim: u32, hidden: u32) -> String {
        let mut text = format!("name = \"mlp\"\noutputs = [\"y_{}\"]\n[[tensor]]\nname = \"x\"\nshape = [{tokens}, {dim}]\ndtype = \"f16\"\nrole = \"input\"\ninit = \"zeros\"\n", blocks - 1);
        for b in 0..blocks {
            for (w, shape) in [("w1", format!("[{dim}, {hidden}]")), ("w2", format!("[{hidden}, {dim}]"))] {
                text += &format!("[[tensor]]\nname = \"{w}_{b}\"\nshape = {shape}\ndtype = \"f16\"\nrole = \"weight\"\ninit = \"zeros\"\n");
            }
            let input = if b == 0 { "x".to_string() } else { format!("y_{}", b - 1) };
            text += &format!("[[operation]]\nname = \"h_{b}\"\nop = \"matmul\"\ninputs = [\"{input}\", \"w1_{b}\"]\n[[operation]]\nname = \"g_{b}\"\nop = \"gelu\"\ninputs = [\"h_{b}\"]\n[[operation]]\nname = \"y_{b}\"\nop = \"matmul\"\ninputs = [\"g_{b}\", \"w2_{b}\"]\n");
        }
        text
    }

    /// `blocks` MLP blocks of 37 tokens, dimension 64 and hidden dimension 96.
    fn mlp(blocks: usize) -> Graph {
        Graph::parse(&mlp_text(blocks, 37, 64, 96), "mlp.toml").unwrap()
    }


    fn small16() -> Target {
        Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap()
    }

    /// A finished program shares the exchange phases of the lowering it was completed from
    /// (no transfer is copied while another program, a beam state, still holds that lowering),
    /// and a copy of a finished program (the table screen's sizing view, `select_finalist`'s
    /// prepared copy) shares them too: the copies the search and selection make of a program
    /// cost pointers, not its transfers.
    #[test]
    fn finished_programs_and_their_copies_share_phases_with_the_prefix() {
        let target = small16();
        let graph = mlp(2);
        let oriented = orient(&graph, &BTreeSet::new()).unwrap();
        let ops = oriented.graph.operations.len();
        let prefix = extend(Partial::new(false), &oriented, &target, &[], ops).unwrap();
        assert!(!prefix.phase_lists().is_empty());
        let held = prefix.clone();
        let lowered = complete(prefix, &oriented, &target, &[]).unwrap().lowered;
        assert!(lowered.phases.len() >= held.phase_lists().len());
        for (finished, kept) in lowered.phases.iter().zip(held.phase_lists()) {
            assert!(Arc::ptr_eq(finished, kept), "a finished program copied a phase its prefix holds");
        }
        let copy = lowered.clone();
        assert!(copy.phases.iter().zip(&lowered.phases).all(|(a, b)| Arc::ptr_eq(a, b)));
        assert!(copy.compute_sets.iter().zip(&lowered.compute_sets).all(|(a, b)| Arc::ptr_eq(a, b)));
        // The host pass adds phases of its own and leaves the program's shared.
        let prepared = crate::lower::host::replicate_every_input(lowered.clone(), &target);
        assert!(prepared.phases.iter().zip(&lowered.phases).all(|(a, b)| Arc::ptr_eq(a, b)));
    }

    /// The host pass gives repeated blocks' equal weights equal load-time replication phases
    /// (the same tiles, offsets in their buffers and words; only the buffers differ), so they
    /// share their schedules and table segments: a weight's homes are spread by its own phase's
    /// sends, not by the weights replicated before it.
    #[test]
    fn repeated_blocks_equal_weights_get_equal_replication_phases() {
        let target = small16();
        for blocks in [2, 3] {
            let graph = mlp(blocks);
            let oriented = orient(&graph, &BTreeSet::new()).unwrap();
            let ops = oriented.graph.operations.len();
            let prefix = extend(Partial::new(false), &oriented, &target, &[], ops).unwrap();
            let lowered = crate::lower::host::replicate(complete(prefix, &oriented, &target, &[]).unwrap().lowered, &target);
            // Each weight's phase as (source tile, offset in its buffer, words, destinations as
            // (tile, offset in its buffer)), by weight name.
            let relative = |phase: u32| -> Vec<(u32, u32, u32, Vec<(u32, u32)>)> {
                let at = |(buffer, offset): (u32, u32)| (lowered.buffers[buffer as usize].tile, offset);
                lowered.phases[phase as usize].iter().map(|t| (at(t.source).0, at(t.source).1, t.words, t.destinations.iter().map(|&d| at(d)).collect())).collect()
            };
            let weights: Vec<&LHostTensor> = lowered.inputs.iter().filter(|t| t.role == crate::package::HostRole::Weight).collect();
            assert_eq!(lowered.initialize.len(), weights.len(), "{blocks} blocks: every weight is replicated");
            let phases: std::collections::BTreeMap<&str, Vec<_>> = weights.iter().zip(&lowered.initialize).map(|(t, &p)| (t.name.as_str(), relative(p))).collect();
            for b in 1..blocks {
                for w in ["w1", "w2"] {
                    let (first, this) = (&phases[format!("{w}_0").as_str()], &phases[format!("{w}_{b}").as_str()]);
                    assert!(!first.is_empty());
                    assert_eq!(first, this, "{blocks} blocks: {w}_{b}'s replication differs from {w}_0's");
                }
            }
        }
    }

    /// `blocks` MLP blocks of 64 tokens, dimension 256 and hidden dimension 768, each product
    /// held normal at four row partitions (`[[constraint]]`), so that on 16 tiles a replicated
    /// weight takes a quarter of itself (96 KiB) on every tile.
    fn row_partitioned_mlp(blocks: usize) -> Graph {
        Graph::parse(&row_partitioned_text(blocks), "mlp.toml").unwrap()
    }

    /// `weights = "home"` on a product: the beam starts from the mixed program homing that
    /// product's weights and the later ones, so the earlier blocks' weights stay replicated and
    /// the later (normal) products' are written once (to their home tiles); without it the
    /// small program keeps every weight replicated. An edit of the constraint resumes no beam
    /// step.
    #[test]
    fn a_home_weights_constraint_starts_the_beam_from_a_mixed_program() {
        let target = small16();
        let text = mlp_text(3, 37, 64, 96);
        let free = Graph::parse(&text, "mlp.toml").unwrap();
        // Normal products (a swapped product streams its weight as its A operand, replicated).
        let normal: String = ["y_1", "h_2", "y_2"].iter().map(|p| format!("[[constraint]]\noperation = \"{p}\"\norientation = \"normal\"\n")).collect();
        let homed = Graph::parse(&format!("{text}[[constraint]]\noperation = \"h_1\"\norientation = \"normal\"\nweights = \"home\"\n{normal}"), "mlp.toml").unwrap();
        let replicas = |l: &Lowered, name: &str| {
            let t = l.inputs.iter().find(|t| t.name == name).unwrap();
            t.streamed_elements() / t.elements()
        };
        let best = &finalists(&free, &target, 1).unwrap()[0];
        assert!(["w1_0", "w2_0", "w1_1", "w2_1", "w1_2", "w2_2"].iter().all(|w| replicas(best, w) > 1), "the free program replicates every weight");
        let best = &finalists(&homed, &target, 1).unwrap()[0];
        assert!(replicas(best, "w1_0") > 1 && replicas(best, "w2_0") > 1, "block 0 keeps its weights replicated");
        for w in ["w1_1", "w2_1", "w1_2", "w2_2"] {
            assert_eq!(replicas(best, w), 1, "{w} is kept once, on its home tiles");
        }
        let (_, trace) = finalists_resuming(&free, &target, 4, None);
        assert_eq!(identical_steps(&free, &trace, &homed, 4, &swappable(&homed), &BTreeSet::new(), &BTreeSet::new(), (true, true)), 0);
        assert_eq!(identical_steps(&free, &trace, &free, 4, &swappable(&free), &BTreeSet::new(), &BTreeSet::new(), (true, true)), trace.steps.len());
    }

    /// A weights constraint whose mixed program does not fit is given up no further than tile
    /// memory requires: the feasibility step tries the constrained program, then the latest
    /// earlier starts that cover its overflow, before the beam's own arrangement (every weight
    /// on home tiles, as without the constraint), and the given-up constraint is named.
    #[test]
    fn a_home_weights_constraint_that_does_not_fit_is_given_up_no_further_than_memory_requires() {
        let target = small16();
        let text = row_partitioned_text(4);
        let h2 = "operation = \"h_2\"\norientation = \"normal\"\nrow_partitions = 4\n";
        assert!(text.contains(h2));
        let graph = Graph::parse(&text.replace(h2, &format!("{h2}weights = \"home\"\n")), "mlp.toml").unwrap();
        let replicas = |l: &Lowered, name: &str| {
            let t = l.inputs.iter().find(|t| t.name == name).unwrap();
            t.streamed_elements() / t.elements()
        };
        let free = &finalists(&row_partitioned_mlp(4), &target, 1).unwrap()[0];
        assert_eq!(replicas(free, "w1_0"), 1, "without the constraint every weight is on home tiles");
        let best = &finalists(&graph, &target, 1).unwrap()[0];
        assert!(replicas(best, "w1_0") > 1 && replicas(best, "w2_0") > 1, "block 0 keeps its weights replicated");
        for w in ["w1_1", "w2_1", "w1_2", "w2_2", "w1_3", "w2_3"] {
            assert_eq!(replicas(best, w), 1, "{w} is kept once, on its home tiles");
        }
        assert_eq!(given_up_home_constraint(&graph, 3), Some(("h_2".to_string(), "h_1".to_string())));
        // Named by the first product whose weights are homed (h_1 from operation 2, y_0).
        assert_eq!(given_up_home_constraint(&graph, 0), Some(("h_2".to_string(), "h_0".to_string())));
        assert_eq!(given_up_home_constraint(&graph, 1), Some(("h_2".to_string(), "y_0".to_string())));
        assert_eq!(given_up_home_constraint(&graph, 6), None);
        assert_eq!(given_up_home_constraint(&row_partitioned_mlp(4), 0), None);
    }

    /// A mixed program made from the beam's replicated prefixes (`Snapshot::longest`, then
    /// `home_later`) is the program lowered with those weights homed from the start, for every
    /// start and over orientations whose later products differ from the prefixes'.
    #[test]
    fn mixed_programs_from_snapshots_equal_whole_lowerings() {
        let (graph, target) = (mlp(3), small16());
        let products = swappable(&graph);
        // A replicated lineage over the all-normal orientation, snapshotted at every product.
        let normal = Arc::new(orient(&graph, &BTreeSet::new()).unwrap());
        let mut history: Option<Arc<Snapshot>> = None;
        let mut partial = Partial::new(false);
        for &p in &products {
            let end = end_before(&normal, Some(p));
            partial = extend(partial, &normal, &target, &[], end).unwrap();
            history = Some(Arc::new(Snapshot { oriented: normal.clone(), partial: partial.clone(), earlier: history }));
        }
        let history = history.unwrap();
        let mut extended = 0;
        for swapped_from in [products.len(), products.len() - 1, 1] {
            let swapped: BTreeSet<usize> = products[swapped_from..].iter().copied().collect();
            let oriented = orient(&graph, &swapped).unwrap();
            for &from in &products[1..] {
                let cut = end_before(&oriented, Some(from));
                let expected = lower_homing_from(&oriented, &target, from, &[]).unwrap().lowered;
                let Some(prefix) = history.longest(&oriented, cut) else { continue };
                assert!(prefix.partial.lowered_operations() <= cut);
                let reserves = vec![Reserve::default(); oriented.graph.operations.len()];
                let p = extend(prefix.partial.clone().home_later(from), &oriented, &target, &reserves, oriented.graph.operations.len()).unwrap();
                assert_eq!(complete(p, &oriented, &target, &reserves).unwrap().lowered, expected, "swapped from {swapped_from}, homed from {from}");
                extended += (prefix.partial.lowered_operations() > 0) as usize;
            }
        }
        assert!(extended >= products.len() - 1, "prefixes extended: {extended}");
    }

    /// `reserves_of` as it summed, at every step of every operation's span, the other
    /// operations' live buffers on every tile.
    fn reserves_swept(attempt: &Attempt, operations: usize) -> Vec<Reserve> {
        let l = &attempt.lowered;
        let mut out = vec![Reserve::default(); operations];
        for (&op, &(s0, s1)) in &attempt.spans {
            let mut r = Reserve::default();
            for tile in 0..l.tiles {
                for step in s0..=s1 {
                    let live = l.buffers.iter().enumerate().filter(|(i, b)| b.tile == tile && attempt.owners[*i] != op && b.first_step <= step && step <= b.last_step);
                    let (total, interleaved) = live.fold((0u64, 0u64), |(t, i), (_, b)| (t + b.bytes as u64, i + if b.kind == AllocationKind::Partials || b.prefer_interleaved { b.bytes as u64 } else { 0 }));
                    r.total = r.total.max(total);
                    r.interleaved = r.interleaved.max(interleaved);
                }
            }
            out[op as usize] = r;
        }
        out
    }

    /// The reserves from live bytes per step less each operation's own are the sums over the
    /// other operations' buffers, on MLPs and an encoder layer, replicated and home-tile
    /// weights, with and without reserves of their own.
    #[test]
    fn reserves_from_live_bytes_equal_the_swept_sums() {
        let target = small16();
        let encoder = include_str!("../../../fixtures/workloads/siglip-encoder-f16-b1-t29-d64-h4-m96-l3.toml");
        let graphs = [mlp(1), mlp(3), Graph::parse(&mlp_text(2, 128, 256, 1024), "mlp.toml").unwrap(), Graph::parse(encoder, "encoder.toml").unwrap()];
        for graph in &graphs {
            let oriented = orient(graph, &BTreeSet::new()).unwrap();
            let operations = graph.operations.len();
            for home in [false, true] {
                let attempt = lower_with(&oriented, &target, home, &vec![Reserve::default(); operations]).unwrap();
                let reserves = reserves_of(&attempt, operations);
                assert_eq!(reserves, reserves_swept(&attempt, operations), "{} home {home}", graph.name);
                assert!(reserves.iter().any(|r| r.total > 0));
                let again = lower_with(&oriented, &target, home, &reserves).unwrap();
                assert_eq!(reserves_of(&again, operations), reserves_swept(&again, operations), "{} home {home}, reserved", graph.name);
            }
        }
    }

    /// A workload whose host tensors, one copy of each, exceed every tile's memory beside the
    /// runtime header is refused before the search, with the bytes; one that does not exceed it
    /// is left to the search (which may still find it does not fit).
    #[test]
    fn host_bytes_beyond_every_tile_are_refused_before_the_search() {
        let target = small16();
        let m = &target.memory;
        let room = (m.loader_limit - m.base - crate::emit::RUNTIME_HEADER_BYTES) as u64 * 16;
        // x [16, 1024] and two weights of 1024 x hidden, f16.
        let bytes = |hidden: u64| 16 * 1024 * 2 + 2 * 1024 * hidden * 2;
        let (under, over) = (2480, 2490);
        assert!(bytes(under) <= room && bytes(over) > room);
        assert_eq!(host_bytes_beyond_tiles(&Graph::parse(&mlp_text(1, 16, 1024, under as u32), "mlp.toml").unwrap(), &target), None);
        let big = Graph::parse(&mlp_text(1, 16, 1024, over as u32), "mlp.toml").unwrap();
        let e = finalists(&big, &target, DEFAULT_FINALISTS).expect_err("no program holds the weights");
        // The previous build's trace is handed back for the next build, not replaced.
        let (_, previous) = finalists_warming(&Graph::parse(&mlp_text(1, 16, 64, 96), "mlp.toml").unwrap(), &target, DEFAULT_FINALISTS, None, None);
        assert!(!previous.steps.is_empty());
        let (refused, trace, _) = finalists_keeping(&big, &target, DEFAULT_FINALISTS, Some(&previous), None, None, false);
        assert_eq!((refused.as_ref().err(), &trace), (Some(&e), &previous));
        let per_tile = (room / 16) as u32;
        let header = crate::emit::RUNTIME_HEADER_BYTES;
        assert_eq!(e, LowerError::HostBytes { host: bytes(over), largest: "w1_0".into(), largest_bytes: 1024 * over * 2, tiles: 16, per_tile, base: m.base, limit: m.loader_limit, header, room, short: bytes(over) - room });
        let expected = format!(
            "the host writes {} bytes of weights and inputs before the run (one copy of each; the largest, 'w1_0', {} bytes), but every one of the 16 tiles holds at most {per_tile} bytes of them, in the memory the loader writes ({:#x} to {:#x}) less its {header}-byte runtime header: {room} bytes on the chip, {} bytes too few",
            bytes(over),
            1024 * over * 2,
            m.base,
            m.loader_limit,
            bytes(over) - room
        );
        assert!(e.to_string().starts_with(&expected), "{e}");
    }

    /// A re-plan made only to beat a program `select_finalist` already holds takes the
    /// finalists the whole search takes where one fits at the planner's partitions, and none
    /// where only the last resort (smaller operand blocks) would make one fit: a one-block MLP
    /// of 882 rows, 306 wide, hidden 702 on small16, whose blocks fill a region of a tile.
    #[test]
    fn a_replan_to_beat_a_held_program_skips_the_last_resort() {
        let target = small16();
        let fits = mlp(2);
        assert_eq!(finalists_that_fit(&fits, &target, DEFAULT_FINALISTS).unwrap(), Some(finalists(&fits, &target, DEFAULT_FINALISTS).unwrap()));
        let full = Graph::parse(&mlp_text(1, 882, 306, 702), "mlp.toml").unwrap();
        let rescued = finalists(&full, &target, DEFAULT_FINALISTS).unwrap();
        assert!(!rescued.is_empty());
        let placed = place_storage(&target, &rescued[0], &vec![CODE_RESERVE_BYTES as u32; rescued[0].tiles as usize]);
        assert!(placed.is_ok(), "the last resort's program fits: {:?}", placed.err());
        assert_eq!(finalists_that_fit(&full, &target, DEFAULT_FINALISTS).unwrap(), None);
    }

    /// Programs far over tile memory are made feasible only when no nearer one fits, and
    /// skipping them leaves the finalists as making every program feasible gives them: over
    /// MLPs whose beams end with programs at 2.5-3.1x tile memory beside ones that fit.
    #[test]
    fn far_programs_are_skipped_only_when_a_nearer_one_fits() {
        let target = small16();
        let mut skipped = 0;
        for (blocks, tokens, dim, hidden) in [(3, 128, 256, 1024), (4, 64, 384, 1152), (2, 64, 256, 768)] {
            let graph = Graph::parse(&mlp_text(blocks, tokens, dim, hidden), "mlp.toml").unwrap();
            let (a, b) = (beam(&graph, &target, DEFAULT_FINALISTS, None), beam(&graph, &target, DEFAULT_FINALISTS, None));
            let (with, n, _) = feasible_finalists(&graph, &target, DEFAULT_FINALISTS, a.programs, &a.far, true, &a.histories, a.first_error, None, None, true);
            let (without, none, _) = feasible_finalists(&graph, &target, DEFAULT_FINALISTS, b.programs, &b.far, false, &b.histories, b.first_error, None, None, true);
            assert_eq!(none, 0);
            assert_eq!(n, a.far.iter().filter(|&&f| f).count(), "{blocks} blocks of {tokens}x{dim}x{hidden}: a near program fits");
            assert_eq!(with.unwrap(), without.unwrap(), "{blocks} blocks of {tokens}x{dim}x{hidden}");
            skipped += n;
        }
        // The first two MLPs have far programs (the third none).
        assert!(skipped >= 2, "far programs skipped: {skipped}");
        // With every program far over tile memory, every one is made feasible (none nearer fits).
        let graph = Graph::parse(&mlp_text(4, 128, 512, 1536), "mlp.toml").unwrap();
        let run = beam(&graph, &target, DEFAULT_FINALISTS, None);
        assert!(!run.far.is_empty() && run.far.iter().all(|&f| f));
        assert_eq!(feasible_finalists(&graph, &target, DEFAULT_FINALISTS, run.programs, &run.far, true, &run.histories, run.first_error, None, None, true).1, 0);
    }

    /// A prefix lowered over one orientation and extended over another (later products
    /// swapped) is exactly the program lowered at once, with replicated or home-tile weights:
    /// the beam's programs are real ones, and a home-weights prefix the beam carries extends
    /// to the program a switch to home-tile weights would lower from the start.
    #[test]
    fn extended_prefixes_equal_whole_lowerings() {
        let (graph, target) = (mlp(2), small16());
        let products = swappable(&graph);
        assert_eq!(products.len(), 4);
        for home in [false, true] {
            for split in 0..products.len() {
                let swapped: BTreeSet<usize> = products[split..].iter().copied().collect();
                let whole = orient(&graph, &swapped).unwrap();
                let expected = lower_with(&whole, &target, home, &[]).unwrap().lowered;
                let prefix = orient_until(&graph, &BTreeSet::new(), products[split]).unwrap();
                let end = prefix.origin.partition_point(|&o| (o as usize) < products[split]);
                let partial = extend(Partial::new(home), &prefix, &target, &[], end).unwrap();
                assert!(prefix_compatible(&prefix, &whole, partial.lowered_operations()), "split {split}");
                let memo = HomePrefix { oriented: Arc::new(prefix), partial };
                let partial = if home { home_lowering(Some(&memo), &whole, &target, whole.graph.operations.len()).unwrap() } else { extend(memo.partial, &whole, &target, &[], whole.graph.operations.len()).unwrap() };
                assert_eq!(complete(partial, &whole, &target, &[]).unwrap().lowered, expected, "home {home} split {split}");
            }
        }
        // A prefix lowered over a sibling orientation (this product swapped) up to the product,
        // extended over this one (the product normal, later ones swapped), as the beam's pool
        // hands on: the program lowered at once. The pool picks the longest compatible prefix.
        for home in [false, true] {
            for split in 0..products.len() {
                let sibling = orient(&graph, &products[split..].iter().copied().collect()).unwrap();
                let this = orient(&graph, &products[split + 1..].iter().copied().collect()).unwrap();
                let cut = sibling.origin.partition_point(|&o| (o as usize) < products[split]);
                assert!(prefix_compatible(&sibling, &this, cut), "split {split}");
                let memos: Vec<Arc<HomePrefix>> = [0, cut]
                    .into_iter()
                    .map(|end| Arc::new(HomePrefix { partial: extend(Partial::new(home), &sibling, &target, &[], end).unwrap(), oriented: Arc::new(orient(&graph, &products[split..].iter().copied().collect()).unwrap()) }))
                    .collect();
                let memo = longest_compatible(&memos, &this, this.graph.operations.len()).unwrap();
                assert_eq!(memo.partial.lowered_operations(), cut);
                let partial = extend(memo.partial.clone(), &this, &target, &[], this.graph.operations.len()).unwrap();
                let expected = lower_with(&this, &target, home, &[]).unwrap().lowered;
                assert_eq!(complete(partial, &this, &target, &[]).unwrap().lowered, expected, "home {home} split {split}");
            }
        }
        // A prefix whose consumer would be oriented differently is not reused.
        let normal = orient(&graph, &BTreeSet::new()).unwrap();
        let all: BTreeSet<usize> = products.iter().copied().collect();
        let swapped = orient(&graph, &all).unwrap();
        assert!(!prefix_compatible(&normal, &swapped, normal.graph.operations.len()));
    }

    /// Home tiles follow the weights' period: the same weight of every repeated block is homed
    /// on the same tiles, so the blocks' phases repeat one pattern; rotating homes (the
    /// fallback when those do not fit) give each block its own.
    #[test]
    fn aligned_homes_repeat_the_blocks_patterns() {
        let (graph, target) = (mlp(3), small16());
        let oriented = orient(&graph, &BTreeSet::new()).unwrap();
        let slot = |name: &str| super::super::build::aligned_home_slot(&graph, graph.find(name).unwrap());
        assert_eq!([slot("w1_0"), slot("w2_0"), slot("w1_1"), slot("w2_1"), slot("w1_2"), slot("w2_2")], [Some(0), Some(1), Some(0), Some(1), Some(0), Some(1)]);
        assert_eq!(slot("x"), None);
        assert_eq!(super::super::build::aligned_home_slot(&mlp(1), mlp(1).find("w2_0").unwrap()), Some(1));
        // Each phase as its (source tile, words, destination tiles), in order.
        let patterns = |l: &Lowered| -> Vec<Vec<(u32, u32, Vec<u32>)>> {
            let tile = |b: u32| l.buffers[b as usize].tile;
            l.phases.iter().map(|p| p.iter().map(|t| (tile(t.source.0), t.words, t.destinations.iter().map(|d| tile(d.0)).collect())).collect()).collect()
        };
        let distinct = |l: &Lowered| patterns(l).into_iter().collect::<std::collections::BTreeSet<_>>().len();
        let aligned = lower_with(&oriented, &target, true, &[]).unwrap().lowered;
        let rotated = super::super::build::lower_with_rotated_homes(&oriented, &target, &[]).unwrap().lowered;
        assert_eq!(aligned.phases.len(), rotated.phases.len());
        assert!(distinct(&aligned) < distinct(&rotated), "aligned {} rotated {}", distinct(&aligned), distinct(&rotated));
    }

    /// Homes rotating with the period's repeats (tried between aligned and rotated ones in a
    /// program of repeated blocks): a block of the r-th repeat sits r row partitions on from
    /// the first repeat's, so the homed bytes spread over the row partitions as aligned homes'
    /// do not, while repeats a whole number of row partitions apart still multicast from the
    /// same tiles and share their patterns, as rotating with every weight does not. (Twelve
    /// full-size encoder layers: exchange tables 54.2 MB against 102.3 MB, thirteen fit.)
    #[test]
    fn period_homes_spread_the_repeats_and_share_patterns_a_row_period_apart() {
        use super::super::build::{period_home_slot, weights_repeat};
        let target = small16();
        let slot = |g: &Graph, name: &str| period_home_slot(g, g.find(name).unwrap());
        let graph = mlp(8);
        assert_eq!([slot(&graph, "w1_0"), slot(&graph, "w2_0"), slot(&graph, "w1_3"), slot(&graph, "w2_7")], [Some((0, 0, 8)), Some((1, 0, 8)), Some((0, 3, 8)), Some((1, 7, 8))]);
        assert_eq!(slot(&graph, "x"), None);
        assert!(weights_repeat(&graph) && weights_repeat(&mlp(2)) && !weights_repeat(&mlp(1)));
        let oriented = orient(&graph, &BTreeSet::new()).unwrap();
        let aligned = lower_with(&oriented, &target, true, &[]).unwrap().lowered;
        let period = super::super::build::lower_with_period_homes(&oriented, &target, &[]).unwrap().lowered;
        let rotated = super::super::build::lower_with_rotated_homes(&oriented, &target, &[]).unwrap().lowered;
        // Homed bytes on the fullest tile.
        let fullest = |l: &Lowered| {
            let mut load = vec![0u64; l.tiles as usize];
            for t in l.inputs.iter().filter(|t| t.role == HostRole::Weight) {
                assert_eq!(t.streamed_elements(), t.elements(), "{} is homed once", t.name);
                for b in t.segments.iter().map(|s| s.buffer).collect::<BTreeSet<u32>>() {
                    load[l.buffers[b as usize].tile as usize] += l.buffers[b as usize].bytes as u64;
                }
            }
            load.into_iter().max().unwrap()
        };
        let patterns = |l: &Lowered| -> Vec<Vec<(u32, u32, Vec<u32>)>> {
            let tile = |b: u32| l.buffers[b as usize].tile;
            l.phases.iter().map(|p| p.iter().map(|t| (tile(t.source.0), t.words, t.destinations.iter().map(|d| tile(d.0)).collect())).collect()).collect()
        };
        let distinct = |l: &Lowered| patterns(l).into_iter().collect::<BTreeSet<_>>().len();
        assert_eq!(period.phases.len(), aligned.phases.len());
        assert!(fullest(&period) < fullest(&aligned), "period {} aligned {}", fullest(&period), fullest(&aligned));
        assert!(distinct(&period) < distinct(&rotated), "period {} rotated {}", distinct(&period), distinct(&rotated));
        assert!(distinct(&period) > distinct(&aligned), "period {} aligned {}", distinct(&period), distinct(&aligned));
        // Block j's two phases (after the input's at step 0; the last block's second product
        // writes the output in place) repeat block j + rows', rows being a row period.
        let all = patterns(&period);
        let blocks: Vec<&[Vec<(u32, u32, Vec<u32>)>]> = all[1..].chunks(2).filter(|c| c.len() == 2).collect();
        assert_eq!(blocks.len(), 7);
        let rows = (1..blocks.len()).find(|&r| blocks[0] == blocks[r]).expect("a later block shares block 0's patterns");
        for j in 0..blocks.len() - rows {
            assert_eq!(blocks[j], blocks[j + rows], "blocks {j} and {}", j + rows);
        }
        assert!(rows > 1, "every block homed alike");
    }

    /// Rotating homes (the fallback where aligned ones do not fit) put each weight block on
    /// the least-loaded tile of its row partitions (the tiles it is multicast to), the blocks
    /// taken in program order: replayed here, each block's home held no more homed bytes then
    /// than any other tile of its group. (Rotation alone put 15 blocks on the fullest tile of
    /// eleven full-size encoder layers, where the mean was 8.6, and they did not fit.)
    #[test]
    fn rotating_homes_put_each_weight_block_on_the_least_loaded_tile() {
        let target = small16();
        let graph = Graph::parse(&mlp_text(5, 64, 96, 160), "mlp.toml").unwrap();
        let oriented = orient(&graph, &BTreeSet::new()).unwrap();
        let rotated = super::super::build::lower_with_rotated_homes(&oriented, &target, &[]).unwrap().lowered;
        let tile = |b: u32| rotated.buffers[b as usize].tile;
        // Each homed block's group: its home and the tiles it is multicast to.
        let mut groups: std::collections::BTreeMap<u32, BTreeSet<u32>> = std::collections::BTreeMap::new();
        let weights: Vec<&LHostTensor> = rotated.inputs.iter().filter(|t| t.role == HostRole::Weight).collect();
        assert_eq!(weights.len(), 10);
        for t in &weights {
            assert_eq!(t.streamed_elements(), t.elements(), "{} is homed once", t.name);
            for s in &t.segments {
                groups.entry(s.buffer).or_insert_with(|| [tile(s.buffer)].into_iter().collect());
            }
        }
        for phase in &rotated.phases {
            for x in phase.iter() {
                if let Some(group) = groups.get_mut(&x.source.0) {
                    group.extend(x.destinations.iter().map(|d| tile(d.0)));
                }
            }
        }
        let mut load = vec![0u64; rotated.tiles as usize];
        let mut chose = 0;
        for t in &weights {
            let blocks: BTreeSet<u32> = t.segments.iter().map(|s| s.buffer).collect();
            for b in blocks {
                let group = &groups[&b];
                let least = group.iter().map(|&g| load[g as usize]).min().unwrap();
                assert_eq!(load[tile(b) as usize], least, "{}: block {b} on tile {} of {group:?}, loads {load:?}", t.name, tile(b));
                chose += usize::from(group.len() > 1);
                load[tile(b) as usize] += rotated.buffers[b as usize].bytes as u64;
            }
        }
        assert!(chose > 0);
    }

    /// The per-tile peaks (bucketed by step) are those of the live bytes step by step, counted
    /// plainly: buffers live from their first step to their last (host-written ones, and ones
    /// never written, from step 0), in standard or interleaved memory by kind.
    #[test]
    fn tile_peaks_are_the_stepwise_live_bytes_peaks() {
        let mut rng = crate::exchange::synthetic::SplitMix64(0x9e37_79b9_7f4a_7c15);
        let mut next = |n: u64| rng.below(n as u32) as u64;
        for round in 0..40 {
            let tiles = 1 + next(6) as u32;
            let buffers: Vec<BufferDecl> = (0..next(60))
                .map(|_| {
                    let first = if next(8) == 0 { u32::MAX } else { next(30) as u32 };
                    let last = if first == u32::MAX { next(30) as u32 } else { first + next(10) as u32 };
                    let kind = if next(4) == 0 { AllocationKind::Partials } else { AllocationKind::Data };
                    // Tiles past the chip are not counted.
                    BufferDecl { tile: next(tiles as u64 + 1) as u32, bytes: 8 * next(100) as u32, kind, prefer_interleaved: next(3) == 0, label: 0, first_step: first, last_step: last }
                })
                .collect();
            let host: Vec<bool> = buffers.iter().map(|_| next(5) == 0).collect();
            let mut expected = vec![(0u64, 0u64, 0u64); tiles as usize];
            for step in 0..64u32 {
                let mut live = vec![(0u64, 0u64); tiles as usize];
                for (i, b) in buffers.iter().enumerate().filter(|(_, b)| b.tile < tiles) {
                    let first = if host[i] || b.first_step == u32::MAX { 0 } else { b.first_step };
                    let last = b.last_step.max(if b.first_step == u32::MAX { 0 } else { b.first_step });
                    if first <= step && step <= last {
                        let l = &mut live[b.tile as usize];
                        if b.kind == AllocationKind::Partials || b.prefer_interleaved {
                            l.1 += b.bytes as u64;
                        } else {
                            l.0 += b.bytes as u64;
                        }
                    }
                }
                for (e, (s, i)) in expected.iter_mut().zip(live) {
                    *e = (e.0.max(s), e.1.max(i), e.2.max(s + i));
                }
            }
            let mut got = vec![(0u64, 0u64, 0u64); tiles as usize];
            tile_peaks(buffers.iter(), &host, tiles, |t, p| got[t as usize] = p);
            assert_eq!(got, expected, "round {round}");
        }
    }

    /// Four scored states, told apart by how many products they swap (0 to 3): the second
    /// dominates the third, and the fourth does not fit.
    fn four_scored_states() -> Vec<(State, [u64; 5], bool)> {
        let graph = mlp(1);
        let state = |n: usize| State { swapped: (0..n).collect(), oriented: Arc::new(orient(&graph, &BTreeSet::new()).unwrap()), partial: Partial::new(false), home: None, history: None };
        vec![
            (state(0), [100, 10, 5, 5, 10], true),
            (state(1), [90, 20, 5, 5, 10], true),
            (state(2), [95, 20, 6, 5, 11], true),
            (state(3), [50, 1, 1, 1, 2], false),
        ]
    }

    /// Pareto retention keeps what fits first, then the non-dominated extensions by estimate,
    /// then the dominated ones, up to the width.
    #[test]
    fn retention_is_pareto_then_estimate() {
        let scored = four_scored_states();
        let kept: Vec<usize> = retain(scored.clone(), 4, |_| true).iter().map(|s| s.swapped.len()).collect();
        assert_eq!(kept, vec![1, 0, 2, 3]);
        let kept: Vec<usize> = retain(scored, 2, |_| true).iter().map(|s| s.swapped.len()).collect();
        assert_eq!(kept, vec![1, 0]);
    }

    /// Where none of the states within the width is completable, retention keeps the first
    /// dropped one that is as well; where one within the width is, or none is at all, the
    /// width holds.
    #[test]
    fn retention_keeps_a_completable_state_beyond_the_width() {
        let scored = four_scored_states();
        let kept = |width: usize, completable: &dyn Fn(usize) -> bool| -> Vec<usize> { retain(scored.clone(), width, |s| completable(s.swapped.len())).iter().map(|s| s.swapped.len()).collect() };
        assert_eq!(kept(1, &|n| n == 0), vec![1, 0]);
        assert_eq!(kept(1, &|n| n == 3), vec![1, 3]);
        assert_eq!(kept(2, &|n| n == 0), vec![1, 0]);
        assert_eq!(kept(2, &|n| n == 2), vec![1, 0, 2]);
        assert_eq!(kept(1, &|_| false), vec![1]);
        assert_eq!(kept(4, &|_| false), vec![1, 0, 2, 3]);
    }

    /// The beam's finalists are no worse than any orientation's program: on two blocks, the
    /// best estimate among every suffix orientation lowered whole is the first finalist's.
    #[test]
    fn beam_finds_the_best_suffix_orientation() {
        let (graph, target) = (mlp(2), small16());
        let products = swappable(&graph);
        let best = (0..=products.len())
            .filter_map(|start| {
                let swapped: BTreeSet<usize> = products[start..].iter().copied().collect();
                let o = orient(&graph, &swapped).ok()?;
                lower_feasible(&o, &target, None, None, None, true, None, None).ok().filter(|r| r.1.is_some()).map(|r| estimated_cycles(&r.0))
            })
            .min()
            .unwrap();
        let found = finalists(&graph, &target, DEFAULT_FINALISTS).unwrap();
        assert!(found.len() <= DEFAULT_FINALISTS);
        assert!(estimated_cycles(&found[0]) <= best, "{} > {best}", estimated_cycles(&found[0]));
    }

    /// An MLP text with block `block`'s GELU made a scale (factor 0.5).
    fn edited(text: &str, block: usize) -> Graph {
        let from = format!("name = \"g_{block}\"\nop = \"gelu\"\n");
        assert!(text.contains(&from));
        Graph::parse(&text.replacen(&from, &format!("name = \"g_{block}\"\nop = \"scale\"\nfactor = 0.5\n"), 1), "mlp.toml").unwrap()
    }

    /// The text of `row_partitioned_mlp`.
    fn row_partitioned_text(blocks: usize) -> String {
        let mut text = mlp_text(blocks, 64, 256, 768);
        for b in 0..blocks {
            for p in ["h", "y"] {
                text += &format!("[[constraint]]\noperation = \"{p}_{b}\"\norientation = \"normal\"\nrow_partitions = 4\n");
            }
        }
        text
    }

    /// Each beam program's lowering and home start, in beam order.
    fn programs_of(b: &Beam) -> Vec<(Lowered, usize)> {
        b.programs.iter().map(|(_, a, _)| a.as_ref().map(|(a, h)| (a.lowered.clone(), *h)).expect("a beam program")).collect()
    }

    /// A beam resumed from an earlier build's trace ends with the programs (and finalists) of
    /// a beam from the start, and resumes as far as the edit allows: after an edit in the last
    /// block, every product step before the block's; after one in the first block, none; from
    /// an unrelated workload's trace, none. Over replicated weights (the small MLP) and over
    /// mixed and home-tile weights (the row-partitioned one).
    #[test]
    fn a_resumed_beam_equals_the_beam_from_the_start() {
        let target = small16();
        for (name, text) in [("small", mlp_text(4, 37, 64, 96)), ("row-partitioned", row_partitioned_text(4))] {
            let a = Graph::parse(&text, "mlp.toml").unwrap();
            let width = DEFAULT_FINALISTS;
            let (found_a, trace) = finalists_resuming(&a, &target, width, None);
            found_a.unwrap();
            assert_eq!(trace.steps.len(), swappable(&a).len() + 1, "{name}");
            let products = swappable(&a).len();
            // An unrelated workload (another hidden size): its trace resumes no product step.
            let other = Graph::parse(&mlp_text(4, 37, 64, 128), "other.toml").unwrap();
            let (_, other_trace) = finalists_resuming(&other, &target, width, None);
            for (block, resumed, previous) in [(3, products - 2, &trace), (0, 0, &trace), (3, 0, &other_trace)] {
                let b = edited(&text, block);
                let cold = beam(&b, &target, width, None);
                let warm = beam(&b, &target, width, Some((&Graph::parse(&previous.workload, "t").unwrap(), previous)));
                assert_eq!((warm.resumed, warm.searched), (resumed, products - resumed), "{name} block {block}");
                assert_eq!(cold.resumed, 0);
                assert_eq!(programs_of(&warm), programs_of(&cold), "{name} block {block}");
                assert_eq!(warm.steps, cold.steps, "{name} block {block}: the traces");
                let (found, _) = finalists_resuming(&b, &target, width, Some(previous));
                assert_eq!(found.unwrap(), finalists(&b, &target, width).unwrap(), "{name} block {block}");
            }
        }
    }

    /// A beam resumed from the states the previous build kept (`KeptBeam`, as `ipuq watch`
    /// keeps them) takes them instead of lowering them again and ends with the programs, trace
    /// and finalists of a beam from the start; it keeps its own states (those of the repeated
    /// steps taken over), from which a second edit resumes alike. Over replicated weights and
    /// over mixed and home-tile weights.
    #[test]
    fn a_beam_resumed_from_kept_states_equals_the_beam_from_the_start() {
        let target = small16();
        let width = DEFAULT_FINALISTS;
        let edit = |text: &str, block: usize| text.replacen(&format!("name = \"g_{block}\"\nop = \"gelu\"\n"), &format!("name = \"g_{block}\"\nop = \"scale\"\nfactor = 0.5\n"), 1);
        for (name, text) in [("small", mlp_text(4, 37, 64, 96)), ("row-partitioned", row_partitioned_text(4))] {
            let products = swappable(&Graph::parse(&text, "mlp.toml").unwrap()).len();
            let mut previous: Option<(Graph, BeamTrace, KeptBeam)> = None;
            let mut current = text.clone();
            for (round, block) in [None, Some(3), Some(2)].into_iter().enumerate() {
                if let Some(block) = block {
                    current = edit(&current, block);
                }
                let graph = Graph::parse(&current, "mlp.toml").unwrap();
                let cold = beam(&graph, &target, width, None);
                let run = beam_keeping(&graph, &target, width, previous.as_ref().map(|(g, t, _)| (g, t)), previous.as_ref().map(|(_, _, k)| k), true);
                assert_eq!(run.reused, block.is_some(), "{name} round {round}");
                if let Some(block) = block {
                    assert_eq!(run.resumed, 2 * block, "{name} round {round}");
                    // The edit follows the block's first product: its step took the extensions
                    // through that product from the previous build (`Through`).
                    let through = previous.as_ref().and_then(|(_, _, k)| k.through[2 * block].clone()).expect("the step's extensions were kept");
                    assert!(through.taken.load(Ordering::Relaxed) > 0, "{name} round {round}");
                }
                assert_eq!(programs_of(&run), programs_of(&cold), "{name} round {round}");
                assert_eq!(run.steps, cold.steps, "{name} round {round}: the traces");
                let trace = BeamTrace { workload: workload_structure(&graph), width: width as u64, steps: run.steps.clone() };
                let kept = run.kept.expect("the states were kept");
                assert_eq!(kept.steps.len(), products + 1);
                assert!(kept.steps[..products].iter().all(Option::is_some) && kept.steps[products].is_none(), "{name} round {round}: every step's states but the last");
                if let Some((g, t, k)) = &previous {
                    let (found, _, _) = finalists_keeping(&graph, &target, width, Some(t), Some(k), None, false);
                    assert_eq!(found.unwrap(), finalists(&graph, &target, width).unwrap(), "{name} round {round}");
                    // States kept for another trace are not taken.
                    let other = BeamTrace { steps: t.steps.iter().map(|s| TraceStep { states: s.states.iter().rev().cloned().collect(), noted: s.noted }).collect(), ..t.clone() };
                    let mixed = t.steps.iter().any(|s| s.states.len() > 1 && s.states.first() != s.states.last());
                    if mixed {
                        assert!(!beam_keeping(&graph, &target, width, Some((g, &other)), Some(k), false).reused, "{name} round {round}");
                    }
                }
                previous = Some((graph, trace, kept));
            }
        }
    }

    /// Finalists made with the previous build's kept beam, extensions through products
    /// (`Through`) and mixed programs' prefixes (`MixedPrefixes`) are those of a build from the
    /// start, edit after edit (the same factor edited twice, then another block), with or
    /// without the capped program lowered beside the resumed beam (`KeptBeam::capped_tried`).
    #[test]
    fn finalists_from_kept_prefixes_equal_finalists_from_the_start() {
        let target = small16();
        let width = DEFAULT_FINALISTS;
        let edit = |text: &str, block: usize, factor: &str| {
            let at = text.find(&format!("name = \"g_{block}\"\n")).expect("the block's activation");
            let end = at + text[at..].find("inputs").expect("its inputs");
            format!("{}name = \"g_{block}\"\nop = \"scale\"\nfactor = {factor}\n{}", &text[..at], &text[end..])
        };
        for (name, text) in [("small", mlp_text(4, 37, 64, 96)), ("row-partitioned", row_partitioned_text(4))] {
            let mut previous: Option<(BeamTrace, KeptBeam)> = None;
            let mut current = text.clone();
            for (round, edited) in [None, Some((3, "0.5")), Some((3, "0.25")), Some((2, "0.5"))].into_iter().enumerate() {
                if let Some((block, factor)) = edited {
                    current = edit(&current, block, factor);
                }
                let graph = Graph::parse(&current, "mlp.toml").unwrap();
                // A resumed beam lowers the capped program beside it only where the build it
                // resumes tried one (`KeptBeam::capped_tried`): the row-partitioned blocks'
                // replicated weights do not fit, so each build tries it. Told that the previous
                // build did not, the resumed beam lowers none, and the finalists are the same.
                if let Some((t, k)) = previous.as_mut() {
                    let old = Graph::parse(&t.workload, "the previous workload").unwrap();
                    let tried = k.capped_tried;
                    assert_eq!(tried, name == "row-partitioned", "{name} round {round}");
                    assert_eq!(beam_keeping(&graph, &target, width, Some((&old, t)), Some(k), false).capped_ahead.is_some(), tried, "{name} round {round}");
                    if tried {
                        k.capped_tried = false;
                        assert!(beam_keeping(&graph, &target, width, Some((&old, t)), Some(k), false).capped_ahead.is_none(), "{name} round {round}");
                        let (found, _, _) = finalists_keeping(&graph, &target, width, Some(t), Some(k), None, true);
                        assert_eq!(found.unwrap(), finalists(&graph, &target, width).unwrap(), "{name} round {round}: without the capped lowering beside the beam");
                        k.capped_tried = true;
                    }
                }
                let (found, trace, kept) = finalists_keeping(&graph, &target, width, previous.as_ref().map(|(t, _)| t), previous.as_ref().map(|(_, k)| k), None, true);
                assert_eq!(found.unwrap(), finalists(&graph, &target, width).unwrap(), "{name} round {round}");
                previous = Some((trace, kept.expect("kept")));
            }
        }
    }

    /// A mixed program extended from the previous build's mixed prefixes (`extend_mixed`),
    /// after an edit between the two products of the block it homes from, takes the prefix
    /// through the block's first product and is the program lowered with those weights homed
    /// from the start; over an edit before that product, it takes none, and is that program too.
    #[test]
    fn mixed_programs_from_the_previous_builds_prefixes_equal_whole_lowerings() {
        let target = small16();
        let text = mlp_text(3, 37, 64, 96);
        let scaled = |text: &str, block: usize| text.replacen(&format!("name = \"g_{block}\"\nop = \"gelu\"\n"), &format!("name = \"g_{block}\"\nop = \"scale\"\nfactor = 0.5\n"), 1);
        // The replicated prefix before product `from` (a beam snapshot), and the mixed program.
        let mixed = |text: &str, from: usize, memo: &MixedMemo| {
            let graph = Graph::parse(text, "mlp.toml").unwrap();
            let oriented = Arc::new(orient(&graph, &BTreeSet::new()).unwrap());
            let prefix = extend(Partial::new(false), &oriented, &target, &[], end_before(&oriented, Some(from))).unwrap();
            let snapshot = Snapshot { oriented: oriented.clone(), partial: prefix, earlier: None };
            let p = extend_mixed(&snapshot, &oriented, &target, from, Some(memo)).unwrap();
            let expected = lower_homing_from(&oriented, &target, from, &[]).unwrap().lowered;
            assert_eq!(complete(p, &oriented, &target, &[]).unwrap().lowered, expected, "homed from {from}");
        };
        let products = swappable(&Graph::parse(&text, "mlp.toml").unwrap());
        let from = products[products.len() - 2];
        for (edited, taken) in [(scaled(&text, 2), true), (scaled(&text, 1), false)] {
            let first = MixedPrefixes::default();
            mixed(&text, from, &MixedMemo { now: &first, before: None, capped_tried: &AtomicBool::new(false) });
            assert!(!first.entries.lock().unwrap().is_empty(), "prefixes kept");
            let second = MixedPrefixes::default();
            mixed(&edited, from, &MixedMemo { now: &second, before: Some(&first), capped_tried: &AtomicBool::new(false) });
            assert_eq!(first.taken.load(Ordering::Relaxed) > 0, taken);
            // The prefixes taken are carried into the edited build's memo, though it lowered
            // none of them: a further edit of the same operation takes them from there.
            let third = MixedPrefixes::default();
            mixed(&edited.replacen("factor = 0.5", "factor = 0.25", 1), from, &MixedMemo { now: &third, before: Some(&second), capped_tried: &AtomicBool::new(false) });
            assert_eq!(second.taken.load(Ordering::Relaxed) > 0, taken);
        }
    }

    /// A state lowered again from its trace record (`replay`) is the program the beam built by
    /// extending prefixes: the last step's states, completed, are the beam's programs; and a
    /// beam resumed from its own trace cut after any step ends with the same programs.
    #[test]
    fn replayed_states_equal_the_beams() {
        let target = small16();
        for graph in [mlp(3), row_partitioned_mlp(4)] {
            let cold = beam(&graph, &target, DEFAULT_FINALISTS, None);
            let last = cold.steps.last().unwrap();
            let replayed = replay(&last.states, &swappable(&graph), cold.steps.len() - 1, &graph, &target, false).unwrap();
            let completed: Vec<(Lowered, usize)> = replayed.into_iter().map(|s| (complete(s.partial.clone(), &s.oriented, &target, &[]).unwrap().lowered, s.partial.home_from())).collect();
            assert_eq!(completed, programs_of(&cold));
            let trace = BeamTrace { workload: workload_structure(&graph), width: DEFAULT_FINALISTS as u64, steps: cold.steps.clone() };
            for cut in 1..=trace.steps.len() {
                let cut_trace = BeamTrace { steps: trace.steps[..cut].to_vec(), ..trace.clone() };
                let warm = beam(&graph, &target, DEFAULT_FINALISTS, Some((&graph, &cut_trace)));
                assert_eq!(warm.resumed, cut - 1);
                assert_eq!(programs_of(&warm), programs_of(&cold), "cut {cut}");
                assert_eq!(warm.steps, cold.steps, "cut {cut}");
            }
        }
        // A mixed state, as the beam makes one (a replicated prefix, its later products
        // keeping their weights on home tiles: `Partial::home_later`), replays to the same
        // program, over each orientation of the last products and from each product on.
        let graph = mlp(3);
        let products = swappable(&graph);
        // Mixed programs that differ from the replicated one (not all do: the comparison must
        // cover weights on home tiles).
        let mut homed = 0;
        for swapped_from in [products.len(), products.len() - 2] {
            let swapped: BTreeSet<usize> = products[swapped_from..].iter().copied().collect();
            let oriented = orient(&graph, &swapped).unwrap();
            for &from in &products[1..] {
                let cut = end_before(&oriented, Some(from));
                let prefix = extend(Partial::new(false), &oriented, &target, &[], cut).unwrap();
                let mixed = extend(prefix.home_later(from), &oriented, &target, &[], oriented.graph.operations.len()).unwrap();
                let record = TracedState { swapped: swapped.iter().map(|&p| p as u64).collect(), home_from: from as u64 };
                let replayed = replay(&[record], &products, products.len(), &graph, &target, false).unwrap().pop().unwrap();
                assert_eq!(replayed.partial.home_from(), from);
                let expected = complete(mixed, &oriented, &target, &[]).unwrap().lowered;
                homed += usize::from(expected != lower_with(&oriented, &target, false, &[]).unwrap().lowered);
                assert_eq!(complete(replayed.partial, &replayed.oriented, &target, &[]).unwrap().lowered, expected, "swapped {swapped:?} from {from}");
            }
        }
        assert!(homed > 0);
    }

    /// Four blocks at four row partitions on 16 tiles: replicated, the eight weights take
    /// 768 KiB on every tile, beyond tile memory; on home tiles they all fit, but every product
    /// then multicasts its weight. The whole-program step keeps the earlier products' weights
    /// replicated and homes the later ones' (a mixed program, its start derived from the
    /// replicated program's overflow), which fits and is estimated cheaper than homing all.
    #[test]
    fn mixed_weights_fit_where_replicated_do_not() {
        let (graph, target) = (row_partitioned_mlp(4), small16());
        let oriented = orient(&graph, &BTreeSet::new()).unwrap();
        assert!(!fits(&lower_with(&oriented, &target, false, &[]).unwrap().lowered, &target));
        let (homed, homed_fits) = lower_feasible_alone(&oriented, &target, 0).unwrap();
        let (chosen, chosen_fits) = lower_feasible_alone(&oriented, &target, usize::MAX).unwrap();
        assert!(homed_fits && chosen_fits);
        // Elements the host writes per weight: its replicas (replicated), or itself once (homed).
        let written = |l: &Lowered| -> Vec<u64> { (0..4).flat_map(|b| [format!("w1_{b}"), format!("w2_{b}")]).map(|w| l.inputs.iter().find(|t| t.name == w).unwrap().streamed_elements()).collect() };
        let once = 256 * 768;
        assert!(written(&homed).iter().all(|&e| e == once), "{:?}", written(&homed));
        let chosen_written = written(&chosen);
        // Replicated first, homed after: a prefix of the weights in program order.
        let replicated = chosen_written.iter().take_while(|&&e| e == 4 * once).count();
        assert!(replicated > 0 && replicated < 8 && chosen_written[replicated..].iter().all(|&e| e == once), "{chosen_written:?}");
        assert!(estimated_cycles(&chosen) < estimated_cycles(&homed), "mixed {} homed {}", estimated_cycles(&chosen), estimated_cycles(&homed));
    }

    /// A swapped chain's end written out for a normal reader (here the first block's MLP
    /// swapped, the second block's first product reading its result by rows) is an orientation
    /// the search takes only where the weights can be replicated on `CHAIN_REPLICAS` tiles or
    /// more: small weights on 16 tiles, not four 256 x 768 blocks' on 16 tiles.
    #[test]
    fn a_swapped_chain_is_written_out_only_where_weights_replicate_widely() {
        let target = small16();
        let big = Graph::parse(&mlp_text(4, 64, 256, 768), "mlp.toml").unwrap();
        let small = Graph::parse(&mlp_text(2, 37, 64, 96), "mlp.toml").unwrap();
        assert!(!chains_allowed(&big, &target) && chains_allowed(&small, &target));
        let swapped: BTreeSet<usize> = [0, 2].into_iter().collect();
        for g in [&big, &small] {
            assert!(orient_until(g, &swapped, usize::MAX).unwrap().chain_written);
            assert!(!orient_until(g, &BTreeSet::new(), usize::MAX).unwrap().chain_written);
        }
        assert!(beam_orient(&big, &swapped, usize::MAX, chains_allowed(&big, &target)).is_err());
        assert!(beam_orient(&small, &swapped, usize::MAX, chains_allowed(&small, &target)).is_ok());
    }

    /// Four MLP blocks of 64 tokens, dimension 256 and hidden dimension 768 on 16 tiles, every
    /// product constrained to swapped: their weights (their A operands) cannot be kept on home
    /// tiles, and replicated at the planner's own partitions they do not fit (the build failed
    /// with a placement error). Every weight replicated on fewer tiles fits: the program keeps
    /// every weight resident, at most two replicas each, and passes placement. (Unconstrained,
    /// since session 34 the search prefers another program by its estimate: the first two
    /// blocks swapped, the second one's result written out for the third, normal, block; the
    /// swapped blocks' weights on four tiles each, the normal blocks' on one.)
    #[test]
    fn replicated_weights_on_fewer_tiles_fit_where_home_tiles_cannot() {
        let mut text = mlp_text(4, 64, 256, 768);
        for b in 0..4 {
            for p in ["h", "y"] {
                text += &format!("\n[[constraint]]\noperation = \"{p}_{b}\"\norientation = \"swapped\"\n");
            }
        }
        let (graph, target) = (Graph::parse(&text, "mlp.toml").unwrap(), small16());
        let found = finalists(&graph, &target, 1).unwrap();
        let chosen = &found[0];
        assert!(fits(chosen, &target), "{}", describe(chosen));
        assert_eq!(chosen.swapped_operations().len(), 8, "{}", describe(chosen));
        // Replicas per weight: elements the host writes over the weight's elements.
        let replicas = |l: &Lowered| -> Vec<u64> { l.inputs.iter().filter(|t| t.role == HostRole::Weight).map(|t| t.streamed_elements() / t.elements()).collect() };
        let chosen_replicas = replicas(chosen);
        assert_eq!(chosen_replicas.len(), 8);
        assert!(chosen_replicas.iter().all(|&r| (1..=2).contains(&r)), "{chosen_replicas:?}: {}", describe(chosen));
        // The same orientation at the planner's own partitions: more replicas, and no fit.
        let oriented = orient(&graph, &chosen.swapped_operations()).unwrap();
        let uncapped = lower_with(&oriented, &target, false, &[]).unwrap().lowered;
        assert!(!fits(&uncapped, &target));
        assert!(replicas(&uncapped).iter().max() > chosen_replicas.iter().max(), "{:?}", replicas(&uncapped));
        // The search is deterministic; the program records its cap, and lowered again alone
        // with it (a steer's re-plan) it is the same program.
        let again = finalists(&graph, &target, 1).unwrap();
        assert_eq!(describe(&again[0]), describe(chosen));
        let cap = replication_cap_of(chosen).expect("the capped program records its cap");
        assert_eq!(Some(&cap), chosen_replicas.iter().max().map(|&r| r as u32).as_ref());
        assert_eq!(relower_capped(&graph, &target, chosen).as_ref(), Some(chosen));
        assert_eq!(replication_cap_of(&uncapped), None);
    }

    /// `taken` is the program `oriented` lowers to in place under replication cap `cap`.
    fn assert_lowered_in_place(taken: &Attempt, oriented: &Oriented, target: &Target, cap: u32) {
        let in_place = lower_replication_capped(oriented, target, cap, &vec![Reserve::default(); oriented.graph.operations.len()]).unwrap();
        assert_eq!(taken.lowered, in_place.lowered);
        assert_eq!(taken.owners, in_place.owners);
        assert_eq!(taken.spans, in_place.spans);
        assert_eq!(taken.interleaved_weights, in_place.interleaved_weights);
    }

    /// A capped lowering that extends the previous build's capped prefixes (`CappedPrefixes`,
    /// kept by a process that builds again) is the program lowered in place over the edited
    /// graph: an edit of the last block reuses the prefixes before it, and prefixes of another
    /// cap, or past the edit, are not taken.
    #[test]
    fn a_capped_lowering_resumed_from_the_previous_builds_prefixes_is_the_one_lowered_in_place() {
        let target = small16();
        let text = row_partitioned_text(4);
        let (graph, edited_graph) = (row_partitioned_mlp(4), edited(&text, 3));
        let products = swappable(&graph);
        let oriented = orient(&graph, &BTreeSet::new()).unwrap();
        let partial = extend(Partial::new(false), &oriented, &target, &[], end_before(&oriented, products.get(2).copied())).unwrap();
        let first = CappedAhead::start(&graph, &target, &BTreeSet::new(), &[&partial], &products, None, true).expect("a cap to try");
        first.take(&oriented, first.cap).expect("lowered").expect("lowers");
        let kept = first.prefixes.lock().unwrap().take().expect("prefixes kept once taken");
        // One prefix per product boundary past the first operation.
        let boundaries = products.iter().filter(|&&p| end_before(&oriented, Some(p)) > 0).count();
        assert_eq!(kept.prefixes.len(), boundaries, "one prefix per product boundary");
        let edited_oriented = orient(&edited_graph, &BTreeSet::new()).unwrap();
        // The edited GELU is in the last block: the prefixes up to its up product lower alike.
        let reused = kept.longest(&edited_oriented, kept.cap).expect("a prefix to extend").lowered_operations();
        assert!(reused > 0 && reused <= end_before(&edited_oriented, products.last().copied()), "{reused}");
        assert!(kept.longest(&edited_oriented, kept.cap + 1).is_none(), "another cap");
        let resumed = CappedAhead::start(&edited_graph, &target, &BTreeSet::new(), &[&partial], &products, Some(kept.clone()), true).expect("a cap to try");
        assert_eq!(resumed.cap, kept.cap);
        let taken = resumed.take(&edited_oriented, resumed.cap).expect("lowered").expect("lowers");
        assert_lowered_in_place(&taken, &edited_oriented, &target, resumed.cap);
        // Its own prefixes: those taken over, then the ones it lowered.
        let again = resumed.prefixes.lock().unwrap().take().expect("kept");
        assert_eq!(again.prefixes.len(), boundaries);
    }

    /// Where the first replication cap does not fit and the cap with the margin is lower,
    /// `capped_program` hands that cap back (`CappedStart::Fallback`) instead of lowering it,
    /// and `lower_feasible` lowers it beside the home-tile arrangements. Two blocks of 512
    /// tokens, 256 wide, hidden 768 on small16 (caps 2, then 1): neither cap fits, and the
    /// program taken is the arrangements' own, which trying them one after the other takes.
    #[test]
    fn the_cap_with_the_margin_is_lowered_beside_the_home_tile_arrangements() {
        let target = small16();
        let graph = Graph::parse(&mlp_text(2, 512, 256, 768), "mlp.toml").unwrap();
        let oriented = orient(&graph, &BTreeSet::new()).unwrap();
        let beam = || lower_homing_from(&oriented, &target, 0, &[]).unwrap();
        let CappedStart::Fallback(d) = capped_program(&oriented, &target, &beam(), None) else { panic!("the cap with the margin is handed back") };
        assert_eq!(d.cap, 1);
        assert!(capped_at(&oriented, &target, d).is_none(), "neither cap fits");
        let (Arranged::Fits((alone, alone_peaks, alone_from)), false) = arrangements(&oriented, &target, Some((beam(), 0)), None, None, None, false) else { panic!("a home-tile arrangement fits") };
        let (taken, peaks, from) = lower_feasible(&oriented, &target, Some((beam(), 0)), None, None, true, None, None).unwrap();
        assert_eq!((peaks, from), (alone_peaks, alone_from));
        assert!(taken == alone, "the arrangements' program");
    }

    /// The capped program lowered beside the beam (`CappedAhead`) is the program lowered in
    /// place with its orientation and cap; it is handed over only for that orientation and
    /// cap, once, and a lowering not taken is stopped and joined when dropped.
    #[test]
    fn the_capped_program_lowered_beside_the_beam_is_the_one_lowered_in_place() {
        let (graph, target) = (row_partitioned_mlp(4), small16());
        let products = swappable(&graph);
        let oriented = orient(&graph, &BTreeSet::new()).unwrap();
        let partial = extend(Partial::new(false), &oriented, &target, &[], end_before(&oriented, products.get(2).copied())).unwrap();
        let ahead = CappedAhead::start(&graph, &target, &BTreeSet::new(), &[&partial], &products, None, false).expect("a cap to try");
        assert!(ahead.cap >= 1);
        // Another cap, or another program: not this lowering.
        assert!(ahead.take(&oriented, ahead.cap + 1).is_none());
        assert!(ahead.take(&orient(&row_partitioned_mlp(3), &BTreeSet::new()).unwrap(), ahead.cap).is_none());
        let unconstrained = Graph::parse(&mlp_text(4, 64, 256, 768), "mlp.toml").unwrap();
        assert!(ahead.take(&orient(&unconstrained, &BTreeSet::new()).unwrap(), ahead.cap).is_none());
        let taken = ahead.take(&oriented, ahead.cap).expect("lowered").expect("lowers");
        assert_lowered_in_place(&taken, &oriented, &target, ahead.cap);
        assert!(ahead.take(&oriented, ahead.cap).is_none(), "handed over once");
        assert!(ahead.prefixes.lock().unwrap().is_none(), "no prefixes kept unless asked");
        // Dropped untaken: stopped at its next product and joined.
        drop(CappedAhead::start(&graph, &target, &BTreeSet::new(), &[&partial], &products, None, false).expect("a cap to try"));
        // The phases it hands on as it goes are the program's, in order, requested as
        // select_finalist and the table screen request them (the same patterns, so the same
        // memo entries; the same addresses too).
        let ahead = CappedAhead::start(&graph, &target, &BTreeSet::new(), &[&partial], &products, None, false).expect("a cap to try");
        let handed = ahead.lowering.lock().unwrap().take().expect("its phases");
        let taken = ahead.take(&oriented, ahead.cap).expect("lowered").expect("lowers");
        let mut bases = crate::pipeline::ProvisionalBases::default();
        let mut requests = Vec::new();
        for next in handed.try_iter() {
            next.declare(&mut bases);
            requests.extend((0..next.phases.len()).map(|k| next.request(k, &bases)));
        }
        let provisional = crate::pipeline::provisional_bases(&taken.lowered);
        assert_eq!(requests.len(), taken.lowered.phases.len());
        for (i, r) in requests.iter().enumerate() {
            let expected = crate::pipeline::phase_request(&taken.lowered, i, &|b, offset| provisional[b as usize] + offset);
            assert_eq!(crate::exchange::pattern_digest(r), crate::exchange::pattern_digest(&expected), "phase {i}");
            assert_eq!(r, &expected, "phase {i}");
        }
    }

    /// A search that hands the capped program's phases to a `Warm` while it waits finds the
    /// same finalists (the handing on is a speed matter only), and what it hands on are valid
    /// exchange requests (each schedules); on two threads (one warming thread) and on a wide
    /// pool (`WIDE_POOL`: phases warmed side by side).
    #[test]
    fn warming_the_capped_programs_phases_leaves_the_finalists_alone() {
        let (graph, target) = (row_partitioned_mlp(4), small16());
        for threads in [2, WIDE_POOL + 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let seen: Arc<std::sync::Mutex<Vec<crate::exchange::PhaseRequest>>> = Arc::default();
            let record = seen.clone();
            let warm: Arc<Warm> = Arc::new(move |r: &crate::exchange::PhaseRequest| record.lock().unwrap().push(r.clone()));
            let (plain, warmed) = pool.install(|| (finalists(&graph, &target, DEFAULT_FINALISTS).unwrap(), finalists_warming(&graph, &target, DEFAULT_FINALISTS, None, Some(warm)).0.unwrap()));
            assert_eq!(plain, warmed, "{threads} threads");
            for r in seen.lock().unwrap().iter() {
                crate::exchange::schedule_phase(&target, r).expect("a phase handed on schedules");
            }
        }
    }

    /// The finalists are the same with one thread (no lowering beside the beam), with two, and
    /// on a wide pool (`WIDE_POOL`: the capped lowering's phases are warmed on several
    /// threads).
    #[test]
    fn finalists_are_the_same_at_any_thread_count() {
        let target = small16();
        for graph in [row_partitioned_mlp(4), Graph::parse(&mlp_text(4, 64, 256, 768), "mlp.toml").unwrap()] {
            let at = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| finalists(&graph, &target, DEFAULT_FINALISTS).unwrap())
            };
            let one = at(1);
            assert_eq!(one, at(2));
            assert_eq!(one, at(WIDE_POOL + 2));
        }
    }
}

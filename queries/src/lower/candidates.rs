//! The matrix-product plan of an operation as a memoized query keyed by its signature: the
//! shapes and dtypes of its operands, how its producers store them (grid cuts and tiles,
//! seen through the same views), the budgets it plans within, the user's constraint, and the
//! target's constants. Operations with equal signatures (repeated blocks and layers, the same
//! product in several orientation candidates or re-planning rounds) share one entry, so the
//! candidate enumeration runs once per distinct signature in a process.
//!
//! The plan is a pure function of what the key holds, so a hit returns exactly what planning
//! again would: builds stay deterministic whatever ran before in the process.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use super::plan::{plan_matmul, MatMulProblem, NoPlan, Planned};
use crate::hash::{Digest, KeyHasher};
use crate::target::Target;

/// Entries kept before the memo starts over (a long `watch` session stays bounded).
const CAPACITY: usize = 4096;

type Memo = Mutex<HashMap<Digest, Result<Planned, NoPlan>>>;

fn memo() -> &'static Memo {
    static MEMO: OnceLock<Memo> = OnceLock::new();
    MEMO.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Digest of an operation's signature; `parts` describe everything the problem's closures
/// read (operand views, producer grids, dtypes, ranks), the target included.
pub fn signature(target: &Target, problem: &MatMulProblem, parts: &str) -> Digest {
    let text = format!(
        "{target:?}|{} {} {} {} {} {} {} {:?}|{} {} {}|{:?} {} {}|{} {} {} {}|tiles {} {}|{parts}",
        problem.batches,
        problem.m,
        problem.k,
        problem.n,
        problem.b_transposed,
        problem.whole_rows,
        problem.m_align,
        problem.epilogue,
        problem.memory_budget,
        problem.interleaved_budget,
        problem.standard_budget,
        problem.constraint,
        problem.max_row_partitions,
        problem.max_column_partitions,
        problem.a_gathered,
        problem.b_gathered,
        problem.a_stored,
        problem.b_stored,
        problem.first_tile,
        problem.tiles,
    );
    // The block cap of a last-resort lowering, only where there is one (every other key as before).
    let text = match problem.max_block_bytes {
        u64::MAX => text,
        cap => format!("{text}|block {cap}"),
    };
    KeyHasher::new("ipuq matmul plan candidates v1").bytes(text.as_bytes()).finish()
}

/// `plan_matmul`, memoized by `key` (from [`signature`]).
pub fn planned(target: &Target, problem: &MatMulProblem, key: Digest) -> Result<Planned, NoPlan> {
    if let Some(hit) = memo().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return hit.clone();
    }
    let result = plan_matmul(target, problem);
    let mut m = memo().lock().unwrap_or_else(|e| e.into_inner());
    if m.len() >= CAPACITY {
        m.clear();
    }
    m.insert(key, result.clone());
    result
}

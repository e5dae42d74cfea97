//! "critical-neighborhood": local search along the critical path (stub).

use super::problem::Problem;
use super::timing;
use super::types::Piece;

pub(crate) fn critical_neighborhood(problem: &Problem, pieces: Vec<Piece>, _floor: u32) -> (Vec<Piece>, u32, u32) {
    let h = timing::horizon(problem, &pieces);
    (pieces, h, 0)
}

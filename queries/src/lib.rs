//! ipuq's compiler: the IR, the target description, the stages as salsa queries, the package.
//!
//! This crate does no I/O of its own: files enter as salsa inputs set by the caller, and the
//! disk cache is reached through a small trait (`db::StageStore`).

pub mod cost;
pub mod elements;
pub mod emit;
pub mod exchange_placement;
pub mod exchange;
pub mod fingerprint;
pub mod hash;
pub mod image;
pub mod ir;
pub mod lower;
pub mod package;
pub mod provenance;
pub mod storage;
pub mod sizing;
pub mod tables;
pub mod target;
pub mod db;
pub mod pipeline;
pub mod phases;

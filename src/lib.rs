//! ipuq: the command line, the devices (the simulator by default), the host exchange runtime,
//! verification against the host reference, profiles and reports. Only this crate prints,
//! reads files and touches devices; the compiler lives in `ipuq_queries`.

pub mod alloc;
pub mod build;
pub mod cli;
pub mod device;
pub mod exchange_report;
pub mod import;
pub mod inspect;
pub mod logging;
pub mod op_profile;
pub mod plans;
pub mod profile;
pub mod progress;
pub mod reference;
pub mod reference_cache;
pub mod remote_args;
pub mod report;
pub mod runtime;
pub mod server;
pub mod verify;
pub mod watch;
pub mod workload;

//! `ipuq exchange-report`: for every exchange phase of the given workloads, the bound, the
//! scheduled horizon, the gap and the scheduling time, from a fresh (uncached) scheduling run.
//! Every schedule is lowered to tables and checked by the independent validator.

use std::path::PathBuf;
use std::time::Instant;

use ipuq_queries::exchange::{lower_to_tables, schedule_phase, validate};
use ipuq_queries::ir::Graph;
use ipuq_queries::lower::lower;
use ipuq_queries::pipeline::{provisional_bases, requests};
use ipuq_queries::target::Target;

use crate::build::load_target;

pub fn run(workloads: &[PathBuf], target: Option<&str>) -> Result<(), String> {
    let (text, origin) = load_target(target).map_err(|e| e.to_string())?;
    let target = Target::from_toml(&text, &origin).map_err(|e| e.to_string())?;
    println!("{:<64} {:>5} {:>9} {:>10} {:>8} {:>8} {:>7} {:>22} {:>9}", "workload", "phase", "transfers", "words", "bound", "horizon", "gap%", "kind", "ms");
    let mut gaps = Vec::new();
    for path in workloads {
        let source = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let graph = Graph::parse(&source, &path.display().to_string()).map_err(|e| e.to_string())?;
        let lowered = lower(&graph, &target).map_err(|e| e.to_string())?;
        let bases = provisional_bases(&lowered);
        for request in requests(&lowered, |buffer, offset| bases[buffer as usize] + offset) {
            let start = Instant::now();
            let schedule = schedule_phase(&target, &request).map_err(|e| e.to_string())?;
            let ms = start.elapsed().as_secs_f64() * 1e3;
            let tables = lower_to_tables(&target, &request, &schedule);
            validate(&target, &request, &tables).map_err(|e| format!("phase {}: {e}", request.index))?;
            let words: u64 = request.transfers.iter().map(|t| t.words as u64).sum();
            let bound = schedule.best_bound();
            let gap = 100.0 * (schedule.horizon as f64 - bound as f64) / bound.max(1) as f64;
            gaps.push(gap);
            println!(
                "{:<64} {:>5} {:>9} {:>10} {:>8} {:>8} {:>7.2} {:>22} {:>9.1}",
                graph.name,
                request.index,
                request.transfers.len(),
                words,
                bound,
                schedule.horizon,
                gap,
                schedule.kind.name(),
                ms
            );
        }
    }
    gaps.sort_by(f64::total_cmp);
    if let (Some(max), Some(median)) = (gaps.last(), gaps.get(gaps.len() / 2)) {
        println!("phases={} medianGapPercent={median:.2} maximumGapPercent={max:.2} validated=all", gaps.len());
    }
    Ok(())
}

//! `ipuq plans WORKLOAD`: the operator-plan finalists of `lower_mid` as a table, each with its
//! estimate and its exact cost after scheduling and placement (`select_finalist`), and which
//! one was chosen: how a user sees why a plan won.

use std::path::Path;

use ipuq_queries::db::{graph, sources, Database};
use ipuq_queries::lower::search::describe;
use ipuq_queries::pipeline::{finalists, selection};

use crate::build::load_target;

pub fn run(workload: &Path, target: Option<&str>, keep: usize) -> Result<(), String> {
    let text = std::fs::read_to_string(workload).map_err(|e| format!("workload {}: cannot read: {e}", workload.display()))?;
    let (target_text, target_origin) = load_target(target).map_err(|e| e.to_string())?;
    let db = Database::new(None).with_plan_finalists(keep);
    let s = sources(&db, text, workload.display().to_string(), target_text, target_origin);
    let g = graph(&db, s).map_err(|e| e.to_string())?;
    let f = finalists(&db, s).map_err(|e| e.to_string())?;
    let chosen = selection(&db, s).map_err(|e| e.to_string())?;
    println!("workload={} finalists={} chosen={}", g.value.name, f.value.len(), chosen.value.chosen);
    if !chosen.value.steered.is_empty() {
        println!("no finalist below could be placed; planned again with {}", chosen.value.steered.join("; "));
        let l = ipuq_queries::pipeline::lowered(&db, s).map_err(|e| e.to_string())?;
        println!("chosen after re-planning: {}", describe(&l.value));
        return Ok(());
    }
    println!("{:>8} {:>6} {:>10} {:>10} {:>10} {:>10}  plans", "finalist", "chosen", "estimated", "scheduled", "standard", "interleaved");
    for (i, l) in f.value.iter().enumerate() {
        let costed = chosen.value.costed.iter().find(|c| c.finalist == i as u32);
        let (estimated, scheduled, standard, interleaved) = match costed {
            Some(c) => (c.estimated_cycles.to_string(), c.scheduled_cycles.to_string(), c.peak_standard_bytes.to_string(), c.peak_interleaved_bytes.to_string()),
            None => {
                let why = chosen.value.failures.iter().find(|x| x.0 == i as u32).map(|x| x.1.as_str()).unwrap_or("not costed");
                (ipuq_queries::lower::search::estimated_cycles(l).to_string(), format!("({why})"), "-".into(), "-".into())
            }
        };
        let mark = if chosen.value.chosen == i as u32 { "*" } else { "" };
        println!("{i:>8} {mark:>6} {estimated:>10} {scheduled:>10} {standard:>10} {interleaved:>10}  {}", describe(l));
    }
    Ok(())
}

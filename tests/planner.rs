//! The operator planner end to end on the 16-tile target: finalists and select_finalist,
//! orientation, the folded softmax scale, whole-program memory, user plan constraints and
//! `ipuq plans`.

mod common;

use common::{assert_pass, field, fixture, ipuq, tail};

const MLP: &str = "workloads/siglip-mlp-f16-b1-t37-d64-h96-n1.toml";
const ATTENTION: &str = "workloads/attention-grouped-materialized-gaussian-f16-b1-t29-h4-kv2-d8.toml";
const ENCODER: &str = "workloads/siglip-encoder-f16-b1-t29-d64-h4-m96-l3.toml";

fn workdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("temporary folder")
}

/// A log field's value in the first stderr line containing `message`.
fn log_field(stderr: &str, message: &str, key: &str) -> Option<String> {
    let line = stderr.lines().find(|l| l.contains(message))?;
    line.split_whitespace().find_map(|kv| kv.strip_prefix(&format!("{key}=")).map(str::to_string))
}

#[test]
fn finalists_are_logged_and_the_selected_cost_is_what_the_simulator_counts() {
    let dir = workdir();
    let out = ipuq(&["run", &fixture(MLP), "--target", "small16", "-o", "out", "--checkpoints"], dir.path());
    assert_pass(&out);
    let retained = out.stderr.lines().filter(|l| l.contains("retained operator-plan finalist")).count();
    assert!(retained >= 2, "the MLP has normal and swapped candidates:\n{}", tail(&out.stderr));
    for key in ["values", "operations", "estimated_cycles", "estimated_exchange_cycles", "peak_standard_bytes", "peak_interleaved_bytes", "peak_total_bytes", "active_tile_counts"] {
        assert!(log_field(&out.stderr, "retained operator-plan finalist", key).is_some(), "{key} missing");
    }
    let scheduled: u64 = log_field(&out.stderr, "selected operator-plan finalist", "scheduled_cycles").expect("a selection line").parse().unwrap();
    let simulated: u64 = field(&out.stdout, "workload=", "cycles").unwrap().parse().unwrap();
    // select_finalist costs the program as it will run (input replication phase included).
    assert!(scheduled.abs_diff(simulated) * 50 <= simulated, "scheduled {scheduled} vs simulated {simulated}");
    assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"));

    let one = ipuq(&["build", &fixture(MLP), "--target", "small16", "-o", "one", "--plan-finalists", "1"], dir.path());
    assert_eq!(one.code, 0, "{}", tail(&one.stderr));
    assert_eq!(one.stderr.lines().filter(|l| l.contains("retained operator-plan finalist")).count(), 1);
}

#[test]
fn plans_prints_the_finalists_and_marks_the_chosen_one() {
    let dir = workdir();
    let out = ipuq(&["plans", &fixture(MLP), "--target", "small16"], dir.path());
    assert_eq!(out.code, 0, "{}", tail(&out.stderr));
    let rows: Vec<&str> = out.stdout.lines().skip(2).collect();
    assert!(rows.len() >= 2, "{}", out.stdout);
    assert_eq!(rows.iter().filter(|r| r.split_whitespace().nth(1) == Some("*")).count(), 1, "{}", out.stdout);
    assert!(out.stdout.contains("h_0:normal[") && out.stdout.contains("swapped["), "{}", out.stdout);
}

#[test]
fn a_swapped_constraint_is_honoured_and_passes() {
    let dir = workdir();
    let text = std::fs::read_to_string(fixture(MLP)).unwrap();
    let constrained = format!(
        "{text}\n[[constraint]]\noperation = \"h_0\"\norientation = \"swapped\"\ninner_partitions = 2\n\n[[constraint]]\noperation = \"y_0\"\norientation = \"swapped\"\nweight_memory = \"standard\"\n"
    );
    std::fs::write(dir.path().join("c.toml"), constrained).unwrap();
    let out = ipuq(&["run", "c.toml", "--target", "small16", "-o", "out", "--checkpoints"], dir.path());
    assert_pass(&out);
    assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"));
    let applied: Vec<&str> = out.stderr.lines().filter(|l| l.contains("applied GEMM plan constraint")).collect();
    assert_eq!(applied.len(), 2, "{}", tail(&out.stderr));
    assert!(applied[0].contains("source_operation=h_0") && applied[0].contains("constraint=orientation=swapped,inner_partitions=2"), "{}", applied[0]);
    let matching: u32 = log_field(applied[0], "applied GEMM plan constraint", "matching_plans").unwrap().parse().unwrap();
    assert!(matching >= 1);
    let plans = ipuq(&["plans", "c.toml", "--target", "small16"], dir.path());
    assert!(plans.stdout.contains("h_0:swapped[") && plans.stdout.contains(",2]") && plans.stdout.contains("y_0:swapped["), "{}", plans.stdout);
    assert!(plans.stdout.contains("/w-standard"), "{}", plans.stdout);
}

#[test]
fn an_infeasible_constraint_exits_2_naming_the_operation_and_the_field() {
    let dir = workdir();
    let text = std::fs::read_to_string(fixture(MLP)).unwrap();
    std::fs::write(dir.path().join("bad.toml"), format!("{text}\n[[constraint]]\noperation = \"y_0\"\ncolumn_partitions = 500\n")).unwrap();
    let out = ipuq(&["build", "bad.toml", "--target", "small16", "-o", "out"], dir.path());
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("operation 'y_0'") && out.stderr.contains("column_partitions=500"), "{}", out.stderr);
    std::fs::write(dir.path().join("gelu.toml"), format!("{text}\n[[constraint]]\noperation = \"g_0\"\nrow_partitions = 2\n")).unwrap();
    let out = ipuq(&["build", "gelu.toml", "--target", "small16", "-o", "out"], dir.path());
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("g_0") && out.stderr.contains("only matrix products take plan constraints"), "{}", out.stderr);
}

/// `weights = "home"` keeps the weights of a product and the later ones on home tiles (the
/// earlier ones replicated): the run passes; a value other than "home", or a product without a
/// weight operand, exits 2 naming the operation and the field.
#[test]
fn a_home_weights_constraint_runs_and_bad_ones_are_named() {
    let dir = workdir();
    let text = std::fs::read_to_string(fixture(ENCODER)).unwrap();
    std::fs::write(dir.path().join("home.toml"), format!("{text}\n[[constraint]]\noperation = \"l1.q.product\"\nweights = \"home\"\n")).unwrap();
    let out = ipuq(&["run", "home.toml", "--target", "small16", "-o", "out", "--checkpoints"], dir.path());
    assert_pass(&out);
    assert!(!out.stderr.contains("the weights constraint could not be kept"), "{}", out.stderr);
    assert_eq!(field(&out.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"));
    for (value, operation, expected) in [("\"replicated\"", "l1.q.product", "weights must be \"home\""), ("\"home\"", "l1.scores", "needs a product whose second operand is a rank-2 weight tensor")] {
        std::fs::write(dir.path().join("bad.toml"), format!("{text}\n[[constraint]]\noperation = \"{operation}\"\nweights = {value}\n")).unwrap();
        let out = ipuq(&["build", "bad.toml", "--target", "small16", "-o", "out"], dir.path());
        assert_eq!(out.code, 2, "{}", out.stderr);
        assert!(out.stderr.contains(&format!("operation '{operation}'")) && out.stderr.contains(expected), "{}", out.stderr);
    }
}

/// A weights constraint whose mixed program does not fit tile memory: the build homes earlier
/// products' weights too, no further than memory requires, says so naming both products, and
/// the program runs and passes. Four MLP blocks of 64 x 256 x 768 held at four row partitions
/// on 16 tiles: with the constraint on the third block, the first two blocks' replicated
/// weights do not fit; the first block's do.
#[test]
fn a_home_weights_constraint_that_does_not_fit_is_given_up_with_a_warning() {
    let dir = workdir();
    let out = ipuq(&["workload", "siglip-mlp", "--blocks", "4", "--tokens", "64", "--dim", "256", "--hidden", "768", "-o", "m.toml"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    let mut text = std::fs::read_to_string(dir.path().join("m.toml")).unwrap();
    for b in 0..4 {
        for p in ["h", "y"] {
            let home = if (p, b) == ("h", 2) { "weights = \"home\"\n" } else { "" };
            text += &format!("\n[[constraint]]\noperation = \"{p}_{b}\"\norientation = \"normal\"\nrow_partitions = 4\n{home}");
        }
    }
    std::fs::write(dir.path().join("m.toml"), text).unwrap();
    let out = ipuq(&["run", "m.toml", "--target", "small16", "-o", "out"], dir.path());
    assert_pass(&out);
    let warning = out.stderr.lines().find(|l| l.contains("the weights constraint could not be kept")).unwrap_or_else(|| panic!("no warning:\n{}", tail(&out.stderr)));
    assert!(warning.contains("operation=h_2") && warning.contains("home_weights_from=h_1"), "{warning}");
}

#[test]
fn the_attention_scale_is_folded_into_the_softmax_and_passes() {
    let dir = workdir();
    let out = ipuq(&["plans", &fixture(ATTENTION), "--target", "small16", "--plan-finalists", "1"], dir.path());
    assert_eq!(out.code, 0, "{}", tail(&out.stderr));
    assert!(out.stdout.contains("probabilities:softmax") && !out.stdout.contains("scaled_scores"), "{}", out.stdout);
    let run = ipuq(&["run", &fixture(ATTENTION), "--target", "small16", "-o", "out", "--checkpoints"], dir.path());
    assert_pass(&run);
    assert_eq!(field(&run.stdout, "diagnosticCheckpoints=", "numericalTest").as_deref(), Some("PASS"));
}

#[test]
fn a_batch_of_four_mlp_fits_whole_program() {
    // Batch 4 at small dimensions on 16 tiles: weights of both products stay resident, so each
    // product's budget must leave room for the other's.
    let dir = workdir();
    let out = ipuq(&["workload", "siglip-mlp", "--batch", "4", "--tokens", "37", "--dim", "64", "--hidden", "96", "-o", "b4.toml"], dir.path());
    assert_eq!(out.code, 0, "{}", out.stderr);
    let run = ipuq(&["run", "b4.toml", "--target", "small16", "-o", "out"], dir.path());
    assert_pass(&run);
}

/// The per-tile exchange-table budget is a planner input: one byte under what the planner's
/// own program needs on its fullest tile, lower_mid's table screen finds the best finalist
/// over it, so the operation whose phase holds most of that tile's tables is planned again,
/// steered away from its plan (an `info` line names it), before select_finalist, which then
/// has no program to re-plan; where no steering helps, the build exits 2 naming the tile, the
/// bytes and the budget. At exactly what the program needs, nothing is re-planned.
#[test]
fn an_exchange_table_budget_over_every_finalist_replans_the_operation_at_fault() {
    let dir = workdir();
    let out = ipuq(&["build", &fixture(MLP), "--target", "small16", "-o", "base"], dir.path());
    assert_eq!(out.code, 0, "{}", tail(&out.stderr));
    let need: u32 = out
        .stderr
        .lines()
        .filter(|l| l.contains("allocated package support memory"))
        .filter_map(|l| l.split_whitespace().find_map(|kv| kv.strip_prefix("exchange_table_bytes=")).and_then(|v| v.parse().ok()))
        .max()
        .expect("support memory is logged per tile");
    assert!(need > 0);
    const STEERED: &str = "no finalist can be placed: planning the operation again, steered away from its plan";
    const SCREENED: &str = "exchange tables over the budget: lowering the finalist again, steered away from the plan";
    let exact = ipuq(&["build", &fixture(MLP), "--target", "small16", "-o", "exact", "--exchange-table-budget", &need.to_string()], dir.path());
    assert_eq!(exact.code, 0, "{}", tail(&exact.stderr));
    assert!(!exact.stderr.contains(STEERED) && !exact.stderr.contains(SCREENED), "{}", tail(&exact.stderr));
    assert_eq!(std::fs::read(dir.path().join("exact/model.ipuexe")).unwrap(), std::fs::read(dir.path().join("base/model.ipuexe")).unwrap());
    let under = (need - 1).to_string();
    let out = ipuq(&["run", &fixture(MLP), "--target", "small16", "-o", "under", "--exchange-table-budget", &under], dir.path());
    let operation = log_field(&out.stderr, SCREENED, "operation").expect("the steered operation is named");
    assert!(["h_0", "y_0"].contains(&operation.as_str()), "{operation}");
    assert!(log_field(&out.stderr, SCREENED, "constraint").is_some(), "{}", tail(&out.stderr));
    if out.code == 0 {
        assert_pass(&out);
        assert!(!out.stderr.contains(STEERED), "select_finalist planned the program again:\n{}", tail(&out.stderr));
    } else {
        assert_eq!(out.code, 2, "{}", tail(&out.stderr));
        assert!(out.stderr.contains(&format!("over the per-tile exchange-table budget of {under} bytes")), "{}", tail(&out.stderr));
    }
}

/// A one-block MLP of 882 rows (294 tokens, batch 3, 306 wide, hidden 702) takes about a
/// quarter of small16's memory, but at the planner's own partitions a gathered operand block
/// (a quarter of the GELU output, 311 KB) or a weight block read transposed (215 KB) fills a
/// region of a tile, and the re-planning rounds, whose reserves only grow, found no plan: the
/// build exited 2. The last resort plans every product with operand blocks no larger than a
/// tile's standard region (`fit_block_capped` in `lower/search.rs`), and it builds and passes.
#[test]
fn a_program_whose_blocks_fill_a_region_is_planned_again_with_smaller_blocks() {
    let dir = workdir();
    let workload = dir.path().join("mlp.toml");
    let w = workload.display().to_string();
    let made = ipuq(&["workload", "siglip-mlp", "--tokens=294", "--dim=306", "--hidden=702", "--batch=3", "-o", &w], dir.path());
    assert_eq!(made.code, 0, "{}", made.stderr);
    let out = dir.path().join("out").display().to_string();
    let run = ipuq(&["run", &w, "--target", "small16", "-o", &out], dir.path());
    assert_pass(&run);
}

//! The command line: `ipuq workload | import | build | run | watch | serve | profile | cache`.
//!
//! Exit codes: 0 success, 1 a numerical check failed, 2 usage, input, compile or device error.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ipuq_queries::ir::Graph;

use crate::build::{build, default_cache_dir, print_timings, read_package, BuildOptions};
use crate::report::{self, Outcome};

#[derive(Parser)]
#[command(name = "ipuq", version, about = "A compiler and runtime for the Graphcore IPU; runs on its simulator by default")]
pub struct Cli {
    /// Threads for compiling and simulating (default: $RAYON_NUM_THREADS, else one per core).
    /// Packages and results are the same at any count.
    #[arg(short = 'j', long, global = true, value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
pub struct CompileArgs {
    /// Target description: a TOML file, or the built-in `ipu21` (default) or `small16`.
    #[arg(long)]
    target: Option<String>,
    /// Output folder for model.ipuexe (default: out/<workload name>).
    #[arg(short = 'o', long = "out")]
    out: Option<PathBuf>,
    /// Reuse and store stage outputs in the content-addressed cache.
    #[arg(long)]
    incremental: bool,
    /// Cache folder (default: $IPUQ_CACHE_DIR, else ~/.cache/ipuq).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// With --incremental: read the cache but write nothing to it (a shared CI cache).
    #[arg(long)]
    cache_read_only: bool,
    /// With --incremental: size budget of the cache (bytes, or with K, M, G), enforced by
    /// evicting least recently used entries after a build that wrote to it
    /// (default: $IPUQ_CACHE_MAX_BYTES, else 2G).
    #[arg(long, value_parser = crate::build::parse_bytes)]
    cache_max_bytes: Option<u64>,
    /// Print a per-phase table of times, computed stages and disk-cache hits.
    #[arg(long)]
    timings: bool,
    /// Operator-plan finalists lower_mid keeps for select_finalist to cost exactly.
    #[arg(long, default_value_t = ipuq_queries::lower::search::DEFAULT_FINALISTS, value_parser = clap::value_parser!(usize))]
    plan_finalists: usize,
    /// Exchange-table bytes one tile may hold, a hard limit: a plan whose tables exceed it is
    /// steered away from and the program planned again. Without it the compiler's policy
    /// applies: 48 KiB, exceeded where the program still places with its tables (deep stacks
    /// of layers hold a table for each of their phases).
    #[arg(long)]
    exchange_table_budget: Option<u32>,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
    /// With --incremental: build in this process even where a build server (`ipuq serve`)
    /// answers for the cache folder.
    #[arg(long, conflicts_with = "server")]
    no_server: bool,
    /// With --incremental: where no build server answers for the cache folder, start one in
    /// the background (`ipuq serve`, its log in server.log there; it stops after three idle
    /// hours) and build through it, so that the next build rebuilds from its memory.
    #[arg(long, requires = "incremental")]
    server: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Write a workload file of one of the seed families.
    Workload {
        #[command(subcommand)]
        family: Family,
    },
    /// Write a workload for a Hugging Face checkpoint directory (config.json and
    /// model.safetensors or its sharded index): the SigLIP vision or BERT encoder stack, its
    /// weights referenced by file, tensor name and digest.
    Import {
        model_dir: PathBuf,
        /// Rows of hidden_states (default: SigLIP (image_size/patch_size)^2, BERT 128).
        #[arg(long)]
        tokens: Option<u32>,
        /// Import only the first N layers (default: all).
        #[arg(long)]
        layers: Option<u32>,
        /// The workload file to write (default: <workload name>.toml).
        #[arg(short = 'o', long = "out")]
        out: Option<PathBuf>,
    },
    /// Compile a workload file into DIR/model.ipuexe.
    Build {
        workload: PathBuf,
        #[command(flatten)]
        compile: CompileArgs,
    },
    /// Build if needed, run on the simulator, verify against the host reference.
    Run {
        /// A workload file, or a package (.ipuexe).
        input: PathBuf,
        #[command(flatten)]
        compile: CompileArgs,
        /// Sample intermediate tensors and compare them with the host reference.
        #[arg(long)]
        checkpoints: bool,
        #[arg(long, default_value_t = 256)]
        sample_limit: usize,
        /// Write inputs, weights and outputs as .npy files (NAME.npy) into this folder.
        #[arg(long)]
        dump: Option<PathBuf>,
        /// Supply an input's values: NAME=FILE.npy (f32 or f16, the declared shape); repeatable.
        #[arg(long = "input", value_name = "NAME=FILE.npy", value_parser = crate::workload::given::parse_assignment)]
        inputs: Vec<(String, PathBuf)>,
        /// Seconds to wait for the device lock before giving up.
        #[arg(long, default_value_t = 600)]
        lock_timeout: u64,
        /// The machine the simulator models: a target file, or the built-in `ipu21` or `small16`
        /// (default: ipuq's description of the machine the package names). A package built
        /// for another machine (another target digest) is refused.
        #[arg(long)]
        device_target: Option<String>,
    },
    /// Print the operator-plan finalists: plans, estimated and exact cycles, peak bytes, the chosen one.
    Plans {
        workload: PathBuf,
        #[arg(long)]
        target: Option<String>,
        #[arg(long, default_value_t = ipuq_queries::lower::search::DEFAULT_FINALISTS)]
        plan_finalists: usize,
    },
    /// Rebuild the workload on every save of it (or of a --target file), keeping one compiler
    /// in memory; with --run, run each build on the simulator and print its result line.
    /// Errors are printed and the watch goes on.
    Watch {
        workload: PathBuf,
        #[command(flatten)]
        compile: CompileArgs,
        #[arg(long)]
        run: bool,
        /// With --run: supply an input's values, NAME=FILE.npy (f32 or f16, the declared
        /// shape; read again for every run, and a save of it runs again); repeatable.
        #[arg(long = "input", value_name = "NAME=FILE.npy", value_parser = crate::workload::given::parse_assignment, requires = "run")]
        inputs: Vec<(String, PathBuf)>,
        /// With --run: write inputs, weights and outputs of every run as .npy files (NAME.npy)
        /// into this folder.
        #[arg(long, requires = "run")]
        dump: Option<PathBuf>,
        /// Seconds to wait for the device lock before giving up on a run.
        #[arg(long, default_value_t = 600)]
        lock_timeout: u64,
        /// Milliseconds between two looks at the workload file (and a --target file) when no
        /// change is noticed (on Linux changes are noticed at once through inotify; the looks
        /// catch file systems that send no notices).
        #[arg(long, default_value_t = 200)]
        poll_ms: u64,
        /// Stop after this many rebuilds (default: watch until killed).
        #[arg(long)]
        max_rebuilds: Option<u32>,
    },
    /// Serve the --incremental builds of other ipuq processes from one long-lived compiler
    /// session (what `ipuq watch` keeps between saves), on a socket in the cache folder.
    Serve {
        /// Cache folder (default: $IPUQ_CACHE_DIR, else ~/.cache/ipuq); the socket is
        /// server.sock in it.
        #[arg(long)]
        cache_dir: Option<PathBuf>,
        /// Stop after this many seconds without a request.
        #[arg(long, default_value_t = crate::server::DEFAULT_MAX_IDLE.as_secs())]
        max_idle_secs: u64,
        /// Stop the server of the cache folder instead.
        #[arg(long)]
        stop: bool,
    },
    /// Summarise an execution profile.
    Profile {
        file: PathBuf,
        /// Export a Chrome trace-event JSON file (Perfetto, chrome://tracing).
        #[arg(long)]
        chrome_trace: Option<PathBuf>,
        /// The package the profile is a run of: also print cycles per operation kind.
        #[arg(long)]
        package: Option<PathBuf>,
        /// With --package: one row per operation, in program order, instead of per kind.
        #[arg(long, requires = "package")]
        operations: bool,
    },
    /// Describe a package (identity, program, memory, exchange and host tables) without running it.
    Inspect { package: PathBuf },
    /// For every exchange phase of the workloads: bound, horizon, gap and scheduling time.
    ExchangeReport {
        workloads: Vec<PathBuf>,
        #[arg(long)]
        target: Option<String>,
    },
    /// Inspect or maintain the stage cache.
    Cache {
        #[command(subcommand)]
        action: CacheAction,
        #[arg(long, global = true)]
        cache_dir: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum Family {
    /// SigLIP MLP blocks: y = gelu_tanh(x W1) W2.
    SiglipMlp {
        #[arg(long, default_value_t = 729)]
        tokens: u32,
        #[arg(long, default_value_t = 1152)]
        dim: u32,
        #[arg(long, default_value_t = 4304)]
        hidden: u32,
        #[arg(long, default_value_t = 1)]
        batch: u32,
        #[arg(long, default_value_t = 1)]
        blocks: u32,
        #[arg(long)]
        biases: bool,
        #[arg(short = 'o', long = "out")]
        out: Option<PathBuf>,
    },
    /// Grouped-head attention with materialised scores and Gaussian inputs.
    Attention {
        #[arg(long, default_value_t = 729)]
        tokens: u32,
        #[arg(long, default_value_t = 16)]
        heads: u32,
        #[arg(long, default_value_t = 4)]
        kv_heads: u32,
        #[arg(long, default_value_t = 72)]
        head_dim: u32,
        #[arg(long, default_value_t = 1)]
        batch: u32,
        #[arg(short = 'o', long = "out")]
        out: Option<PathBuf>,
    },
    /// SigLIP So400m/14 encoder layers (pre-LayerNorm, biases, GELU tanh) with random weights.
    SiglipEncoder {
        #[arg(long, default_value_t = 1)]
        layers: u32,
        #[arg(long, default_value_t = 729)]
        tokens: u32,
        #[arg(long, default_value_t = 1152)]
        dim: u32,
        #[arg(long, default_value_t = 16)]
        heads: u32,
        /// The MLP's inner width.
        #[arg(long, default_value_t = 4304)]
        hidden: u32,
        #[arg(long, default_value_t = 1)]
        batch: u32,
        #[arg(short = 'o', long = "out")]
        out: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum CacheAction {
    Stats,
    Verify,
    /// Evict least recently used entries until the cache is under the budget.
    Gc {
        #[arg(long, default_value_t = crate::build::DEFAULT_CACHE_MAX_BYTES, value_parser = crate::build::parse_bytes)]
        max_bytes: u64,
    },
    Clear,
    /// Write cache entries into one file: those the workloads need (building them), or all.
    Export {
        file: PathBuf,
        #[arg(long = "workload")]
        workloads: Vec<PathBuf>,
        /// Target the workloads are built for (default ipu21).
        #[arg(long)]
        target: Option<String>,
    },
    /// Verify every entry of an exported file and add it to the cache.
    Import { file: PathBuf },
}

/// Whether the command line (program name first) runs a long-lived command, `ipuq watch` or
/// `ipuq serve`, as the command-line parser reads it (a line it refuses runs nothing long).
pub fn long_lived(args: &[std::ffi::OsString]) -> bool {
    Cli::try_parse_from(args).is_ok_and(|cli| matches!(cli.command, Command::Watch { .. } | Command::Serve { .. }))
}

pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    if let Some(threads) = cli.threads {
        if let Err(e) = rayon::ThreadPoolBuilder::new().num_threads(threads as usize).build_global() {
            eprintln!("error: --threads {threads}: {e}");
            return ExitCode::from(2);
        }
    }
    match run(cli) {
        Ok(outcome) => ExitCode::from(outcome as u8),
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}

fn out_dir(compile: &CompileArgs, name: &str) -> PathBuf {
    compile.out.clone().unwrap_or_else(|| PathBuf::from("out").join(name))
}

fn workload_name(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("workload {}: cannot read: {e}", path.display()))?;
    workload_name_of(path, &text)
}

/// The name of the workload `text`, read from `path`.
fn workload_name_of(path: &Path, text: &str) -> Result<String, String> {
    Graph::parse(text, &path.display().to_string()).map(|g| g.name).map_err(|e| e.to_string())
}

fn build_options(args: &CompileArgs, out_dir: PathBuf) -> Result<BuildOptions, String> {
    let remote = args.remote.options()?;
    Ok(BuildOptions {
        target: args.target.clone(),
        out_dir,
        incremental: args.incremental || remote.is_some(),
        cache_dir: args.cache_dir.clone(),
        cache_read_only: args.cache_read_only,
        cache_max_bytes: args.cache_max_bytes,
        plan_finalists: args.plan_finalists,
        table_budget: args.exchange_table_budget,
        remote,
    })
}

fn compile(workload: &Path, args: &CompileArgs) -> Result<crate::build::Built, String> {
    let name = workload_name(workload)?;
    let options = build_options(args, out_dir(args, &name))?;
    if args.server && options.incremental {
        crate::server::start(options.cache_dir.as_deref())?;
    }
    let served = if args.no_server { None } else { crate::server::build(workload, &options) };
    let built = match served {
        Some(built) => built?,
        None => build(workload, &options).map_err(|e| e.to_string())?,
    };
    if args.timings {
        print_timings(&built.timings);
    }
    Ok(built)
}

fn run(cli: Cli) -> Result<Outcome, String> {
    match cli.command {
        Command::Workload { family } => {
            let (file, out) = match family {
                Family::SiglipMlp { tokens, dim, hidden, batch, blocks, biases, out } => {
                    let p = crate::workload::SiglipMlp { batch, tokens, dimension: dim, hidden, blocks, biases };
                    (crate::workload::siglip_mlp(&p).map_err(|e| e.to_string())?, out)
                }
                Family::Attention { tokens, heads, kv_heads, head_dim, batch, out } => {
                    let p = crate::workload::GroupedAttention { batch, tokens, heads, kv_heads, head_dimension: head_dim };
                    (crate::workload::grouped_attention(&p).map_err(|e| e.to_string())?, out)
                }
                Family::SiglipEncoder { layers, tokens, dim, heads, hidden, batch, out } => {
                    let p = crate::workload::SiglipEncoder { batch, tokens, dimension: dim, heads, hidden, layers };
                    (crate::workload::siglip_encoder(&p).map_err(|e| e.to_string())?, out)
                }
            };
            let path = out.unwrap_or_else(|| PathBuf::from(format!("{}.toml", file.name)));
            std::fs::write(&path, crate::workload::to_toml(&file)).map_err(|e| format!("{}: {e}", path.display()))?;
            println!("workload={} file={}", file.name, path.display());
            Ok(Outcome::Pass)
        }
        Command::Import { model_dir, tokens, layers, out } => {
            let imported = crate::import::import(&crate::import::ImportRequest { model_dir, tokens, layers, out }).map_err(|e| e.to_string())?;
            println!(
                "workload={} file={} modelType={} tokens={} layers={} weights={} postLayerNorm={}",
                imported.file.name,
                imported.path.display(),
                imported.config.model_type,
                imported.tokens,
                imported.layers,
                imported.tensors,
                imported.final_norm
            );
            Ok(Outcome::Pass)
        }
        Command::Build { workload, compile: args } => {
            let built = compile(&workload, &args)?;
            println!("package={} tiles={} estimatedCycles={}", built.path.display(), built.tiles, built.estimated_cycles);
            Ok(Outcome::Pass)
        }
        Command::Run { input, compile: args, checkpoints, sample_limit, dump, inputs, lock_timeout, device_target } => {
            let (package_path, folder) = if input.extension().is_some_and(|e| e == "ipuexe") {
                (input.clone(), input.parent().map(Path::to_path_buf).unwrap_or_default())
            } else {
                let built = compile(&input, &args)?;
                (built.path, input.parent().map(Path::to_path_buf).unwrap_or_default())
            };
            let package = tracing::info_span!("ipuq.run.read_package").in_scope(|| read_package(&package_path)).map_err(|e| e.to_string())?;
            let device_target = device_target.map(|spec| crate::build::load_target(Some(&spec))).transpose().map_err(|e| e.to_string())?;
            let options = report::RunRequest { device_target, checkpoints, sample_limit, dump, lock_timeout: Duration::from_secs(lock_timeout), workload_folder: folder, inputs };
            report::run_and_verify(&package, &package_path, &options)
        }
        Command::Watch { workload, compile: args, run, inputs, dump, lock_timeout, poll_ms, max_rebuilds } => {
            if args.server {
                return Err("--server: ipuq watch keeps a compiler session of its own and builds in it (a build server is for separate build commands)".into());
            }
            let options = build_options(&args, PathBuf::new())?;
            let watch = crate::watch::WatchOptions { run, inputs, dump, lock_timeout: Duration::from_secs(lock_timeout), poll: Duration::from_millis(poll_ms.max(1)), max_rebuilds };
            crate::watch::watch(&workload, options, |w, text| workload_name_of(w, text).map(|name| out_dir(&args, &name)), &watch)?;
            Ok(Outcome::Pass)
        }
        Command::Serve { cache_dir, max_idle_secs, stop } => {
            let dir = crate::server::cache_folder(cache_dir.as_deref())?;
            if stop {
                let stopped = crate::server::stop(&dir)?;
                println!("{}", if stopped { format!("stopped the build server of {}", dir.display()) } else { format!("no build server answers for {}", dir.display()) });
            } else {
                crate::server::serve(&dir, Duration::from_secs(max_idle_secs))?;
            }
            Ok(Outcome::Pass)
        }
        Command::Profile { file, chrome_trace, package, operations } => {
            let summary = crate::profile::summarize(&file).map_err(|e| e.to_string())?;
            println!("{summary}");
            if let Some(path) = package {
                let package = read_package(&path).map_err(|e| e.to_string())?;
                let timeline = crate::profile::read(&file).map_err(|e| e.to_string())?;
                let split = if operations { crate::op_profile::by_operation(&package, &timeline) } else { crate::op_profile::by_kind(&package, &timeline) };
                let split = split.map_err(|e| format!("{}: {e}", path.display()))?;
                println!("{split}");
            }
            if let Some(out) = chrome_trace {
                crate::profile::chrome_trace(&file, &out).map_err(|e| e.to_string())?;
                println!("chromeTrace={}", out.display());
            }
            Ok(Outcome::Pass)
        }
        Command::Plans { workload, target, plan_finalists } => {
            crate::plans::run(&workload, target.as_deref(), plan_finalists)?;
            Ok(Outcome::Pass)
        }
        Command::Inspect { package } => {
            crate::inspect::run(&package)?;
            Ok(Outcome::Pass)
        }
        Command::ExchangeReport { workloads, target } => {
            crate::exchange_report::run(&workloads, target.as_deref())?;
            Ok(Outcome::Pass)
        }
        Command::Cache { action, cache_dir } => {
            let dir = cache_dir.unwrap_or_else(default_cache_dir);
            // Looking needs no write access: stats and verify work on a read-only cache.
            let read_only = matches!(action, CacheAction::Stats | CacheAction::Verify);
            let cache = ipuq_cache::Cache::open(&dir, ipuq_cache::CacheOptions { read_only, max_bytes: None }).map_err(|e| e.to_string())?;
            match action {
                CacheAction::Stats => {
                    println!("{}", cache.stats().map_err(|e| e.to_string())?);
                    println!("remote (all builds with this cache folder): {}", cache.remote_totals());
                }
                CacheAction::Export { file, workloads, target } => println!("{}", crate::remote_args::export(&dir, &file, &workloads, target.as_deref())?),
                CacheAction::Import { file } => {
                    let report = cache.import(&file).map_err(|e| e.to_string())?;
                    println!("{report}");
                    if !report.rejected.is_empty() {
                        return Ok(Outcome::NumericalFailure);
                    }
                }
                CacheAction::Verify => {
                    let report = cache.verify().map_err(|e| e.to_string())?;
                    println!("{report}");
                    if !report.damaged.is_empty() {
                        return Ok(Outcome::NumericalFailure);
                    }
                }
                CacheAction::Gc { max_bytes } => println!("{}", cache.gc(max_bytes).map_err(|e| e.to_string())?),
                CacheAction::Clear => {
                    cache.clear().map_err(|e| e.to_string())?;
                    println!("cleared {}", dir.display());
                }
            }
            Ok(Outcome::Pass)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::long_lived;

    fn line(words: &[&str]) -> Vec<std::ffi::OsString> {
        words.iter().map(|w| w.into()).collect()
    }

    /// `watch` and `serve` are the long-lived commands, after any global option; nothing else
    /// is, nor a command's later words, nor a line the parser refuses.
    #[test]
    fn only_watch_and_serve_are_long_lived() {
        for words in [&["ipuq", "watch", "w.toml"][..], &["ipuq", "serve"], &["ipuq", "-j", "4", "serve"], &["ipuq", "--threads", "2", "watch", "w.toml"], &["ipuq", "-j4", "watch", "w.toml"], &["ipuq", "--threads=3", "serve"], &["ipuq", "watch", "w.toml", "-j", "2"]] {
            assert!(long_lived(&line(words)), "{words:?}");
        }
        for words in [&["ipuq", "build", "watch.toml"][..], &["ipuq", "run", "serve"], &["ipuq"], &["ipuq", "-j", "8"], &["ipuq", "--help"], &["ipuq", "-j", "watch", "build"], &["ipuq", "cache", "stats"], &["ipuq", "watch"]] {
            assert!(!long_lived(&line(words)), "{words:?}");
        }
    }
}

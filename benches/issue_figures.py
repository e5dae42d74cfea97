#!/usr/bin/env python3
"""The build-time figures issues 8 and 9 ask for, measured the way the README's tables are:
release binaries, plain cold `ipuq build` (a fresh output folder, no cache) and
`ipuq build --incremental` (a fresh cache per cold run; each edit from a copy of the warm cache
and output folder), each measurement repeated RUNS times with the binaries alternating, medians
printed with the range and the load average seen.

Usage: issue_figures.py [--runs N] [--cycles] [--only enc|mlp] IPUQ [BASELINE_IPUQ ...]

- Issue 9: one and four full-size SigLIP encoder layers (`ipuq workload siglip-encoder`), cold
  build wall time and the four-layer over one-layer ratio (asks <= 2.5 x); with --cycles also
  `ipuq run` of each (simulated cycles, PASS, the ratio; asks <= 350,000 and <= 4.2 x).
- Issue 8: one and four full-size SigLIP MLP blocks, cold build ratio (asks <= 6 x and <= 10 s);
  the four blocks with `--incremental`: cold, no-op and the last block's GELU made a scale
  (asks the edit <= 20 % of the cold build), the edited package checked equal to a cold build
  of the edited workload past the header's compiler id; and the same edit saved under
  `ipuq watch` (one process, no disk cache): seconds from the save to the new result line;
  and through a build server (`ipuq serve`, where the binary has it): the four blocks' cold
  `--incremental` build and then the edit, each a new `ipuq build --incremental` process that
  the server answers (the edit once the server has written the cold build's cache entries, as
  it does after answering), the edited package checked as above.

This machine's speed moves by a factor of two within hours (see the README), so only figures of
binaries measured in the same run, alternating, compare. Nothing here is a test: CI runs none
of it (four layers take about half a minute a build)."""
import os, re, shutil, statistics, subprocess, sys, tempfile, time

args = sys.argv[1:]
runs, cycles, only = 3, False, None
while args and args[0].startswith("--"):
    flag = args.pop(0)
    if flag == "--runs":
        runs = int(args.pop(0))
    elif flag == "--cycles":
        cycles = True
    elif flag == "--only":
        only = args.pop(0)
    else:
        sys.exit(f"unknown flag {flag}\n{__doc__}")
if not args:
    sys.exit(__doc__)
binaries = [os.path.abspath(b) for b in args]
work = tempfile.mkdtemp(prefix="issue-figures-")
env = dict(os.environ, IPUQ_LOG=os.environ.get("IPUQ_LOG", "warn"))


def ipuq(binary, *argv, cwd=work):
    """Run one ipuq command; wall seconds and standard output. Fails loudly on an error."""
    start = time.monotonic()
    done = subprocess.run([binary, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.monotonic() - start
    if done.returncode != 0:
        sys.exit(f"{binary} {' '.join(argv)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return wall, done.stdout


def load():
    return open("/proc/loadavg").read().split()[0]


def workloads():
    first = binaries[0]
    made = {}
    if only in (None, "enc"):
        for layers in (1, 4):
            made[f"enc{layers}"] = f"enc{layers}.toml"
            ipuq(first, "workload", "siglip-encoder", "--layers", str(layers), "-o", made[f"enc{layers}"])
    if only in (None, "mlp"):
        for blocks in (1, 4):
            made[f"mlp{blocks}"] = f"mlp{blocks}.toml"
            ipuq(first, "workload", "siglip-mlp", "--blocks", str(blocks), "-o", made[f"mlp{blocks}"])
        text = open(os.path.join(work, "mlp4.toml")).read()
        # The last block's GELU becomes a scale (factor 0.5), the README's one-operation edit.
        last = text.rfind('op = "gelu"')
        assert last >= 0, "the four-block MLP has a GELU"
        open(os.path.join(work, "mlp4e.toml"), "w").write(text[:last] + 'op = "scale"\nfactor = 0.5' + text[last + len('op = "gelu"'):])
    return made


def median_line(name, values, unit="s"):
    m = statistics.median(values)
    return f"{name}: median {m:.2f} {unit} ({min(values):.2f}-{max(values):.2f}, {len(values)} runs)"


def same_package(a, b):
    """Equal past the header's compiler id (the first 124 bytes hold it), as the README compares."""
    x, y = open(a, "rb").read(), open(b, "rb").read()
    return len(x) == len(y) and x[124:] == y[124:]


def watch_edit(binary, tag):
    """`ipuq watch` on the four blocks (no disk cache): after its first build, the edited text is
    saved over the watched file; seconds from the save to the second result line."""
    watched, out = os.path.join(work, f"watched-{tag}.toml"), f"watch-{tag}"
    shutil.copyfile(os.path.join(work, "mlp4.toml"), watched)
    shutil.rmtree(os.path.join(work, out), ignore_errors=True)
    process = subprocess.Popen([binary, "watch", watched, "-o", out, "--poll-ms", "10", "--max-rebuilds", "2"], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = (l for l in process.stdout if l.startswith("package="))
    next(lines)
    saved = time.monotonic()
    shutil.copyfile(os.path.join(work, "mlp4e.toml"), watched)
    next(lines)
    wall = time.monotonic() - saved
    process.wait()
    return wall


def has_server(binary):
    return subprocess.run([binary, "serve", "--help"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def served_edit(binary, tag):
    """`ipuq serve` for a fresh cache; the four blocks built cold through it, then (once it has
    finished that build: its entries written) the edited workload. Wall seconds of the two client
    processes, and the edited package's path."""
    cache, out = f"cache-served-{tag}", f"served-{tag}"
    for d in (cache, out):
        shutil.rmtree(os.path.join(work, d), ignore_errors=True)
    server = subprocess.Popen([binary, "serve", "--cache-dir", cache], cwd=work, env=dict(env, IPUQ_LOG="info"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = iter(server.stderr)
    next(l for l in lines if l.startswith("serving"))
    finished = lambda: next(l for l in lines if "build finished after the answer" in l)
    cold, _ = ipuq(binary, "build", "mlp4.toml", "--incremental", "--cache-dir", cache, "-o", out)
    finished()
    edit, _ = ipuq(binary, "build", "mlp4e.toml", "--incremental", "--cache-dir", cache, "-o", out)
    finished()
    ipuq(binary, "serve", "--stop", "--cache-dir", cache)
    server.wait()
    return cold, edit, os.path.join(work, out, "model.ipuexe")


def main():
    made = workloads()
    label = {b: f"[{i}] {b}" for i, b in enumerate(binaries)}
    times = {b: {} for b in binaries}
    put = lambda b, k, v: times[b].setdefault(k, []).append(v)
    for run in range(runs):
        for b in binaries:
            tag = str(binaries.index(b))
            for name in made:
                out = f"out-{tag}-{name}"
                shutil.rmtree(os.path.join(work, out), ignore_errors=True)
                wall, _ = ipuq(b, "build", made[name], "-o", out)
                put(b, f"cold {name}", wall)
                print(f"run {run + 1} {label[b]} cold {name} {wall:.2f} s load {load()}", flush=True)
            if "mlp4" in made:
                cache, out = f"cache-{tag}", f"inc-{tag}"
                for d in (cache, out, cache + "-e", out + "-e"):
                    shutil.rmtree(os.path.join(work, d), ignore_errors=True)
                cold, _ = ipuq(b, "build", "mlp4.toml", "--incremental", "--cache-dir", cache, "-o", out)
                noop, _ = ipuq(b, "build", "mlp4.toml", "--incremental", "--cache-dir", cache, "-o", out)
                shutil.copytree(os.path.join(work, cache), os.path.join(work, cache + "-e"))
                shutil.copytree(os.path.join(work, out), os.path.join(work, out + "-e"))
                edit, _ = ipuq(b, "build", "mlp4e.toml", "--incremental", "--cache-dir", cache + "-e", "-o", out + "-e")
                for k, v in (("incremental cold mlp4", cold), ("no-op mlp4", noop), ("edit mlp4", edit)):
                    put(b, k, v)
                put(b, "edit over cold %", 100 * edit / cold)
                print(f"run {run + 1} {label[b]} incremental mlp4 cold {cold:.2f} s, no-op {noop:.2f} s, edit {edit:.2f} s ({100 * edit / cold:.0f} %) load {load()}", flush=True)
                watched = watch_edit(b, tag)
                put(b, "watch edit mlp4", watched)
                print(f"run {run + 1} {label[b]} ipuq watch: the same edit rebuilt {watched:.2f} s after the save load {load()}", flush=True)
                served = has_server(b)
                if served:
                    served_cold, served_edit_wall, served_package = served_edit(b, tag)
                    put(b, "served cold mlp4", served_cold)
                    put(b, "served edit mlp4", served_edit_wall)
                    print(f"run {run + 1} {label[b]} through ipuq serve: cold {served_cold:.2f} s, the edit {served_edit_wall:.2f} s load {load()}", flush=True)
                if run == 0:
                    ref = f"edited-{tag}"
                    shutil.rmtree(os.path.join(work, ref), ignore_errors=True)
                    ipuq(b, "build", "mlp4e.toml", "-o", ref)
                    equal = same_package(os.path.join(work, out + "-e", "model.ipuexe"), os.path.join(work, ref, "model.ipuexe"))
                    print(f"{label[b]} edited incremental package equals a cold build of the edited workload: {equal}", flush=True)
                    if served:
                        equal = same_package(served_package, os.path.join(work, ref, "model.ipuexe"))
                        print(f"{label[b]} the package of the edit through ipuq serve equals it: {equal}", flush=True)
    print()
    for b in binaries:
        t = times[b]
        print(label[b])
        for k in sorted(t):
            print("  " + median_line(k, t[k], "%" if k.endswith("%") else "s"))
        med = {k: statistics.median(v) for k, v in t.items()}
        if "cold enc1" in med:
            r = med["cold enc4"] / med["cold enc1"]
            print(f"  issue 9: four layers build in {r:.2f} x one layer (asks <= 2.5 x: {'met' if r <= 2.5 else 'not met'})")
        if "cold mlp1" in med:
            r = med["cold mlp4"] / med["cold mlp1"]
            ok = r <= 6 and med["cold mlp4"] <= 10
            print(f"  issue 8: four MLP blocks build in {r:.2f} x one block, {med['cold mlp4']:.2f} s (asks <= 6 x and <= 10 s: {'met' if ok else 'not met'})")
        if "edit over cold %" in med:
            e = med["edit over cold %"]
            print(f"  issue 8: the one-operation edit takes {e:.0f} % of the cold incremental build (asks <= 20 %: {'met' if e <= 20 else 'not met'})")
        if "watch edit mlp4" in med and "cold mlp4" in med:
            w = 100 * med["watch edit mlp4"] / med["cold mlp4"]
            print(f"  issue 8: under ipuq watch the edit rebuilds in {med['watch edit mlp4']:.2f} s, {w:.0f} % of the cold build ({'met' if w <= 20 else 'not met'} against 20 %)")
        if "served edit mlp4" in med and "cold mlp4" in med:
            w = 100 * med["served edit mlp4"] / med["cold mlp4"]
            print(f"  issue 8: through ipuq serve (a new `ipuq build --incremental` process) the edit rebuilds in {med['served edit mlp4']:.2f} s, {w:.0f} % of the cold build ({'met' if w <= 20 else 'not met'} against 20 %)")
        if cycles and "enc1" in made:
            found = {}
            for name in ("enc1", "enc4"):
                _, out = ipuq(b, "run", made[name], "-o", f"run-{name}")
                line = next(l for l in out.splitlines() if l.startswith("workload="))
                found[name] = (int(re.search(r" cycles=(\d+)", line).group(1)), re.search(r"numericalTest=(\w+)", line).group(1))
            r = found["enc4"][0] / found["enc1"][0]
            print(f"  issue 9: one layer {found['enc1'][0]:,} simulated cycles {found['enc1'][1]} (asks <= 350,000), four layers {found['enc4'][0]:,} {found['enc4'][1]}: {r:.3f} x (asks <= 4.2 x)")
    print(f"\n(workloads and outputs in {work})")


main()

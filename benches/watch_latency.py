#!/usr/bin/env python3
"""Latency of `ipuq watch W --run`: from saving an edit of an initialiser seed to the next result
line on standard output, for each of EDITS edits (seeds 7, 8, 9, ... for the input x; PATTERN
names another seed line, e.g. "seed = 102\n"). Usage: watch_latency.py IPUQ WORKLOAD [EDITS [PATTERN]]"""
import os, subprocess, sys, tempfile, threading, time, queue, shutil, statistics

ipuq, workload = sys.argv[1], sys.argv[2]
edits = int(sys.argv[3]) if len(sys.argv) > 3 else 3
text = open(workload).read()
pattern = sys.argv[4] if len(sys.argv) > 4 else "seed = 1\n"
assert pattern in text
folder = tempfile.mkdtemp(prefix="watch-latency-")
path = os.path.join(folder, "mlp.toml")
open(path, "w").write(text)
env = dict(os.environ, IPUQ_LOG=os.environ.get("IPUQ_LOG", "warn"))
child = subprocess.Popen([ipuq, "watch", "mlp.toml", "--run", "-o", "out", "--poll-ms", "200"], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
lines = queue.Queue()
def pump():
    for line in child.stdout:
        lines.put((time.monotonic(), line.rstrip("\n")))
threading.Thread(target=pump, daemon=True).start()
def stderr_pump():
    for line in child.stderr:
        sys.stderr.write("  [watch] " + line)
threading.Thread(target=stderr_pump, daemon=True).start()
def next_result(limit):
    deadline = time.monotonic() + limit
    while True:
        at, line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        if line.startswith("workload="):
            return at, line
start = time.monotonic()
at, line = next_result(600)
print(f"first result after {at - start:.2f} s: {'PASS' if 'numericalTest=PASS' in line else 'FAIL'}", flush=True)
latencies = []
for i in range(edits):
    time.sleep(1.0)
    load = open("/proc/loadavg").read().split()[0]
    seed = 7 + i
    value = str(seed) if pattern == "seed = 1\n" else str(int(pattern.split()[-1]) * 1000 + seed)
    new = text.replace(pattern, pattern.replace(pattern.split()[-1], value), 1)
    tmp = path + ".tmp"
    open(tmp, "w").write(new)
    saved = time.monotonic()
    os.replace(tmp, path)
    at, line = next_result(600)
    error = line.split("maximumAbsoluteError=")[1].split()[0]
    latencies.append(at - saved)
    print(f"edit {i + 1} (seed {seed}, load {load}): new result line after {at - saved:.2f} s, maximumAbsoluteError={error} {'PASS' if 'numericalTest=PASS' in line else 'FAIL'}", flush=True)
child.kill()
child.wait()
print(f"median {statistics.median(latencies):.2f} s of {len(latencies)}: " + ", ".join(f"{l:.2f}" for l in latencies))
shutil.rmtree(folder, ignore_errors=True)

#!/bin/bash
# Thread scaling of ipuq builds and simulator runs, the figures of the README's "Threads and
# many-core machines": cold builds of the MLP seed, the four-block MLP and one and four encoder
# layers at each thread count (then again in reverse order), each package's digest (equal at
# every count), then simulator runs of the MLP seed and four layers with the cached reference.
#
# Usage: benches/thread_scaling.sh IPUQ   (a release binary; env THREADS="16 8 4 2 1", REPS=2,
# OUT=folder for results.txt and timings.txt). Made for a lent many-core machine; not a test.
set -u
B=$(realpath "${1:?usage: thread_scaling.sh IPUQ}")
OUT=${OUT:-/tmp/scale-out}; mkdir -p $OUT
R=$OUT/results.txt; T=$OUT/timings.txt; : > $R; : > $T
THREADS=${THREADS:-"16 8 4 2 1"}
REPS=${REPS:-2}
W=/tmp/scale; rm -rf $W; mkdir -p $W; cd $W
{ echo "nproc=$(nproc)"; grep -m1 'model name' /proc/cpuinfo; uptime; } | tee -a $R
$B workload siglip-mlp --blocks 1 -o mlp1.toml >/dev/null
$B workload siglip-mlp --blocks 4 -o mlp4.toml >/dev/null
$B workload siglip-encoder --layers 1 -o enc1.toml >/dev/null
$B workload siglip-encoder --layers 4 -o enc4.toml >/dev/null
TIMEFORMAT='%R %U %S'
build() { # workload threads rep
  rm -rf o-$1-$2
  { time RAYON_NUM_THREADS=$2 $B build $1.toml -o o-$1-$2 --timings > tim.txt 2>err.txt ; } 2> time.txt
  local rc=$? 
  echo "build $1 threads=$2 rep=$3 wall_user_sys=$(cat time.txt | tr ' ' ,) sha=$(sha256sum o-$1-$2/model.ipuexe 2>/dev/null | cut -c1-16)" | tee -a $R
  { echo "== build $1 threads=$2 rep=$3"; awk '/^phase /{p=1} p{print} /^total /{p=0}' err.txt; } >> $T
  grep -q 'package=' tim.txt || tail -5 err.txt | tee -a $R
}
for rep in $(seq 1 $REPS); do
  order="$THREADS"; [ $((rep % 2)) = 0 ] && order=$(echo $THREADS | tr ' ' '\n' | tac | tr '\n' ' ')
  for t in $order; do for w in mlp1 mlp4 enc1 enc4; do build $w $t $rep; done; done
done
# Simulator runs of the built packages (the reference computed once first, then cached).
for w in mlp1 enc4; do
  P=o-$w-${THREADS%% *}/model.ipuexe
  { time RAYON_NUM_THREADS=16 $B run $P > run.txt 2>err.txt ; } 2> time.txt
  echo "run-first $w threads=16 wall_user_sys=$(cat time.txt | tr ' ' ,) $(grep -o 'cycles=[0-9]*\|numericalTest=[A-Z]*' run.txt | head -2 | tr '\n' ' ')" | tee -a $R
  for rep in 1 2; do for t in $THREADS; do
    { time RAYON_NUM_THREADS=$t $B run $P > run.txt 2>err.txt ; } 2> time.txt
    echo "run $w threads=$t rep=$rep wall_user_sys=$(cat time.txt | tr ' ' ,) $(grep -o 'cycles=[0-9]*\|numericalTest=[A-Z]*' run.txt | head -2 | tr '\n' ' ')" | tee -a $R
  done; done
done
echo done | tee -a $R

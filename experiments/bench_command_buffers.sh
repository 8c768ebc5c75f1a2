#!/usr/bin/env bash
# The sampler alone under XLA's command-buffer (CUDA graph) settings, one process each,
# on one GPU: a decode step of a small model at 128 rows is mostly kernel launches.
#
#   OUT=/path/to/results bash experiments/bench_command_buffers.sh [VARIANT ...]
#
# VARIANT: default (XLA's own), while (+WHILE,+CONDITIONAL: the decode loop itself in a
# graph, no host round trip a step), off (no command buffers). Each runs
# experiments/bench_rollout.py (Qwen2.5-0.5B shape, P512 + R1024 forced, batch 128 and
# 512); its JSON and log are written to $OUT. Needs wheels/ beside the tree unless
# SKIP_INSTALL=1.
set -uo pipefail
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
source "$(dirname "$0")/wheels.sh"
install_wheels || exit 1
declare -A FLAGS=([default]="" [while]="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
                  [off]="--xla_gpu_enable_command_buffer=")
for name in "${@:-default while off}"; do
  for variant in $name; do
    [[ -v FLAGS[$variant] ]] || { echo "unknown variant $variant" >&2; exit 2; }
    echo "== $variant: XLA_FLAGS=${FLAGS[$variant]}"
    XLA_FLAGS="${FLAGS[$variant]}" PYTHONPATH=/tmp/site:$PWD timeout 200 \
      python3 experiments/bench_rollout.py --batch-sizes 128 512 --prompt-len 512 \
      --new-tokens 1024 --no-hf --repeats 2 --out "$OUT/rollout_$variant.json" 2>&1 \
      | grep -v "^[WI]0000" | tee "$OUT/rollout_$variant.log" | tail -n 8
  done
done

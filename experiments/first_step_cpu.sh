#!/usr/bin/env bash
# The main job's first step on this machine's CPU, `python -m jrl.train` as the guide's
# "The compilation cache" runs it (2 RL steps, a 20-step warm start, 16 validation rows):
#
#   OUT=/path/to/results bash experiments/first_step_cpu.sh
#
#   {on,off}_val    validation before training, an empty cache, trainer.parallel_compile
#                   on (the default) / off
#   {on,off}_empty  no validation before training, an empty cache
#   {on,off}_warm   the same command again, the cache the run before filled (new workdir)
# Each run's console output is written to $OUT/NAME.log, its wall time last.
set -uo pipefail
OUT=${OUT:-first_step_cpu}
mkdir -p "$OUT"
scratch=$(mktemp -d)
job=(--config=configs/grpo_arith.py:steps=2 --config.sft.steps=20 --config.data.num_val=16
  --config.trainer.test_freq=0)
run() {  # run NAME CACHE_DIR ARGS...
  local name=$1 cache=$2
  shift 2
  local start=$SECONDS
  XDG_CACHE_HOME="$cache" python -m jrl.train "${job[@]}" --workdir="$scratch/$name" "$@" 2>&1 \
    | tr '\r' '\n' | grep -E "^step|after RL|compil" | awk '!seen[$0]++' > "$OUT/$name.log"
  echo "wall $((SECONDS - start)) s" >> "$OUT/$name.log"
  echo "== $name"; cat "$OUT/$name.log"
}
for mode in on off; do
  flag=(--config.trainer.parallel_compile=$([[ $mode == on ]] && echo True || echo False))
  run "${mode}_val" "$scratch/cache_${mode}_val" "${flag[@]}"
  run "${mode}_empty" "$scratch/cache_$mode" "${flag[@]}" --config.trainer.val_before_train=False
  run "${mode}_warm" "$scratch/cache_$mode" "${flag[@]}" --config.trainer.val_before_train=False
done
rm -rf "$scratch"

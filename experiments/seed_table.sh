#!/usr/bin/env bash
# The main job on several seeds at once, each on its own pair of CPU cores (as on a
# 2-core laptop), one fresh workdir per run; prints one line per run.
#   [FIRST_CORE=0] [EXTRA="--config.a=b ..."] experiments/seed_table.sh CONFIG OUTDIR SEED...
# EXTRA: more flags for every run (e.g. --config.actor.use_dynamic_bsz=True).
set -uo pipefail
config=$1 out=$2; shift 2
mkdir -p "$out"
export JAX_PLATFORMS=cpu
i=$(( ${FIRST_CORE:-0} / 2 ))
for seed in "$@"; do
  cores="$((2 * i)),$((2 * i + 1))"
  ( SECONDS=0
    # shellcheck disable=SC2086
    taskset -c "$cores" python -m jrl.train --config="$config" --config.seed="$seed" \
      --workdir="$out/seed$seed" ${EXTRA:-} > "$out/seed$seed.log" 2>&1
    echo "$(basename "$config") seed $seed: $(grep -a 'val-core' "$out/seed$seed.log")" \
      "(${SECONDS} s)" ) &
  i=$((i + 1))
done
wait

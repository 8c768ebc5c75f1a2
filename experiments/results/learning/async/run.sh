#!/usr/bin/env bash
# The main job, synchronous (8 CPU devices) vs one-step asynchronous (4 sample + 4 train,
# truncated IS), seeds 0-2, one run at a time on the 2-core machine.
cd /tmp/seeds_src
source .venv/bin/activate
export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false"
out=/tmp/seeds_out
for seed in 0 1 2; do
  for mode in sync async; do
    extra=()
    if [ $mode = async ]; then
      extra=(--config.rollout.devices=4 --config.algorithm.rollout_correction.rollout_is=token)
    fi
    SECONDS=0
    python -m jrl.train --config=configs/grpo_arith.py --config.seed=$seed \
      --workdir=$out/$mode-seed$seed "${extra[@]}" > $out/$mode-seed$seed.log 2>&1
    echo "$mode seed $seed: $(grep -a "val-core" $out/$mode-seed$seed.log | tail -1) (${SECONDS} s)" >> $out/table.txt
  done
done
echo done >> $out/table.txt

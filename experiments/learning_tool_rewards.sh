#!/usr/bin/env bash
# Tool rewards on and off on the calculator task: configs/grpo_tool_calc.py with the
# graded calculator (configs/tools/graded_calculator.yaml: step reward 0 for the call
# that first computes the answer, -0.05 for any other, calc_reward 1 when solved),
# GRPO and PPO, rollout.multi_turn.add_tool_rewards True and False, seeds 0 1 2: 12
# runs at once, sharing one GPU (each may take 6% of its memory), validation every 5
# steps. Prints one line per run (experiments/tool_rewards_table.py, which can be
# rerun on the same directory).
#   [OUT=dir] [PYTHON=python] experiments/learning_tool_rewards.sh
# Workdirs: $OUT/runs/<grpo|ppo>_<on|off>_seed<S>; logs: $OUT/logs/<name>.log.
set -uo pipefail
PYTHON=${PYTHON:-python}
OUT=${OUT:-runs/learning_tool_rewards}
mkdir -p "$OUT/runs" "$OUT/logs"
OUT=$(cd "$OUT" && pwd)  # a relative OUT is taken from where the script is started
cd "$(dirname "$0")/.."  # the tool yaml names its class by a path from the repo root
ppo_flags=(--config.algorithm.adv_estimator=gae --config.critic.ppo_mini_batch_size=16
           --config.critic.ppo_micro_batch_size=128)
names=()
for seed in 0 1 2; do
  for algo in grpo ppo; do
    for rewards in on off; do
      name="${algo}_${rewards}_seed${seed}"
      names+=("$name")
      flags=()
      [ "$algo" = ppo ] && flags=("${ppo_flags[@]}")
      add=$([ "$rewards" = on ] && echo True || echo False)
      ( SECONDS=0
        XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.06 \
          "$PYTHON" -m jrl.train --config="configs/grpo_tool_calc.py:seed=$seed" \
          --workdir="$OUT/runs/$name" \
          --config.rollout.multi_turn.tool_config_path=configs/tools/graded_calculator.yaml \
          --config.rollout.multi_turn.add_tool_rewards="$add" \
          --config.trainer.test_freq=5 "${flags[@]}" > "$OUT/logs/$name.log" 2>&1
        echo "$name: exit $? after ${SECONDS} s" ) &
    done
  done
done
wait
"$PYTHON" experiments/tool_rewards_table.py "$OUT/runs" "${names[@]}"

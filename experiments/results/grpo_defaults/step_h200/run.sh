#!/usr/bin/env bash
# The two norms of a layer recomputing their values in the backward pass (a rolled scan,
# remat none) against the tree before (before/, an export of 369cdc4): the same runs as
# ../ppo_80gb_h200/run.sh (the rolled backbone's fwd+bwd alone, traced, then the docs
# workload at the bench's defaults, sides alternating), which this calls.
#   OUT=dir RUNS="profile defaults" BUDGET_S=400 bash experiments/results/grpo_defaults/step_h200/run.sh
exec bash "$(dirname "$0")/../ppo_80gb_h200/run.sh" "$@"

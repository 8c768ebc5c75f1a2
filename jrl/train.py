"""Entry point: `python -m jrl.train --config=configs/<name>.py [--config.key=value ...]`.

Until the RL trainer lands, this prints the algorithms jrl implements and the
resolved configuration.
"""

from absl import app, flags
from ml_collections import config_flags

from jrl import advantages, losses

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")


def algorithm_table() -> str:
    rows = ["advantage estimators (algorithm.adv_estimator):"]
    for name, est in sorted(advantages.ESTIMATORS.items()):
        needs = [k for k, v in (("critic", est.needs_values), ("groups", est.needs_groups),
                                ("greedy baseline", est.needs_baseline)) if v]
        rows.append(f"  {name:<30} needs: {', '.join(needs) or '-'}")
    rows.append("policy losses (actor.policy_loss.loss_mode):")
    rows += [f"  {name}" for name in sorted(losses.POLICY_LOSSES)]
    rows.append(f"kl estimators: {', '.join(losses.KL_PENALTIES)}")
    return "\n".join(rows)


def main(argv):
    del argv
    print(algorithm_table())
    if _CONFIG.value is not None:
        print(_CONFIG.value)


if __name__ == "__main__":
    app.run(main)

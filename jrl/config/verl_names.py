"""verl's config keys that jrl names otherwise, so that a `--config.<verl key>` override
stops with the jrl key to use rather than the nearest spelling (docs/from_verl.md has
the whole map; keys named alike, less verl's `actor_rollout_ref.` prefix, are not here).
"""

from __future__ import annotations

from collections.abc import Collection

_GLOBAL = ("counted in sequences over all devices, not per GPU: verl's value times the "
           "number of GPUs")

# verl key -> (jrl key, a note or "").
RENAMED = {
    "data.max_response_length": ("rollout.response_length", ""),
    "data.shuffle": ("data.seed", "training prompts are always reshuffled each epoch, "
                     "with this seed"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (
        "model.remat", "True is model.remat='full'"),
    "actor_rollout_ref.actor.optim.warmup_style": ("actor.optim.lr_scheduler_type", ""),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (
        "actor.ppo_micro_batch_size", _GLOBAL),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": (
        "rollout.log_prob_micro_batch_size", _GLOBAL),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": (
        "rollout.log_prob_micro_batch_size", _GLOBAL + "; one key for old and reference "
        "log-probs"),
    "critic.ppo_micro_batch_size_per_gpu": ("critic.ppo_micro_batch_size", _GLOBAL),
    "critic.forward_micro_batch_size_per_gpu": (
        "rollout.log_prob_micro_batch_size", _GLOBAL + "; shared with the log-prob passes"),
    "custom_reward_function.path": ("reward.custom_fn", "one value, 'path/to/file.py:name'"),
    "custom_reward_function.name": ("reward.custom_fn", "one value, 'path/to/file.py:name'"),
    "actor_rollout_ref.hybrid_engine": (
        "rollout.devices", "devices of their own for the rollout (0: the training devices)"),
    "trainer.default_local_dir": ("--workdir", "a flag, not a config key"),
    "trainer.n_gpus_per_node": ("mesh.data", "jrl uses every device JAX sees, laid out by the "
                                "mesh.* keys; several hosts join through distributed.*"),
    "trainer.nnodes": ("distributed.num_processes", "jrl uses every device JAX sees; several "
                       "hosts join through the distributed.* keys"),
}

# verl's prefixes that jrl drops or shortens.
_PREFIXES = (("actor_rollout_ref.actor.", "actor."), ("actor_rollout_ref.rollout.", "rollout."),
             ("actor_rollout_ref.model.", "model."))


def suggestion(key: str, known: Collection[str]) -> str | None:
    """What to write instead of verl's `key` (jrl's key, with a note where the meaning
    differs), or None when `key` is not a verl key jrl knows; `known`: jrl's keys."""
    if key in RENAMED:
        target, note = RENAMED[key]
        return f"verl's {key} is {target} here" + (f" ({note})" if note else "")
    for verl, ours in _PREFIXES:
        if key.startswith(verl):
            target = ours + key[len(verl):]
            if target in known:
                return f"verl's {key} is {target} here"
    return None

"""GRPO on synthetic multi-digit arithmetic with the built-in character tokenizer."""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    config = ml_collections.ConfigDict()
    # Random seed; every source of randomness is split from it.
    config.seed = 0
    config.algorithm = ml_collections.ConfigDict()
    # Advantage estimator (verl's algorithm.adv_estimator).
    config.algorithm.adv_estimator = "grpo"
    return config

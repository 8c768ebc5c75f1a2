"""jrl: reinforcement-learning post-training for language models, in JAX."""

__version__ = "0.1.0"

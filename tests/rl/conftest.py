"""The tiny Hugging Face checkpoints of tests/models, for the shared-prompt tests here."""

from tests.models.conftest import hf_checkpoint  # noqa: F401

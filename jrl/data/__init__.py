"""Data: tokenizers (built-in character tokenizer, HF tokenizers from a local directory)."""

from jrl.data.tokenizers import CharTokenizer, HFTokenizer, Tokenizer

__all__ = ["CharTokenizer", "HFTokenizer", "Tokenizer"]

"""Rewards computed on the device: a JAX function of token ids (`reward.in_graph_fn`).

The host path decodes each response and calls a Python function with verl's
signature (`jrl.rewards.scoring`). A run that keeps whole RL steps on the device
has no host round trip, so its reward is a JAX function of the same arguments as
arrays, for one sample::

    fn(data_source, solution_ids, solution_mask, ground_truth_ids, ground_truth_mask)
        -> score | {"score": score, "acc": ..., ...}

- `data_source`: int32 scalar, the index of the row's `data_source` in the sorted
  list of the data sources (`encode_targets`' `sources`; e.g. with sources
  `["gsm8k", "synthetic/arithmetic"]` an arithmetic row has 1).
- `solution_ids` int32 `[R]`, `solution_mask` int32 `[R]`: the response, right-padded;
  the mask is 1 on its tokens up to and including the stop token (jrl's
  `response_mask`).
- `ground_truth_ids` int32 `[T]`, `ground_truth_mask` int32 `[T]`: the row's
  `reward_model.ground_truth` encoded without special tokens, right-padded
  (`encode_targets`).

It returns a float scalar, or a dict of float scalars holding "score"; its other
entries (e.g. "acc") are the reward's extras, as a host function's dict entries
are (logged as `reward_extra/<name>/mean`; "acc" is the validation headline).
`InGraphReward.score` vmaps it over the rows of a batch; it must trace with static
shapes (no Python branches on values) and make no host callbacks. `resolve` traces
it once on small dummy arrays, so such mistakes stop the run before anything
compiles, with a `ConfigError` naming `reward.in_graph_fn`.

`reward.in_graph_fn` is the built-in "exact_match" (`exact_match`), a file
"path/to/file.py:name" (loaded by `jrl.pyfile`, as `reward.custom_fn` is) or an
importable "package.module:name".
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jrl import pyfile
from jrl.data.dataset import Row, ground_truth
from jrl.errors import ConfigError, DataError
from jrl.rewards.scoring import describe_error

KEY = "reward.in_graph_fn"
BUILTINS = ("exact_match",)
SPEC_FORMS = "'exact_match', 'path/to/file.py:name' or 'package.module:name'"


@dataclasses.dataclass(frozen=True)
class InGraphReward:
    """A per-sample JAX reward function and its batched form.

    Attributes:
      fn: the per-sample function (see the module docstring for its arguments).
      name: the `reward.in_graph_fn` spec it was resolved from.
    """

    fn: Callable
    name: str

    def score(self, responses, response_mask, targets, target_mask, data_source):
        """Scores a batch of N responses; jittable (no host callbacks, static shapes).

        Args:
          responses: int `[N, R]` response token ids.
          response_mask: int `[N, R]`, 1 on each response's tokens (stop token included).
          targets: int `[N, T]` ground-truth ids of each sample's row (`encode_targets`,
            repeated for the samples of a prompt).
          target_mask: int `[N, T]`.
          data_source: int `[N]`, each row's index in the sorted data sources.

        Returns:
          (scores float32 `[N]`, extras {name: float32 `[N]`}), the dict entries of the
          function's return other than "score" (none when it returns a number).
        """
        n = responses.shape[0]
        for what, array in (("response_mask", response_mask), ("targets", targets),
                            ("target_mask", target_mask), ("data_source", data_source)):
            if array.shape[0] != n:
                raise ValueError(f"{what} has {array.shape[0]} rows for {n} responses")
        out = jax.vmap(self.fn)(*(jnp.asarray(a, jnp.int32) for a in (
            data_source, responses, response_mask, targets, target_mask)))
        if isinstance(out, Mapping):
            extras = {k: jnp.asarray(v, jnp.float32) for k, v in out.items() if k != "score"}
            return jnp.asarray(out["score"], jnp.float32), extras
        return jnp.asarray(out, jnp.float32), {}


# --------------------------------------------------------------------------- specs


def _split_spec(spec) -> tuple[str, str]:
    """(what is before the colon, the name after it); ConfigError when malformed."""
    if spec in BUILTINS:
        return "", spec
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{KEY}: {spec!r} is not valid; expected {SPEC_FORMS} (built-in: "
                          f"{list(BUILTINS)})")
    source, _, name = spec.rpartition(":")
    return source, name


def _is_file(source: str) -> bool:
    return source.endswith(".py") or "/" in source


def check_spec(spec) -> None:
    """Checks the form of a `reward.in_graph_fn` value, and that its file exists (the
    function itself is loaded and traced by `resolve`).

    Raises:
      ConfigError: naming the key and the valid forms.
    """
    source, name = _split_spec(spec)
    if spec in BUILTINS:
        return
    if _is_file(source):
        path, _ = pyfile.parse_spec(spec, KEY, SPEC_FORMS)
        if not path.is_file():
            raise ConfigError(f"{KEY}: file {str(path)!r} (from {spec!r}) does not exist")
        return
    if not (all(part.isidentifier() for part in source.split(".")) and name.isidentifier()):
        raise ConfigError(f"{KEY}: {spec!r} is not valid; expected {SPEC_FORMS}")


def _load(spec: str) -> Callable:
    """The user function a file or module spec names (checked by `check_spec` first)."""
    check_spec(spec)
    source, name = _split_spec(spec)
    try:
        if _is_file(source):
            fn = pyfile.load(spec, KEY, SPEC_FORMS)
        else:
            fn = getattr(importlib.import_module(source), name)
    except ConfigError:
        raise
    except Exception as err:  # importing runs user code: anything may fail
        hint = "" if _is_file(source) else (
            "; a module outside an installed package needs its directory on PYTHONPATH, or "
            "name the file: 'path/to/file.py:name'")
        raise ConfigError(f"{KEY}: loading {spec!r} failed: {describe_error(err)}{hint}"
                          ) from None
    if not callable(fn):
        raise ConfigError(f"{KEY}: {name!r} of {spec!r} is a {type(fn).__name__}, not a "
                          "function")
    return fn


def resolve(spec: str, tokenizer) -> InGraphReward:
    """The in-graph reward a `reward.in_graph_fn` value names, checked by tracing it once.

    Args:
      spec: "exact_match", "path/to/file.py:name" or "package.module:name".
      tokenizer: the run's tokenizer (the built-in reads its vocabulary).

    Raises:
      ConfigError: a malformed spec, a missing file, module or name, or a function
        that does not trace to float scalars without host callbacks (named).
    """
    fn = exact_match(tokenizer) if spec == "exact_match" else _load(spec)
    check_fn(fn, spec)
    return InGraphReward(fn=fn, name=spec)


# --------------------------------------------------------------------------- checks


def _primitive_names(jaxpr) -> set[str]:
    """Names of the primitives of a jaxpr and of the jaxprs nested in its equations."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns"):
                    names |= _primitive_names(sub)
    return names


def _output_problem(out) -> str | None:
    """What is wrong with a per-sample function's traced output, or None."""
    if isinstance(out, Mapping):
        if "score" not in out:
            return f"returned a dict without 'score' (keys: {sorted(out)})"
        items = out.items()
    else:
        items = [("score", out)]
    for key, value in items:
        shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
        if shape != () or dtype is None or not (
                jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
                or jnp.issubdtype(dtype, jnp.bool_)):
            what = "the score" if out is value else f"entry {key!r}"
            return (f"returned {what} as {type(value).__name__} of shape {shape} and dtype "
                    f"{dtype}; expected a real scalar per sample")
    return None


def check_fn(fn: Callable, spec: str, response_length: int = 5, target_length: int = 3) -> None:
    """Traces `fn` on one sample of dummy arrays: it must give real scalars (or a dict
    of them with "score") and call no host callback.

    Raises:
      ConfigError: naming `reward.in_graph_fn`, the spec and the problem.
    """
    args = (jax.ShapeDtypeStruct((), jnp.int32),
            *[jax.ShapeDtypeStruct((length,), jnp.int32)
              for length in (response_length, response_length, target_length, target_length)])
    try:
        jaxpr, out = jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception as err:  # user code: anything may fail while tracing
        raise ConfigError(f"{KEY}: {spec!r} does not trace as a JAX function of token ids: "
                          f"{describe_error(err)}; it must use jax.numpy on its arrays, with "
                          "no Python branches on their values") from None
    problem = _output_problem(out)
    callbacks = sorted(n for n in _primitive_names(jaxpr.jaxpr) if "callback" in n)
    if problem is None and callbacks:
        problem = f"calls the host ({', '.join(callbacks)}), which runs on the device cannot"
    if problem is not None:
        raise ConfigError(f"{KEY}: {spec!r} {problem}")


# --------------------------------------------------------------------------- targets


def encode_targets(tokenizer, rows: Sequence[Row], max_length: int | None = None,
                   sources: Sequence[str] | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """The rows' ground truths as token ids, for `InGraphReward.score` (host-side).

    Args:
      tokenizer: encodes `str(reward_model.ground_truth)` without special tokens.
      rows: verl rows.
      max_length: columns of the result (None: the longest ground truth's, at least 1).
      sources: the data sources to index (None: the sorted distinct sources of
        `rows`); pass the training set's to give validation rows the same indices.

    Returns:
      ids int32 `[N, T]` right-padded with the pad id, mask int32 `[N, T]`, data_source
      int32 `[N]` (each row's index in `sources`), and `sources`.

    Raises:
      DataError: a row (1-based) without a ground truth or a string data_source, a
        data_source not in `sources`, or a ground truth longer than `max_length`.
    """
    encoded, names = [], []
    for i, row in enumerate(rows, 1):
        truth, source = ground_truth(row), row.get("data_source")
        if truth is None:
            raise DataError(f"row {i}: field 'reward_model.ground_truth' is missing; "
                            f"{KEY} compares responses with it")
        if not isinstance(source, str):
            raise DataError(f"row {i}: field 'data_source' must be a string, got {source!r}")
        encoded.append(tokenizer.encode(str(truth), add_special_tokens=False))
        names.append(source)
        if max_length is not None and len(encoded[-1]) > max_length:
            raise DataError(f"row {i}: field 'reward_model.ground_truth' is "
                            f"{len(encoded[-1])} tokens, more than the {max_length} that "
                            f"{KEY} gives ground truths")
    sources = sorted(set(names)) if sources is None else list(sources)
    index = {name: k for k, name in enumerate(sources)}
    for i, name in enumerate(names, 1):
        if name not in index:
            raise DataError(f"row {i}: data_source {name!r} is not among {sources}")
    width = max([len(ids) for ids in encoded] + [1]) if max_length is None else max_length
    ids = np.full((len(rows), width), tokenizer.pad_token_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for row, truth_ids in enumerate(encoded):
        ids[row, :len(truth_ids)] = truth_ids
        mask[row, :len(truth_ids)] = 1
    return ids, mask, np.asarray([index[n] for n in names], np.int32).reshape(-1), sources


# --------------------------------------------------------------------------- exact_match


def token_tables(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Per-vocabulary tables, from each token decoded alone as `decode_responses` does.

    Returns:
      (silent bool `[V]`: the special tokens that decoding skips, and the stop tokens
      `tokenizer.eos_token_ids`; blank bool `[V]`: tokens whose text is only whitespace
      or empty, silent ones included).
    """
    ids = range(tokenizer.vocab_size)
    texts = [tokenizer.decode([i], skip_special_tokens=True) for i in ids]
    # Skipped as special: text with the specials, none without. A token that decodes
    # to "" either way (a SentencePiece "▁" alone) is blank, not silent.
    silent = np.asarray([text == "" and tokenizer.decode([i], skip_special_tokens=False) != ""
                         for i, text in zip(ids, texts, strict=True)], bool)
    silent[[i for i in tokenizer.eos_token_ids if i < len(silent)]] = True
    blank = np.asarray([not text.strip() for text in texts], bool) | silent
    return silent, blank


def _stripped(ids, mask, silent, blank, length: int):
    """A sequence's text tokens with blank tokens at either end dropped, left-aligned in
    `[length]` (-1 after them), and their count. Ids outside the tables count as text."""
    silent_t = silent.at[ids].get(mode="fill", fill_value=False)
    blank_t = blank.at[ids].get(mode="fill", fill_value=False)
    text = (mask > 0) & ~silent_t
    content = text & ~blank_t
    positions = jnp.arange(ids.shape[0])
    first = jnp.min(jnp.where(content, positions, ids.shape[0]))
    last = jnp.max(jnp.where(content, positions, -1))
    kept = text & (positions >= first) & (positions <= last)
    slots = jnp.where(kept, jnp.cumsum(kept) - 1, length)
    return jnp.full((length,), -1, jnp.int32).at[slots].set(ids, mode="drop"), kept.sum()


def exact_match(tokenizer) -> Callable:
    """The built-in "exact_match": 1.0 when the response equals the ground truth, up to
    surrounding whitespace, as `jrl.rewards.arithmetic.compute_score`'s exact match.

    Compared on ids: the response's tokens under its mask without the tokens that add no
    text (special tokens, which decoding skips, and the stop tokens), and with
    whitespace-only tokens at either end dropped, must equal the ground truth's ids
    treated the same way, token for token. Returns `{"score": x, "acc": x}`.

    Where it can differ from the host scorer: the host compares texts, this compares
    ids. With a character tokenizer (jrl's `CharTokenizer`) the two agree. A BPE
    tokenizer may spell the same text with other ids (" 42" as one token where the
    ground truth is "42", or "42" as "4" "2"), or glue whitespace to a word, which this
    then counts as text: such a response scores 0 here and 1 on the host. A stop token
    that is not a special token is text to the host but dropped here, and ids outside
    the tokenizer's vocabulary (a model's padded vocabulary) are text that never matches.
    """
    silent, blank = (jnp.asarray(table) for table in token_tables(tokenizer))

    def fn(data_source, solution_ids, solution_mask, ground_truth_ids, ground_truth_mask):
        del data_source
        length = max(solution_ids.shape[0], ground_truth_ids.shape[0])
        solution, num_solution = _stripped(solution_ids, solution_mask, silent, blank, length)
        truth, num_truth = _stripped(ground_truth_ids, ground_truth_mask, silent, blank, length)
        match = ((num_solution == num_truth) & jnp.all(solution == truth)).astype(jnp.float32)
        return {"score": match, "acc": match}

    return fn


__all__ = ["BUILTINS", "InGraphReward", "check_fn", "check_spec", "encode_targets",
           "exact_match", "resolve", "token_tables"]

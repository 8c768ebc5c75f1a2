"""In-graph rewards (`jrl.rewards.in_graph`): exact_match against the host scorer, user
functions, `encode_targets`, the `reward.in_graph_fn` config checks, jit and vmap."""

import json
import os
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from jrl.app import experiment
from jrl.config import settings
from jrl.data.tokenizers import CharTokenizer, HFTokenizer
from jrl.errors import ConfigError, DataError
from jrl.rewards import arithmetic, in_graph
from jrl.rewards.responses import decode_responses
from tests.tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALCULATOR_YAML = os.path.join(REPO, "configs", "tools", "calculator.yaml")
CHAR = CharTokenizer()
R = 6  # response columns


def _row(truth, source=arithmetic.DATA_SOURCE):
    return {"data_source": source, "reward_model": {"ground_truth": truth}}


def _responses(tok, texts, stops, extra=()):
    """Right-padded responses `[N, R]` of `texts` (+ a stop token where `stops`), cut to
    R columns, with masks; `extra[i]` ids follow row i's stop token unmasked."""
    ids = np.full((len(texts), R), tok.pad_token_id, np.int32)
    mask = np.zeros((len(texts), R), np.int32)
    for i, (text, stop) in enumerate(zip(texts, stops, strict=True)):
        row = (tok.encode(text) + [tok.eos_token_id] * stop)[:R]
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
        after = list(extra[i]) if i < len(extra) else []
        ids[i, len(row):len(row) + len(after)] = after
    return ids, mask


def _in_graph_scores(tok, ids, mask, truths, spec="exact_match"):
    reward = in_graph.resolve(spec, tok)
    targets, target_mask, source, _ = in_graph.encode_targets(tok, [_row(t) for t in truths])
    return jax.jit(reward.score)(ids, mask, targets, target_mask, source)


def _host_scores(tok, ids, mask, truths):
    texts = decode_responses(tok, ids, mask)
    return np.asarray([arithmetic.compute_score(None, text, truth)["score"]
                       for text, truth in zip(texts, truths, strict=True)], np.float32)


# (response text, ends with the stop token, ground truth, exact match by hand)
CHAR_CASES = [
    ("42", True, "42", 1.0),
    (" 42 ", True, "42", 1.0),  # whitespace around
    ("\n42\n", True, "42", 1.0),
    ("42", True, " 42\n", 1.0),  # whitespace around the ground truth
    ("42", True, 42, 1.0),  # a number as ground truth
    ("  42  ", False, "42", 1.0),  # truncated at R columns, no stop token
    ("42", False, "42", 1.0),  # missing stop token
    ("421", True, "42", 0.0),  # an extra token
    ("42+1=", True, "42", 0.0),
    ("", True, "42", 0.0),  # empty response: the stop token only
    ("", False, "42", 0.0),  # nothing at all
    ("   ", True, "42", 0.0),  # whitespace only
    ("43", True, "42", 0.0),  # a wrong digit
    ("4 2", True, "42", 0.0),  # whitespace inside counts
    ("4", False, "42", 0.0),  # too short
    ("7", True, "7", 1.0),
]


def test_exact_match_agrees_with_the_host_scorer_on_char_tokens():
    texts, stops, truths, expected = zip(*CHAR_CASES, strict=True)
    ids, mask = _responses(CHAR, texts, stops)
    scores, extras = _in_graph_scores(CHAR, ids, mask, truths)
    chex.assert_trees_all_equal(_host_scores(CHAR, ids, mask, truths), np.float32(expected))
    chex.assert_trees_all_equal(np.asarray(scores), np.float32(expected))
    chex.assert_trees_all_equal(np.asarray(extras["acc"]), np.float32(expected))
    assert set(extras) == {"acc"}


def test_exact_match_skips_special_tokens_and_ignores_what_follows_the_mask():
    ids, mask = _responses(CHAR, ["42", "42", "4"], [True, True, True],
                           extra=[CHAR.encode("9"), [], []])
    ids[1, :3] = [CHAR.encode("4")[0], CHAR.bos_token_id, CHAR.encode("2")[0]]  # 4 <bos> 2
    ids[2, 1] = 120  # an id past the tokenizer's vocabulary (a model's padded one)
    mask[2, :2] = 1
    scores, _ = _in_graph_scores(CHAR, ids, mask, ["42", "42", "4"])
    chex.assert_trees_all_equal(np.asarray(scores), np.float32([1, 1, 0]))
    assert decode_responses(CHAR, ids[:2], mask[:2]) == ["42", "42"]


@pytest.fixture(scope="module")
def bpe():
    """A small byte-level BPE tokenizer trained offline (" 42" and "42" are single tokens)."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["the answer is 42 and 421 and 7", "what is 12 plus 30? 42"] * 20,
                            trainer)
    return HFTokenizer(raw, {"eos_token": "<|im_end|>", "pad_token": "<pad>"})


def test_exact_match_on_a_bpe_tokenizer(bpe):
    assert len(bpe.encode("42")) == 1 and len(bpe.encode(" 42")) == 1
    cases = [("42", True, 1.0), ("42\n", True, 1.0), ("\n42", True, 1.0), ("421", True, 0.0),
             ("4 2", True, 0.0), ("", True, 0.0), ("42", False, 1.0), ("43", True, 0.0),
             ("<|im_start|>42", True, 1.0)]
    texts, stops, expected = zip(*cases, strict=True)
    ids, mask = _responses(bpe, texts, stops)
    truths = ["42"] * len(texts)
    scores, _ = _in_graph_scores(bpe, ids, mask, truths)
    chex.assert_trees_all_equal(_host_scores(bpe, ids, mask, truths), np.float32(expected))
    chex.assert_trees_all_equal(np.asarray(scores), np.float32(expected))


def test_exact_match_differs_from_the_host_where_bpe_spells_text_otherwise(bpe):
    # " 42" is one token, not a blank token and "42": the host strips the text, ids cannot.
    ids, mask = _responses(bpe, [" 42"], [True])
    scores, _ = _in_graph_scores(bpe, ids, mask, ["42"])
    assert _host_scores(bpe, ids, mask, ["42"]).tolist() == [1.0]
    assert np.asarray(scores).tolist() == [0.0]


def test_token_tables_of_the_char_tokenizer():
    silent, blank = in_graph.token_tables(CHAR)
    assert silent.shape == blank.shape == (CHAR.vocab_size,)
    assert np.flatnonzero(silent).tolist() == [0, 1, 2]  # pad, bos, eos
    assert np.flatnonzero(blank).tolist() == [0, 1, 2, *CHAR.encode(" \n")]


def test_token_tables_of_a_bpe_tokenizer(bpe):
    silent, blank = in_graph.token_tables(bpe)
    specials = [bpe.encode(t)[0] for t in ("<pad>", "<|im_start|>", "<|im_end|>")]
    assert np.flatnonzero(silent).tolist() == sorted(specials)
    assert blank[bpe.encode(" ")].all() and blank[bpe.encode("\n")].all()
    assert not blank[bpe.encode(" 42")].any()


# --------------------------------------------------------------------------- user functions

USER_FILE = textwrap.dedent('''
    import jax
    import jax.numpy as jnp


    def first_token(data_source, solution_ids, solution_mask, ground_truth_ids,
                    ground_truth_mask):
        return jnp.where(solution_mask[0] > 0, solution_ids[0] == ground_truth_ids[0], False)


    def with_extras(data_source, solution_ids, solution_mask, ground_truth_ids,
                    ground_truth_mask):
        return {"score": data_source * 10.0, "length": solution_mask.sum(),
                "truth_length": ground_truth_mask.sum()}


    def branches(data_source, solution_ids, solution_mask, ground_truth_ids, ground_truth_mask):
        return 1.0 if solution_ids[0] == ground_truth_ids[0] else 0.0


    def no_score(data_source, solution_ids, solution_mask, ground_truth_ids, ground_truth_mask):
        return {"acc": 1.0}


    def per_token(data_source, solution_ids, solution_mask, ground_truth_ids, ground_truth_mask):
        return solution_mask * 1.0


    def calls_host(data_source, solution_ids, solution_mask, ground_truth_ids,
                   ground_truth_mask):
        shape = jax.ShapeDtypeStruct((), jnp.float32)
        return jax.pure_callback(lambda x: x.sum().astype("float32"), shape, solution_ids)


    NOT_A_FUNCTION = 3
''')


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return str(path)


def test_user_function_from_a_file(user_file):
    ids, mask = _responses(CHAR, ["42", "5", ""], [True, True, False])
    scores, extras = _in_graph_scores(CHAR, ids, mask, ["4", "42", "1"],
                                      spec=f"{user_file}:first_token")
    assert extras == {}
    chex.assert_trees_all_equal(np.asarray(scores), np.float32([1, 0, 0]))


def test_a_dict_return_gives_extras_and_data_source_is_the_sorted_index(user_file):
    reward = in_graph.resolve(f"{user_file}:with_extras", CHAR)
    rows = [_row("12", "zeta"), _row("7", "alpha"), _row("345", "mid")]
    targets, target_mask, source, sources = in_graph.encode_targets(CHAR, rows)
    assert sources == ["alpha", "mid", "zeta"] and source.tolist() == [2, 0, 1]
    ids, mask = _responses(CHAR, ["1", "22", "333"], [True, True, False])
    scores, extras = jax.jit(reward.score)(ids, mask, targets, target_mask, source)
    chex.assert_trees_all_equal(np.asarray(scores), np.float32([20, 0, 10]))
    chex.assert_trees_all_equal(np.asarray(extras["length"]), np.float32([2, 3, 3]))
    chex.assert_trees_all_equal(np.asarray(extras["truth_length"]), np.float32([2, 1, 3]))
    assert {k: v.dtype for k, v in extras.items()} == {"length": jnp.float32,
                                                       "truth_length": jnp.float32}


def test_user_function_from_a_module(tmp_path, monkeypatch):
    package = tmp_path / "my_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scores.py").write_text(USER_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = in_graph.resolve("my_rewards.scores:first_token", CHAR)
    assert reward.name == "my_rewards.scores:first_token"
    ids, mask = _responses(CHAR, ["4"], [True])
    scores, _ = _in_graph_scores(CHAR, ids, mask, ["4"], spec=reward.name)
    assert np.asarray(scores).tolist() == [1.0]


@pytest.mark.parametrize("name, message", [
    ("branches", "does not trace as a JAX function of token ids: TracerBoolConversionError"),
    ("no_score", "returned a dict without 'score' (keys: ['acc'])"),
    ("per_token", "returned the score as ShapeDtypeStruct of shape (5,)"),
    ("calls_host", "calls the host (pure_callback)"),
    ("NOT_A_FUNCTION", "'NOT_A_FUNCTION' of"),
    ("missing", "defines no 'missing'; its public callables are"),
])
def test_bad_user_functions_stop_before_compiling(user_file, name, message):
    with pytest.raises(ConfigError) as err:
        in_graph.resolve(f"{user_file}:{name}", CHAR)
    assert str(err.value).startswith("reward.in_graph_fn")
    assert message in str(err.value)


def test_a_file_that_fails_to_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(ConfigError) as err:
        in_graph.resolve(f"{path}:fn", CHAR)
    assert str(err.value).startswith(f"reward.in_graph_fn: loading '{path}:fn' failed: "
                                     "ImportError: importing")
    assert "no GPU here" in str(err.value) and "PYTHONPATH" not in str(err.value)


@pytest.mark.parametrize("spec, message", [
    ("exact", "reward.in_graph_fn: 'exact' is not valid; expected 'exact_match', "
              "'path/to/file.py:name' or 'package.module:name' (built-in: ['exact_match'])"),
    ("no/such.py:fn", "reward.in_graph_fn: file 'no/such.py' (from 'no/such.py:fn') does "
                      "not exist"),
    ("no-such.module:fn", "reward.in_graph_fn: 'no-such.module:fn' is not valid; expected "
                          "'exact_match', 'path/to/file.py:name' or 'package.module:name'"),
    (":fn", "reward.in_graph_fn: ':fn' is not valid; expected 'exact_match', "),
    ("no_such_module_xyz:fn", "reward.in_graph_fn: loading 'no_such_module_xyz:fn' failed: "
                              "ModuleNotFoundError"),
])
def test_bad_specs(spec, message):
    with pytest.raises(ConfigError) as err:
        in_graph.resolve(spec, CHAR)
    assert str(err.value).startswith(message)


# --------------------------------------------------------------------------- encode_targets


def test_encode_targets_pads_to_the_longest():
    ids, mask, source, sources = in_graph.encode_targets(
        CHAR, [_row("12"), _row(7), _row("345", "b")])
    digit = CHAR.encode("0")[0]  # digits are consecutive ids from here
    chex.assert_trees_all_equal(ids, np.int32([[digit + 1, digit + 2, 0], [digit + 7, 0, 0],
                                               [digit + 3, digit + 4, digit + 5]]))
    chex.assert_trees_all_equal(mask, np.int32([[1, 1, 0], [1, 0, 0], [1, 1, 1]]))
    assert sources == ["b", arithmetic.DATA_SOURCE] and source.tolist() == [1, 1, 0]
    wide, wide_mask, _, _ = in_graph.encode_targets(CHAR, [_row("12")], max_length=4)
    assert wide.tolist() == [[digit + 1, digit + 2, 0, 0]] and wide_mask.tolist() == [[1, 1, 0, 0]]


def test_encode_targets_errors_name_the_row():
    rows = [_row("12"), _row("7"), _row("345")]
    with pytest.raises(DataError, match=r"^row 3: field 'reward_model.ground_truth' is 3 "
                                        r"tokens, more than the 2 that reward.in_graph_fn"):
        in_graph.encode_targets(CHAR, rows, max_length=2)
    with pytest.raises(DataError, match=r"^row 2: field 'reward_model.ground_truth' is missing"):
        in_graph.encode_targets(CHAR, [_row("1"), {"data_source": "x"}])
    with pytest.raises(DataError, match=r"^row 1: data_source 'other' is not among \['a'\]"):
        in_graph.encode_targets(CHAR, [_row("1", "other")], sources=["a"])


# --------------------------------------------------------------------------- jit and vmap


def test_score_under_jit_and_vmap_over_runs():
    reward = in_graph.resolve("exact_match", CHAR)
    truths = ["42", "7", "42"]
    targets, target_mask, source, _ = in_graph.encode_targets(CHAR, [_row(t) for t in truths])
    runs = [_responses(CHAR, texts, [True] * 3) for texts in (["42", "7", "4"],
                                                              [" 7", " 7 ", "42\n"])]
    ids = jnp.stack([r[0] for r in runs])  # [runs, N, R]
    mask = jnp.stack([r[1] for r in runs])

    @jax.jit
    def all_runs(ids, mask):
        return jax.vmap(reward.score, in_axes=(0, 0, None, None, None))(
            ids, mask, targets, target_mask, source)

    scores, extras = all_runs(ids, mask)
    chex.assert_shape(scores, (2, 3))
    chex.assert_trees_all_equal(np.asarray(scores), np.float32([[1, 1, 0], [0, 1, 1]]))
    chex.assert_trees_all_equal(extras["acc"], scores)
    for run in range(2):
        one, _ = reward.score(ids[run], mask[run], targets, target_mask, source)
        chex.assert_trees_all_equal(one, scores[run])


def test_score_checks_row_counts():
    reward = in_graph.resolve("exact_match", CHAR)
    ids, mask = _responses(CHAR, ["1", "2"], [True, True])
    targets, target_mask, source, _ = in_graph.encode_targets(CHAR, [_row("1")])
    with pytest.raises(ValueError, match="targets has 1 rows for 2 responses"):
        reward.score(ids, mask, targets, target_mask, source)


# --------------------------------------------------------------------------- config


def _settings(**overrides):
    return settings.from_config(tiny_config(**overrides), stop_token_ids=CHAR.eos_token_ids,
                                pad_token_id=CHAR.pad_token_id, num_train_rows=90)


def test_the_key_defaults_to_host_rewards_and_takes_a_spec(user_file):
    assert _settings().reward.in_graph_fn is None
    assert _settings(**{"reward.in_graph_fn": "exact_match"}).reward.in_graph_fn == "exact_match"
    spec = f"{user_file}:first_token"
    assert _settings(**{"reward.in_graph_fn": spec}).reward.in_graph_fn == spec
    with pytest.raises(ConfigError, match=r"^reward.in_graph_fn: 'exact' is not valid"):
        _settings(**{"reward.in_graph_fn": "exact"})


# The conflicting key, and the overrides that set it given (user_file, tmp_path).
CONFLICTS = [
    ("reward.custom_fn", lambda f, d: {"reward.custom_fn": f"{f}:first_token"}),
    ("reward_model.enable", lambda f, d: {"reward_model.enable": True,
                                          "reward_model.model.path": str(d)}),
    ("reward_model.overlong_buffer.enable", lambda f, d: {
        "reward_model.overlong_buffer.enable": True, "reward_model.overlong_buffer.len": 2}),
    ("rollout.multi_turn.enable", lambda f, d: {
        "rollout.multi_turn.enable": True,
        "rollout.multi_turn.tool_config_path": CALCULATOR_YAML}),
    ("algorithm.filter_groups.enable", lambda f, d: {"algorithm.filter_groups.enable": True}),
    ("algorithm.adv_estimator", lambda f, d: {"algorithm.adv_estimator": "remax"}),
]


@pytest.mark.parametrize("key, overrides", CONFLICTS, ids=[key for key, _ in CONFLICTS])
def test_host_only_rewards_and_features_conflict(key, overrides, user_file, tmp_path):
    overrides = overrides(user_file, tmp_path)
    _settings(**overrides)  # valid without the in-graph reward
    with pytest.raises(ConfigError) as err:
        _settings(**overrides, **{"reward.in_graph_fn": "exact_match"})
    assert str(err.value).startswith(
        f"reward.in_graph_fn: 'exact_match' scores on the device and cannot be combined with "
        f"{key}=")
    assert str(err.value).endswith("; unset one of them")


def test_rows_an_in_graph_reward_scores_are_not_held_to_the_built_in_rewards(tmp_path):
    row = {"prompt": "1+2=", "data_source": "my_task",
           "reward_model": {"ground_truth": "3", "style": "rule"}}
    for split in ("train", "val"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    files = {"data.train_files": str(tmp_path / "train.jsonl"),
             "data.val_files": str(tmp_path / "val.jsonl"), "data.max_prompt_length": 8}
    with pytest.raises(DataError, match="field 'data_source' is 'my_task', which has no reward"):
        experiment.build_data(settings.experiment_from_config(tiny_config(**files)), CHAR)
    config = tiny_config(**files, **{"reward.in_graph_fn": "exact_match"})
    train_rows, _ = experiment.build_data(settings.experiment_from_config(config), CHAR)
    assert [r["data_source"] for r in train_rows] == ["my_task"]

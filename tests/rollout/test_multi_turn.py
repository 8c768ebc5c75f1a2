"""Multi-turn rollouts: the kept cache gives the log-probs of the whole row, and the
rows' tokens and masks are the chat template applied to the whole conversation."""

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import tools as tools_lib
from jrl.data.tokenizers import CharTokenizer, HFTokenizer
from jrl.models import ModelConfig, init_params
from jrl.models.cache import TRASH_PAGE
from jrl.rl import logprobs
from jrl.rollout import multi_turn
from jrl.rollout.sampler import SamplingConfig
from tests import char_tokenizer
from tests.tracing import decode_masks

CHAR = CharTokenizer()


def _tiny_model(**overrides):
    return ModelConfig.preset("tiny", vocab_size=CHAR.vocab_size, hidden_size=32,
                              intermediate_size=64, num_layers=2, head_dim=8, **overrides)


class _Echo(tools_lib.Tool):
    """Answers every call with a fixed short text."""

    def execute(self, instance_id, arguments):
        return "42", 0.5, {}


_ECHO_SCHEMA = {"type": "function", "function": {
    "name": "echo", "description": "echo", "parameters": {"type": "object", "properties": {}}}}


def _prompts(texts, length):
    ids = np.zeros((len(texts), length), np.int32)
    mask = np.zeros((len(texts), length), np.int32)
    for i, text in enumerate(texts):
        tokens = CHAR.encode(text)
        ids[i, length - len(tokens):] = tokens
        mask[i, length - len(tokens):] = 1
    return ids, mask


@pytest.mark.parametrize("stop_chars", ["aeiou\n", "a\n"])
def test_log_probs_of_the_whole_row_equal_the_samplers_turn_by_turn(monkeypatch, stop_chars):
    """Every turn ends at a frequent token and calls a tool: rows of several turns, tool
    blocks between them and rows cut by the cache's end mid-turn. One forward over each
    compact row (prompt, turns and tool blocks) gives the sampler's log-probs (fp32)."""
    config = _tiny_model(decode_attention_impl="xla")
    params = init_params(config, jax.random.key(1))
    monkeypatch.setattr(tools_lib, "parse_tool_calls",
                        lambda text, fmt: ([tools_lib.ToolCall("echo", {})], []))
    stops = tuple(CHAR.encode(stop_chars))
    sampling = SamplingConfig(n=2, max_new_tokens=120, stop_token_ids=(CHAR.eos_token_id,),
                              pad_token_id=CHAR.pad_token_id)
    mt = multi_turn.MultiTurnConfig(max_assistant_turns=6, max_user_turns=6,
                                    max_tool_response_tokens=24, turn_stop_ids=stops)
    ids, mask = _prompts(["User: hi\nAssistant: ", "User: 12*3?\nAssistant: "], 24)
    out = multi_turn.generate(params, ids, mask, jax.random.key(7), sampling=sampling,
                              config=config, tokenizer=CHAR,
                              tools={"echo": _Echo({}, _ECHO_SCHEMA)}, mt=mt)
    m = out.metrics
    assert m["num_turns/max"] >= 3 and m["multi_turn/segments"] >= 3
    if stop_chars == "a\n":  # long turns: some rows are cut by the cache's end and go on
        assert m["multi_turn/cache_cuts"] > 0
    block = "Tool: 42\nAssistant: "
    for row in range(4):
        real = out.attention_mask[row] > 0
        tokens, trained = out.responses[row, real].tolist(), out.response_mask[row, real]
        # Each run of context-only tokens is the rendered tool message: after a turn ended
        # by "\n" (the template's own turn end), the rest; after any other stop, a "\n" too.
        runs = [(i, j) for i, j in _runs(trained == 0)]
        for i, j in runs:
            closing = "" if tokens[i - 1] == CHAR.encode("\n")[0] else "\n"
            assert CHAR.decode(tokens[i:j]) == closing + block
        assert np.all(out.rollout_log_probs[row][out.response_mask[row] == 0] == 0)
    # Each call rewarded 0.5; every block answers one (a call whose block would pass the
    # budget ends its row).
    np.testing.assert_array_equal(out.tool_rewards, 0.5 * out.tool_calls)
    assert np.all(out.tool_calls >= _calls_per_row(out, block))
    assert np.all(out.tool_calls <= _calls_per_row(out, block) + 1)
    want, _ = logprobs.response_log_probs(
        params, jnp.asarray(out.prompt_ids), jnp.asarray(out.prompt_mask),
        jnp.asarray(out.responses), jnp.asarray(out.attention_mask), config=config,
        temperature=1.0, chunk_size=16)
    trained = out.response_mask > 0
    np.testing.assert_allclose(out.rollout_log_probs[trained], np.asarray(want)[trained],
                               atol=1e-5, rtol=0)


def test_rows_not_decoding_attend_to_the_new_slot_alone(monkeypatch):
    """In a segment's decode steps the forward gets, for a row not decoding (its turn
    ended, or it waits), a mask of the new slot alone, so the decode kernels read one
    block of its cache; a decoding row keeps its own mask (its filled slots and the new
    one). The rollout is the one every row's own mask gives."""
    config = _tiny_model()
    params = init_params(config, jax.random.key(1))
    monkeypatch.setattr(tools_lib, "parse_tool_calls",
                        lambda text, fmt: ([tools_lib.ToolCall("echo", {})], []))
    kept, decoding_mask = {}, multi_turn.decoding_mask

    def recording_mask(key_mask, slot, running):
        jax.debug.callback(lambda m, s, r: kept.__setitem__(int(s), (np.asarray(m),
                                                                     np.asarray(r))),
                           key_mask, slot, running)
        return decoding_mask(key_mask, slot, running)

    monkeypatch.setattr(multi_turn, "decoding_mask", recording_mask)
    attended = decode_masks(monkeypatch, multi_turn)  # what each decode step's forward got
    sampling = SamplingConfig(n=2, max_new_tokens=80, stop_token_ids=(CHAR.eos_token_id,),
                              pad_token_id=CHAR.pad_token_id)
    mt = multi_turn.MultiTurnConfig(max_assistant_turns=4, max_user_turns=4,
                                    max_tool_response_tokens=24,
                                    turn_stop_ids=tuple(CHAR.encode("aeiou\n")))
    ids, mask = _prompts(["User: hi\nAssistant: ", "User: 12*3?\nAssistant: "], 24)
    def run():
        return multi_turn.generate(params, ids, mask, jax.random.key(7), sampling=sampling,
                                   config=config, tokenizer=CHAR,
                                   tools={"echo": _Echo({}, _ECHO_SCHEMA)}, mt=mt)

    out = run()
    jax.effects_barrier()
    assert attended and sorted(attended) == sorted(kept)  # one mask a decode step
    idle = 0
    for slot, got in attended.items():
        key_mask, running = kept[slot]
        only_new = np.arange(got.shape[1]) == slot
        np.testing.assert_array_equal(got[~running], np.broadcast_to(only_new, got[~running].shape))
        np.testing.assert_array_equal(got[running], key_mask[running])
        assert np.all(got[running].sum(axis=1) > 1) and np.all(got[running][:, slot] == 1)
        idle += int((~running).sum())
    assert idle > 0  # some rows waited while others decoded
    # Their outputs are discarded: with every row's own mask the rollout is the same.
    traced = []

    def own_mask(key_mask, slot, running):
        traced.append(slot)
        return key_mask

    monkeypatch.setattr(multi_turn, "decoding_mask", own_mask)
    plain = run()
    assert traced  # the programs were traced afresh through the patch
    for field in ("responses", "attention_mask", "rollout_log_probs"):
        np.testing.assert_array_equal(getattr(plain, field), getattr(out, field), err_msg=field)


# (stop characters, model, page size, pool pages): turns ended at a frequent token (several
# turns a row, rows finishing in between); at a rare one (rows cut by the cache's end
# mid-turn), with adapters applied at every step (LoRA, unmerged) and pages of one slot;
# Gemma's soft-capping and sliding-window layers; pools of 17 and 39 pages for six rows
# of up to 16 and 31 (rows preempted and prefilled again in blocks, one row waiting
# from the start, rows cut by the cache's end).
PAGED_CASES = [("aeiou\n", "tiny", 8, 0), ("a\n", "lora", 1, 0), ("aeiou\n", "gemma", 16, 0),
               ("aeiou\n", "tiny", 8, 18), ("a\n", "tiny", 4, 40)]


@pytest.mark.parametrize("stop_chars,model,page_size,num_pages", PAGED_CASES,
                         ids=["turns", "cache_cuts_lora_page_of_one", "gemma", "preempted",
                              "preempted_cache_cuts"])
def test_paged_multi_turn_rollouts_equal_the_contiguous_caches(monkeypatch, stop_chars, model,
                                                               page_size, num_pages):
    """`rollout.kv_cache=paged`: the contiguous cache's rollout bit for bit on XLA:CPU
    (tokens, masks, log-probs, turns); with a pool too small for every row, rows are
    preempted and their tokens so far prefilled again, which gives the same tokens and
    log-probs up to float32 rounding. After every program the pool's pages are split
    exactly between the free stack and the rows, each of which holds the pages of its
    real tokens (its key mask: none for a row preempted or finished)."""
    from tests.models.test_lora import _randomise_b
    if model == "gemma":
        config = dataclasses.replace(
            ModelConfig.preset("tiny-gemma"), vocab_size=CHAR.vocab_size, hidden_size=32,
            intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            sliding_window=5, decode_attention_impl="xla")
    else:
        config = _tiny_model(decode_attention_impl="xla",
                             **(dict(lora_rank=4, lora_alpha=8.0) if model == "lora" else {}))
    params = init_params(config, jax.random.key(1))
    if model == "lora":
        params = _randomise_b(params, 2)
    monkeypatch.setattr(tools_lib, "parse_tool_calls",
                        lambda text, fmt: ([tools_lib.ToolCall("echo", {})], []))
    mt = multi_turn.MultiTurnConfig(max_assistant_turns=6, max_user_turns=6,
                                    max_tool_response_tokens=24,
                                    turn_stop_ids=tuple(CHAR.encode(stop_chars)))
    ids, mask = _prompts(["User: hi\nAssistant: ", "User: 12*3?\nAssistant: ", "Hi"], 24)
    contiguous = SamplingConfig(n=2, max_new_tokens=100, stop_token_ids=(CHAR.eos_token_id,),
                                pad_token_id=CHAR.pad_token_id)
    run = lambda sampling: multi_turn.generate(
        params, ids, mask, jax.random.key(7), sampling=sampling, config=config,
        tokenizer=CHAR, tools={"echo": _Echo({}, _ECHO_SCHEMA)}, mt=mt)
    want = run(contiguous)
    states, jit_sampler = [], multi_turn.jit_sampler

    def recorded(fun, sampling, **kwargs):  # each program's state, and the rows ended
        program = jit_sampler(fun, sampling, **kwargs)

        def call(*args, **kw):
            state = program(*args, **kw)
            ended = args[6] if fun is multi_turn.resume else None
            states.append((jax.device_get(state), None if ended is None else np.asarray(ended)))
            return state
        return call

    monkeypatch.setattr(multi_turn, "jit_sampler", recorded)
    got = run(dataclasses.replace(contiguous, kv_cache="paged", page_size=page_size,
                                  num_pages=num_pages))
    for field in ("responses", "response_mask", "attention_mask", "tool_calls", "tool_rewards"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    if num_pages:
        np.testing.assert_allclose(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5)
        assert got.preemptions.sum() > 0 and got.preemptions.min() == 0
        assert got.metrics["multi_turn/segments"] > want.metrics["multi_turn/segments"]
    else:
        np.testing.assert_array_equal(got.rollout_log_probs, want.rollout_log_probs)
        timed = lambda metrics: {k: v for k, v in metrics.items() if "latency" not in k}
        assert timed(got.metrics) == timed(want.metrics)
        np.testing.assert_array_equal(got.preemptions, 0)
    assert want.page_usage is None and want.preemptions is None
    assert want.metrics["multi_turn/segments"] >= 3
    if stop_chars == "a\n":
        assert want.metrics["multi_turn/cache_cuts"] > 0
    num_rows, prompt_len = 6, 24
    num_pages = num_pages or num_rows * -(-(prompt_len + 100) // page_size) + 1
    finished, peak = np.zeros(num_rows, bool), 0
    for state, ended in states:
        if ended is not None:
            finished |= ended
        pages = state.pages
        assert pages.free.shape == (num_pages,)
        table = state.cache.block_table
        held = [set(row[row != TRASH_PAGE].tolist()) for row in table]
        free = set(pages.free[:pages.num_free].tolist())
        assert len(free) == pages.num_free and TRASH_PAGE not in free
        assert sum(map(len, held)) + len(free) == num_pages - 1
        assert set().union(free, *held) == set(range(1, num_pages))
        tokens = state.key_mask.sum(axis=1)
        for row in range(num_rows):
            want_pages = 0 if finished[row] else -(-int(tokens[row]) // page_size)
            assert len(held[row]) == want_pages, (row, held[row], tokens[row])
        peak = max(peak, num_pages - 1 - int(pages.num_free))
        assert peak <= pages.peak <= num_pages - 1
    assert finished.any()  # some rows gave their pages back before the rollout ended
    # 17 pages admit five prompts of 3, 3, 3, 3 and 1 pages, a page kept free for each
    # other row: the sixth waits from the start, drawing nothing in the first segment.
    np.testing.assert_array_equal(states[0][0].seg_len == 0,
                                  np.arange(6) == 5 if num_pages == 18 else np.zeros(6, bool))
    assert got.page_usage == states[-1][0].pages.peak / (num_pages - 1)
    assert 0 < got.page_usage <= 1


def test_paged_multi_turn_settings_are_checked():
    """Fewer decode slots than rows, or a pool too small for one row at full length:
    stopped before compiling, naming the key."""
    for key, value, match in (
            ("max_num_seqs", 4, "rollout.max_num_seqs=4 is not supported with "
                                "rollout.multi_turn.enable=True"),
            ("num_pages", 26, r"rollout.num_pages=26 is too few for one sequence: a row of 4 "
                              r"prompt \+ 100 response slots")):
        sampling = SamplingConfig(n=2, max_new_tokens=100, kv_cache="paged", page_size=4,
                                  **{key: value})
        with pytest.raises(ValueError, match=match):
            multi_turn.generate(None, np.ones((1, 4), np.int32), np.ones((1, 4), np.int32),
                                jax.random.key(0), sampling=sampling, config=None,
                                tokenizer=CHAR, tools={}, mt=multi_turn.MultiTurnConfig())
    multi_turn.check_paged(dataclasses.replace(sampling, num_pages=27), 4)  # 26 pages + trash


def _runs(flags):
    """(start, end) of each run of True in `flags`."""
    edges = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))


def _calls_per_row(out, block):
    """Tool blocks in each row, counted from its tokens."""
    return np.asarray([CHAR.decode(out.responses[row, out.attention_mask[row] > 0]).count(block)
                       for row in range(out.responses.shape[0])], np.float32)


# ------------------------------------------------ the host's rows equal the whole template

QWEN_STYLE_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory):
    """A character-level HF tokenizer with Qwen's special tokens and tool-role template."""
    path = tmp_path_factory.mktemp("qwen_style")
    return HFTokenizer.from_pretrained(char_tokenizer.write(path, _SPECIAL, QWEN_STYLE_TEMPLATE))


def _by_hand(text: str, specials) -> list[str]:
    """The tokens of `text` for a character-level vocabulary: each special token whole,
    every other character alone (an independent tokenisation)."""
    pattern = "|".join(re.escape(s) for s in specials)
    pieces = []
    for part in re.split(f"({pattern})", text) if specials else [text]:
        pieces += [part] if part in specials else list(part)
    return pieces


def _scripted(monkeypatch, turns_per_row):
    """Replaces the device programs (host functions, not jitted): row r's segment k is
    `turns_per_row[r][k]` (token ids, the last one ending the turn); records the blocks
    the host appends."""
    blocks = []

    def segment(k, num_rows, used, prompt_lengths, width=600):
        seg = np.zeros((num_rows, width), np.int32)
        lengths = np.zeros(num_rows, np.int32)
        for r, turns in enumerate(turns_per_row):
            if k < len(turns):
                seg[r, :len(turns[k])], lengths[r] = turns[k], len(turns[k])
        used = used + lengths
        # The cache holds the prompt and every response token but the pending one (a key
        # mask of one column summing to that).
        key_mask = (prompt_lengths + used - 1)[:, None]
        return types.SimpleNamespace(
            k=k, seg_tokens=seg, seg_log_probs=np.full(seg.shape, -0.5, np.float32),
            seg_len=lengths, turn_ended=lengths > 0, active=np.zeros(num_rows, bool), pages=None,
            used=used, key_mask=key_mask, prompt_lengths=prompt_lengths,
            last_tokens=np.asarray([t[min(k, len(t) - 1)][-1] for t in turns_per_row], np.int32))

    def start(params, ids, mask, rng, **kw):
        return segment(0, len(turns_per_row), np.zeros(len(turns_per_row), np.int32),
                       np.asarray(mask).sum(axis=1))

    def resume(params, state, block_ids, block_mask, added, lacking, finished, rng, **kw):
        blocks.append((np.asarray(block_ids), np.asarray(block_mask), np.asarray(added)))
        # Each block is all its row's cache lacks: no row is prefilled again here.
        sent = np.asarray(block_mask).sum(axis=1)
        np.testing.assert_array_equal(np.asarray(lacking)[sent > 0], sent[sent > 0])
        return segment(state.k + 1, len(turns_per_row), state.used + added,
                       state.prompt_lengths)

    monkeypatch.setattr(multi_turn, "start", start)
    monkeypatch.setattr(multi_turn, "resume", resume)
    monkeypatch.setattr(multi_turn, "jit_sampler", lambda fun, sampling, **kwargs: fun)
    return blocks


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>'
TWO_CALLS = CALL + "\n" + CALL.replace("123*456", "7-9")


@pytest.mark.parametrize("kind", ["hf", "char"])
def test_rows_equal_the_template_applied_to_the_whole_conversation(monkeypatch, qwen_style,
                                                                   kind):
    """Hand-made conversations: a calculator call then an answer; two calls in one turn,
    a bad call, then an answer; a direct answer. The row's ids are the whole
    conversation's, rendered and encoded at once; the trained tokens are the assistant
    contents with their turn-ending token."""
    tok = qwen_style if kind == "hf" else CHAR
    turn_end = "<|im_end|>" if kind == "hf" else "\n"  # the model's end-of-turn token
    bad = "<tool_call>\n{not json}\n</tool_call>"
    conversations = [
        [CALL, "The product is 56088."],
        [TWO_CALLS, bad, "So 56088 and -2."],
        ["No tool needed: 4."],
    ]
    tools = {"calculator": tools_lib.Calculator({})}
    encode_turn = (lambda text: tok.encode(text) + [tok.eos_token_id]) if kind == "hf" else (
        lambda text: tok.encode(text + "\n"))
    blocks = _scripted(monkeypatch, [[encode_turn(t) for t in conv] for conv in conversations])
    prompt = [{"role": "user", "content": "What is 123*456?"}]
    prompt_text = tok.apply_chat_template(prompt, add_generation_prompt=True)
    ids = np.asarray([tok.encode(prompt_text)] * 3, np.int32)
    sampling = SamplingConfig(n=1, max_new_tokens=600, stop_token_ids=(tok.eos_token_id,),
                              pad_token_id=tok.pad_token_id)
    mt = multi_turn.MultiTurnConfig(max_tool_response_tokens=200, max_assistant_turns=5)
    out = multi_turn.generate(None, ids, np.ones_like(ids), jax.random.key(0),
                              sampling=sampling, config=None, tokenizer=tok, tools=tools, mt=mt,
                              put=lambda xs: xs)
    tool_texts = {"123*456": "56088", "7-9": "-2"}
    for row, conv in enumerate(conversations):
        messages = list(prompt)
        for k, turn in enumerate(conv):
            messages.append({"role": "assistant", "content": turn})
            if k + 1 < len(conv):  # the tools' answers, as the host renders them
                calls, errors = tools_lib.parse_tool_calls(turn, "hermes")
                messages += [{"role": "tool", "content": f"Error: {e}"} for e in errors]
                messages += [{"role": "tool", "content": tool_texts[c.arguments["expression"]]}
                             for c in calls]
        whole = tok.apply_chat_template(messages, add_generation_prompt=False)
        if kind == "hf":  # the template's newline after the last <|im_end|> is not sampled
            assert whole.endswith(turn_end + "\n")
            whole = whole[:-1]
        real = out.attention_mask[row] > 0
        np.testing.assert_array_equal(
            np.concatenate([ids[row], out.responses[row, real]]), tok.encode(whole))
        # The trained tokens, by hand: each assistant content and its turn end.
        pieces = _by_hand(whole, _SPECIAL if kind == "hf" else [])
        trained = np.zeros(len(pieces), np.int32)
        offset, position = 0, 0
        for turn in conv:
            text = turn + turn_end
            at = whole.index(text, offset)
            first = len(_by_hand(whole[:at], _SPECIAL if kind == "hf" else []))
            count = len(_by_hand(text, _SPECIAL if kind == "hf" else []))
            trained[first:first + count] = 1
            offset = at + len(text)
            position = first + count
        assert position == len(pieces)
        np.testing.assert_array_equal(out.response_mask[row, real], trained[ids.shape[1]:])
        # Every call counts, the malformed one too (answered with its error).
        assert out.tool_calls[row] == sum(sum(map(len, tools_lib.parse_tool_calls(t, "hermes")))
                                          for t in conv[:-1])
    assert out.metrics["multi_turn/tool_errors"] == 1  # the malformed call
    assert out.metrics["multi_turn/tool_calls/malformed"] == 1
    assert out.metrics["multi_turn/tool_calls/total"] == out.tool_calls.sum() >= 1
    assert len(blocks) == 2  # two rounds of tool answers, no re-prefill


class _Raises(tools_lib.Tool):
    def execute(self, instance_id, arguments):
        raise RuntimeError("disk on fire")


class _Hangs(tools_lib.Tool):
    def execute(self, instance_id, arguments):
        import time
        time.sleep(3)
        return "late", 0.0, {}


def _schema(name):
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object", "properties": {}}}}


def test_a_raising_a_hanging_and_an_unknown_tool_are_answered_as_errors(monkeypatch):
    """One turn calls three broken tools: the row gets three error messages (in call
    order), on time, and goes on to its next turn; the run counts three tool errors."""
    import time

    call = lambda name: f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>'
    first = "\n".join(call(name) for name in ("raises", "hangs", "nosuch"))
    _scripted(monkeypatch, [[CHAR.encode(first + "\n"), CHAR.encode("ok\n")]])
    tools = {"raises": _Raises({}, _schema("raises")), "hangs": _Hangs({}, _schema("hangs"))}
    ids = np.asarray([CHAR.encode("User: go\nAssistant: ")], np.int32)
    sampling = SamplingConfig(n=1, max_new_tokens=600, stop_token_ids=(CHAR.eos_token_id,))
    mt = multi_turn.MultiTurnConfig(max_tool_response_tokens=300, tool_timeout_s=0.3)
    began = time.perf_counter()
    out = multi_turn.generate(None, ids, np.ones_like(ids), jax.random.key(0),
                              sampling=sampling, config=None, tokenizer=CHAR, tools=tools, mt=mt,
                              put=lambda xs: xs)
    assert time.perf_counter() - began < 2.0
    text = CHAR.decode(out.responses[0, out.attention_mask[0] > 0])
    assert text == (first + "\n"
                    + "Tool: Error: RuntimeError: disk on fire\n"
                    + "Tool: Error: tool 'hangs' timed out after 0.3 s\n"
                    + "Tool: Error: unknown tool 'nosuch'; available tools: hangs, raises\n"
                    + "Assistant: ok\n")
    assert out.metrics["multi_turn/tool_errors"] == 3 and out.tool_calls[0] == 3
    assert out.metrics["num_turns/max"] == 3  # two model turns, one tool answer


@pytest.mark.parametrize("program", ["start", "resume"])
def test_both_programs_compile_as_the_samplers(monkeypatch, program):
    """`start` and `resume` are compiled through `rollout.jit_sampler` (the sampler's
    compiler options): an option XLA does not know, given to one of them, stops it."""
    def jit_sampler(fun, sampling, **kwargs):
        options = {"xla_no_such_option": 1} if fun.__name__ == program else {}
        return jax.jit(fun, compiler_options=options, **kwargs)

    monkeypatch.setattr(multi_turn, "jit_sampler", jit_sampler)
    monkeypatch.setattr(tools_lib, "parse_tool_calls",
                        lambda text, fmt: ([tools_lib.ToolCall("echo", {})], []))
    config = _tiny_model()
    sampling = SamplingConfig(n=1, max_new_tokens=64, stop_token_ids=(CHAR.eos_token_id,),
                              pad_token_id=CHAR.pad_token_id)
    mt = multi_turn.MultiTurnConfig(max_assistant_turns=2, max_user_turns=2,
                                    max_tool_response_tokens=32,
                                    turn_stop_ids=tuple(t for t in range(CHAR.vocab_size)
                                                        if t != CHAR.eos_token_id))
    ids, mask = _prompts(["User: hi\nAssistant: "], 24)
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option"):
        multi_turn.generate(init_params(config, jax.random.key(1)), ids, mask,
                            jax.random.key(7), sampling=sampling, config=config,
                            tokenizer=CHAR, tools={"echo": _Echo({}, _ECHO_SCHEMA)}, mt=mt)


def test_combine_metrics_of_validation_batches():
    batches = [{"num_turns/mean": 1.0, "num_turns/max": 3.0, "num_turns/min": 1.0,
                "multi_turn/tool_calls/total": 4.0, "multi_turn/segments": 2.0},
               {"num_turns/mean": 2.0, "num_turns/max": 2.0, "num_turns/min": 0.0,
                "multi_turn/tool_calls/total": 1.0, "multi_turn/segments": 3.0}]
    assert multi_turn.combine_metrics(batches) == {
        "num_turns/mean": 1.5, "num_turns/max": 3.0, "num_turns/min": 0.0,
        "multi_turn/tool_calls/total": 5.0, "multi_turn/segments": 5.0}
    assert multi_turn.combine_metrics([{}, {}]) == {}


class _Judge(tools_lib.Tool):
    """Never called; rewards each row 2 at its end (`calc_reward`)."""

    def execute(self, instance_id, arguments):
        return "", 0.0, {}

    def calc_reward(self, instance_id):
        return 2.0


def test_tool_rewards_by_tool_name(monkeypatch):
    """Row 0 calls echo twice in one turn and an unknown tool (step rewards 0.5, 0.5 and
    0); row 1 answers at once. Each row holds every tool's step rewards summed plus its
    calc_reward: verl's `rollout_reward_scores`, {tool name: reward}."""
    echo = '<tool_call>\n{"name": "echo", "arguments": {}}\n</tool_call>'
    first = "\n".join([echo, echo, echo.replace("echo", "nosuch")])
    _scripted(monkeypatch, [[CHAR.encode(first + "\n"), CHAR.encode("ok\n")],
                            [CHAR.encode("ok\n")]])
    tools = {"echo": _Echo({}, _ECHO_SCHEMA), "judge": _Judge({}, _schema("judge"))}
    ids = np.asarray([CHAR.encode("User: go\nAssistant: ")] * 2, np.int32)
    sampling = SamplingConfig(n=1, max_new_tokens=600, stop_token_ids=(CHAR.eos_token_id,))
    mt = multi_turn.MultiTurnConfig(max_tool_response_tokens=300)
    out = multi_turn.generate(None, ids, np.ones_like(ids), jax.random.key(0),
                              sampling=sampling, config=None, tokenizer=CHAR, tools=tools, mt=mt,
                              put=lambda xs: xs)
    assert out.tool_calls.tolist() == [3, 0]
    assert out.reward_scores == [{"echo": 1.0, "judge": 2.0}, {"echo": 0.0, "judge": 2.0}]
    np.testing.assert_array_equal(out.tool_rewards, [3.0, 2.0])

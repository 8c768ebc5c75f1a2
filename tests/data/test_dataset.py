"""The batch iterator (exact resume) and prompt encoding (left padding, overlong rows)."""

import numpy as np
import pytest

from jrl.data.dataset import BatchIterator, IteratorState, encode_prompts
from jrl.data.tokenizers import CharTokenizer


def test_batch_iterator_resumes_exactly():
    rows = [{"i": i} for i in range(10)]
    it = BatchIterator(rows, 3, seed=1)
    seen = [tuple(r["i"] for r in it.next_batch()) for _ in range(5)]
    # Three batches per epoch (the last incomplete one dropped), reshuffled each epoch.
    assert sorted(sum(seen[:3], ())) == sorted(set(sum(seen[:3], ())))
    assert it.state == IteratorState(epoch=1, position=6)
    resumed = BatchIterator(rows, 3, seed=1, state=IteratorState(epoch=1, position=3))
    assert tuple(r["i"] for r in resumed.next_batch()) == seen[4]
    with pytest.raises(ValueError, match="train_batch_size=11"):
        BatchIterator(rows, 11, seed=0)


def test_encode_prompts_left_pads_and_names_overlong_rows():
    tok = CharTokenizer()
    rows = [{"prompt": "1+2=", "data_source": "s"}, {"prompt": "10+20=", "data_source": "s"}]
    ids, mask = encode_prompts(tok, rows, 6, apply_chat_template=False)
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 1, 1], [1] * 6])
    assert tok.decode(ids[0][mask[0] > 0].tolist()) == "1+2="
    assert ids[0, 0] == tok.pad_token_id
    with pytest.raises(ValueError, match="row 1 .* 6 tokens.*max_prompt_length=5"):
        encode_prompts(tok, rows, 5, apply_chat_template=False)

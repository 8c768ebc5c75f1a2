"""verl-schema parquet / JSON lines loading, row validation, raw readers, overlong filtering."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jrl.data import files
from jrl.data.dataset import encode_prompts, ground_truth, prompt_token_ids
from jrl.data.tokenizers import CharTokenizer

CHAT_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"}],
    "ability": "math",
    "reward_model": {"ground_truth": "3", "style": "rule"},
    "extra_info": {"index": 0, "split": "train"},
}
TEXT_ROW = {
    "data_source": "synthetic/arithmetic",
    "prompt": "10+20=",
    "reward_model": {"ground_truth": "30", "style": "rule"},
    "extra_info": {"index": 1, "split": "train"},
}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def parquet_file(tmp_path):
    # The schema datasets.to_parquet writes for verl's preprocessed GSM8K.
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([CHAT_ROW, {**CHAT_ROW, "data_source": "b"}]), path)
    return path


def test_parquet_rows_are_plain_python(parquet_file):
    rows = files.load_rows(str(parquet_file))
    assert rows[0] == CHAT_ROW
    assert [r["data_source"] for r in rows] == ["openai/gsm8k", "b"]
    assert type(rows[0]["prompt"]) is list and type(rows[0]["prompt"][0]) is dict
    assert type(rows[0]["extra_info"]) is dict
    assert not any(isinstance(v, np.ndarray) for v in rows[0].values())


def test_list_of_paths_in_order_and_max_rows(parquet_file, tmp_path):
    jsonl = _write_jsonl(tmp_path / "more.jsonl", [TEXT_ROW, TEXT_ROW, TEXT_ROW])
    rows = files.load_rows([parquet_file, str(jsonl)])
    assert [r["data_source"] for r in rows] == ["openai/gsm8k", "b"] + ["synthetic/arithmetic"] * 3
    assert rows[2] == TEXT_ROW
    assert len(files.load_rows([parquet_file, jsonl], max_rows=3)) == 3
    assert len(files.load_rows(jsonl, max_rows=10)) == 3
    with pytest.raises(ValueError, match="max_rows=0"):
        files.load_rows(jsonl, max_rows=0)


def test_json_array_and_blank_lines(tmp_path):
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([TEXT_ROW, CHAT_ROW]))
    assert files.load_rows(array) == [TEXT_ROW, CHAT_ROW]
    lines = tmp_path / "rows.jsonl"
    lines.write_text(json.dumps(TEXT_ROW) + "\n\n" + json.dumps(CHAT_ROW) + "\n")
    assert files.load_rows(lines) == [TEXT_ROW, CHAT_ROW]


def test_prompt_key_is_copied_to_prompt(tmp_path):
    row = {"data_source": "s", "question": [{"role": "user", "content": "hi"}]}
    path = _write_jsonl(tmp_path / "q.jsonl", [row])
    (loaded,) = files.load_rows(path, prompt_key="question")
    assert loaded["prompt"] == row["question"] and loaded["question"] == row["question"]
    with pytest.raises(files.DataError, match=r"q.jsonl: the column 'prompt' named by "
                       r"data.prompt_key is missing from every row"):
        files.load_rows(path)


@pytest.mark.parametrize(("bad", "match"), [
    ({"prompt": 3}, r"row 2: field 'prompt' must be a string or a non-empty list.*got int"),
    ({"prompt": []}, r"row 2: field 'prompt' must be"),
    ({"prompt": [{"role": "user"}]}, r"row 2: .*message 0 has content=None"),
    ({"prompt": ["hi"]}, r"row 2: .*message 0 is a str"),
    ({"data_source": None}, r"row 2: field 'data_source' must be a string"),
    ({"reward_model": "3"}, r"row 2: field 'reward_model' must be a dict"),
    ({"extra_info": [1]}, r"row 2: field 'extra_info' must be a dict"),
])
def test_malformed_row_names_file_row_and_field(tmp_path, bad, match):
    path = _write_jsonl(tmp_path / "bad.jsonl", [TEXT_ROW, {**TEXT_ROW, **bad}])
    with pytest.raises(ValueError, match=match) as err:
        files.load_rows(path)
    assert "bad.jsonl" in str(err.value)


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.parquet"):
        files.load_rows(["nowhere.parquet"])
    csv = tmp_path / "rows.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"rows.csv: unsupported file type '.csv'"):
        files.load_rows(csv)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(TEXT_ROW) + "\n{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl: row 2: not valid JSON"):
        files.load_rows(broken)
    with pytest.raises(ValueError, match="broken.jsonl: line 2 is not valid JSON"):
        files.read_records(broken)
    with pytest.raises(ValueError, match="no data files"):
        files.load_rows([])


@pytest.mark.parametrize("content", [b"", b"PAR1" + b"\0" * 40, b"hello"])
def test_unreadable_parquet_names_the_file(tmp_path, content):
    path = tmp_path / "rows.parquet"
    path.write_bytes(content)
    for read in (files.load_rows, files.read_records):
        with pytest.raises(files.DataError, match=r"^data file '.*rows.parquet' is not a "
                           r"readable parquet file \(pyarrow: .*\); copy or write it again$"):
            read(path)


def test_truncated_parquet_names_the_file(parquet_file):
    data = parquet_file.read_bytes()
    parquet_file.write_bytes(data[:len(data) // 2])
    with pytest.raises(files.DataError, match=r"train.parquet' is not a readable parquet file"):
        files.load_rows(parquet_file)


def test_non_utf8_json_names_the_file_and_line(tmp_path):
    lines = tmp_path / "rows.jsonl"
    lines.write_bytes(json.dumps(TEXT_ROW).encode() + b'\n{"prompt": "\xff"}\n')
    with pytest.raises(files.DataError) as err:
        files.load_rows(lines)
    assert str(err.value) == (f"{lines}: line 2 is not UTF-8 text (its byte 13 is 0xff); save "
                              "the file as UTF-8")
    array = tmp_path / "rows.json"
    array.write_bytes('[{"prompt": "café"}]'.encode("latin-1"))
    with pytest.raises(files.DataError, match=r"rows.json is not UTF-8 text \(its byte 17 is "
                       r"0xe9\)"):
        files.read_records(array)


def test_a_directory_is_not_a_data_file(parquet_file, tmp_path):
    for read in (files.load_rows, files.read_records):
        with pytest.raises(files.DataError) as err:
            read(tmp_path)
        assert str(err.value) == (f"data file '{tmp_path}' is a directory, not a data file "
                                  "(give a .parquet/.jsonl/.json file); it holds "
                                  "['train.parquet']")


def test_a_column_missing_from_every_row_is_one_line(tmp_path):
    rows = [{"question": f"{i}+1=", "data_source": "s", "reward_model": {"ground_truth": "1"}}
            for i in range(64)]
    path = tmp_path / "q.parquet"
    files.write_parquet(rows, path)
    with pytest.raises(files.DataError) as err:
        files.load_rows(path)
    assert str(err.value) == (
        f"{path}: the column 'prompt' named by data.prompt_key is missing from every row; the "
        "file's columns are ['data_source', 'question', 'reward_model']; set data.prompt_key "
        "to the column holding the prompts")
    assert len(files.load_rows(path, prompt_key="question")) == 64
    files.write_parquet([{"question": "1+1="}] * 3, path)
    with pytest.raises(files.DataError, match=r"the columns 'text' named by data.prompt_key "
                       r"and 'data_source' \(.*\) are missing from every row; the file's "
                       r"columns are \['question'\]; set data.prompt_key to the column "
                       r"holding the prompts and add a 'data_source' column$"):
        files.load_rows(path, prompt_key="text")


def test_a_column_missing_from_some_rows_is_reported_by_row(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", [TEXT_ROW, {"data_source": "s"}, TEXT_ROW,
                                                   {"data_source": "s", "question": "q"}])
    with pytest.raises(files.DataError) as err:
        files.load_rows(path)
    lines = str(err.value).splitlines()
    assert lines[0].startswith(f"{path}: 2 bad rows")
    assert lines[1].startswith("  row 2: missing field 'prompt'")
    assert lines[2].startswith("  row 4: missing field 'prompt'")


def test_ground_truth_of_rows_without_reward_model():
    assert ground_truth({"reward_model": None}) is None
    assert ground_truth({}) is None
    assert ground_truth(TEXT_ROW) == "30"


def test_filter_overlong_prompts_counts_like_encode_prompts():
    tok = CharTokenizer()
    rows = [{"prompt": "1+2=", "data_source": "s"}, {"prompt": "10+20=", "data_source": "s"},
            {"prompt": "3+4=", "data_source": "s"}]
    kept, dropped = files.filter_overlong_prompts(rows, tok, 5, apply_chat_template=False)
    assert kept == [rows[0], rows[2]] and dropped == 1
    # "User: " + prompt + "\n" + "Assistant: " is 6 + 4 + 1 + 11 = 22 characters for "1+2=".
    assert len(prompt_token_ids(tok, rows[0], apply_chat_template=True)) == 22
    kept, dropped = files.filter_overlong_prompts(rows, tok, 22, apply_chat_template=True)
    assert kept == [rows[0], rows[2]] and dropped == 1
    encode_prompts(tok, kept, 22, apply_chat_template=True)  # what is kept always encodes
    with pytest.raises(ValueError, match="row 1"):
        encode_prompts(tok, rows, 22, apply_chat_template=True)


def test_raw_readers_and_split_discovery(tmp_path):
    records = [{"question": "q0", "answer": "a0"}, {"question": "q1", "answer": "a1"}]
    table = pa.Table.from_pylist(records)
    (tmp_path / "disk" / "train").mkdir(parents=True)
    with pa.ipc.new_stream(tmp_path / "disk" / "train" / "data-00000-of-00001.arrow",
                           table.schema) as writer:
        writer.write_table(table)
    with pa.ipc.new_file(tmp_path / "disk" / "train" / "data-00001-of-00002.arrow",
                         table.schema) as writer:  # IPC file format is read too
        writer.write_table(table.slice(0, 1))
    assert files.read_records(tmp_path / "disk/train/data-00000-of-00001.arrow") == records
    found = files.find_split_files(tmp_path / "disk", "train")
    assert [p.name for p in found] == ["data-00000-of-00001.arrow", "data-00001-of-00002.arrow"]
    assert files.find_split_files(tmp_path / "disk", "test") == []

    (tmp_path / "hub" / "main").mkdir(parents=True)
    pq.write_table(table, tmp_path / "hub" / "main" / "test-00000-of-00001.parquet")
    (found,) = files.find_split_files(tmp_path / "hub", "test")
    assert files.read_records(found) == records
    splits = files.read_splits(tmp_path / "hub")
    assert list(splits) == ["test"] and splits["test"][1] == records
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"none of the splits \['train', 'test'\]"):
        files.read_splits(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="nothing' does not exist"):
        files.read_splits(tmp_path / "nothing")

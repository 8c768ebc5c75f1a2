"""`python -m jrl.data.preprocess gsm8k|math` on tiny datasets in each download layout."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jrl.data import preprocess
from jrl.data.files import load_rows
from jrl.rewards import default_compute_score

GSM_SUFFIX = ' Let\'s think step by step and output the final answer after "####".'
MATH_SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."

GSM_SPLITS = {
    "train": [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
        {"question": "A car costs $1,200 plus $34.", "answer": "1200+34=1234\n#### 1,234"},
    ],
    "test": [{"question": "What is 10 - 12?", "answer": "10-12=-2\n#### -2"}],
}
MATH_SPLITS = {
    "train": [
        {"problem": "Half of 1?", "solution": r"It is $\boxed{\frac{1}{2}}$.", "level": "L1"},
        {"problem": "Box it.", "solution": r"First \boxed{1}, then $\boxed{\{2, 3\}}$."},
    ],
    "test": [{"problem": "Two plus two?", "solution": r"$2+2=\boxed{4}$"}],
}


def _write_save_to_disk(root, splits):
    """The layout of `DatasetDict.save_to_disk`: <split>/data-*.arrow in IPC stream format."""
    for split, records in splits.items():
        (root / split).mkdir(parents=True)
        table = pa.Table.from_pylist(records)
        with pa.ipc.new_stream(root / split / "data-00000-of-00001.arrow", table.schema) as w:
            w.write_table(table)
        (root / split / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (root / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))


def _write_hub_parquet(root, splits, config="main"):
    (root / config).mkdir(parents=True)
    for split, records in splits.items():
        pq.write_table(pa.Table.from_pylist(records),
                       root / config / f"{split}-00000-of-00001.parquet")


def _write_jsonl(root, splits):
    root.mkdir(parents=True)
    for split, records in splits.items():
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


LAYOUTS = {"save_to_disk": _write_save_to_disk, "parquet": _write_hub_parquet,
           "jsonl": _write_jsonl}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gsm8k_rows_in_every_layout(tmp_path, layout):
    LAYOUTS[layout](tmp_path / "raw", GSM_SPLITS)
    written = preprocess.main(
        ["gsm8k", "--local_dir", str(tmp_path / "raw"), "--output_dir", str(tmp_path / "out")])
    assert written == {"train": 2, "test": 1}
    train = load_rows(tmp_path / "out" / "train.parquet")
    assert train[1] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "A car costs $1,200 plus $34." + GSM_SUFFIX}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1234"},
        "extra_info": {"split": "train", "index": 1,
                       "answer": "1200+34=1234\n#### 1,234",
                       "question": "A car costs $1,200 plus $34."},
    }
    assert [r["reward_model"]["ground_truth"] for r in train] == ["7", "1234"]
    (test,) = load_rows(tmp_path / "out" / "test.parquet")
    assert test["reward_model"]["ground_truth"] == "-2"
    assert test["extra_info"]["split"] == "test" and test["extra_info"]["index"] == 0
    assert default_compute_score(test["data_source"], "... #### -2", "-2")["score"] == 1.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_math_rows_in_every_layout(tmp_path, layout):
    LAYOUTS[layout](tmp_path / "raw", MATH_SPLITS)
    written = preprocess.main(
        ["math", "--local_dir", str(tmp_path / "raw"), "--output_dir", str(tmp_path / "out")])
    assert written == {"train": 2, "test": 1}
    train = load_rows(tmp_path / "out" / "train.parquet")
    assert train[0] == {
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": "Half of 1?" + MATH_SUFFIX}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": r"\frac{1}{2}"},
        "extra_info": {"split": "train", "index": 0,
                       "solution": r"It is $\boxed{\frac{1}{2}}$.", "question": "Half of 1?"},
    }
    assert train[1]["reward_model"]["ground_truth"] == r"\{2, 3\}"  # the last box, nested
    (test,) = load_rows(tmp_path / "out" / "test.parquet")
    assert test["reward_model"]["ground_truth"] == "4"
    assert default_compute_score(test["data_source"], r"\boxed{4}", "4")["score"] == 1.0


def test_math500_test_split_with_answer_fallback(tmp_path):
    _write_jsonl(tmp_path / "raw", {"test": [
        {"problem": "p", "solution": "no box here", "answer": "12"},
        {"problem": "q", "solution": r"\boxed{3}", "answer": "3"},
    ]})
    written = preprocess.main([
        "math", "--local_dataset_path", str(tmp_path / "raw"),
        "--local_save_dir", str(tmp_path / "out"), "--data_source", "HuggingFaceH4/MATH-500"])
    assert written == {"test": 1 + 1}
    assert not (tmp_path / "out" / "train.parquet").exists()
    rows = load_rows(tmp_path / "out" / "test.parquet")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["12", "3"]
    assert {r["data_source"] for r in rows} == {"HuggingFaceH4/MATH-500"}


def test_preprocess_errors_name_the_record(tmp_path):
    _write_jsonl(tmp_path / "bad", {"train": [GSM_SPLITS["train"][0],
                                              {"question": "q", "answer": "no marker"}]})
    with pytest.raises(ValueError, match=r"train.jsonl: train record 1: answer has no '#### "):
        preprocess.main(["gsm8k", "--local_dir", str(tmp_path / "bad"),
                         "--output_dir", str(tmp_path / "o")])
    _write_jsonl(tmp_path / "nofield", {"test": [{"question": "q"}]})
    with pytest.raises(ValueError, match=r"test record 0: field 'answer' must be a string"):
        preprocess.main(["gsm8k", "--local_dir", str(tmp_path / "nofield"),
                         "--output_dir", str(tmp_path / "o")])
    _write_jsonl(tmp_path / "nobox", {"train": [{"problem": "p", "solution": "none"}]})
    with pytest.raises(ValueError, match=r"train record 0: the solution has no \\boxed"):
        preprocess.main(
            ["math", "--local_dir", str(tmp_path / "nobox"), "--output_dir", str(tmp_path / "o")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="none of the splits"):
        preprocess.main(["gsm8k", "--local_dir", str(tmp_path / "empty"),
                         "--output_dir", str(tmp_path / "o")])


def test_module_runs_from_the_command_line(tmp_path):
    _write_jsonl(tmp_path / "raw", {"test": GSM_SPLITS["test"]})
    done = subprocess.run([sys.executable, "-m", "jrl.data.preprocess", "gsm8k", "--local_dir",
                           str(tmp_path / "raw"), "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"test: 1 rows -> {tmp_path / 'out' / 'test'}.parquet\n"
    done = subprocess.run([sys.executable, "-m", "jrl.data.preprocess"], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 2 and "{gsm8k,math}" in done.stderr

"""GSM8K in verl's row schema: `train.parquet` and `test.parquet`.

Reads a local copy of `openai/gsm8k` (config "main") as it is usually downloaded:

* a `datasets.save_to_disk` directory (`train/` and `test/` with `*.arrow` files);
* the hub's parquet files (`main/train-00000-of-00001.parquet`, `main/test-...`);
* JSON lines (`train.jsonl`, `test.jsonl`, as in the original grade-school-math repo).

Each record `{"question", "answer"}` becomes::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": <number after "#### ", no commas>},
     "extra_info": {"split", "index", "answer", "question"}}

the rows verl's `examples/data_preprocess/gsm8k.py` writes, scored by
`jrl.rewards.gsm8k`.

    python experiments/preprocess_gsm8k.py --local_dir ~/downloads/gsm8k \\
        --output_dir ~/data/gsm8k
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from jrl.data.files import convert_splits

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")
_FINAL_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


def ground_truth(answer: str, where: str) -> str:
    """The number after the first "#### " of a GSM8K solution, commas removed."""
    match = _FINAL_ANSWER.search(answer)
    if match is None:
        raise ValueError(f"{where}: answer has no '#### <number>' line: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def to_row(record: dict, split: str, index: int, where: str) -> dict:
    """One verl row of a `{"question", "answer"}` record."""
    for key in ("question", "answer"):
        if not isinstance(record.get(key), str):
            raise ValueError(f"{where}: field {key!r} must be a string; fields present: "
                             f"{sorted(record)}")
    question, answer = record["question"], record["answer"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth(answer, where)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def convert(local_dir: str | Path, output_dir: str | Path) -> dict[str, int]:
    """Writes `<output_dir>/<split>.parquet` for each split found; returns rows per split.

    Raises:
      FileNotFoundError: neither split is found under `local_dir` (layouts named).
      ValueError: a record lacks a field or a final answer (file and record named).
    """
    return convert_splits(local_dir, output_dir, SPLITS, to_row)


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local_dir", "--local_dataset_path", required=True,
                        help="the downloaded dataset (save_to_disk dir, parquet or jsonl)")
    parser.add_argument("--output_dir", "--local_save_dir", default="~/data/gsm8k",
                        help="where train.parquet and test.parquet are written")
    args = parser.parse_args(argv)
    written = convert(args.local_dir, args.output_dir)
    for split, count in written.items():
        print(f"{split}: {count} rows -> {Path(args.output_dir).expanduser() / split}.parquet")
    return written


if __name__ == "__main__":
    main(sys.argv[1:])

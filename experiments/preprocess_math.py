r"""MATH in verl's row schema: `train.parquet` and/or `test.parquet`.

Reads a local copy of a MATH dataset as it is usually downloaded:

* a `datasets.save_to_disk` directory (`train/` and `test/` with `*.arrow` files);
* the hub's parquet files (`data/train-00000-of-00001.parquet`, `data/test-...`,
  e.g. `DigitalLearningGmbH/MATH-lighteval`);
* JSON lines (`test.jsonl` of `HuggingFaceH4/MATH-500`, which has no train split).

Each record `{"problem", "solution", ...}` becomes::

    {"data_source": <--data_source>,
     "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": <last \boxed{} of the solution>},
     "extra_info": {"split", "index", "solution", "question"}}

the rows verl's `examples/data_preprocess/math_dataset.py` writes, scored by
`jrl.rewards.math_answers`. A solution without a boxed answer falls back to the
record's "answer" field when it has one (MATH-500 does).

    python experiments/preprocess_math.py --local_dir ~/downloads/MATH-lighteval \
        --output_dir ~/data/math
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jrl.data.files import convert_splits
from jrl.rewards.math_answers import DATA_SOURCES, last_boxed

DEFAULT_DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SPLITS = ("train", "test")


def ground_truth(record: dict, where: str) -> str:
    """The last boxed answer of the solution, else the record's "answer" field."""
    answer = last_boxed(record["solution"])
    if answer is None:
        answer = record.get("answer")
    if not isinstance(answer, str):
        raise ValueError(f"{where}: the solution has no \\boxed{{...}} answer and the record "
                         f"no 'answer' field: {record['solution'][-80:]!r}")
    return answer


def to_row(record: dict, split: str, index: int, where: str, data_source: str) -> dict:
    """One verl row of a `{"problem", "solution"}` record."""
    for key in ("problem", "solution"):
        if not isinstance(record.get(key), str):
            raise ValueError(f"{where}: field {key!r} must be a string; fields present: "
                             f"{sorted(record)}")
    problem, solution = record["problem"], record["solution"]
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth(record, where)},
        "extra_info": {"split": split, "index": index, "solution": solution,
                       "question": problem},
    }


def convert(local_dir: str | Path, output_dir: str | Path,
            data_source: str = DEFAULT_DATA_SOURCE) -> dict[str, int]:
    """Writes `<output_dir>/<split>.parquet` for each split found; returns rows per split.

    Raises:
      FileNotFoundError: neither split is found under `local_dir` (layouts named).
      ValueError: a record lacks a field or a final answer (file and record named).
    """
    return convert_splits(local_dir, output_dir, SPLITS,
                          lambda r, split, i, where: to_row(r, split, i, where, data_source))


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local_dir", "--local_dataset_path", required=True,
                        help="the downloaded dataset (save_to_disk dir, parquet or jsonl)")
    parser.add_argument("--output_dir", "--local_save_dir", default="~/data/math",
                        help="where train.parquet / test.parquet are written")
    parser.add_argument("--data_source", default=DEFAULT_DATA_SOURCE, choices=DATA_SOURCES,
                        help="data_source of the rows (selects the MATH reward rule)")
    args = parser.parse_args(argv)
    written = convert(args.local_dir, args.output_dir, args.data_source)
    for split, count in written.items():
        print(f"{split}: {count} rows -> {Path(args.output_dir).expanduser() / split}.parquet")
    return written


if __name__ == "__main__":
    main(sys.argv[1:])

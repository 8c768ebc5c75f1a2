r"""GSM8K and MATH in verl's row schema: `train.parquet` and/or `test.parquet`.

    python -m jrl.data.preprocess gsm8k --local_dir ~/downloads/gsm8k --output_dir ~/data/gsm8k
    python -m jrl.data.preprocess math --local_dir ~/downloads/MATH-lighteval \
        --output_dir ~/data/math [--data_source HuggingFaceH4/MATH-500]

Each reads a local copy of the dataset as it is usually downloaded:

* a `datasets.save_to_disk` directory (`train/` and `test/` with `*.arrow` files);
* the hub's parquet files (`main/train-00000-of-00001.parquet` for `openai/gsm8k`,
  `data/train-00000-of-00001.parquet` for `DigitalLearningGmbH/MATH-lighteval`, ...);
* JSON lines (`train.jsonl`, `test.jsonl`: the original grade-school-math repo, or
  `test.jsonl` of `HuggingFaceH4/MATH-500`, which has no train split).

`gsm8k`: each record `{"question", "answer"}` of `openai/gsm8k` (config "main") becomes::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": <number after "#### ", no commas>},
     "extra_info": {"split", "index", "answer", "question"}}

the rows verl's `examples/data_preprocess/gsm8k.py` writes, scored by
`jrl.rewards.gsm8k`.

`math`: each record `{"problem", "solution", ...}` becomes::

    {"data_source": <--data_source>,
     "prompt": [{"role": "user", "content": problem + " " + MATH_INSTRUCTION}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": <last \boxed{} of the solution>},
     "extra_info": {"split", "index", "solution", "question"}}

the rows verl's `examples/data_preprocess/math_dataset.py` writes, scored by
`jrl.rewards.math_answers`. A solution without a boxed answer falls back to the
record's "answer" field when it has one (MATH-500 does).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from jrl.data.files import convert_splits
from jrl.errors import EXIT_USER_ERROR, DataError, JrlError
from jrl.rewards.math_answers import DATA_SOURCES, last_boxed

SPLITS = ("train", "test")
GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_GSM8K_FINAL_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
MATH_DEFAULT_DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def _check_strings(record: dict, keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if not isinstance(record.get(key), str):
            raise DataError(f"{where}: field {key!r} must be a string; fields present: "
                             f"{sorted(record)}")


def gsm8k_ground_truth(answer: str, where: str) -> str:
    """The number after the first "#### " of a GSM8K solution, commas removed."""
    match = _GSM8K_FINAL_ANSWER.search(answer)
    if match is None:
        raise DataError(f"{where}: answer has no '#### <number>' line: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def gsm8k_row(record: dict, split: str, index: int, where: str) -> dict:
    """One verl row of a `{"question", "answer"}` record."""
    _check_strings(record, ("question", "answer"), where)
    question, answer = record["question"], record["answer"]
    return {
        "data_source": GSM8K_DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gsm8k_ground_truth(answer, where)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def math_ground_truth(record: dict, where: str) -> str:
    """The last boxed answer of the solution, else the record's "answer" field."""
    answer = last_boxed(record["solution"])
    if answer is None:
        answer = record.get("answer")
    if not isinstance(answer, str):
        raise DataError(f"{where}: the solution has no \\boxed{{...}} answer and the record "
                         f"no 'answer' field: {record['solution'][-80:]!r}")
    return answer


def math_row(record: dict, split: str, index: int, where: str, data_source: str) -> dict:
    """One verl row of a `{"problem", "solution"}` record."""
    _check_strings(record, ("problem", "solution"), where)
    problem, solution = record["problem"], record["solution"]
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": problem + " " + MATH_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": math_ground_truth(record, where)},
        "extra_info": {"split": split, "index": index, "solution": solution,
                       "question": problem},
    }


def convert_gsm8k(local_dir: str | Path, output_dir: str | Path) -> dict[str, int]:
    """Writes `<output_dir>/<split>.parquet` for each split found; returns rows per split.

    Raises:
      FileNotFoundError: neither split is found under `local_dir` (layouts named).
      DataError: a record lacks a field or a final answer (file and record named).
    """
    return convert_splits(local_dir, output_dir, SPLITS, gsm8k_row)


def convert_math(local_dir: str | Path, output_dir: str | Path,
                 data_source: str = MATH_DEFAULT_DATA_SOURCE) -> dict[str, int]:
    """Writes `<output_dir>/<split>.parquet` for each split found; returns rows per split.

    Raises:
      FileNotFoundError: neither split is found under `local_dir` (layouts named).
      DataError: a record lacks a field or a final answer (file and record named).
    """
    return convert_splits(local_dir, output_dir, SPLITS,
                          lambda r, split, i, where: math_row(r, split, i, where, data_source))


def _add_paths(command: argparse.ArgumentParser, default_output: str, splits_help: str) -> None:
    command.add_argument("--local_dir", "--local_dataset_path", required=True,
                         help="the downloaded dataset (save_to_disk dir, parquet or jsonl)")
    command.add_argument("--output_dir", "--local_save_dir", default=default_output,
                         help=f"where {splits_help} written")


def make_parser() -> argparse.ArgumentParser:
    """The command line: a subcommand per dataset, verl's flag names accepted as aliases."""
    parser = argparse.ArgumentParser(prog="python -m jrl.data.preprocess",
                                     description=__doc__.split("\n")[0])
    datasets = parser.add_subparsers(dest="dataset", required=True, metavar="{gsm8k,math}")
    gsm8k = datasets.add_parser("gsm8k", help="openai/gsm8k (config main)")
    _add_paths(gsm8k, "~/data/gsm8k", "train.parquet and test.parquet are")
    math = datasets.add_parser("math", help="MATH (MATH-lighteval, MATH-500, ...)")
    _add_paths(math, "~/data/math", "train.parquet / test.parquet are")
    math.add_argument("--data_source", default=MATH_DEFAULT_DATA_SOURCE, choices=DATA_SOURCES,
                      help="data_source of the rows (selects the MATH reward rule)")
    return parser


def main(argv: list[str] | None = None) -> dict[str, int]:
    """Converts the dataset `argv` names; prints and returns the rows written per split."""
    args = make_parser().parse_args(argv)
    if args.dataset == "gsm8k":
        written = convert_gsm8k(args.local_dir, args.output_dir)
    else:
        written = convert_math(args.local_dir, args.output_dir, args.data_source)
    for split, count in written.items():
        print(f"{split}: {count} rows -> {Path(args.output_dir).expanduser() / split}.parquet")
    return written


def _main_with_errors() -> None:
    """`main` as a command: a missing or malformed dataset prints one line and exits with
    status 2, as `python -m jrl.train` does."""
    try:
        main()
    except (JrlError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


if __name__ == "__main__":
    _main_with_errors()

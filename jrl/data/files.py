"""Prompt datasets on disk, in verl's row schema.

`load_rows(paths)` reads the files a verl user passes as `data.train_files` /
`data.val_files`: parquet (as written by verl's preprocessing scripts) or JSON
lines, one row per line. Every row is checked, and the malformed ones stop the load
together, each with its file, row (numbered from 1: row N of a .jsonl file is its
line N), field and what would be valid::

    {"prompt": str | [{"role": str, "content": str}, ...],
     "data_source": str,
     "reward_model": {"ground_truth": ..., "style": ...}   (optional),
     "extra_info": {...}                                     (optional)}

Other fields pass through untouched; `extra_info` reaches the reward function.

The raw readers (`read_records`, `find_split_files`) also read a local copy of a
Hugging Face dataset (a `save_to_disk` directory of arrow files, the hub's parquet
shards, or JSON lines) for `python -m jrl.data.preprocess`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jrl.data.dataset import Row, prompt_token_ids
from jrl.errors import DataError

ROW_SUFFIXES = (".parquet", ".jsonl", ".json")
RECORD_SUFFIXES = (*ROW_SUFFIXES, ".arrow")
_PARQUET_BATCH_ROWS = 4096
# Bad rows listed in one error (all are counted).
MAX_LISTED_BAD_ROWS = 20


# --------------------------------------------------------------------------- raw records


def _unreadable(path: Path, kind: str, err: Exception) -> DataError:
    # pyarrow's messages can run over several lines; the error stays on one.
    detail = " ".join(str(err).split())
    return DataError(f"data file {str(path)!r} is not a readable {kind} file (pyarrow: "
                     f"{detail}); copy or write it again")


def _iter_parquet(path: Path) -> Iterator[dict]:
    # to_pylist gives plain Python lists and dicts; pandas would give numpy object arrays.
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            yield from batch.to_pylist()
    except (pa.ArrowInvalid, OSError) as err:
        raise _unreadable(path, "parquet", err) from err


def _not_utf8(path: Path, err: UnicodeDecodeError, data: bytes, line: int | None = None
              ) -> DataError:
    """The error for `data` (line `line` of `path`, or all of it) failing to decode."""
    what = str(path) if line is None else f"{path}: line {line}"
    return DataError(f"{what} is not UTF-8 text (its byte {err.start + 1} is "
                     f"0x{data[err.start]:02x}); save the file as UTF-8")


def _json_lines(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """`(line number, record, problem)` of each non-blank line; `problem` names invalid
    JSON (the record is then None). A line that is not UTF-8 stops the read (the whole
    file is then in another encoding, more often than not)."""
    # Read as bytes and decode line by line, so that a bad byte is placed on its line.
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _not_utf8(path, err, raw, line_number) from None
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line), None
            except json.JSONDecodeError as err:
                yield line_number, None, (f"not valid JSON ({err.msg}); a JSON lines file "
                                          "holds one JSON object per line")


def _iter_json_lines(path: Path) -> Iterator[dict]:
    for line_number, record, problem in _json_lines(path):
        if problem:
            raise DataError(f"{path}: line {line_number} is {problem}")
        yield record


def _is_json_array(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4096).lstrip().startswith(b"[")


def _iter_json(path: Path) -> Iterator[dict]:
    """A `.json` file: one JSON array of objects, or JSON lines (as `datasets` accepts)."""
    if not _is_json_array(path):
        yield from _iter_json_lines(path)
        return
    data = path.read_bytes()
    try:
        records = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise _not_utf8(path, err, data) from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from err
    yield from records


def _iter_arrow(path: Path) -> Iterator[dict]:
    """An arrow file of `datasets.save_to_disk` (IPC stream format) or an IPC file."""
    try:
        try:
            reader = pa.ipc.open_stream(path)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(path)
            for i in range(reader.num_record_batches):
                yield from reader.get_batch(i).to_pylist()
            return
        for batch in reader:
            yield from batch.to_pylist()
    except (pa.ArrowInvalid, OSError) as err:
        raise _unreadable(path, "arrow", err) from err


def _check_is_file(path: Path) -> None:
    """A data path must be a file: a missing one and a directory are named."""
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix in RECORD_SUFFIXES)[:5]
        holds = f"; it holds {inside}" if inside else ""
        raise DataError(f"data file {str(path)!r} is a directory, not a data file (give a "
                        f"{'/'.join(ROW_SUFFIXES)} file){holds}")
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")


def iter_records(path: str | os.PathLike) -> Iterator[Any]:
    """Yields the records of one file, unvalidated: `.parquet`, `.jsonl`, `.json`, `.arrow`.

    Raises:
      FileNotFoundError: the file does not exist (named).
      DataError: a directory, an unsupported suffix (named, with the supported ones),
        invalid JSON or text that is not UTF-8 (file and line named), or a parquet or
        arrow file pyarrow cannot read.
    """
    path = Path(path).expanduser()
    _check_is_file(path)
    readers = {".parquet": _iter_parquet, ".jsonl": _iter_json_lines, ".json": _iter_json,
               ".arrow": _iter_arrow}
    if path.suffix not in readers:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; expected one of "
                        f"{sorted(readers)}")
    return readers[path.suffix](path)


def read_records(path: str | os.PathLike) -> list[Any]:
    """All records of one file (see `iter_records`)."""
    return list(iter_records(path))


def find_split_files(root: str | os.PathLike, split: str) -> list[Path]:
    """Files holding one split of a locally downloaded dataset, in shard order.

    Looks under `root` (recursively) for, in this order of preference:
      * a `datasets.save_to_disk` split directory `<split>/` with `*.arrow` files;
      * parquet shards `<split>.parquet` or `<split>-*.parquet` (the hub's layout,
        e.g. `main/train-00000-of-00001.parquet`);
      * JSON lines `<split>.jsonl` / `<split>.json` or `<split>-*.jsonl`.

    Returns:
      The sorted files of the first kind found; empty when the split is absent.
    """
    root = Path(root).expanduser()
    arrow = sorted(p for p in root.rglob("*.arrow") if p.parent.name == split)
    if arrow:
        return arrow
    for suffix in (".parquet", ".jsonl", ".json"):
        found = sorted(
            p for p in root.rglob(f"*{suffix}")
            if p.name == f"{split}{suffix}" or p.name.startswith(f"{split}-")
        )
        if found:
            return found
    return []


def read_splits(root: str | os.PathLike, splits: Sequence[str] = ("train", "test")
                ) -> dict[str, tuple[str, list[Any]]]:
    """The records of each split found under `root` (see `find_split_files`).

    Returns:
      `{split: (source, records)}` for the splits present, `source` naming the files.

    Raises:
      FileNotFoundError: `root` is not a directory, or none of the splits is present
        (the layouts searched named).
    """
    if not Path(root).expanduser().is_dir():
        raise FileNotFoundError(f"dataset directory {str(root)!r} does not exist")
    found = {}
    for split in splits:
        files = find_split_files(root, split)
        if files:
            found[split] = (", ".join(map(str, files)), [r for f in files for r in read_records(f)])
    if not found:
        raise FileNotFoundError(
            f"none of the splits {list(splits)} under {str(root)!r}: expected <split>/ "
            "directories of *.arrow files (datasets.save_to_disk), <split>-*.parquet or "
            "<split>.parquet files, or <split>.jsonl files")
    return found


def write_parquet(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Writes rows (dicts of Python values) as one parquet file, creating its directory."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), path)


# --------------------------------------------------------------------------- verl rows


_PROMPT_FORMAT = "a string or a non-empty list of {'role': str, 'content': str} messages"


def _check_prompt(prompt: Any) -> str | None:
    """What is wrong with a prompt, or None when it is valid."""
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, list) or not prompt:
        return f"got {type(prompt).__name__} {_short(prompt)}"
    for j, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return f"message {j} is a {type(message).__name__}"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return f"message {j} has {key}={_short(message.get(key))}"
    return None


def _prompt_text(prompt: str | list) -> str:
    return prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def validate_row(row: Any, *, where: str, prompt_key: str = "prompt") -> Row:
    """Checks one row of verl's schema and returns it with `prompt` set.

    Args:
      row: the record as read.
      where: "row N" (from 1), for error messages.
      prompt_key: the field holding the prompt (verl's `data.prompt_key`); its value
        is also stored under "prompt", where the rest of jrl reads it.

    Raises:
      ValueError: naming `where`, the field and what would be valid.
    """
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: a row must be a JSON object / struct, got "
                        f"{type(row).__name__}")
    row = dict(row)
    if prompt_key not in row:
        raise DataError(f"{where}: missing field {prompt_key!r} (the prompt: {_PROMPT_FORMAT}); "
                        f"fields present: {sorted(row)}")
    problem = _check_prompt(row[prompt_key])
    if problem is None and not _prompt_text(row[prompt_key]).strip():
        problem = "it is empty (no text to condition on)"
    if problem:
        raise DataError(f"{where}: field {prompt_key!r} must be {_PROMPT_FORMAT}; {problem}")
    if not isinstance(row.get("data_source"), str):
        raise DataError(f"{where}: field 'data_source' must be a string naming the reward "
                        f"function's data source; got {_short(row.get('data_source'))}")
    for key in ("reward_model", "extra_info"):
        if row.get(key) is not None and not isinstance(row[key], Mapping):
            raise DataError(f"{where}: field {key!r} must be a dict (or absent); got "
                            f"{type(row[key]).__name__} {_short(row[key])}")
    row["prompt"] = row[prompt_key]
    return row


def numbered_records(path: str | os.PathLike) -> Iterator[tuple[int, Any, str | None]]:
    """`(row number, record, problem)` of each record of a data file, rows numbered from 1.

    Row N of a JSON lines file is its line N (blank lines hold no row but keep their
    numbers), so an error's row is where an editor shows it; a line that is not valid
    JSON gives record None and the problem. Other files number their records 1, 2, ...
    """
    path = Path(path).expanduser()
    if path.suffix == ".jsonl" or (path.suffix == ".json" and path.is_file()
                                   and not _is_json_array(path)):
        yield from _json_lines(path)
        return
    for number, record in enumerate(iter_records(path), start=1):
        yield number, record, None


class BadRows:
    """The bad rows of one pass over the data, reported together: one `DataError` whose
    first line counts them and names their source, then one line per row (the first
    `MAX_LISTED_BAD_ROWS`). A single bad row is one line, `<source>: row N: <problem>`.
    """

    def __init__(self):
        self.problems: list[tuple[str, str]] = []  # (source, "row N: problem")
        self.sources: dict[str, None] = {}  # every source with a bad row, in order
        self.count = 0

    def add(self, source: str, problem: str) -> None:
        self.count += 1
        self.sources[source] = None
        if len(self.problems) < MAX_LISTED_BAD_ROWS:
            self.problems.append((source, problem))

    def raise_any(self) -> None:
        """Raises the `DataError` listing the rows added, if any."""
        if not self.count:
            return
        sources = list(self.sources)
        if self.count == 1:
            raise DataError(f"{sources[0]}: {self.problems[0][1]}")
        listed = "" if self.count == len(self.problems) else \
            f"; the first {len(self.problems)} are listed"
        where = ", ".join(sources)
        lines = [f"{where}: {self.count} bad rows (numbered from 1; row N of a .jsonl "
                 f"file is its line N){listed}:"]
        lines += [f"  {problem}" if len(sources) == 1 else f"  {source}: {problem}"
                  for source, problem in self.problems]
        raise DataError("\n".join(lines))


def load_rows(paths: str | os.PathLike | Sequence[str | os.PathLike], *,
              prompt_key: str = "prompt", max_rows: int | None = None,
              check: Callable[[Row, str], None] | None = None) -> list[Row]:
    """Rows of verl-schema parquet / JSON lines files, validated, in file order.

    Every row is read and checked before anything is reported: all the bad rows of
    all the files come back in one error (`BadRows`), rows numbered from 1 (row N of
    a .jsonl file is its line N).

    Args:
      paths: one path or a list of paths (verl's `data.train_files` accepts both).
      prompt_key: field holding the prompt (verl's `data.prompt_key`).
      max_rows: stop after this many rows in total (None: all).
      check: `check(row, where)` run on each valid row (`where` is "row N"), for what
        the caller needs of a row (its reward's fields, its prompt's length); it raises
        a `DataError` starting with `where` to reject the row.

    Returns:
      A list of plain dicts (lists and dicts, never numpy object arrays).

    Raises:
      FileNotFoundError: a path does not exist (named).
      DataError: no paths, a directory, an unsupported suffix, an unreadable file, a
        column missing from every row of a file (one line: the file's columns and the
        key naming the column), or malformed rows (file, rows, fields and what is
        valid named).
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise DataError("no data files given; expected a path or a list of paths to "
                        f"{'/'.join(ROW_SUFFIXES)} files")
    if max_rows is not None and max_rows < 1:
        raise DataError(f"max_rows={max_rows} must be positive (or None for all rows)")
    for path in paths:  # fail on a missing or unreadable file before reading a large one
        _check_is_file(Path(path).expanduser())
        if Path(path).suffix not in ROW_SUFFIXES:
            raise DataError(f"{path}: unsupported file type {Path(path).suffix!r}; expected "
                            f"one of {list(ROW_SUFFIXES)}")
    rows: list[Row] = []
    bad = BadRows()
    for path in paths:
        # The columns of the file's rows, to tell a column missing from every row (one
        # error for the file) from rows that lack it here and there (one error a row).
        columns: set[str] = set()
        for number, record, problem in numbered_records(path):
            if max_rows is not None and len(rows) >= max_rows:
                break
            if isinstance(record, Mapping):
                columns.update(record)
            where = f"row {number}"
            try:
                if problem:
                    raise DataError(f"{where}: {problem}")
                row = validate_row(record, where=where, prompt_key=prompt_key)
                if check is not None:
                    check(row, where)
            except DataError as err:
                bad.add(str(path), str(err))
                continue
            rows.append(row)
        if columns:
            _check_columns(path, columns, prompt_key)
    bad.raise_any()
    return rows


def _check_columns(path, columns: set[str], prompt_key: str) -> None:
    """Raises one error when no row of the file has the prompt column or 'data_source'."""
    described = {prompt_key: f"{prompt_key!r} named by data.prompt_key",
                 "data_source": "'data_source' (each row's data source, which picks its "
                                "reward function)"}
    fixes = {prompt_key: "set data.prompt_key to the column holding the prompts",
             "data_source": "add a 'data_source' column"}
    missing = [name for name in described if name not in columns]
    if not missing:
        return
    if len(missing) == 1:
        subject = f"the column {described[missing[0]]} is"
    else:
        subject = f"the columns {' and '.join(described[n] for n in missing)} are"
    raise DataError(f"{path}: {subject} missing from every row; the file's columns are "
                    f"{sorted(columns)}; {' and '.join(fixes[n] for n in missing)}")


def filter_overlong_prompts(rows: Sequence[Row], tokenizer, max_prompt_length: int,
                            apply_chat_template: bool, tools: Sequence[dict] | None = None
                            ) -> tuple[list[Row], int]:
    """Drops rows whose prompt has more than `max_prompt_length` tokens.

    Prompts are encoded exactly as `dataset.encode_prompts` encodes them, with the
    multi-turn tool schemas `tools` (verl's `data.filter_overlong_prompts`).

    Returns:
      `(kept_rows, num_dropped)`, the kept rows in their original order.
    """
    kept = [row for row in rows
            if len(prompt_token_ids(tokenizer, row, apply_chat_template, tools))
            <= max_prompt_length]
    return kept, len(rows) - len(kept)


def convert_splits(local_dir: str | os.PathLike, output_dir: str | os.PathLike,
                   splits: Sequence[str], to_row) -> dict[str, int]:
    """Writes `<output_dir>/<split>.parquet` for each split found under `local_dir`.

    Args:
      local_dir: a downloaded dataset (see `read_splits` for the layouts).
      output_dir: where the parquet files go (`~` allowed).
      splits: split names to look for.
      to_row: `fn(record, split, index, where) -> row` in verl's schema.

    Returns:
      Rows written per split.
    """
    written = {}
    for split, (source, records) in read_splits(local_dir, splits).items():
        rows = [to_row(r, split, i, f"{source}: {split} record {i}")
                for i, r in enumerate(records)]
        write_parquet(rows, Path(output_dir).expanduser() / f"{split}.parquet")
        written[split] = len(rows)
    return written

"""Reading a local dataset's rows (the dataset and math envs, `molt sft`): JSONL, Parquet, CSV or
a `datasets` directory, each row with its place, so an error can name the file's line."""

from __future__ import annotations

import functools
import json
from pathlib import Path

__all__ = ["read_rows"]


@functools.lru_cache(maxsize=4)
def read_rows(path: str) -> tuple[tuple[int, dict], ...]:
    """A JSONL, Parquet or CSV file's rows, or a `datasets` directory's (save_to_disk), each with
    its place: its JSONL line, else its row number (from 1; a DatasetDict's: in its split)."""
    if Path(path).is_dir():     # a DatasetDict's splits are its rows' "split"
        from datasets import DatasetDict, load_from_disk
        ds = load_from_disk(path)
        return tuple((i, {**r, "split": s}) for s, d in ds.items()
                     for i, r in enumerate(d.to_list(), 1)) \
            if isinstance(ds, DatasetDict) else tuple(enumerate(ds.to_list(), 1))
    if path.endswith((".parquet", ".csv")):
        from pyarrow import csv, parquet
        read = parquet.read_table if path.endswith(".parquet") else csv.read_csv
        return tuple(enumerate(read(path).to_pylist(), 1))
    with open(path) as f:
        return tuple((n, _json_row(line, f"{path}:{n}")) for n, line in enumerate(f, 1)
                     if line.strip())


def _json_row(line: str, where: str) -> dict:
    try:
        row = json.loads(line.rstrip())
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}, column {e.colno}); fix that line "
                         "(one JSON object per line)") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a JSON {type(row).__name__}, not an object; write one "
                         "{column: value} object per line")
    return row

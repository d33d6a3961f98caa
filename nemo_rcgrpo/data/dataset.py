"""Stage-1 data as a `datasets.Dataset` with a declared schema (memory-mapped Arrow), from any of three forms.

``load_stage1(path, split)`` reads

- a JSONL file, as `rcgrpo prepare-data` writes it (``sft.jsonl``, ``rctp.jsonl``);
- a Parquet file, as verl users keep their data;
- a folder written by ``Dataset.save_to_disk``;

and returns a Dataset of ``FEATURES``, written to the `datasets` cache (``HF_DATASETS_CACHE``) and memory-mapped
from there, keyed by the file's path, size and modification time. Each row is one conversation:

    task_id   string              the task it was played on (any id; used in logs and dumps)
    category  string (optional)   what per-category counts are keyed on
    split     string (optional)   train | test (``data.split`` selects; ``all``: every row)
    messages  list of messages    OpenAI chat messages: role, content, and for an assistant message tool_calls
                                  [{id, type, function: {name, arguments (a JSON string)}}], for a tool message
                                  tool_call_id and name
    tools     string (optional)   the OpenAI tool schemas offered, as a JSON string (JSON Schemas have no fixed Arrow
                                  type); JSONL lines may hold the list itself
    reward    int (optional)      1 expert, 0 failure (RCTP-FT data)

A row or column that does not fit is a `DataSchemaError` of one line naming the file, the row and the field.
`to_record(row)` gives the plain dict the renderer takes (absent fields dropped, tools parsed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

MESSAGE = {
    "role": "string",
    "content": "string",
    "tool_call_id": "string",
    "name": "string",
    "tool_calls": [{"id": "string", "type": "string", "function": {"name": "string", "arguments": "string"}}],
}
OPTIONAL = ("category", "split", "tools", "reward", "mode", "failure_type", "reward_goal")


class DataSchemaError(ValueError):
    """Stage-1 data that does not fit the schema; the message names the file, row and field."""


def features():
    from datasets import Features, List, Value

    def build(spec):
        if isinstance(spec, dict):
            return {k: build(v) for k, v in spec.items()}
        if isinstance(spec, list):
            return List(build(spec[0]))
        return Value(spec)

    return Features(
        {
            "task_id": Value("string"),
            "category": Value("string"),
            "split": Value("string"),
            "mode": Value("string"),
            "messages": List(build(MESSAGE)),
            "tools": Value("string"),
            "reward": Value("int32"),
            "failure_type": Value("string"),
            "reward_goal": Value("string"),
        }
    )


def _check_message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise DataSchemaError(f"{where}: must be a message object, not {type(m).__name__}")
    unknown = sorted(set(m) - set(MESSAGE))
    if unknown:
        raise DataSchemaError(f"{where}: unknown field {unknown[0]!r} (a message has {sorted(MESSAGE)})")
    if not isinstance(m.get("role"), str):
        raise DataSchemaError(f"{where}.role: must be a string")
    for key in ("content", "tool_call_id", "name"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise DataSchemaError(f"{where}.{key}: must be a string or absent")
    calls = m.get("tool_calls")
    if calls is None:
        return m
    if not isinstance(calls, list):
        raise DataSchemaError(f"{where}.tool_calls: must be a list")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise DataSchemaError(f"{where}.tool_calls[{j}].function.name: must be a string")
        args = f.get("arguments")
        if not isinstance(args, str):  # an object is accepted and stored as its JSON text, as OpenAI sends it
            args = json.dumps(args if args is not None else {})
        out.append(
            {"id": c.get("id"), "type": c.get("type", "function"), "function": {"name": f["name"], "arguments": args}}
        )
    return {**m, "tool_calls": out}


def check_record(r: Any, where: str) -> dict[str, Any]:
    """One row in the schema's shape (tools as a JSON string), or a DataSchemaError naming ``where`` and the field."""
    if not isinstance(r, dict):
        raise DataSchemaError(f"{where}: must be an object, not {type(r).__name__}")
    messages = r.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataSchemaError(
            f"{where}: field 'messages' must be a non-empty list of chat messages"
            + ("" if "messages" in r else f" (the row has {sorted(r)})")
        )
    row = {
        "task_id": None if r.get("task_id") is None else str(r["task_id"]),
        "messages": [_check_message(m, f"{where}: messages[{i}]") for i, m in enumerate(messages)],
    }
    tools = r.get("tools")
    if tools is not None and not isinstance(tools, (list, str)):
        raise DataSchemaError(f"{where}: field 'tools' must be a list of tool schemas or its JSON string")
    row["tools"] = json.dumps(tools) if isinstance(tools, list) else tools
    reward = r.get("reward")
    if reward is not None and (isinstance(reward, bool) or reward not in (0, 1)):
        raise DataSchemaError(f"{where}: field 'reward' must be 0 or 1, not {reward!r}")
    row["reward"] = reward
    for key in ("category", "split", "mode", "failure_type", "reward_goal"):
        value = r.get(key)
        if value is not None and not isinstance(value, str):
            raise DataSchemaError(f"{where}: field {key!r} must be a string, not {type(value).__name__}")
        row[key] = value
    return row


def jsonl_objects(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(``FILE:LINE``, the parsed line) of each non-empty line; a line that is not JSON is a one-line error."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataSchemaError(f"{path}:{n}: not JSON ({e.msg})") from None


def open_table(datasets, path: Path):
    """The Dataset of a saved-Dataset folder or a Parquet file (a folder that is not one: a one-line error)."""
    if not path.is_dir():
        return datasets.Dataset.from_parquet(str(path))
    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - not a saved Dataset: say so in one line
        raise DataSchemaError(
            f"{path}: a folder must be written by Dataset.save_to_disk ({type(e).__name__})"
        ) from None


def _jsonl_rows(path: str, size: int, mtime: int) -> Iterator[dict[str, Any]]:  # size, mtime: the cache key
    for where, r in jsonl_objects(path):
        yield check_record(r, where)


def _check_columns(ds, path: Path):
    """A Parquet file or saved Dataset: required and known columns, then every row through `check_record`."""
    columns = set(ds.column_names)
    if "messages" not in columns:
        raise DataSchemaError(
            f"{path}: field 'messages' is missing (columns: {sorted(columns)}; the stage-1 schema: "
            "nemo_rcgrpo/data/dataset.py)"
        )
    return ds


def load_stage1(path: str | Path, split: str = "all", progress: bool = False):
    """The stage-1 Dataset at ``path`` (.jsonl, .parquet or a saved-Dataset folder), rows of ``split`` only."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if progress else datasets.disable_progress_bars)()
    try:
        return _load(datasets, Path(path), split)
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()


class Rows:
    """A Dataset read row by row as renderer records (`to_record`), in any order, without a copy in Python lists."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return to_record(self.ds[int(i)])


def _load(datasets, path: Path, split: str):
    if path.is_dir() or path.suffix == ".parquet":
        rows = _check_columns(open_table(datasets, path), path)
    elif path.is_file():
        st = path.stat()
        try:
            return _select(
                datasets.Dataset.from_generator(
                    _jsonl_rows,
                    gen_kwargs={"path": str(path.resolve()), "size": st.st_size, "mtime": st.st_mtime_ns},
                    features=features(),
                ),
                split,
            )
        except datasets.exceptions.DatasetGenerationError as e:  # the generator's own error, not the wrapper
            cause = e.__cause__
            while cause is not None and not isinstance(cause, DataSchemaError):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            raise DataSchemaError(str(cause)) from None
    else:
        raise FileNotFoundError(f"data file {path} does not exist; run `rcgrpo prepare-data out_dir={path.parent}`")
    # Parquet / saved Dataset: their own Arrow types; every row checked and cast into the schema
    checked = [check_record(r, f"{path}: row {i}") for i, r in enumerate(rows)]
    return _select(datasets.Dataset.from_list(checked, features=features()), split)


def _select(ds, split: str):
    if split == "all":
        return ds
    return ds.filter(lambda s: s == split, input_columns="split")


def to_record(row: dict[str, Any]) -> dict[str, Any]:
    """A Dataset row as the renderer takes it: absent (None) fields dropped, at every level, and tools parsed."""

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if v is not None}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    out = clean(row)
    if isinstance(out.get("tools"), str):
        out["tools"] = json.loads(out["tools"])
    return out

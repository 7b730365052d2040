"""Rows of a task's data file: JSON lines or Parquet, local or any fsspec URL.

:func:`load_rows` reads the file with the ``datasets`` library (its Arrow
readers are fast on large files and read the Parquet that hubs publish),
but keeps it local and quiet: the hub is switched off for the call, the
cache lives in a temporary folder removed afterwards (nothing lands in
``~/.cache``), and every failure is one :class:`TaskDataError` line naming
the file, and the line for bad JSON, instead of a ``datasets`` traceback.
A remote URL (``s3://bucket/key.jsonl``) is copied to a local temporary
file with :func:`fsspec.open` first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from aurora_store.errors import TaskDataError

__all__ = ["SUFFIXES", "load_rows"]

#: File name endings :func:`load_rows` reads, and the ``datasets`` builder of each.
SUFFIXES: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

_OFFLINE_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def load_rows(url_or_path: str, storage_options: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every row of a ``.jsonl``/``.json``/``.parquet`` file as a dict, in file order.

    ``url_or_path`` is a local path or any fsspec URL (``s3://...``, with
    ``storage_options`` such as the endpoint and credentials). A ``.json``
    file may hold JSON lines or one array of objects. Raises
    :class:`TaskDataError` for a missing, empty, unreadable or malformed file.
    """
    src = os.fspath(url_or_path)
    builder = _builder_of(src)
    with _local_copy(src, storage_options) as path:
        if os.path.getsize(path) == 0:
            raise TaskDataError(f"{src}: the file is empty")
        rows = _read(src, path, builder)
    if not rows:
        raise TaskDataError(f"{src}: the file holds no rows")
    return rows


def _builder_of(src: str) -> str:
    name = src.split("?", 1)[0].rstrip("/").lower()
    for suffix, builder in SUFFIXES.items():
        if name.endswith(suffix):
            return builder
    raise TaskDataError(f"{src}: unknown file type (expected a name ending in {', '.join(SUFFIXES)})")


@contextlib.contextmanager
def _local_copy(src: str, storage_options: Mapping[str, Any] | None) -> Iterator[str]:
    """``src`` itself when local, else a temporary copy removed on exit."""
    if "://" not in src or src.startswith("file://"):
        path = src.removeprefix("file://")
        if not os.path.isfile(path):
            raise TaskDataError(f"{src}: no such file")
        yield path
        return
    import fsspec

    tmp = tempfile.mkdtemp(prefix="aurora-task-")
    try:
        local = os.path.join(tmp, "data" + os.path.splitext(src.split("?", 1)[0])[1])
        try:
            with fsspec.open(src, "rb", **dict(storage_options or {})) as fin, open(local, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
        except FileNotFoundError:
            raise TaskDataError(f"{src}: no such file") from None
        except Exception as e:  # any vendor's error: the store said no
            raise TaskDataError(f"{src}: cannot be read ({type(e).__name__}: {_first_line(e)})") from None
        yield local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read(src: str, path: str, builder: str) -> list[dict[str, Any]]:
    saved = {k: os.environ.get(k) for k in _OFFLINE_ENV}
    os.environ.update({k: "1" for k in _OFFLINE_ENV})
    try:
        import datasets
        import datasets.config
        import datasets.utils.logging as ds_logging

        datasets.config.HF_DATASETS_OFFLINE = True  # read when first imported: set it again
        ds_logging.disable_progress_bar()
        level = ds_logging.get_verbosity()
        ds_logging.set_verbosity(logging.CRITICAL)  # its own "Failed to load JSON" lines
        try:
            with tempfile.TemporaryDirectory(prefix="aurora-datasets-") as cache:
                ds = datasets.load_dataset(builder, data_files=path, split="train", cache_dir=cache, keep_in_memory=True)
                rows: list[dict[str, Any]] = ds.to_list()
                del ds
            return rows
        except Exception as e:
            if builder == "json":
                _explain_json(src, path)  # raises naming the line when it finds the fault
            raise TaskDataError(f"{src}: cannot be read as {builder} ({_first_line(e)})") from None
        finally:
            ds_logging.set_verbosity(level)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _explain_json(src: str, path: str) -> None:
    """Find why ``datasets`` refused a JSON file and raise naming the line (or return)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise TaskDataError(f"{src}: not UTF-8 text (byte {e.start})") from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{src}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        numbered = list(enumerate(records if isinstance(records, list) else [records], start=1))
        what = "item"
    else:
        numbered = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                numbered.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise TaskDataError(f"{src}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        what = "line"
    types: dict[str, tuple[str, int]] = {}
    for n, rec in numbered:
        if not isinstance(rec, dict):
            raise TaskDataError(f"{src}: {what} {n}: expected a JSON object, got {type(rec).__name__}")
        for key, value in rec.items():
            if value is None:
                continue
            kind = type(value).__name__
            first = types.setdefault(key, (kind, n))
            if first[0] != kind:
                raise TaskDataError(f"{src}: {what} {n}: field {key!r} is {kind}, but {first[0]} on {what} {first[1]}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    line = text.splitlines()[0]
    return line if len(line) <= 200 else line[:200] + "…"

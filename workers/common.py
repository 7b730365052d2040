"""What the Trainer, Actors and Relays share: where the run is and the model
description in the store.

Torch loads only when a model is built (:func:`read_model_description`), so
importing :class:`Endpoints` is light. The run's records (digests, expected
states) are :mod:`aurora_store.coordination.records`; process setup is
:mod:`workers.process`.

See docs/WORKERS.md for the contract these helpers implement.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aurora_store.errors import ConfigError, IntegrityError, ObjectNotFound
from aurora_store.lineage.binding import ModelFile
from aurora_store.redact import redacted_repr
from aurora_store.storage import Store

__all__ = [
    "MODEL_CONFIG_KEY",
    "MODEL_PREFIX",
    "TOKENIZER_KEY",
    "MAX_MODEL_FILE_BYTES",
    "write_model_description",
    "read_model_description",
    "model_files_listed",
    "check_model_files",
    "Endpoints",
]

MODEL_PREFIX = "model/"
"""Where the run root holds the model's description (config, tokenizer files, generation config)."""
MODEL_CONFIG_KEY = MODEL_PREFIX + "config.json"
TOKENIZER_KEY = MODEL_PREFIX + "tokenizer.json"
MAX_MODEL_FILE_BYTES = 64 << 20
"""Most bytes of one model description file a reader takes when no manifest lists its size
(a run written before the files were listed, a Trainer still setting up): the same bound as
``workers.pretrained.MAX_FILE_BYTES``, kept here so that reading it loads no torch. Read
capped one byte past it, never whole."""

log = logging.getLogger("aurora.workers")


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where a worker finds the run."""

    store: str
    """Run root URL at origin."""
    redis: str
    """Redis URL."""
    run: str
    """Run name (the Redis key namespace)."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)

    __repr__ = redacted_repr  # the Redis URL may hold a password, the options keys and tokens


def write_model_description(
    store: Store, config_json: str | bytes, tokenizer_json: str | bytes | None, extra: Mapping[str, bytes] | None = None
) -> list[ModelFile]:
    """Create-only: a run's model is fixed for its whole life.

    ``model/config.json`` and ``model/tokenizer.json`` (the character
    tokenizer's, or a Hugging Face ``tokenizer.json``; None for a directory
    without one), then ``extra`` (file name -> bytes: the generation config,
    the tokenizer's config and chat template, :mod:`workers.pretrained`),
    each under ``model/``. Returns the files as version 0's snapshot
    manifest lists them (FORMAT.md §1): the Trainer passes them to
    ``publish_snapshot(model=...)``, so they are covered by that manifest's
    hashes (and signature), and readers check them before use
    (:func:`read_model_description`).
    """
    named: dict[str, bytes] = {}
    if tokenizer_json is not None:
        named["tokenizer.json"] = _bytes(tokenizer_json)
    for name, data in (extra or {}).items():
        if name != "config.json":
            named.setdefault(name, data)
    # The config last: a reader that finds it finds every other file (the Actor waits for it).
    named["config.json"] = _bytes(config_json)
    files = []
    for name, data in named.items():
        key = MODEL_PREFIX + name
        store.put(key, data, mode="create")
        files.append(ModelFile(key, len(data), hashlib.sha256(data).hexdigest()))
    return files


def _bytes(text: str | bytes) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)


def model_files_listed(store: Store) -> tuple[dict[str, ModelFile] | None, str]:
    """(the model files the run lists, the manifest that lists them); (None, why) for a run that lists none.

    Version 0's snapshot manifest is the list (FORMAT.md §1). Where retention
    removed version 0, the newest snapshot *bound to the chain* (FORMAT.md
    §4.1) that carries a list stands in: the Trainer lists the files in every
    snapshot it writes, and a planted snapshot is never bound.
    """
    from aurora_store.format.manifest import manifest_key
    from aurora_store.lineage.binding import model_files
    from aurora_store.lineage.fetch import ManifestReader
    from aurora_store.lineage.plan import scan_versions

    reader = ManifestReader(store)
    snapshots = [0] if reader.get("snapshot", 0) is not None else sorted(scan_versions(store).snapshots, reverse=True)
    for v in snapshots:
        m = reader.get("snapshot", v)
        if m is None or reader.unbound(v) is not None:
            continue
        where = store.where(manifest_key("snapshot", v))
        files = model_files(m.extra, where)
        if files is not None:
            return files, where
        if v == 0:
            break
    return None, "no snapshot manifest lists the model files (a run written before they were listed)"


def _checked_model_file(store: Store, key: str, listed: Mapping[str, ModelFile] | None, where: str) -> bytes:
    """The bytes of ``key``, checked against ``listed`` (size and sha256) when the run lists its files."""
    f = listed.get(key) if listed is not None else None
    if listed is not None and f is None:
        raise IntegrityError(f"{store.where(key)}: not among the model files {where} lists")
    if f is None:
        return store.get_capped(key, MAX_MODEL_FILE_BYTES, "the limit on a model file")
    data = store.get_capped(key, f.bytes, f"the size {where} lists")
    if len(data) != f.bytes or hashlib.sha256(data).hexdigest() != f.sha256:
        raise IntegrityError(
            f"{store.where(key)}: does not match {where} (size or sha256): the model description was changed after version 0"
        )
    return data


_unlisted_said: set[str] = set()


def _say_unlisted(store: Store, why: str) -> None:
    if store.url not in _unlisted_said:
        _unlisted_said.add(store.url)
        log.warning("%s: the model files are not checked: %s", store.url, why)


def check_model_files(store: Store, used: Mapping[str, str]) -> None:
    """Check files already read (key -> sha256 of the bytes used) against the run's list, now that it exists.

    For a reader that built its model while the Trainer was still setting up
    (the files are written just before version 0, which lists them).
    """
    listed, where = model_files_listed(store)
    if listed is None:
        _say_unlisted(store, where)
        return
    for key, sha in used.items():
        f = listed.get(key)
        if f is None or f.sha256 != sha:
            raise IntegrityError(f"{store.where(key)}: does not match {where}: the model description was changed after version 0")


def read_model_description(store: Store, used: dict[str, str] | None = None, unlisted_ok: bool = False) -> tuple[Any, Any]:
    """(model skeleton in bf16 with random weights, tokenizer) from ``model/`` in the store.

    Each file is checked against the list in version 0's manifest first
    (:func:`model_files_listed`): a file changed after version 0 raises
    :class:`~aurora_store.errors.IntegrityError`. A run whose manifests list
    no files (written before they were listed, or a Trainer still setting
    up) is read from what ``model/`` holds, with a warning unless
    ``unlisted_ok`` (the caller checks later, with :func:`check_model_files`,
    once version 0 exists). ``used`` receives key -> sha256 of the bytes read.

    The tokenizer is the character tokenizer when ``model/tokenizer.json`` is
    one, else a :class:`~workers.tokenizer.HFTokenizer` built from the stored
    tokenizer files and generation config; a family the fusion map does not
    know is refused (:func:`workers.pretrained.check_family`).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.pretrained import MAX_FILE_BYTES, check_family, tokenizer_from_files
    from workers.router_bias import bias_as_parameter
    from workers.tokenizer import CharTokenizer

    listed, where = model_files_listed(store)
    if listed is None and not unlisted_ok:
        _say_unlisted(store, where)
    keys = sorted(k for k in listed if k.startswith(MODEL_PREFIX)) if listed is not None else store.list(MODEL_PREFIX)
    if MODEL_CONFIG_KEY not in keys:
        raise ConfigError(f"{store.where(MODEL_CONFIG_KEY)}: the run has no model description yet (has the Trainer started?)")
    files: dict[str, bytes] = {}
    try:
        for key in keys:
            if listed is None and store.size(key) > MAX_FILE_BYTES:
                raise IntegrityError(f"{store.where(key)}: over the {MAX_FILE_BYTES} bytes a model description file may have")
            files[key[len(MODEL_PREFIX) :]] = _checked_model_file(store, key, listed, where)
    except ObjectNotFound as e:
        raise ConfigError(f"{e}: the run's model description is incomplete") from None
    if used is not None:
        used.update({MODEL_PREFIX + n: hashlib.sha256(b).hexdigest() for n, b in files.items()})
    try:
        cfg_dict = json.loads(files["config.json"])
        model_type = check_family(cfg_dict, store.where(MODEL_CONFIG_KEY))
        cfg_dict.pop("model_type")
    except (ValueError, AttributeError, TypeError) as e:
        raise ConfigError(f"{store.where(MODEL_CONFIG_KEY)}: not a model config: {e}") from None
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
    bias_as_parameter(model)  # a DeepSeek-style router bias arrives with the weights, not from the config
    torch.nn.Module.to(model, dtype=torch.bfloat16)
    tok_raw = files.get("tokenizer.json")
    tokenizer: Any
    if tok_raw is not None and _is_char_tokenizer(tok_raw):
        tokenizer = CharTokenizer.from_json(tok_raw.decode("utf-8"), where=store.where(TOKENIZER_KEY))
    else:
        tokenizer = tokenizer_from_files(files, getattr(cfg, "vocab_size", None), store.where(MODEL_PREFIX))
    return model.eval(), tokenizer


def _is_char_tokenizer(raw: bytes) -> bool:
    from workers.tokenizer import CHAR_FORMAT

    try:
        d = json.loads(raw)
    except ValueError:
        return False
    return isinstance(d, dict) and d.get("format") == CHAR_FORMAT

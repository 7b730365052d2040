"""A Hugging Face model directory: which families a run accepts, what of it the run root holds, how it is read back.

``aurora trainer --model DIR`` takes a local causal-LM directory (config,
safetensors weights, tokenizer files, generation config; never the Hub).
Its weights become version 0; its *description* (every file but the
weights, from the allowlist :data:`DESCRIPTION_FILES`) is copied under
``model/`` in the run root and listed with hashes in version 0's manifest
(FORMAT.md §1), so an Actor needs only the run root: it builds the model
skeleton from the stored config and the tokenizer from the stored files.

The allowlist keeps a directory's other files (READMEs, optimizer states,
images) out of the run root; a file over :data:`MAX_FILE_BYTES` is refused.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from aurora_store.errors import ConfigError
from workers.router_bias import bias_as_parameter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "Checkpoint",
    "DESCRIPTION_FILES",
    "FAMILIES",
    "MAX_FILE_BYTES",
    "ModelDir",
    "check_family",
    "build_empty",
    "load_pretrained",
    "read_checkpoint",
    "read_model_dir",
    "tokenizer_from_files",
]

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe")
"""``model_type`` values whose projections the fusion map knows (aurora_store.codec.fusion, .experts).

DeepSeek-style ``glm4_moe`` (shared experts, standard attention, no MLA):
transformers holds its router bias ``e_score_correction_bias`` as a buffer;
every model built here holds it as a frozen parameter instead, so that it
travels like the weights (:mod:`workers.router_bias`)."""

DESCRIPTION_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files of a model directory that describe it (everything an Actor needs but the weights)."""

TOKENIZER_FILES = frozenset(DESCRIPTION_FILES) - {"config.json", "generation_config.json"}

MAX_FILE_BYTES = 64 << 20
"""Largest description file accepted (a tokenizer.json of a 256 k vocabulary is about 30 MB)."""


def check_family(config: Mapping[str, Any], where: str) -> str:
    """The ``model_type`` of a config, refused with a message naming it when the fusion map does not know it."""
    family = config.get("model_type")
    if not isinstance(family, str):
        raise ConfigError(f"{where}: config.json has no model_type: not a Hugging Face model config")
    if family not in FAMILIES:
        raise ConfigError(
            f"{where}: model family {family!r} is not supported (supported: {', '.join(FAMILIES)}): "
            f"the fusion map knows their projections only"
        )
    return family


@dataclass(frozen=True, slots=True)
class ModelDir:
    """What a run ships of a local model directory besides its weights."""

    path: str
    family: str
    config: dict[str, Any]
    files: dict[str, bytes]
    """File name -> bytes, the description files the directory has."""


def read_model_dir(path: str | os.PathLike[str]) -> ModelDir:
    """Check a local causal-LM directory and read its description files.

    Refused, each with one line naming the directory: a path that is not a
    directory, no ``config.json``, a family the fusion map does not know, no
    safetensors weights (``.bin`` pickles are not loaded: they execute code),
    no tokenizer, a description file over :data:`MAX_FILE_BYTES`.
    """
    p = os.fspath(path)
    if not os.path.isdir(p):
        raise ConfigError(f"--model {p}: not a directory (a local Hugging Face model directory is expected; nothing is fetched from a hub)")
    cfg_path = os.path.join(p, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--model {p}: no config.json: not a Hugging Face model directory") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cfg_path}: not a JSON config: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{cfg_path}: not a JSON object")
    family = check_family(config, p)
    names = set(os.listdir(p))
    if not any(n.endswith(".safetensors") for n in names):
        raise ConfigError(
            f"--model {p}: no *.safetensors weights (PyTorch .bin pickles are not loaded; convert with save_pretrained(safe_serialization=True))"
        )
    if not names & {"tokenizer.json", "tokenizer.model", "vocab.json"}:
        raise ConfigError(f"--model {p}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")
    files: dict[str, bytes] = {}
    for name in DESCRIPTION_FILES:
        fp = os.path.join(p, name)
        if not os.path.isfile(fp):
            continue
        size = os.path.getsize(fp)
        if size > MAX_FILE_BYTES:
            raise ConfigError(f"{fp}: {size} bytes, over the {MAX_FILE_BYTES} a description file may have")
        with open(fp, "rb") as f:
            files[name] = f.read()
    return ModelDir(p, family, config, files)


def load_pretrained(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The directory's causal LM in ``dtype``, offline, safetensors only, no remote code; router biases as parameters (:mod:`workers.router_bias`)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load in a worker's log says nothing
    p = os.fspath(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True, use_safetensors=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"--model {p}: cannot load the model: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    bias_as_parameter(model)
    return model


def build_empty(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The directory's causal LM built from its config alone, without its weights (offline, no remote code).

    Under :func:`workers.trainer.sharding.params_on_meta` the parameters are meta
    tensors: a sharded Trainer's rank then allocates and reads only its own shard.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    p = os.fspath(path)
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True, trust_remote_code=False)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"--model {p}: cannot build the model: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    bias_as_parameter(model)
    return model


def tokenizer_from_files(files: Mapping[str, bytes], model_vocab: int | None, where: str) -> Any:
    """An :class:`~workers.tokenizer.HFTokenizer` from description files (name -> bytes), as an Actor reads them from the run root.

    The files are written to a private temporary directory that
    ``AutoTokenizer`` reads (offline, no remote code) and that is removed after.
    """
    from workers.tokenizer import HFTokenizer

    with tempfile.TemporaryDirectory(prefix="aurora-tokenizer-") as d:
        for name, data in files.items():
            if name in TOKENIZER_FILES or name == "generation_config.json":
                with open(os.path.join(d, name), "wb") as f:
                    f.write(data)
        tok = HFTokenizer.from_dir(d, model_vocab=model_vocab)
    tok.where = where
    return tok


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The tensors of a safetensors file or model directory, as saved, and what its config says about naming them."""

    tensors: dict[str, torch.Tensor]
    family: str | None
    """config.json's ``model_type`` (None: a bare file, or no config)."""
    tied: bool
    """config.json's ``tie_word_embeddings``."""
    config: dict[str, Any]
    """config.json (empty for a bare file)."""


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """A ``.safetensors`` file, or every ``*.safetensors`` of a model directory (shards) with its ``config.json``.

    Refused with one line: a path that does not exist, a directory without
    safetensors files, an unreadable file, a tensor name in two shards, a
    config.json that is not a JSON object.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = os.fspath(path)
    if os.path.isdir(p):
        files = sorted(os.path.join(p, n) for n in os.listdir(p) if n.endswith(".safetensors"))
        if not files:
            raise ConfigError(f"{p}: no *.safetensors weights in the directory")
    elif os.path.exists(p):
        files = [p]
    else:
        raise ConfigError(f"{p}: no such file or directory")
    tensors: dict[str, torch.Tensor] = {}
    for fp in files:
        try:
            part = load_file(fp)
        except (SafetensorError, OSError, ValueError) as e:
            raise ConfigError(f"{fp}: not a readable safetensors file: {e}") from None
        twice = sorted(set(part) & set(tensors))
        if twice:
            raise ConfigError(f"{fp}: {twice[0]} is in another shard too")
        tensors.update(part)
    config: dict[str, Any] = {}
    cfg_path = os.path.join(p, "config.json")
    if os.path.isdir(p) and os.path.isfile(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{cfg_path}: not a JSON config: {e}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{cfg_path}: not a JSON object")
    family = config.get("model_type")
    return Checkpoint(tensors, family if isinstance(family, str) else None, config.get("tie_word_embeddings") is True, config)

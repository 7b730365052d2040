"""The tokenizers: a character-level one of our own (the built-in model's), and Hugging Face's.

:class:`HFTokenizer` wraps a user's tokenizer (``--model DIR``; an Actor
reads the same files from the run root) behind the members the engines and
the Trainer use; :class:`CharTokenizer` is the built-in tiny model's.

Nothing is downloaded: the vocabulary is a fixed, ordered alphabet, so the
same characters get the same ids on every machine, and a Trainer and its
Actors agree on ids without shipping anything but a small JSON file. The
special tokens come first (``pad`` = 0, ``bos`` = 1, ``eos`` = 2, ``unk`` = 3)
so that a model built for one alphabet keeps its special rows when the
alphabet grows at the end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aurora_store.errors import TokenizerError

__all__ = [
    "ASCII_ALPHABET",
    "CHAR_FORMAT",
    "DEFAULT_ALPHABET",
    "SPECIAL_TOKENS",
    "CharTokenizer",
    "HFTokenizer",
    "TokenizerError",
]

#: Special tokens, in id order.
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")

#: Digits, arithmetic, the GSM8K answer marker and what "Q: 23+58=? A:" needs.
DEFAULT_ALPHABET = "0123456789+-*/()=?#:,. \nQA"
#: The default alphabet, then the rest of printable ASCII: enough for GSM8K text.
#: It extends the default at the end, so default ids keep their meaning.
ASCII_ALPHABET = DEFAULT_ALPHABET + "".join(c for c in map(chr, range(33, 127)) if c not in DEFAULT_ALPHABET)

CHAR_FORMAT = "aurora-char-tokenizer/1"
_FORMAT = CHAR_FORMAT


@dataclass(frozen=True)
class CharTokenizer:
    """One id per character of ``alphabet``, after the special tokens."""

    alphabet: str = DEFAULT_ALPHABET
    """Characters in id order; id of ``alphabet[i]`` is ``len(SPECIAL_TOKENS) + i``."""
    strict: bool = True
    """Unknown characters raise :class:`TokenizerError`; otherwise they become ``unk``."""
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.alphabet:
            raise TokenizerError("the alphabet is empty")
        seen: set[str] = set()
        for i, ch in enumerate(self.alphabet):
            if ch in seen:
                raise TokenizerError(f"alphabet: character {ch!r} at position {i} repeats")
            seen.add(ch)
        base = len(SPECIAL_TOKENS)
        object.__setattr__(self, "_ids", {ch: base + i for i, ch in enumerate(self.alphabet)})

    # -- ids ---------------------------------------------------------------
    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def unk_id(self) -> int:
        return 3

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.alphabet)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(len(SPECIAL_TOKENS)))

    # -- coding ------------------------------------------------------------
    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``text``'s characters, optionally framed by ``bos``/``eos``."""
        out = [self.bos_id] if bos else []
        ids = self._ids
        for pos, ch in enumerate(text):
            i = ids.get(ch)
            if i is None:
                if self.strict:
                    raise TokenizerError(f"character {ch!r} at position {pos} of {_preview(text)} is not in the alphabet")
                i = self.unk_id
            out.append(i)
        if eos:
            out.append(self.eos_id)
        return out

    def render_prompt(self, text: str) -> list[int]:
        """The ids a prompt is generated from: ``bos`` and the text (no chat template here)."""
        return self.encode(text, bos=True)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def encode_batch(self, texts: Iterable[str], bos: bool = False) -> list[list[int]]:
        return [self.encode(t, bos=bos) for t in texts]

    def decode(self, ids: Sequence[int] | Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped (or spelled out with ``skip_special=False``)."""
        base = len(SPECIAL_TOKENS)
        n = self.vocab_size
        parts: list[str] = []
        for i in ids:
            i = int(i)
            if not 0 <= i < n:
                raise TokenizerError(f"id {i} is outside the vocabulary (size {n})")
            if i < base:
                if not skip_special:
                    parts.append(SPECIAL_TOKENS[i])
            else:
                parts.append(self.alphabet[i - base])
        return "".join(parts)

    # -- files -------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {
                "format": _FORMAT,
                "special_tokens": list(SPECIAL_TOKENS),
                "alphabet": self.alphabet,
                "strict": self.strict,
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, where: str = "<string>") -> CharTokenizer:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{where}: not JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != _FORMAT:
            raise TokenizerError(f"{where}: not a {_FORMAT} file")
        if d.get("special_tokens") != list(SPECIAL_TOKENS):
            raise TokenizerError(f"{where}: special_tokens {d.get('special_tokens')!r}, expected {list(SPECIAL_TOKENS)}")
        alphabet, strict = d.get("alphabet"), d.get("strict", True)
        if not isinstance(alphabet, str) or not isinstance(strict, bool):
            raise TokenizerError(f"{where}: 'alphabet' must be a string and 'strict' a boolean")
        return cls(alphabet, strict)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the tokenizer as JSON (a file, or ``tokenizer.json`` inside a folder)."""
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "tokenizer.json")
        with open(p, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CharTokenizer:
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "tokenizer.json")
        with open(p, encoding="utf-8") as f:
            return cls.from_json(f.read(), p)


def _preview(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "…")


class HFTokenizer:
    """A Hugging Face tokenizer (``tokenizer.json``, its config and chat template) as the engines use it.

    The same members as :class:`CharTokenizer` (ids, ``encode``, ``decode``)
    plus :meth:`render_prompt`, which gives the ids a prompt is generated
    from: the tokenizer's chat template with the generation prompt when it
    has one (what ``apply_chat_template`` gives), else ``bos`` (when the
    tokenizer has one) and the text. ``stop_ids`` are every end-of-sequence
    id of the generation config (Qwen3 and Llama 3 name several).
    """

    def __init__(self, tok: Any, stop_ids: Sequence[int] = (), model_vocab: int | None = None, where: str = "<tokenizer>") -> None:
        self._tok = tok
        self.where = where
        eos = [int(i) for i in stop_ids] or ([int(tok.eos_token_id)] if tok.eos_token_id is not None else [])
        if not eos:
            raise TokenizerError(f"{where}: the tokenizer names no eos token and the generation config no eos_token_id")
        self._stop = tuple(dict.fromkeys(eos))
        pad = tok.pad_token_id
        self._pad = int(pad) if pad is not None else self._stop[0]
        self._n = max(len(tok), int(model_vocab or 0))

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], model_vocab: int | None = None) -> HFTokenizer:
        """The tokenizer of a local model directory (never the Hub), with its generation config's stop ids."""
        from transformers import AutoTokenizer

        p = os.fspath(path)
        try:
            tok = AutoTokenizer.from_pretrained(p, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TokenizerError(
                f"{p}: not a loadable Hugging Face tokenizer: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None
        stop: list[int] = []
        gen = os.path.join(p, "generation_config.json")
        if os.path.exists(gen):
            try:
                with open(gen, encoding="utf-8") as f:
                    named = json.load(f).get("eos_token_id")
            except (OSError, ValueError, AttributeError) as err:
                raise TokenizerError(f"{gen}: not a generation config: {err}") from None
            stop = [named] if isinstance(named, int) else [i for i in (named or []) if isinstance(i, int)]
        return cls(tok, stop, model_vocab, where=p)

    @property
    def hf(self) -> Any:
        """The wrapped ``PreTrainedTokenizerFast``."""
        return self._tok

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> int | None:
        b = self._tok.bos_token_id
        return int(b) if b is not None else None

    @property
    def eos_id(self) -> int:
        return self._stop[0]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop

    @property
    def vocab_size(self) -> int:
        """Ids a model may emit: the tokenizer's, or the model's embedding rows when it has more."""
        return self._n

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self._tok.all_special_ids)

    @property
    def chat_template(self) -> str | None:
        t = getattr(self._tok, "chat_template", None)
        return t if isinstance(t, str) and t else None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``text`` without the tokenizer's own specials, optionally framed by ``bos``/``eos``."""
        ids = [int(i) for i in self._tok.encode(text, add_special_tokens=False)]
        if bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def render_prompt(self, text: str) -> list[int]:
        """The ids a user message is generated from: the chat template's, when the tokenizer has one."""
        if self.chat_template is None:
            return self.encode(text, bos=True)
        out = self._tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return [int(i) for i in out]

    def decode(self, ids: Sequence[int] | Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``; ids past the tokenizer's own (padding rows of the embedding) are dropped."""
        n = len(self._tok)
        keep = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self._n:
                raise TokenizerError(f"id {i} is outside the vocabulary (size {self._n})")
            if i < n:
                keep.append(i)
        return str(self._tok.decode(keep, skip_special_tokens=skip_special))

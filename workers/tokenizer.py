"""A character-level tokenizer of our own, for the arithmetic task.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from aurora_store.errors import TokenizerError

__all__ = [
    "ASCII_ALPHABET",
    "DEFAULT_ALPHABET",
    "SPECIAL_TOKENS",
    "CharTokenizer",
    "TokenizerError",
]

#: Special tokens, in id order.
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")

#: Digits, arithmetic, the GSM8K answer marker and what "Q: 23+58=? A:" needs.
DEFAULT_ALPHABET = "0123456789+-*/()=?#:,. \nQA"
#: The default alphabet, then the rest of printable ASCII: enough for GSM8K text.
#: It extends the default at the end, so default ids keep their meaning.
ASCII_ALPHABET = DEFAULT_ALPHABET + "".join(
    c for c in map(chr, range(33, 127)) if c not in DEFAULT_ALPHABET
)

_FORMAT = "aurora-char-tokenizer/1"




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
                    raise TokenizerError(
                        f"character {ch!r} at position {pos} of {_preview(text)} is not in the alphabet"
                    )
                i = self.unk_id
            out.append(i)
        if eos:
            out.append(self.eos_id)
        return out

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
            raise TokenizerError(
                f"{where}: special_tokens {d.get('special_tokens')!r}, expected {list(SPECIAL_TOKENS)}"
            )
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

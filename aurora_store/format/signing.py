"""Signed versions (FORMAT.md §4.1): who wrote a manifest, checked before any segment is used.

Every byte of a version is hashed, and the ``state`` chain binds each delta
to its base; but nothing in the hashes says *who* wrote a version: anyone
who can write to origin (or to a mirror) can publish a self-consistent one.
A signature closes that. The Trainer (and ``aurora snapshot create`` /
``delta create``) signs every manifest with a :class:`Signer`; a reader
holding :class:`TrustKeys` refuses a manifest that is unsigned, signed by a
key it does not trust, or badly signed, with a :class:`~aurora_store.errors.SignatureError`
that names the version and the key id. A reader with no trust key ignores
the field, exactly as before signatures existed.

Two algorithms:

- ``ed25519`` (recommended): the writer holds the private key, readers only
  the public one and so cannot sign. ``key_id`` = first 16 hex digits of the
  sha256 of the 32-byte raw public key. Keys are PEM files (PKCS#8 private,
  SubjectPublicKeyInfo public) as ``cryptography`` and ``openssl`` write them
  (:func:`generate_keypair`, ``aurora keygen``).
- ``hmac-sha256``: a shared secret file of at least 32 random bytes (e.g.
  ``head -c 32 /dev/urandom > key``); every reader can also sign. Its key id
  is chosen by the operator, or the first 16 hex digits of the sha256 of the
  secret.

The signed bytes are the canonical JSON of the manifest object without its
``signature`` member. Both algorithms are deterministic, so a publish that
is retried after a lost answer writes the very same manifest bytes.

This module does no I/O beyond reading key files it is pointed at.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aurora_store.errors import ConfigError, SignatureError
from aurora_store.format.manifest import Manifest, canonical_json

__all__ = [
    "ED25519",
    "HMAC_SHA256",
    "ALGORITHMS",
    "MIN_HMAC_KEY_BYTES",
    "PRIVATE_KEY_FILE",
    "PUBLIC_KEY_FILE",
    "Signature",
    "Signer",
    "TrustKeys",
    "signing_payload",
    "ed25519_key_id",
    "hmac_key_id",
    "generate_keypair",
    "signer_from_option",
    "trust_from_option",
]

ED25519 = "ed25519"
HMAC_SHA256 = "hmac-sha256"
ALGORITHMS = (ED25519, HMAC_SHA256)
#: Shortest HMAC secret accepted: 32 bytes (256 bits), the tag's own strength.
MIN_HMAC_KEY_BYTES = 32
#: File names ``aurora keygen --out DIR`` writes.
PRIVATE_KEY_FILE = "signing-key.pem"
PUBLIC_KEY_FILE = "signing-key.pub.pem"

_KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_HEX = re.compile(r"^[0-9a-f]*$")
_VALUE_HEX = {ED25519: 128, HMAC_SHA256: 64}
#: Key files are small; a bigger file is not a key (and is not read whole).
_MAX_KEY_FILE = 64 << 10


def signing_payload(obj: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: canonical JSON of ``obj`` without ``signature``."""
    return canonical_json({k: v for k, v in obj.items() if k != "signature"})


def ed25519_key_id(raw_public: bytes) -> str:
    """``key_id`` of an Ed25519 key: first 16 hex digits of sha256 of its 32 raw bytes."""
    return hashlib.sha256(raw_public).hexdigest()[:16]


def hmac_key_id(secret: bytes) -> str:
    """Default ``key_id`` of an HMAC secret: first 16 hex digits of its sha256."""
    return hashlib.sha256(secret).hexdigest()[:16]


def _check_key_id(key_id: str) -> str:
    if not _KEY_ID.fullmatch(key_id):
        raise ConfigError(f"key id {key_id!r} must be 1-64 letters, digits, '.', '_' or '-'")
    return key_id


def _read_key_file(path: str | os.PathLike[str], what: str) -> bytes:
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > _MAX_KEY_FILE:
            raise ConfigError(f"{what} {p}: {size} bytes is not a key file")
        return p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {p}: cannot read it ({e.strerror or type(e).__name__})") from None


def _is_pem(data: bytes) -> bool:
    return data.lstrip().startswith(b"-----BEGIN ")


@dataclass(frozen=True, slots=True)
class Signature:
    """The ``signature`` member of a manifest."""

    alg: str
    key_id: str
    value: str
    """Lowercase hex: 64-byte Ed25519 signature or 32-byte HMAC tag."""

    def to_json(self) -> dict[str, str]:
        return {"alg": self.alg, "key_id": self.key_id, "value": self.value}

    @classmethod
    def from_json(cls, raw: Any) -> Signature | str:
        """The signature, or why ``raw`` is not one (untrusted input: never raises)."""
        if not isinstance(raw, dict):
            return f"signature is a {type(raw).__name__}, not an object"
        alg, key_id, value = raw.get("alg"), raw.get("key_id"), raw.get("value")
        if alg not in ALGORITHMS:
            return f"signature alg {str(alg)[:40]!r} is not one of {list(ALGORITHMS)}"
        if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
            return f"signature key_id {str(key_id)[:70]!r} is not a key id"
        if not isinstance(value, str) or len(value) != _VALUE_HEX[alg] or not _HEX.fullmatch(value):
            return f"signature value is not {_VALUE_HEX[alg]} lowercase hex digits"
        return cls(alg, key_id, value)


class Signer:
    """Signs manifests with one key (Ed25519 private key, or an HMAC secret).

    Build one with :meth:`from_file` (``--sign-key``), :meth:`ed25519` or
    :meth:`hmac`. The key never appears in a repr or message.
    """

    __slots__ = ("alg", "key_id", "_ed", "_secret")

    def __init__(self, alg: str, key_id: str, *, ed: Any = None, secret: bytes | None = None) -> None:
        self.alg = alg
        self.key_id = _check_key_id(key_id)
        self._ed = ed
        self._secret = secret

    @classmethod
    def ed25519(cls, private_key: Any) -> Signer:
        """From a ``cryptography`` ``Ed25519PrivateKey``."""
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        raw = private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return cls(ED25519, ed25519_key_id(raw), ed=private_key)

    @classmethod
    def hmac(cls, secret: bytes, key_id: str | None = None) -> Signer:
        """From a shared secret of at least :data:`MIN_HMAC_KEY_BYTES` bytes."""
        if len(secret) < MIN_HMAC_KEY_BYTES:
            raise ConfigError(f"an hmac-sha256 key needs at least {MIN_HMAC_KEY_BYTES} bytes, got {len(secret)}")
        return cls(HMAC_SHA256, key_id or hmac_key_id(secret), secret=bytes(secret))

    @classmethod
    def generate(cls) -> Signer:
        """A fresh Ed25519 key (tests, benchmarks; ``aurora keygen`` writes one to files)."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls.ed25519(Ed25519PrivateKey.generate())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], key_id: str | None = None) -> Signer:
        """A PEM Ed25519 private key (PKCS#8, unencrypted), else an HMAC secret file.

        ``key_id`` names an HMAC key (an Ed25519 key's id is derived from the
        key itself, and giving another one is an error).
        """
        data = _read_key_file(path, "signing key")
        if not _is_pem(data):
            return cls.hmac(data, key_id)
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        try:
            key = load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"signing key {path}: not an unencrypted PEM private key ({e})") from None
        except Exception as e:  # noqa: BLE001 - cryptography raises UnsupportedAlgorithm (not a ValueError)
            raise ConfigError(f"signing key {path}: {type(e).__name__}: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"signing key {path}: a {type(key).__name__}; Aurora signs with Ed25519 keys")
        signer = cls.ed25519(key)
        if key_id is not None and key_id != signer.key_id:
            raise ConfigError(f"signing key {path}: an Ed25519 key's id is {signer.key_id}, not {key_id!r}")
        return signer

    # ------------------------------------------------------------------
    def sign_payload(self, payload: bytes) -> Signature:
        if self.alg == ED25519:
            return Signature(ED25519, self.key_id, self._ed.sign(payload).hex())
        assert self._secret is not None
        return Signature(HMAC_SHA256, self.key_id, hmac.new(self._secret, payload, hashlib.sha256).hexdigest())

    def sign_json(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """``obj`` with a ``signature`` member over the rest of it."""
        return {**obj, "signature": self.sign_payload(signing_payload(obj)).to_json()}

    def sign(self, m: Manifest) -> Manifest:
        """``m`` signed: its ``signature`` (in ``extra``) covers every other field as written.

        Call it last, on the manifest exactly as it will be written.
        """
        body = {k: v for k, v in m.to_json().items() if k != "signature"}
        sig = self.sign_payload(canonical_json(body))
        extra = {k: v for k, v in m.extra.items() if k != "signature"}
        extra["signature"] = sig.to_json()
        return replace(m, extra=extra)

    def public_pem(self) -> bytes:
        """The public key, SubjectPublicKeyInfo PEM (Ed25519 only)."""
        if self.alg != ED25519:
            raise ConfigError("an hmac-sha256 key has no public half: readers need the secret itself")
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        return bytes(self._ed.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))

    def private_pem(self) -> bytes:
        """The private key, PKCS#8 PEM, unencrypted (Ed25519 only)."""
        if self.alg != ED25519:
            raise ConfigError("an hmac-sha256 key is its secret file")
        from cryptography.hazmat.primitives.serialization import (
            Encoding,
            NoEncryption,
            PrivateFormat,
        )

        return bytes(self._ed.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))

    def trust(self) -> TrustKeys:
        """The keys that verify this signer's signatures (for HMAC: the secret itself)."""
        if self.alg == ED25519:
            return TrustKeys([(ED25519, self.key_id, self._ed.public_key())])
        assert self._secret is not None
        return TrustKeys([(HMAC_SHA256, self.key_id, self._secret)])

    def __repr__(self) -> str:
        return f"Signer({self.alg}, key_id={self.key_id})"


class TrustKeys:
    """The keys a reader accepts signatures from; several at once for a key rotation.

    Immutable. Build with :meth:`from_files` (``--trust-key``), or from a
    :class:`Signer` (:meth:`Signer.trust`); combine with ``|``. Empty trust
    keys are not allowed (use None for "no check").

    A key may sign several runs. A reader that knows its run binds the keys to
    it (:meth:`for_run`): a manifest signed for another run (its signed ``run``
    field) is refused like a forged one, so another run's chain copied under
    this run's names never replays.
    """

    __slots__ = ("_keys", "run")

    def __init__(self, keys: Iterable[tuple[str, str, Any]], run: str | None = None) -> None:
        out: dict[str, tuple[str, Any]] = {}
        for alg, key_id, key in keys:
            if alg not in ALGORITHMS:
                raise ConfigError(f"unknown signature algorithm {alg!r}")
            _check_key_id(key_id)
            if key_id in out and out[key_id][0] != alg:
                raise ConfigError(f"trust key id {key_id} names two keys of different algorithms")
            out[key_id] = (alg, key)
        if not out:
            raise ConfigError("no trust key given")
        self._keys = out
        self.run = run
        """The run whose manifests these keys accept; None: any run the keys signed."""

    def for_run(self, run: str | None) -> TrustKeys:
        """These keys, accepting only manifests whose signed ``run`` is ``run`` (None: unbound)."""
        if run == self.run:
            return self
        return TrustKeys([(a, k, key) for k, (a, key) in self._keys.items()], run)

    @classmethod
    def from_file(cls, spec: str | os.PathLike[str]) -> TrustKeys:
        """One ``--trust-key`` value: ``FILE`` or ``KEY_ID=FILE``.

        FILE is an Ed25519 public key (SubjectPublicKeyInfo PEM; a private key
        PEM is accepted and only its public half kept), else an HMAC secret
        file (at least 32 bytes) whose id is ``KEY_ID`` or the default
        :func:`hmac_key_id`. A value that is an existing file is always a file.
        """
        text = os.fspath(spec)
        key_id: str | None = None
        path = text
        if not os.path.exists(text) and "=" in text:
            key_id, path = text.split("=", 1)
            _check_key_id(key_id)
        data = _read_key_file(path, "trust key")
        if not _is_pem(data):
            if len(data) < MIN_HMAC_KEY_BYTES:
                raise ConfigError(f"trust key {path}: not a PEM key, and too short ({len(data)} bytes) for an hmac-sha256 secret")
            return cls([(HMAC_SHA256, key_id or hmac_key_id(data), data)])
        from cryptography.hazmat.primitives.asymmetric.ed25519 import (
            Ed25519PrivateKey,
            Ed25519PublicKey,
        )
        from cryptography.hazmat.primitives.serialization import (
            Encoding,
            PublicFormat,
            load_pem_private_key,
            load_pem_public_key,
        )

        key: Any
        try:
            if b"PRIVATE KEY" in data.split(b"\n", 1)[0]:
                priv = load_pem_private_key(data, password=None)
                if not isinstance(priv, Ed25519PrivateKey):
                    raise ConfigError(f"trust key {path}: a {type(priv).__name__}; Aurora signs with Ed25519 keys")
                key = priv.public_key()
            else:
                key = load_pem_public_key(data)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - ValueError, TypeError, UnsupportedAlgorithm
            raise ConfigError(f"trust key {path}: not a readable PEM key ({type(e).__name__}: {e})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"trust key {path}: a {type(key).__name__}; Aurora signs with Ed25519 keys")
        kid = ed25519_key_id(key.public_bytes(Encoding.Raw, PublicFormat.Raw))
        if key_id is not None and key_id != kid:
            raise ConfigError(f"trust key {path}: an Ed25519 key's id is {kid}, not {key_id!r}")
        return cls([(ED25519, kid, key)])

    @classmethod
    def from_files(cls, specs: Sequence[str | os.PathLike[str]]) -> TrustKeys:
        """Several ``--trust-key`` values (a key rotation trusts the old and the new key)."""
        if not specs:
            raise ConfigError("no trust key given")
        out = cls.from_file(specs[0])
        for s in specs[1:]:
            out = out | cls.from_file(s)
        return out

    def __or__(self, other: TrustKeys) -> TrustKeys:
        if self.run is not None and other.run is not None and self.run != other.run:
            raise ConfigError(f"trust keys bound to two runs ({self.run!r}, {other.run!r}) cannot be combined")
        return TrustKeys([(a, k, key) for k, (a, key) in (self._keys | other._keys).items()], self.run or other.run)

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(sorted(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        bound = f", run={self.run!r}" if self.run is not None else ""
        return f"TrustKeys({', '.join(f'{self._keys[k][0]}:{k}' for k in self.key_ids)}{bound})"

    # ------------------------------------------------------------------
    def check_json(self, obj: Mapping[str, Any], where: str, kind: str, version: int) -> str:
        """Verify the ``signature`` of a manifest object as read; returns the key id.

        Raises :class:`~aurora_store.errors.SignatureError` when it is missing,
        malformed, made by a key not trusted here, or does not verify.
        """

        def refuse(reason: str, key_id: str | None = None) -> SignatureError:
            return SignatureError(where, kind, version, key_id, reason)

        if "signature" not in obj:
            raise refuse(f"unsigned, and this reader trusts only signed versions (keys {', '.join(self.key_ids)})")
        sig = Signature.from_json(obj["signature"])
        if isinstance(sig, str):
            raise refuse(sig)
        known = self._keys.get(sig.key_id)
        if known is None:
            raise refuse(f"signed by key {sig.key_id}, which is not trusted here (trusted: {', '.join(self.key_ids)})", sig.key_id)
        alg, key = known
        if alg != sig.alg:
            raise refuse(f"signed with {sig.alg}, but trusted key {sig.key_id} is {alg}", sig.key_id)
        payload = signing_payload(obj)
        if alg == ED25519:
            from cryptography.exceptions import InvalidSignature

            try:
                key.verify(bytes.fromhex(sig.value), payload)
                ok = True
            except InvalidSignature:
                ok = False
        else:
            ok = hmac.compare_digest(hmac.new(key, payload, hashlib.sha256).hexdigest(), sig.value)
        if not ok:
            raise refuse(f"signature by key {sig.key_id} does not verify (the manifest was altered, or forged)", sig.key_id)
        if self.run is not None and obj.get("run") != self.run:
            # Checked after the signature: the run named here is the one the key signed.
            raise refuse(f"signed for run {str(obj.get('run'))[:80]!r}, not this run ({self.run!r}): another run's version", sig.key_id)
        return sig.key_id

    def check(self, m: Manifest, where: str) -> str:
        """:meth:`check_json` of a parsed manifest (as it re-serializes); returns the key id."""
        return self.check_json(m.to_json(), where, m.kind, m.version)


def generate_keypair(out_dir: str | os.PathLike[str], overwrite: bool = False) -> Signer:
    """``aurora keygen``: a new Ed25519 key as ``DIR/signing-key.pem`` (PKCS#8, mode 0600)
    and ``DIR/signing-key.pub.pem`` (SubjectPublicKeyInfo, mode 0644).

    The private file is created with mode 0600 from the start (never
    readable by others, even for a moment). Existing files are refused
    unless ``overwrite``: replacing a key by accident orphans a run.
    """
    d = Path(out_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"keygen: cannot create {d} ({e.strerror or type(e).__name__})") from None
    priv, pub = d / PRIVATE_KEY_FILE, d / PUBLIC_KEY_FILE
    if not overwrite:
        for p in (priv, pub):
            if p.exists():
                raise ConfigError(f"keygen: {p} already exists (a run signed with it would be orphaned); choose another --out")
    signer = Signer.generate()
    for p, data, mode in ((priv, signer.private_pem(), 0o600), (pub, signer.public_pem(), 0o644)):
        tmp = p.with_name(f".{p.name}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            try:
                os.fchmod(fd, mode)
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, p)
        except OSError as e:
            raise ConfigError(f"keygen: cannot write {p} ({e.strerror or type(e).__name__})") from None
    return signer


def signer_from_option(path: str | None, key_id: str | None = None) -> Signer | None:
    """The :class:`Signer` of a ``--sign-key`` value (already defaulted from the environment); None: unsigned."""
    return Signer.from_file(path, key_id) if path else None


def trust_from_option(specs: Sequence[str] | None) -> TrustKeys | None:
    """The :class:`TrustKeys` of ``--trust-key`` values (already defaulted from the environment); None: no check."""
    return TrustKeys.from_files(list(specs)) if specs else None

"""Choosing between the compiled kernels and their numpy twins, and compiling.

The kernels are compiled with numba (``njit(cache=True, nogil=True)``) the
first time each is used, not at import: importing numba costs a quarter of a
second and compiling a kernel about as much again, once per machine (the
compiled code is cached in ``__pycache__`` next to the kernel's module; where
that is not writable, numba's user cache, and failing that nothing is
cached). The kernels are serial: the codec's targets are per core, the scan
runs near memory bandwidth on one, and numba's parallel mode would bring in a
threading layer whose default (workqueue) aborts the process when two Python
threads launch parallel kernels at once, which a publisher with upload
threads could do. ``nogil`` lets callers run kernels on threads instead.

Every kernel has a pure numpy twin, used when numba is not installed or
``AURORA_NO_JIT=1`` is set. The switch is read on every call, so a test can
change paths with an environment variable.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from aurora_store.config import Switch

__all__ = [
    "JIT_ENV",
    "NO_JIT",
    "jit_available",
    "jit_enabled",
    "path",
    "numba_version",
    "use_jit",
    "compiled",
    "helper",
    "readonly",
    "unsigned",
]

#: Set to ``1`` to use the numpy twins even where numba is installed.
JIT_ENV = "AURORA_NO_JIT"
#: The switch itself: a process-wide debugging and measurement aid, not a run's option, so an
#: environment switch (declared, and listed in docs/OPTIONS.md) rather than a worker's flag.
NO_JIT = Switch(JIT_ENV, bool, False, "use the numpy twins of the compiled codec kernels even where numba is installed")


@functools.cache
def _numba() -> Any | None:
    try:
        import numba
    except ImportError:
        return None
    return numba


def jit_available() -> bool:
    """Whether numba can be imported."""
    return _numba() is not None


def jit_enabled() -> bool:
    """Whether the compiled kernels are used: numba is there and
    ``AURORA_NO_JIT`` is unset (or ``0``). Read on every call, so a test
    can switch paths with an environment variable."""
    # Not a config dataclass: a per-call switch between two exact twins,
    # which the tests flip with monkeypatch.setenv between examples.
    if NO_JIT.get():
        return False
    return jit_available()


def path() -> str:
    """``"jit"`` or ``"numpy"``: which implementation the kernels use now."""
    return "jit" if jit_enabled() else "numpy"


def numba_version() -> str | None:
    """The installed numba's version, or ``None``."""
    numba = _numba()
    return None if numba is None else str(numba.__version__)


def use_jit(jit: bool | None) -> bool:
    """The path a wrapper takes: ``jit`` when forced, else :func:`jit_enabled`."""
    if jit is None:
        return jit_enabled()
    if jit and not jit_available():
        raise RuntimeError("numba is not installed; the compiled kernels are unavailable")
    return jit


def helper(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn``, a scalar function in numba's subset, as one that kernels call.

    It stays a plain Python function (numba is imported lazily); when
    :func:`compiled` compiles a kernel whose body names it, the kernel sees
    the compiled helper instead, which LLVM inlines. One body then serves
    every kernel that needs it (the FP8 rounding, for one).
    """
    fn.__aurora_kernel_helper__ = True  # type: ignore[attr-defined]
    return fn


def _with_helpers(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` itself, or a copy whose globals map the :func:`helper` functions it names to their compiled
    selves (and the hints of :mod:`aurora_store.codec.kernels.prefetch` to their intrinsics)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return fn
    found = {}
    for name in code.co_names:
        obj = fn.__globals__.get(name)
        if getattr(obj, "__aurora_kernel_helper__", False):
            found[name] = compiled(obj)
        elif callable(make := getattr(obj, "__aurora_kernel_intrinsic__", None)):
            found[name] = make()
    if not found:
        return fn
    # A copy of the module's globals taken now: kernels read constants and helpers from it, nothing mutable.
    out = types.FunctionType(code, {**fn.__globals__, **found}, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__qualname__, out.__module__, out.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return out


@functools.cache
def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled by numba; compiled (or loaded from the cache) on first use.

    The :func:`helper` functions ``fn`` calls are compiled with it."""
    numba = _numba()
    if numba is None:
        raise RuntimeError("numba is not installed; the compiled kernels are unavailable")
    fn = _with_helpers(fn)
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:
        # No writable cache location at all (a read-only install, no home):
        # compile in every process instead of failing.
        return numba.njit(cache=False, nogil=True)(fn)


def readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: numba compiles one variant per writeability, so
    inputs are always passed read-only (bytes from a segment are)."""
    if not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v


def unsigned(a: np.ndarray) -> np.ndarray:
    """``a`` viewed as the unsigned integer type of its width (bit work is unsigned)."""
    if a.dtype.kind == "u":
        return a
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))

"""Cache-line prefetch hints the compiled kernels can give.

A kernel that visits scattered places it knows in advance (the next rows of
a list of 128 x 128 blocks, say) waits on memory once per place unless it
asks for the lines ahead of use; the hardware prefetchers follow streams,
not lists. :func:`prefetch_read` and :func:`prefetch_write` name the element
``a[i]`` whose line will be read or written soon: in a kernel compiled by
:func:`aurora_store.codec.kernels.jit.compiled` each becomes LLVM's
``llvm.prefetch`` (a hint: no fault, no effect on results, whatever the
address); called as plain Python they do nothing. numba is imported only
when a kernel using them is compiled.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["prefetch_read", "prefetch_write"]


@functools.cache
def _intrinsic(write: bool) -> Any:
    """The numba intrinsic emitting ``llvm.prefetch(&a[i], rw, locality 3, data cache)``."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    def typer(typingctx: Any, arr: Any, i: Any) -> Any:
        if not isinstance(arr, types.Array) or not isinstance(i, types.Integer):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            at = context.cast(builder, args[1], signature.args[1], types.intp)
            ptr = builder.bitcast(builder.gep(ary.data, [at]), cgutils.voidptr_t)
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32]), "llvm.prefetch.p0"
            )
            builder.call(fn, [ptr, i32(int(write)), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(arr, i), codegen

    typer.__name__ = "prefetch_write" if write else "prefetch_read"
    return intrinsic(typer)


def prefetch_read(a: Any, i: Any) -> None:
    """Hint that the line holding ``a[i]`` will be read soon (a no-op in plain Python)."""


def prefetch_write(a: Any, i: Any) -> None:
    """Hint that the line holding ``a[i]`` will be written soon (a no-op in plain Python)."""


prefetch_read.__aurora_kernel_intrinsic__ = functools.partial(_intrinsic, False)  # type: ignore[attr-defined]
prefetch_write.__aurora_kernel_intrinsic__ = functools.partial(_intrinsic, True)  # type: ignore[attr-defined]

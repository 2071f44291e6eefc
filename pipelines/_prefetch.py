"""A software prefetch for compiled loops: `prefetch(data, index)` in numba code.

Random reads from a large memory-mapped file wait on memory at every record;
asking for the next records' cache lines while copying this one overlaps
those waits (`_riegeli.read_single_records`, docs/benchmarks.md).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I32 = ir.IntType(32)
# llvm.prefetch's arguments after the address: a read, the highest locality
# (keep in all cache levels), a data cache.
_READ, _KEEP, _DATA = (ir.Constant(_I32, value) for value in (0, 3, 1))


@intrinsic
def prefetch(typingctx, data, index):
    """Hints the CPU to load the cache line of `data[index]` (a 1-D array, an
    integer index): no effect on results, never a fault, even out of bounds."""

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        address = builder.gep(array.data, [args[1]])
        if getattr(address.type, "is_opaque", False):
            name = "llvm.prefetch.p0"
        else:  # typed pointers (older LLVM): the intrinsic takes an i8*
            address = builder.bitcast(address, ir.IntType(8).as_pointer())
            name = "llvm.prefetch.p0i8"
        function_type = ir.FunctionType(ir.VoidType(), [address.type, _I32, _I32, _I32])
        function = cgutils.get_or_insert_function(builder.module, function_type, name)
        builder.call(function, [address, _READ, _KEEP, _DATA])
        return context.get_dummy_value()

    return types.none(data, index), codegen

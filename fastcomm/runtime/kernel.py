"""A kernel's entry points and its packed launch arguments: what both compile units' ABI mirrors
(fastcomm.abi, fastcomm.kquant.abi) declare their kernels with."""
from __future__ import annotations

import ctypes
import dataclasses

# The dtype suffix of a typed entry point (fc_<family><variant>_<suffix>), by torch dtype name.
DTYPE_SUFFIX = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}

_CTYPES = {"ptr": ctypes.c_uint64, "u64": ctypes.c_uint64, "u32": ctypes.c_uint32, "f32": ctypes.c_float,
           "i32": ctypes.c_int32}



@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel family of a compile unit: ``fc_<family><variant>_<dtype suffix>`` for each dtype and variant."""

    family: str
    params: tuple[tuple[str, object], ...]  # (name, type): ptr / u64 / u32 / i32 / f32, or a ctypes struct by value
    variants: tuple[str, ...] = ("",)
    typed: bool = True                    # one entry point per dtype (fc_<family>_<suffix>), or just fc_<family>

    def symbol(self, dtype: str | None = None, variant: str = "") -> str:
        if variant not in self.variants:
            raise ValueError(f"kernel {self.family} has no variant {variant!r} (has {self.variants})")
        return f"fc_{self.family}{variant}_{DTYPE_SUFFIX[dtype]}" if self.typed else f"fc_{self.family}{variant}"

    def symbols(self) -> list[str]:
        if not self.typed:
            return [self.symbol(None, v) for v in self.variants]
        return [self.symbol(d, v) for v in self.variants for d in DTYPE_SUFFIX]

    def pack(self, *args) -> "PackedArgs":
        """The launch's kernelParams array (and the ctypes values it points to, kept alive with it)."""
        if len(args) != len(self.params):
            names = ", ".join(n for n, _ in self.params)
            raise TypeError(f"{self.family} takes {len(self.params)} arguments ({names}), got {len(args)}")
        values = [a if isinstance(t, type) else _CTYPES[t](a) for (_, t), a in zip(self.params, args)]
        for (name, t), v in zip(self.params, values):
            if isinstance(t, type) and not isinstance(v, t):
                raise TypeError(f"{self.family}: {name} must be a {t.__name__}, got {type(v).__name__}")
        return PackedArgs(values)


class PackedArgs:
    def __init__(self, values):
        self.values = values
        self.array = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)

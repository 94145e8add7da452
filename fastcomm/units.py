"""Byte sizes as people write them: the one parser and the one formatter (CLI flags, settings, tables)."""
from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)
_MULT = {"": 1, "K": KiB, "M": MiB, "G": GiB}


def parse_size(text: str) -> int:
    """'12K' -> 12288, '8M', '1.5M', '4096', '64KiB', '2MB' (binary units). Raises ValueError for anything
    else, including negative sizes."""
    m = _SIZE.fullmatch(str(text).strip())
    if m is None and _SIZE.fullmatch(str(text).strip().lstrip("-")):
        raise ValueError(f"not a size: {text!r} (sizes cannot be negative)")
    if m is None:
        raise ValueError(f"not a size: {text!r} (expected e.g. 4096, 12K, 8M, 1G)")
    value = float(m.group(1)) * _MULT[m.group(2).upper()]
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def format_size(n: int, compact: bool = False) -> str:
    """The one byte-size formatter. Exact binary units where they divide: 12288 -> '12 KiB',
    8388608 -> '8 MiB', 1000 -> '1000 B'; ``compact`` for table columns: '12K', '8M', '1000B', '1.5M'."""
    for unit, scale in (("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= scale and (compact or n % scale == 0):
            whole = n % scale == 0
            if compact:
                return f"{n // scale}{unit}" if whole else f"{n / scale:.3g}{unit}"
            return f"{n // scale} {unit}iB"
    return f"{n}B" if compact else f"{n} B"

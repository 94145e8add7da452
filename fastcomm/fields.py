"""Validated reads of the fields of a JSON record that fastcomm wrote and reads back (the tune cache, the K-quant
forms tables): each problem is one ``BadField`` naming the field's path; the reader adds the file's name and
turns it into its own error."""
from __future__ import annotations

from typing import Any


class BadField(ValueError):
    """A problem inside the data (the reader names the file)."""


def need_obj(data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise BadField(f"missing or ill-typed field '{where}' (expected an object)")


def get(data: dict, key: str, where: str):
    """(the field's path, its value)."""
    name = f"{where}.{key}" if where else key
    if key not in data:
        raise BadField(f"missing field '{name}'")
    return name, data[key]


def integer(data: dict, key: str, where: str, lo: int | None = None) -> int:
    name, v = get(data, key, where)
    if isinstance(v, bool) or not isinstance(v, int):  # bool is an int to Python, never to us
        raise BadField(f"field '{name}' must be an integer, got {v!r}")
    if lo is not None and v < lo:
        raise BadField(f"field '{name}' must be >= {lo}, got {v}")
    return v


def string(data: dict, key: str, where: str) -> str:
    name, v = get(data, key, where)
    if not isinstance(v, str):
        raise BadField(f"field '{name}' must be a string, got {v!r}")
    return v


def enum(kind, value: str, where: str):
    try:
        return kind(value)
    except ValueError:
        known = ", ".join(e.value for e in kind)
        raise BadField(f"unknown {kind.__name__} {value!r} at '{where}' (known: {known})") from None

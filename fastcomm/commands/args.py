"""Argument types shared by the command-line verbs (argparse reports their errors in one line, exit 2)."""
from __future__ import annotations

import argparse

from ..units import parse_size


def parse_size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None

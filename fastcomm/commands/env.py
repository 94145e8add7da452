"""`fastcomm env`: every FASTCOMM_* variable and its meaning."""
from __future__ import annotations


def add_parser(sub) -> None:
    e = sub.add_parser("env", help="list every FASTCOMM_* variable and its meaning")
    e.set_defaults(func=run)


def run(args) -> int:
    from ..config import describe_variables

    print(describe_variables())
    return 0

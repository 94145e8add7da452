"""`fastcomm env`: every FASTCOMM_* variable: its current value (or default), whether it is valid, its meaning.
Exits 1 when any is invalid, so scripts can check a setup before starting anything. A FASTCOMM_* name that is no
setting (a typo, a removed setting) is named on stderr: fastcomm ignores it."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    e = sub.add_parser("env", help="every FASTCOMM_* variable: current value, valid or not, meaning",
                       description=__doc__)
    e.set_defaults(func=run)


def render(statuses) -> list[str]:
    lines = []
    for s in statuses:
        value = f"{s.raw!r}" if s.raw is not None else f"unset (default {s.var.default!r})"
        verdict = "ok" if s.error is None else f"INVALID: {s.error}"
        lines += [f"{s.var.name} = {value}  [{verdict}]", f"    {s.var.meaning}"]
    return lines


def run(args) -> int:
    from ..variables import check_environment, unknown_variables

    statuses = check_environment()
    print("\n".join(render(statuses)))
    for name in unknown_variables():
        print(f"fastcomm env: {name} is not a fastcomm setting; it is ignored", file=sys.stderr)
    bad = [s for s in statuses if s.error]
    if bad:
        print(f"fastcomm env: {len(bad)} invalid setting{'s' if len(bad) > 1 else ''}: "
              + "; ".join(s.var.name for s in bad), file=sys.stderr)
        return 1
    return 0

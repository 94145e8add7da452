"""The `fastcomm` command: one verb per module here (compile, env, topo, tune), plus verbs other installed
packages register under the ``fastcomm.commands`` entry-point group (the benchmarks in bench/ register
``bench`` and ``bench-decode``), so the library never imports them by name."""
from __future__ import annotations

import argparse
import importlib.metadata
import sys

from . import compile as compile_cmd
from . import env as env_cmd
from . import topo as topo_cmd
from . import tune as tune_cmd

ENTRY_POINTS = "fastcomm.commands"


def external_commands() -> dict[str, importlib.metadata.EntryPoint]:
    """Verbs registered by other packages: name -> entry point of a ``main(argv) -> int``."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)}


def build_parser(external: dict | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastcomm", description="fastcomm: fast all-reduce for PCIe tensor parallelism")
    p.add_argument("--version", action="version", version=version_text())
    sub = p.add_subparsers(dest="command", required=True)
    for module in (compile_cmd, env_cmd, topo_cmd, tune_cmd):
        module.add_parser(sub)
    for name in sorted(external or {}):
        # Listed for --help only: main() hands such a verb all of its arguments before parsing anything.
        sub.add_parser(name, help=f"(from {external[name].value.split(':')[0]}; `fastcomm {name} --help`)")
    return p


def version_text() -> str:
    from .. import __version__

    return f"fastcomm {__version__}"


def main(argv=None) -> int:
    from ..config import ConfigError
    from ..errors import FastcommError

    argv = sys.argv[1:] if argv is None else list(argv)
    external = external_commands()
    if argv and argv[0] in external:
        return int(external[argv[0]].load()(argv[1:]) or 0)
    args = build_parser(external).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:  # a bad FASTCOMM_* setting: the user's to fix, so one line and no traceback
        print(f"fastcomm {args.command}: {e}", file=sys.stderr)
        return 2
    except FastcommError as e:  # a setup fastcomm refuses (it says why); not a bug to trace
        print(f"fastcomm {args.command}: {e}", file=sys.stderr)
        return 1

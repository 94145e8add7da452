"""Imports point one way: every module's imports read against the layer table in ARCHITECTURE.md.

A module imports only modules of its own rank or a lower one and never one of the other product; outside the
tests no module reaches another module's private names; what the tests stand on (conftest, helpers, workers,
drivers) imports no benchmark module. Read from the source (ast), so a new upward import fails here."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"fastcomm": ROOT / "fastcomm", "fastcomm_vllm": ROOT / "integrations" / "vllm" / "fastcomm_vllm",
            "fastcomm_bench": ROOT / "bench"}


def _table() -> list[tuple[float, str, str]]:
    """(rank, product, module) for every module named in ARCHITECTURE.md's layer table."""
    rows = []
    for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"\d+(\.\d+)?", cells[0]):
            rows += [(float(cells[0]), cells[1], m) for m in re.findall(r"`([\w.]+)`", cells[2])]
    return rows


TABLE = _table()


def _layer(module: str) -> tuple[float, str] | None:
    best = max((m for m in TABLE if module == m[2] or module.startswith(m[2] + ".")), key=lambda m: len(m[2]),
               default=None)
    return None if best is None else (best[0], best[1])


def _modules():
    """(dotted name, path) of every library module."""
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([pkg, *parts]), path


def _imports(module: str, path: Path):
    """(imported module, names taken from it, line) for every import of ours, relative ones resolved."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    yield a.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in PACKAGES:
                continue
            names = tuple(a.name for a in node.names)
            # `from pkg import mod` imports the module pkg.mod where it is one
            for a in names:
                sub = f"{target}.{a}"
                if _is_module(sub):
                    yield sub, (), node.lineno
            rest = tuple(a for a in names if not _is_module(f"{target}.{a}"))
            if rest or not names:
                yield target, rest, node.lineno


def _is_module(name: str) -> bool:
    pkg, *rest = name.split(".")
    root = PACKAGES.get(pkg)
    if root is None:
        return False
    p = root.joinpath(*rest)
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def test_the_table_names_every_library_module():
    missing = [m for m, _ in _modules() if _layer(m) is None]
    assert not missing, f"modules in no layer of ARCHITECTURE.md: {missing}"


def test_no_module_imports_upward_or_across_products():
    bad = []
    for module, path in _modules():
        rank, product = _layer(module)
        for target, _, line in _imports(module, path):
            if target == module or module.startswith(target + ".") and path.name != "__init__.py" \
                    and target in ("fastcomm", "fastcomm_vllm", "fastcomm_bench"):
                continue  # a package's own __init__ (relative imports resolve through it)
            got = _layer(target)
            if got is None:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}, which is in no layer")
                continue
            t_rank, t_product = got
            if t_rank > rank or (product and t_product and t_product != product):
                bad.append(f"{path.relative_to(ROOT)}:{line} ({module}, rank {rank:g} {product or 'shared'}) "
                           f"imports {target} (rank {t_rank:g} {t_product or 'shared'})")
    assert not bad, "\n".join(bad)


def test_no_library_module_takes_another_modules_private_names():
    bad = []
    for module, path in _modules():
        tree = ast.parse(path.read_text())
        aliases = {}
        for target, names, line in _imports(module, path):
            if target == module:
                continue
            bad += [f"{path.relative_to(ROOT)}:{line} imports {target}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    aliases[a.asname or a.name.split(".")[0]] = True
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and _is_ours(tree, node.value.id):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def _is_ours(tree, alias: str) -> bool:
    """Whether ``alias`` names one of our modules in this file (not torch, a plugin or vLLM)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in PACKAGES):
            if any((a.asname or a.name) == alias for a in node.names):
                return True
        if isinstance(node, ast.Import):
            if any((a.asname or a.name.split(".")[0]) == alias and a.name.split(".")[0] in PACKAGES
                   for a in node.names):
                return True
    return False


def test_what_the_tests_stand_on_imports_no_benchmark():
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name.startswith("test_"):
            continue  # a test module may import the benchmark it tests
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {m}" for m in mods
                    if m.split(".")[0] == "fastcomm_bench"]
    assert not bad, "\n".join(bad)


def test_the_layer_test_sees_an_upward_import(tmp_path):
    """The check itself: the runtime importing the CLI is caught."""
    assert _layer("fastcomm.runtime.jit") == (1, "") and _layer("fastcomm.commands.args")[0] == 5
    assert _layer("fastcomm.kquant.ops")[1] == "kquant" and _layer("fastcomm.ops")[1] == "collectives"
    fake = tmp_path / "jit.py"
    fake.write_text("from ..commands.args import fail\n")
    (target, _, _), = [t for t in _imports("fastcomm.runtime.jit", fake) if t[0] == "fastcomm.commands.args"]
    assert _layer(target)[0] > _layer("fastcomm.runtime.jit")[0]

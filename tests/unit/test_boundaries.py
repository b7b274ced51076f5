"""The stdlib-only packages import no torch, nats, asyncio or msgpack (checked in a fresh interpreter)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

FORBIDDEN = ("torch", "nats", "asyncio", "msgpack")
MODULES = (
    "nitsum.policy",
    "nitsum.policy.registry",
    "nitsum.policy.topology",
    "nitsum.policy.baselines",
    "nitsum.policy.costmodel",
    "nitsum.policy.steptable",
    "nitsum.policy.flows",
    "nitsum.policy.flow_baselines",
    "nitsum.kv",
    "nitsum.topology",
    "nitsum.workloads",
    "nitsum.sim",
    "nitsum.sim.engine",
    "nitsum.sim.network",
    "nitsum.sim.cluster",
    "nitsum.sim.flowsim",
    "nitsum.sim.cli",
    "nitsum.sim.experiments.tiers",
    "nitsum.sim.experiments.flows",
    "nitsum.sim.experiments.reconfig",
)


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_no_heavy_or_async_dependency(module):
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "No module named" in out.stderr and module.split(".")[1] == "kv":
        pytest.skip(f"{module} does not exist yet")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], f"{module} pulled in {out.stdout.strip()}"


# -- private fields stay inside their package ---------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "libs" / "nitsum", ROOT / "services", ROOT / "load")


def _unit_of(path: Path) -> str:
    """The package a source file belongs to: `nitsum.<sub>` (a module right under nitsum is its own unit),
    `services.<name>` or `load`."""
    rel = path.relative_to(ROOT).parts
    if rel[0] == "libs":
        return "nitsum." + Path(rel[2]).stem if len(rel) > 2 else "nitsum"
    if rel[0] == "services":
        return "services." + (rel[1] if len(rel) > 2 else Path(rel[1]).stem)
    return rel[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _scan() -> tuple[dict[str, set[str]], list[tuple[str, str, int, str]]]:
    """(private names each unit defines, every `obj._name` read or written on an object other than
    self/cls: (unit, file, line, name))."""
    defined: dict[str, set[str]] = {}
    uses: list[tuple[str, str, int, str]] = []
    for base in SOURCES:
        for path in sorted(base.rglob("*.py")):
            unit = _unit_of(path)
            tree = ast.parse(path.read_text(), str(path))
            names = defined.setdefault(unit, set())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                    names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute) and _private(node.attr):
                    owner = node.value
                    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                        if isinstance(node.ctx, ast.Store):
                            names.add(node.attr)
                    elif not (isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super"):
                        uses.append((unit, str(path.relative_to(ROOT)), node.lineno, node.attr))
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _private(node.target.id):
                    names.add(node.target.id)
    return defined, uses


def test_no_package_reads_another_packages_private_fields():
    """`obj._name` where `_name` is a private name of one of the project's other packages (and not of this
    one): a read of a private field across packages. Give the owner a method instead."""
    defined, uses = _scan()
    offences = []
    for unit, path, line, name in uses:
        owners = {u for u, names in defined.items() if name in names}
        if owners and unit not in owners:
            offences.append(f"{path}:{line}: .{name} (private to {', '.join(sorted(owners))})")
    assert offences == [], "private fields read across packages:\n" + "\n".join(offences)


def test_no_test_reads_the_engines_private_fields():
    """Tests use the engine's API too (export_state, install_state, request_ids, ...): a private name only
    `nitsum.engine` defines, read on an object in tests/, is a test reaching into the engine's state."""
    defined, _ = _scan()
    engine_only = defined["nitsum.engine"] - set().union(*(n for u, n in defined.items() if u != "nitsum.engine"))
    offences = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in engine_only:
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    offences.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert offences == [], "tests reading the engine's private fields:\n" + "\n".join(offences)


def test_engine_imports_nothing_from_node():
    """The engine is built on by the node runtime, never the other way round."""
    bad = []
    for path in sorted((ROOT / "libs" / "nitsum" / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nitsum.node"):
                bad.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("nitsum.node") for a in node.names):
                bad.append(f"{path.name}:{node.lineno}")
    assert bad == [], f"engine/ imports nitsum.node: {bad}"


def test_benchmarks_are_imported_by_no_service_or_library_package():
    """`nitsum.bench` sits on top: only the CLI's bench table (by name) and the benchmarks themselves use it."""
    bad = []
    for base in (ROOT / "libs" / "nitsum", ROOT / "services"):
        for path in sorted(base.rglob("*.py")):
            if "bench" in path.relative_to(ROOT).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
                )
                if any(n == "nitsum.bench" or n.startswith("nitsum.bench.") for n in names):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == [], f"imports of nitsum.bench: {bad}"


def test_one_group_id_function_for_the_mesh_the_node_world_and_the_simulator():
    """Workers, the coordinator and the simulator name groups with one function, in one format."""
    from nitsum.policy import snapshot
    from nitsum.wire import node

    assert node.group_id_of is snapshot.group_id_of
    assert snapshot.group_id_of("n0", 4, 2) == "n0-g4-tp2"
    assert not hasattr(snapshot, "group_id_for")

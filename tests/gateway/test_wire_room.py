"""The gateway imports from ``engine`` only its torch-free wire room: the protocol, the Redis
client factory and the OpenTelemetry setup both sides share. Importing every gateway module
loads neither torch nor transformers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

WIRE_ROOM = {
    "sluicegate.engine.protocol",
    "sluicegate.engine.redis_client",
    "sluicegate.engine.tracing",
}


def _engine_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine"):
            names = [f"{node.module}.{a.name}" for a in node.names]
            found |= {n for n in names if n in WIRE_ROOM} or {node.module}
            if node.module == "engine":
                found |= {f"engine.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("engine")}
    return {name for name in found if name != "engine"}


def test_gateway_reaches_only_the_wire_room(repo_root: Path) -> None:
    outside = {
        str(path.relative_to(repo_root)): sorted(_engine_imports(path) - WIRE_ROOM)
        for path in (repo_root / "gateway").rglob("*.py")
    }
    assert {k: v for k, v in outside.items() if v} == {}


def test_importing_the_gateway_loads_no_torch(repo_root: Path) -> None:
    modules = sorted(
        ".".join(path.relative_to(repo_root).with_suffix("").parts)
        for path in (repo_root / "gateway").rglob("*.py")
        if "migrations" not in path.parts
    )
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name.removesuffix('.__init__'))\n"
        "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=repo_root, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

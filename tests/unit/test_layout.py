"""The package layout and the dependency direction between farloco's three code folders, and between the rooms
of node.

optim and protocol are siblings that never import each other, and neither imports node: node composes them.
util is below all three and imports none of them.
Inside node: the shared modules at its top (config, schedule, handoff, checkpoint, logs, fsutil) import no room; the
trainer side (node/training) never imports the daemon or the user tools; the daemon (node/daemon) never imports
the user tools (node/tools), which may import everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import ROOT

ROOMS = ("farloco.node.daemon", "farloco.node.training", "farloco.node.tools")
FORBIDDEN = {
    "util": ("farloco.protocol", "farloco.optim", "farloco.node"),
    "optim": ("farloco.protocol", "farloco.node"),
    "protocol": ("farloco.optim", "farloco.node"),
    "node/training": ("farloco.node.daemon", "farloco.node.tools"),
    "node/daemon": ("farloco.node.tools",),
}


def test_shared_node_modules_import_no_room() -> None:
    violations = [
        f"{path.relative_to(ROOT)}:{lineno} imports {module}"
        for path in sorted((ROOT / "node").glob("*.py"))
        for lineno, module in imported_modules(path)
        if module.startswith(ROOMS)
    ]
    assert not violations, "a shared module of node imports a room:\n" + "\n".join(violations)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level > 1:
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependency_direction(package: str) -> None:
    violations = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for lineno, module in imported_modules(path):
            if module.startswith(".."):
                violations.append(
                    f"{path.relative_to(ROOT)}:{lineno} relative import {module} leaves the package"
                )
            if module.startswith(FORBIDDEN[package]):
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert not violations, "dependency direction broken:\n" + "\n".join(violations)


def test_no_bare_top_level_imports() -> None:
    offenders = []
    for folder in ("node", "protocol", "optim", "util", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for lineno, module in imported_modules(path):
                if module.split(".")[0] in ("node", "protocol", "optim", "util"):
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno} imports bare {module}")
    assert not offenders, "use farloco.node / farloco.protocol / farloco.optim:\n" + "\n".join(offenders)


def test_installed_names() -> None:
    import farloco.node
    import farloco.optim
    import farloco.protocol
    import farloco.util

    for module, folder in (
        (farloco.node, "node"),
        (farloco.optim, "optim"),
        (farloco.protocol, "protocol"),
        (farloco.util, "util"),
    ):
        assert Path(module.__file__ or "").parent.name == folder

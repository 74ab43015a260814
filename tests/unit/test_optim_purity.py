"""farloco.optim stays pure tensor math: no sockets, threads, processes, pickling or sibling imports."""

from __future__ import annotations

import ast

from helpers import ROOT

OPTIM = ROOT / "optim"
FORBIDDEN_PREFIXES = (
    "socket", "threading", "asyncio", "multiprocessing", "subprocess", "concurrent", "pickle", "dill",
    "grpc", "hivemind", "torch.distributed", "farloco.node", "farloco.protocol",
)  # fmt: skip


def test_optim_imports_no_io_and_no_siblings() -> None:
    violations = []
    files = sorted(OPTIM.glob("*.py"))
    assert files, f"no sources found under {OPTIM}"
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if any(name == p or name.startswith(p + ".") for p in FORBIDDEN_PREFIXES):
                    violations.append(f"{path.name}:{node.lineno} imports {name}")
            # torch.load unpickles; nothing in optim may call it
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "load"
                and getattr(node.value, "id", "") == "torch"
            ):
                violations.append(f"{path.name}:{node.lineno} calls torch.load")
    assert violations == []


def test_every_optim_module_has_a_docstring() -> None:
    for path in sorted(OPTIM.glob("*.py")):
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.name} needs a module docstring"

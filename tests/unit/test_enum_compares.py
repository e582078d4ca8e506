"""Enums are compared as enums: no module of the core compares a state, level, status, reason or op
with a string (`r.state == "Available"`, `str(r.state) in (...)`), which a renamed value would
silently break."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "controlplane", "dataplane", "tools")
FIELDS = {"state", "level", "desired", "status", "reason", "op", "target", "source"}


def _enum_side(node: ast.expr) -> bool:
    """`x.state` or `str(x.state)` (and the same for the other enum-valued fields)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" and node.args:
        node = node.args[0]
    return isinstance(node, ast.Attribute) and node.attr in FIELDS


def _stringy(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
    return False


def test_core_compares_enums_as_enums():
    offenders = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    if any(_enum_side(s) for s in sides) and any(_stringy(s) for s in sides):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders

"""Environment settings (`NDIF_*`) do what the docs say they do: each one a component stores is used,
and each one the docs name is read by the code (or the deploy scripts)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("schemas", "controlplane", "dataplane")
SETTING = re.compile(r"\bNDIF_[A-Z0-9_]+\b")
# Names that are not settings: stream names.
NOT_SETTINGS = {"NDIF_EVENTS", "NDIF_REQUESTS"}


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for top in PRODUCT for p in sorted((ROOT / top).rglob("*.py"))]


def _names_a_setting(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and SETTING.fullmatch(n.value)
               for n in ast.walk(node))


def test_every_setting_a_component_stores_is_used() -> None:
    """`self.x = ...NDIF_X...` with no `.x` read anywhere is a setting that does nothing."""
    stored: dict[str, str] = {}
    read: set[str] = set()
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _names_a_setting(node.value):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        stored[t.attr] = f"{path.relative_to(ROOT)}:{node.lineno}"
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                read.add(node.attr)
    assert stored, "the scan found no stored setting: it no longer sees how settings are read"
    unused = {attr: where for attr, where in stored.items() if attr not in read}
    assert not unused, f"settings stored and never used: {unused}"


def test_every_setting_the_docs_name_is_read() -> None:
    code = " ".join(p.read_text() for top in PRODUCT for p in (ROOT / top).rglob("*.py"))
    code += " ".join(p.read_text() for p in (ROOT / "deploy").rglob("*") if p.is_file() and p.suffix in (".sh", ".py"))
    read = set(SETTING.findall(code))
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {(name, str(d.relative_to(ROOT))) for d in docs for name in SETTING.findall(d.read_text())}
    stale = sorted((name, where) for name, where in named if name not in read | NOT_SETTINGS)
    assert not stale, f"documented settings no code reads: {stale}"

"""Subjects come from schemas/subjects.py only: no other module spells an NDIF subject in a string."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "controlplane", "dataplane", "tools")
SUBJECT = re.compile(r"^ndif\.(evt|req|cmd|status|run|dispatcher)\b")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            ids.add(id(body[0].value))
    return ids


def _logger_names(tree: ast.AST) -> set[int]:
    """`structlog.get_logger("ndif.dispatcher")`: a logger's name, not a subject."""
    return {id(a) for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "get_logger" for a in node.args}


def _literal_subjects(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree) | _logger_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and isinstance(head.value, str) and SUBJECT.match(head.value):
                found.append(f"{node.lineno}: f{head.value!r}...")
            skip.update(id(v) for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                and SUBJECT.match(node.value):
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_no_module_but_subjects_spells_a_subject():
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if p.name != "subjects.py" or p.parent.name != "schemas"]
    assert len(files) > 30
    offenders = {str(p.relative_to(ROOT)): hits for p in files if (hits := _literal_subjects(p))}
    assert not offenders, offenders


def test_the_check_sees_a_spelled_subject(tmp_path: pathlib.Path):
    bad = tmp_path / "bad.py"
    bad.write_text('import structlog\nlog = structlog.get_logger("ndif.dispatcher")\n'
                   'def f(t):\n    """On `ndif.req.x`."""\n    return f"ndif.req.{t}", "ndif.dispatcher.kill"\n')
    assert _literal_subjects(bad) == ["5: f'ndif.req.'...", "5: 'ndif.dispatcher.kill'"]

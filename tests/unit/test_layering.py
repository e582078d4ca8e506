"""The dependencies point one way, as docs/architecture.md's map draws them (read with `ast`, so a
lazy import inside a function counts too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Within a package, each part may import only the parts listed before it.
ORDERS = {
    "dataplane/serving/dispatcher": ["background", "statuses", "capacity", "provisioning", "intake", "follower",
                                     "service"],
    "controlplane/eventstore": ["connection", "topology", "appends", "feed", "snapshots", "log"],
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def modules(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


def test_the_check_sees_a_lazy_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from dataplane.serving import dispatcher\n")
    assert "dataplane.serving.dispatcher" in imports_of(f)


@pytest.mark.parametrize(("top", "forbidden"), [("schemas", ("controlplane", "dataplane")),
                                                 ("controlplane", ("dataplane",))])
def test_the_core_never_imports_what_is_built_on_it(top, forbidden):
    bad = {str(p.relative_to(ROOT)): sorted(n for n in imports_of(p) if n.split(".")[0] in forbidden)
           for p in modules(top)}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_processor_never_reaches_back_into_the_dispatcher():
    got = imports_of(ROOT / "dataplane/serving/processor.py")
    assert not {n for n in got if n.startswith("dataplane.serving.dispatcher")}


@pytest.mark.parametrize("package", sorted(ORDERS))
def test_parts_import_only_the_parts_before_them(package):
    order = ORDERS[package]
    dotted = package.replace("/", ".")
    files = {p.stem for p in (ROOT / package).glob("*.py")} - {"__init__"}
    assert files == set(order), f"{package}: parts not in the order list: {sorted(files ^ set(order))}"
    wrong = []
    for i, part in enumerate(order):
        for name in imports_of(ROOT / package / f"{part}.py"):
            if name.startswith(dotted + "."):
                other = name[len(dotted) + 1:].split(".")[0]
                if other in order and order.index(other) >= i:
                    wrong.append(f"{part} imports {other}")
    assert wrong == []

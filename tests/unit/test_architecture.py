"""The architecture, held by directory rather than by hand-kept lists (read with `ast`, so a lazy
import inside a function counts as much as one at the top).

- The pure core (`schemas/`, `controlplane/core/`): no clock, randomness, I/O or logging.
- Layers: imports flow one way, schemas <- core <- adapters and replica <- services <- ops, and no
  two packages import each other (directly or round a circle).
- Within a package whose parts are ordered, each part imports only the parts before it.
- The SDK imports neither torch nor Ray.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("schemas", "controlplane", "dataplane", "tools")

# Every package of ours and its layer: a module may import only from its own layer or below, and
# packages of one layer may not import each other round a circle.
LAYERS: dict[str, int] = {
    "schemas": 0,
    "controlplane.core": 1,
    "controlplane.store": 2,
    "dataplane.runtime": 2,
    "dataplane.replica": 2,
    "controlplane.service": 3,
    "controlplane.dashboard": 3,
    "dataplane.node": 3,
    "dataplane.serving": 3,
    "dataplane.client": 3,
    "controlplane.ops": 4,
    "dataplane.ops": 4,
    "tools": 5,
}
PURE = ("schemas", "controlplane.core")

# Within a package, each part may import only the parts listed before it.
ORDERS = {
    "dataplane/serving/dispatcher": ["background", "statuses", "provisioning", "intake", "follower", "service"],
    "controlplane/store/eventstore": ["connection", "topology", "appends", "feed", "snapshots", "gate", "log"],
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


def package_of(dotted: str) -> str | None:
    """The layered package a dotted name lives in (the longest prefix in LAYERS), else None."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return None


def our_modules() -> list[Path]:
    return sorted(p for top in TOPS for p in (ROOT / top).rglob("*.py"))


def dotted_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_the_check_sees_a_lazy_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from dataplane.serving import dispatcher\n")
    assert "dataplane.serving.dispatcher" in imports_of(f)


def test_every_module_belongs_to_a_layer():
    loose = [dotted_of(p) for p in our_modules()
             if package_of(dotted_of(p)) is None and p.name != "__init__.py"]
    assert loose == [], f"modules outside every layered package (add the package to LAYERS): {loose}"


def test_imports_flow_down_the_layers():
    wrong = []
    for p in our_modules():
        me = package_of(dotted_of(p))
        if me is None:
            continue
        for name in imports_of(p):
            other = package_of(name)
            if other is not None and LAYERS[other] > LAYERS[me]:
                wrong.append(f"{p.relative_to(ROOT)} ({me}, layer {LAYERS[me]}) imports {name} (layer {LAYERS[other]})")
    assert wrong == []


def test_no_two_packages_import_each_other():
    edges: dict[str, set[str]] = {k: set() for k in LAYERS}
    for p in our_modules():
        me = package_of(dotted_of(p))
        for name in imports_of(p):
            other = package_of(name)
            if me and other and other != me:
                edges[me].add(other)
    # Depth-first search for a cycle.
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == 1:
                return [*path[path.index(m):], m]
            if m not in state and (c := visit(m)):
                return c
        state[n] = 2
        path.pop()
        return None

    for n in sorted(edges):
        if n not in state and (c := visit(n)):
            pytest.fail(" -> ".join(c))


CLOCKS = re.compile(r"\b(time\.time|time\.monotonic|time\.perf_counter|datetime\.now|datetime\.utcnow|date\.today|"
                    r"uuid[14]|os\.urandom|secrets\.)")
IMPURE_MODULES = {"random", "secrets", "uuid", "time", "socket", "asyncio", "logging", "structlog", "nats", "ray",
                  "torch", "pathlib", "subprocess", "shutil", "threading", "aiohttp"}
# `os` only for `os.path`'s string work (a checkpoint path's normal form): never the environment or the disk.
OS_IO = re.compile(r"\bos\.(environ|getenv|listdir|scandir|stat|remove|unlink|makedirs|mkdir|walk|open|system|popen)\b")


def test_the_pure_core_has_no_clock_randomness_io_or_logging():
    files = [p for p in our_modules() if package_of(dotted_of(p)) in PURE]
    assert any("controlplane/core/nodeplan.py" in str(p) for p in files)
    assert any("controlplane/core/capacity.py" in str(p) for p in files)
    offenders = []
    for p in files:
        for name in imports_of(p):
            if name.split(".")[0] in IMPURE_MODULES:
                offenders.append(f"{p.relative_to(ROOT)}: imports {name}")
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if CLOCKS.search(line) or OS_IO.search(line) or re.search(r"(?<![\w.])(open|print|input)\(", line):
                offenders.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert offenders == [], "\n".join(offenders)


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


def test_the_processor_never_reaches_back_into_the_dispatcher():
    got = imports_of(ROOT / "dataplane/serving/processor.py")
    assert not {n for n in got if n.startswith("dataplane.serving.dispatcher")}


def test_the_client_sdk_imports_neither_torch_nor_ray():
    code = ("import sys, dataplane.client\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'transformers', 'accelerate'))\nprint(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

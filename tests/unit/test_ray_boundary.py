"""Only the runtime adapter imports Ray: every other module of ours goes through its ports.

Parsed with `ast`, so an import inside a function (a lazy import) counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "controlplane", "dataplane", "tools")
ADAPTER = Path("dataplane/runtime/ray_adapter.py")


def ray_imports(source: str) -> list[int]:
    """Lines of `source` that import `ray` or one of its submodules."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            if any(a.name == "ray" or a.name.startswith("ray.") for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module == "ray" or node.module.startswith("ray."):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            if node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).split(".")[0] == "ray":
                lines.append(node.lineno)
    return lines


def test_the_detector_finds_every_kind_of_import() -> None:
    src = ("import os\nimport ray\nfrom ray.util import x\ndef f():\n    import ray.exceptions\n"
           "    from ray import serve\n    __import__('ray')\nimport rayon\nfrom raylib import y\n")
    assert ray_imports(src) == [2, 3, 5, 6, 7]


def test_only_the_runtime_adapter_imports_ray() -> None:
    offenders = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel == ADAPTER:
                continue
            for line in ray_imports(path.read_text()):
                offenders.append(f"{rel}:{line}")
    assert not offenders, f"only {ADAPTER} may import ray; found imports in {offenders}"
    assert ray_imports((ROOT / ADAPTER).read_text()), "the adapter is where Ray is imported"

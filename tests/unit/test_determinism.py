"""The pure core never reads the clock, mints ids or draws random numbers: those come through ctx."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PURE = [ROOT / "schemas", ROOT / "controlplane" / "projections", ROOT / "controlplane" / "placement.py",
        ROOT / "controlplane" / "decide.py"]
FORBIDDEN = re.compile(r"\b(time\.time|time\.monotonic|datetime\.now|datetime\.utcnow|uuid[14]|"
                       r"import random|from random|os\.urandom|secrets\.)")


def test_pure_modules_use_no_clock_ids_or_randomness():
    files = [p for base in PURE if base.exists()
             for p in ([base] if base.is_file() else base.rglob("*.py"))]
    assert files, "no pure modules found"
    offenders = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
                 for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
                 if FORBIDDEN.search(line)]
    assert not offenders, "\n".join(offenders)

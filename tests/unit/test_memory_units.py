"""Memory sizes have one unit for people: GiB (2**30 bytes). Every memory flag takes GiB and says so in
its name; refusals, status messages and views print GiB; events keep bytes. A flag that took
another unit is refused by its old name (exit 2, one line naming the new flag), never read anew."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.core.capacity import never_fits
from controlplane.core.placement import gpus_refusal
from controlplane.ops.cli import REPLACED_FLAGS
from dataplane.ops.cli import _agent_kwargs, parser
from schemas import events as E
from tests.cluster_builder import Builder

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def _node(b: Builder, node_id: str, cards: int, card_bytes: int) -> Builder:
    return b.add(E.NodeJoined(**b._env("agent"), node_id=node_id, cpu_cache_bytes=0,
                              gpus=tuple(E.GpuInfo(index=i, memory_bytes=card_bytes) for i in range(cards))))


def test_the_memory_flags_take_gib() -> None:
    a = parser().parse_args(["agent", "--gpus", "2", "--gpu-memory-gib", "80", "--cpu-cache-gib", "10.5"])
    kw = _agent_kwargs(a)
    assert [g.memory_bytes for g in kw["gpus"]] == [80 * GiB, 80 * GiB]
    assert kw["cpu_cache_bytes"] == int(10.5 * GiB)
    assert _agent_kwargs(parser().parse_args(["up", "--gpus", "1"]))["gpus"][0].memory_bytes == 80 * GiB  # default
    assert parser().parse_args(["deploy", "m", "--size-gib", "1.5"]).size_bytes == int(1.5 * GiB)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e30", "lots"])
def test_a_gib_flag_refuses_what_is_no_size(value: str) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["deploy", "m", "--size-gib", value])
    assert exc.value.code == 2


@pytest.mark.parametrize(("args", "new"), [
    (["deploy", "m", "--size-bytes", "5000000000"], "--size-gib"),
    (["agent", "--gpus", "2", "--gpu-memory-gb", "80"], "--gpu-memory-gib"),
    (["agent", "--cpu-cache-gb=10"], "--cpu-cache-gib"),
])
def test_an_old_memory_flag_is_refused_naming_the_new_one(args: list[str], new: str) -> None:
    ran = subprocess.run([sys.executable, "-m", "dataplane.ops.cli", *args], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert ran.returncode == 2 and not ran.stdout, ran
    assert ran.stderr.count("\n") == 1 and new in ran.stderr and "GiB" in ran.stderr, ran.stderr


def test_refusals_print_gib() -> None:
    b = _node(Builder(), "a", 2, 80 * GiB)
    why = never_fits(b.state, 200 * GiB)
    assert why is not None and "the largest card is 80.00 GiB" in why and "160.00 GiB in all" in why, why
    assert "needs 200.00 GiB" in why, why
    why = gpus_refusal(b.state, 200 * GiB, 2)
    assert why is not None and "charged 100.00 GiB (200.00 GiB / 2)" in why and "at most 80.00 GiB" in why, why


def _strings(path: Path) -> list[tuple[int, str]]:
    if path.suffix != ".py":
        return list(enumerate(path.read_text().splitlines(), 1))
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))
    return out


def _shown(text: str) -> bool:
    """Text that shows or takes memory in another unit. An old flag's name is allowed only as the
    refusal table's key, or next to the flag that replaced it."""
    if text in REPLACED_FLAGS or any(old in text and new in text for old, new in REPLACED_FLAGS.items()):
        return False
    return bool(re.search(r"\d\s*GB\b|\bGB\b|--[\w-]+-gb\b|--size-bytes\b", text))


def test_no_other_memory_unit_is_shown_or_taken() -> None:
    """No GB (10**9) in what the product shows or takes: its strings, its page, its CLI docs."""
    files = [p for top in ("schemas", "controlplane", "dataplane") for p in sorted((ROOT / top).rglob("*"))
             if p.suffix in (".py", ".js", ".html")]
    files += [ROOT / "README.md", ROOT / "docs" / "cli.md", ROOT / "docs" / "architecture.md"]
    found = [f"{p.relative_to(ROOT)}:{line}: {text.strip()[:80]}" for p in files for line, text in _strings(p)
             if _shown(text)]
    assert not found, found


def test_status_shows_a_tiny_models_use_not_zero() -> None:
    from controlplane.ops.render import _gib

    assert [_gib(n) for n in (0, 10 << 20, 100, 1 << 30, 80 << 30)] == ["0.0", "0.010", "<0.001", "1.0", "80.0"]

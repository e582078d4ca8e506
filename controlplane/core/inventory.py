"""What of a node's report is capacity: its agent's cards, bounded, and checked against the operator's
declaration (schemas/inventory.py). Pure: the fold calls it for every `NodeJoined` and `NodeDeclared`.

Without any declaration in the log (a history from before inventories, a test) the report is
taken as it is, bounded. Once one is, a node's capacity is the declared cards its agent also
reports, each at the smaller of the two memories; whatever the report claims beyond that is
refused, and said so (an anomaly, not capacity). The report can only lower what was declared.
"""

from __future__ import annotations

from typing import NamedTuple

from schemas.events import GpuInfo
from schemas.inventory import MAX_CARD_BYTES, MAX_CARDS_PER_NODE, MAX_CPU_CACHE_BYTES, NodeInventory


class Admitted(NamedTuple):
    gpus: tuple[GpuInfo, ...]
    cpu_cache_bytes: int
    labels: dict[str, str]
    problems: tuple[str, ...]  # what the report claimed that was not admitted, in the operator's terms


def bounded(gpus: tuple[GpuInfo, ...]) -> tuple[tuple[GpuInfo, ...], list[str]]:
    """The cards no node can have dropped: an index seen twice or out of range, memory out of range."""
    out: list[GpuInfo] = []
    seen: set[int] = set()
    problems: list[str] = []
    for g in gpus:
        if not 0 <= g.index < MAX_CARDS_PER_NODE or g.index in seen:
            problems.append(f"card index {g.index} is repeated or not 0-{MAX_CARDS_PER_NODE - 1}")
        elif not 0 < g.memory_bytes <= MAX_CARD_BYTES:
            problems.append(f"card {g.index} reports {g.memory_bytes} bytes, not 1 to {MAX_CARD_BYTES}")
        else:
            seen.add(g.index)
            out.append(g)
    return tuple(out), problems


def admit(node_id: str, gpus: tuple[GpuInfo, ...], cpu_cache_bytes: int, declared: NodeInventory | None,
          enforced: bool) -> Admitted:
    """The capacity of a node whose agent reports `gpus` and `cpu_cache_bytes`, given what the operator
    `declared` for it (`enforced`: a declaration is in force, for this node or any other)."""
    cards, problems = bounded(gpus)
    cpu = cpu_cache_bytes
    if not 0 <= cpu <= MAX_CPU_CACHE_BYTES:
        problems.append(f"CPU cache of {cpu} bytes is not 0 to {MAX_CPU_CACHE_BYTES}")
        cpu = 0
    if not enforced:
        return Admitted(cards, cpu, {}, tuple(problems))
    if declared is None:
        what = f"{len(cards)} card(s)" if cards else "no card"
        return Admitted((), 0, {}, (*problems, f"node {node_id!r} is not in the operator's inventory: "
                                              f"its report ({what}) is not capacity"))
    reported = {g.index: g for g in cards}
    admitted: list[GpuInfo] = []
    listed = declared.card_list()
    for index, group in listed:
        g = reported.pop(index, None)
        if g is None:
            continue  # declared, not seen by its agent: it cannot load there
        if g.memory_bytes > group.memory_bytes:
            problems.append(f"card {index} reports {g.memory_bytes} bytes, {group.memory_bytes} declared")
        admitted.append(GpuInfo(index=index, memory_bytes=min(g.memory_bytes, group.memory_bytes), name=g.name,
                                kind=group.kind))
    if reported:
        problems.append(f"card(s) {sorted(reported)} reported but not declared ({len(listed)} declared)")
    if declared.cpu_cache_bytes is not None and cpu > declared.cpu_cache_bytes:
        problems.append(f"CPU cache of {cpu} bytes reported, {declared.cpu_cache_bytes} declared")
        cpu = declared.cpu_cache_bytes
    return Admitted(tuple(admitted), cpu, dict(declared.labels), tuple(problems))

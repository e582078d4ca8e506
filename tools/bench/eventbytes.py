"""Bytes per stored event, and decode time, with model keys as strings (the old body) vs as fields.

"Before" is each event encoded by a plain msgspec encoder, which is byte for byte what the store
wrote before model keys were structured (`"model_key": "<class>:{\"repo_id\": ...}"`); "after" is
`encode_event`, what it writes now (`"model_key": {"repo_id": ...}`). Both from the same events, in
one run. Sets: the golden history tests/replay/histories/v1_lifecycle.jsonl, the rebuild benchmark's
lifecycle events (tools/bench/eventlog.py) with its repo ids swapped for realistic ones, and any
JSONL files given (one stored body a line, e.g. a dump of a demo's NDIF_EVENTS stream).

    python tools/bench/eventbytes.py [dump.jsonl ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "bench"))

import msgspec  # noqa: E402
from eventlog import lifecycle_events  # noqa: E402

from schemas import events as E  # noqa: E402

_plain = msgspec.json.Encoder()
REPOS = ["openai-community/gpt2", "meta-llama/Llama-3.1-8B", "EleutherAI/gpt-j-6b", "/home/ops/.ndif/models/tiny-gpt2"]


def realistic(events: list[E.Event]) -> list[E.Event]:
    """The bench's keys (`org/model-N`) with real repo ids, so key bytes are what an operator sees."""
    keys: dict[str, str] = {}
    out = []
    for ev in events:
        if ev.model_key is None:
            out.append(ev)
            continue
        if ev.model_key not in keys:
            repo = REPOS[len(keys) % len(REPOS)]
            keys[ev.model_key] = f'nnsight.modeling.language.LanguageModel:{{"repo_id": "{repo}", "revision": null}}'
        out.append(msgspec.structs.replace(ev, model_key=keys[ev.model_key]))
    return out


def key_bytes(body: bytes) -> int:
    """Bytes of `"model_key":<value>,` in one body."""
    value = json.loads(body).get("model_key")
    return len(b'"model_key":,') + len(msgspec.json.encode(value))


def best_us(variants: dict[str, tuple[Callable[[Any], object], list[Any]]], rounds: int = 60,
            number: int = 10) -> dict[str, float]:
    """Microseconds per item, the best of `rounds` rounds that run the variants in turn (the machine's
    load moves a lot; interleaving lets each variant see the same quiet moments)."""
    best = {name: float("inf") for name in variants}
    for _ in range(rounds):
        for name, (f, xs) in variants.items():
            # A def, not a lambda, only so mypy can type it (it cannot infer a lambda with defaults):
            # the same bytecode and the same defaults, timed the same way.
            def run(f: Callable[[Any], object] = f, xs: list[Any] = xs) -> list[object]:
                return [f(x) for x in xs]

            t = timeit.timeit(run, number=number)
            best[name] = min(best[name], t / number / len(xs) * 1e6)
    return {name: round(v, 2) for name, v in best.items()}


def measure(name: str, events: list[E.Event], timing: bool) -> dict[str, str | int | float]:
    before = [_plain.encode(ev) for ev in events]
    after = [E.encode_event(ev) for ev in events]
    n = len(events)
    per_event_before = round(sum(map(len, before)) / n, 1)
    per_event_after = round(sum(map(len, after)) / n, 1)
    row: dict[str, str | int | float] = {
        "set": name, "events": n,
        "bytes_per_event_before": per_event_before,
        "bytes_per_event_after": per_event_after,
        "model_key_share_before": round(sum(map(key_bytes, before)) / sum(map(len, before)), 3),
        "model_key_share_after": round(sum(map(key_bytes, after)) / sum(map(len, after)), 3),
    }
    row["saved"] = round(1 - per_event_after / per_event_before, 3)
    if timing:
        row.update(best_us({
            "decode_us_string_keys": (E.decode_event, before[:2000]),
            "decode_us_field_keys": (E.decode_event, after[:2000]),
            "encode_us_plain": (_plain.encode, events[:2000]),
            "encode_us_codec": (E.encode_event, events[:2000]),
        }))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dumps", nargs="*", type=Path, help="JSONL files of stored event bodies (one a line)")
    args = ap.parse_args()
    golden = ROOT / "tests" / "replay" / "histories" / "v1_lifecycle.jsonl"
    sets: list[tuple[str, list[E.Event]]] = [
        ("golden v1_lifecycle", [E.decode_event(b) for b in golden.read_bytes().splitlines() if b.strip()]),
        ("bench lifecycle, real repo ids", realistic(lifecycle_events(20000)))]
    for path in args.dumps:
        decoded = [E.decode_or_skip(b) for b in path.read_bytes().splitlines() if b.strip()]
        sets.append((path.name, [ev for ev in decoded if isinstance(ev, E.Event)]))
    for name, evs in sets:
        print(json.dumps(measure(name, evs, timing=name.startswith("bench"))))


if __name__ == "__main__":
    main()

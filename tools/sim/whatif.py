"""What-if replay: a simulated day's log re-decided under another policy, figures side by side.

    python tools/sim/whatif.py LOG --policy FILE [--quiet]

LOG is a JSON-lines event log written by `tools/sim/day.py --log LOG`; its requests are
regenerated from LOG.day.json (the day's spec) and its policy is read from the log (each model's
first AutoscalePolicySet). The same requests are run again through the product's decide, placement
and autoscaler under the recorded policy and under FILE (a JSON object of AutoscalePolicy fields),
and the log itself is read for what it recorded (count-changing decisions, cold and warm starts,
evictions). A log without its .day.json (a production log) holds no requests: this tool says so
and stops (exit 2) rather than guess a demand from the figures its decisions recorded.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from day import load_policy, run_autoscaler
from workload import DaySpec, generate

from schemas import events as E
from schemas.autoscale import AutoscalePolicy
from schemas.status import Level


def recorded(log: Path) -> tuple[AutoscalePolicy | None, dict[str, int], int]:
    """The first policy the log sets, its counts of what happened, and its events."""
    policy: AutoscalePolicy | None = None
    seen: Counter[str] = Counter()
    n = 0
    with log.open("rb") as f:
        for line in f:
            ev = E.decode_or_skip(line)
            n += 1
            if isinstance(ev, E.AutoscalePolicySet) and policy is None:
                policy = ev.policy
            elif isinstance(ev, E.AutoscaleDecided) and ev.target != ev.current:
                seen["decisions"] += 1
            elif isinstance(ev, E.ReplicaScheduled):
                seen["warm_starts" if ev.source is Level.WARM else "cold_starts"] += 1
            elif isinstance(ev, E.ReplicaEvictionRequested):
                seen["evictions"] += 1
    return policy, dict(seen), n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--policy", required=True, help="JSON file of AutoscalePolicy fields")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    log = Path(a.log)
    spec_path = Path(f"{a.log}.day.json")
    if not spec_path.exists():
        print(f"{log}: no {spec_path.name} beside it: the log holds no requests to replay "
              "(a simulated day's log comes with its spec; `tools/sim/day.py --log`)", file=sys.stderr)
        return 2
    spec = DaySpec(**json.loads(spec_path.read_text()))
    old, counts, events = recorded(log)
    if old is None:
        print(f"{log}: no AutoscalePolicySet in it: nothing to compare against", file=sys.stderr)
        return 2
    new = load_policy(a.policy)
    w = generate(spec)
    if not a.quiet:
        print(f"{log}: {events} events, policy {json.dumps(_policy(old))}; replaying {w.requests} requests "
              f"under it and under {json.dumps(_policy(new))}", flush=True)
    before = run_autoscaler(w, old, quiet=a.quiet)
    after = run_autoscaler(w, new, quiet=a.quiet)
    hours = spec.day_s / 3600
    as_logged = {k: round(v / hours, 1) if k != "decisions" else v for k, v in counts.items()}
    out = {"log": str(log), "events": events, "as_logged_per_h": as_logged,
           "recorded_policy": before.summary(), "new_policy": after.summary(),
           "gpu_hours_ratio_new_over_recorded": round(after.gpu_hours / before.gpu_hours, 3) if before.gpu_hours else None}
    print(json.dumps(out))
    return 0


def _policy(p: AutoscalePolicy) -> dict[str, object]:
    return {f: getattr(p, f) for f in p.__struct_fields__}


if __name__ == "__main__":
    raise SystemExit(main())

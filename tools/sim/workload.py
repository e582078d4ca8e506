"""A synthetic day of requests for a fleet: heavy-tailed popularity, a daily cycle, bursts, model sizes.

Seeded and self-describing: a `DaySpec` (a few numbers) regenerates the same `Workload`, so a
simulated day's log needs only its spec beside it to be replayed under another policy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import numpy.typing as npt

GB = 10**9


@dataclass(frozen=True)
class DaySpec:
    """What a synthetic day is made of. Defaults: the issue's fleet (500 models, 1,000 nodes x 8 GPUs)."""

    models: int = 500
    nodes: int = 1000
    gpus_per_node: int = 8
    card_gb: float = 80.0
    cpu_cache_gb: float = 512.0  # per node, for WARM copies
    day_s: int = 86_400
    tick_s: float = 1.0
    seed: int = 0
    mean_rate: float = 20.0  # requests per second over the whole fleet, averaged over the day
    zipf_s: float = 1.1  # popularity of the model of rank k is proportional to 1 / k**zipf_s
    min_gb: float = 1.0
    max_gb: float = 140.0
    bursts_per_model: float = 2.0  # per day, on average
    burst_mean_s: float = 900.0
    burst_rate: float = 0.5  # median extra requests per second of a burst (log-normal, capped)
    burst_cap: float = 5.0

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Workload:
    """The day's models and arrivals, tick by tick (CSR: tick t's arrivals are models[off[t]:off[t+1]]
    with counts[...]), and each model's expected rate at each 60 s step (for sizing the fixed fleet)."""

    spec: DaySpec
    model_keys: list[str]
    sizes_gb: list[float]
    service_s: list[float]  # one request on one replica
    offsets: npt.NDArray[np.int64]
    models: npt.NDArray[np.int32]
    counts: npt.NDArray[np.int32]
    minute_rates: npt.NDArray[np.float64]  # (minutes, models)
    requests: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ticks(self) -> int:
        return len(self.offsets) - 1

    def arrivals(self, tick: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        a, b = int(self.offsets[tick]), int(self.offsets[tick + 1])
        return self.models[a:b], self.counts[a:b]


def service_time(size_gb: float) -> float:
    """Seconds one request holds one replica: bigger models are slower (0.2 s at 1 GB, 1.6 s at 140 GB)."""
    return 0.19 + size_gb / 100.0


def generate(spec: DaySpec, chunk_s: int = 3600) -> Workload:
    """The day `spec` describes (the same spec, the same day)."""
    rng = np.random.default_rng(spec.seed)
    n = spec.models
    sizes = np.exp(rng.uniform(math.log(spec.min_gb), math.log(spec.max_gb), n))
    ranks = rng.permutation(n) + 1  # popularity rank, independent of size
    weight = 1.0 / ranks.astype(np.float64) ** spec.zipf_s
    weight /= weight.sum()
    phase = rng.normal(0.0, 7200.0, n)  # researchers in other time zones
    # Bursts: (model, start, end, extra rate).
    nb = rng.poisson(spec.bursts_per_model, n)
    b_model = np.repeat(np.arange(n), nb)
    b_start = rng.uniform(0, spec.day_s, len(b_model))
    b_len = np.clip(rng.exponential(spec.burst_mean_s, len(b_model)), 120, 3600)
    b_rate = np.minimum(spec.burst_cap, np.exp(rng.normal(math.log(spec.burst_rate), 0.8, len(b_model))))
    # The daily cycle, normalised so the day's mean over the fleet is `mean_rate` without bursts.
    base = spec.mean_rate * weight

    def rates_at(t: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """(len(t), models) expected requests per second."""
        x = (t[:, None] - 4 * 3600 - phase[None, :]) / spec.day_s * 2 * math.pi
        diurnal = 0.35 + 0.65 * (0.5 - 0.5 * np.cos(x))  # lowest at 04:00 local, highest at 16:00
        r = base[None, :] * diurnal / 0.675  # 0.675: the cycle's mean
        for m, s, ln, br in zip(b_model, b_start, b_len, b_rate, strict=True):
            on = (t >= s) & (t < s + ln)
            if on.any():
                r[on, m] += br
        return r

    ticks = int(spec.day_s / spec.tick_s)
    offsets = np.zeros(ticks + 1, dtype=np.int64)
    models_parts: list[npt.NDArray[np.int32]] = []
    counts_parts: list[npt.NDArray[np.int32]] = []
    done = 0
    step = max(1, int(chunk_s / spec.tick_s))
    for lo in range(0, ticks, step):
        hi = min(ticks, lo + step)
        t = (np.arange(lo, hi, dtype=np.float64) + 0.5) * spec.tick_s
        lam = rates_at(t) * spec.tick_s
        draws = rng.poisson(lam).astype(np.int32)
        rows, cols = np.nonzero(draws)
        models_parts.append(cols.astype(np.int32))
        counts_parts.append(draws[rows, cols])
        per_tick = np.bincount(rows, minlength=hi - lo)
        offsets[lo + 1:hi + 1] = done + np.cumsum(per_tick)
        done += int(per_tick.sum())
    minutes = np.arange(0, spec.day_s, 60, dtype=np.float64) + 30.0
    models_arr = np.concatenate(models_parts) if models_parts else np.zeros(0, np.int32)
    counts_arr = np.concatenate(counts_parts) if counts_parts else np.zeros(0, np.int32)
    return Workload(
        spec=spec,
        model_keys=[f"sim/model-{i:04d}" for i in range(n)],
        sizes_gb=[float(s) for s in sizes],
        service_s=[service_time(float(s)) for s in sizes],
        offsets=offsets, models=models_arr, counts=counts_arr,
        minute_rates=rates_at(minutes),
        requests=int(counts_arr.sum()),
    )


def peak_counts(w: Workload, *, window_min: int = 5, per_replica: float = 0.8, cap: int = 8) -> list[int]:
    """The replica count an operator would give each model for its peak: its highest expected
    arrival rate over `window_min` minutes, served at `per_replica` utilisation, at least 1, at most `cap`."""
    r = w.minute_rates
    k = max(1, window_min)
    c = np.cumsum(np.vstack([np.zeros((1, r.shape[1])), r]), axis=0)
    smooth = (c[k:] - c[:-k]) / k
    peak = smooth.max(axis=0)
    out = []
    for i in range(r.shape[1]):
        busy = peak[i] * w.service_s[i] / per_replica
        out.append(int(min(cap, max(1, math.ceil(busy)))))
    return out

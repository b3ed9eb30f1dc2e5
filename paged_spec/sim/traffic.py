"""Traffic for the simulator: when requests arrive and how long their prompts and outputs are.

No dataset can be downloaded here, so the presets are synthetic: log-normal
lengths whose means match what the PagedAttention paper reports for its two
traces (ShareGPT: 161 prompt and 338 output tokens on average, long-tailed;
Alpaca: 19 and 58, short) after clipping to the paper's 2,048-token maximum.
The spread (``sigma``, the standard deviation of the length's logarithm) is
this project's choice, wide for chat and narrow for instructions. A trace file
replaces both arrivals and lengths.

>>> reqs = poisson_trace(LENGTH_PRESETS["sharegpt"], rate=10.0, num_requests=20_000, seed=0)
>>> [r.arrival for r in reqs[:3]] == sorted(r.arrival for r in reqs[:3])
True
>>> mean = lambda xs: sum(xs) / len(xs)
>>> round(mean([r.prompt_len for r in reqs]), -1), round(mean([r.output_len for r in reqs]), -1)
(160.0, 340.0)
>>> round(len(reqs) / reqs[-1].arrival)     # requests per second
10
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: arrival time in seconds, prompt and output length in tokens."""

    arrival: float
    prompt_len: int
    output_len: int
    request_class: str = "default"  # slices the metrics (spec.metrics): "chat", "document", ...


@dataclass(frozen=True)
class LogNormal:
    """Lengths ``round(exp(N(mu, sigma)))`` of mean ``mean`` before clipping to ``lo .. hi``."""

    mean: float
    sigma: float
    lo: int = 1
    hi: int = 2048

    def sample(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma**2 / 2  # so that E[exp(N(mu, sigma))] = mean
        return min(self.hi, max(self.lo, round(rng.lognormvariate(mu, self.sigma))))


@dataclass(frozen=True)
class LengthPreset:
    """Prompt and output length distributions of one kind of traffic."""

    name: str
    prompt: LogNormal
    output: LogNormal


LENGTH_PRESETS = {
    "sharegpt": LengthPreset(
        "sharegpt", LogNormal(165, 0.9, hi=1024), LogNormal(348, 0.7, hi=1024)
    ),
    "alpaca": LengthPreset("alpaca", LogNormal(19.3, 0.5, hi=256), LogNormal(58.5, 0.7, hi=512)),
}
"""Clipping keeps prompt + output within 2,048 tokens, the paper's maximum length."""

DOCUMENT = LengthPreset(
    "document", LogNormal(3000, 0.3, lo=1024, hi=6000), LogNormal(120, 0.5, hi=512)
)
"""Long-document requests (summarize, extract): long prompts, short answers. This
project's choice, for the request-class lesson; within 8,192 tokens."""


def poisson_trace(
    preset: LengthPreset, rate: float, num_requests: int, seed: int = 0
) -> list[TraceRequest]:
    """``num_requests`` requests with exponential gaps of mean ``1 / rate`` seconds.

    The lengths are drawn from their own generator, so the same seed gives the
    same requests at every rate: a sweep over rates changes only the arrivals.
    """
    if rate <= 0 or num_requests < 1:
        raise ValueError(f"need rate > 0 and num_requests >= 1, got {rate}, {num_requests}")
    return mixed_trace([(preset, 1.0)], rate, num_requests, seed, classes=False)


def mixed_trace(
    mix: Sequence[tuple[LengthPreset, float]],
    rate: float,
    num_requests: int,
    seed: int = 0,
    *,
    classes: bool = True,
) -> list[TraceRequest]:
    """Poisson arrivals at ``rate``; each request's kind drawn from ``mix`` by share.

    With ``classes`` each request's class is its preset's name (else "default").

    >>> t = mixed_trace([(LENGTH_PRESETS["sharegpt"], 0.9), (DOCUMENT, 0.1)], 10.0, 1000)
    >>> docs = [r for r in t if r.request_class == "document"]
    >>> len(docs), all(1024 <= r.prompt_len <= 6000 for r in docs)
    (106, True)
    """
    if rate <= 0 or num_requests < 1:
        raise ValueError(f"need rate > 0 and num_requests >= 1, got {rate}, {num_requests}")
    arrivals, lengths = random.Random(seed), random.Random(seed + 1)
    kinds = random.Random(seed + 2)
    presets, shares = [p for p, _ in mix], [w for _, w in mix]
    t, out = 0.0, []
    for _ in range(num_requests):
        t += arrivals.expovariate(rate)
        preset = presets[0] if len(mix) == 1 else kinds.choices(presets, shares)[0]
        name = preset.name if classes else "default"
        out.append(
            TraceRequest(t, preset.prompt.sample(lengths), preset.output.sample(lengths), name)
        )
    return out


def load_trace(path: Path) -> list[TraceRequest]:
    """Read a JSON-lines trace: one ``{"arrival": s, "prompt_len": n, "output_len": m}`` a line
    (optionally ``"request_class": name``)."""
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            req = TraceRequest(
                float(row["arrival"]),
                int(row["prompt_len"]),
                int(row["output_len"]),
                str(row.get("request_class", "default")),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: not a trace row ({e}): {line[:80]!r}") from None
        if req.arrival < 0 or req.prompt_len < 1 or req.output_len < 1:
            raise ValueError(f"{path}:{lineno}: need arrival >= 0 and lengths >= 1: {line[:80]!r}")
        out.append(req)
    if not out:
        raise ValueError(f"{path}: the trace is empty")
    return sorted(out, key=lambda r: r.arrival)


def save_trace(path: Path, trace: Iterable[TraceRequest]) -> None:
    """Write a trace in the format :func:`load_trace` reads (by the project's one rule for an
    output path: :func:`conformance.output_files.write_output`)."""
    from conformance.output_files import write_output

    write_output(path, "".join(json.dumps(asdict(r)) + "\n" for r in trace))

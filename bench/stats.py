"""Figures and the ratio table: medians, p99, interleaved A/B sampling, and rows comparing ours with a baseline.

The machine has two noisy cores, so no absolute time stands alone as a claim: each row carries the baseline
measured in the same run, interleaved with ours, and the ratio between them.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (p99 of 50 samples is their maximum: honest for small samples)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def median_interval(
    values: Sequence[float], confidence: float = 0.9, resamples: int = 2000
) -> tuple[float, float]:
    """Where the median of `values` would fall, run again: the central `confidence` range of the medians of
    bootstrap resamples (seeded, so a report is reproducible). What more rounds narrow: the middle half of
    per-round ratios is the scatter of one round, this is how well the figure itself is known."""
    if not values:
        return math.nan, math.nan
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    cut = int(resamples * (1 - confidence) / 2)
    return medians[cut], medians[resamples - 1 - cut]


def spread_text(ratios: Sequence[float], by_pair: Sequence[Sequence[float]] = ()) -> str:
    """How a row's per-round ratios scatter and how well their median is known: "40 rounds, middle half
    0.95-1.01, median within 0.97-0.99 (90%)"; for rounds made on several pairs of processes (`by_pair`: each
    pair's ratios), also the lowest and highest of the pairs' medians: ", 4 process pairs' medians 0.96-0.99"."""
    low, high = median_interval(ratios)
    text = (
        f"{len(ratios)} rounds, middle half {percentile(ratios, 0.25):.2f}-{percentile(ratios, 0.75):.2f}, "
        f"median within {low:.2f}-{high:.2f} (90%)"
    )
    if len(by_pair) > 1:
        medians = [median(pair) for pair in by_pair]
        text += f", {len(by_pair)} process pairs' medians {min(medians):.2f}-{max(medians):.2f}"
    return text


# A row's median is known well enough, and its later process pairs are skipped (bench.data_plane, bench.flag_cost),
# once the bootstrap's 90 % range of its median lies within this of the median (what a full row's 80 rounds aim
# for on a loaded machine) and its pairs' medians agree within PAIRS_AGREE: the process luck that more rounds of
# one pair do not average away. Never before MIN_PAIRS pairs and MIN_ROUNDS rounds.
SETTLED_WITHIN = 0.03
PAIRS_AGREE = 0.04
MIN_PAIRS = 2
MIN_ROUNDS = 10


def settled(ratios: Sequence[float], by_pair: Sequence[Sequence[float]]) -> bool:
    """Whether more pairs of processes would add nothing the row needs: its median within ±SETTLED_WITHIN (90 %)
    and its pairs' medians within PAIRS_AGREE of each other. On a quiet machine the rows settle after two or three
    of their four pairs; on a loaded one they take every pair, as before."""
    if len(by_pair) < MIN_PAIRS or len(ratios) < MIN_ROUNDS:
        return False
    low, high = median_interval(ratios)
    middle = median(ratios)
    medians = [median(pair) for pair in by_pair]
    return max(high - middle, middle - low) <= SETTLED_WITHIN and max(medians) - min(medians) <= PAIRS_AGREE


@dataclass(frozen=True)
class Budget:
    """How long one pair's share of a row's rounds may take: its rounds stop once `seconds` are spent, never before
    `at_least` of them. On a quiet machine a row makes every round its plan gives it; on a loaded one (a block of
    4,096 calls took 8 s at load 10, 1.1 s at load 1) it makes fewer, which its row shows (its rounds, and how well
    its median is known)."""

    seconds: float = math.inf
    at_least: int = 0

    def spent(self, rounds_made: int, started: float) -> bool:
        return rounds_made >= self.at_least and time.monotonic() - started >= self.seconds


UNLIMITED = Budget()


def pair_budget(row_seconds: float, pairs: int) -> Budget:
    """A pair's even share of a row's seconds, with at least its share of MIN_ROUNDS (so a row has 10 or more)."""
    return Budget(row_seconds / pairs, -(-MIN_ROUNDS // pairs))


def p99(values: Sequence[float]) -> float:
    return percentile(values, 0.99)


@dataclass
class Samples:
    """Latencies in seconds."""

    values: list[float] = field(default_factory=list)

    @property
    def p50_ms(self) -> float:
        return median(self.values) * 1e3

    @property
    def p99_ms(self) -> float:
        return p99(self.values) * 1e3

    def describe(self) -> str:
        return f"{fmt_ms(self.p50_ms)} / {fmt_ms(self.p99_ms)} ms"


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def interleaved_latencies(
    ours: Callable[[], object], baseline: Callable[[], object], pairs: int, warmup: int = 1
) -> tuple[Samples, Samples]:
    """Alternate the two calls (AB, BA, AB, ...) so drift and noise hit both alike."""
    for _ in range(warmup):
        ours()
        baseline()
    ours_samples, baseline_samples = Samples(), Samples()
    for index in range(pairs):
        if index % 2 == 0:
            ours_samples.values.append(timed(ours))
            baseline_samples.values.append(timed(baseline))
        else:
            baseline_samples.values.append(timed(baseline))
            ours_samples.values.append(timed(ours))
    return ours_samples, baseline_samples


def fmt_ms(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def fmt_ratio(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if value >= 100:
        return f"{value:.0f}x"
    if value >= 10:
        return f"{value:.1f}x"
    return f"{value:.2f}x"


@dataclass
class Row:
    """One line of the table: ours beside the baseline measured in the same run, and the ratio between them
    ("times better": baseline / ours for latencies, ours / baseline for throughput). `met` is None when the row
    only informs."""

    area: str
    measure: str
    ours: str
    baseline: str
    ratio: float
    goal_text: str = ""
    met: bool | None = None
    goal_ratio: float | None = None  # a minimum ratio (ratio_row's goal)

    def ratio_text(self) -> str:
        """The ratio as shown, one digit more where two would show it equal to its goal: a miss never reads as
        the goal itself ("0.848x", not "0.85x", against 0.85)."""
        shown = fmt_ratio(self.ratio)
        if self.goal_ratio is not None and shown == fmt_ratio(self.goal_ratio) and self.ratio != self.goal_ratio:
            return f"{self.ratio:.3f}x"
        return shown


def ratio_row(area: str, measure: str, ours: str, baseline: str, ratio: float, goal: float | None) -> Row:
    """A row whose goal is a minimum ratio (None: no goal, the row informs)."""
    if goal is None:
        return Row(area, measure, ours, baseline, ratio)
    met = not math.isnan(ratio) and ratio >= goal
    return Row(area, measure, ours, baseline, ratio, f"≥ {fmt_ratio(goal)}", met, goal)


TABLE_HEADER = ("area", "measure", "gym_rpc", "baseline (same run)", "ratio", "goal", "met")


def table_lines(rows: Sequence[Row]) -> list[str]:
    """A Markdown table (it reads well on a terminal too)."""
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "|".join("---" for _ in TABLE_HEADER) + "|"]
    for row in rows:
        met = "—" if row.met is None else ("yes" if row.met else "NO")
        cells = (row.area, row.measure, row.ours, row.baseline, row.ratio_text(), row.goal_text or "—", met)
        lines.append("| " + " | ".join(cells) + " |")
    return lines

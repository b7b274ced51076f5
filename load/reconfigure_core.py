"""`nitsum bench reconfigure`'s functional core (pure, no clock reads): the topology chains, the stream-visible
pause of each change from the token timeline, stalls, the workers' pre-copy log lines and the restart baseline."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

TP1X4 = "[0 TP1 hybrid][1 TP1 hybrid][2 TP1 hybrid][3 TP1 hybrid]"
TP2X2 = "[0-1 TP2 hybrid][2-3 TP2 hybrid]"
TP4 = "[0-3 TP4 hybrid]"
TP1X2 = "[0 TP1 hybrid][1 TP1 hybrid]"
TP2 = "[0-1 TP2 hybrid]"
# (kind, from, to): every merge and split the brief asks for, starting and ending where workers boot.
CHAIN: tuple[tuple[str, str, str], ...] = (
    ("merge", TP1X4, TP4),
    ("split", TP4, TP2X2),
    ("merge", TP2X2, TP4),
    ("split", TP4, TP2X2),
    ("split", TP2X2, TP1X4),
)
# `--devices 2`: one worker per core on a 2-core machine (the 4-worker chain runs two processes per core).
CHAIN_2: tuple[tuple[str, str, str], ...] = (
    ("merge", TP1X2, TP2),
    ("split", TP2, TP1X2),
    ("merge", TP1X2, TP2),
    ("split", TP2, TP1X2),
)
SHAPE_NAMES = {TP1X4: "4xTP1", TP2X2: "2xTP2", TP4: "TP4", TP1X2: "2xTP1", TP2: "TP2"}
CHAINS = {4: CHAIN, 2: CHAIN_2}
BOOT_SHAPES = {4: TP1X4, 2: TP1X2}  # workers boot as one TP1 group each
# An inter-token gap this long is a stall (a hand-off the gateway did not follow), not a slow step.
STALL_MS = 1000.0


@dataclass(frozen=True)
class TransitionGap:
    max_gap_ms: float | None  # largest inter-token gap of any stream overlapping the transition window
    steady_ms: float | None  # median inter-token gap of the steady stretch before the window (old TP)
    streams_across: int  # streams with a gap overlapping the window
    steady_after_ms: float | None = None  # the same, of the stretch after the window (new TP)

    @property
    def reference_ms(self) -> float | None:
        """The step a gap across the change would take with no pause at all: the gap ends with the new
        group's first token, so it is one step of the old or of the new TP, whichever is longer (on 2 shared
        cores a TP4 step is 2-3x a TP1 step; charging that to the pause would count the new TP's own cost)."""
        known = [x for x in (self.steady_ms, self.steady_after_ms) if x is not None]
        return max(known) if known else None

    @property
    def pause_ms(self) -> float | None:
        """Stream-visible pause: the largest gap minus one reference step (what the stream lost)."""
        ref = self.reference_ms
        if self.max_gap_ms is None or ref is None:
            return None
        return max(0.0, self.max_gap_ms - ref)

    @property
    def pause_steps(self) -> float | None:
        p, ref = self.pause_ms, self.reference_ms
        return None if p is None or not ref else p / ref

    @property
    def pause_before_ms(self) -> float | None:
        """The older, stricter figure: the largest gap minus the steady step before the change only."""
        if self.max_gap_ms is None or self.steady_ms is None:
            return None
        return max(0.0, self.max_gap_ms - self.steady_ms)


def _stretch_step(token_times_ms: Sequence[Sequence[float]], lo: float, hi: float) -> float | None:
    """Steady step of the stretch [lo, hi]: per stream the mean gap of its tokens inside ((last - first) /
    (n - 1), so tokens the client read in one chunk, 0 ms apart, do not make it 0), then the median."""
    per_stream = []
    for times in token_times_ms:
        inside = [t for t in times if lo <= t <= hi]
        if len(inside) >= 3 and inside[-1] > inside[0]:
            per_stream.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return statistics.median(per_stream) if per_stream else None


def transition_gaps(
    token_times_ms: Sequence[Sequence[float]], windows_ms: Sequence[tuple[float, float]]
) -> tuple[float | None, list[TransitionGap]]:
    """Steady step (median over transitions) and, per window [start, end] (admin call sent .. answered), the
    largest gap from that change on against the steady steps of the stretch since the previous window ended
    (old TP) and of the stretch from this window's end to the next window's start (new TP).

    A gap (a, b) belongs to change k when b > start_k and a < start_{k+1}."""
    out = []
    prev_end = float("-inf")
    for k, (s, e) in enumerate(windows_ms):
        # Gaps that end after the call was sent and start before the next change: a stream that stalls after
        # the answer (its new leader not followed) counts against this change too.
        until = windows_ms[k + 1][0] if k + 1 < len(windows_ms) else float("inf")
        across = [
            (b - a, i)
            for i, times in enumerate(token_times_ms)
            for a, b in zip(times, times[1:])
            if b > s and a < until
        ]
        out.append(
            TransitionGap(
                max(g for g, _ in across) if across else None,
                _stretch_step(token_times_ms, prev_end, s),
                len({i for _, i in across}),
                _stretch_step(token_times_ms, e, until),
            )
        )
        prev_end = e
    steady = [g.steady_ms for g in out if g.steady_ms is not None]
    return (statistics.median(steady) if steady else None), out


def stalls(token_times_ms: Sequence[Sequence[float]], threshold_ms: float) -> int:
    """Inter-token gaps of at least threshold_ms: a hand-off the gateway did not follow shows as one."""
    return sum(1 for times in token_times_ms for a, b in zip(times, times[1:]) if b - a >= threshold_ms)


_PRECOPY_LINE = re.compile(
    r"epoch (\d+): prepare step ([\d.]+) ms .*?pre-copy of (\d+) flow\(s\) \+ (\d+) local copy\(ies\), "
    r"(\d+) chunk\(s\), (\d+) bytes, done ([\d.]+) ms"
)


def precopy_stats(log_lines: Sequence[str]) -> dict[int, dict[str, float]]:
    """Per epoch, from the old group leaders' log lines (services/worker/migration_flows.py): the longest
    prepare step (the part of prepare that stops a group), stage-M flows, chunks and bytes pre-copied (all
    leaders), and the latest pre-copy end after its prepare ack was pending."""
    out: dict[int, dict[str, float]] = {}
    for line in log_lines:
        m = _PRECOPY_LINE.search(line)
        if m is None:
            continue
        epoch = int(m.group(1))
        row = out.setdefault(epoch, {"prepare_step_ms": 0.0, "flows": 0, "chunks": 0, "bytes": 0, "precopy_ms": 0.0})
        row["prepare_step_ms"] = max(row["prepare_step_ms"], float(m.group(2)))
        row["flows"] += int(m.group(3))
        row["chunks"] += int(m.group(5))
        row["bytes"] += int(m.group(6))
        row["precopy_ms"] = max(row["precopy_ms"], float(m.group(7)))
    return out


def restart_ms(stop_ms: float, boot_ms: float, to_target_ms: dict[str, float], target: str) -> float | None:
    """Restart baseline for one target shape: workers boot as N x TP1; other shapes need one more change."""
    if target in BOOT_SHAPES.values():
        return stop_ms + boot_ms
    return stop_ms + boot_ms + to_target_ms[target] if target in to_target_ms else None

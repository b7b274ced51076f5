"""What a live mesh adds to the engine steps a device table times: the request path and step-time noise.

A device table (`nitsum bench profile`) times `engine.step()` alone, at its fastest. A request on the live mesh
also crosses HTTP, the gateway, NATS and the coordinator before it reaches the engine, and its first token
crosses them back; every step is followed by the worker publishing its tokens, and on a shared CPU the steps
themselves are slowed by whatever else runs. None of that is a constant: the path of a request depends on how
busy (or how asleep) the services were, and the slowdown comes in episodes. So the simulator takes both as
*empirical distributions measured on calibration requests* (`nitsum bench fidelity` measures them on trace
rows it does not evaluate) and draws from them with a seeded generator:

- `path_ms`: one draw per request, added to every time its client observes (first token, last token). Measured
  end to end (live TTFT minus the simulated engine TTFT), it carries the prefill step's own noise too, which is
  why prefill steps are not scaled below. It delays what the client sees, not when the engine gets the
  request: the services' spans put a few ms before the worker (client to gateway to coordinator to worker,
  ~4 ms at p50) and the heavy tail (stalls of 100-500 ms on a loaded machine) after it, and a path placed
  before admission made the simulated policy refuse requests the live one had admitted and served.
- `stalled` (paired with `path_ms`): the calibration request's tokens all reached the client at once (live
  TPOT 0: the delivery path stalled until the decode was over, so its path sample holds the whole decode). A
  request drawing such a sample sees its tokens at once too: its record's TPOT is 0. On a loaded machine up
  to a quarter of a session's requests do; leaving them out put the simulated TPOT p50 26 % over the live one.
- `step_ratios`: live decode-step period / the table's; scales decode-only steps. The slowdowns of a shared
  machine are an outside process in wall-clock time that lasts longer than a step, so the ratio is drawn per
  window of `noise_window_ms` of simulated time (window k's ratio is the k-th draw whatever happens in between:
  reproducible), and a request takes the ratio of the window its decode *starts* in and keeps it to its last
  token; a decode step is slowed by the mean ratio of the requests in it. Each calibration ratio was measured
  over one request's whole decode, and the calibration makes the window as long as the longest calibration
  decode, so concurrent requests mostly share one draw, as they shared one machine state live. Tried and
  dropped, each for a measured reason: a draw per step (averages a request's slowdown away: TPOT p90 at 56 % of
  the live one), every step taking its own window's draw (the slowest requests, with the longest decodes, most
  often straddle two windows and average their slow draw away: TPOT p90 15 % low even on the calibration rows
  themselves), one draw per request independent of the others (TPOT p50 13 % high on the calibration rows),
  one draw per engine busy period
  (a slow draw lengthens its own busy period, so it slows more requests than its share: TPOT p50 20x on an
  overloaded run).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nitsum.metrics import RequestRecord


@dataclass(frozen=True)
class ServiceModel:
    path_ms: tuple[float, ...] = (0.0,)  # samples, ms added to what the client sees (end to end: see above)
    stalled: tuple[bool, ...] = ()  # per path sample: its tokens came at once (empty: none did)
    step_ratios: tuple[float, ...] = (1.0,)  # samples of live decode-step period / table step time
    noise_window_ms: float = 0.0  # a drawn step ratio holds this long; 0: a fresh draw every step
    seed: int = 0
    source: str = ""  # where the samples were measured

    def __post_init__(self) -> None:
        if not self.path_ms or not self.step_ratios:
            raise ValueError("a service model needs at least one path sample and one step ratio")
        if not all(math.isfinite(x) and x >= 0.0 for x in self.path_ms):
            raise ValueError("path samples must be finite and >= 0 ms")
        if not all(math.isfinite(x) and x > 0.0 for x in self.step_ratios):
            raise ValueError("step ratios must be finite and > 0")
        if self.stalled and len(self.stalled) != len(self.path_ms):
            raise ValueError("one stalled flag per path sample (or none)")
        if not (math.isfinite(self.noise_window_ms) and self.noise_window_ms >= 0.0):
            raise ValueError("noise_window_ms must be finite and >= 0")


def draw(sorted_samples: Sequence[float], u: float) -> tuple[float, int]:
    """The empirical distribution's value at quantile u in [0, 1), linear between neighbouring samples (so the
    draws fill the gaps between 50 samples instead of sticking to them: a p90 that sat in a gap of a heavy tail
    jumped by 20-50 % between simulations), and the index of the nearest sample."""
    pos = u * (len(sorted_samples) - 1)
    i = int(pos)
    j = min(i + 1, len(sorted_samples) - 1)
    return sorted_samples[i] + (pos - i) * (sorted_samples[j] - sorted_samples[i]), round(pos)


class ServiceSampler:
    """The draws of one simulator run (two independent seeded streams: paths, step ratios)."""

    def __init__(self, model: ServiceModel) -> None:
        self.model = model
        order = sorted(range(len(model.path_ms)), key=lambda k: model.path_ms[k])
        self._path_ms = [model.path_ms[k] for k in order]
        self._stalled = [bool(model.stalled) and model.stalled[k] for k in order]
        self._step_ratios = sorted(model.step_ratios)
        self._paths = random.Random(2 * model.seed)
        self._ratios = random.Random(2 * model.seed + 1)
        self._window = -1  # the last window a ratio was drawn for
        self._ratio = 1.0

    def path(self) -> tuple[float, bool]:
        """The next request's (path ms, stalled: the flag of the nearest sample); requests draw in arrival order."""
        value, nearest = draw(self._path_ms, self._paths.random())
        return value, self._stalled[nearest]

    def step_ratio(self, now_ms: float) -> float:
        """The slowdown of a decode step starting at `now_ms` (non-decreasing across calls)."""
        w = self.model.noise_window_ms
        if w <= 0.0:
            return draw(self._step_ratios, self._ratios.random())[0]
        k = int(now_ms // w)
        assert k >= self._window, "step ratios are asked for in time order"
        while self._window < k:  # one draw per window, including windows no step started in
            self._ratio = draw(self._step_ratios, self._ratios.random())[0]
            self._window += 1
        return self._ratio


@dataclass(frozen=True)
class Calibration:
    """A service model measured on calibration requests, with what was left out and why."""

    model: ServiceModel
    requests: int  # calibration pairs given
    path_samples: int
    path_clamped: int  # live TTFT below the simulated engine TTFT: the path sample is 0, not negative
    ratio_samples: int
    ratio_dropped: int  # live TPOT of 0 (all tokens arrived in one chunk: a stall), or no TPOT
    stalled: int = 0  # of those, live TPOT 0 (flagged with their path sample)


def calibrate_service(
    live: Sequence[RequestRecord],
    simulated: Sequence[RequestRecord],
    seed: int = 0,
    source: str = "",
    base_ratio: float = 1.0,
) -> Calibration:
    """The service model of a mesh from calibration requests: `live[i]` and `simulated[i]` are the same request
    measured on the mesh and simulated on the device table with every decode step scaled by `base_ratio` (and
    no path), with everything else that ran at the time (so queueing behind other requests is the simulator's,
    not the path's).
    - path sample = live TTFT - simulated TTFT (clamped at 0);
    - step ratio = base_ratio x live TPOT / simulated TPOT;
    - noise window = the longest live decode (first to last token) among the requests with a ratio."""
    assert len(live) == len(simulated), "one simulated record per live record"
    paths, ratios, spans = [], [], []
    clamped = dropped = 0
    for a, b in zip(live, simulated):
        assert a.prompt_tokens == b.prompt_tokens and abs(a.send_ms - b.send_ms) < 1.0, (
            f"calibration pair {a.request_id} / {b.request_id} is not the same request"
        )
        if a.ttft_ms is not None and b.ttft_ms is not None:
            d = a.ttft_ms - b.ttft_ms
            clamped += d < 0
            paths.append((max(d, 0.0), a.tpot_ms == 0.0))
        if a.tpot_ms and b.tpot_ms:
            ratios.append(base_ratio * a.tpot_ms / b.tpot_ms)
            spans.append(a.finish_ms - a.first_token_ms)
        else:
            dropped += 1
    if not paths or not ratios:
        raise ValueError(
            f"calibration needs requests with a first token and with a TPOT: {len(paths)} TTFT, "
            f"{len(ratios)} TPOT pairs of {len(live)}"
        )
    paths.sort()
    stalled = tuple(s for _, s in paths)
    model = ServiceModel(
        path_ms=tuple(p for p, _ in paths),
        stalled=stalled if any(stalled) else (),
        step_ratios=tuple(sorted(ratios)),
        noise_window_ms=max(spans),
        seed=seed,
        source=source,
    )
    return Calibration(model, len(live), len(paths), clamped, len(ratios), dropped, sum(stalled))


def calibrate_service_fixed_point(
    live: Sequence[RequestRecord],
    simulate_at: Callable[[float], Sequence[RequestRecord]],
    iterations: int = 3,
    seed: int = 0,
    source: str = "",
) -> tuple[Calibration, list[float]]:
    """`calibrate_service` against a simulation already slowed by the typical ratio, so that what a slowdown
    itself causes in the engine (longer decodes overlap more, so batches and queues grow) is simulated rather
    than also counted in the measured ratios and paths. `simulate_at(m)` returns the calibration requests
    simulated with every decode step scaled by m and no path. Starting from m = 1 (the bare table), each
    round calibrates against `simulate_at(m)` and takes m = the median of the ratios found. Returns the last
    calibration and the ms tried."""
    tried = [1.0]
    cal = calibrate_service(live, simulate_at(1.0), seed, source)
    for _ in range(iterations):
        m = statistics.median(cal.model.step_ratios)
        tried.append(m)
        cal = calibrate_service(live, simulate_at(m), seed, source, base_ratio=m)
    return cal, tried


__all__ = ["Calibration", "ServiceModel", "ServiceSampler", "calibrate_service", "calibrate_service_fixed_point"]

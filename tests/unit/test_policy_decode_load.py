"""Rules 17 and 18 of the goodput estimator (policy/decodeload.py, policy/stream.py): the decode side as the
simulator's groups batch it (every decode of a group in one step, routing by a decode's own slack, nothing
refused) and a prefill group's steady batch, on the measured CPU table and on the data-sheet roofline."""

from __future__ import annotations

import math
from pathlib import Path

from nitsum.policy.costmodel import cost_model
from nitsum.policy.decodeload import DecodeLoad, decode_rate, poisson_cdf, steady_batch
from nitsum.policy.estimate import classes_of, evaluate, summarize
from nitsum.policy.snapshot import ArrivalStats, ClusterSnapshot, GroupView, NodeView, RequestView, group_id_of
from nitsum.policy.stream import prefill_batch
from nitsum.sim.cluster import ClusterConfig
from nitsum.topology import Topology

CPU_TABLE = Path(__file__).resolve().parents[2] / "libs/nitsum/data/costmodel/cpu_tiny_steps.csv"
CPU = ClusterConfig(model="tiny", device_kind="cpu", device_table=CPU_TABLE).cost_model()
H100 = cost_model("llama-3-70b", "h100")
AZURE_CONV = (235, 664, 1117, 1879)  # prompt quartile means of Azure conv (as the policy measures them)


def largest_batch_within(cost, tp: int, tpot_ms: float, ctx: int) -> int:
    """By scanning the table's steps, not through max_decode_batch's search."""
    b = 0
    while cost.step_time_ms(tp, b + 1, b + 1, (b + 1) * ctx) <= tpot_ms:
        b += 1
    return b


def test_decode_capacity_of_decode_groups_on_the_cpu_table_is_what_its_steps_allow():
    for tpot in (25.0, 100.0):
        for ctx in (512, 1117):
            b = largest_batch_within(CPU, 1, tpot, ctx)
            assert b >= 1
            expected = 6 * b / CPU.step_time_ms(1, b, b, b * ctx)
            assert decode_rate(CPU, 1, 6, tpot, ctx) == expected
    # A TP4 group's single decode step on this table (26 ms) misses a 25 ms TPOT: no capacity there at all.
    assert largest_batch_within(CPU, 4, 25.0, 512) == 0 and decode_rate(CPU, 4, 1, 25.0, 512) == 0.0


def test_steady_batch_is_littles_law_and_unbounded_past_what_any_batch_decodes():
    ctx = 1117
    d = 0.15  # tokens per ms on one TP1 group
    batch = steady_batch(CPU, 1, d, ctx)
    lo = int(batch)
    s_lo, s_hi = (CPU.step_time_ms(1, b, b, b * ctx) for b in (lo, lo + 1))
    assert math.isclose(batch, d * (s_lo + (batch - lo) * (s_hi - s_lo)), rel_tol=1e-3)
    # More than the group decodes at its largest batch (throughput b / S(b) levels off near 0.25 tokens/ms):
    assert max(b / CPU.step_time_ms(1, b, b, b * ctx) for b in (1, 8, 64, 512)) < 0.3
    assert steady_batch(CPU, 1, 0.3, ctx) == math.inf


def test_poisson_cdf():
    assert poisson_cdf(0, 2.0) == math.exp(-2.0)
    assert math.isclose(poisson_cdf(3, 2.0), math.exp(-2.0) * (1 + 2 + 2 + 4 / 3))
    exact = sum(math.exp(-150.0 + k * math.log(150.0) - math.lgamma(k + 1)) for k in range(161))
    assert abs(poisson_cdf(160, 150.0) - exact) < 0.01  # the normal approximation above a mean of 100
    assert poisson_cdf(5, math.inf) == 0.0 and poisson_cdf(-1, 1.0) == 0.0


def test_background_beside_interactive_decodes_slows_them_and_is_not_refused():
    # Six TP1 decode groups. Interactive alone: ~0.12 tokens/ms, well within their 25 ms batches.
    inter_ctx, bg_ctx = 512, 1117
    alone = DecodeLoad(CPU, [1], [6], [0])
    alone.place([0], 0.12, 25.0, inter_ctx)
    assert alone.met_fraction(0, 25.0) > 0.9
    # Background that fits the groups at its own 100 ms TPOT but not at 25 ms: routing checks the background
    # decode's own slack, so it joins the interactive decodes' groups, and their steps pass 25 ms.
    bg = 1.0
    assert decode_rate(CPU, 1, 6, 25.0, bg_ctx) < bg < decode_rate(CPU, 1, 6, 100.0, bg_ctx)
    both = DecodeLoad(CPU, [1], [6], [0])
    both.place([0], 0.12, 25.0, inter_ctx)
    parts = both.place([0], bg, 100.0, bg_ctx)
    assert sum(t for _, t in parts) == bg  # nothing refused
    assert both.met_fraction(0, 25.0) < 0.1 < 0.9 < both.met_fraction(0, 100.0)
    # More background than the groups decode within 100 ms: it still joins (overflow), and both tiers miss.
    over = DecodeLoad(CPU, [1], [6], [0])
    over.place([0], 0.12, 25.0, inter_ctx)
    over.place([0], 2.0, 100.0, bg_ctx)
    assert over.load[0] == 2.12 and over.met_fraction(0, 100.0) < 0.1


def test_a_prefill_group_batches_its_arrivals_into_a_runaway_on_the_cpu_table_and_not_on_a_roofline():
    # 4.35 prompts/s of 900 tokens on a TP1 group: one prompt alone takes 185 ms (81 % busy), but two take
    # 657 ms, so once two wait the batch grows to what 8,192 tokens hold (9 prompts), as the simulator's does.
    cpu = prefill_batch(CPU, 1, 4.35e-3, 900, 8192)
    assert cpu.k == 8192 // 900 and cpu.busy == 1.0
    assert cpu.service_ms(900) > 1.2 * CPU.prefill_time_ms(1, 900)
    # The same arrivals on a data-sheet H100 TP4 group (1,000-token prompts, 74 ms alone): batches of about
    # one, and a prompt's time is its time alone.
    h100 = prefill_batch(H100, 4, 4.35e-3, 1000, 8192)
    assert 1.0 < h100.k < 1.5
    lam_s = 4.35e-3 * h100.step_ms
    assert math.isclose(h100.k, lam_s + math.exp(-lam_s), rel_tol=0.05)  # the fixed point of the mean batch
    assert math.isclose(h100.service_ms(1000), H100.prefill_time_ms(4, 1000), rel_tol=0.05)
    # No batching (prefill_batch_tokens 0): one prompt per step.
    assert prefill_batch(CPU, 1, 4.35e-3, 900, 0).k == 1.0


def cpu_node(top: str) -> NodeView:
    groups = tuple(
        GroupView(group_id_of("n0", g.start, g.tp), g.devices, g.tp, g.role) for g in Topology.parse(top).groups
    )
    return NodeView("n0", 8, 1, 8, groups, "cpu")


def test_more_prefill_groups_than_the_decode_side_holds_score_below_fewer():
    # The stationary point of `sim tiers` at 10.3 req/s on the measured table (30 % interactive, Azure conv):
    # five TP1 prefill groups deliver more background than three decode groups decode within 100 ms; two
    # prefill groups batch it into fewer prompts per s, which six decode groups hold. (The simulator: 8.3
    # weighted req/s for 2 + 6, 2.0 for 5 + 3.)
    arrivals = (
        ArrivalStats("interactive", 3.1, 200.0, 25.0, 10.0, AZURE_CONV, 240.0),
        ArrivalStats("background", 7.2, 10_000.0, 100.0, 1.0, AZURE_CONV, 220.0),
    )

    def score(top: str) -> float:
        t = Topology.parse(top)
        snap = ClusterSnapshot(0.0, (cpu_node(top),), (), arrivals=arrivals)
        load = summarize(snap, snap.nodes[0], 1000.0)
        return evaluate(CPU, classes_of(t.groups), load, 5000.0, 512, 8192, (1, 2, 4, 8)).score

    two = score("[0 TP1 prefill][1 TP1 prefill]" + "".join(f"[{k} TP1 decode]" for k in range(2, 8)))
    five = score("".join(f"[{k} TP1 prefill]" for k in range(5)) + "".join(f"[{k} TP1 decode]" for k in range(5, 8)))
    assert two > five


def test_the_stream_keeps_a_hybrid_groups_prefill_pending_whether_or_not_a_prompt_is_queued_now():
    # Rule 21: at 10.3 req/s a TP1 hybrid group prefills most of the time, so its decode steps carry the minimum
    # chunk beside them (the simulator's hybrid step). Before, the stream's decodes were priced without it
    # unless a prompt happened to be queued at that instant: one queued prompt took a third off the stream's
    # score, and the interactive decodes looked to meet 25 ms on TP1 hybrid groups 64 % of the time (the
    # simulator's static TP1x8 run: 5 % of its finished interactive requests).
    arrivals = (
        ArrivalStats("interactive", 3.1, 200.0, 25.0, 10.0, AZURE_CONV, 240.0),
        ArrivalStats("background", 7.2, 10_000.0, 100.0, 1.0, AZURE_CONV, 220.0),
    )
    top = "".join(f"[{k} TP1 hybrid]" for k in range(8))

    def stream(requests, streams=arrivals) -> float:
        snap = ClusterSnapshot(0.0, (cpu_node(top),), requests, arrivals=streams)
        load = summarize(snap, snap.nodes[0], 1000.0)
        return evaluate(CPU, classes_of(Topology.parse(top).groups), load, 5000.0, 512, 8192, (1, 2, 4, 8)).stream

    queued = RequestView("q", "background", 10_000.0, 100.0, 1.0, 0.0, 600, 200)
    idle, one = stream(()), stream((queued,))
    # (one queued prompt still takes its slot and prefill time from the stream: close, not equal)
    assert abs(idle - one) < 0.05 * idle
    # The interactive stream, whose decodes cannot meet 25 ms beside the background's on these groups, adds
    # less than its prefill takes from the background (on main it added a fifth to the score).
    assert stream(()) < stream((), arrivals[1:])

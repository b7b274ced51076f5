"""The stream-visible pause of `nitsum bench reconfigure`: pure arithmetic on token arrival times."""

import pytest

from nitsum_load.reconfigure_core import transition_gaps


def _stream(start: float, step: float, n: int) -> list[float]:
    return [start + i * step for i in range(n)]


def test_pause_is_measured_against_the_longer_of_the_old_and_new_steps() -> None:
    # 10 ms steps until 100, a 70 ms gap across the change (window 95..120), then 30 ms steps.
    before = _stream(0.0, 10.0, 11)  # 0..100
    after = _stream(170.0, 30.0, 10)  # 170..440
    steady, [gap] = transition_gaps([before + after], [(95.0, 120.0)])
    assert gap.max_gap_ms == pytest.approx(70.0)
    assert gap.steady_ms == pytest.approx(10.0)
    assert gap.steady_after_ms == pytest.approx(30.0)
    assert gap.reference_ms == pytest.approx(30.0)
    assert gap.pause_ms == pytest.approx(40.0)
    assert gap.pause_steps == pytest.approx(40.0 / 30.0)
    assert gap.pause_before_ms == pytest.approx(60.0)
    assert steady == pytest.approx(10.0)


def test_a_merge_to_a_faster_group_keeps_the_old_step_as_reference() -> None:
    before = _stream(0.0, 40.0, 6)  # 0..200
    after = _stream(300.0, 20.0, 10)
    _, [gap] = transition_gaps([before + after], [(210.0, 250.0)])
    assert gap.reference_ms == pytest.approx(40.0)
    assert gap.pause_ms == pytest.approx(60.0)  # 100 ms gap - one 40 ms step


def test_windows_take_their_own_stretches() -> None:
    times = _stream(0.0, 10.0, 11) + _stream(150.0, 20.0, 11) + _stream(420.0, 5.0, 11)  # gaps 50 and 70
    _, gaps = transition_gaps([times], [(101.0, 120.0), (345.0, 380.0)])
    assert [g.max_gap_ms for g in gaps] == pytest.approx([50.0, 70.0])
    assert gaps[0].steady_after_ms == pytest.approx(20.0)  # stretch 120..345
    assert gaps[1].steady_ms == pytest.approx(20.0)  # stretch 120..345 again, as the 'before' of the next
    assert gaps[1].steady_after_ms == pytest.approx(5.0)
    assert [g.pause_ms for g in gaps] == pytest.approx([30.0, 50.0])


def test_no_tokens_means_no_figure() -> None:
    _, [gap] = transition_gaps([[]], [(0.0, 1.0)])
    assert gap.max_gap_ms is None and gap.pause_ms is None and gap.pause_steps is None


def test_every_chain_runs_from_the_boot_shape_back_to_it_through_matching_steps():
    from nitsum_load.reconfigure_core import BOOT_SHAPES, CHAINS, SHAPE_NAMES, restart_ms

    for devices, chain in CHAINS.items():
        boot = BOOT_SHAPES[devices]
        assert chain[0][1] == boot and chain[-1][2] == boot
        assert all(a[2] == b[1] for a, b in zip(chain, chain[1:]))  # each change starts where the last ended
        assert {k for k, _, _ in chain} == {"merge", "split"}
        assert all(SHAPE_NAMES[s].count("x") <= 1 for _, s, _ in chain)
        # Back at the boot shape the restart is stop + boot; elsewhere it adds that shape's set-topology.
        others = {dst for _, _, dst in chain if dst != boot}
        to_target = {dst: 50.0 for dst in others}
        assert restart_ms(1000.0, 3000.0, to_target, boot) == 4000.0
        assert all(restart_ms(1000.0, 3000.0, to_target, dst) == 4050.0 for dst in others)

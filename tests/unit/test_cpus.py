"""CPU lists (NITSUM_CPUS), pinning a process, and `nitsum up --cpu-affinity auto`'s placement."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from nitsum.config import ConfigError, WorkerConfig, load
from nitsum.cpus import allowed_cpus, cpu_list_error, format_cpu_list, parse_cpu_list, plan_placement
from nitsum.up import cpu_placement, parse_args


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", ()), ("1", (1,)), ("0-3", (0, 1, 2, 3)), ("2,0-1,2", (0, 1, 2)), (" 5 , 7-8 ", (5, 7, 8))],
)
def test_parse_cpu_list(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert cpu_list_error(text) is None


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("a", "'a' is not a CPU number or range"),
        ("1,,2", "has an empty entry"),
        ("3-1", "runs backwards"),
        ("-1", "is not a CPU number or range"),
        ("0-x", "is not a CPU number or range"),
        ("99999", "above 4096"),
    ],
)
def test_bad_cpu_lists_are_refused_with_the_part_named(text, why):
    assert why in cpu_list_error(text)
    with pytest.raises(ValueError, match="CPU"):
        parse_cpu_list(text)


def test_format_cpu_list_is_the_inverse_of_parse():
    assert format_cpu_list((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert format_cpu_list([3]) == "3" and format_cpu_list([]) == ""
    for text in ("0-2,5,7-8", "1", "0,2,4"):
        assert format_cpu_list(parse_cpu_list(text)) == text


def test_a_bad_nitsum_cpus_stops_the_service_config_naming_the_setting():
    with pytest.raises(ConfigError, match="NITSUM_CPUS"):
        load(WorkerConfig, argv=[], environ={"NITSUM_CPUS": "0-"})
    assert load(WorkerConfig, argv=[], environ={"NITSUM_CPUS": "0"}).cpus == "0"


def test_plan_placement_gives_each_worker_a_cpu_of_its_own():
    p = plan_placement((0, 1, 2, 3), 2)
    assert p.workers == ("2", "3") and p.others == "0-1"
    p = plan_placement((4, 9, 2), 1)  # the allowed set need not start at 0 or be contiguous
    assert p.workers == ("9",) and p.others == "2,4"
    assert plan_placement((0, 1), 2) is None  # no CPU left for the rest: not pinned at all
    assert plan_placement((0,), 1) is None
    # a worker of two torch threads gets two CPUs
    p = plan_placement(tuple(range(8)), 3, per_worker=2)
    assert p.workers == ("2-3", "4-5", "6-7") and p.others == "0-1"
    assert plan_placement(tuple(range(6)), 3, per_worker=2) is None


def _args(*argv: str) -> argparse.Namespace:
    return parse_args(["--devices", "1", *argv])


def test_cpu_placement_follows_the_flag_the_environment_and_the_device():
    assert cpu_placement(_args("--cpu-affinity", "off"), {})[0] is None
    placement, line = cpu_placement(_args(), {"NITSUM_CPUS": "0"})
    assert placement is None and "NITSUM_CPUS=0" in line  # the user's placement wins
    placement, line = cpu_placement(_args(), {"NITSUM_TORCH_THREADS": str(len(allowed_cpus()))})
    assert placement is None and "not pinned" in line  # every CPU for the worker's threads: none for the rest
    placement, line = cpu_placement(_args("--device", "cuda"), {})
    assert placement is None and "--device cpu only" in line
    placement, line = cpu_placement(_args(), {})
    if len(allowed_cpus()) < 2:
        assert placement is None and "not pinned" in line
    else:
        assert placement.workers == (str(allowed_cpus()[-1]),)
        assert str(allowed_cpus()[-1]) not in parse_cpu_list(placement.others)
        assert f"workers on CPU {allowed_cpus()[-1]}" in line


def test_cpu_affinity_flag_is_checked():
    with pytest.raises(SystemExit):
        parse_args(["--cpu-affinity", "sometimes"])


PROBE = """
import os, sys, threading
from nitsum.cpus import parse_cpu_list, pin_process
early = threading.Thread(target=threading.Event().wait, daemon=True)  # a thread started before the pin
early.start()
pin_process(parse_cpu_list(sys.argv[1]))
late = threading.Thread(target=threading.Event().wait, daemon=True)
late.start()
masks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
print(len(masks), sorted({tuple(m) for m in masks.values()}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_process_moves_every_thread_and_the_ones_started_later():
    cpu = allowed_cpus()[-1]
    out = subprocess.run([sys.executable, "-c", PROBE, str(cpu)], capture_output=True, text=True, check=True)
    threads, masks = out.stdout.split(" ", 1)
    assert int(threads) >= 3 and masks.strip() == str([(cpu,)])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_cpu_the_process_may_not_use_is_refused_and_changes_nothing():
    before = allowed_cpus()
    from nitsum.cpus import pin_process

    with pytest.raises(ValueError, match="4000 is not among the CPUs"):
        pin_process((before[0], 4000))
    assert allowed_cpus() == before


def test_a_service_with_a_cpu_it_may_not_use_exits_with_a_configuration_error(tmp_path):
    env = {**os.environ, "NITSUM_CPUS": "4000", "NITSUM_RUN_DIR": str(tmp_path), "NITSUM_METRICS_PORT": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "nitsum.cli", "serve", "flow-scheduler"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "configuration error: NITSUM_CPUS='4000'" in out.stderr and "is not among the CPUs" in out.stderr

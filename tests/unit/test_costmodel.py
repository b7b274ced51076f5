"""Cost model (ALGORITHMS.md §3): roofline bounds, monotonicity, capacity, device tables."""

import dataclasses
import json
import subprocess
import sys

import pytest

from nitsum.policy.costmodel import (
    DEVICE_PRESETS,
    DeviceSpec,
    cost_model,
    device_spec,
    load_device_table,
    model_spec,
    resolve_device,
)


def test_llama70b_tp8_h100_decode_step_between_memory_floor_and_twice_it():
    cm = cost_model("llama-3-70b", "h100")
    floor = cm.memory_floor_ms(8, context_tokens=8 * 1024)
    step = cm.decode_step_ms(8, batch_size=8, context_tokens=8 * 1024)
    assert floor < step < 2 * floor
    # Weights alone: 141 GB / 8 ranks / 3.35 TB/s ≈ 5.3 ms.
    assert 5.0 < cm.memory_floor_ms(8) < 5.5


def test_70b_shapes_give_about_70b_parameters():
    assert 70.0e9 < model_spec("llama-3-70b").total_params < 71.0e9
    assert 8.0e9 < model_spec("llama-3-8b").total_params < 8.1e9
    m = model_spec("mixtral-8x22b")
    assert 139e9 < m.total_params < 142e9 and 38e9 < m.active_params < 40e9


@pytest.mark.parametrize("kind", ["h100", "h200", "a100"])
def test_prefill_gets_faster_with_tp_and_decode_batch_costs_more(kind):
    cm = cost_model("llama-3-70b", kind)
    times = [cm.prefill_time_ms(k, 2000) for k in (2, 4, 8)]
    assert times == sorted(times, reverse=True)
    assert cm.decode_step_ms(4, 64, 64 * 1000) > cm.decode_step_ms(4, 1, 1000)


def test_h200_decode_is_faster_than_h100_and_a100_slowest():
    steps = {k: cost_model("llama-3-70b", k).decode_step_ms(8, 1, 1000) for k in ("a100", "h100", "h200")}
    assert steps["h200"] < steps["h100"] < steps["a100"]


def test_kv_capacity_zero_when_weights_do_not_fit():
    cm = cost_model("llama-3-70b", "h100")
    assert cm.kv_capacity_tokens(1) == 0 and not cm.fits(1)
    assert 0 < cm.kv_capacity_tokens(2) < cm.kv_capacity_tokens(4) < cm.kv_capacity_tokens(8)
    assert cm.max_decode_batch(1, 100.0, 1000) == 0


def test_max_decode_batch_is_the_largest_batch_within_tpot():
    cm = cost_model("llama-3-8b", "h100")
    b = cm.max_decode_batch(1, 25.0, 1000)
    assert b > 0
    assert cm.decode_step_ms(1, b, b * 1000) <= 25.0
    assert b == cm.kv_capacity_tokens(1) // 1000 or cm.decode_step_ms(1, b + 1, (b + 1) * 1000) > 25.0


def test_tp1_has_no_all_reduce_and_chunked_prefill_costs_more():
    cm = cost_model("llama-3-8b", "h100")
    assert cm.prefill_time_ms(1, 4096, chunk_tokens=512) > cm.prefill_time_ms(1, 4096)
    assert cm.prefill_time_ms(1, 4096, cached_tokens=4096) == 0.0


def test_reconfig_cost_is_fixed_plus_bytes_over_parallel_links():
    cm = cost_model("llama-3-70b", "h100")
    assert cm.reconfig_cost_ms(0.0) == cm.reconfig_fixed_ms
    one_pair = cm.reconfig_cost_ms(1e9, 2) - cm.reconfig_fixed_ms
    four_pairs = cm.reconfig_cost_ms(1e9, 8) - cm.reconfig_fixed_ms
    assert one_pair == pytest.approx(4 * four_pairs)
    assert one_pair == pytest.approx(1e9 / (450e9 * 0.7) * 1e3)


def test_shipped_cpu_table_loads_and_says_where_it_comes_from():
    # `nitsum bench profile` replaced the placeholder with a measured table (commit 932b85c); either way the
    # table names its source, and a placeholder says so.
    cpu = load_device_table()
    assert cpu.name == "cpu" and cpu.source
    assert ("PLACEHOLDER" in cpu.source) == cpu.placeholder
    assert device_spec("cpu") == cpu
    assert cost_model("tiny", "cpu").decode_step_ms(1, 1, 10) > 0


def test_device_table_json_round_trip_and_errors(tmp_path):
    spec = DEVICE_PRESETS["h100"]
    path = tmp_path / "h100.json"
    path.write_text(spec.to_json())
    assert load_device_table(path) == spec
    data = json.loads(spec.to_json())
    data["measurements"] = [{"tp": 1, "batch_size": 1, "step_ms": 3.0}]  # profile output keeps raw points
    assert DeviceSpec.from_json(json.dumps(data)) == spec
    with pytest.raises(ValueError, match="unknown device table fields: bogus"):
        DeviceSpec.from_json(json.dumps({**json.loads(spec.to_json()), "bogus": 1}))
    with pytest.raises(ValueError, match="schema"):
        DeviceSpec.from_json(json.dumps({"name": "x"}))


@pytest.mark.parametrize("fn, arg", [(device_spec, "tpu"), (model_spec, "gpt-5")])
def test_unknown_presets_name_themselves(fn, arg):
    with pytest.raises(ValueError, match=arg):
        fn(arg)


def test_policy_package_imports_only_the_standard_library():
    mods = [
        "nitsum.policy." + m
        for m in (
            "tiers",
            "snapshot",
            "decisions",
            "costmodel",
            "estimate",
            "phases",
            "topology",
            "routing",
            "admission",
            "baselines",
            "registry",
            "goodput",
            "base",
            "steptable",
        )
    ] + ["nitsum.bench.policy"]  # the decision benchmark times the same stdlib-only objects
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in mods)
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'numpy', 'nats', 'asyncio', 'msgpack'))\nprint(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_tiny_preset_matches_the_tiny_checkpoint_config():
    from nitsum.model.tiny import TINY_CONFIG

    m = model_spec("tiny")
    assert (
        m.num_layers,
        m.hidden_size,
        m.num_heads,
        m.num_kv_heads,
        m.intermediate_size,
        m.vocab_size,
        m.head_dim,
    ) == (
        TINY_CONFIG["num_hidden_layers"],
        TINY_CONFIG["hidden_size"],
        TINY_CONFIG["num_attention_heads"],
        TINY_CONFIG["num_key_value_heads"],
        TINY_CONFIG["intermediate_size"],
        TINY_CONFIG["vocab_size"],
        TINY_CONFIG["head_dim"],
    )
    assert m.bytes_per_param == 4.0 and TINY_CONFIG["torch_dtype"] == "float32"


def test_per_sequence_and_prefill_step_overheads():
    base = DeviceSpec("t", 1e30, 1e30, 1.0, 1e12, step_overhead_ms=0.5)
    dev = dataclasses.replace(base, seq_overhead_ms=0.25, prefill_step_overhead_ms=2.0)
    m, b = cost_model("tiny", dev), cost_model("tiny", base)
    assert m.step_time_ms(1, 4, 4, 400) == pytest.approx(b.step_time_ms(1, 4, 4, 400) + 4 * 0.25)  # decode
    assert m.step_time_ms(1, 2, 300, 300) == pytest.approx(b.step_time_ms(1, 2, 300, 300) + 2 * 0.25 + 2.0)  # prefill
    assert DeviceSpec.from_json(dev.to_json()) == dev


def test_resolve_device_forms(tmp_path):
    table = DeviceSpec("measured", 1e12, 1e11, 1.0, 1e9)
    path = tmp_path / "t.json"
    path.write_text(table.to_json())
    assert resolve_device("h100") is DEVICE_PRESETS["h100"]
    assert resolve_device(table) is table and resolve_device(cost_model("tiny", table)) is table
    assert resolve_device(path) == table and resolve_device(str(path)) == table
    with pytest.raises(ValueError, match="no such file"):
        resolve_device(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="unknown device kind 'tpu'"):
        resolve_device("tpu")

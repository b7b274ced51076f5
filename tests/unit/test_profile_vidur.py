"""`nitsum bench profile --from-vidur`: a step table from Vidur's published GPU profiles.

Checked on profiles written here in Vidur's own column layout (so every expected figure is worked out by
hand), on the committed excerpt of Vidur's H100 profile (the committed table is what the converter makes
of it, and the simulator reads it), and through the CLI."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from nitsum.bench.profile import main
from nitsum.bench.profile_vidur import (
    LAYER_OPS,
    VidurProfileError,
    attention_ms,
    lm_head_ms,
    read_all_reduce_profile,
    read_mlp_profile,
    vidur_rows,
)
from nitsum.policy.costmodel import DeviceSpec, ModelSpec, model_spec
from nitsum.policy.steptable import load_step_rows, select, write_rows
from nitsum.sim.experiments.common import table_target

DATA = Path(__file__).resolve().parents[2] / "libs" / "nitsum" / "data" / "costmodel"
EXCERPT_MLP = DATA / "vidur" / "h100_llama-2-70b_mlp.csv"
EXCERPT_AR = DATA / "vidur" / "h100_dgx_all_reduce.csv"
COMMITTED = DATA / "h100_llama-3-70b_vidur_steps.csv"

SMALL = ModelSpec(
    "small", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=100
)
# So fast that attention and the LM head (the roofline parts) are far below the measured parts' precision.
INSTANT = DeviceSpec("instant", 1e30, 1e30, 1e12, 1e12, step_overhead_ms=0.5)

OPS = [f"time_stats.{op}.median" for op in LAYER_OPS]
MLP_HEADER = ["time_stats.emb.median", *OPS, "n_head", "n_kv_head", "n_embd", "n_expanded_embd", "num_tokens",
              "num_tensor_parallel_workers"]  # fmt: skip


def mlp_csv(points, shape=(4, 2, 64, 256)) -> str:
    """points: (tp, num_tokens, emb ms, per-op ms) -> Vidur's mlp.csv columns (each op that time)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(MLP_HEADER)
    for tp, n, emb, op in points:
        w.writerow([emb, *([op] * len(OPS)), *shape, n, tp])
    return out.getvalue()


def ar_csv(points) -> str:
    """points: (workers, bytes, ms[, devices per node]) -> Vidur's all_reduce.csv columns, rank 0."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["", "time_stats.all_reduce.median", "rank", "num_workers", "size", "collective", "devices_per_node"])
    for i, p in enumerate(points):
        workers, size, ms = p[:3]
        w.writerow([i, ms, 0, workers, size, "all_reduce", p[3] if len(p) > 3 else workers])
    return out.getvalue()


MLP = mlp_csv(
    [
        (1, 1, 0.01, 0.1),
        (1, 8, 0.02, 0.2),
        (1, 64, 0.05, 0.9),
        (2, 1, 0.01, 0.06),
        (2, 8, 0.02, 0.11),
        (2, 64, 0.04, 0.5),
    ]  # fmt: skip
)
# A TP2 group's all-reduce at 1 token = 64 x 2 bytes = 128 B, at 8 tokens 1 KiB, at 64 tokens 8 KiB.
AR = ar_csv([(2, 128, 0.03), (2, 1024, 0.04), (2, 8192, 0.12), (4, 128, 5.0, 8)])


def row(rows, tp, phase, batch, tokens):
    (hit,) = [r for r in rows if (r.tp, r.phase, r.batch_size, r.tokens) == (tp, phase, batch, tokens)]
    return hit.ms


def test_a_step_is_the_layers_measured_operators_and_all_reduces_plus_the_embedding_and_overhead():
    rows = vidur_rows(MLP, AR, SMALL, INSTANT, "gpu")
    ops = len(LAYER_OPS)
    # TP1 decode of 8 sequences: 8 tokens; 2 layers x 9 operators x 0.2 ms + embedding 0.02 + overhead 0.5.
    assert row(rows, 1, "decode", 8, 512) == pytest.approx(2 * ops * 0.2 + 0.02 + 0.5, abs=1e-3)
    # TP2 prefill of 2 x 32 tokens = 64: 2 x (9 x 0.5 + 2 all-reduces of 8 KiB at 0.12) + 0.04 + 0.5.
    assert row(rows, 2, "prefill", 2, 32) == pytest.approx(2 * (ops * 0.5 + 2 * 0.12) + 0.04 + 0.5, abs=1e-3)
    # Between measured token counts: linear (TP1, 4 tokens: 4/7 of the way from 1 to 8 tokens).
    f = 3 / 7
    assert row(rows, 1, "decode", 4, 128) == pytest.approx(
        2 * ops * (0.1 + f * 0.1) + (0.01 + f * 0.01) + 0.5, abs=1e-3
    )
    # Outside the profile (a decode of 128 sequences is 128 tokens; the profile stops at 64): not written.
    assert not [r for r in rows if r.phase == "decode" and r.batch_size > 64]
    assert not [r for r in rows if r.phase == "prefill" and r.batch_size * r.prompt_tokens > 64]
    # TP4 has an all-reduce row only across nodes (devices_per_node 8 for 4 workers) and no operator rows.
    assert {r.tp for r in rows} == {1, 2}


def test_the_roofline_parts_are_the_attention_kernel_and_the_lm_head():
    m = model_spec("llama-3-70b")
    h100 = DeviceSpec("h100", 989e12, 3.35e12, 450e9, 80e9)
    # Decode, TP8, 64 sequences of 2048 tokens: KV read = 64 x 2048 x 327,680 B / 8 ranks at 0.8 x 3.35 TB/s.
    kv = 64 * 2048 * m.kv_bytes_per_token / 8
    assert m.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert attention_ms(m, h100, 8, "decode", 64, 2048) == pytest.approx(kv / (0.8 * 3.35e12) * 1e3)
    # Prefill, TP4, one 4096-token prompt: causal pairs 4096 x 4097 / 2, 4 x layers x hidden FLOPs each, per rank.
    flops = 4 * 80 * 8192 * 4096 * 4097 / 2 / 4
    assert attention_ms(m, h100, 4, "prefill", 1, 4096) == pytest.approx(flops / (0.6 * 989e12) * 1e3)
    # LM head at decode: its weights read once per rank.
    assert lm_head_ms(m, h100, 8, 1) == pytest.approx(128256 * 8192 * 2 / 8 / (0.8 * 3.35e12) * 1e3)


def test_repeated_points_are_averaged_and_cross_node_all_reduces_left_out():
    layer, embed = read_mlp_profile(mlp_csv([(1, 8, 0.02, 0.2), (1, 8, 0.04, 0.4)]), SMALL)
    assert layer == {1: [(8, pytest.approx(len(LAYER_OPS) * 0.3))]} and embed == {1: [(8, pytest.approx(0.03))]}
    reduce = read_all_reduce_profile(ar_csv([(2, 128, 0.03), (2, 128, 0.05), (4, 128, 9.0, 8)]))
    assert reduce == {2: [(128, pytest.approx(0.04))]}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            mlp_csv([(1, 8, 0.02, 0.2)], shape=(4, 2, 128, 256)),
            "line 2, column 'n_embd': profiled at 128, model small has 64",
        ),
        (mlp_csv([(1, 8, 0.02, 0.2)], shape=(4, 4, 64, 256)), "line 2, column 'n_kv_head'"),
        (MLP.replace("0.9", "fast", 1), "line 4, column 'time_stats.input_layernorm.median': 'fast' is not a number"),
        (MLP.replace(",64,1\n", ",64,3\n", 1), "line 4: tp 3 must be a power of two"),
        (
            "num_tokens,num_tensor_parallel_workers\n1,1\n",
            "line 1 (header): missing column(s) time_stats.input_layernorm",
        ),
        (",".join(MLP_HEADER) + "\n", "no rows after the header"),
    ],
)
def test_a_bad_mlp_profile_is_refused_naming_line_and_column(text, message):
    with pytest.raises(VidurProfileError, match="mlp.csv: ") as err:
        vidur_rows(text, AR, SMALL, INSTANT, "gpu")
    assert message in str(err.value)


def test_a_bad_all_reduce_profile_is_refused():
    with pytest.raises(VidurProfileError, match=r"all_reduce.csv: line 1 \(header\): missing column\(s\) size"):
        vidur_rows(MLP, "time_stats.all_reduce.median,rank,num_workers,devices_per_node\n", SMALL, INSTANT, "gpu")
    with pytest.raises(VidurProfileError, match="line 2, column 'time_stats.all_reduce.median': -1.0 must be"):
        vidur_rows(MLP, ar_csv([(2, 128, -1.0)]), SMALL, INSTANT, "gpu")
    with pytest.raises(VidurProfileError, match="no rank-0 all-reduce rows within one node"):
        vidur_rows(MLP, ar_csv([(4, 128, 5.0, 8)]), SMALL, INSTANT, "gpu")


def test_the_committed_table_is_what_the_converter_makes_of_the_committed_excerpt_and_the_simulator_reads_it():
    m = model_spec("llama-3-70b")
    from nitsum.policy.costmodel import device_spec

    made = vidur_rows(EXCERPT_MLP.read_text(), EXCERPT_AR.read_text(), m, device_spec("h100"), "h100")
    committed = load_step_rows(COMMITTED)
    assert write_rows(made) == COMMITTED.read_text()  # as the CLI writes it
    assert {r.tp for r in committed} == {1, 2, 4, 8}
    model, device, rows = table_target(COMMITTED, "llama-3-70b", "h100")
    assert (model, device, rows) == ("llama-3-70b", "h100", committed)
    table = select(committed, "h100", m)
    # The simulator's and the policy's price at a written point is the row.
    assert table.step_ms(8, 1, 1, 1024) == row(committed, 8, "decode", 1, 1024)
    # What a data-sheet roofline does not say: TP8 decode is far from twice as fast as TP4.
    assert row(committed, 4, "decode", 32, 1024) / row(committed, 8, "decode", 32, 1024) < 1.6


def test_the_cli_writes_the_table_and_refuses_what_it_cannot_read(tmp_path, capsys):
    mlp, ar = tmp_path / "mlp.csv", tmp_path / "all_reduce.csv"
    mlp.write_text(MLP.replace(",4,2,64,256,", ",64,8,8192,28672,"))  # the 70B shapes
    ar.write_text(ar_csv([(2, 16384, 0.03), (2, 131072, 0.04), (2, 1048576, 0.12)]))  # 1, 8, 64 tokens of 8192
    out = tmp_path / "steps.csv"
    assert main(["--from-vidur", str(mlp), "--all-reduce", str(ar), "--csv", str(out)]) == 0
    rows = load_step_rows(out)
    assert {(r.device, r.model) for r in rows} == {("h100", "llama-3-70b")} and {r.tp for r in rows} == {1, 2}
    assert "wrote" in capsys.readouterr().out
    # Another model's shapes: exit 2, the line named, nothing written.
    other = tmp_path / "other.csv"
    assert main(["--from-vidur", str(mlp), "--all-reduce", str(ar), "--csv", str(other), "--preset", "llama-3-8b"]) == 2
    assert "line 2, column 'n_embd': profiled at 8192, model llama-3-8b has 4096" in capsys.readouterr().err
    assert not other.exists()
    assert main(["--from-vidur", str(tmp_path / "none.csv"), "--all-reduce", str(ar), "--csv", str(other)]) == 2
    assert "none.csv: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--from-vidur", str(mlp), "--csv", str(other)])
    assert exit_.value.code == 2 and "--from-vidur needs --all-reduce FILE and --csv FILE" in capsys.readouterr().err


def test_a_table_made_for_a_checkpoint_directory_is_the_one_the_coordinator_reads_for_it(tmp_path, capsys):
    """`--model DIR`: the checkpoint's shapes, its rows named by the directory, as the coordinator names the served
    model; NITSUM_DEVICE_TABLE then prices that model from them (on the GPU kind, bf16)."""
    import json

    from nitsum.config import CoordinatorConfig
    from nitsum_services.coordinator.core import policy_config

    ckpt = tmp_path / "Meta-Llama-3-70B-Instruct"
    ckpt.mkdir()
    shapes = {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
              "intermediate_size": 28672, "vocab_size": 128256, "model_type": "llama"}  # fmt: skip
    (ckpt / "config.json").write_text(json.dumps(shapes))
    out = tmp_path / "steps.csv"
    assert (
        main(
            ["--from-vidur", str(EXCERPT_MLP), "--all-reduce", str(EXCERPT_AR), "--csv", str(out), "--model", str(ckpt)]
        )
        == 0
    )
    rows = load_step_rows(out)
    assert {r.model for r in rows} == {"Meta-Llama-3-70B-Instruct"}
    # The same shapes as the preset: the same times as the committed table.
    assert [r.ms for r in rows] == [r.ms for r in load_step_rows(COMMITTED)]
    config = policy_config(CoordinatorConfig(model=str(ckpt), device_kind="h100", device_table=str(out)))
    ((kind, table),) = config.step_tables
    r = next(r for r in rows if r.tp == 4 and r.phase == "decode")
    assert kind == "h100" and table.step_ms(4, r.batch_size, r.batch_size, r.batch_size * r.context_tokens) == r.ms
    # A config.json without a field the cost model needs: exit 2, the field named.
    del shapes["intermediate_size"]
    (ckpt / "config.json").write_text(json.dumps(shapes))
    assert (
        main(
            ["--from-vidur", str(EXCERPT_MLP), "--all-reduce", str(EXCERPT_AR), "--csv", str(out), "--model", str(ckpt)]
        )
        == 2
    )
    assert "no field 'intermediate_size'" in capsys.readouterr().err

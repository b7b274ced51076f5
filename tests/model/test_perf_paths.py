"""The runner's fast paths (fused projections, grouped decode attention with reused gather buffers,
batched equal-length prefills) against transformers and against the unfused model."""

import pytest
import torch

from nitsum.engine.plan import ChunkPlan, StepPlan
from nitsum.engine.runner import ModelRunner
from nitsum.model import layers, loader
from nitsum.model.model import fused_view
from nitsum.parallel import TPGroup

BLOCK = 16


def tokens(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=gen).tolist()


def table(first_block: int, num_blocks: int = 4) -> tuple[int, ...]:
    return tuple(range(first_block, first_block + num_blocks))


@pytest.fixture(scope="module")
def runner(tiny_dir):
    return ModelRunner(str(tiny_dir), TPGroup.single("cpu"), num_kv_blocks=64)


def test_fused_view_only_over_adjacent_tensors():
    buffer = torch.arange(12.0)
    a, b = buffer[:4].view(2, 2), buffer[4:8].view(2, 2)
    fused = fused_view([a, b])
    assert fused.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    assert fused.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, no copy
    assert fused_view([b, a]) is None  # wrong order
    assert fused_view([a, buffer[8:12].view(2, 2)]) is None  # a gap
    assert fused_view([a, b.clone()]) is None  # another storage
    assert fused_view([a, None]) is None


def test_standalone_tp1_runner_fuses_every_layer_on_views_of_its_weights(runner, tiny_dir):
    checkpoint = loader.load_weights(tiny_dir, torch.float32)
    for index, layer in enumerate(runner.model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv_weight is not None and mlp.gate_up_weight is not None
        assert attn.qkv_weight.data_ptr() == attn.q_proj.weight.data_ptr()
        assert mlp.gate_up_weight.data_ptr() == mlp.gate_proj.weight.data_ptr()
        prefix = f"model.layers.{index}."
        assert torch.equal(attn.v_proj.weight, checkpoint[prefix + "self_attn.v_proj.weight"])
        assert torch.equal(mlp.up_proj.weight, checkpoint[prefix + "mlp.up_proj.weight"])
        assert torch.equal(runner.weights[prefix + "mlp.up_proj.weight"], checkpoint[prefix + "mlp.up_proj.weight"])


def test_runner_on_separate_weight_tensors_does_not_fuse(tiny_dir):
    cfg = loader.load_config(tiny_dir)
    weights = loader.load_weights(tiny_dir, torch.float32)  # one tensor per weight: not adjacent
    unfused = ModelRunner(str(tiny_dir), TPGroup.single("cpu"), num_kv_blocks=8, weights=weights, config=cfg)
    assert all(
        layer.self_attn.qkv_weight is None and layer.mlp.gate_up_weight is None for layer in unfused.model.model.layers
    )


def two_step_plans():
    """Step 1 prefills a, b (different lengths) and the first 16 tokens of e. Step 2, in mixed order:
    fresh prompts c, d of equal length (one batched call), decodes of a and b (different contexts: the
    masked path), and e's next 10 tokens over its cached prefix."""
    seqs = {"a": tokens(1, 21), "b": tokens(2, 38), "c": tokens(3, 12), "d": tokens(4, 12), "e": tokens(5, 26)}
    blocks = {name: table(1 + 4 * i) for i, name in enumerate(seqs)}
    step1 = StepPlan(
        "step",
        1,
        (
            ChunkPlan(tuple(seqs["a"][:20]), 0, blocks["a"], True),
            ChunkPlan(tuple(seqs["b"][:37]), 0, blocks["b"], True),
            ChunkPlan(tuple(seqs["e"][:16]), 0, blocks["e"], False),
        ),
    )
    order = ["c", "a", "e", "d", "b"]
    step2 = StepPlan(
        "step",
        2,
        (
            ChunkPlan(tuple(seqs["c"]), 0, blocks["c"], True),
            ChunkPlan((seqs["a"][20],), 20, blocks["a"], True),
            ChunkPlan(tuple(seqs["e"][16:]), 16, blocks["e"], True),
            ChunkPlan(tuple(seqs["d"]), 0, blocks["d"], True),
            ChunkPlan((seqs["b"][37],), 37, blocks["b"], True),
        ),
    )
    return seqs, order, step1, step2


@pytest.fixture(params=["onednn-everywhere", "torch"])
def linear_backend(request, monkeypatch):
    """Every matmul through oneDNN (threshold 0), or every matmul through F.linear."""
    if request.param == "torch":
        monkeypatch.setattr(layers, "_linear_backend", "torch")
    else:
        if layers._ONEDNN_LINEAR is None:
            pytest.skip("this torch build has no oneDNN linear")
        monkeypatch.setattr(layers, "ONEDNN_MIN_MACS", 0)
    return request.param


def test_onednn_linear_agrees_with_f_linear(monkeypatch):
    if layers._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear")
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=gen) for shape in ((33, 96), (200, 96), (200,)))
    monkeypatch.setattr(layers, "ONEDNN_MIN_MACS", 0)
    assert torch.allclose(layers.linear(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="linear backend"):
        layers.set_linear_backend("mkl")


def test_mixed_step_logits_match_transformers(tiny_dir, hf_model, linear_backend):
    runner = ModelRunner(str(tiny_dir), TPGroup.single("cpu"), num_kv_blocks=64)
    seqs, order, step1, step2 = two_step_plans()
    first = runner.execute(step1)
    logits = runner.execute(step2)
    assert first.shape[0] == 2 and logits.shape[0] == len(order)
    with torch.no_grad():
        for row, name in enumerate(order):
            expected = hf_model(torch.tensor([seqs[name]])).logits[0, -1]
            assert (logits[row] - expected).abs().max().item() <= 1e-4, name
        for row, (name, length) in enumerate((("a", 20), ("b", 37))):
            expected = hf_model(torch.tensor([seqs[name][:length]])).logits[0, -1]
            assert (first[row] - expected).abs().max().item() <= 1e-4, name


def test_decode_batch_equals_each_sequence_alone(runner):
    """Equal and unequal context lengths in one decode batch give each row what it gets alone (up to
    matmul rounding, which depends on the batch size: the parity tolerance)."""
    seqs = [tokens(10 + i, n) for i, n in enumerate((30, 30, 7, 45))]
    tables = [table(1 + 4 * i) for i in range(len(seqs))]
    runner.execute(StepPlan("step", 1, tuple(ChunkPlan(tuple(s[:-1]), 0, t, False) for s, t in zip(seqs, tables))))
    decodes = [ChunkPlan((s[-1],), len(s) - 1, t, True) for s, t in zip(seqs, tables)]
    together = runner.execute(StepPlan("step", 2, tuple(decodes)))
    equal_pair = runner.execute(StepPlan("step", 3, tuple(decodes[:2])))  # equal contexts: no mask
    for row, chunk in enumerate(decodes):
        alone = runner.execute(StepPlan("step", 4, (chunk,)))[0]
        assert torch.allclose(together[row], alone, atol=1e-4, rtol=0)
    assert torch.allclose(equal_pair, together[:2], atol=1e-4, rtol=0)


def test_decode_groups_split_only_when_padding_costs_more_than_a_call(monkeypatch):
    from nitsum.engine import runner as runner_module

    monkeypatch.setattr(runner_module, "GROUP_COST_BLOCK_ROWS", 32)
    assert runner_module.decode_groups([3] * 32) == [(0, 32)]  # equal contexts: one call
    assert runner_module.decode_groups([1, 1, 2, 2]) == [(0, 4)]  # padding (2 block-rows) < a call
    # Half the rows at 1 block, half at 40: one call pads 16 x 39 block-rows, far more than a call.
    assert runner_module.decode_groups([1] * 16 + [40] * 16) == [(0, 16), (16, 32)]
    spread = runner_module.decode_groups(list(range(1, 65)))
    assert len(spread) == runner_module.MAX_DECODE_GROUPS
    assert [end - start for start, end in spread] == [16] * 4 and spread[-1][1] == 64


def test_decode_rows_in_several_groups_equal_each_sequence_alone(tiny_dir, monkeypatch):
    """Decode rows of very different contexts, given in an order that is not their context order, split
    into several attention calls (each group padded to its own longest context): each row's logits are
    those it gets alone."""
    from nitsum.engine import runner as runner_module

    monkeypatch.setattr(runner_module, "GROUP_COST_BLOCK_ROWS", 0)  # split whenever it saves padding
    local = ModelRunner(str(tiny_dir), TPGroup.single("cpu"), num_kv_blocks=64)
    lengths = (70, 5, 33, 18, 61, 9)
    seqs = [tokens(40 + i, n) for i, n in enumerate(lengths)]
    tables = [table(1 + 6 * i, 6) for i in range(len(seqs))]
    local.execute(StepPlan("step", 1, tuple(ChunkPlan(tuple(s[:-1]), 0, t, False) for s, t in zip(seqs, tables))))
    decodes = [ChunkPlan((s[-1],), len(s) - 1, t, True) for s, t in zip(seqs, tables)]
    blocks = sorted(-(-n // BLOCK) for n in lengths)
    assert len(runner_module.decode_groups(blocks)) > 1  # the step below really splits
    together = local.execute(StepPlan("step", 2, tuple(decodes)))
    for row, chunk in enumerate(decodes):
        alone = local.execute(StepPlan("step", 3, (chunk,)))[0]
        assert torch.allclose(together[row], alone, atol=1e-4, rtol=0), row


def test_prepared_rope_equals_reference_rope(tiny_dir):
    from nitsum.model.model import apply_rope, apply_rope_prepared, rope_step_tables, rope_tables

    cfg = loader.load_config(tiny_dir)
    cos, sin = rope_tables(cfg, 64, torch.float32, "cpu")
    positions = torch.tensor([0, 1, 17, 63])
    x = torch.randn(4, 3, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    expected = apply_rope(x, cos[positions], sin[positions])
    got = apply_rope_prepared(x, *rope_step_tables(cos[positions], sin[positions]))
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(got, x, atol=1e-3)  # it rotates (position 0 alone would not)


def test_workspace_reuses_its_buffers_until_a_larger_one_is_needed():
    from nitsum.model.model import Workspace

    space = Workspace()
    like = torch.zeros(1)
    k1, v1 = space.buffers(100, like)
    k2, v2 = space.buffers(60, like)
    assert (k2.numel(), v2.numel()) == (60, 60)
    assert k2.data_ptr() == k1.data_ptr() and v2.data_ptr() == v1.data_ptr()  # reused, no new allocation
    assert k1.data_ptr() != v1.data_ptr()
    k3, _ = space.buffers(101, like)
    assert k3.numel() == 101 and k3.data_ptr() != k1.data_ptr()
    k4, _ = space.buffers(10, torch.zeros(1, dtype=torch.float64))
    assert k4.dtype == torch.float64


def test_engine_bench_quick_runs_and_outputs_agree(capsys):
    from nitsum.bench import engine as bench

    assert (
        bench.main(["--quick", "--workload", "equal", "--max-tokens", "3", "--concurrency", "1,2", "--repeat", "2"])
        == 0
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny |")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "2"]
    # Greedy outputs equal to transformers' in every run (2 runs of c requests), batched and serial.
    assert [row.split("|")[-2].strip() for row in rows] == ["2/2 / 2", "4/4 / 4"]


def test_trace_lengths_are_seeded_scaled_draws_of_the_trace():
    from nitsum.bench import engine_trace as bench_trace
    from nitsum.workloads import default_trace_path, read_azure

    rows = {
        (r.prompt_tokens, r.output_tokens) for r in read_azure(default_trace_path("azure-conv", prefer_excerpt=True))
    }
    lengths = bench_trace.trace_lengths("azure-conv", 50, 1.0, 100_000, seed=4)
    assert set(lengths) <= rows and len(set(lengths)) > 10  # real rows, pairs kept, varied
    assert lengths == bench_trace.trace_lengths("azure-conv", 50, 1.0, 100_000, seed=4)
    assert lengths != bench_trace.trace_lengths("azure-conv", 50, 1.0, 100_000, seed=5)
    scaled = bench_trace.trace_lengths("azure-conv", 50, 0.125, 100_000, seed=4)
    assert scaled == [(max(1, round(p / 8)), max(1, round(o / 8))) for p, o in lengths]
    assert all(p + o <= 64 for p, o in bench_trace.trace_lengths("azure-conv", 50, 1.0, 64, seed=4))
    with pytest.raises(ValueError, match="unknown trace"):
        bench_trace.trace_lengths("nope", 1, 0.5, 64, seed=0)


def test_trace_closed_loop_keeps_concurrency_and_matches_transformers(tiny_dir, hf_model):
    """nitsum never has more than c requests in flight and refills a slot as soon as one finishes; its
    greedy outputs have each request's own length and equal transformers' (alone and left-padded)."""
    from nitsum.bench import engine_trace as bench_trace
    from nitsum.engine.engine import Engine
    from nitsum.engine.params import EngineConfig

    engine = Engine(EngineConfig(model_dir=str(tiny_dir), max_num_seqs=16, max_num_batched_tokens=256))
    items = bench_trace.trace_workload([(5, 3), (17, 9), (2, 1), (30, 4), (9, 6)], seed=1)
    seen = []  # (requests in the engine, requests not finished yet) at the start of each step
    finished = 0
    step = engine.step

    def counting_step():
        nonlocal finished
        seen.append((len(engine.scheduler.running) + len(engine.scheduler.waiting), len(items) - finished))
        outputs = step()
        finished += sum(o.finished for o in outputs)
        return outputs

    engine.step = counting_step
    _, ours = bench_trace.run_nitsum(engine, items, concurrency=2, tag="t")
    assert all(in_engine == min(2, unfinished) for in_engine, unfinished in seen), seen
    assert [len(o) for o in ours] == [3, 9, 1, 4, 6]
    _, batched, computed = bench_trace.run_hf(hf_model, items, concurrency=2, batched=True)
    _, serial, _ = bench_trace.run_hf(hf_model, items, concurrency=2, batched=False)
    assert ours == serial and ours == batched
    assert computed == 2 * (17 + 9) + 2 * (30 + 4) + 1 * (9 + 6)  # padded prompts plus the longest output


def test_engine_bench_trace_mode_runs_and_outputs_agree(capsys):
    from nitsum.bench import engine as bench

    assert bench.main(["--quick", "--workload", "trace", "--concurrency", "1,4", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| tiny |")]
    assert [row[2].strip() for row in rows] == ["1", "4"]
    assert [row[3].strip().split(" ")[0] for row in rows] == ["8", "8"]  # at least 8 requests each
    assert rows[0][-2].strip() == "8/8 / -" and rows[1][-2].strip() == "8/8 / 8"


def test_engine_bench_decode_step_mode(capsys):
    from nitsum.bench import engine as bench

    assert bench.main(["--models", "tiny", "--decode-contexts", "20,40", "--decode-batch", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("decode step")]
    assert [line.split(":")[0] for line in lines] == [
        "decode step, tiny, batch 2, context 20",
        "decode step, tiny, batch 2, context 40",
    ]
    assert bench.main(["--models", "tiny", "--decode-contexts", "40", "--decode-batch", "3", "--decode-varied"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("decode step")]
    assert [line.split(":")[0] for line in lines] == ["decode step, tiny, batch 3, context 16..40"]
    with pytest.raises(SystemExit):
        bench.main(["--decode-contexts", "1k"])

"""The shared weight store lays each layer's q|k|v and gate|up back to back, so a TP=1 model built on its
views runs fused projections (as a runner that loads the checkpoint itself does), while every parameter
stays a view of the store and the logits equal those of a model on the checkpoint's own tensors."""

import json

import pytest
import torch

from nitsum.engine.plan import ChunkPlan, StepPlan
from nitsum.engine.runner import ModelRunner
from nitsum.model import loader
from nitsum.model.model import FUSABLE_GROUPS
from nitsum.parallel import TPGroup
from nitsum.parallel.weights import ALIGN_BYTES, SharedWeightStore


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    opened = SharedWeightStore.open(tiny_dir, "float32", tmp_path_factory.mktemp("shm"))
    yield opened
    opened.remove()


def test_store_writes_fusable_groups_back_to_back_and_the_rest_aligned(store, tiny_dir):
    manifest = json.loads(store.path.with_suffix(".json").read_text())["tensors"]
    cfg = loader.load_config(tiny_dir)
    grouped = set()
    for layer in range(cfg.num_layers):
        for group in FUSABLE_GROUPS:
            names = [f"model.layers.{layer}.{suffix}" for suffix in group]
            if not all(n in manifest for n in names):
                continue
            grouped.update(names)
            for before, after in zip(names, names[1:]):
                entry = manifest[before]
                size = entry["numel"] * loader.DTYPES[entry["dtype"]].itemsize
                assert manifest[after]["offset"] == entry["offset"] + size, (before, after)
    assert len(grouped) == cfg.num_layers * 5  # q, k, v, gate, up of every layer (no biases here)
    starts = [
        e["offset"]
        for n, e in manifest.items()
        if n not in grouped or n.endswith(("q_proj.weight", "gate_proj.weight"))
    ]
    assert all(offset % ALIGN_BYTES == 0 for offset in starts)
    # Values are the checkpoint's, whatever the layout.
    checkpoint = loader.load_weights(tiny_dir, torch.float32)
    assert set(store.tensors) == set(checkpoint)
    assert all(torch.equal(store.tensors[n], checkpoint[n]) for n in checkpoint)


def test_tp1_runner_on_the_store_fuses_on_views_and_matches_the_checkpoint(store, tiny_dir):
    cfg = loader.load_config(tiny_dir)
    on_store = ModelRunner(str(tiny_dir), TPGroup.single("cpu"), num_kv_blocks=16, weights=store.tensors, config=cfg)
    for layer in on_store.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv_weight is not None and mlp.gate_up_weight is not None
        assert store.contains(attn.qkv_weight) and store.contains(mlp.gate_up_weight)
    assert all(store.contains(p) for p in on_store.model.parameters())

    # Against separate tensors (no fusion): same logits, prefill and decode.
    unfused = ModelRunner(
        str(tiny_dir),
        TPGroup.single("cpu"),
        num_kv_blocks=16,
        weights=loader.load_weights(tiny_dir, torch.float32),
        config=cfg,
    )
    assert all(layer.self_attn.qkv_weight is None for layer in unfused.model.model.layers)
    prompt = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    table = (1, 2)
    plans = [
        StepPlan("step", 1, (ChunkPlan(tuple(prompt[:-1]), 0, table, True),)),
        StepPlan("step", 2, (ChunkPlan((prompt[-1],), 20, table, True),)),
    ]
    for plan in plans:
        assert torch.allclose(on_store.execute(plan), unfused.execute(plan), atol=1e-5, rtol=0)


def test_tp2_shards_of_the_store_stay_views_and_separate(store, tiny_dir):
    """A TP=2 rank's shards are row ranges of q, k and v: views of the store, but not adjacent."""
    cfg = loader.load_config(tiny_dir)
    shards = loader.shard_weights(store.tensors, cfg, rank=1, size=2)
    assert all(store.contains(t) for t in shards.values())
    q, k = shards["model.layers.0.self_attn.q_proj.weight"], shards["model.layers.0.self_attn.k_proj.weight"]
    assert q.data_ptr() + q.numel() * q.element_size() != k.data_ptr()

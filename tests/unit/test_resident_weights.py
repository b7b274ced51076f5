"""Device-resident boot weights (`parallel.weights.boot_weights` / `ResidentWeights`), checked on CPU in the
forced resident mode (the same code a CUDA worker runs) and, with a GPU, on CUDA.

For every device of a node and every TP level it may join: each shard is a view of the device's one
resident allocation, equals the shared store's shard at the same (TP, rank), and the resident bytes are the
hull of the store slices the device uses (computed here from the store's views by pointer arithmetic, not
by the code under test). A TP change builds a runner on the same resident copy: the loader's byte counter
does not move and every parameter is a view of that copy."""

import pytest
import torch

from nitsum.engine.plan import ChunkPlan, StepPlan
from nitsum.engine.runner import ModelRunner
from nitsum.model import loader
from nitsum.parallel import TPGroup
from nitsum.parallel.weights import ResidentWeights, SharedWeightStore, boot_weights

NODE = 4
MAX_TP = 4


@pytest.fixture(scope="module")
def store(tiny_model_dir, tmp_path_factory):
    opened = SharedWeightStore.open(tiny_model_dir, "float32", tmp_path_factory.mktemp("shm"))
    yield opened
    opened.remove()


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return loader.load_config(tiny_model_dir)


def levels(min_tp, max_tp):
    return [tp for tp in (1, 2, 4, 8) if min_tp <= tp <= max_tp]


def store_slice(full: torch.Tensor, shard: torch.Tensor) -> tuple[int, int, int] | None:
    """(dim, start, end) of a store shard inside its full tensor, from the view's address; None when whole."""
    assert shard.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    if shard.shape == full.shape:
        assert shard.data_ptr() == full.data_ptr()
        return None
    offset = (shard.data_ptr() - full.data_ptr()) // full.element_size()
    dim = 0 if shard.shape[0] != full.shape[0] else 1
    start = offset // full.stride(dim)
    return dim, start, start + shard.shape[dim]


def expected_hull_bytes(store, cfg, device_index, min_tp, max_tp) -> int:
    """Bytes a device must hold: per tensor the hull of the store slices it uses over the levels."""
    per_level = [loader.shard_weights(store.tensors, cfg, device_index % tp, tp) for tp in levels(min_tp, max_tp)]
    total = 0
    for name, full in store.tensors.items():
        slices = [store_slice(full, shards[name]) for shards in per_level]
        if slices[0] is None:
            total += full.numel() * full.element_size()
            continue
        dim = slices[0][0]
        width = max(s[2] for s in slices) - min(s[1] for s in slices)
        total += full.numel() // full.shape[dim] * width * full.element_size()
    return total


def check_views_bytes_and_values(store, cfg, device, device_index, min_tp, max_tp):
    """(a) every shard at every allowed level is a view of the resident copy, whose bytes are the hull;
    (b) each shard equals the store's shard at the same (TP, rank)."""
    resident = boot_weights(
        store, device, device_index, min_tp, max_tp, config=cfg, node_size=max(NODE, max_tp), resident=True
    )
    assert isinstance(resident, ResidentWeights)
    assert resident.device.type == torch.device(device).type
    full_bytes = sum(t.numel() * t.element_size() for t in store.tensors.values())
    hull = expected_hull_bytes(store, cfg, device_index, min_tp, max_tp)
    assert resident.tensor_bytes == hull
    assert hull <= resident.size_bytes < hull + 64 * (len(resident.tensors) + 1)  # only alignment padding
    if min_tp == 1:
        assert hull == full_bytes  # TP=1 uses every byte: the coarsest level is the whole model
    else:
        assert hull < full_bytes
    storage = resident.buffer.untyped_storage().data_ptr()
    for tp in levels(min_tp, max_tp):
        rank = device_index % tp
        shards = resident.shards(cfg, rank, tp)
        reference = loader.shard_weights(store.tensors, cfg, rank, tp)
        assert set(shards) == set(reference)
        for name, shard in shards.items():
            assert shard.untyped_storage().data_ptr() == storage, (tp, name)
            assert resident.contains(shard), (tp, name)
            assert not store.contains(shard)
            assert shard.shape == reference[name].shape, (tp, name)
            assert torch.equal(shard.cpu(), reference[name]), (tp, name)
    return resident


def check_tp_change_reads_and_allocates_nothing(store, cfg, device, device_index, min_tp, max_tp):
    """(c) runners at every level, one after another, on one resident copy: no byte read, every parameter a
    view of the copy. (Building a runner does not communicate: a group of the right rank and size, without a
    process group, is enough to build one here; `test_resident_tp` runs a real TP=2 group.)"""
    resident = boot_weights(store, device, device_index, min_tp, max_tp, config=cfg, node_size=NODE, resident=True)
    before = loader.bytes_read
    for tp in levels(min_tp, max_tp) + levels(min_tp, max_tp)[::-1]:
        group = TPGroup.single(device) if tp == 1 else TPGroup(device_index % tp, tp, None, device)
        runner = ModelRunner("unused-model-dir", group, device=device, num_kv_blocks=4, weights=resident, config=cfg)
        params = list(runner.model.parameters())
        assert len(params) == len(store.tensors)  # one per checkpoint tensor (the tiny model is untied)
        assert all(resident.contains(p) for p in params), tp
        assert loader.bytes_read == before


@pytest.mark.parametrize("min_tp", [1, 2])
@pytest.mark.parametrize("device_index", range(NODE))
def test_every_shard_is_a_view_of_the_hull_and_equals_the_store(store, cfg, device_index, min_tp):
    check_views_bytes_and_values(store, cfg, "cpu", device_index, min_tp, MAX_TP)


def test_the_hull_of_non_nested_ranges_by_hand(store, cfg):
    """max_tp=4, min_tp=2, device 1: rows [64, 128) of q at TP=2 and [32, 64) at TP=4 -> rows [32, 128)."""
    resident = boot_weights(store, "cpu", 1, 2, 4, config=cfg, resident=True)
    q = "model.layers.0.self_attn.q_proj.weight"  # 128 rows: 4 blocks of 32
    o = "model.layers.0.self_attn.o_proj.weight"  # columns, same blocks
    norm = "model.layers.0.input_layernorm.weight"
    assert resident.spans[q] == (0, 32, 96) and resident.tensors[q].shape == (96, 128)
    assert resident.spans[o] == (1, 32, 96) and resident.tensors[o].shape == (128, 96)
    assert resident.spans[norm] is None and resident.tensors[norm].shape == store.tensors[norm].shape
    assert torch.equal(resident.tensors[q], store.tensors[q][32:128])
    assert torch.equal(resident.tensors[o], store.tensors[o][:, 32:128])
    # Device 0 of the same node needs only blocks [0, 2): half of every sharded weight.
    assert boot_weights(store, "cpu", 0, 2, 4, config=cfg, resident=True).spans[q] == (0, 0, 64)


def test_replicated_kv_heads_beyond_the_kv_head_count(store, cfg):
    """TP=8 > 4 KV heads: a rank's K/V rows are a replicated head; they are views of the hull too."""
    assert cfg.num_kv_heads == 4
    for device_index in range(8):
        check_views_bytes_and_values(store, cfg, "cpu", device_index, 4, 8)
    resident = boot_weights(store, "cpu", 5, 4, 8, config=cfg, node_size=8, resident=True)
    # Device 5: KV head 1 at TP=4 (rank 1), head 5 * 4 // 8 = 2 at TP=8 -> heads 1..2 (rows 16..48).
    assert resident.spans["model.layers.0.self_attn.k_proj.weight"] == (0, 16, 32)


def test_tied_embeddings_keep_no_copy_of_the_checkpoints_lm_head(tmp_path):
    """A tied model computes its LM head on the embedding's slices: the checkpoint's lm_head is not copied."""
    from nitsum.model.tiny import make_tiny

    model_dir = make_tiny(tmp_path / "tied", {"tie_word_embeddings": True})
    tied = loader.load_config(model_dir)
    store = SharedWeightStore.open(model_dir, "float32", tmp_path / "shm")
    try:
        assert "lm_head.weight" in store.tensors
        resident = boot_weights(store, "cpu", 3, 2, 4, config=tied, node_size=4, resident=True)
        assert "lm_head.weight" not in resident.tensors
        embed = store.tensors["model.embed_tokens.weight"]
        assert resident.tensor_bytes == expected_hull_bytes(store, tied, 3, 2, 4) - (
            store.tensors["lm_head.weight"].numel() * 4 // 2
        )  # the lm_head hull ([2, 4) of 4 blocks) is not held
        for tp in (2, 4):
            shards = resident.shards(tied, 3 % tp, tp)
            assert shards["lm_head.weight"] is shards["model.embed_tokens.weight"]
            head = shards["lm_head.weight"]
            assert torch.equal(head, loader.shard_weights(store.tensors, tied, 3 % tp, tp)["lm_head.weight"])
            assert resident.contains(head) and head.shape[0] == embed.shape[0] // tp
            runner = ModelRunner(
                "unused", TPGroup(3 % tp, tp, None, "cpu"), num_kv_blocks=4, weights=resident, config=tied
            )
            assert all(resident.contains(p) for p in runner.model.parameters())
    finally:
        store.remove()


@pytest.mark.parametrize("min_tp", [1, 2])
def test_tp_change_reads_nothing_and_allocates_no_weight(store, cfg, min_tp):
    for device_index in range(NODE):
        check_tp_change_reads_and_allocates_nothing(store, cfg, "cpu", device_index, min_tp, MAX_TP)


def tp1_plans():
    prompt = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    table = (1, 2)
    return [
        StepPlan("step", 1, (ChunkPlan(tuple(prompt[:-1]), 0, table, True),)),
        StepPlan("step", 2, (ChunkPlan((prompt[-1],), 20, table, True),)),
    ]


def check_tp1_runner_fuses_and_matches_the_store(store, cfg, device):
    """With min_tp=1 the hull is the whole model, laid out as the store: a TP=1 runner on it runs fused
    q|k|v and gate|up on views, and its logits equal a runner on the store's (CPU) tensors."""
    resident = boot_weights(store, device, 0, 1, MAX_TP, config=cfg, node_size=NODE, resident=True)
    on_resident = ModelRunner(
        "unused", TPGroup.single(device), device=device, num_kv_blocks=4, weights=resident, config=cfg
    )
    on_store = ModelRunner("unused", TPGroup.single("cpu"), num_kv_blocks=4, weights=store.tensors, config=cfg)
    for layer in on_resident.model.model.layers:
        assert resident.contains(layer.self_attn.qkv_weight) and resident.contains(layer.mlp.gate_up_weight)
    for plan in tp1_plans():
        assert torch.allclose(on_resident.execute(plan).cpu(), on_store.execute(plan), atol=1e-4, rtol=0)


def test_tp1_runner_on_the_resident_copy_fuses_and_matches_the_store(store, cfg):
    check_tp1_runner_fuses_and_matches_the_store(store, cfg, "cpu")


def test_cpu_default_is_the_store_itself(store, cfg):
    weights = boot_weights(store, "cpu", 2, 1, 4, config=cfg)
    assert weights is store.tensors


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((4, 1, 4), {}, "device index 4 is outside the node's devices 0..3"),
        ((-1, 1, 4), {}, "device index -1"),
        ((0, 3, 4), {}, "powers of two"),
        ((0, 4, 2), {}, "powers of two with min_tp <= max_tp"),
        ((0, 0, 4), {}, "min_tp must be a positive integer"),
        ((0, 1, 8), {"node_size": 4}, "max_tp=8 exceeds the node's 4 devices"),
        ((0, 1, 16), {"node_size": 16}, "TP level 16 of [1, 16] does not fit the model: num_attention_heads=8"),
    ],
)
def test_bad_boot_arguments_are_clear_errors(store, cfg, args, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        boot_weights(store, "cpu", *args, config=cfg, resident=True, **{"node_size": 4, **kwargs})


def test_cuda_without_a_resident_copy_is_refused(store, cfg):
    with pytest.raises(ValueError, match="needs device-resident weights"):
        boot_weights(store, "cuda", 0, 1, 4, config=cfg, resident=False)


def test_a_level_or_rank_the_device_does_not_take_is_refused(store, cfg):
    resident = boot_weights(store, "cpu", 1, 2, 4, config=cfg, resident=True)
    with pytest.raises(ValueError, match=r"TP=1 is not among this device's levels \(2, 4\)"):
        resident.shards(cfg, 0, 1)
    with pytest.raises(ValueError, match="device 1 is rank 1 at TP=2, not 0"):
        resident.shards(cfg, 0, 2)
    with pytest.raises(ValueError, match="device 1 is rank 1 at TP=4, not 3"):
        ModelRunner("unused", TPGroup(3, 4, None, "cpu"), num_kv_blocks=4, weights=resident, config=cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")
@pytest.mark.parametrize("min_tp", [1, 2])
def test_resident_copy_on_cuda(store, cfg, min_tp):
    """(a)-(c) on the real path: the copy lives on the GPU; shards, runners and a TP=1 forward use it."""
    for device_index in range(NODE):
        resident = check_views_bytes_and_values(store, cfg, "cuda", device_index, min_tp, MAX_TP)
        assert all(t.is_cuda for t in resident.tensors.values())
        check_tp_change_reads_and_allocates_nothing(store, cfg, "cuda", device_index, min_tp, MAX_TP)
    if min_tp == 1:
        check_tp1_runner_fuses_and_matches_the_store(store, cfg, "cuda")

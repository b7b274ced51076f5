"""Reload-free weights: each weight of a model is held once per host and every (TP, rank) computes on views.

CPU: `SharedWeightStore` is one file per (model, dtype) in a shared-memory directory (`/dev/shm` by
default). The first worker of the host takes an exclusive file lock, reads the checkpoint once (the
loader's `bytes_read` counts it) and writes every tensor, 64-byte aligned, into `<key>.bin`; it then
writes `<key>.json` (name -> dtype, shape, offset) by atomic rename, which marks the store complete. Every
other worker (and any later restart) finds the manifest and maps the file with `torch.from_file(shared=
True)`: the pages are the same physical memory, and nothing is read from disk.

Layout: each layer's q|k|v (weights, and biases) and gate|up are written back to back (in that order, no
padding between them), so a TP=1 model built on the store's views runs those projections as one matmul
each (`model.fused_view`), exactly as a runner that loaded the checkpoint itself. Every other tensor, and
each such group, starts 64-byte aligned. (A TP>1 rank's q, k and v shards are row ranges of three tensors,
so they cannot all touch at once: those ranks keep separate matmuls.) `STORE_LAYOUT` is part of the key,
so a store written with an older layout is not mapped by a newer worker.

Full tensors are stored; the `max_tp` blocks of a column-parallel weight are contiguous row ranges and
those of a row-parallel weight column ranges, so rank j of a TP=k group takes its `max_tp/k` consecutive
blocks with `narrow` (`loader.shard_weights`): a view, never a copy. A TP change re-cuts views.

Cleanup: the files outlive the workers on purpose (a restarted worker maps instead of reading disk).
`remove()` unlinks them (the node's supervisor calls it on shutdown or when the model changes); processes
that still map them keep valid memory until they exit, as with any unlinked file. A crash while writing
leaves no manifest, so the next worker rewrites the data file under the lock.

CUDA: a GPU cannot compute on the host store, so at boot each worker copies to its device, once, only what
that device uses at any level it may join (`boot_weights` -> `ResidentWeights`): per weight one contiguous
range along the weight's split dimension, the *hull* of the ranges the device covers at min_tp..max_tp
(tensors every rank uses whole -- norms, row-parallel biases -- are copied whole). A hull, not the coarsest
level's blocks alone, because with the aligned rank -> block mapping a device's ranges at different levels
are not nested: with max_tp = 4 and min_tp = 2, device 1 covers blocks [2, 4) of a column-parallel weight
at TP=2 but block [1, 2) at TP=4, so it holds [1, 4). With min_tp = 1 the hull is the whole model (the
"coarsest level" of ALGORITHMS 1.1); with min_tp > 1 it is less. Every (TP, rank) shard the device takes is
then a `narrow` of that copy (`ResidentWeights.shards`), so a TP change reads nothing from disk or host
memory and allocates no weight tensor. The copy is one allocation laid out as the store (fusable groups back
to back), so a level whose slices are the whole hulls runs fused projections. The same copy can be forced
on CPU (`resident=True`), which is how the logic is tested without a GPU. Not implemented: mapping peers'
blocks through CUDA IPC instead of storing them (the P2P mode of ALGORITHMS 1.1); each device holds its
own hull.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from nitsum.model import loader

ALIGN_BYTES = 64
STORE_LAYOUT = 2  # 2: fusable projections adjacent
DEFAULT_SHM_DIR = "/dev/shm"


def store_key(model_dir: str | Path, dtype: str) -> str:
    """Names a store by model path, dtype and the checkpoint files' sizes and mtimes (a new file -> a new key)."""
    directory = Path(model_dir).resolve()
    digest = hashlib.sha256(f"{directory}|{dtype}|layout{STORE_LAYOUT}".encode())
    for path in sorted(directory.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"|{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"nitsum-weights-{directory.name}-{digest.hexdigest()[:16]}"


@dataclass
class SharedWeightStore:
    path: Path  # the data file
    tensors: dict[str, torch.Tensor]  # full-size weights, views of one shared mapping
    size_bytes: int
    base_address: int  # address of the mapping (for the views-of-the-store check)
    created: bool  # True when this process wrote the store (and read the checkpoint)

    @staticmethod
    def open(model_dir: str | Path, dtype: str = "float32", shm_dir: str | Path = DEFAULT_SHM_DIR) -> SharedWeightStore:
        torch_dtype = loader.dtype_of(dtype)
        directory = Path(shm_dir)
        directory.mkdir(parents=True, exist_ok=True)
        key = store_key(model_dir, dtype)
        data_path = directory / f"{key}.bin"
        manifest_path = directory / f"{key}.json"
        created = False
        with open(directory / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not manifest_path.is_file():
                _write_store(model_dir, torch_dtype, data_path, manifest_path)
                created = True
        manifest = json.loads(manifest_path.read_text())
        size = int(manifest["size_bytes"])
        buffer = torch.from_file(str(data_path), shared=True, size=size, dtype=torch.uint8)
        tensors: dict[str, torch.Tensor] = {}
        for name, entry in manifest["tensors"].items():
            dt = loader.dtype_of(entry["dtype"])
            nbytes = entry["numel"] * dt.itemsize
            flat = buffer.narrow(0, entry["offset"], nbytes).view(dt)
            tensors[name] = flat.view(entry["shape"])
        return SharedWeightStore(data_path, tensors, size, buffer.data_ptr(), created)

    def contains(self, tensor: torch.Tensor) -> bool:
        """True when `tensor` is a view of this store's mapping (not a copy): same storage, inside it."""
        storage = tensor.untyped_storage()
        return (
            storage.data_ptr() == self.base_address
            and self.base_address <= tensor.data_ptr() < self.base_address + self.size_bytes
        )

    def remove(self) -> None:
        """Unlink the store's files (mappings stay valid in the processes that hold them)."""
        for suffix in (".json", ".bin", ".lock"):
            self.path.with_suffix(suffix).unlink(missing_ok=True)


def _write_store(model_dir: str | Path, dtype: torch.dtype, data_path: Path, manifest_path: Path) -> None:
    weights = loader.load_weights(model_dir, dtype, "cpu")  # the one read of the checkpoint
    entries: dict[str, dict] = {}
    offset = 0
    for run in _adjacent_runs(list(weights)):
        offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES  # each run starts aligned; its members touch
        for name in run:
            tensor = weights[name]
            entries[name] = {
                "dtype": next(k for k, v in loader.DTYPES.items() if v == tensor.dtype),
                "shape": list(tensor.shape),
                "numel": tensor.numel(),
                "offset": offset,
            }
            offset += tensor.numel() * tensor.element_size()
    size = max(ALIGN_BYTES, -(-offset // ALIGN_BYTES) * ALIGN_BYTES)
    with open(data_path, "wb") as handle:
        handle.truncate(size)
    buffer = torch.from_file(str(data_path), shared=True, size=size, dtype=torch.uint8)
    for name, tensor in weights.items():
        entry = entries[name]
        raw = tensor.contiguous().view(-1).view(torch.uint8)
        buffer.narrow(0, entry["offset"], raw.numel()).copy_(raw)
    del buffer
    tmp = manifest_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"size_bytes": size, "tensors": entries}))
    os.replace(tmp, manifest_path)


def _adjacent_runs(names: list[str]) -> list[list[str]]:
    """The checkpoint's tensor names in write order, as runs to be stored back to back: one run per complete
    fusable group of a layer (`model.FUSABLE_GROUPS`, in the group's order), every other name alone."""
    from nitsum.model.model import FUSABLE_GROUPS

    present = set(names)
    group_of: dict[str, list[str]] = {}
    for name in names:
        prefix, dot, rest = name.partition(".layers.")
        if not dot:
            continue
        layer, _, suffix = rest.partition(".")
        for group in FUSABLE_GROUPS:
            if suffix in group:
                members = [f"{prefix}.layers.{layer}.{member}" for member in group]
                if all(m in present for m in members):
                    group_of[name] = members
    runs: list[list[str]] = []
    placed: set[str] = set()
    for name in names:
        if name in placed:
            continue
        run = group_of.get(name, [name])
        runs.append(run)
        placed.update(run)
    return runs


class ResidentWeights:
    """One device's boot copy of the weights: per tensor, the hull of the slices this device uses at every
    TP level it may join, in one allocation on the device (see the module docstring, "CUDA").

    Made once by `boot_weights`; `shards(cfg, rank, size)` then cuts any (level, rank) of this device as
    views (`narrow`) of it, so a TP change allocates no weight tensor and reads nothing from host memory.
    """

    def __init__(
        self,
        store_tensors: dict[str, torch.Tensor],
        config: loader.ModelConfig,
        device: str | torch.device,
        device_index: int,
        levels: tuple[int, ...],
    ) -> None:
        self.config = config
        self.device_index = device_index
        self.levels = levels
        names = [n for n in store_tensors if "rotary_emb" not in n]
        if config.tie_word_embeddings and "model.embed_tokens.weight" in store_tensors:
            names = [n for n in names if n != "lm_head.weight"]  # the model uses the embedding's slices
        # name -> (dim, start, length) in the full tensor: the hull of this device's spans over the levels;
        # None for a tensor every rank uses whole.
        self.full_shapes = {n: tuple(store_tensors[n].shape) for n in names}
        self.spans: dict[str, tuple[int, int, int] | None] = {}
        for name in names:
            spans = [loader.shard_span(name, self.full_shapes[name], config, device_index % tp, tp) for tp in levels]
            if spans[0] is None:
                self.spans[name] = None
                continue
            start = min(s[1] for s in spans)
            end = max(s[1] + s[2] for s in spans)
            self.spans[name] = (spans[0][0], start, end - start)
        # One buffer, laid out as the store is (fusable groups back to back, everything else aligned), so
        # that at a level where this device's slices are the whole hulls (TP=1 when min_tp=1; at TP>1 e.g.
        # device 0 at min_tp) q|k|v and gate|up still run as one matmul (`model.fused_view`).
        offsets: dict[str, int] = {}
        offset = 0
        for run in _adjacent_runs(names):
            offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
            for name in run:
                offsets[name] = offset
                offset += self._hull_numel(name) * store_tensors[name].element_size()
        self.buffer = torch.empty(
            max(ALIGN_BYTES, -(-offset // ALIGN_BYTES) * ALIGN_BYTES), dtype=torch.uint8, device=device
        )
        self.tensors: dict[str, torch.Tensor] = {}
        for name in names:
            source = store_tensors[name]
            span = self.spans[name]
            part = source if span is None else source.narrow(*span)
            nbytes = part.numel() * part.element_size()
            resident = self.buffer.narrow(0, offsets[name], nbytes).view(source.dtype).view(part.shape)
            resident.copy_(part)
            self.tensors[name] = resident

    def _hull_numel(self, name: str) -> int:
        shape = list(self.full_shapes[name])
        span = self.spans[name]
        if span is not None:
            shape[span[0]] = span[2]
        numel = 1
        for n in shape:
            numel *= n
        return numel

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def size_bytes(self) -> int:
        """Bytes of the one allocation (the hulls plus alignment padding between runs)."""
        return self.buffer.numel()

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the hulls themselves."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def rank_at(self, tp: int) -> int:
        """This device's rank in its (aligned) group at level `tp`."""
        return self.device_index % tp

    def shards(self, cfg: loader.ModelConfig, rank: int, size: int) -> dict[str, torch.Tensor]:
        """What `loader.shard_weights(full, cfg, rank, size)` gives, as views of the resident copy. Only the
        (level, rank) pairs this device takes are resident: anything else is a ValueError, not a copy."""
        if cfg != self.config:
            raise ValueError("resident weights were cut for another model config")
        cfg.check_tp(size)
        if size not in self.levels:
            raise ValueError(f"TP={size} is not among this device's levels {self.levels}")
        if rank != self.rank_at(size):
            raise ValueError(f"device {self.device_index} is rank {self.rank_at(size)} at TP={size}, not {rank}")
        shards: dict[str, torch.Tensor] = {}
        for name, resident in self.tensors.items():
            hull = self.spans[name]
            if hull is None:
                shards[name] = resident
                continue
            dim, start, length = loader.shard_span(name, self.full_shapes[name], cfg, rank, size)
            assert dim == hull[0] and hull[1] <= start and start + length <= hull[1] + hull[2], (
                f"{name}: TP={size} rank {rank} slice [{start}, {start + length}) outside the resident hull"
            )
            shards[name] = resident.narrow(dim, start - hull[1], length)
        if cfg.tie_word_embeddings or "lm_head.weight" not in shards:
            shards["lm_head.weight"] = shards["model.embed_tokens.weight"]
        return shards

    def contains(self, tensor: torch.Tensor) -> bool:
        """True when `tensor` is a view of the resident allocation (not a copy): same storage, inside it."""
        base = self.buffer.data_ptr()
        return (
            tensor.device == self.device
            and tensor.untyped_storage().data_ptr() == base
            and base <= tensor.data_ptr() < base + self.size_bytes
        )


def boot_weights(
    store: SharedWeightStore,
    device: str,
    device_index: int,
    min_tp: int,
    max_tp: int,
    *,
    config: loader.ModelConfig,
    node_size: int | None = None,
    resident: bool | None = None,
) -> dict[str, torch.Tensor] | ResidentWeights:
    """The weights a node worker's runners compute on, made once at boot (`NodeRuntime(weights=...)`).

    CPU: the host-wide store's full tensors, unchanged (every worker maps the same pages). Anything else
    (CUDA): a `ResidentWeights` copy on `device` holding only what device `device_index` uses at levels
    min_tp..max_tp. `resident=True` forces that copy on CPU too (tests check the logic without a GPU);
    `resident=False` on a non-CPU device is refused (runners there would compute on host memory)."""
    node_size = max_tp if node_size is None else node_size
    for label, value in (("min_tp", min_tp), ("max_tp", max_tp), ("node_size", node_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if min_tp & (min_tp - 1) or max_tp & (max_tp - 1) or min_tp > max_tp:
        raise ValueError(f"TP levels must be powers of two with min_tp <= max_tp, got [{min_tp}, {max_tp}]")
    if max_tp > node_size:
        raise ValueError(f"max_tp={max_tp} exceeds the node's {node_size} devices")
    if not isinstance(device_index, int) or isinstance(device_index, bool) or not 0 <= device_index < node_size:
        raise ValueError(f"device index {device_index!r} is outside the node's devices 0..{node_size - 1}")
    levels = tuple(1 << k for k in range(min_tp.bit_length() - 1, max_tp.bit_length()))
    for tp in levels:
        try:
            config.check_tp(tp)
        except loader.ModelLoadError as exc:
            raise ValueError(f"TP level {tp} of [{min_tp}, {max_tp}] does not fit the model: {exc}") from exc
    on_cpu = torch.device(device).type == "cpu"
    if resident is None:
        resident = not on_cpu
    if not resident:
        if not on_cpu:
            raise ValueError(f"device {device!r} needs device-resident weights (resident=False is for CPU only)")
        return store.tensors
    return ResidentWeights(store.tensors, config, device, device_index, levels)

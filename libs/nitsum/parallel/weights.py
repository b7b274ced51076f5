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

CUDA: `device_store` copies the store to the device once at boot (the blocks of the coarsest level a
device may join; with min_tp = 1 that is the whole model). Finer levels are views of it.
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
        return (storage.data_ptr() == self.base_address
                and self.base_address <= tensor.data_ptr() < self.base_address + self.size_bytes)

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


def device_store(store: SharedWeightStore, device: str) -> dict[str, torch.Tensor]:
    """CUDA: one device-resident copy made at boot; every TP level's shards are views of it."""
    if device == "cpu":
        return store.tensors
    return {name: t.to(device) for name, t in store.tensors.items()}

"""Where the model lives: `tiny` means the deterministic tiny checkpoint in the cache (made on first use)."""

from __future__ import annotations

import fcntl
from pathlib import Path

from nitsum.config import default_home


def resolve_model_dir(model: str) -> Path:
    """A model directory ready to load. `tiny` is created under NITSUM_HOME/models/tiny once (file-locked)."""
    if model != "tiny":
        path = Path(model).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        return path
    target = default_home() / "models" / "tiny"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / ".tiny.lock"
    with open(lock_path, "w") as lock:
        # Several services start at once on first run; only one writes the checkpoint.
        fcntl.flock(lock, fcntl.LOCK_EX)
        from nitsum.model.tiny import make_tiny

        make_tiny(target)
    return target

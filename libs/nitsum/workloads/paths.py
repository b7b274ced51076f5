"""Where traces live: the real ones under shared/traces, else the small excerpts committed in the package.

Search order for the traces directory: `$NITSUM_TRACES_DIR`, then `<repo>/../shared/traces` (the repo is the
checkout holding `libs/nitsum`). The excerpts (libs/nitsum/data/traces) keep the same relative file names, so
callers never branch on which one they got; `is_excerpt(path)` says which.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # libs/nitsum
EXCERPTS_DIR = _PACKAGE_DIR / "data" / "traces"

# Short names -> path relative to the traces directory.
TRACE_NAMES: dict[str, str] = {
    "azure-code": "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
    "azure-conv": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    "mooncake-conv": "mooncake_fast25/conversation_trace.jsonl",
    "servegen-m-large": "servegen/servegen_m-large.tar.gz",
    "servegen-m-mid": "servegen/servegen_m-mid.tar.gz",
    "servegen-m-small": "servegen/servegen_m-small.tar.gz",
    "servegen-mm-image": "servegen/servegen_mm-image.tar.gz",
    "servegen-deepseek-r1": "servegen/servegen_deepseek-r1.tar.gz",
}


def traces_dir() -> Path | None:
    """The directory of the real traces, or None where there is none (CI without shared/)."""
    env = os.environ.get("NITSUM_TRACES_DIR")
    if env:
        return Path(env) if Path(env).is_dir() else None
    repo = _PACKAGE_DIR.parent.parent  # libs/nitsum -> libs -> repo
    candidate = repo.parent / "shared" / "traces"
    return candidate if candidate.is_dir() else None


def default_trace_path(name: str, *, prefer_excerpt: bool = False) -> Path:
    """Path of a trace by short name (see TRACE_NAMES) or by its path relative to the traces directory.

    Returns the real file when it exists (unless `prefer_excerpt`), else the committed excerpt.
    Raises FileNotFoundError when neither exists, naming both places looked in.
    """
    rel = TRACE_NAMES.get(name, name)
    real_dir = traces_dir()
    looked: list[Path] = []
    if real_dir is not None and not prefer_excerpt:
        real = real_dir / rel
        looked.append(real)
        if real.is_file():
            return real
    excerpt = EXCERPTS_DIR / rel
    looked.append(excerpt)
    if excerpt.is_file():
        return excerpt
    known = ", ".join(sorted(TRACE_NAMES))
    raise FileNotFoundError(f"trace {name!r} not found (looked in {', '.join(map(str, looked))}); names: {known}")


def is_excerpt(path: str | os.PathLike[str]) -> bool:
    """True when `path` is one of the committed excerpts rather than a full trace."""
    try:
        Path(path).resolve().relative_to(EXCERPTS_DIR)
    except ValueError:
        return False
    return True

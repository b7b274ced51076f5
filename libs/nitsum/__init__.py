"""nitsum: an LLM serving mesh for tiered SLOs (adaptive TP + stage-aware KV flow scheduling)."""

__version__ = "0.1.0"

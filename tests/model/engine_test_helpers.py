"""Helpers shared by the model/engine tests (module name kept unique across the test tree)."""

import torch


def prompts_of_lengths(lengths, seed=1):
    """Deterministic byte-token prompts (ids < 256) of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def record_logits(engine):
    """Wrap the runner so every step's logits are kept (test-only instrumentation)."""
    recorded = []
    execute = engine.runner.execute

    def wrapped(plan):
        logits = execute(plan)
        recorded.append(logits.clone())
        return logits

    engine.runner.execute = wrapped
    return recorded

"""py-spy raw samples of one process, grouped into the cost categories of docs/BENCHMARKS.md (Gateway, issue 23)."""

import collections
import sys

# categorize py-spy raw samples (active CPU only) of a worker or gateway
CATS = [
    ("engine step (model forward)", ["ModelRunner.execute"]),
    ("engine step (scheduler, sampling, detok)", ["Engine.step", "PlainBackend.step"]),
    ("step thread other (turn, stats)", ["StepThread."]),
    (
        "frame build + publish (worker)",
        ["WorkerSession._publish", "FramePublisher", "WorkerSession._finish_error", "Running."],
    ),
    ("NATS client (flusher, read loop, parse)", ["nats/aio/client.py", "nats/protocol", "nats/aio/transport"]),
    ("codec decode/encode", ["nitsum/wire/codec.py"]),
    (
        "gateway: stream SSE + JSON",
        [
            "Responder.stream",
            "Responder.collect",
            "protocol.py",
            "gateway/bodies.py",
            "gateway/sampling.py",
            "gateway/fields.py",
        ],
    ),
    ("gateway: Generation / deltas", ["Generation.", "FrameDispatcher", "choice_deltas"]),
    ("gateway: HTTP (aiohttp)", ["aiohttp/"]),
    (
        "gateway: handler setup (parse, tokenizer, submit)",
        ["Gateway.completions", "Gateway.chat_completions", "Gateway._generation", "Gateway._handle"],
    ),
    ("tracing / metrics", ["opentelemetry", "prometheus_client", "nitsum/telemetry"]),
    ("executor hop (thread pool, futures)", ["concurrent/futures", "run_in_executor", "_chain_future", "futures.py"]),
    ("event loop (select, callbacks)", ["asyncio/"]),
]


def cat(frames):
    s = ";".join(frames)
    for name, keys in CATS:
        if any(k in s for k in keys):
            return name
    return "other"


counts = collections.Counter()
total = 0
examples = collections.defaultdict(collections.Counter)
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n)
    total += n
    frames = stack.split(";")
    c = cat(frames)
    counts[c] += n
    examples[c][frames[-1]] += n
rate = float(sys.argv[2])
units = float(sys.argv[3]) if len(sys.argv) > 3 else 0
print(
    f"{sys.argv[1]}: {total} samples = {total / rate:.2f} CPU-s"
    + (f", {total / rate / units * 1e6:.0f} us per unit ({units:.0f} units)" if units else "")
)
for c, v in counts.most_common():
    extra = f" {v / rate / units * 1e6:7.1f} us/unit" if units else ""
    print(
        f"  {v / total * 100:5.1f}%{extra}  {c}   <- " + ", ".join(f"{f[:50]}" for f, _ in examples[c].most_common(2))
    )

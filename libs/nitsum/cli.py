"""The `nitsum` command line.

Each verb is dispatched lazily to the module that owns it, so `nitsum sim` never imports torch and
`nitsum admin` never imports the engine:

    nitsum up ...                 -> nitsum.up:main
    nitsum serve <service> ...    -> nitsum_services.<service>.main:main
    nitsum admin <cmd> ...        -> nitsum.admin:main
    nitsum model make-tiny DIR    -> nitsum.model.tiny:main
    nitsum sim <experiment> ...   -> nitsum.sim.cli:main
    nitsum load ...               -> nitsum_load.cli:main
    nitsum bench <name> ...       -> see BENCHES below
"""

from __future__ import annotations

import importlib
import sys

SERVICES = {
    "gateway": "nitsum_services.gateway.main",
    "coordinator": "nitsum_services.coordinator.main",
    "prefill-worker": "nitsum_services.worker.main",
    "decode-worker": "nitsum_services.worker.main",
    "flow-scheduler": "nitsum_services.flow_scheduler.main",
}

VERBS = {
    "up": "nitsum.up",
    "admin": "nitsum.admin",
    "model": "nitsum.model.cli",
    "sim": "nitsum.sim.cli",
    "load": "nitsum_load.cli",
}

# `nitsum bench <name>`: module whose main(argv) runs that benchmark.
BENCHES = {
    "engine": "nitsum.bench.engine",
    "reconfigure": "nitsum_load.bench_reconfigure",
    "policy": "nitsum.bench.policy",
    "flows": "nitsum.bench.flows",
    "gateway": "nitsum_load.bench_gateway",
    "profile": "nitsum.bench.profile",
    "fidelity": "nitsum_load.bench_fidelity",
    "soak": "nitsum_load.bench_soak",
}

USAGE = (
    """usage: nitsum <verb> ...

verbs:
  up                 run the whole mesh on this machine (nats-server, services, CPU workers, tiny model)
  serve SERVICE      run one service: gateway | coordinator | prefill-worker | decode-worker | flow-scheduler
  admin CMD          admin plane over NATS: status | set-policy | set-topology | drain | role | reform-node
  model make-tiny DIR  write the deterministic tiny Llama checkpoint (Hugging Face format)
  sim EXPERIMENT     cluster simulator experiments: tiers | flows | reconfig
  load               load generator against any OpenAI-compatible endpoint
  bench NAME         benchmarks: """
    + " | ".join(BENCHES)
    + "\n"
)


def _run(module_name: str, argv: list[str]) -> int:
    module = importlib.import_module(module_name)
    result = module.main(argv)
    return int(result or 0)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version", "version"):
        from nitsum import __version__

        print(f"nitsum {__version__}")
        return 0
    verb, rest = args[0], args[1:]
    if verb == "serve":
        if not rest or rest[0] not in SERVICES:
            sys.stderr.write(f"nitsum serve: choose one of {', '.join(SERVICES)}\n")
            return 2
        return _run(SERVICES[rest[0]], rest)
    if verb == "bench":
        if not rest or rest[0] not in BENCHES:
            sys.stderr.write(f"nitsum bench: choose one of {', '.join(BENCHES)}\n")
            return 2
        return _run(BENCHES[rest[0]], rest[1:])
    if verb in VERBS:
        return _run(VERBS[verb], rest)
    sys.stderr.write(f"nitsum: unknown verb {verb!r}\n{USAGE}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

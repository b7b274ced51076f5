"""Run one rank of a tensor-parallel engine group from argv (ranks are separate processes).

    python -m nitsum.bench.tp_run --model-dir D --rank R --world-size N --master-port P \
        [--master-addr 127.0.0.1] [--prompt-ids 1,2,3] [--max-tokens 64] [--out result.json]

Rank 0 leads: it generates greedily for the prompt and writes {"tokens": [...], "logits": [[...], ...]}
(one logits row per sampled token) to --out. Other ranks follow the leader's step plans until shutdown.
"""

from __future__ import annotations

import argparse
import json

import torch

from nitsum.engine.engine import Engine, run_peer
from nitsum.engine.params import EngineConfig, SamplingParams
from nitsum.parallel import init_tp_group


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nitsum.bench.tp_run")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-ids", default="1,2,3")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--decode-attention", default="auto", choices=("auto", "flex", "gather"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.num_threads)
    group = init_tp_group(args.master_addr, args.master_port, args.rank, args.world_size, device=args.device)
    cfg = EngineConfig(
        model_dir=args.model_dir, device=args.device, dtype=args.dtype, decode_attention=args.decode_attention
    )
    try:
        if not group.is_leader:
            run_peer(cfg, group)
            return 0
        engine = Engine(cfg, group)
        recorded: list[torch.Tensor] = []
        execute = engine.runner.execute

        def recording_execute(plan):
            logits = execute(plan)
            recorded.append(logits.cpu())
            return logits

        engine.runner.execute = recording_execute
        prompt = [int(t) for t in args.prompt_ids.split(",") if t]
        try:
            [tokens] = engine.generate([prompt], SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        finally:
            engine.shutdown()
        if args.out:
            logits = torch.cat(recorded).tolist()
            with open(args.out, "w") as handle:
                json.dump(
                    {
                        "tokens": tokens,
                        "logits": logits,
                        "device": str(engine.runner.device),
                        "host_staging": group.host_staging,
                    },
                    handle,
                )
        return 0
    finally:
        group.destroy()


if __name__ == "__main__":
    raise SystemExit(main())

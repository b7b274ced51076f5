"""`nitsum load`: open-loop load against any OpenAI-compatible endpoint, reported per SLO tier.

    nitsum load --url http://127.0.0.1:8000 --trace azure-conv --time-scale 0.5 \\
        --tier-mix interactive=0.3,background=0.7 --max-requests 200 --duration 120 --out runs/conv

Sources: --trace (azure-conv | azure-code | mooncake | servegen:<model> | a .csv / .jsonl path), --poisson RATE,
--gamma RATE,CV. Prompts are synthesized: text of repeated words (about N tokens), or with
--prompt-format token-ids exactly N token ids (only on /v1/completions). The words-per-token
ratio of text prompts is measured first with two 1-token requests (--no-calibrate: assume 1 token per word). Ctrl-C stops sending, cancels what is
in flight (reported as unfinished) and still writes the report. `--from-log FILE` re-reports a lifecycle log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from nitsum.metrics import summarize
from nitsum_load.client import ENDPOINTS, PROMPT_FORMATS, ClientConfig, PromptScale, calibrate_prompt
from nitsum_load.progress import ProgressBar
from nitsum_load.report import format_table, read_lifecycle_log, write_all
from nitsum_load.runner import Counters, run_open_loop
from nitsum_load.workload import DEFAULT_BUCKET_SPREAD_MS, Shaping, parse_tier_mix, read_trace, shape, synthetic


def _positive(kind: type) -> Any:
    def conv(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    conv.__name__ = kind.__name__
    return conv


def _rate_cv(text: str) -> tuple[float, float]:
    try:
        rate, cv = (float(x) for x in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected RATE,CV (e.g. 4,2), got {text!r}") from exc
    if not rate > 0 or not cv > 0:
        raise argparse.ArgumentTypeError(f"RATE and CV must be > 0, got {text!r}")
    return rate, cv


def _tier_mix(text: str) -> dict[str, float]:
    try:
        return parse_tier_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nitsum load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the OpenAI-compatible server")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--trace",
        help="azure-conv | azure-code | mooncake | servegen:<model> | path (.csv: Azure 2023/2024 or BurstGPT; .jsonl: Mooncake)",
    )
    src.add_argument("--poisson", type=_positive(float), metavar="RATE", help="Poisson arrivals, requests/s")
    src.add_argument("--gamma", type=_rate_cv, metavar="RATE,CV", help="gamma arrivals: rate/s and gap CV")
    src.add_argument(
        "--from-log", type=Path, metavar="FILE", help="send nothing; report an existing requests.jsonl lifecycle log"
    )
    p.add_argument(
        "--time-scale", type=_positive(float), default=1.0, help="multiply arrival times (0.5 = twice the rate)"
    )
    p.add_argument(
        "--target-rate",
        type=_positive(float),
        default=None,
        metavar="RPS",
        help="instead of --time-scale: rescale arrivals to this mean rate",
    )
    p.add_argument(
        "--tier-mix",
        type=_tier_mix,
        default=None,
        help="e.g. interactive=0.3,background=0.7 (default: every request interactive)",
    )
    p.add_argument("--slo-ttft-ms", type=_positive(float), default=None, help="override every tier's TTFT target")
    p.add_argument("--slo-tpot-ms", type=_positive(float), default=None, help="override every tier's TPOT target")
    p.add_argument("--max-requests", type=_positive(int), default=None)
    p.add_argument(
        "--duration",
        type=_positive(float),
        default=None,
        metavar="S",
        help="send no request arriving at or after S seconds",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="after the last send, wait at most S s for in-flight requests (default 60)",
    )
    p.add_argument("--request-timeout", type=_positive(float), default=300.0, metavar="S")
    p.add_argument(
        "--concurrency-limit",
        type=_positive(int),
        default=None,
        help="at most N requests in flight; later ones wait (their wait counts in TTFT)",
    )
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    p.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="text")
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="text prompts: assume one token per word instead of measuring it with two requests",
    )
    p.add_argument("--max-prompt-tokens", type=_positive(int), default=None)
    p.add_argument("--max-output-tokens", type=_positive(int), default=None)
    p.add_argument("--prompt-tokens", type=_positive(int), default=256, help="--poisson/--gamma fixed prompt length")
    p.add_argument("--output-tokens", type=_positive(int), default=64, help="--poisson/--gamma fixed output length")
    p.add_argument(
        "--lengths-from",
        default=None,
        metavar="TRACE",
        help="--poisson/--gamma: draw (prompt, output) lengths from this trace instead",
    )
    p.add_argument(
        "--bucket-spread-ms",
        type=float,
        default=DEFAULT_BUCKET_SPREAD_MS,
        help="requests sharing a timestamp (Mooncake ~3 s buckets, BurstGPT whole seconds) are spread over this many ms, for BurstGPT at most up to the next stamp (0 = fire at once)",
    )
    # Two extensions are on by default: ignore_eos (vLLM, SGLang, nitsum) makes outputs exactly as long as the
    # workload says; return_token_ids (nitsum, recent vLLM) gives every token its own time even when a chunk's
    # text is empty (a partial UTF-8 character) or holds several tokens. Turn them off for strict servers.
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (for servers that reject it)",
    )
    p.add_argument(
        "--no-token-ids",
        dest="return_token_ids",
        action="store_false",
        help="do not send return_token_ids; count one token per non-empty text chunk",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="report directory (default runs/load-<time>)")
    p.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="live progress bar on stderr (auto: when stderr is a terminal)",
    )
    return p


async def discover_model(url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    """The first model id of GET /v1/models; raises RuntimeError with the reason otherwise."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(
                url.rstrip("/") + "/v1/models", headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"GET /v1/models answered HTTP {resp.status}; pass --model")
                data = await resp.json()
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise RuntimeError(f"cannot reach {url}: {exc!r}") from exc
    models = data.get("data") or []
    if not models:
        raise RuntimeError("GET /v1/models listed no model; pass --model")
    return str(models[0]["id"])


async def _calibrate(cfg: ClientConfig) -> PromptScale:
    """Measured text-prompt scale; on failure a warning and one token per word (the run still goes ahead)."""
    try:
        async with aiohttp.ClientSession() as session:
            return await calibrate_prompt(session, cfg)
    except RuntimeError as exc:
        sys.stderr.write(f"nitsum load: warning: {exc}; assuming one token per word\n")
        return PromptScale()


def build_specs(args: argparse.Namespace) -> list:
    max_n = args.max_requests
    if args.trace:
        reqs = read_trace(
            args.trace, limit=max_n, bucket_spread_ms=args.bucket_spread_ms, duration_s=args.duration, seed=args.seed
        )
    else:
        lengths = read_trace(args.lengths_from, bucket_spread_ms=args.bucket_spread_ms) if args.lengths_from else None
        kind, rate, cv = ("gamma", *args.gamma) if args.gamma else ("poisson", args.poisson, 1.0)
        # Generated before time scaling, so a duration bound is stretched to cover the scaled window.
        dur = None if args.duration is None else args.duration / args.time_scale
        reqs = synthetic(
            kind,
            rate,
            cv=cv,
            num_requests=max_n,
            duration_s=dur,
            seed=args.seed,
            lengths=lengths,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
        )
    shaping = Shaping(
        tier_mix=args.tier_mix,
        time_scale=args.time_scale,
        target_rate_per_s=args.target_rate,
        max_requests=max_n,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        seed=args.seed,
    )
    return shape(reqs, shaping)


def _meta(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"}
    meta.update(extra)
    return meta


async def run(args: argparse.Namespace, specs: list) -> int:
    """Send the workload (`build_specs(args)`, read before anything is contacted) and write the report."""
    model = args.model or await discover_model(args.url, args.api_key)
    cfg = ClientConfig(
        base_url=args.url,
        model=model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        request_timeout_s=args.request_timeout,
        ignore_eos=args.ignore_eos,
        return_token_ids=args.return_token_ids,
        prompt_format=args.prompt_format,
    )
    if args.calibrate and args.prompt_format == "text":
        cfg = dataclasses.replace(cfg, prompt_scale=await _calibrate(cfg))
    if not specs:
        sys.stderr.write("nitsum load: the workload is empty (check --trace / --duration / --max-requests)\n")
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):  # no signal handlers off the main thread
        loop.add_signal_handler(signal.SIGINT, stop.set)
    counters = Counters()
    show = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    bar = ProgressBar(counters, sys.stderr) if show else None
    if bar:
        bar.start()
    started = time.time()
    try:
        result = await run_open_loop(
            specs,
            cfg,
            duration_s=args.duration,
            concurrency_limit=args.concurrency_limit,
            drain_timeout_s=args.drain_timeout,
            stop=stop,
            counters=counters,
        )
    finally:
        if bar:
            await bar.stop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGINT)
    records = [t.to_record() for t in result.trackers]
    report = summarize(records)
    out = args.out or Path("runs") / time.strftime("load-%Y%m%d-%H%M%S")
    meta = _meta(
        args,
        model=model,
        prompt_scale=dataclasses.asdict(cfg.prompt_scale),
        started_unix_s=started,
        elapsed_s=result.elapsed_s,
        interrupted=result.interrupted,
        planned_requests=len(specs),
        sent_requests=len(records),
    )
    write_all(report, records, out, meta, log_rows=(t.to_log() for t in result.trackers))
    print(format_table(report))
    note = " (interrupted: partial report)" if result.interrupted else ""
    print(f"sent {len(records)} of {len(specs)} planned requests in {result.elapsed_s:.1f} s{note}; report in {out}")
    return 130 if result.interrupted else 0


def report_from_log(args: argparse.Namespace) -> int:
    records = read_lifecycle_log(args.from_log)
    report = summarize(records)
    if args.out:
        write_all(report, records, args.out, _meta(args, source_log=str(args.from_log)))
    print(format_table(report))
    return 0


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.from_log:
        if not args.from_log.is_file():
            parser.error(f"--from-log: no such file {args.from_log}")
        try:
            return report_from_log(args)
        except ValueError as exc:
            parser.error(str(exc))
    if not (args.trace or args.poisson or args.gamma):
        parser.error("choose a workload: --trace NAME, --poisson RATE or --gamma RATE,CV")
    if args.lengths_from and args.trace:
        parser.error("--lengths-from is for --poisson/--gamma")
    if args.prompt_format == "token-ids" and args.endpoint != "completions":
        parser.error("--prompt-format token-ids needs --endpoint completions")
    try:
        # The workload first: a trace that cannot be read is refused before anything is sent.
        specs = build_specs(args)
    except (ValueError, FileNotFoundError) as exc:
        sys.stderr.write(f"nitsum load: {exc}\n")
        return 2
    try:
        return asyncio.run(run(args, specs))
    except FileNotFoundError as exc:
        sys.stderr.write(f"nitsum load: {exc}\n")
        return 2
    except RuntimeError as exc:
        sys.stderr.write(f"nitsum load: {exc}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

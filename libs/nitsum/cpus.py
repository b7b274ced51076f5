"""Where the mesh's processes run: CPU lists (`NITSUM_CPUS`), pinning a process to one, and the placement
`nitsum up --cpu-affinity auto` gives its children.

A worker's step thread computes while the rest of the mesh (its own event loop, the gateway, nats-server, the
coordinator, the client) handles the tokens it produced. Left to the kernel, those processes land on the step's
core and the step runs slower for it: on the 2-vCPU test VM one worker's live TPOT was 1.42-1.61x the engine's
own step with every process floating, and 1.14-1.20x with the worker on a core of its own and the rest on the
other (docs/BENCHMARKS.md, issue 23). GPU serving stacks pin their engine processes for the same reason (NUMA-local
cores per GPU). Linux only; elsewhere a CPU list is refused with a clear error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MAX_CPU = 4096  # a CPU number above this is a typo, not a machine


def cpu_list_error(text: str) -> str | None:
    """None when `text` is empty or a CPU list as taskset and cpuset write it ("1", "0-3", "2,5-7"); else why not."""
    try:
        parse_cpu_list(text)
    except ValueError as exc:
        return str(exc)
    return None


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The CPUs of a list like "0-3,6" (sorted, each once); "" -> (). ValueError names the bad part."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            if text.strip():
                raise ValueError(f"must be a CPU list such as 1 or 0-3,6; {text!r} has an empty entry")
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"must be a CPU list such as 1 or 0-3,6; {part!r} is not a CPU number or range")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first > last:
            raise ValueError(f"CPU range {part!r} runs backwards")
        if last > MAX_CPU:
            raise ValueError(f"CPU {last} is above {MAX_CPU}")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus) -> str:
    """The shortest CPU list for these CPUs: (0, 1, 2, 5) -> "0-2,5"."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (what taskset, a cgroup cpuset or a container gave it)."""
    if not hasattr(os, "sched_getaffinity"):
        return tuple(range(os.cpu_count() or 1))
    return tuple(sorted(os.sched_getaffinity(0)))


def pin_process(cpus: tuple[int, ...]) -> None:
    """Run this process, every thread it has and every thread it starts later, on `cpus` only.

    Threads started before the call (torch's, the interpreter's) are moved one by one: sched_setaffinity acts on
    one thread, and later ones inherit from the thread that starts them. ValueError when the list asks for a CPU
    this process may not use, or the platform cannot pin."""
    if not cpus:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("this platform cannot pin a process to CPUs (Linux only)")
    missing = sorted(set(cpus) - set(allowed_cpus()))
    if missing:
        raise ValueError(
            f"CPU {format_cpu_list(missing)} is not among the CPUs this process may use ({format_cpu_list(allowed_cpus())})"
        )
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


@dataclass(frozen=True)
class Placement:
    """`nitsum up`'s CPU lists: one CPU of its own per worker, the rest for every other process."""

    workers: tuple[str, ...]  # NITSUM_CPUS of worker i
    others: str  # NITSUM_CPUS of the gateway(s), coordinator, flow-scheduler and nats-server


def plan_placement(allowed: tuple[int, ...], workers: int, per_worker: int = 1) -> Placement | None:
    """Workers on the last `workers` x `per_worker` CPUs, `per_worker` each (a worker's torch threads,
    NITSUM_TORCH_THREADS); everything else on the CPUs before them. None when fewer CPUs are left than one for the
    rest: a shared core would then be pinned, which is worse than letting the kernel move the processes."""
    cpus = sorted(set(allowed))
    need = workers * per_worker
    if workers < 1 or per_worker < 1 or len(cpus) < need + 1:
        return None
    first = len(cpus) - need
    mine = [format_cpu_list(cpus[first + i * per_worker : first + (i + 1) * per_worker]) for i in range(workers)]
    return Placement(tuple(mine), format_cpu_list(cpus[:first]))

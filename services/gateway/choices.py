"""The n choices of one request: each its own `Generation`, read together as one stream of (choice index, delta)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from nitsum.wire.messages import SamplingSpec
from nitsum_services.gateway.generation import Generation, GenerationError

log = logging.getLogger("nitsum.gateway")


async def choice_deltas(gens: list[Generation]):
    """(choice index, Delta) from every generation as they come; the first is already started, the
    others start once it has produced its first token (or finished). Raises the first GenerationError."""
    if len(gens) == 1:  # no pump task and queue between the stream and the response: one hop less per token
        async for item in _single_deltas(gens[0]):
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    prefilled = asyncio.Event()

    async def pump(i: int, gen: Generation) -> None:
        try:
            if i > 0:
                await prefilled.wait()
                await gen.start()
            async for delta in gen.deltas():
                prefilled.set()
                queue.put_nowait((i, delta))
            queue.put_nowait((i, None))
        except GenerationError as exc:
            queue.put_nowait((i, exc))
        except Exception as exc:  # a bug must end the request with an error, not leave it waiting
            log.exception("%s: choice %d failed", gen.request_id, i)
            queue.put_nowait((i, GenerationError(500, "gateway_error", f"{type(exc).__name__}: {exc}")))
        finally:
            prefilled.set()

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    reason = "request_ended"
    try:
        running = len(gens)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, GenerationError):
                raise item
            else:
                yield i, item
    except asyncio.CancelledError:
        reason = "client_disconnected"
        raise
    finally:
        for gen in gens:  # a failed sibling (or a disconnect) ends them all
            if gen.worker_id and not gen.finished:
                await gen.abort(reason)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _single_deltas(gen: Generation):
    """`choice_deltas` of one generation, read in the handler's own task (same errors, same abort at the end)."""
    reason = "request_ended"
    try:
        async for delta in gen.deltas():
            yield 0, delta
    except GenerationError:
        raise
    except asyncio.CancelledError:
        reason = "client_disconnected"
        raise
    except Exception as exc:  # a bug must end the request with an error, not leave it waiting
        log.exception("%s: choice 0 failed", gen.request_id)
        raise GenerationError(500, "gateway_error", f"{type(exc).__name__}: {exc}") from None
    finally:
        if gen.worker_id and not gen.finished:
            await gen.abort(reason)


def choice_sampling(spec: SamplingSpec, index: int) -> SamplingSpec:
    """Choice `index` of n: a given seed is advanced by the index (choices differ, yet reproducibly)."""
    if index == 0 or spec.seed is None:
        return spec
    seed = (spec.seed + index + (1 << 63)) % (1 << 64) - (1 << 63)
    return replace(spec, seed=seed)

"""The NATS connection every service uses.

- reconnects forever (a restarted nats-server is picked up without restarting the service); given the
  members of a NATS cluster (NITSUM_NATS_URL comma-separated; members the servers announce are added),
  it uses the first reachable URL of the list (list a host's own server first), moves to the next member
  when its server goes, re-subscribes there, and sends what was published
  meanwhile (kept in a PENDING_BYTES buffer). Core NATS is at most once: a frame the lost server had
  taken but not forwarded is gone; the protocols above cover it (indexed stream chunks re-routed from
  the last token on a gap, heartbeats, request timeouts);
- `request` always has a timeout and turns an `ErrorReply` into a typed `RemoteError`;
- `subscribe` decodes frames strictly: an undecodable frame is dropped and counted (and answered with
  an ErrorReply when the sender waits for one), never a crash; queue groups spread worker pools;
- W3C trace context rides in NATS headers both ways;
- `round_trip` proves the connection hears the server now (a message to itself, then its handlers run);
- `drain` on stop lets in-flight handlers finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import context as otel_context

from nitsum.config import CommonConfig, nats_urls
from nitsum.natsserver import inbox_prefix
from nitsum.telemetry.metrics import Metrics
from nitsum.telemetry.tracing import extract_context, inject_headers
from nitsum.wire import DecodeError, decode, encode
from nitsum.wire.messages import ErrorReply
from nitsum.wire.subjects import Subjects

log = logging.getLogger("nitsum.bus")

# Publishes made while reconnecting are buffered up to this size (nats-py's default is 2 MiB, below one
# max_payload frame of 8 MB), then sent to the server the connection moved to.
PENDING_BYTES = 64 * 1024 * 1024


class BusError(Exception):
    code = "bus_error"


class BusTimeout(BusError):
    code = "timeout"


class NoResponders(BusError):
    code = "no_responders"


class RemoteError(BusError):
    """The peer answered with an ErrorReply."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(f"{reply.code}: {reply.message}")
        self.reply = reply
        self.code = reply.code


@dataclass
class Delivery:
    """What a handler knows about the message besides its payload."""

    subject: str
    reply: str
    headers: dict[str, str]


Handler = Callable[[Any, Delivery], Awaitable[Any]]


class Bus:
    def __init__(self, nc: NATS, subjects: Subjects, metrics: Metrics | None, name: str) -> None:
        self.nc = nc
        self.subjects = subjects
        self.metrics = metrics
        self.name = name
        self._tasks: set[asyncio.Task] = set()
        self._subscriptions: weakref.WeakSet = weakref.WeakSet()  # gone once unsubscribed and dropped
        self._echo_subject = ""
        self._echo_waiters: dict[bytes, asyncio.Future] = {}
        self._echo_seq = 0
        self.reconnects = 0
        self.disconnects = 0

    @classmethod
    async def connect(
        cls,
        config: CommonConfig,
        name: str,
        metrics: Metrics | None = None,
        connect_deadline_s: float = 30.0,
    ) -> Bus:
        """Connect, retrying until `connect_deadline_s` (the server may still be starting)."""
        holder: dict[str, Bus] = {}

        async def on_error(exc: Exception) -> None:
            log.warning("%s: NATS error: %s", name, exc)

        async def on_disconnected() -> None:
            if "bus" in holder:
                holder["bus"].disconnects += 1
            log.warning("%s: disconnected from NATS; reconnecting", name)

        async def on_reconnected() -> None:
            if "bus" in holder:
                holder["bus"].reconnects += 1
                log.info("%s: reconnected to NATS at %s", name, holder["bus"].server)
            else:
                log.info("%s: reconnected to NATS", name)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_deadline_s
        last_error: Exception | None = None
        while True:
            nc = NATS()
            try:
                await nc.connect(
                    servers=nats_urls(config.nats_url),
                    name=name,
                    user=config.nats_user or None,
                    password=config.nats_password or None,
                    # Replies to this identity's requests come to its own inbox prefix (a worker's identity may
                    # read no other: nitsum.natsserver.worker_permissions).
                    inbox_prefix=inbox_prefix(config.nats_user),
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.25,
                    pending_size=PENDING_BYTES,
                    dont_randomize=True,  # the list's order is the preference
                    connect_timeout=2,
                    ping_interval=5,
                    max_outstanding_pings=3,
                    error_cb=on_error,
                    disconnected_cb=on_disconnected,
                    reconnected_cb=on_reconnected,
                )
                break
            except Exception as exc:  # nats-py raises several types for "cannot connect"
                last_error = exc
                if "Authorization" in str(exc) or "authorization" in str(exc):
                    raise BusError(
                        f"{name}: NATS refused the credentials for user {config.nats_user!r}: {exc}"
                    ) from None
                if loop.time() > deadline:
                    raise BusError(f"{name}: cannot connect to NATS at {config.nats_url}: {last_error}") from None
                await asyncio.sleep(0.25)
        bus = cls(nc, Subjects(config.namespace), metrics, name)
        holder["bus"] = bus
        return bus

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    @property
    def server(self) -> str:
        """host:port of the NATS server this connection uses now ('' while disconnected); never credentials."""
        url = self.nc.connected_url if self.nc.is_connected else None
        return f"{url.hostname}:{url.port}" if url is not None and url.hostname else ""

    async def publish(self, subject: str, message: Any, headers: dict[str, str] | None = None) -> None:
        await self.nc.publish(subject, encode(message), headers=inject_headers(headers))

    async def publish_raw(self, subject: str, payload: bytes, headers: dict[str, str] | None = None) -> None:
        await self.nc.publish(subject, payload, headers=inject_headers(headers))

    async def flush(self, timeout_s: float = 2.0) -> None:
        await self.nc.flush(timeout=timeout_s)

    async def round_trip(self, timeout_s: float) -> None:
        """A message to this connection's own inbox and back through the server, then a turn of the event loop
        for every message that came in before it: on return, everything the server had sent this connection
        before it saw the echo has been handed to this Bus's handlers (in-order handlers have run it).
        Raises BusTimeout when the echo does not come back in time (the server or this process stalled, or
        the connection is down), BusError when it cannot be sent.

        Not `nc.flush`: nats-py (2.16) cancels a timed-out flush's PONG future, and the late PONG then
        raises in its reader task, which stops reading for good. A late echo here is simply ignored.
        """
        loop = asyncio.get_running_loop()
        if not self._echo_subject:
            subject = self.nc.new_inbox()

            async def on_echo(msg: Msg) -> None:
                waiter = self._echo_waiters.pop(msg.data, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)

            try:
                await self.nc.subscribe(subject, cb=on_echo)
            except (nats.errors.Error, ConnectionError) as exc:  # closed or draining: said as the Bus says it
                raise BusError(f"{self.name}: cannot reach NATS: {exc}") from None
            self._echo_subject = subject  # only once subscribed: a failed attempt is retried next time
        self._echo_seq += 1
        token = str(self._echo_seq).encode()
        waiter = loop.create_future()
        self._echo_waiters[token] = waiter
        try:
            await self.nc.publish(self._echo_subject, token)
            await asyncio.wait_for(waiter, timeout=timeout_s)
        except TimeoutError:
            raise BusTimeout(f"{self.name}: no round trip through NATS within {timeout_s:.3g} s") from None
        except nats.errors.Error as exc:
            raise BusError(f"{self.name}: cannot reach NATS: {exc}") from None
        finally:
            self._echo_waiters.pop(token, None)
        # Each subscription dispatches from its own queue in its own task: let them catch up to the echo.
        for _ in range(1000):
            await asyncio.sleep(0)
            if not any(sub.pending_msgs for sub in list(self._subscriptions)):
                break
        await asyncio.sleep(0)  # the last message taken from a queue finishes its (synchronous) handling

    async def request(self, subject: str, message: Any, timeout_s: float, expected: type | tuple | None = None) -> Any:
        """Send and wait for one answer; raises BusTimeout, NoResponders, RemoteError or DecodeError."""
        try:
            msg = await self.nc.request(subject, encode(message), timeout=timeout_s, headers=inject_headers())
        except NoRespondersError:
            raise NoResponders(f"no service listens on {subject}") from None
        except (TimeoutError, NatsTimeoutError):
            raise BusTimeout(f"no answer on {subject} within {timeout_s:.3g} s") from None
        reply = decode(msg.data)
        if isinstance(reply, ErrorReply):
            raise RemoteError(reply)
        if expected is not None and not isinstance(reply, expected):
            raise DecodeError(f"{subject}: unexpected answer {type(reply).__name__}", "unexpected_kind")
        return reply

    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        queue: str = "",
        expected: type | tuple | None = None,
        concurrent: bool = False,
    ):
        """Call `handler(message, delivery)` for every valid frame; a returned message is sent as the reply.

        With `concurrent=True` each message runs in its own task (request handlers that await other
        services); otherwise messages are handled in order (stats, stream chunks).
        """

        async def on_msg(msg: Msg) -> None:
            try:
                message = decode(msg.data, expected)
            except DecodeError as exc:
                self._count_drop(subject, exc.code)
                log.warning("%s: dropped frame on %s: %s", self.name, msg.subject, exc)
                if msg.reply:
                    await self._answer(msg, ErrorReply(code="bad_frame", message=str(exc)))
                return
            if concurrent:
                task = asyncio.create_task(self._handle(handler, message, msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                await self._handle(handler, message, msg)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        self._subscriptions.add(sub)
        return sub

    async def subscribe_json(self, subject: str, handler: Callable[[Any, Delivery], Awaitable[Any]], queue: str = ""):
        """Admin subjects: JSON in (empty payload = {}), JSON out."""

        async def on_msg(msg: Msg) -> None:
            try:
                body = json.loads(msg.data.decode() or "{}") if msg.data.strip() else {}
                if not isinstance(body, dict):
                    raise ValueError("the request must be a JSON object")
            except (ValueError, UnicodeDecodeError) as exc:
                self._count_drop(subject, "bad_json")
                answer: Any = {"ok": False, "error": {"code": "bad_json", "message": str(exc)}}
            else:
                delivery = Delivery(msg.subject, msg.reply or "", dict(msg.headers or {}))
                token = otel_context.attach(extract_context(delivery.headers))
                try:
                    answer = await handler(body, delivery)
                except Exception as exc:  # an admin bug must answer, not hang the caller
                    log.exception("%s: admin handler for %s failed", self.name, msg.subject)
                    answer = {"ok": False, "error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}}
                finally:
                    otel_context.detach(token)
            if msg.reply:
                await self.nc.publish(msg.reply, json.dumps(answer, default=str).encode())

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    async def request_json(self, subject: str, body: dict, timeout_s: float) -> dict:
        try:
            msg = await self.nc.request(subject, json.dumps(body).encode(), timeout=timeout_s)
        except NoRespondersError:
            raise NoResponders(f"no service listens on {subject}") from None
        except (TimeoutError, NatsTimeoutError):
            raise BusTimeout(f"no answer on {subject} within {timeout_s:.3g} s") from None
        return json.loads(msg.data.decode())

    async def _handle(self, handler: Handler, message: Any, msg: Msg) -> None:
        delivery = Delivery(msg.subject, msg.reply or "", dict(msg.headers or {}))
        token = otel_context.attach(extract_context(delivery.headers))
        try:
            answer = await handler(message, delivery)
        except Exception as exc:  # answered as a coded error, never as success
            log.exception("%s: handler for %s failed", self.name, msg.subject)
            answer = ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}") if msg.reply else None
        finally:
            otel_context.detach(token)
        if answer is not None and msg.reply:
            await self._answer(msg, answer)

    async def _answer(self, msg: Msg, answer: Any) -> None:
        try:
            await self.nc.publish(msg.reply, encode(answer), headers=inject_headers())
        except Exception as exc:  # the asker may be gone; its own timeout covers it
            log.warning("%s: could not answer on %s: %s", self.name, msg.reply, exc)

    def _count_drop(self, subject: str, code: str) -> None:
        if self.metrics is not None:
            self.metrics.dropped_frames_total().labels(subject=subject, code=code).inc()

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Stop taking messages, let handlers in flight finish, then close."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=timeout_s)
        except (TimeoutError, nats.errors.Error, ConnectionError) as exc:
            log.warning("%s: drain incomplete (%s); closing", self.name, exc)
            await self.nc.close()

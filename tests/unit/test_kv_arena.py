"""KV arenas (shm.Arena): a worker's cache memory kept across TP changes, mapped by other processes of
the host through /proc/<pid>/fd/<fd> (no name in /dev/shm). Real segments, a real second process."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import uuid

import pytest
import torch

from nitsum.node import kv_hosts
from nitsum.transfer import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")


def _name() -> str:
    return shm.segment_name(f"t{uuid.uuid4().hex[:8]}", 0, 0) + "-arena"


def test_an_arena_leaves_no_name_and_another_process_maps_it_by_its_handle():
    name = _name()
    arena = shm.Arena.create(name, 1 << 20)
    try:
        assert name not in shm.leftovers()  # unlinked at once: only the descriptor holds it
        cache = arena.view((4, 8, 16), torch.float32)
        cache[1, 2, 3] = 5.0
        code = (
            f"import torch; from nitsum.transfer import shm; "
            f"t = shm.attach_handle({arena.handle!r}, (4, 8, 16), torch.float32, {os.getpid()}); "
            f"assert t[1, 2, 3].item() == 5.0; t[3, 7, 15] = 9.0"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        assert cache[3, 7, 15].item() == 9.0  # one-sided: the other process wrote straight into it
        # A later change's cache of another shape reuses the same memory (what was there stays).
        other = arena.view((2, 16, 16), torch.float32)
        assert other.data_ptr() == cache.data_ptr()
        with pytest.raises(AssertionError, match="does not fit"):
            arena.view((1 << 20,), torch.float32)
    finally:
        arena.close()
        arena.close()  # idempotent
    assert arena.fd is None


def test_a_handle_that_is_not_an_arena_of_that_process_is_refused(tmp_path):
    arena = shm.Arena.create(_name(), 4096)
    try:
        with pytest.raises(OSError, match="not a KV arena handle"):
            shm.attach_handle(arena.handle, (16,), torch.float32, os.getpid() + 1)  # another pid
        with pytest.raises(OSError, match="not a KV arena handle"):
            shm.attach_handle("/etc/passwd", (16,), torch.float32, os.getpid())
        with pytest.raises(OSError, match="less than"):
            shm.attach_handle(arena.handle, (2048,), torch.float32, os.getpid())  # 8 kB > 4 kB
        plain = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
        try:  # a descriptor of this process, but no KV segment
            with pytest.raises(OSError, match="not a KV segment"):
                shm.attach_handle(f"/proc/{os.getpid()}/fd/{plain}", (1,), torch.float32, os.getpid())
        finally:
            os.close(plain)
    finally:
        arena.close()


def test_arenas_are_handed_only_to_workers_of_the_same_pid_namespace():
    def member(rank, host, pidns):
        return kv_hosts.Member(rank, host, True, "cpu", "auto", "127.0.0.1", 5000 + rank, 100 + rank, pidns)

    same = (member(0, "a", 7), member(1, "a", 7), member(2, "b", 9))  # rank 2 is on another host
    assert kv_hosts.maps_arenas_of(same, 0) and kv_hosts.maps_arenas_of(same, 2)
    mixed = (member(0, "a", 7), member(1, "a", 8))  # containers sharing /dev/shm, not their pids
    assert not kv_hosts.maps_arenas_of(mixed, 0) and not kv_hosts.maps_arenas_of(mixed, 1)
    assert not kv_hosts.maps_arenas_of((member(0, "a", 0),), 0)  # unknown namespace: never
    assert kv_hosts.Member.decode(same[1].encode()) == same[1]


def test_arenas_are_handed_only_to_workers_that_can_open_their_proc_fds():
    def member(rank):
        return kv_hosts.Member(rank, "a", True, "cpu", "auto", "127.0.0.1", 5000 + rank, 100 + rank, 7)

    members = (member(0), member(1), member(2))
    # Rank 1 can read everyone's /proc/<pid>/fd; ranks 0 and 2 cannot read rank 1's (hidepid, another user).
    readers = (frozenset({2}), frozenset({0, 2}), frozenset({0}))
    assert kv_hosts.maps_arenas_of(members, 0, readers) and kv_hosts.maps_arenas_of(members, 2, readers)
    assert not kv_hosts.maps_arenas_of(members, 1, readers)  # it makes fresh named segments instead
    assert kv_hosts.maps_arenas_of(members, 1)  # (the namespaces alone would have allowed it)


def test_the_proc_fd_probe_says_whose_descriptors_this_process_may_open():
    assert kv_hosts.can_read_fds(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert kv_hosts.can_read_fds(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not kv_hosts.can_read_fds(child.pid)  # gone
    if os.geteuid() != 0:
        return
    # Another user id may not open root's descriptors: the probe, run as `nobody` in a forked child, says so.
    parent = os.getpid()
    r, w = os.pipe()
    answer = "timeout"
    pid = os.fork()
    if pid == 0:  # the child: only os calls, and it never returns into pytest
        try:
            try:
                os.setgid(65534)
                os.setuid(65534)
            except OSError as exc:
                os.write(w, f"skip {exc}".encode())
            else:
                os.write(w, f"{kv_hosts.can_read_fds(parent)} {kv_hosts.can_read_fds(os.getpid())}".encode())
        except BaseException as exc:  # noqa: BLE001 -- whatever happens is reported to the parent
            try:
                os.write(w, f"error {exc}".encode())
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 30.0)
        answer = os.read(r, 4096).decode() if ready else "timeout"
    finally:
        os.close(r)
        if answer == "timeout":
            os.kill(pid, 9)
        os.waitpid(pid, 0)
    if answer.startswith("skip"):
        pytest.skip(f"cannot become another user here: {answer}")
    assert answer == "False True"

"""Shared-memory collectives of a CPU TP group (nitsum.parallel.shm_collectives): real processes mapping one
/dev/shm segment, real futex waits. Results against plain torch arithmetic; faults (a member that died, one
that hangs, a group torn down) must raise, never hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid

import pytest
import torch

from nitsum.parallel import shm_collectives as sc

pytestmark = [
    pytest.mark.skipif(not sc.supported(), reason="shared-memory collectives need x86-64 Linux"),
    pytest.mark.timeout(120),
]

SLOT = 8192  # small, so that the tests' payloads take several rounds


def _path() -> str:
    return f"{sc.SHM_DIR}/nitsum-tpc-test-{uuid.uuid4().hex[:10]}"


def _open(path: str, rank: int, size: int, timeout_s: float = 30.0) -> sc.ShmChannel:
    if rank == 0:
        return sc.ShmChannel(path, 0, size, create=True, slot_bytes=SLOT, timeout_s=timeout_s)
    deadline = time.monotonic() + 30
    while True:
        try:
            return sc.ShmChannel(path, rank, size, create=False, slot_bytes=SLOT, timeout_s=timeout_s)
        except (FileNotFoundError, sc.ChannelError):  # not created (or not sized) yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _collectives(path, rank, size, out):
    torch.set_num_threads(1)
    ch = _open(path, rank, size)
    gen = torch.Generator().manual_seed(100 + rank)
    res = {}
    big = torch.randn(5000, generator=gen)  # 20 kB: three rounds of 8 kB
    res["big"] = ch.all_reduce(big.clone())
    res["bf16"] = ch.all_reduce(torch.randn(3, 700, generator=gen).to(torch.bfloat16))
    base = torch.randn(4, 6, generator=gen)
    res["noncontig"] = ch.all_reduce(base.t())  # a transposed view: reduced in place all the same
    res["gather"] = ch.all_gather(torch.full((3, 2), float(rank)), dim=-1)
    res["gather_big"] = ch.all_gather(torch.arange(3000, dtype=torch.float32) + rank * 10_000, dim=0)
    payload = bytes([rank]) * (rank * 9000)  # 0, 9000, 18000 bytes: zero, two and three rounds
    res["bytes"] = ch.all_gather_bytes(payload)
    res["bcast"] = ch.broadcast_bytes(b"plan-" * 3000 if rank == 0 else None)
    ch.barrier()
    res["rounds"] = ch.rounds
    out.put((rank, {k: (v.float().tolist() if isinstance(v, torch.Tensor) else v) for k, v in res.items()}))


def _run(target, size, *extra, timeout_s=60):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    path = _path()
    procs = [ctx.Process(target=target, args=(path, r, size, out, *extra)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=timeout_s) for _ in range(size))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        if os.path.exists(path):
            os.unlink(path)
    return results


@pytest.mark.parametrize("size", [2, 3, 4])
def test_collectives_match_torch_and_agree_bitwise_on_every_member(size):
    res = _run(_collectives, size)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(size)]
    inputs = [
        [
            torch.randn(5000, generator=g),
            torch.randn(3, 700, generator=g).to(torch.bfloat16),
            torch.randn(4, 6, generator=g),
        ]
        for g in gens
    ]
    # Summed in rank order on every member, so every member holds the same bits.
    for key in ("big", "bf16", "noncontig"):
        assert all(res[r][key] == res[0][key] for r in range(size)), key
    want = inputs[0][0].clone()
    for x in inputs[1:]:
        want += x[0]
    assert torch.equal(torch.tensor(res[0]["big"]), want)
    want_bf = inputs[0][1].clone()
    for x in inputs[1:]:
        want_bf += x[1]
    assert torch.equal(torch.tensor(res[0]["bf16"]), want_bf.float())
    assert torch.allclose(torch.tensor(res[0]["noncontig"]), sum(x[2] for x in inputs).t())
    assert res[1]["gather"] == torch.cat([torch.full((3, 2), float(r)) for r in range(size)], dim=-1).tolist()
    assert res[0]["gather_big"] == torch.cat([torch.arange(3000.0) + r * 10_000 for r in range(size)]).tolist()
    assert all(res[r]["bytes"] == [bytes([j]) * (j * 9000) for j in range(size)] for r in range(size))
    assert all(res[r]["bcast"] == b"plan-" * 3000 for r in range(size))
    assert len({res[r]["rounds"] for r in range(size)}) == 1 and res[0]["rounds"] > 10  # chunked, in step


def _dies(path, rank, size, out):
    ch = _open(path, rank, size)
    if rank == 1:
        ch.barrier()
        os._exit(0)  # gone without a word, in the middle of the group's life
    ch.barrier()
    t0 = time.monotonic()
    try:
        ch.all_reduce(torch.ones(4))
        out.put((rank, "no error"))
    except sc.ChannelError as exc:
        out.put((rank, (str(exc), time.monotonic() - t0)))


def test_a_member_that_died_makes_the_others_raise_not_hang():
    ctx = mp.get_context("fork")
    out, path = ctx.Queue(), _path()
    procs = [ctx.Process(target=_dies, args=(path, r, 2, out)) for r in range(2)]
    for p in procs:
        p.start()
    procs[1].join(30)  # reaped: no zombie left for the survivor's check to see
    try:
        rank, (message, waited) = out.get(timeout=30)
    finally:
        for p in procs:
            p.join(10)
        os.unlink(path)
    assert rank == 0 and "rank 1" in message and "exited" in message
    assert waited < 20  # found by its pid, long before the 30 s timeout


def _hangs(path, rank, size, out):
    ch = _open(path, rank, size, timeout_s=0.5)
    if rank == 1:
        time.sleep(5)  # alive, but never comes
        out.put((rank, "slept"))
        return
    try:
        ch.barrier()
        out.put((rank, "no error"))
    except sc.ChannelError as exc:
        out.put((rank, str(exc)))


def test_a_member_that_never_comes_times_out():
    res = _run(_hangs, 2)
    assert "timed out" in res[0] and res[1] == "slept"


def _aborted(path, rank, size, out):
    ch = _open(path, rank, size)
    ch.barrier()
    if rank == 1:
        time.sleep(0.3)
        ch.abort()  # this member tears the group down: whoever waits in it raises
        out.put((rank, "aborted"))
        return
    messages = []
    for call in (lambda: ch.all_gather_bytes(b"x"), ch.barrier):
        try:
            call()
            messages.append("no error")
        except sc.ChannelError as exc:
            messages.append(str(exc))
    out.put((rank, messages))


def test_abort_wakes_a_waiting_member_and_the_group_stays_down():
    res = _run(_aborted, 2)
    assert res[1] == "aborted"
    assert len(res[0]) == 2 and all("torn down" in m for m in res[0])


def test_bad_arguments_and_segments_are_refused(tmp_path):
    path = _path()
    with pytest.raises(ValueError, match="members"):
        sc.ShmChannel(path, 2, 2, create=True)
    with pytest.raises(ValueError, match="multiple of 4096"):
        sc.ShmChannel(path, 0, 2, create=True, slot_bytes=1000)
    ch = sc.ShmChannel(path, 0, 2, create=True, slot_bytes=SLOT)
    try:
        with pytest.raises(FileExistsError):
            sc.ShmChannel(path, 0, 2, create=True, slot_bytes=SLOT)  # never two creators of one name
        with pytest.raises(sc.ChannelError, match="expected"):
            sc.ShmChannel(path, 1, 2, create=False, slot_bytes=2 * SLOT)  # members disagree on its layout
    finally:
        ch.close()
        os.unlink(path)
    with pytest.raises(sc.ChannelError, match="torn down"):
        ch.barrier()  # closed here: no round


def test_names_are_unique_and_carry_the_world_and_group():
    a, b = sc.create_name("p29400", 0, 4), sc.create_name("p29400", 0, 4)
    assert a != b and a.startswith(sc.NAME_PREFIX + "p29400-g0x4-")


MISMATCHES = {
    # a bug on one side: another collective
    "collective": lambda ch, rank: ch.all_reduce(torch.ones(8)) if rank == 0 else ch.all_gather_bytes(b"a step plan"),
    # the same collective, different sizes
    "size": lambda ch, rank: ch.all_reduce(torch.ones(8 if rank == 0 else 4)),
}


def _mismatched(path, rank, size, out, kind):
    ch = _open(path, rank, size)
    try:
        MISMATCHES[kind](ch, rank)
        out.put((rank, "no error"))
    except sc.ChannelError as exc:
        out.put((rank, str(exc)))


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_members_in_different_collectives_or_sizes_raise_instead_of_mixing_their_data(kind):
    res = _run(_mismatched, 2, kind)
    assert all("another collective" in res[r] for r in (0, 1)), res


def test_a_creator_that_fails_leaves_no_name(monkeypatch):
    path = _path()

    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sc.os, "posix_fallocate", no_room)
    with pytest.raises(OSError, match="No space"):
        sc.ShmChannel(path, 0, 2, create=True, slot_bytes=SLOT)
    assert not os.path.exists(path)  # nobody else knew the name: it does not stay in /dev/shm

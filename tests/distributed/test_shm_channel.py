"""ShmChannel: ordering and integrity under load, slow readers, timeouts, aborts, cleanup."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import random
import secrets
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rtp.distributed import shm_channel
from rtp.distributed.shm_channel import (
    PIECE_HEADER_BYTES,
    ChannelAborted,
    ChannelTimeout,
    ShmChannel,
)
from rtp.distributed.shm_segment import cleanup_stale_segments, make_segment_name
from rtp.errors import RtpError

pytestmark = pytest.mark.timeout(120)

CTX = mp.get_context("fork")
SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def prefix() -> Iterator[str]:
    """A name prefix unique to this test; afterwards nothing with it may remain in /dev/shm."""
    pfx = f"rtpt{secrets.token_hex(3)}_"
    yield pfx
    leftovers = sorted(p.name for p in SHM.glob(pfx + "*"))
    for name in leftovers:
        (SHM / name).unlink(missing_ok=True)
    assert leftovers == [], f"segments left behind: {leftovers}"


# ---------------------------------------------------------------- helpers


def _messages(seed: int, count: int, chunk_bytes: int) -> Iterator[bytes]:
    """Deterministic message stream: mostly small, some up to a chunk, a few spanning several chunks."""
    rng = random.Random(seed)
    for _ in range(count):
        r = rng.random()
        if r < 0.90:
            size = rng.randint(1, 64)
        elif r < 0.98:
            size = rng.randint(65, chunk_bytes)
        else:
            size = rng.randint(chunk_bytes + 1, 4 * chunk_bytes)
        yield rng.randbytes(size)


def _digest_update(digest: hashlib._Hash, msg: bytes) -> None:
    digest.update(len(msg).to_bytes(8, "little"))
    digest.update(msg)


def _reader_main(name: str, index: int, seed: int, count: int, chunk_bytes: int, results, slow: bool = False) -> None:
    """Read ``count`` messages, compare each with the regenerated stream, report (index, first bad, digest, error)."""
    try:
        ch = ShmChannel.attach(name, index, timeout=30)
        digest, first_bad = hashlib.blake2b(), None
        pause = random.Random(1000 + index)
        for i, expected in enumerate(_messages(seed, count, chunk_bytes)):
            got = ch.read(timeout=60)
            if got != expected and first_bad is None:
                first_bad = i
            _digest_update(digest, got)
            if slow and pause.random() < 0.2:
                time.sleep(pause.random() * 0.003)
        end = ch.read(timeout=60)  # the writer ends with an empty message
        ch.close()
        results.put((index, first_bad, digest.hexdigest(), None if end == b"" else f"bad end marker {end!r}"))
    except BaseException as exc:  # report instead of dying silently
        results.put((index, None, None, repr(exc)))


def _write_stream(ch: ShmChannel, seed: int, count: int, chunk_bytes: int) -> str:
    digest = hashlib.blake2b()
    for msg in _messages(seed, count, chunk_bytes):
        ch.write(msg, timeout=60)
        _digest_update(digest, msg)
    ch.write(b"", timeout=60)
    return digest.hexdigest()


def _collect(results, procs: list, n: int) -> list[tuple]:
    out = [results.get(timeout=100) for _ in range(n)]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.terminate()
    return sorted(out, key=lambda r: r[0])


def _check_readers(out: list[tuple], expected_digest: str) -> None:
    for index, first_bad, digest, error in out:
        assert error is None, f"reader {index}: {error}"
        assert first_bad is None, f"reader {index}: message {first_bad} differs"
        assert digest == expected_digest, f"reader {index}: digest mismatch"


# ---------------------------------------------------------------- integrity


def test_100k_messages_through_a_tiny_ring(prefix: str) -> None:
    name, chunk, count, readers = make_segment_name(prefix), 4096, 100_000, 3
    results = CTX.Queue()
    with ShmChannel.create(name, num_readers=readers, chunk_bytes=chunk, num_chunks=2) as w:
        procs = [CTX.Process(target=_reader_main, args=(name, i, 7, count, chunk, results)) for i in range(readers)]
        for p in procs:
            p.start()
        expected = _write_stream(w, 7, count, chunk)
        _check_readers(_collect(results, procs, readers), expected)
    assert all(p.exitcode == 0 for p in procs)


def test_slow_reader_never_loses_a_message(prefix: str) -> None:
    name, chunk, count = make_segment_name(prefix), 256, 1500
    results = CTX.Queue()
    with ShmChannel.create(name, num_readers=2, chunk_bytes=chunk, num_chunks=2) as w:
        procs = [
            CTX.Process(target=_reader_main, args=(name, 0, 11, count, chunk, results)),
            CTX.Process(target=_reader_main, args=(name, 1, 11, count, chunk, results, True)),
        ]
        for p in procs:
            p.start()
        expected = _write_stream(w, 11, count, chunk)
        _check_readers(_collect(results, procs, 2), expected)


def _writer_main(ch: ShmChannel, seed: int, count: int, chunk: int, results) -> None:
    try:
        results.put(("w", seed, _write_stream(ch, seed, count, chunk)))
    except BaseException as exc:
        results.put(("w", seed, repr(exc)))


def test_two_channels_in_parallel(prefix: str) -> None:
    chunk, count = 512, 3000
    names = [make_segment_name(prefix), make_segment_name(prefix)]
    assert names[0] != names[1]
    writers = [ShmChannel.create(n, num_readers=1, chunk_bytes=chunk, num_chunks=3) for n in names]
    try:
        wres, rres = CTX.Queue(), CTX.Queue()
        # Forked writers use the inherited writer ends; readers attach by name. Different seeds per channel.
        procs = [CTX.Process(target=_writer_main, args=(writers[i], 100 + i, count, chunk, wres)) for i in range(2)]
        procs += [CTX.Process(target=_reader_main, args=(names[i], 0, 100 + i, count, chunk, rres)) for i in range(2)]
        for p in procs:
            p.start()
        written = {seed: digest for _, seed, digest in (wres.get(timeout=100) for _ in range(2))}
        got = [rres.get(timeout=100) for _ in range(2)]
        for p in procs:
            p.join(timeout=30)
        # Both readers are index 0, so match them to their channel by the digest of their own seed.
        assert sorted(written) == [100, 101]
        for _, first_bad, _digest, error in got:
            assert error is None and first_bad is None
        assert sorted(d for _, _, d, _ in got) == sorted(written.values())
        assert all(p.exitcode == 0 for p in procs)
        # The forked writers' unlink() was a no-op: the segments still exist until the creator unlinks.
        assert all((SHM / n).exists() for n in names)
    finally:
        for w in writers:
            w.close()
            w.unlink()


@pytest.mark.parametrize("num_chunks", [1, 2, 3])
@pytest.mark.parametrize("chunk_bytes", [PIECE_HEADER_BYTES + 1, 100, 4096])
def test_message_sizes_from_zero_to_many_rings(prefix: str, num_chunks: int, chunk_bytes: int) -> None:
    cap = chunk_bytes - PIECE_HEADER_BYTES  # payload bytes per chunk
    ring = num_chunks * chunk_bytes
    sizes = [0, 1, cap - 1, cap, cap + 1, 2 * cap, ring, 10 * ring + 3, 0, 5]
    rng = random.Random(chunk_bytes * 10 + num_chunks)
    msgs = [rng.randbytes(max(s, 0)) for s in sizes]
    name = make_segment_name(prefix)
    with ShmChannel.create(name, num_readers=2, chunk_bytes=chunk_bytes, num_chunks=num_chunks) as w:
        readers = [ShmChannel.attach(name, i, timeout=5) for i in range(2)]
        got: list[list[bytes]] = [[], []]
        threads = [
            threading.Thread(target=lambda i=i: got[i].extend(readers[i].read(timeout=30) for _ in msgs))
            for i in range(2)
        ]
        for t in threads:
            t.start()
        for m in msgs:
            w.write(memoryview(m) if len(m) % 2 else m, timeout=30)
        for t in threads:
            t.join(timeout=60)
        for r in readers:
            r.close()
    assert got == [msgs, msgs]


def _publish_counter_early(w: ShmChannel, msg: bytes, delay: float) -> None:
    """Write ``msg`` (one piece) the way a weakly ordered CPU may show it: counter first, data ``delay`` s later."""
    lay, k = w._layout, w._next_piece
    c = (k - 1) % lay.num_chunks
    base = lay.data_off + c * lay.chunk_bytes
    saved = bytes(w._buf[base : base + lay.chunk_bytes])
    w.write(msg)  # the real write, then roll the chunk's bytes back, keeping the counter published
    fresh = bytes(w._buf[base : base + lay.chunk_bytes])
    w._buf[base : base + lay.chunk_bytes] = saved
    if delay >= 0:
        time.sleep(delay)
        w._buf[base : base + lay.chunk_bytes] = fresh


def test_reader_waits_for_data_published_after_its_counter(prefix: str) -> None:
    name = make_segment_name(prefix)
    with ShmChannel.create(name, num_readers=1, chunk_bytes=128, num_chunks=1) as w:
        r = ShmChannel.attach(name, 0)
        w.write(b"first")
        assert r.read(timeout=1) == b"first"
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(r.read(timeout=5)))
        t.start()
        # The chunk still holds piece 1 ("first"): a stale piece number, then a crc mismatch on the new one.
        _publish_counter_early(w, b"second", delay=0.1)
        t.join(timeout=10)
        assert got == [b"second"]
        r.close()


def test_piece_that_never_checks_out_is_reported(prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_channel, "_STALE_PIECE_LIMIT_S", 0.1)
    name = make_segment_name(prefix)
    with ShmChannel.create(name, num_readers=1, chunk_bytes=128, num_chunks=2) as w:
        r = ShmChannel.attach(name, 0)
        _publish_counter_early(w, b"never arrives", delay=-1)
        with pytest.raises(RtpError, match="corrupted"):
            r.read(timeout=5)
        r.close()


# ------------------------------------------------------- timeouts and aborts


def test_reader_timeout_and_abort(prefix: str) -> None:
    name = make_segment_name(prefix)
    with ShmChannel.create(name, num_readers=1, chunk_bytes=64, num_chunks=2) as w:
        r = ShmChannel.attach(name, 0)
        t0 = time.monotonic()
        with pytest.raises(ChannelTimeout):
            r.read(timeout=0.2)
        assert 0.2 <= time.monotonic() - t0 < 2.0
        calls: list[float] = []

        def abort_later() -> bool:
            calls.append(time.monotonic())
            return len(calls) >= 3

        t0 = time.monotonic()
        with pytest.raises(ChannelAborted):
            r.read(timeout=10, should_abort=abort_later)
        assert time.monotonic() - t0 < 1.0  # polled at least every ~50 ms
        # A timed-out read left the channel usable.
        w.write(b"after", timeout=1)
        assert r.read(timeout=1) == b"after"
        r.close()


def _attach_and_exit(name: str) -> None:
    ShmChannel.attach(name, 0, timeout=10).close()


def test_writer_blocked_by_dead_reader(prefix: str) -> None:
    name = make_segment_name(prefix)
    with ShmChannel.create(name, num_readers=1, chunk_bytes=64, num_chunks=2) as w:
        reader = CTX.Process(target=_attach_and_exit, args=(name,))
        reader.start()
        reader.join(timeout=30)
        assert reader.exitcode == 0
        assert not w.peers_alive()  # the attached reader's pid is gone
        w.write(b"a")  # the ring holds two unconsumed pieces...
        w.write(b"b")
        with pytest.raises(ChannelTimeout):  # ...the third has nowhere to go
            w.write(b"c", timeout=0.2)
        t0 = time.monotonic()
        with pytest.raises(ChannelAborted):
            w.write(b"c", should_abort=lambda: not w.peers_alive())
        assert time.monotonic() - t0 < 1.0
        # Interrupted before its first piece: still usable. Interrupted mid-message: broken, says so.
        with pytest.raises(ChannelTimeout):
            w.write(b"c", timeout=0.05)
    name = make_segment_name(prefix)
    with ShmChannel.create(name, num_readers=1, chunk_bytes=64, num_chunks=2) as w:
        with pytest.raises(ChannelTimeout):
            w.write(bytes(200), timeout=0.1)  # 2 pieces fit, the 3rd blocks
        with pytest.raises(RtpError, match="broken"):
            w.write(b"x", timeout=0.1)


def _idle_reader(name: str, results) -> None:
    ch = ShmChannel.attach(name, 0, timeout=10)
    t_cpu, t_wall = time.process_time(), time.monotonic()
    try:
        ch.read(timeout=1.0)
        results.put(None)
    except ChannelTimeout:
        results.put((time.process_time() - t_cpu, time.monotonic() - t_wall))
    ch.close()


def test_idle_reader_barely_uses_cpu(prefix: str) -> None:
    name = make_segment_name(prefix)
    results = CTX.Queue()
    with ShmChannel.create(name, num_readers=1, chunk_bytes=64, num_chunks=2):
        p = CTX.Process(target=_idle_reader, args=(name, results))
        p.start()
        res = results.get(timeout=30)
        p.join(timeout=10)
    assert res is not None, "read returned data that was never written"
    cpu, wall = res
    assert wall >= 1.0
    assert cpu / wall < 0.2, f"idle reader used {cpu / wall:.0%} of a core"


# ------------------------------------------------------- lifetime and cleanup


def test_stale_segment_cleanup(prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                  capture_output=True, text=True, check=True).stdout)
    stale_name = f"{prefix}{dead_pid}_{secrets.token_hex(6)}"
    stale = ShmChannel.create(stale_name, num_readers=1, chunk_bytes=64, num_chunks=1)
    live = ShmChannel.create(make_segment_name(prefix), num_readers=1, chunk_bytes=64, num_chunks=1)
    other = SHM / f"{prefix}not_our_scheme"
    other.write_bytes(b"x")
    try:
        with caplog.at_level(logging.WARNING, logger="rtp.distributed.shm_segment"):
            removed = cleanup_stale_segments(prefix)
        assert removed == [stale_name]
        assert not (SHM / stale_name).exists()
        assert (SHM / live.name).exists() and other.exists()
        assert stale_name in caplog.text
        assert cleanup_stale_segments(prefix) == []
    finally:
        other.unlink(missing_ok=True)
        for ch in (stale, live):
            ch.close()
            ch.unlink()  # already removed for `stale`: must not raise
            ch.unlink()


def test_separate_reader_process_does_not_unlink_or_warn(prefix: str) -> None:
    # A reader in its own interpreter has its own resource_tracker: had attach() registered the
    # segment, that tracker would unlink it and warn about a leak when the reader exits.
    name = make_segment_name(prefix)
    code = textwrap.dedent(f"""
        from rtp.distributed.shm_channel import ShmChannel
        ch = ShmChannel.attach({name!r}, 0, timeout=20)
        print(ch.read(timeout=20).decode())
        ch.close()
    """)
    with ShmChannel.create(name, num_readers=2, chunk_bytes=64, num_chunks=2) as w:
        w.write(b"hello")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "hello"
        assert "leaked" not in proc.stderr and "resource_tracker" not in proc.stderr, proc.stderr
        assert (SHM / name).exists()
        late = ShmChannel.attach(name, 1, timeout=5)  # the segment is intact for everyone else
        assert late.read(timeout=1) == b"hello"
        late.close()
    assert not (SHM / name).exists()


def _child_unlinks(ch: ShmChannel) -> None:
    ch.unlink()


def test_context_manager_and_forked_copy_unlink(prefix: str) -> None:
    name = make_segment_name(prefix)
    with ShmChannel.create(name, num_readers=1, chunk_bytes=64, num_chunks=2) as w:
        p = CTX.Process(target=_child_unlinks, args=(w,))
        p.start()
        p.join(timeout=30)
        assert (SHM / name).exists(), "a forked copy of the writer removed the segment"
    assert not (SHM / name).exists()
    w.close()  # idempotent after __exit__
    w.unlink()
    with pytest.raises(RtpError, match="closed"):
        w.write(b"x")


def test_argument_validation_and_roles(prefix: str) -> None:
    name = make_segment_name(prefix)
    assert name.startswith(f"{prefix}{os.getpid()}_")
    for kwargs in (
        dict(num_readers=0, chunk_bytes=64, num_chunks=2),
        dict(num_readers=1, chunk_bytes=PIECE_HEADER_BYTES, num_chunks=2),
        dict(num_readers=1, chunk_bytes=64, num_chunks=0),
        dict(num_readers=1.5, chunk_bytes=64, num_chunks=2),
        dict(num_readers=True, chunk_bytes=64, num_chunks=2),
    ):
        with pytest.raises(ValueError):
            ShmChannel.create(name, **kwargs)
    with pytest.raises(ValueError):
        ShmChannel.create("a/b", num_readers=1, chunk_bytes=64, num_chunks=2)
    with pytest.raises(ValueError):
        make_segment_name("bad/prefix")
    with pytest.raises(ChannelTimeout):
        ShmChannel.attach(make_segment_name(prefix), 0, timeout=0.1)
    with ShmChannel.create(name, num_readers=2, chunk_bytes=64, num_chunks=2) as w:
        with pytest.raises(FileExistsError):
            ShmChannel.create(name, num_readers=2, chunk_bytes=64, num_chunks=2)
        with pytest.raises(ValueError, match="reader_index"):
            ShmChannel.attach(name, 2)
        r = ShmChannel.attach(name, 1)
        with pytest.raises(RtpError):
            r.write(b"x")
        with pytest.raises(RtpError):
            w.read(timeout=0.01)
        with pytest.raises(RtpError):
            r.unlink()
        assert r.creator_pid == os.getpid() and r.peers_alive() and w.peers_alive()
        r.close()
        r.close()
        with pytest.raises(RtpError, match="closed"):
            r.read(timeout=0.01)

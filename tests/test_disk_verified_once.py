"""The disk tier's verified-once reads: a chunk file whose identity (device, inode, size, mtime
and ctime) is unchanged since a read verified it is read without hashing, and any change to it
makes the next read hash it again (a corrupt file is then a miss).

Files written by a test are seconds old at most, so the tier would take every one of them for
"racy" (changed too recently for its timestamps to show a later change, see
``chunkfile.may_trust``).  Tests that need files old enough to be trusted say so by setting the
tier's ``clock_offset_ns`` (the file system's clock minus this host's) an hour ahead: the files
then look an hour old, without any sleep.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import xxhash

from lmprefetch.memory import Arena
from lmprefetch.tiers import chunkfile
from lmprefetch.tiers.disk import HEADER_BYTES, DiskTier

from .disk_tiers import (
    SLOT_BYTES,
    TIMEOUT_S,
    OsProxy,
    file_of,
    key,
    load,
    opened,
    payload,
    store,
)
from .tier_io import checked_arena

HOUR_NS = 3600 * 10**9
N = 4  # chunks per test


class _HashSpy:
    """Stands in for the ``xxhash`` module inside ``chunkfile``: counts the payloads hashed by
    reads (each hashed read makes one streaming ``xxh3_64``), and the one-shot hashes (of
    writes, and of a trusted read's bytes when its file changed during the read)."""

    def __init__(self) -> None:
        self.hashed_reads = 0
        self.one_shot = 0
        self._lock = threading.Lock()

    def xxh3_64(self) -> Any:
        with self._lock:
            self.hashed_reads += 1
        return xxhash.xxh3_64()

    def xxh3_64_intdigest(self, data: Any) -> int:
        with self._lock:
            self.one_shot += 1
        return xxhash.xxh3_64_intdigest(data)


@pytest.fixture
def arena() -> Iterator[Arena]:
    with checked_arena(SLOT_BYTES, 16) as a:
        yield a


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> _HashSpy:
    s = _HashSpy()
    monkeypatch.setattr(chunkfile, "xxhash", s)
    return s


def aged(tier: DiskTier) -> DiskTier:
    """Make every file of ``tier`` look an hour old (see the module docstring)."""
    tier.clock_offset_ns = HOUR_NS
    return tier


def keys() -> list[Any]:
    return [key(h) for h in range(N)]


async def until_the_clock_passes(path: Path) -> None:
    """Wait until the file system stamps a change later than ``path``'s last one.

    The tests make files look old (see the module docstring), but they are not: a change in
    the same tick of the file system's coarse clock as the write would leave the file's
    timestamps as they were, which is exactly the racy case a really old file cannot have.
    A probe file shows the file system's clock."""
    st = await trio.Path(path).stat()
    newest = max(st.st_mtime_ns, st.st_ctime_ns)
    probe = trio.Path(path.with_name("clock-probe"))
    with trio.fail_after(5):
        while True:
            await probe.write_bytes(b"")
            if (await probe.stat()).st_mtime_ns > newest:
                break
            await trio.sleep(0.001)
    await probe.unlink()


async def change(fn: Callable[[Path], None], path: Path) -> None:
    """Change the file at ``path`` with ``fn``, in a thread, once the clock has moved on."""
    await until_the_clock_passes(path)
    await trio.to_thread.run_sync(fn, path)


async def exists(path: Path) -> bool:
    return await trio.Path(path).exists()


async def verified_then_trusted(tier: DiskTier, arena: Arena, spy: _HashSpy) -> None:
    """Load every chunk twice: the first load hashes each file, the second none."""
    assert await load(tier, arena, keys()) == [payload(h) for h in range(N)]
    assert (spy.hashed_reads, tier.verified_reads, tier.trusted_reads) == (N, N, 0)
    assert await load(tier, arena, keys()) == [payload(h) for h in range(N)]
    assert (spy.hashed_reads, tier.verified_reads, tier.trusted_reads) == (N, N, N)


# -- the rule ---------------------------------------------------------------------------------
def test_may_trust_only_files_older_than_the_racy_window() -> None:
    ident = chunkfile.FileIdentity(1, 2, 3, mtime_ns=10 * 10**9, ctime_ns=11 * 10**9)
    newest = ident.ctime_ns
    assert chunkfile.may_trust(ident, newest + chunkfile.RACY_NS)
    assert not chunkfile.may_trust(ident, newest + chunkfile.RACY_NS - 1)
    # The newer of the two timestamps counts, whichever it is.
    later_mtime = ident._replace(mtime_ns=20 * 10**9)
    assert not chunkfile.may_trust(later_mtime, newest + chunkfile.RACY_NS)
    assert chunkfile.may_trust(later_mtime, 20 * 10**9 + chunkfile.RACY_NS)
    # A file "from the future" (a clock ahead of ours) is never trusted.
    assert not chunkfile.may_trust(ident, ident.mtime_ns - 1)


async def test_the_file_systems_clock_is_measured_when_the_tier_opens(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            # A local file system stamps files with this host's clock (coarsely).
            assert abs(tier.clock_offset_ns) < chunkfile.RACY_NS


# -- verified once ----------------------------------------------------------------------------
@pytest.mark.parametrize("o_direct", [False, True])
async def test_a_file_verified_once_is_read_unhashed_while_unchanged(
    tmp_path: Path, arena: Arena, spy: _HashSpy, o_direct: bool
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, o_direct=o_direct) as tier:
            await store(tier, arena, range(N))
            writes = spy.one_shot
            await verified_then_trusted(aged(tier), arena, spy)
            # Still unchanged: still unhashed, and a prefix of them too.
            assert await load(tier, arena, keys()[:2]) == [payload(0), payload(1)]
            assert (spy.hashed_reads, tier.trusted_reads) == (N, N + 2)
            assert tier.stats.chunks_loaded == 2 * N + 2
            assert spy.one_shot == writes  # nothing was hashed after all


def _rewrite_same_size(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 100] ^= 0x01
    with open(path, "r+b") as f:  # in place: same inode
        f.write(raw)


def _rewrite_keeping_mtime(path: Path) -> None:
    st = path.stat()
    _rewrite_same_size(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def _replace_by_rename(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x80
    tmp = path.with_name("elsewhere")
    tmp.write_bytes(bytes(raw))
    os.replace(tmp, path)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


_CHANGES = {
    "rewritten_same_size": _rewrite_same_size,
    "mtime_restored_with_utime": _rewrite_keeping_mtime,
    "replaced_by_rename": _replace_by_rename,
    "truncated": _truncate,
}


@pytest.mark.parametrize("how", sorted(_CHANGES))
async def test_a_verified_file_that_changes_is_verified_again_and_a_corrupt_one_misses(
    tmp_path: Path, arena: Arena, spy: _HashSpy, how: str
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, read_threads=1) as tier:
            await store(tier, arena, range(N))
            await verified_then_trusted(aged(tier), arena, spy)
            path = Path(file_of(tmp_path, key(2)))
            await change(_CHANGES[how], path)
            assert await load(tier, arena, keys()) == [payload(0), payload(1)]
            assert spy.hashed_reads == N + 1  # the changed file was hashed, the others not
            assert not tier.contains_now(key(2)) and not await exists(path)
            assert tier.corrupt_files_removed == 1 and tier.stats.errors == 1
            # The chunk stored again is a new file: verified on its first read, then trusted.
            await store(tier, arena, [2])
            assert await load(tier, arena, keys()) == [payload(h) for h in range(N)]
            assert spy.hashed_reads == N + 2
            assert await load(tier, arena, keys()) == [payload(h) for h in range(N)]
            assert spy.hashed_reads == N + 2


async def test_a_file_replaced_by_a_valid_copy_is_verified_again_and_loads(
    tmp_path: Path, arena: Arena, spy: _HashSpy
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, range(N))
            await verified_then_trusted(aged(tier), arena, spy)

            def replace_by_a_copy(path: Path) -> None:
                copy = path.with_name("copy")
                copy.write_bytes(path.read_bytes())
                os.replace(copy, path)

            await change(replace_by_a_copy, Path(file_of(tmp_path, key(1))))
            assert await load(tier, arena, keys()) == [payload(h) for h in range(N)]
            assert (spy.hashed_reads, tier.verified_reads) == (N + 1, N + 1)
            assert tier.stats.errors == 0


async def test_a_racy_file_is_verified_on_every_read_until_it_is_old_enough(
    tmp_path: Path, arena: Arena, spy: _HashSpy
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, range(N))
            tier.clock_offset_ns = 0  # files written a moment ago: racy
            for reads in (1, 2, 3):
                assert await load(tier, arena, keys()) == [payload(h) for h in range(N)]
                assert (spy.hashed_reads, tier.trusted_reads) == (reads * N, 0)
            await verified_then_trusted_after(aged(tier), arena, spy, already=3 * N)


async def verified_then_trusted_after(
    tier: DiskTier, arena: Arena, spy: _HashSpy, *, already: int
) -> None:
    assert await load(tier, arena, keys()) == [payload(h) for h in range(N)]
    assert spy.hashed_reads == already + N
    assert await load(tier, arena, keys()) == [payload(h) for h in range(N)]
    assert (spy.hashed_reads, tier.trusted_reads) == (already + N, N)


@pytest.mark.parametrize("verified_when", ["racy", "old"])
async def test_a_change_that_the_timestamps_cannot_show_is_caught_while_racy(
    tmp_path: Path, arena: Arena, spy: _HashSpy, monkeypatch: pytest.MonkeyPatch,
    verified_when: str,
) -> None:
    """A change within one tick of the file system's timestamps leaves the identity as it
    was; here ``fstat`` is made to report the identity from before the change.  A file
    verified while it was racy was never trusted, so the change is caught; that is what the
    racy rule is for (with a file verified when old, the same change goes unhashed)."""
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, read_threads=1) as tier:
            await store(tier, arena, range(N))
            tier.clock_offset_ns = HOUR_NS if verified_when == "old" else 0
            assert await load(tier, arena, keys()) == [payload(h) for h in range(N)]
            assert spy.hashed_reads == N
            path = Path(file_of(tmp_path, key(1)))
            before = await trio.Path(path).stat()
            await trio.to_thread.run_sync(_rewrite_same_size, path)
            frozen = SimpleNamespace(
                st_dev=before.st_dev, st_ino=before.st_ino, st_size=before.st_size,
                st_mtime_ns=before.st_mtime_ns, st_ctime_ns=before.st_ctime_ns,
            )
            monkeypatch.setattr(chunkfile, "os", OsProxy({
                "fstat": lambda fd: frozen if os.fstat(fd).st_ino == before.st_ino
                else os.fstat(fd),
            }))
            got = await load(tier, arena, keys())
            if verified_when == "racy":
                assert got == [payload(0)]
                assert spy.hashed_reads == N + 2  # 0 and 1 hashed again; 2, 3 not read
                assert not await exists(path) and tier.corrupt_files_removed == 1
            else:
                assert len(got) == N and spy.hashed_reads == N  # trusted: not hashed


async def test_a_trusted_file_changed_during_its_read_is_hashed_after_all(
    tmp_path: Path, arena: Arena, spy: _HashSpy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunkfile, "PIECE_BYTES", 4096)  # a chunk: 4 pieces
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, read_threads=1) as tier:
            await store(tier, arena, range(N))
            await verified_then_trusted(aged(tier), arena, spy)
            path = Path(file_of(tmp_path, key(1)))
            await until_the_clock_passes(path)
            writes = spy.one_shot
            real_read_into = chunkfile._read_into
            changed: list[int] = []

            def read_into(
                fd: int, views: Any, expected: int, offset: int = 0, flags: int = 0
            ) -> int:
                got = real_read_into(fd, views, expected, offset, flags)
                if not changed and os.fstat(fd).st_ino == path.stat().st_ino:
                    changed.append(offset)  # after the first piece: change a later one
                    with open(path, "r+b") as f:
                        f.seek(HEADER_BYTES + SLOT_BYTES - 10)
                        f.write(b"0123456789")
                return got

            monkeypatch.setattr(chunkfile, "_read_into", read_into)
            assert await load(tier, arena, keys()) == [payload(0)]
            assert changed == [0]
            assert spy.hashed_reads == N  # no streaming hash: the read was trusted
            assert spy.one_shot == writes + 1  # but the bytes that landed were checked
            assert not await exists(path) and tier.corrupt_files_removed == 1


async def test_trust_lasts_only_as_long_as_the_tier_and_the_key(
    tmp_path: Path, arena: Arena, spy: _HashSpy
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, range(N))
            await verified_then_trusted(aged(tier), arena, spy)
            # Removed and stored again: the new file is hashed on its first read.
            assert await tier.remove(key(0))
            assert key(0) not in tier._trusted  # no record outlives its key
            await store(tier, arena, [0])
            assert await load(tier, arena, keys()) == [payload(h) for h in range(N)]
            assert spy.hashed_reads == N + 1
        async with opened(tmp_path) as tier:  # a restart remembers no verification
            await verified_then_trusted_after(aged(tier), arena, spy, already=N + 1)


def test_a_chunk_file_read_reports_its_identity(tmp_path: Path) -> None:
    final = str(tmp_path / "c.kv")
    data = payload(3, 5000)
    chunkfile.write_file(final, final + ".tmp", b"k", memoryview(data))
    slot = bytearray(SLOT_BYTES)
    first = chunkfile.read_buffered(final, b"k", memoryview(slot))
    st = os.stat(final)
    assert first == (5000, chunkfile.FileIdentity.of(st), True, False)  # not encoded
    assert first.identity == (st.st_dev, st.st_ino, HEADER_BYTES + 5000, st.st_mtime_ns,
                              st.st_ctime_ns)
    again = chunkfile.read_buffered(final, b"k", memoryview(slot), None, first.identity)
    assert again == (5000, first.identity, False, False)
    assert bytes(slot[:5000]) == data
    # The header is checked on a trusted read too: another key is a miss.
    with pytest.raises(chunkfile.FileCorrupt, match="another key"):
        chunkfile.read_buffered(final, b"x", memoryview(slot), None, first.identity)


async def test_verify_once_off_hashes_every_read(
    tmp_path: Path, arena: Arena, spy: _HashSpy
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, range(N))
            aged(tier).verify_once = False
            for reads in (1, 2, 3):
                assert await load(tier, arena, keys()) == [payload(h) for h in range(N)]
                assert (spy.hashed_reads, tier.trusted_reads) == (reads * N, 0)
            tier.verify_once = True  # the files were verified all along: trusted at once
            assert await load(tier, arena, keys()) == [payload(h) for h in range(N)]
            assert (spy.hashed_reads, tier.trusted_reads) == (3 * N, N)

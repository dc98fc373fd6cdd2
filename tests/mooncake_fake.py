"""An in-process stand-in for Mooncake's ``MooncakeDistributedStore``, for the tests that need
no Mooncake processes (they run everywhere, without the package or a network namespace).

Objects live in a :class:`FakePool` that several fake clients share (several engines, one
store).  Transfers really go to and from the addresses the tier passes (``ctypes.memmove``),
and only inside memory registered with the client, as RDMA would require: so the tier's
zero-copy address arithmetic and its registration of the arena are what these tests check.
Result codes follow Mooncake's (``mooncake-store/include/types.h``); :class:`FakePool` has
knobs to inject them.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmprefetch.tiers.mooncake_store import MooncakeStore

OK = 0
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
NO_AVAILABLE_HANDLE = -200
RPC_FAIL = -900


class FakePool:
    """What a master and its segments hold: the objects, and the faults to inject.

    Knobs (each maps an object name to the code a call returns for it, or is one code for
    every name): ``exist_codes``, ``get_codes``, ``put_codes``; ``leased`` names cannot be
    removed; ``setup_codes`` are returned by successive ``setup`` calls (then 0);
    ``raise_in`` names methods that raise ``RuntimeError`` (as a binding error would).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, bytes] = {}
        self.exist_codes: dict[str, int] = {}
        self.get_codes: dict[str, int] = {}
        self.put_codes: dict[str, int] = {}
        self.leased: set[str] = set()
        self.setup_codes: list[int] = []
        self.raise_in: set[str] = set()
        self.clients: list[FakeStore] = []
        self.calls: list[str] = []

    def factory(self) -> Callable[[], MooncakeStore]:
        """What the tier's ``store_factory`` takes (mypy checks the fake against the tier's
        :class:`~lmprefetch.tiers.mooncake_store.MooncakeStore` here: ``nox -s types``)."""

        def make() -> FakeStore:
            store = FakeStore(self)
            with self.lock:
                self.clients.append(store)
            return store

        return make


class FakeStore:
    """One client of a :class:`FakePool` (the methods the tier calls, nothing more)."""

    def __init__(self, pool: FakePool) -> None:
        self.pool = pool
        self.regions: dict[int, int] = {}  # address -> size
        self.registrations = 0
        self.set_up = False
        self.closed = False
        self.setup_args: tuple[Any, ...] = ()

    def _call(self, name: str) -> None:
        self.pool.calls.append(name)
        if name in self.pool.raise_in:
            raise RuntimeError(f"fake {name} failed")
        if self.closed:
            raise RuntimeError(f"{name} on a closed client")

    def _registered(self, address: int, size: int) -> bool:
        return any(
            start <= address and address + size <= start + length
            for start, length in self.regions.items()
        )

    def setup(self, *args: Any) -> int:
        self._call("setup")
        self.setup_args = args
        with self.pool.lock:
            rc = self.pool.setup_codes.pop(0) if self.pool.setup_codes else OK
        self.set_up = rc == OK
        return rc

    def register_buffer(self, address: int, size: int) -> int:
        self._call("register_buffer")
        self.regions[address] = size
        self.registrations += 1
        return OK

    def unregister_buffer(self, address: int) -> int:
        self._call("unregister_buffer")
        return OK if self.regions.pop(address, None) is not None else INVALID_PARAMS

    def batch_is_exist(self, names: list[str]) -> list[int]:
        self._call("batch_is_exist")
        pool = self.pool
        with pool.lock:
            return [pool.exist_codes.get(n, 1 if n in pool.objects else 0) for n in names]

    def batch_get_into(self, names: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        self._call("batch_get_into")
        out = []
        pool = self.pool
        for name, address, size in zip(names, addresses, sizes, strict=True):
            with pool.lock:
                code = pool.get_codes.get(name)
                data = pool.objects.get(name)
            if code is not None:
                out.append(code)
            elif data is None:
                out.append(OBJECT_NOT_FOUND)
            elif len(data) > size or not self._registered(address, size):
                out.append(INVALID_PARAMS)
            else:
                ctypes.memmove(address, data, len(data))
                out.append(len(data))
        return out

    def batch_put_from(self, names: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        self._call("batch_put_from")
        out = []
        pool = self.pool
        for name, address, size in zip(names, addresses, sizes, strict=True):
            with pool.lock:
                code = pool.put_codes.get(name)
            if code is not None:
                out.append(code)
            elif size < 1 or not self._registered(address, size):
                out.append(INVALID_PARAMS)
            else:
                data = ctypes.string_at(address, size)
                with pool.lock:
                    pool.objects.setdefault(name, data)  # immutable, as Mooncake's
                out.append(OK)
        return out

    def remove(self, name: str) -> int:
        self._call("remove")
        pool = self.pool
        with pool.lock:
            if name in pool.leased:
                return OBJECT_HAS_LEASE
            return OK if pool.objects.pop(name, None) is not None else OBJECT_NOT_FOUND

    def close(self) -> int:
        self._call("close")
        self.closed = True
        return OK

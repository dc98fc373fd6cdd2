"""Mooncake's client as the Mooncake tier uses it: its calls, their result codes, the
environment that bounds its waits, and whether it is installed.

:class:`MooncakeStore` is what :mod:`lmprefetch.tiers.mooncake` calls on a
``mooncake.store.MooncakeDistributedStore`` (blocking calls: worker threads only); mypy checks
the tests' fake (``tests/mooncake_fake.py``) against it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Final, Protocol

__all__ = [
    "INVALID_PARAMS",
    "MISSING",
    "OBJECT_ALREADY_EXISTS",
    "OBJECT_HAS_LEASE",
    "MooncakeStore",
    "check_installed",
    "code_name",
    "set_environment",
]

# Mooncake's result codes (mooncake-store/include/types.h) that the tier tells apart.
INVALID_PARAMS: Final = -600  # batch_get_into: the object is larger than the buffer
REPLICA_IS_NOT_READY: Final = -703  # being written
OBJECT_NOT_FOUND: Final = -704
OBJECT_ALREADY_EXISTS: Final = -705
OBJECT_HAS_LEASE: Final = -706
REPLICA_NOT_FOUND: Final = -710
REPLICA_IS_GONE: Final = -712
#: Codes that mean "not there (any more)": a hole, not an error.
MISSING: Final = frozenset(
    {OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, REPLICA_NOT_FOUND, REPLICA_IS_GONE}
)
CODE_NAMES: Final = {
    -1: "INTERNAL_ERROR", -200: "NO_AVAILABLE_HANDLE", -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT",
}  # fmt: skip


def code_name(rc: int) -> str:
    """``rc`` with its Mooncake name, for a log line."""
    return f"{rc} ({CODE_NAMES.get(rc, 'error')})"


def set_environment(timeout_s: float, metadata_server: str, local_host: str) -> None:
    """Bound Mooncake's own waits by ``timeout_s`` (see "Deadlines" in
    :mod:`lmprefetch.tiers.mooncake`), and give it the
    address to advertise, where the environment does not set them already.  Process-wide: the
    first tier of a process sets them, before its first client exists, and Mooncake reads them
    as its clients connect.

    (With a metadata server, Mooncake's transfer engine ignores the local hostname and
    advertises the first non-loopback address of the machine, or ``MC_TCP_BIND_ADDRESS``: so
    that ``local_hostname`` means the same in both modes, it goes there.)"""
    ms = str(max(1, round(timeout_s * 1000)))
    seconds = str(max(1, math.ceil(timeout_s)))
    settings = [
        ("MC_RPC_TIMEOUT_MS", ms),
        ("MC_RPC_CONNECT_TIMEOUT_MS", ms),
        ("MC_TCP_PROGRESS_TIMEOUT_SEC", seconds),
        ("MC_TCP_STATUS_TIMEOUT_SEC", seconds),
        ("MC_STORE_CLIENT_SETUP_RETRIES", "1"),
    ]
    if metadata_server != "P2PHANDSHAKE":
        settings.append(("MC_TCP_BIND_ADDRESS", local_host))
    for name, value in settings:
        if name not in os.environ:
            os.environ[name] = value


def check_installed() -> None:
    """Raise a one-line ``ValueError`` naming the extra when Mooncake's client cannot be
    imported (the package is missing, or ``libibverbs`` is, which even TCP needs)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        hint = " (and apt-get install libibverbs1)" if "libibverbs" in detail else ""
        raise ValueError(
            "mooncake_master: the Mooncake tier needs the mooncake extra: python -m pip "
            f"install 'lmprefetch[mooncake]'{hint}; importing mooncake.store failed: {detail}"
        ) from None


class MooncakeStore(Protocol):
    """What the tier uses of Mooncake's client, ``mooncake.store.MooncakeDistributedStore``
    (blocking calls: worker threads only).  Result codes are 0 or a positive length for
    success, negative Mooncake error codes otherwise; ``batch_is_exist`` answers 1, 0 or a
    negative code per key.  Every argument is passed by position."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
        /,
    ) -> int: ...

    def register_buffer(self, address: int, size: int, /) -> int: ...

    def unregister_buffer(self, address: int, /) -> int: ...

    def batch_is_exist(self, keys: list[str], /) -> Sequence[int]: ...

    def batch_get_into(
        self, keys: list[str], addresses: list[int], sizes: list[int], /
    ) -> Sequence[int]: ...

    def batch_put_from(
        self, keys: list[str], addresses: list[int], sizes: list[int], /
    ) -> Sequence[int]: ...

    def remove(self, key: str, /) -> int: ...

    def close(self) -> int: ...

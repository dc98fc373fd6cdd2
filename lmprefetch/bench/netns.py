"""A private network namespace for the benchmarks and tests that start Mooncake.

Mooncake's clients (every engine with the Mooncake tier, and the ``mooncake_client`` store
process) listen on every network interface, whatever address they are told to use.  A
benchmark or a test that starts them on a shared machine therefore runs them in a network
namespace of their own, where only the loopback interface exists: nothing outside can reach
them, and loopback works as usual.

``python -m lmprefetch.bench.netns COMMAND [ARG...]`` runs a command so: in this namespace if
it is already private, else under ``unshare --net`` (as root) or ``unshare --user
--map-root-user --net`` (as another user, where the kernel allows user namespaces), with the
loopback interface brought up first.  Its exit status is the command's.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import sys
from collections.abc import Sequence

__all__ = ["bring_loopback_up", "loopback_only", "main", "unshare_argv"]

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_INSIDE = "--inside-private-netns"


def loopback_only() -> bool:
    """Whether this process sees no network interface but loopback (a private network
    namespace, or a machine without a network)."""
    # (Not /sys/class/net: sysfs shows the namespace of whoever mounted it.)
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return False
    return bool(names) and all(name == "lo" for name in names)


def bring_loopback_up() -> None:
    """Set the ``lo`` interface up (a new network namespace starts with it down).

    Raises:
        OSError: not allowed (outside a namespace this process owns, as a normal user).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, _SIOCGIFFLAGS, request)[:18])[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


def unshare_argv(command: Sequence[str]) -> list[str] | None:
    """The command line that runs ``command`` in a new private network namespace with
    loopback up, or ``None`` when ``unshare`` is not installed."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    options = ["--net"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--net"]
    return [exe, *options, "--", sys.executable, "-m", "lmprefetch.bench.netns", _INSIDE,
            *command]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    inside = bool(args) and args[0] == _INSIDE
    if inside:
        args = args[1:]
    if not args:
        print("usage: python -m lmprefetch.bench.netns COMMAND [ARG...]", file=sys.stderr)
        return 2
    if not inside and not loopback_only():
        wrapped = unshare_argv(args)
        if wrapped is None:
            print("lmprefetch.bench.netns: unshare (util-linux) is not installed", file=sys.stderr)
            return 2
        os.execv(wrapped[0], wrapped)
    try:
        bring_loopback_up()
    except OSError as exc:
        print(f"lmprefetch.bench.netns: cannot bring lo up: {exc}", file=sys.stderr)
        return 2
    try:
        os.execvp(args[0], args)
    except OSError as exc:
        print(f"lmprefetch.bench.netns: cannot run {args[0]}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())

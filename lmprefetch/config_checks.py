"""The rules of one configuration field each, beyond its type and bounds: the functions a
field of :class:`~lmprefetch.config.PrefetchConfig` names in ``Meta(extra={"check": ...})``,
each returning what is wrong with a value (``None``: nothing), and the names they accept.

:mod:`lmprefetch.config` re-exports the public ones; rules that relate two fields stay there
(``_check_rules``).
"""

from __future__ import annotations

import re

from .config_fields import MiB

__all__ = [
    "LOAD_POLICIES",
    "MOONCAKE_PROTOCOLS",
    "MOONCAKE_SEGMENT_MIN",
    "codec_name",
    "host_port",
    "key_file",
    "load_policy",
    "mooncake_segment",
    "no_at_sign",
    "no_spaces",
    "parse_host_port",
    "redis_urls",
]


def no_at_sign(name: str) -> str | None:
    # A key is its parts joined by "@"; a model name with one would read back as other parts.
    if "@" in name:
        return f"must not contain '@' (it separates the parts of a key), got {name!r}"
    return None


def redis_urls(urls: str) -> str | None:
    for url in (u.strip() for u in urls.split(",")):
        if not url.startswith(("redis://", "rediss://")):
            return f"each entry must start with redis:// or rediss://, got {url!r}"
    return None


#: ``mooncake_protocol`` values (the transports of Mooncake's non-CUDA build).
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
#: The smallest segment Mooncake accepts (a smaller one fails the client's setup).
MOONCAKE_SEGMENT_MIN = 16 * MiB


def parse_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for IPv6) as ``(host, port)``.

    Raises:
        ValueError: not a host and a port in 1..65535.
    """
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if (
        not sep
        or not host
        or not (port.isascii() and port.isdigit())
        or not 0 < int(port) < 65536
        or any(ch.isspace() or ch in "/[]" for ch in host)
        or not host.isprintable()
    ):
        raise ValueError(f"expected host:port (mooncake_master's RPC service), got {address!r}")
    return host, int(port)


def host_port(address: str) -> str | None:
    try:
        parse_host_port(address)
    except ValueError as exc:
        return f"must be {str(exc).removeprefix('expected ')}"
    return None


def no_spaces(text: str) -> str | None:
    # Mooncake reads these as one token each (a URL, a host name): a space is always a typo.
    if any(ch.isspace() for ch in text) or not text.isprintable():
        return f"must not contain spaces or control characters, got {text!r}"
    return None


#: The load policies ``load_policy`` names without a module (see :mod:`lmprefetch.policy`).
LOAD_POLICIES = ("always", "never", "cost")
_CUSTOM_POLICY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)


def load_policy(name: str) -> str | None:
    # Only the form: the module is imported when the engine opens (lmprefetch.policy).
    if name in LOAD_POLICIES or _CUSTOM_POLICY.fullmatch(name):
        return None
    return f"must be one of {LOAD_POLICIES} or 'package.module:Class', got {name!r}"


def mooncake_segment(size: int) -> str | None:
    # 0 is allowed (the standalone-store deployment), so this is not a lower bound.
    if size != 0 and size < MOONCAKE_SEGMENT_MIN:
        return (
            f"must be 0 (contribute no memory) or at least {MOONCAKE_SEGMENT_MIN} "
            f"(16 MiB, Mooncake's least), got {size}"
        )
    return None


def codec_name(name: str) -> str | None:
    # The name only (and that its libraries are installed); the dtype rule is in _check_rules.
    from .codec.registry import codec_problem

    return codec_problem(name)


def key_file(path: str) -> str | None:
    # Read at start-up, where the configuration is built (a few bytes): a missing, unreadable or
    # short key file must stop the start, not turn every later store into a miss.
    from .codec.encryption import KeyFileError, cryptography_missing, load_master_key

    try:
        load_master_key(path)
    except KeyFileError as exc:
        return str(exc).partition(": ")[2]
    return cryptography_missing()

"""Address policy: the one trainer address an engine may join (:data:`ENV_ADDRESS`).

An engine configured with ``QSTRAT_TRANSFER_ADDRESS`` refuses, before joining, an init info
naming another address (or port). Hosts compare as addresses: IPv6 literals bare or bracketed,
in their canonical form.
"""
from __future__ import annotations

import ipaddress

#: Environment variable with the one group address an engine may join: ``host`` or ``host:port``.
ENV_ADDRESS = "QSTRAT_TRANSFER_ADDRESS"


def _host(host: str) -> str:
    """A host as compared: IPv6 literals without brackets, in their canonical form."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def split_address(configured: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]``, ``[v6]:port`` or a bare IPv6 literal (``::1``,
    ``fe80::1``) as ``(host, port or None)``.

    Raises: ValueError naming :data:`ENV_ADDRESS` for an empty host or a port that is not an
        integer in 1-65535.
    """
    text = configured.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
        if rest and port is None:
            host = ""
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:  # a host name, an IPv4 address, or a bare IPv6 literal (two colons or more)
        host, port = text, None
    bad = not host or (port is not None and not (port.isdigit() and 1 <= int(port) <= 65535))
    if bad:
        raise ValueError(f"{ENV_ADDRESS}={configured!r}: expected host, host:port, [ipv6] or [ipv6]:port "
                         "(port 1-65535)")
    return _host(host), None if port is None else int(port)


def check_address(configured: str | None, address: str, port: int) -> None:
    """Refuse an init info naming another group address than ``configured`` (``host`` or
    ``host:port``; None: anything is accepted).

    Raises: TransferAuthError naming both addresses (addresses are not secrets); ValueError for
        a malformed ``configured`` (:func:`split_address`).
    """
    from qstrat.errors import TransferAuthError

    if not configured:
        return
    host, want_port = split_address(configured)
    if _host(address) != host or (want_port is not None and want_port != int(port)):
        raise TransferAuthError(f"init_weight_transfer_engine refused: it points the engine at "
                                f"{address}:{port}, the configured transfer address is {configured} "
                                f"({ENV_ADDRESS})")

"""A real, rate-limited network link on this machine for the transport benchmark (root only).

A network namespace (``qlink``) joined to this one by a veth pair (``ql0`` here, 10.78.0.1/24;
``ql1`` in the namespace, 10.78.0.2/24), each end's egress shaped by the kernel's token bucket
filter (``tc qdisc replace dev ... root tbf rate RATE``): traffic between the sender (here) and
receivers spawned inside the namespace crosses a real kernel TCP path at RATE in both directions.
Other names and subnet: the environment variables ``QSTRAT_LINK_NAME`` and ``QSTRAT_LINK_NET``
(below). The namespace and the veth pair are reused when they exist and removed at exit only when this
process created them; the shapers it set are removed either way. ``lo`` and other interfaces are
never touched.

Receivers join through :func:`shaped_link`: while it is open, ``multiprocessing``'s spawned
children start inside the namespace (``ip netns exec``) with ``GLOO_SOCKET_IFNAME=ql1``, and this
process's gloo device is ``ql0`` (``GLOO_SOCKET_IFNAME``), so every gloo connection crosses the link.
"""
from __future__ import annotations

import contextlib
import multiprocessing.spawn as mp_spawn
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator

#: Names and subnet, overridable so that several benchmarks on one machine do not share a link:
#: ``QSTRAT_LINK_NAME=dp`` -> namespace ``dplink``, veth ends ``dp0`` / ``dp1``;
#: ``QSTRAT_LINK_NET=10.78.45`` -> addresses ``10.78.45.1`` / ``10.78.45.2``.
_NAME, _NET = os.environ.get("QSTRAT_LINK_NAME", "ql"), os.environ.get("QSTRAT_LINK_NET", "10.78.0")
NETNS, HOST_IF, NS_IF = ("qlink" if _NAME == "ql" else f"{_NAME}link"), f"{_NAME}0", f"{_NAME}1"
HOST_ADDR, NS_ADDR = f"{_NET}.1", f"{_NET}.2"
#: tc's rate units, in bits per second (``tc(8)``: kbit = 1000 bit/s, bps = bytes/s).
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
#: Link names that are not rates: the unshaped veth pair, and plain loopback (no namespace).
UNSHAPED, LOOPBACK = "unshaped", "loopback"


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate (``1gbit``, ``500mbit``, ``125mbps``).

    Raises: SystemExit naming the rate when it is not ``<number><unit>`` with a tc unit."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", rate.strip().lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise SystemExit(f"--link {rate!r}: expected a tc rate such as 1gbit, 500mbit, 10gbit "
                         f"(units {', '.join(_UNITS)}), or {UNSHAPED!r} / {LOOPBACK!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def check_can_shape() -> None:
    """Raises: SystemExit when this process is not root or ``ip`` / ``tc`` are missing."""
    if os.geteuid() != 0:
        raise SystemExit("--link needs root (it creates a network namespace, a veth pair and tc shapers)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"--link needs iproute2's {' and '.join(missing)} on PATH (not found)")


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode:
        raise SystemExit(f"--link: {' '.join(cmd)} failed: {done.stderr.strip()}")
    return done


def _in_ns(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return _sh("ip", "netns", "exec", NETNS, *cmd, check=check)


def _create() -> tuple[bool, bool]:
    """Create what is missing: (namespace created, veth pair created)."""
    made_ns = NETNS not in _sh("ip", "netns", "list").stdout.split()
    if made_ns:
        _sh("ip", "netns", "add", NETNS)
        _in_ns("ip", "link", "set", "lo", "up")
    made_veth = _sh("ip", "link", "show", HOST_IF, check=False).returncode != 0
    if made_veth:
        _sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        _sh("ip", "link", "set", NS_IF, "netns", NETNS)
        _sh("ip", "addr", "add", f"{HOST_ADDR}/24", "dev", HOST_IF)
        _sh("ip", "link", "set", HOST_IF, "up")
        _in_ns("ip", "addr", "add", f"{NS_ADDR}/24", "dev", NS_IF)
        _in_ns("ip", "link", "set", NS_IF, "up")
    return made_ns, made_veth


def _shape(rate: str | None) -> None:
    """Both ends' egress shaped to ``rate`` (tbf; burst 1 ms at the rate, at least 256 KiB), or
    the shapers removed (None)."""
    for run, dev in ((_sh, HOST_IF), (_in_ns, NS_IF)):
        if rate is None:
            run("tc", "qdisc", "del", "dev", dev, "root", check=False)
        else:
            burst = max(256 * 1024, int(rate_bits(rate) / 8 / 1000))
            run("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
                "latency", "50ms")


@contextlib.contextmanager
def shaped_link(rate: str) -> Iterator[str]:
    """Open the link shaped to ``rate`` (or :data:`UNSHAPED`); yields the sender's address.

    While open, spawned ``multiprocessing`` children run inside the namespace; on exit the
    spawn executable, ``GLOO_SOCKET_IFNAME`` and the link are restored / removed.
    Raises: SystemExit (not root, no ``ip``/``tc``, a bad rate, a failed ``ip``/``tc`` command)."""
    check_can_shape()
    if rate != UNSHAPED:
        rate_bits(rate)
    made_ns = made_veth = False
    old_exe, old_ifname = mp_spawn.get_executable(), os.environ.get("GLOO_SOCKET_IFNAME")
    with tempfile.TemporaryDirectory(prefix="qlink-") as tmp:
        wrapper = os.path.join(tmp, "python-in-netns")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nexec ip netns exec {NETNS} env GLOO_SOCKET_IFNAME={NS_IF} '
                    f'"{sys.executable}" "$@"\n')
        os.chmod(wrapper, stat.S_IRWXU)
        try:
            made_ns, made_veth = _create()
            _shape(None if rate == UNSHAPED else rate)
            mp_spawn.set_executable(wrapper)
            os.environ["GLOO_SOCKET_IFNAME"] = HOST_IF
            yield HOST_ADDR
        finally:
            mp_spawn.set_executable(os.fsdecode(old_exe))
            if old_ifname is None:
                os.environ.pop("GLOO_SOCKET_IFNAME", None)
            else:
                os.environ["GLOO_SOCKET_IFNAME"] = old_ifname
            _shape(None)
            if made_veth:
                _sh("ip", "link", "del", HOST_IF, check=False)
            if made_ns:
                _sh("ip", "netns", "del", NETNS, check=False)

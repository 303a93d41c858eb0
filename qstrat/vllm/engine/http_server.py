"""A vLLM HTTP server in a process group of its own, for as long as a ``with`` block runs.

Used by the demos and tests that drive a real server (``python -m vllm.entrypoints.openai.api_server``
or TRL's server command): start, wait for ``/health``, stop the whole group (front end and engine
core) on exit.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

#: Environment of a vLLM CPU server on a shared machine: the weight-transfer routes (dev mode),
#: 1 GiB of KV cache, one OpenMP thread and no core binding (identical greedy logprobs call after
#: call, as :func:`qstrat.vllm.engine.local.start_engine`'s engines), no compilation.
CPU_SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                  "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TORCHDYNAMO_DISABLE": "1"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(command: Sequence[str], port: int, log: Path, env: Mapping[str, str],
            start_s: float = 420.0) -> Iterator[str]:
    """Run ``command`` (a server listening on 127.0.0.1:``port``) with ``env`` as its whole
    environment, output to ``log``; yield its base URL once ``/health`` answers 200.

    On exit the process group gets SIGTERM, then SIGKILL after 30 s.
    Raises: RuntimeError with the log's last 4,000 characters when the server exits or does not
        answer within ``start_s`` seconds.
    """
    import requests

    with open(log, "w") as out:
        proc = subprocess.Popen(list(command), env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited (rc {proc.returncode}):\n{log.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {start_s:g} s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

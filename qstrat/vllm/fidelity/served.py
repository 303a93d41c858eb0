"""The fidelity probe's engine side over HTTP: a vLLM OpenAI-compatible server's prompt logprobs.

:func:`qstrat.vllm.fidelity.probe.probe` scores its sequences on an engine; when the engine is a
server in another process (TRL's ``vllm_mode="server"``, any ``vllm serve``), pass a
:class:`ServedEngine` where it takes the ``vllm.LLM``. It asks ``/v1/completions`` with vLLM's
extra parameter ``prompt_logprobs`` (the same ``SamplingParams(prompt_logprobs=k)`` as the
in-process path: one greedy token, prefix-cache reads skipped for such requests) and reads the
server's ``max_logprobs`` from ``/server_info`` (vLLM's dev-mode route; TRL's server and
qstrat's run in dev mode) where it has one.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ServedEngine"]


class ServedEngine:
    """A vLLM server the fidelity probe reads its engine logprobs from.

    Args:
        base_url: the server's root (``http://host:port``; TRL's ``VLLMClient.base_url``).
        model: the served model name (default: the first of ``/v1/models``).
        timeout: seconds per request.
    Raises (on use): ``requests`` errors for an unreachable server; ValueError naming the
        server and vLLM's message when it refuses the request (e.g. a ``max_logprobs`` cap).
    """

    def __init__(self, base_url: str, model: str | None = None, timeout: float = 300.0) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"ServedEngine: base_url must be a server's http(s) URL, got {base_url!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"ServedEngine: timeout must be a positive number of seconds per request (None would "
                             f"wait forever on a server that never answers), got {timeout!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._model = model

    def _get(self, route: str) -> Any:
        import requests

        r = requests.get(self.base_url + route, timeout=self.timeout)
        r.raise_for_status()
        return r.json()

    @property
    def model(self) -> str:
        """The served model name (asked once from ``/v1/models`` when not given)."""
        if self._model is None:
            self._model = str(self._get("/v1/models")["data"][0]["id"])
        return self._model

    @property
    def logprobs_cap(self) -> int | None:
        """The server's ``model_config.max_logprobs`` (-1: the vocabulary), None when it does not
        report one (no ``/server_info``: not in dev mode)."""
        import requests

        try:
            info = self._get("/server_info")
        except requests.HTTPError:
            return None
        value = (info.get("model_config") or {}).get("max_logprobs") if isinstance(info, dict) else None
        return int(value) if isinstance(value, int) else None

    def read_prompt_logprobs(self, sequences: Sequence[Sequence[int]], k: int) -> list[list[dict[int, float]]]:
        """Per sequence, per position 1..L-1, ``{token id: logprob}`` of the top ``k`` tokens and
        the actual next token (``/v1/completions``, ``prompt_logprobs=k``, one greedy token).
        vLLM's server writes ``-inf`` as -9999.0 (its ``clamp_prompt_logprobs``); kept as sent."""
        import requests

        body = {"model": self.model, "prompt": [list(map(int, s)) for s in sequences], "max_tokens": 1,
                "temperature": 0.0, "prompt_logprobs": int(k)}
        r = requests.post(self.base_url + "/v1/completions", json=body, timeout=self.timeout)
        if r.status_code != 200:
            raise ValueError(f"fidelity: the vLLM server at {self.base_url} refused prompt_logprobs={k} "
                             f"(HTTP {r.status_code}): {r.text[:300]}")
        try:
            choices = sorted(r.json()["choices"], key=lambda c: c["index"])
            rows = [[{int(t): float(lp["logprob"]) for t, lp in pos.items()} for pos in c["prompt_logprobs"][1:]]
                    for c in choices]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"fidelity: the server at {self.base_url} answered /v1/completions without vLLM's "
                             f"prompt_logprobs ({type(exc).__name__}: {exc}); is it a vLLM server?") from None
        # a verdict scored on part of the probe would pass on partial data: every sequence, every position
        got = [len(row) for row in rows]
        want = [len(s) - 1 for s in sequences]
        if got != want:
            raise ValueError(f"fidelity: the server at {self.base_url} returned prompt logprobs for {len(rows)} "
                             f"sequences of {got} positions; the probe sent {len(sequences)} of {want}")
        return rows

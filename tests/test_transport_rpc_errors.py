"""A failed weight-sync call over HTTP names the engine's reason in the trainer's exception
(the live server: tests/test_engine_http.py)."""
from __future__ import annotations

import json
from concurrent.futures import Future

import pytest

from qstrat.transport import RefitSender
from qstrat.transport.rpc_errors import describe

REASON = "Call to collective_rpc method failed: Worker failed with error 'wire manifest does not match the engine: ...'"


def http_error(status: int, body: bytes, content_type: str = "application/json"):
    """A real requests.HTTPError, as HTTPVLLMWeightSyncClient's raise_for_status makes it."""
    requests = pytest.importorskip("requests")
    response = requests.Response()
    response.status_code, response._content = status, body
    response.headers["Content-Type"] = content_type
    response.url, response.reason = "http://127.0.0.1:8000/update_weights", "Internal Server Error"
    with pytest.raises(requests.HTTPError) as err:
        response.raise_for_status()
    return err.value


def failed(exc: BaseException) -> Future:
    f: Future = Future()
    f.set_exception(exc)
    return f


def test_the_engines_reason_reaches_the_senders_errors():
    """vLLM's server answers a refused round with 500 and {"error": {"message": ...}}; the
    sender's error list used to hold only "HTTPError: 500 Server Error: ... for url: ..."."""
    body = json.dumps({"error": {"message": REASON, "type": "InternalServerError", "param": None, "code": 500}})
    sender = RefitSender([], "127.0.0.1", 0, timeout_s=1)
    assert sender.engines.results([failed(http_error(500, body.encode()))]) == {
        0: "HTTPError: 500 Server Error: Internal Server Error for url: "
           f"http://127.0.0.1:8000/update_weights; the engine said: {REASON}"}


def test_other_bodies_and_errors():
    assert describe(http_error(404, b'{"detail": "Not Found"}')).endswith("; the engine said: Not Found")
    assert describe(http_error(502, b"bad gateway", "text/plain")).endswith("; the engine said: bad gateway")
    assert describe(http_error(500, b"")) == ("HTTPError: 500 Server Error: Internal Server Error for url: "
                                              "http://127.0.0.1:8000/update_weights")
    assert describe(RuntimeError("receiver process gone")) == "RuntimeError: receiver process gone"

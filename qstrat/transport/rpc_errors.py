"""What an engine's weight-sync call failed with, as the trainer sees it.

A weight-sync client over HTTP (vLLM's ``HTTPVLLMWeightSyncClient``) raises
``requests.HTTPError("500 Server Error: Internal Server Error for url: ...")``: the reason - a
refused wire manifest (missing, unexpected or wrong tensors, the formats involved), a failed
checksum - is in the response body, which vLLM's server fills with its error response
(``{"error": {"message": ..., "type": ..., "code": ...}}``). :func:`describe` puts it back into
the message :class:`~qstrat.transport.RefitSender` raises.
"""
from __future__ import annotations

from typing import Any

#: How many characters of a non-JSON response body are kept.
BODY_CHARS = 2000


def describe(exc: BaseException) -> str:
    """``"<type>: <message>"`` for a failed weight-sync call, followed by ``"; the engine said:
    <reason>"`` when ``exc`` carries an HTTP response (an attribute ``response`` with ``json()``
    or ``text``, as ``requests.HTTPError`` does): vLLM's ``error.message``, else the body's first
    :data:`BODY_CHARS` characters. Never raises."""
    text = f"{type(exc).__name__}: {exc}"
    reason = _response_reason(getattr(exc, "response", None))
    return f"{text}; the engine said: {reason}" if reason else text


def _response_reason(response: Any) -> str | None:
    if response is None:
        return None
    try:
        body = response.json()
    except Exception:  # not JSON (or no body): fall back to the text
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else body.get("detail")
        if isinstance(message, str) and message.strip():
            return message.strip()
    try:
        text = str(getattr(response, "text", "") or "").strip()
    except Exception:
        return None
    return text[:BODY_CHARS] or None

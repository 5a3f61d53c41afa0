"""The server's logs: one line per event, JSON lines or readable text.

Every module logs through the standard :mod:`logging` module (so ``caplog`` and any
handler an embedding program adds keep working); :func:`configure` makes structlog's
:class:`~structlog.stdlib.ProcessorFormatter` render each record, with the fields a
call passes as ``extra=ids(pool=..., session=..., tenant=..., request=...)`` as fields
of the line:

* ``json`` (``KVCOORD_LOG_FORMAT=json``, ``[server] log_format = "json"``; the Docker
  image's default): one JSON object per line with ``timestamp`` (UTC, ISO 8601),
  ``level``, ``logger``, ``event`` (the message) and the fields;
* ``text`` (the default elsewhere): ``timestamp level logger: message key=value ...``.

Startup and stop facts (where the server listens, where it keeps its data, that it
stopped) are events of the :data:`LIFECYCLE` logger, logged whatever ``log_level`` says.
The optional access log (``[server] access_log = true``) is the :data:`ACCESS` logger:
one line per RPC with its method, tenant, pool, status and duration
(:class:`AccessLogInterceptor`).

Never logged: bearer tokens (only the tenant's name is), prompt tokens and block hashes
(only ids and counts are). :func:`_drop_secrets` also blanks any field whose name says
it holds one, should a call ever pass it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import IO, Any

import grpc
import structlog

from .intercept import observed, status_name
from .wire_slices import PARSED

__all__ = [
    "ACCESS",
    "ENV_LOG_FORMAT",
    "FORMATS",
    "LIFECYCLE",
    "AccessLogInterceptor",
    "configure",
    "ids",
]

ENV_LOG_FORMAT = "KVCOORD_LOG_FORMAT"
FORMATS = ("text", "json")
#: startup and stop facts: always at INFO, whatever the configured level
LIFECYCLE = "kvcoord.lifecycle"
#: one line per RPC when ``[server] access_log`` is on
ACCESS = "kvcoord.access"

#: field names whose values are never written (a safety net: no call passes them)
_SECRET_FIELDS = frozenset(
    {
        "token",
        "tokens",
        "auth_token",
        "authorization",
        "prompt",
        "prompt_token_ids",
        "token_ids",
        "block_hashes",
    }
)
#: the order of the id fields on a text line
_ID_FIELDS = ("pool", "session", "tenant", "request")


def ids(
    *,
    pool: str | None = None,
    session: str | None = None,
    tenant: str | None = None,
    request: str | list[str] | None = None,
    **more: object,
) -> dict[str, object]:
    """The ``extra`` of a log call about a pool, session, tenant or request: each id
    given becomes a field of the line (``None`` ones are left out)."""
    given = {"pool": pool, "session": session, "tenant": tenant, "request": request, **more}
    return {k: v for k, v in given.items() if v is not None}


def _drop_secrets(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in _SECRET_FIELDS.intersection(event):
        event[key] = "[not logged]"
    return event


def _text(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> str:
    """``timestamp LEVEL logger: message key=value ...`` (the ids first)."""
    head = f"{event.pop('timestamp', '')} {str(event.pop('level', '')).upper()} {event.pop('logger', '')}: "
    message = str(event.pop("event", ""))
    trace = event.pop("exception", None)
    keys = [k for k in _ID_FIELDS if k in event] + sorted(k for k in event if k not in _ID_FIELDS)
    pairs = []
    for k in keys:
        v = event[k]
        text = ",".join(map(str, v)) if isinstance(v, list | tuple) else v if isinstance(v, str) else repr(v)
        if not text or any(c.isspace() or c in "\"'=" for c in text):
            text = repr(text)
        pairs.append(f"{k}={text}")
    line = head + message + ("  " + " ".join(pairs) if pairs else "")
    return f"{line}\n{trace}" if trace else line


def configure(
    level: str = "INFO", fmt: str = "text", access_log: bool = False, stream: IO[str] | None = None
) -> None:
    """Send every log record (kvcoord's, gRPC's, ...) to ``stream`` (stderr) as ``fmt``
    (``text`` or ``json``) at ``level``; the :data:`LIFECYCLE` logger always at INFO,
    the :data:`ACCESS` logger only with ``access_log``."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    renderer: Any = structlog.processors.JSONRenderer() if fmt == "json" else _text
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.ExtraAdder(),
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _drop_secrets,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.getLogger(LIFECYCLE).setLevel(logging.INFO)
    logging.getLogger(ACCESS).setLevel(logging.INFO if access_log else logging.CRITICAL + 1)


class AccessLogInterceptor(grpc.aio.ServerInterceptor):
    """One :data:`ACCESS` line per finished RPC: ``rpc``, ``tenant`` (the caller's name,
    never its credential), ``pool`` / ``session`` / ``request`` when the request names
    them, ``status`` and ``duration_ms``."""

    def __init__(self) -> None:
        self.log = logging.getLogger(ACCESS)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not self.log.isEnabledFor(logging.INFO):
            return handler
        rpc = details.method

        def end(_kind: str, request: Any, context: grpc.aio.ServicerContext, ok: bool, t0: float) -> None:
            self._line(rpc, request, context, ok, t0)

        return observed(handler, None, end)

    def _line(self, rpc: str, request: Any, context: grpc.aio.ServicerContext, ok: bool, t0: float) -> None:
        from .access import checked_tenant  # the handler's check bound it in this task

        if isinstance(request, bytes):  # a Step's bytes, parsed by its handler in slices
            request = PARSED.get()

        status = status_name(context, ok)
        self.log.info(
            "%s %s",
            rpc,
            status,
            extra=ids(
                rpc=rpc,
                status=status,
                duration_ms=round((time.perf_counter() - t0) * 1000, 3),
                tenant=_tenant_name(checked_tenant()),
                pool=_field(request, "pool"),
                session=_field(request, "session_id"),
                request=_request_ids(request),
            ),
        )


def _tenant_name(tenant: Any) -> str:
    if tenant is None:
        return "(not authenticated)"
    return str(tenant.name) or "(full access)"


#: at most this many request ids on an access line (a Free names up to max_ops_per_step)
_MAX_IDS = 16


def _request_ids(request: Any) -> str | list[str] | None:
    """The request id(s) a call names: ``request_id``, an AllocateRequest's
    ``op.request.request_id``, or a FreeRequest's ``request_ids`` (the first ones)."""
    own = _field(request, "request_id")
    if own is not None:
        return own
    op = getattr(request, "op", None)
    sync = getattr(op, "request", None) if op is not None else None
    if sync is not None and _field(sync, "request_id"):
        return _field(sync, "request_id")
    many = getattr(request, "request_ids", None)
    if many is not None and not isinstance(many, str) and len(many):
        return [str(r)[:256] for r in list(many)[:_MAX_IDS]]
    return None


def _field(request: Any, name: str) -> str | None:
    """A string field the request has and set, else None (never a token or hash list)."""
    value = getattr(request, name, None)
    return value[:256] if isinstance(value, str) and value else None

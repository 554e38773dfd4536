"""Request messages that do not decode: INVALID_ARGUMENT for the caller, a summary in the log.

gRPC decodes a request before any handler or interceptor code runs, and a decoding error
there ends the call with UNKNOWN (naming the Python exception class) and logs a traceback;
on unary calls that happens before authentication. ``UndecodableInterceptor`` swaps each
edgespec method's deserializer for one that returns an ``Undecodable`` marker instead of
raising; the method's behaviour then raises InvalidRequest at the marker, inside the other
interceptors, so the caller is authenticated first and gets INVALID_ARGUMENT with its
ErrorInfo. The log gets one line per interval (``LogSummary``), however many arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc

from cloud_verifier.errors import InvalidRequest
from cloud_verifier.metrics import VerifierMetrics
from shared.pb import verifier_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_PREFIX = f"/{pb.DESCRIPTOR.services_by_name['VerifierService'].full_name}/"
SUMMARY_INTERVAL_S = 60.0


@dataclass(frozen=True)
class Undecodable:
    """What the tolerant deserializer returns for bytes that are not the request type."""

    error: str


def tolerant(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and its kin
            return Undecodable(str(exc) or "not a valid protobuf message")
    return deserialize


class LogSummary:
    """Logs the first event at once, then at most one line per ``interval_s`` saying how
    many more came (flushed by a timer, so the last ones are never lost)."""

    def __init__(self, interval_s: float = SUMMARY_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._pending = 0
        self._latest = ""
        self._timer: asyncio.TimerHandle | None = None

    def event(self, what: str) -> None:
        if self._timer is None:
            log.warning("undecodable request: %s (further ones are summarised every %.0f s)",
                        what, self.interval_s)
            self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._flush)
            return
        self._pending += 1
        self._latest = what

    def _flush(self) -> None:
        if self._pending == 0:
            self._timer = None
            return
        log.warning("%d undecodable requests in the last %.0f s (latest: %s)", self._pending,
                    self.interval_s, self._latest)
        self._pending = 0
        self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._flush)


class UndecodableInterceptor(grpc.aio.ServerInterceptor):
    """Innermost interceptor of the edgespec service (see the module docstring)."""

    def __init__(self, metrics: VerifierMetrics, summary: LogSummary | None = None) -> None:
        self.metrics = metrics
        self.summary = summary or LogSummary()

    def _refuse(self, method: str, request: Undecodable) -> InvalidRequest:
        self.metrics.undecodable_messages.labels(method.rsplit("/", 1)[-1]).inc()
        self.summary.event(f"{method}: {request.error}")
        return InvalidRequest(f"the request message does not decode as {method}'s request "
                              f"type ({request.error})", field="message")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler
        kwargs = dict(request_deserializer=tolerant(handler.request_deserializer),
                      response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                if isinstance(request, Undecodable):
                    raise self._refuse(method, request)
                return await inner(request, context)
            return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, Undecodable):
                    raise self._refuse(method, request)
                async with contextlib.aclosing(inner_us(request, context)) as responses:
                    async for response in responses:
                        yield response
            return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
        if handler.stream_stream is not None:
            inner_ss = handler.stream_stream

            async def checked(requests):
                async for request in requests:
                    if isinstance(request, Undecodable):
                        raise self._refuse(method, request)
                    yield request

            async def stream_stream(requests, context):
                replies = inner_ss(checked(requests), context)
                async with contextlib.aclosing(replies) as responses:
                    async for response in responses:
                        yield response
            return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)
        raise TypeError(f"{method}: client-streaming methods are not part of edgespec.v1")

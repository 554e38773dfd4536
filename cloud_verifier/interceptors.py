"""Server interceptors of the edgespec service: who is calling, and what a failure says.

``CallerInterceptor`` computes the caller's identity (an API key digest, or "anonymous" when
the server has no keys) and reads the routing key, and exposes both to the handler through
context variables (``current_caller``, ``current_routing_key``). ``StatusInterceptor`` turns
any exception a handler raises into a rich status (cloud_verifier.errors names each domain
error's code and reason; anything else is INTERNAL), counted in
``edgespec_rejected_requests``. Handlers are then only conversions and calls.

Both wrap the behaviour of each edgespec method (whatever its arity),
so that the context variables are set inside the call's own context; other services (health,
reflection) pass through untouched and need no key.
"""

from __future__ import annotations

import contextlib
import contextvars
import hmac
import logging
from collections.abc import Callable

import grpc

from cloud_verifier.config import key_digest
from cloud_verifier.errors import InvalidRequest, Unauthenticated, VerifierError
from cloud_verifier.metrics import VerifierMetrics
from shared import errors as reasons
from shared.pb import verifier_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VerifierService"].full_name
ANONYMOUS = "anonymous"

_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("edgespec_caller")
_ROUTING_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "edgespec_routing_key", default=None)


def current_caller() -> str:
    """The identity the current call's sessions belong to (set by CallerInterceptor)."""
    return _CALLER.get()


def current_routing_key() -> str | None:
    """The current call's routing key, None when it sent none (for logs)."""
    return _ROUTING_KEY.get()


def caller_of(metadata, api_key_digests: frozenset[str]) -> str:
    """An API key digest, or "anonymous" when the server takes no keys."""
    if not api_key_digests:
        return ANONYMOUS
    header = dict(metadata or ()).get("authorization", "")
    if not header.startswith("Bearer "):
        raise Unauthenticated("missing 'authorization: Bearer <api key>' metadata")
    digest = key_digest(header[len("Bearer "):])
    if not any(hmac.compare_digest(digest, d) for d in api_key_digests):
        raise Unauthenticated("unknown API key")
    return digest


def routing_key_of(metadata) -> str | None:
    values = [v for k, v in (metadata or ()) if k == reasons.ROUTING_KEY]
    if not values:
        return None
    if len(values) > 1 or not isinstance(values[0], str) \
            or not reasons.ROUTING_KEY_RE.match(values[0]):
        raise InvalidRequest(f"{reasons.ROUTING_KEY} metadata must be one value of 1-64 "
                             "characters of [A-Za-z0-9_-]", field=reasons.ROUTING_KEY)
    return values[0]


def status_of(exc: Exception) -> grpc.Status:
    """The rich status a client sees for ``exc``."""
    if isinstance(exc, VerifierError):
        return reasons.rich_status(exc.code, str(exc), exc.reason, exc.retry_after_s,
                                   exc.metadata)
    return reasons.rich_status(grpc.StatusCode.INTERNAL,
                               f"internal error: {type(exc).__name__}", reasons.INTERNAL)


# -- wrapping a method's behaviour ------------------------------------------------------------

# around(context) -> an async context manager entered for the whole call.
Around = Callable[[grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager]


def _wrap(handler: grpc.RpcMethodHandler, around: Around) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour run inside ``around(context)``."""
    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            async with around(context):
                return await inner(request, context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
    if handler.stream_unary is not None:  # none in edgespec.v1 today
        inner_su = handler.stream_unary

        async def stream_unary(requests, context):
            async with around(context):
                return await inner_su(requests, context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request, context):
            async with around(context), \
                    contextlib.aclosing(inner_us(request, context)) as responses:
                async for response in responses:
                    yield response
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
    inner_ss = handler.stream_stream

    async def stream_stream(requests, context):
        async with around(context), \
                contextlib.aclosing(inner_ss(requests, context)) as responses:
            async for response in responses:
                yield response
    return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)


class _EdgespecInterceptor(grpc.aio.ServerInterceptor):
    """Wraps only the edgespec service's methods."""

    def around(self, context: grpc.aio.ServicerContext,
               method: str) -> contextlib.AbstractAsyncContextManager:
        raise NotImplementedError

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        return _wrap(handler, lambda context: self.around(context, method))


class CallerInterceptor(_EdgespecInterceptor):
    """Authenticates the caller and reads the routing key, for the handler to use."""

    def __init__(self, api_key_digests: frozenset[str]) -> None:
        self.api_key_digests = api_key_digests

    @contextlib.asynccontextmanager
    async def around(self, context, method):
        metadata = context.invocation_metadata()
        # The call runs in its own context, so these are never seen by another call.
        _CALLER.set(caller_of(metadata, self.api_key_digests))
        _ROUTING_KEY.set(routing_key_of(metadata))
        yield


class StatusInterceptor(_EdgespecInterceptor):
    """Ends a failed call with the rich status of its exception; logs unexpected ones once."""

    def __init__(self, metrics: VerifierMetrics) -> None:
        self.metrics = metrics

    @contextlib.asynccontextmanager
    async def around(self, context, method):
        try:
            yield
        except grpc.aio.AbortError:
            raise  # the handler ended the call with a status itself
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            if not isinstance(exc, VerifierError):
                log.exception("internal error in %s (routing key %s)", method,
                              current_routing_key() or "-")
            status = status_of(exc)
            self.metrics.rejected_requests.labels(status.code.name).inc()
            await context.abort(status.code, status.details, status.trailing_metadata)


def interceptors(api_key_digests: frozenset[str],
                 metrics: VerifierMetrics) -> list[grpc.aio.ServerInterceptor]:
    """In server order: the status one outermost, so that it also maps the caller's
    authentication errors."""
    return [StatusInterceptor(metrics), CallerInterceptor(api_key_digests)]

"""Server interceptors: who is calling, and what a failure says.

``CallerInterceptor`` authenticates the caller against the key ring (cloud_verifier.auth;
"anonymous" when the server takes no keys) and reads the routing key, and exposes both to
the handler through context variables (``current_caller``, ``current_routing_key``). A
stream re-checks its key before each reply once the keys were reloaded, so a revoked key's
open streams end UNAUTHENTICATED while other keys' streams go on. ``StatusInterceptor``
turns any exception a handler raises into a rich status (cloud_verifier.errors names each
domain error's code and reason; anything else is INTERNAL), counted in
``edgespec_rejected_requests``. Handlers are then only conversions and calls.

Both wrap the behaviour of each method (whatever its arity), so that the context variables
are set inside the call's own context. Every service but health needs a key: reflection
describes the API, so it is for callers of the API; health stays open for probes, and
says only SERVING or NOT_SERVING.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health

from cloud_verifier.auth import KeyRing
from cloud_verifier.errors import InvalidRequest, Unauthenticated, VerifierError
from cloud_verifier.metrics import VerifierMetrics
from shared import errors as reasons
from shared.pb import verifier_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VerifierService"].full_name
_OPEN_PREFIX = f"/{health.SERVICE_NAME}/"

_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("edgespec_caller")
_ROUTING_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "edgespec_routing_key", default=None)


def current_caller() -> str:
    """The tenant the current call's sessions belong to (set by CallerInterceptor)."""
    return _CALLER.get()


def current_routing_key() -> str | None:
    """The current call's routing key, None when it sent none (for logs)."""
    return _ROUTING_KEY.get()


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

# around(context) -> an async context manager entered for the whole call; it yields the
# check that runs before each reply of a streaming call.
Around = Callable[[grpc.aio.ServicerContext],
                  contextlib.AbstractAsyncContextManager[Callable[[], None]]]


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
    if handler.stream_unary is not None:  # none served today
        inner_su = handler.stream_unary

        async def stream_unary(requests, context):
            async with around(context):
                return await inner_su(requests, context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request, context):
            async with around(context) as check, \
                    contextlib.aclosing(inner_us(request, context)) as responses:
                async for response in responses:
                    check()
                    yield response
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
    inner_ss = handler.stream_stream

    async def stream_stream(requests, context):
        async with around(context) as check, \
                contextlib.aclosing(inner_ss(requests, context)) as responses:
            async for response in responses:
                check()
                yield response
    return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)


def _no_check() -> None:
    pass


class _GuardedInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the methods of every service but health."""

    def around(self, context: grpc.aio.ServicerContext,
               method: str) -> contextlib.AbstractAsyncContextManager:
        raise NotImplementedError

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_OPEN_PREFIX):
            return handler
        return _wrap(handler, lambda context: self.around(context, method))


class CallerInterceptor(_GuardedInterceptor):
    """Authenticates the caller and reads the routing key, for the handler to use."""

    def __init__(self, keys: KeyRing) -> None:
        self.keys = keys

    @contextlib.asynccontextmanager
    async def around(self, context, method):
        metadata = context.invocation_metadata()
        caller = self.keys.authenticate(metadata)
        # The call runs in its own context, so these are never seen by another call.
        _CALLER.set(caller.tenant)
        _ROUTING_KEY.set(routing_key_of(metadata))
        seen = self.keys.version

        def check() -> None:
            nonlocal seen
            if self.keys.version != seen:  # reloaded since: is this key still in?
                if not self.keys.still_valid(caller):
                    raise Unauthenticated("the API key of this call was revoked")
                seen = self.keys.version
        yield check


class StatusInterceptor(_GuardedInterceptor):
    """Ends a failed call with the rich status of its exception; logs unexpected ones once."""

    def __init__(self, metrics: VerifierMetrics) -> None:
        self.metrics = metrics

    @contextlib.asynccontextmanager
    async def around(self, context, method):
        try:
            yield _no_check
        except grpc.aio.AbortError:
            raise  # the handler ended the call with a status itself
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            if not isinstance(exc, VerifierError):
                log.exception("internal error in %s (routing key %s)", method,
                              current_routing_key() or "-")
            status = status_of(exc)
            self.metrics.rejected_requests.labels(status.code.name).inc()
            await context.abort(status.code, status.details, status.trailing_metadata)


def interceptors(keys: KeyRing, metrics: VerifierMetrics) -> list[grpc.aio.ServerInterceptor]:
    """In server order: the status one outermost, so that it also maps the caller's
    authentication errors."""
    return [StatusInterceptor(metrics), CallerInterceptor(keys)]

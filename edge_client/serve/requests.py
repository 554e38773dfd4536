"""OpenAI request bodies, parsed and checked field by field.

Every problem becomes an ``ApiError`` carrying OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``) and its HTTP status, never a crash.
Fields OpenAI defines but this server cannot honour (``n`` > 1, ``stop``, penalties,
``logprobs``) are refused rather than silently ignored: a client relying on them would
otherwise get output it did not ask for.
"""

from __future__ import annotations

from dataclasses import dataclass

# Absent max_tokens: OpenAI's completions default is 16; chat has none, so a bound keeps one
# request from holding the verifier for the whole context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 256
ROLES = ("system", "user", "assistant")

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
                 "seed", "stop", "user", "presence_penalty", "frequency_penalty", "logprobs",
                 "logit_bias"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}


class ApiError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type_)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ParsedRequest:
    """What a generation needs, checked: the prompt is text (chat: rendered later from
    ``messages``) or token ids."""

    model: str
    max_tokens: int | None  # None: the endpoint's default, bounded by the context left
    temperature: float
    top_p: float
    seed: int
    stream: bool
    include_usage: bool
    prompt: str | list[int] | None = None
    messages: tuple[dict, ...] = ()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise bad(name, f"{name} must be a number, got {type(value).__name__}", "invalid_type")
    if not (low < value if low_open else low <= value) or value > high:
        span = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise bad(name, f"{name} must be in {span}, got {value}")
    return float(value)


def _only_default(body: dict, name: str, allowed: tuple, why: str) -> None:
    value = body.get(name)
    if value is not None and value not in allowed:
        raise bad(name, f"{name}={value!r} is not supported by this server: {why}",
                  "unsupported_value")


def _common(body, fields: set[str], max_tokens_names: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}",
                  "unknown_parameter")
    model = body.get("model")
    if model is None:
        raise bad("model", "you must provide a model parameter", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise bad("model", "model must be a non-empty string", "invalid_type")
    max_tokens = None
    for name in max_tokens_names:
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value):
            raise bad(name, f"{name} must be an integer, got {type(value).__name__}",
                      "invalid_type")
        if value < 1:
            raise bad(name, f"{name} must be at least 1, got {value}")
        max_tokens = value
    n = body.get("n")
    if n is not None and not _is_int(n):
        raise bad("n", f"n must be an integer, got {type(n).__name__}", "invalid_type")
    _only_default(body, "n", (1,), "one choice per request (send several requests)")
    _only_default(body, "best_of", (1,), "one choice per request")
    _only_default(body, "stop", (None,), "stop sequences are not implemented; the model's "
                  "end-of-sequence token ends a generation")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None and not _is_number(body[name]):
            raise bad(name, f"{name} must be a number", "invalid_type")
        _only_default(body, name, (0, 0.0), "penalties would change the target's "
                      "distribution, which speculative verification keeps exact")
    _only_default(body, "logprobs", (None, False, 0), "log-probabilities are not returned")
    _only_default(body, "top_logprobs", (None, 0), "log-probabilities are not returned")
    _only_default(body, "logit_bias", (None, {}), "logit biases would change the target's "
                  "distribution")
    _only_default(body, "echo", (None, False), "the prompt is not echoed")
    _only_default(body, "suffix", (None, ""), "no insertion mode")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", "user must be a string", "invalid_type")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be a boolean", "invalid_type")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed with stream=true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options", "stream_options must be {\"include_usage\": bool}",
                      "invalid_type")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad("stream_options", "include_usage must be a boolean", "invalid_type")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < 2**63):
        raise bad("seed", "seed must be an integer in [0, 2**63)", "invalid_type")
    return dict(model=model, max_tokens=max_tokens,
                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                seed=seed or 0, stream=stream, include_usage=include_usage)


def parse_completion(body) -> ParsedRequest:
    common = _common(body, COMPLETION_FIELDS, ("max_tokens",))
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "you must provide a prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) and t >= 0 for t in prompt):
            raise bad("prompt", "prompt must be a string, or a non-empty list of token ids "
                      "(batches of several prompts are not supported)", "invalid_type")
    elif not isinstance(prompt, str) or not prompt:
        raise bad("prompt", "prompt must be a non-empty string", "invalid_type")
    return ParsedRequest(prompt=prompt, **common)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad(param, "only text content parts ({\"type\": \"text\", \"text\": "
                          "...}) are supported", "invalid_type")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(param, "content must be a string or a list of text parts", "invalid_type")


def parse_chat(body) -> ParsedRequest:
    common = _common(body, CHAT_FIELDS, ("max_tokens", "max_completion_tokens"))
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "you must provide messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list", "invalid_type")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", "each message must be an object", "invalid_type")
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise bad(f"messages[{i}].{extra[0]}", f"unsupported message field {extra[0]!r} "
                      "(no tools or function calls)", "unknown_parameter")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"role must be one of {', '.join(ROLES)}, got "
                      f"{role!r}")
        checked.append({"role": role, "content": _content(message, i)})
    return ParsedRequest(messages=tuple(checked), **common)

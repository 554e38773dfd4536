from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_ARGUMENT: _ClassVar[ErrorReason]
    ERROR_REASON_CONTEXT_TOO_LONG: _ClassVar[ErrorReason]
    ERROR_REASON_SESSION_EVICTED: _ClassVar[ErrorReason]
    ERROR_REASON_SESSION_EXPIRED: _ClassVar[ErrorReason]
    ERROR_REASON_OUT_OF_ORDER: _ClassVar[ErrorReason]
    ERROR_REASON_OVERLOADED: _ClassVar[ErrorReason]
    ERROR_REASON_DRAINING: _ClassVar[ErrorReason]
    ERROR_REASON_UNAUTHENTICATED: _ClassVar[ErrorReason]
    ERROR_REASON_INTERNAL: _ClassVar[ErrorReason]
    ERROR_REASON_STREAM_IDLE: _ClassVar[ErrorReason]
    ERROR_REASON_FEATURES_UNAVAILABLE: _ClassVar[ErrorReason]

class Drafting(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTING_UNSPECIFIED: _ClassVar[Drafting]
    DRAFTING_ROUNDS: _ClassVar[Drafting]
    DRAFTING_LOOKAHEAD: _ClassVar[Drafting]
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_INVALID_ARGUMENT: ErrorReason
ERROR_REASON_CONTEXT_TOO_LONG: ErrorReason
ERROR_REASON_SESSION_EVICTED: ErrorReason
ERROR_REASON_SESSION_EXPIRED: ErrorReason
ERROR_REASON_OUT_OF_ORDER: ErrorReason
ERROR_REASON_OVERLOADED: ErrorReason
ERROR_REASON_DRAINING: ErrorReason
ERROR_REASON_UNAUTHENTICATED: ErrorReason
ERROR_REASON_INTERNAL: ErrorReason
ERROR_REASON_STREAM_IDLE: ErrorReason
ERROR_REASON_FEATURES_UNAVAILABLE: ErrorReason
DRAFTING_UNSPECIFIED: Drafting
DRAFTING_ROUNDS: Drafting
DRAFTING_LOOKAHEAD: Drafting

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("protocol_version", "target_model", "vocab_size", "tokenizer_fingerprint", "max_draft_len", "max_context", "modes", "eos_token_ids", "max_q_support", "max_stop_token_ids", "feature", "max_continue_with")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MODES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_Q_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTINUE_WITH_FIELD_NUMBER: _ClassVar[int]
    protocol_version: str
    target_model: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_draft_len: int
    max_context: int
    modes: _containers.RepeatedScalarFieldContainer[str]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_q_support: int
    max_stop_token_ids: int
    feature: FeatureCapability
    max_continue_with: int
    def __init__(self, protocol_version: _Optional[str] = ..., target_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_draft_len: _Optional[int] = ..., max_context: _Optional[int] = ..., modes: _Optional[_Iterable[str]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_q_support: _Optional[int] = ..., max_stop_token_ids: _Optional[int] = ..., feature: _Optional[_Union[FeatureCapability, _Mapping]] = ..., max_continue_with: _Optional[int] = ...) -> None: ...

class FeatureCapability(_message.Message):
    __slots__ = ("layer", "hidden_size", "codec", "group_size", "target_fingerprint")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    layer: str
    hidden_size: int
    codec: str
    group_size: int
    target_fingerprint: str
    def __init__(self, layer: _Optional[str] = ..., hidden_size: _Optional[int] = ..., codec: _Optional[str] = ..., group_size: _Optional[int] = ..., target_fingerprint: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("token_ids", "q", "confidence")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    confidence: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., confidence: _Optional[_Iterable[float]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("prompt_token_ids", "sampling", "max_new_tokens", "stop_token_ids", "ignore_eos", "drafting", "first_draft", "editable", "want_feature", "continue_with")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_FIELD_NUMBER: _ClassVar[int]
    FIRST_DRAFT_FIELD_NUMBER: _ClassVar[int]
    EDITABLE_FIELD_NUMBER: _ClassVar[int]
    WANT_FEATURE_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_WITH_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    drafting: Drafting
    first_draft: Draft
    editable: bool
    want_feature: bool
    continue_with: bytes
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., drafting: _Optional[_Union[Drafting, str]] = ..., first_draft: _Optional[_Union[Draft, _Mapping]] = ..., editable: _Optional[bool] = ..., want_feature: _Optional[bool] = ..., continue_with: _Optional[bytes] = ...) -> None: ...

class Edit(_message.Message):
    __slots__ = ("keep_length", "append_token_ids", "suggestion", "max_new_tokens", "continue_with")
    KEEP_LENGTH_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SUGGESTION_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_WITH_FIELD_NUMBER: _ClassVar[int]
    keep_length: int
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    suggestion: int
    max_new_tokens: int
    continue_with: bytes
    def __init__(self, keep_length: _Optional[int] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., suggestion: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., continue_with: _Optional[bytes] = ...) -> None: ...

class VerifyRound(_message.Message):
    __slots__ = ("round", "draft", "edit")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    EDIT_FIELD_NUMBER: _ClassVar[int]
    round: int
    draft: Draft
    edit: Edit
    def __init__(self, round: _Optional[int] = ..., draft: _Optional[_Union[Draft, _Mapping]] = ..., edit: _Optional[_Union[Edit, _Mapping]] = ...) -> None: ...

class CancelSuggestion(_message.Message):
    __slots__ = ("suggestion",)
    SUGGESTION_FIELD_NUMBER: _ClassVar[int]
    suggestion: int
    def __init__(self, suggestion: _Optional[int] = ...) -> None: ...

class LookaheadDraft(_message.Message):
    __slots__ = ("base_length", "draft")
    BASE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    base_length: int
    draft: Draft
    def __init__(self, base_length: _Optional[int] = ..., draft: _Optional[_Union[Draft, _Mapping]] = ...) -> None: ...

class Decode(_message.Message):
    __slots__ = ("round", "max_tokens", "stop_when_drafting_pays")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_WHEN_DRAFTING_PAYS_FIELD_NUMBER: _ClassVar[int]
    round: int
    max_tokens: int
    stop_when_drafting_pays: bool
    def __init__(self, round: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_when_drafting_pays: _Optional[bool] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "verify", "lookahead", "decode", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    verify: VerifyRound
    lookahead: LookaheadDraft
    decode: Decode
    cancel: CancelSuggestion
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., verify: _Optional[_Union[VerifyRound, _Mapping]] = ..., lookahead: _Optional[_Union[LookaheadDraft, _Mapping]] = ..., decode: _Optional[_Union[Decode, _Mapping]] = ..., cancel: _Optional[_Union[CancelSuggestion, _Mapping]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ns", "forward_ns")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    forward_ns: int
    def __init__(self, queue_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("round", "token_ids", "num_drafted", "num_accepted", "committed_length", "finished", "target_forwards", "timing", "suggested_draft_len", "draft_token_cost", "suggestion", "fed_tokens", "feature")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    SUGGESTED_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_COST_FIELD_NUMBER: _ClassVar[int]
    SUGGESTION_FIELD_NUMBER: _ClassVar[int]
    FED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    round: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_drafted: int
    num_accepted: int
    committed_length: int
    finished: bool
    target_forwards: int
    timing: Timing
    suggested_draft_len: int
    draft_token_cost: float
    suggestion: int
    fed_tokens: int
    feature: Feature
    def __init__(self, round: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., committed_length: _Optional[int] = ..., finished: _Optional[bool] = ..., target_forwards: _Optional[int] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., suggested_draft_len: _Optional[int] = ..., draft_token_cost: _Optional[float] = ..., suggestion: _Optional[int] = ..., fed_tokens: _Optional[int] = ..., feature: _Optional[_Union[Feature, _Mapping]] = ...) -> None: ...

class Feature(_message.Message):
    __slots__ = ("position", "values", "scales")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    position: int
    values: bytes
    scales: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, position: _Optional[int] = ..., values: _Optional[bytes] = ..., scales: _Optional[_Iterable[float]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("session_id", "step")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: Step
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[_Union[Step, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "sampling", "max_new_tokens", "stop_token_ids", "ignore_eos")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: Step
    def __init__(self, step: _Optional[_Union[Step, _Mapping]] = ...) -> None: ...

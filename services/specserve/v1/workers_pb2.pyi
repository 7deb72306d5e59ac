from specserve.v1 import generator_pb2 as _generator_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SparseDistribution(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generator_pb2.SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generator_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("cached_tokens", "prefix_hit_tokens")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    prefix_hit_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ...) -> None: ...

class SessionUpdate(_message.Message):
    __slots__ = ("session_id", "base_length", "append")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_length: int
    append: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., base_length: _Optional[int] = ..., append: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("update", "gamma")
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    update: SessionUpdate
    gamma: int
    def __init__(self, update: _Optional[_Union[SessionUpdate, _Mapping]] = ..., gamma: _Optional[int] = ...) -> None: ...

class ProposeReply(_message.Message):
    __slots__ = ("tokens", "q", "key", "draft_time_s")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    key: str
    draft_time_s: float
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., key: _Optional[str] = ..., draft_time_s: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("update", "tokens", "q")
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    update: SessionUpdate
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    def __init__(self, update: _Optional[_Union[SessionUpdate, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("n_accepted", "next_token", "accept_probs", "betas", "verify_time_s", "step_tokens", "step_sessions", "logprobs", "step_prompt_tokens", "step_prompt_sessions")
    N_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_PROBS_FIELD_NUMBER: _ClassVar[int]
    BETAS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STEP_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_PROMPT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    n_accepted: int
    next_token: int
    accept_probs: _containers.RepeatedScalarFieldContainer[float]
    betas: _containers.RepeatedScalarFieldContainer[float]
    verify_time_s: float
    step_tokens: int
    step_sessions: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_generator_pb2.TokenLogprob]
    step_prompt_tokens: int
    step_prompt_sessions: int
    def __init__(self, n_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., accept_probs: _Optional[_Iterable[float]] = ..., betas: _Optional[_Iterable[float]] = ..., verify_time_s: _Optional[float] = ..., step_tokens: _Optional[int] = ..., step_sessions: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_generator_pb2.TokenLogprob, _Mapping]]] = ..., step_prompt_tokens: _Optional[int] = ..., step_prompt_sessions: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling", "max_tokens", "gamma", "no_lookup", "stream_interval_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    NO_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generator_pb2.SamplingParams
    max_tokens: int
    gamma: str
    no_lookup: bool
    stream_interval_s: float
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generator_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., gamma: _Optional[str] = ..., no_lookup: _Optional[bool] = ..., stream_interval_s: _Optional[float] = ...) -> None: ...

class Rounds(_message.Message):
    __slots__ = ("rounds",)
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[RoundReply]
    def __init__(self, rounds: _Optional[_Iterable[_Union[RoundReply, _Mapping]]] = ...) -> None: ...

class RoundReply(_message.Message):
    __slots__ = ("tokens", "finish_reason", "gamma", "accepted", "draft_time_s", "verify_time_s", "looked_up", "step_time_s", "logprobs", "drafted_tokens", "prefill_time_s", "cached_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LOOKED_UP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    gamma: int
    accepted: int
    draft_time_s: float
    verify_time_s: float
    looked_up: bool
    step_time_s: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_generator_pb2.TokenLogprob]
    drafted_tokens: _containers.RepeatedScalarFieldContainer[int]
    prefill_time_s: float
    cached_tokens: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., gamma: _Optional[int] = ..., accepted: _Optional[int] = ..., draft_time_s: _Optional[float] = ..., verify_time_s: _Optional[float] = ..., looked_up: _Optional[bool] = ..., step_time_s: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_generator_pb2.TokenLogprob, _Mapping]]] = ..., drafted_tokens: _Optional[_Iterable[int]] = ..., prefill_time_s: _Optional[float] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released", "active_sessions")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    released: bool
    active_sessions: int
    def __init__(self, released: _Optional[bool] = ..., active_sessions: _Optional[int] = ...) -> None: ...

from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class Verification(_message.Message):
    __slots__ = ("alpha", "beta", "rule", "tune_beta")
    RULE_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    TUNE_BETA_FIELD_NUMBER: _ClassVar[int]
    rule: str
    alpha: float
    beta: float
    tune_beta: bool
    def __init__(self, rule: str | None = ..., alpha: float | None = ..., beta: float | None = ..., tune_beta: bool | None = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("max_new_tokens", "prompt", "prompt_token_ids", "seed", "session_id", "stop", "stop_threshold", "temperature", "top_p", "verification")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    STOP_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    session_id: str
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    verification: Verification
    stop_threshold: float
    def __init__(self, prompt: str | None = ..., prompt_token_ids: _Iterable[int] | None = ..., session_id: str | None = ..., max_new_tokens: int | None = ..., temperature: float | None = ..., top_p: float | None = ..., seed: int | None = ..., stop: _Iterable[str] | None = ..., verification: Verification | _Mapping | None = ..., stop_threshold: float | None = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("accepted", "calls", "drafted", "hops", "time_s", "tokens_processed")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    calls: int
    tokens_processed: int
    time_s: float
    hops: int
    drafted: int
    accepted: int
    def __init__(self, calls: int | None = ..., tokens_processed: int | None = ..., time_s: float | None = ..., hops: int | None = ..., drafted: int | None = ..., accepted: int | None = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("accepted_by_position", "drafted_by_position", "generated_tokens", "loglik_loss", "mean_accepted_length", "off_target_tokens", "swi_params", "target_calls", "tiers", "tv_deviation", "verification", "wall_s")
    class TiersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TierStats
        def __init__(self, key: str | None = ..., value: TierStats | _Mapping | None = ...) -> None: ...
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_CALLS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    SWI_PARAMS_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    OFF_TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TV_DEVIATION_FIELD_NUMBER: _ClassVar[int]
    LOGLIK_LOSS_FIELD_NUMBER: _ClassVar[int]
    generated_tokens: int
    target_calls: int
    tiers: _containers.MessageMap[str, TierStats]
    accepted_by_position: _containers.RepeatedScalarFieldContainer[int]
    drafted_by_position: _containers.RepeatedScalarFieldContainer[int]
    mean_accepted_length: float
    wall_s: float
    swi_params: float
    verification: str
    off_target_tokens: int
    tv_deviation: float
    loglik_loss: float
    def __init__(self, generated_tokens: int | None = ..., target_calls: int | None = ..., tiers: _Mapping[str, TierStats] | None = ..., accepted_by_position: _Iterable[int] | None = ..., drafted_by_position: _Iterable[int] | None = ..., mean_accepted_length: float | None = ..., wall_s: float | None = ..., swi_params: float | None = ..., verification: str | None = ..., off_target_tokens: int | None = ..., tv_deviation: float | None = ..., loglik_loss: float | None = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("finish_reason", "session_id", "session_length", "stats", "text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerateStats
    session_id: str
    session_length: int
    def __init__(self, text: str | None = ..., token_ids: _Iterable[int] | None = ..., finish_reason: str | None = ..., stats: GenerateStats | _Mapping | None = ..., session_id: str | None = ..., session_length: int | None = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("finish_reason", "session_length", "stats", "text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerateStats
    session_length: int
    def __init__(self, text: str | None = ..., token_ids: _Iterable[int] | None = ..., finish_reason: str | None = ..., stats: GenerateStats | _Mapping | None = ..., session_length: int | None = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "session_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: str | None = ..., prompt: str | None = ..., prompt_token_ids: _Iterable[int] | None = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "text", "token_ids", "version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    version: int
    text: str
    def __init__(self, session_id: str | None = ..., token_ids: _Iterable[int] | None = ..., version: int | None = ..., text: str | None = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: str | None = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: str | None = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: bool | None = ...) -> None: ...

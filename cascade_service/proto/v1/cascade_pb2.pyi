from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Verification(_message.Message):
    __slots__ = ("rule", "alpha", "beta", "tune_beta")
    RULE_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    TUNE_BETA_FIELD_NUMBER: _ClassVar[int]
    rule: str
    alpha: float
    beta: float
    tune_beta: bool
    def __init__(self, rule: _Optional[str] = ..., alpha: _Optional[float] = ..., beta: _Optional[float] = ..., tune_beta: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "session_id", "max_new_tokens", "temperature", "top_p", "seed", "stop", "verification", "stop_threshold", "speculation", "top_k", "min_p", "logit_bias", "prediction", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "response_format", "n", "best_of")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
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
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
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
    speculation: Speculation
    top_k: int
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    prediction: Prediction
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    response_format: ResponseFormat
    n: int
    best_of: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., session_id: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., verification: _Optional[_Union[Verification, _Mapping]] = ..., stop_threshold: _Optional[float] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prediction: _Optional[_Union[Prediction, _Mapping]] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark", "whitespace")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    whitespace: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ..., whitespace: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "text", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "text", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("content", "token_ids")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    content: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, content: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("mode", "target_row")
    MODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_ROW_FIELD_NUMBER: _ClassVar[int]
    mode: str
    target_row: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, mode: _Optional[str] = ..., target_row: _Optional[_Iterable[int]] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("calls", "tokens_processed", "time_s", "hops", "drafted", "accepted", "tokens_cached")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_CACHED_FIELD_NUMBER: _ClassVar[int]
    calls: int
    tokens_processed: int
    time_s: float
    hops: int
    drafted: int
    accepted: int
    tokens_cached: int
    def __init__(self, calls: _Optional[int] = ..., tokens_processed: _Optional[int] = ..., time_s: _Optional[float] = ..., hops: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., tokens_cached: _Optional[int] = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("generated_tokens", "target_calls", "tiers", "accepted_by_position", "drafted_by_position", "mean_accepted_length", "wall_s", "swi_params", "verification", "off_target_tokens", "tv_deviation", "loglik_loss", "rows", "pass_s", "loop_s", "waited_s", "cached_prompt_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens", "drafted_rounds")
    class TiersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TierStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TierStats, _Mapping]] = ...) -> None: ...
    class RowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RowStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RowStats, _Mapping]] = ...) -> None: ...
    class PassSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
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
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PASS_S_FIELD_NUMBER: _ClassVar[int]
    LOOP_S_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
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
    rows: _containers.MessageMap[str, RowStats]
    pass_s: _containers.ScalarMap[str, float]
    loop_s: float
    waited_s: float
    cached_prompt_tokens: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    drafted_rounds: int
    def __init__(self, generated_tokens: _Optional[int] = ..., target_calls: _Optional[int] = ..., tiers: _Optional[_Mapping[str, TierStats]] = ..., accepted_by_position: _Optional[_Iterable[int]] = ..., drafted_by_position: _Optional[_Iterable[int]] = ..., mean_accepted_length: _Optional[float] = ..., wall_s: _Optional[float] = ..., swi_params: _Optional[float] = ..., verification: _Optional[str] = ..., off_target_tokens: _Optional[int] = ..., tv_deviation: _Optional[float] = ..., loglik_loss: _Optional[float] = ..., rows: _Optional[_Mapping[str, RowStats]] = ..., pass_s: _Optional[_Mapping[str, float]] = ..., loop_s: _Optional[float] = ..., waited_s: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ..., drafted_rounds: _Optional[int] = ...) -> None: ...

class EntryStats(_message.Message):
    __slots__ = ("blocks", "ended", "share", "tokens")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    ended: int
    share: float
    tokens: int
    def __init__(self, blocks: _Optional[int] = ..., ended: _Optional[int] = ..., share: _Optional[float] = ..., tokens: _Optional[int] = ...) -> None: ...

class RowStats(_message.Message):
    __slots__ = ("blocks", "gated", "entries")
    class EntriesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: EntryStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[EntryStats, _Mapping]] = ...) -> None: ...
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GATED_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    gated: int
    entries: _containers.MessageMap[str, EntryStats]
    def __init__(self, blocks: _Optional[int] = ..., gated: _Optional[int] = ..., entries: _Optional[_Mapping[str, EntryStats]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "session_id", "session_length", "logprobs", "choices")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerateStats
    session_id: str
    session_length: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., session_id: _Optional[str] = ..., session_length: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "stats", "logprobs", "seed")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerateStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    seed: int
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "session_length", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerateStats
    session_length: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., session_length: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt", "prompt_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "token_ids", "version", "text")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    version: int
    text: str
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., version: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

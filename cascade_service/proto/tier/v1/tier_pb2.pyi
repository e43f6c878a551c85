from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Context(_message.Message):
    __slots__ = ("tokens", "stable", "offset", "prefix")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STABLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    stable: int
    offset: int
    prefix: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., stable: _Optional[int] = ..., offset: _Optional[int] = ..., prefix: _Optional[int] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "rows", "top_k", "min_p", "logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty", "output_start")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    rows: bool
    top_k: int
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    output_start: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., rows: _Optional[bool] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., output_start: _Optional[int] = ...) -> None: ...

class Rows(_message.Message):
    __slots__ = ("rows", "cols", "float32")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    FLOAT32_FIELD_NUMBER: _ClassVar[int]
    rows: int
    cols: int
    float32: bytes
    def __init__(self, rows: _Optional[int] = ..., cols: _Optional[int] = ..., float32: _Optional[bytes] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("tokens", "token_probs", "dists", "origins")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    DISTS_FIELD_NUMBER: _ClassVar[int]
    ORIGINS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    token_probs: _containers.RepeatedScalarFieldContainer[float]
    dists: Rows
    origins: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., token_probs: _Optional[_Iterable[float]] = ..., dists: _Optional[_Union[Rows, _Mapping]] = ..., origins: _Optional[_Iterable[str]] = ...) -> None: ...

class Adaptive(_message.Message):
    __slots__ = ("rule", "threshold", "head")
    RULE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    rule: str
    threshold: float
    head: str
    def __init__(self, rule: _Optional[str] = ..., threshold: _Optional[float] = ..., head: _Optional[str] = ...) -> None: ...

class FinalRule(_message.Message):
    __slots__ = ("rule", "alpha", "beta")
    RULE_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    rule: str
    alpha: float
    beta: float
    def __init__(self, rule: _Optional[str] = ..., alpha: _Optional[float] = ..., beta: _Optional[float] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("request_id", "tier", "context", "want", "limit", "sampling", "seed", "eos_ids", "adaptive", "min_match", "cache_salt", "grammar", "keyed")
    class AdaptiveEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Adaptive
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Adaptive, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EOS_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    MIN_MATCH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    KEYED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tier: str
    context: Context
    want: int
    limit: int
    sampling: Sampling
    seed: int
    eos_ids: _containers.RepeatedScalarFieldContainer[int]
    adaptive: _containers.MessageMap[str, Adaptive]
    min_match: int
    cache_salt: str
    grammar: Grammar
    keyed: bool
    def __init__(self, request_id: _Optional[str] = ..., tier: _Optional[str] = ..., context: _Optional[_Union[Context, _Mapping]] = ..., want: _Optional[int] = ..., limit: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., seed: _Optional[int] = ..., eos_ids: _Optional[_Iterable[int]] = ..., adaptive: _Optional[_Mapping[str, Adaptive]] = ..., min_match: _Optional[int] = ..., cache_salt: _Optional[str] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., keyed: _Optional[bool] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "text", "start", "at", "whitespace")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    start: int
    at: int
    whitespace: str
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ..., start: _Optional[int] = ..., at: _Optional[int] = ..., whitespace: _Optional[str] = ...) -> None: ...

class TierCounters(_message.Message):
    __slots__ = ("calls", "tokens_processed", "tokens_out", "time_s", "hops", "tokens_cached")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_OUT_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_CACHED_FIELD_NUMBER: _ClassVar[int]
    calls: int
    tokens_processed: int
    tokens_out: int
    time_s: float
    hops: int
    tokens_cached: int
    def __init__(self, calls: _Optional[int] = ..., tokens_processed: _Optional[int] = ..., tokens_out: _Optional[int] = ..., time_s: _Optional[float] = ..., hops: _Optional[int] = ..., tokens_cached: _Optional[int] = ...) -> None: ...

class ReviewCounters(_message.Message):
    __slots__ = ("reviews", "drafted", "accepted", "rejections", "drafted_by_position", "accepted_by_position", "drafted_by_drafter", "accepted_by_drafter", "ran_by_drafter", "ended_by_drafter", "gated")
    class DraftedByDrafterEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AcceptedByDrafterEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RanByDrafterEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class EndedByDrafterEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REVIEWS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_BY_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    RAN_BY_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    ENDED_BY_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    GATED_FIELD_NUMBER: _ClassVar[int]
    reviews: int
    drafted: int
    accepted: int
    rejections: int
    drafted_by_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_by_position: _containers.RepeatedScalarFieldContainer[int]
    drafted_by_drafter: _containers.ScalarMap[str, int]
    accepted_by_drafter: _containers.ScalarMap[str, int]
    ran_by_drafter: _containers.ScalarMap[str, int]
    ended_by_drafter: _containers.ScalarMap[str, int]
    gated: int
    def __init__(self, reviews: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., rejections: _Optional[int] = ..., drafted_by_position: _Optional[_Iterable[int]] = ..., accepted_by_position: _Optional[_Iterable[int]] = ..., drafted_by_drafter: _Optional[_Mapping[str, int]] = ..., accepted_by_drafter: _Optional[_Mapping[str, int]] = ..., ran_by_drafter: _Optional[_Mapping[str, int]] = ..., ended_by_drafter: _Optional[_Mapping[str, int]] = ..., gated: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("tiers", "reviews", "off_target", "tv", "ll_loss")
    class TiersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TierCounters
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TierCounters, _Mapping]] = ...) -> None: ...
    class ReviewsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ReviewCounters
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ReviewCounters, _Mapping]] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    REVIEWS_FIELD_NUMBER: _ClassVar[int]
    OFF_TARGET_FIELD_NUMBER: _ClassVar[int]
    TV_FIELD_NUMBER: _ClassVar[int]
    LL_LOSS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.MessageMap[str, TierCounters]
    reviews: _containers.MessageMap[str, ReviewCounters]
    off_target: int
    tv: float
    ll_loss: float
    def __init__(self, tiers: _Optional[_Mapping[str, TierCounters]] = ..., reviews: _Optional[_Mapping[str, ReviewCounters]] = ..., off_target: _Optional[int] = ..., tv: _Optional[float] = ..., ll_loss: _Optional[float] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("block", "usage", "stopped", "resend")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    RESEND_FIELD_NUMBER: _ClassVar[int]
    block: Block
    usage: Usage
    stopped: bool
    resend: bool
    def __init__(self, block: _Optional[_Union[Block, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stopped: _Optional[bool] = ..., resend: _Optional[bool] = ...) -> None: ...

class ReviewRequest(_message.Message):
    __slots__ = ("request_id", "tier", "context", "block", "leniency", "sampling", "seed", "verification", "cache_salt", "logprobs", "allowed", "allowed_rows", "allowed_cols", "keyed", "probs_unread")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    LENIENCY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_ROWS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_COLS_FIELD_NUMBER: _ClassVar[int]
    KEYED_FIELD_NUMBER: _ClassVar[int]
    PROBS_UNREAD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tier: str
    context: Context
    block: Block
    leniency: float
    sampling: Sampling
    seed: int
    verification: FinalRule
    cache_salt: str
    logprobs: int
    allowed: bytes
    allowed_rows: int
    allowed_cols: int
    keyed: bool
    probs_unread: bool
    def __init__(self, request_id: _Optional[str] = ..., tier: _Optional[str] = ..., context: _Optional[_Union[Context, _Mapping]] = ..., block: _Optional[_Union[Block, _Mapping]] = ..., leniency: _Optional[float] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., seed: _Optional[int] = ..., verification: _Optional[_Union[FinalRule, _Mapping]] = ..., cache_salt: _Optional[str] = ..., logprobs: _Optional[int] = ..., allowed: _Optional[bytes] = ..., allowed_rows: _Optional[int] = ..., allowed_cols: _Optional[int] = ..., keyed: _Optional[bool] = ..., probs_unread: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "top_tokens", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("accepted", "token", "token_probs", "dists", "off_target", "tv", "ll_loss", "logprobs")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    DISTS_FIELD_NUMBER: _ClassVar[int]
    OFF_TARGET_FIELD_NUMBER: _ClassVar[int]
    TV_FIELD_NUMBER: _ClassVar[int]
    LL_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    token: int
    token_probs: _containers.RepeatedScalarFieldContainer[float]
    dists: Rows
    off_target: int
    tv: float
    ll_loss: float
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, accepted: _Optional[int] = ..., token: _Optional[int] = ..., token_probs: _Optional[_Iterable[float]] = ..., dists: _Optional[_Union[Rows, _Mapping]] = ..., off_target: _Optional[int] = ..., tv: _Optional[float] = ..., ll_loss: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ReviewReply(_message.Message):
    __slots__ = ("verdict", "usage", "resend")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    RESEND_FIELD_NUMBER: _ClassVar[int]
    verdict: Verdict
    usage: Usage
    resend: bool
    def __init__(self, verdict: _Optional[_Union[Verdict, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., resend: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "tier", "context")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tier: str
    context: Context
    def __init__(self, request_id: _Optional[str] = ..., tier: _Optional[str] = ..., context: _Optional[_Union[Context, _Mapping]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: bool
    def __init__(self, held: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "num_parameters", "eos_token_ids", "max_positions", "device", "system", "max_block", "encoder_decoder", "decoder_start")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_FIELD_NUMBER: _ClassVar[int]
    ENCODER_DECODER_FIELD_NUMBER: _ClassVar[int]
    DECODER_START_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    num_parameters: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_positions: int
    device: str
    system: bool
    max_block: int
    encoder_decoder: bool
    decoder_start: int
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_parameters: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_positions: _Optional[int] = ..., device: _Optional[str] = ..., system: _Optional[bool] = ..., max_block: _Optional[int] = ..., encoder_decoder: _Optional[bool] = ..., decoder_start: _Optional[int] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("tiers", "version")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierInfo]
    version: str
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierInfo, _Mapping]]] = ..., version: _Optional[str] = ...) -> None: ...

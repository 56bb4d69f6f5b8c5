from minisgl_core.proto.minisgl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitItem(_message.Message):
    __slots__ = ("rid", "input_ids", "sampling", "traceparent", "request_id", "cache_salt", "priority", "num_prompt_tokens", "tenant")
    RID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    rid: int
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    traceparent: str
    request_id: str
    cache_salt: str
    priority: int
    num_prompt_tokens: int
    tenant: int
    def __init__(self, rid: _Optional[int] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., traceparent: _Optional[str] = ..., request_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., tenant: _Optional[int] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("submits", "aborts", "stops")
    SUBMITS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    STOPS_FIELD_NUMBER: _ClassVar[int]
    submits: _containers.RepeatedCompositeFieldContainer[SubmitItem]
    aborts: _containers.RepeatedScalarFieldContainer[int]
    stops: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, submits: _Optional[_Iterable[_Union[SubmitItem, _Mapping]]] = ..., aborts: _Optional[_Iterable[int]] = ..., stops: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenUpdate(_message.Message):
    __slots__ = ("rid", "token_ids", "logprobs", "top_logprobs", "finish_reason", "error", "prompt_tokens", "cached_tokens")
    RID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rid: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    finish_reason: _common_pb2.FinishReason
    error: _common_pb2.Error
    prompt_tokens: int
    cached_tokens: int
    def __init__(self, rid: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[TokenUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[TokenUpdate, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("rids",)
    RIDS_FIELD_NUMBER: _ClassVar[int]
    rids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rids: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    def __init__(self, aborted: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "used_pages", "total_pages", "cached_pages", "prefix_hit_rate")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    used_pages: int
    total_pages: int
    cached_pages: int
    prefix_hit_rate: float
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., used_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., cached_pages: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model_name", "max_model_len", "page_size", "num_pages", "max_running_requests", "max_queued_requests", "vocab_size", "eos_token_ids")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    page_size: int
    num_pages: int
    max_running_requests: int
    max_queued_requests: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("resume_after", "load_interval_s")
    RESUME_AFTER_FIELD_NUMBER: _ClassVar[int]
    LOAD_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    resume_after: int
    load_interval_s: float
    def __init__(self, resume_after: _Optional[int] = ..., load_interval_s: _Optional[float] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "used_pages", "total_pages", "cached_pages", "draining", "max_running_requests", "watchers", "worker_down")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WATCHERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_DOWN_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    used_pages: int
    total_pages: int
    cached_pages: int
    draining: bool
    max_running_requests: int
    watchers: int
    worker_down: bool
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., used_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., cached_pages: _Optional[int] = ..., draining: bool = ..., max_running_requests: _Optional[int] = ..., watchers: _Optional[int] = ..., worker_down: bool = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("seq", "snapshot", "stored", "removed", "load", "page_size", "window", "window_stored", "window_removed")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STORED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_REMOVED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    load: EngineLoad
    page_size: int
    window: int
    window_stored: _containers.RepeatedScalarFieldContainer[int]
    window_removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., snapshot: bool = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., page_size: _Optional[int] = ..., window: _Optional[int] = ..., window_stored: _Optional[_Iterable[int]] = ..., window_removed: _Optional[_Iterable[int]] = ...) -> None: ...

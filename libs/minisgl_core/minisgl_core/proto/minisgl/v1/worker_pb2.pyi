from minisgl_core.proto.minisgl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestPlan(_message.Message):
    __slots__ = ("rid", "slot", "cache_len", "input_ids", "page_offset", "new_pages", "sample", "sampling", "history_ids", "num_prompt_tokens", "request_id", "new_window_pages")
    RID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HISTORY_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_WINDOW_PAGES_FIELD_NUMBER: _ClassVar[int]
    rid: int
    slot: int
    cache_len: int
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    page_offset: int
    new_pages: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    sampling: _common_pb2.SamplingParams
    history_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    request_id: str
    new_window_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rid: _Optional[int] = ..., slot: _Optional[int] = ..., cache_len: _Optional[int] = ..., input_ids: _Optional[_Iterable[int]] = ..., page_offset: _Optional[int] = ..., new_pages: _Optional[_Iterable[int]] = ..., sample: bool = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., history_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., new_window_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeEntries(_message.Message):
    __slots__ = ("rids", "slots", "cache_lens", "page_offsets", "new_page_counts", "new_pages", "new_window_pages")
    RIDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    NEW_WINDOW_PAGES_FIELD_NUMBER: _ClassVar[int]
    rids: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    cache_lens: _containers.RepeatedScalarFieldContainer[int]
    page_offsets: _containers.RepeatedScalarFieldContainer[int]
    new_page_counts: _containers.RepeatedScalarFieldContainer[int]
    new_pages: _containers.RepeatedScalarFieldContainer[int]
    new_window_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rids: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ..., cache_lens: _Optional[_Iterable[int]] = ..., page_offsets: _Optional[_Iterable[int]] = ..., new_page_counts: _Optional[_Iterable[int]] = ..., new_pages: _Optional[_Iterable[int]] = ..., new_window_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "requests", "decodes", "traceparents")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DECODES_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestPlan]
    decodes: DecodeEntries
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestPlan, _Mapping]]] = ..., decodes: _Optional[_Union[DecodeEntries, _Mapping]] = ..., traceparents: _Optional[_Iterable[str]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "rids", "token_ids", "logprobs", "top_logprobs", "forward_ms", "error", "worker_epoch")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RIDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    forward_ms: float
    error: _common_pb2.Error
    worker_epoch: int
    def __init__(self, step_id: _Optional[int] = ..., rids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., forward_ms: _Optional[float] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., worker_epoch: _Optional[int] = ...) -> None: ...

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWorkerInfoResponse(_message.Message):
    __slots__ = ("model_name", "num_pages", "page_size", "max_model_len", "max_slots", "vocab_size", "eos_token_ids", "tp_size", "device", "attention_backend", "kv_cache_dtype", "epoch", "two_shot_max_tokens", "window_pages", "window")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TWO_SHOT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PAGES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    num_pages: int
    page_size: int
    max_model_len: int
    max_slots: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tp_size: int
    device: str
    attention_backend: str
    kv_cache_dtype: str
    epoch: int
    two_shot_max_tokens: int
    window_pages: int
    window: int
    def __init__(self, model_name: _Optional[str] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_slots: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tp_size: _Optional[int] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., epoch: _Optional[int] = ..., two_shot_max_tokens: _Optional[int] = ..., window_pages: _Optional[int] = ..., window: _Optional[int] = ...) -> None: ...

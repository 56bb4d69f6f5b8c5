from minisgl_core.proto.minisgl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DetokenizeUpdate(_message.Message):
    __slots__ = ("rid", "token_ids", "stop", "finished", "traceparent", "request_id")
    RID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    rid: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _common_pb2.StopConditions
    finished: bool
    traceparent: str
    request_id: str
    def __init__(self, rid: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Union[_common_pb2.StopConditions, _Mapping]] = ..., finished: bool = ..., traceparent: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[DetokenizeUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[DetokenizeUpdate, _Mapping]]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("rid", "text", "stopped", "matched_stop", "num_tokens")
    RID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rid: int
    text: str
    stopped: bool
    matched_stop: str
    num_tokens: int
    def __init__(self, rid: _Optional[int] = ..., text: _Optional[str] = ..., stopped: bool = ..., matched_stop: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("deltas",)
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[TextDelta]
    def __init__(self, deltas: _Optional[_Iterable[_Union[TextDelta, _Mapping]]] = ...) -> None: ...

from minisgl_core.proto.minisgl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatInput(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools_json", "chat_template_kwargs_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    add_generation_prompt: bool
    tools_json: str
    chat_template_kwargs_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., add_generation_prompt: bool = ..., tools_json: _Optional[str] = ..., chat_template_kwargs_json: _Optional[str] = ...) -> None: ...

class TokenizeItem(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _common_pb2.TokenIds
    chat: ChatInput
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., add_special_tokens: bool = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("items", "max_prompt_tokens")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TokenizeItem]
    max_prompt_tokens: int
    def __init__(self, items: _Optional[_Iterable[_Union[TokenizeItem, _Mapping]]] = ..., max_prompt_tokens: _Optional[int] = ...) -> None: ...

class TokenizeResult(_message.Message):
    __slots__ = ("token_ids", "error")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    error: _common_pb2.Error
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenizeResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TokenizeResult, _Mapping]]] = ...) -> None: ...

class GetTokenizerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTokenizerInfoResponse(_message.Message):
    __slots__ = ("model_name", "vocab_size", "eos_token_ids", "max_model_len", "has_chat_template")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    has_chat_template: bool
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., has_chat_template: bool = ...) -> None: ...

class DecodeTokensRequest(_message.Message):
    __slots__ = ("token_ids", "join")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    join: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., join: bool = ...) -> None: ...

class DecodeTokensResponse(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

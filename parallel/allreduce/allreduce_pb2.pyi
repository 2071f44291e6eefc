from google.protobuf import empty_pb2 as _empty_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class AllReduceData(_message.Message):
    __slots__ = ("sync_key", "src_rank", "bool_val", "uint64_val", "mac")
    SYNC_KEY_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    BOOL_VAL_FIELD_NUMBER: _ClassVar[int]
    UINT64_VAL_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    sync_key: int
    src_rank: int
    bool_val: bool
    uint64_val: int
    mac: bytes
    def __init__(self, sync_key: _Optional[int] = ..., src_rank: _Optional[int] = ..., bool_val: bool = ..., uint64_val: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class ContributeReply(_message.Message):
    __slots__ = ("handled", "rejected_sync_key", "rejected")
    HANDLED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_SYNC_KEY_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    handled: int
    rejected_sync_key: int
    rejected: str
    def __init__(self, handled: _Optional[int] = ..., rejected_sync_key: _Optional[int] = ..., rejected: _Optional[str] = ...) -> None: ...

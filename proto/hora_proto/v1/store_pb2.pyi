from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StoreSetRequest(_message.Message):
    __slots__ = ("job_id", "key", "value")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    key: str
    value: bytes
    def __init__(self, job_id: _Optional[str] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class StoreSetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreGetRequest(_message.Message):
    __slots__ = ("job_id", "key", "timeout_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    key: str
    timeout_ms: int
    def __init__(self, job_id: _Optional[str] = ..., key: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class StoreGetResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class StoreAddRequest(_message.Message):
    __slots__ = ("job_id", "key", "amount")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    key: str
    amount: int
    def __init__(self, job_id: _Optional[str] = ..., key: _Optional[str] = ..., amount: _Optional[int] = ...) -> None: ...

class StoreAddResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class StoreWaitRequest(_message.Message):
    __slots__ = ("job_id", "keys", "timeout_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    timeout_ms: int
    def __init__(self, job_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class StoreWaitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreCompareSetRequest(_message.Message):
    __slots__ = ("job_id", "key", "expected", "desired")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    key: str
    expected: bytes
    desired: bytes
    def __init__(self, job_id: _Optional[str] = ..., key: _Optional[str] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ...) -> None: ...

class StoreCompareSetResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class StoreDeleteRequest(_message.Message):
    __slots__ = ("job_id", "key")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    key: str
    def __init__(self, job_id: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class StoreDeleteResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

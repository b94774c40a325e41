from hora_proto.v1 import rendezvous_pb2 as _rendezvous_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_TYPE_UNSPECIFIED: _ClassVar[OpType]
    OP_TYPE_ALLREDUCE: _ClassVar[OpType]
    OP_TYPE_ALLGATHER: _ClassVar[OpType]
    OP_TYPE_BROADCAST: _ClassVar[OpType]
    OP_TYPE_ALLTOALL: _ClassVar[OpType]
    OP_TYPE_REDUCESCATTER: _ClassVar[OpType]
    OP_TYPE_BARRIER: _ClassVar[OpType]
    OP_TYPE_JOIN: _ClassVar[OpType]

class ReduceOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCE_OP_UNSPECIFIED: _ClassVar[ReduceOp]
    REDUCE_OP_AVERAGE: _ClassVar[ReduceOp]
    REDUCE_OP_SUM: _ClassVar[ReduceOp]
    REDUCE_OP_ADASUM: _ClassVar[ReduceOp]
    REDUCE_OP_MIN: _ClassVar[ReduceOp]
    REDUCE_OP_MAX: _ClassVar[ReduceOp]
    REDUCE_OP_PRODUCT: _ClassVar[ReduceOp]

class ResponseType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESPONSE_TYPE_UNSPECIFIED: _ClassVar[ResponseType]
    RESPONSE_TYPE_ALLREDUCE: _ClassVar[ResponseType]
    RESPONSE_TYPE_ALLGATHER: _ClassVar[ResponseType]
    RESPONSE_TYPE_BROADCAST: _ClassVar[ResponseType]
    RESPONSE_TYPE_ALLTOALL: _ClassVar[ResponseType]
    RESPONSE_TYPE_REDUCESCATTER: _ClassVar[ResponseType]
    RESPONSE_TYPE_BARRIER: _ClassVar[ResponseType]
    RESPONSE_TYPE_ERROR: _ClassVar[ResponseType]
    RESPONSE_TYPE_JOIN: _ClassVar[ResponseType]

class ErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_KIND_UNSPECIFIED: _ClassVar[ErrorKind]
    ERROR_KIND_MISMATCH: _ClassVar[ErrorKind]
    ERROR_KIND_RANK_GONE: _ClassVar[ErrorKind]
    ERROR_KIND_INVALID: _ClassVar[ErrorKind]

class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_TYPE_UNSPECIFIED: _ClassVar[EventType]
    EVENT_TYPE_MEMBER_LOST: _ClassVar[EventType]
    EVENT_TYPE_MEMBER_LEFT: _ClassVar[EventType]
    EVENT_TYPE_JOB_FAILED: _ClassVar[EventType]
    EVENT_TYPE_STALL_WARNING: _ClassVar[EventType]
OP_TYPE_UNSPECIFIED: OpType
OP_TYPE_ALLREDUCE: OpType
OP_TYPE_ALLGATHER: OpType
OP_TYPE_BROADCAST: OpType
OP_TYPE_ALLTOALL: OpType
OP_TYPE_REDUCESCATTER: OpType
OP_TYPE_BARRIER: OpType
OP_TYPE_JOIN: OpType
REDUCE_OP_UNSPECIFIED: ReduceOp
REDUCE_OP_AVERAGE: ReduceOp
REDUCE_OP_SUM: ReduceOp
REDUCE_OP_ADASUM: ReduceOp
REDUCE_OP_MIN: ReduceOp
REDUCE_OP_MAX: ReduceOp
REDUCE_OP_PRODUCT: ReduceOp
RESPONSE_TYPE_UNSPECIFIED: ResponseType
RESPONSE_TYPE_ALLREDUCE: ResponseType
RESPONSE_TYPE_ALLGATHER: ResponseType
RESPONSE_TYPE_BROADCAST: ResponseType
RESPONSE_TYPE_ALLTOALL: ResponseType
RESPONSE_TYPE_REDUCESCATTER: ResponseType
RESPONSE_TYPE_BARRIER: ResponseType
RESPONSE_TYPE_ERROR: ResponseType
RESPONSE_TYPE_JOIN: ResponseType
ERROR_KIND_UNSPECIFIED: ErrorKind
ERROR_KIND_MISMATCH: ErrorKind
ERROR_KIND_RANK_GONE: ErrorKind
ERROR_KIND_INVALID: ErrorKind
EVENT_TYPE_UNSPECIFIED: EventType
EVENT_TYPE_MEMBER_LOST: EventType
EVENT_TYPE_MEMBER_LEFT: EventType
EVENT_TYPE_JOB_FAILED: EventType
EVENT_TYPE_STALL_WARNING: EventType

class AddProcessSetRequest(_message.Message):
    __slots__ = ("job_id", "worker_id", "generation", "process_set_id", "ranks", "invalid")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PROCESS_SET_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker_id: str
    generation: int
    process_set_id: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    invalid: str
    def __init__(self, job_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., generation: _Optional[int] = ..., process_set_id: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., invalid: _Optional[str] = ...) -> None: ...

class AddProcessSetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveProcessSetRequest(_message.Message):
    __slots__ = ("job_id", "worker_id", "generation", "process_set_id", "invalid")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PROCESS_SET_ID_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker_id: str
    generation: int
    process_set_id: int
    invalid: str
    def __init__(self, job_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., generation: _Optional[int] = ..., process_set_id: _Optional[int] = ..., invalid: _Optional[str] = ...) -> None: ...

class RemoveProcessSetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorRequest(_message.Message):
    __slots__ = ("name", "op_type", "dtype", "shape", "device", "reduce_op", "root_rank", "prescale_factor", "postscale_factor", "process_set_id", "splits", "group_id", "group_size", "invalid", "resent", "received_list")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OP_TYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REDUCE_OP_FIELD_NUMBER: _ClassVar[int]
    ROOT_RANK_FIELD_NUMBER: _ClassVar[int]
    PRESCALE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    POSTSCALE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    PROCESS_SET_ID_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    RESENT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_LIST_FIELD_NUMBER: _ClassVar[int]
    name: str
    op_type: OpType
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    device: str
    reduce_op: ReduceOp
    root_rank: int
    prescale_factor: float
    postscale_factor: float
    process_set_id: int
    splits: _containers.RepeatedScalarFieldContainer[int]
    group_id: int
    group_size: int
    invalid: str
    resent: bool
    received_list: int
    def __init__(self, name: _Optional[str] = ..., op_type: _Optional[_Union[OpType, str]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., reduce_op: _Optional[_Union[ReduceOp, str]] = ..., root_rank: _Optional[int] = ..., prescale_factor: _Optional[float] = ..., postscale_factor: _Optional[float] = ..., process_set_id: _Optional[int] = ..., splits: _Optional[_Iterable[int]] = ..., group_id: _Optional[int] = ..., group_size: _Optional[int] = ..., invalid: _Optional[str] = ..., resent: _Optional[bool] = ..., received_list: _Optional[int] = ...) -> None: ...

class RequestList(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[TensorRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[TensorRequest, _Mapping]]] = ...) -> None: ...

class ReceivedLists(_message.Message):
    __slots__ = ("process_set_id", "last_number", "recent")
    PROCESS_SET_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_NUMBER_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    process_set_id: int
    last_number: int
    recent: _containers.RepeatedCompositeFieldContainer[ResponseList]
    def __init__(self, process_set_id: _Optional[int] = ..., last_number: _Optional[int] = ..., recent: _Optional[_Iterable[_Union[ResponseList, _Mapping]]] = ...) -> None: ...

class StreamOpen(_message.Message):
    __slots__ = ("job_id", "worker_id", "generation", "received")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker_id: str
    generation: int
    received: _containers.RepeatedCompositeFieldContainer[ReceivedLists]
    def __init__(self, job_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., generation: _Optional[int] = ..., received: _Optional[_Iterable[_Union[ReceivedLists, _Mapping]]] = ...) -> None: ...

class StreamHeartbeat(_message.Message):
    __slots__ = ("sequence", "telemetry")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    telemetry: _rendezvous_pb2.RankTelemetry
    def __init__(self, sequence: _Optional[int] = ..., telemetry: _Optional[_Union[_rendezvous_pb2.RankTelemetry, _Mapping]] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("open", "requests", "heartbeat")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    open: StreamOpen
    requests: RequestList
    heartbeat: StreamHeartbeat
    def __init__(self, open: _Optional[_Union[StreamOpen, _Mapping]] = ..., requests: _Optional[_Union[RequestList, _Mapping]] = ..., heartbeat: _Optional[_Union[StreamHeartbeat, _Mapping]] = ...) -> None: ...

class Response(_message.Message):
    __slots__ = ("type", "tensor_names", "process_set_id", "first_dims", "splits", "error_message", "error_kind", "join_fill", "last_joined_rank")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAMES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_SET_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_DIMS_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    JOIN_FILL_FIELD_NUMBER: _ClassVar[int]
    LAST_JOINED_RANK_FIELD_NUMBER: _ClassVar[int]
    type: ResponseType
    tensor_names: _containers.RepeatedScalarFieldContainer[str]
    process_set_id: int
    first_dims: _containers.RepeatedScalarFieldContainer[int]
    splits: _containers.RepeatedScalarFieldContainer[int]
    error_message: str
    error_kind: ErrorKind
    join_fill: _containers.RepeatedCompositeFieldContainer[TensorRequest]
    last_joined_rank: int
    def __init__(self, type: _Optional[_Union[ResponseType, str]] = ..., tensor_names: _Optional[_Iterable[str]] = ..., process_set_id: _Optional[int] = ..., first_dims: _Optional[_Iterable[int]] = ..., splits: _Optional[_Iterable[int]] = ..., error_message: _Optional[str] = ..., error_kind: _Optional[_Union[ErrorKind, str]] = ..., join_fill: _Optional[_Iterable[_Union[TensorRequest, _Mapping]]] = ..., last_joined_rank: _Optional[int] = ...) -> None: ...

class ResponseList(_message.Message):
    __slots__ = ("responses", "number")
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[Response]
    number: int
    def __init__(self, responses: _Optional[_Iterable[_Union[Response, _Mapping]]] = ..., number: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("type", "generation", "rank", "host", "pid", "message", "tensor_names", "missing_ranks", "unix_ms", "ranks")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAMES_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    type: EventType
    generation: int
    rank: int
    host: str
    pid: int
    message: str
    tensor_names: _containers.RepeatedScalarFieldContainer[str]
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    unix_ms: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, type: _Optional[_Union[EventType, str]] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., message: _Optional[str] = ..., tensor_names: _Optional[_Iterable[str]] = ..., missing_ranks: _Optional[_Iterable[int]] = ..., unix_ms: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamHeartbeatAnswer(_message.Message):
    __slots__ = ("sequence", "state")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    state: _rendezvous_pb2.HeartbeatResponse
    def __init__(self, sequence: _Optional[int] = ..., state: _Optional[_Union[_rendezvous_pb2.HeartbeatResponse, _Mapping]] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("responses", "event", "heartbeat")
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    responses: ResponseList
    event: Event
    heartbeat: StreamHeartbeatAnswer
    def __init__(self, responses: _Optional[_Union[ResponseList, _Mapping]] = ..., event: _Optional[_Union[Event, _Mapping]] = ..., heartbeat: _Optional[_Union[StreamHeartbeatAnswer, _Mapping]] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_UNSPECIFIED: _ClassVar[MemberState]
    MEMBER_STATE_JOINING: _ClassVar[MemberState]
    MEMBER_STATE_ACTIVE: _ClassVar[MemberState]
    MEMBER_STATE_LEFT: _ClassVar[MemberState]
    MEMBER_STATE_LOST: _ClassVar[MemberState]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_GATHERING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_FINISHED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
MEMBER_STATE_UNSPECIFIED: MemberState
MEMBER_STATE_JOINING: MemberState
MEMBER_STATE_ACTIVE: MemberState
MEMBER_STATE_LEFT: MemberState
MEMBER_STATE_LOST: MemberState
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_GATHERING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_FINISHED: JobState
JOB_STATE_FAILED: JobState

class JoinRequest(_message.Message):
    __slots__ = ("job_id", "worker_id", "host", "pid", "expected_size", "rank_hint", "data_plane_address", "fusion_threshold_bytes", "stall_warning_ms", "stall_shutdown_ms", "min_size", "max_size", "elastic_timeout_ms", "job_options")
    class JobOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_HINT_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FUSION_THRESHOLD_BYTES_FIELD_NUMBER: _ClassVar[int]
    STALL_WARNING_MS_FIELD_NUMBER: _ClassVar[int]
    STALL_SHUTDOWN_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SIZE_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    JOB_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker_id: str
    host: str
    pid: int
    expected_size: int
    rank_hint: int
    data_plane_address: str
    fusion_threshold_bytes: int
    stall_warning_ms: int
    stall_shutdown_ms: int
    min_size: int
    max_size: int
    elastic_timeout_ms: int
    job_options: _containers.ScalarMap[str, str]
    def __init__(self, job_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., expected_size: _Optional[int] = ..., rank_hint: _Optional[int] = ..., data_plane_address: _Optional[str] = ..., fusion_threshold_bytes: _Optional[int] = ..., stall_warning_ms: _Optional[int] = ..., stall_shutdown_ms: _Optional[int] = ..., min_size: _Optional[int] = ..., max_size: _Optional[int] = ..., elastic_timeout_ms: _Optional[int] = ..., job_options: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("rank", "worker_id", "host", "pid", "state", "data_plane_address", "local_rank", "last_heartbeat_unix_ms")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    worker_id: str
    host: str
    pid: int
    state: MemberState
    data_plane_address: str
    local_rank: int
    last_heartbeat_unix_ms: int
    def __init__(self, rank: _Optional[int] = ..., worker_id: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[MemberState, str]] = ..., data_plane_address: _Optional[str] = ..., local_rank: _Optional[int] = ..., last_heartbeat_unix_ms: _Optional[int] = ...) -> None: ...

class WorldView(_message.Message):
    __slots__ = ("job_id", "generation", "size", "rank", "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous", "members", "store_prefix", "host_update_epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CROSS_RANK_FIELD_NUMBER: _ClassVar[int]
    CROSS_SIZE_FIELD_NUMBER: _ClassVar[int]
    IS_HOMOGENEOUS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    STORE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    HOST_UPDATE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    size: int
    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    is_homogeneous: bool
    members: _containers.RepeatedCompositeFieldContainer[Member]
    store_prefix: str
    host_update_epoch: int
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., size: _Optional[int] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., local_size: _Optional[int] = ..., cross_rank: _Optional[int] = ..., cross_size: _Optional[int] = ..., is_homogeneous: _Optional[bool] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., store_prefix: _Optional[str] = ..., host_update_epoch: _Optional[int] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("world", "worker_secret")
    WORLD_FIELD_NUMBER: _ClassVar[int]
    WORKER_SECRET_FIELD_NUMBER: _ClassVar[int]
    world: WorldView
    worker_secret: str
    def __init__(self, world: _Optional[_Union[WorldView, _Mapping]] = ..., worker_secret: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("job_id", "worker_id", "reason", "rejoin")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker_id: str
    reason: str
    rejoin: bool
    def __init__(self, job_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., reason: _Optional[str] = ..., rejoin: _Optional[bool] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("job_id", "worker_id", "generation", "telemetry")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker_id: str
    generation: int
    telemetry: RankTelemetry
    def __init__(self, job_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., generation: _Optional[int] = ..., telemetry: _Optional[_Union[RankTelemetry, _Mapping]] = ...) -> None: ...

class RankTelemetry(_message.Message):
    __slots__ = ("steps", "last_step_s", "steps_per_s", "batch_size", "rounds", "lateness_p50_ms", "lateness_p95_ms", "last_arrivals", "cache_hits", "cache_misses")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LATENESS_P50_MS_FIELD_NUMBER: _ClassVar[int]
    LATENESS_P95_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_ARRIVALS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    steps: int
    last_step_s: float
    steps_per_s: float
    batch_size: int
    rounds: int
    lateness_p50_ms: float
    lateness_p95_ms: float
    last_arrivals: int
    cache_hits: int
    cache_misses: int
    def __init__(self, steps: _Optional[int] = ..., last_step_s: _Optional[float] = ..., steps_per_s: _Optional[float] = ..., batch_size: _Optional[int] = ..., rounds: _Optional[int] = ..., lateness_p50_ms: _Optional[float] = ..., lateness_p95_ms: _Optional[float] = ..., last_arrivals: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("generation", "job_state", "lease_ms", "failure", "host_update_epoch", "removals_only", "interval_ms")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    HOST_UPDATE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REMOVALS_ONLY_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    job_state: JobState
    lease_ms: int
    failure: str
    host_update_epoch: int
    removals_only: bool
    interval_ms: int
    def __init__(self, generation: _Optional[int] = ..., job_state: _Optional[_Union[JobState, str]] = ..., lease_ms: _Optional[int] = ..., failure: _Optional[str] = ..., host_update_epoch: _Optional[int] = ..., removals_only: _Optional[bool] = ..., interval_ms: _Optional[int] = ...) -> None: ...

class ReportEventRequest(_message.Message):
    __slots__ = ("job_id", "kind", "host", "message")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    kind: str
    host: str
    message: str
    def __init__(self, job_id: _Optional[str] = ..., kind: _Optional[str] = ..., host: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ReportEventResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEventsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("unix_ms", "kind", "generation", "rank", "host", "pid", "message")
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    unix_ms: int
    kind: str
    generation: int
    rank: int
    host: str
    pid: int
    message: str
    def __init__(self, unix_ms: _Optional[int] = ..., kind: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ListEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[JobEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[JobEvent, _Mapping]]] = ...) -> None: ...

class GetWorldRequest(_message.Message):
    __slots__ = ("job_id", "worker_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker_id: str
    def __init__(self, job_id: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class ProcessSetSpec(_message.Message):
    __slots__ = ("process_set_id", "ranks")
    PROCESS_SET_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    process_set_id: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, process_set_id: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class ReattachRequest(_message.Message):
    __slots__ = ("join", "world", "process_sets", "host_update_epoch")
    JOIN_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    PROCESS_SETS_FIELD_NUMBER: _ClassVar[int]
    HOST_UPDATE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    join: JoinRequest
    world: WorldView
    process_sets: _containers.RepeatedCompositeFieldContainer[ProcessSetSpec]
    host_update_epoch: int
    def __init__(self, join: _Optional[_Union[JoinRequest, _Mapping]] = ..., world: _Optional[_Union[WorldView, _Mapping]] = ..., process_sets: _Optional[_Iterable[_Union[ProcessSetSpec, _Mapping]]] = ..., host_update_epoch: _Optional[int] = ...) -> None: ...

class ReattachResponse(_message.Message):
    __slots__ = ("restored",)
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    restored: bool
    def __init__(self, restored: _Optional[bool] = ...) -> None: ...

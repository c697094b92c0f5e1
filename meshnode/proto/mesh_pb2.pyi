from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "addresses", "http_port", "grpc_port", "memory_budget", "total_memory", "compute", "version", "cluster_id", "models", "started_at", "tensor_port", "links", "layer_seconds", "collective_seconds", "holdings", "faults", "stalled_for", "slowdown", "slow_since", "protocol")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
    GRPC_PORT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PORT_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    LAYER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    STALLED_FOR_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    SLOW_SINCE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    addresses: _containers.RepeatedScalarFieldContainer[str]
    http_port: int
    grpc_port: int
    memory_budget: int
    total_memory: int
    compute: float
    version: str
    cluster_id: str
    models: _containers.RepeatedScalarFieldContainer[str]
    started_at: float
    tensor_port: int
    links: _containers.RepeatedCompositeFieldContainer[Link]
    layer_seconds: float
    collective_seconds: float
    holdings: _containers.RepeatedCompositeFieldContainer[ModelHolding]
    faults: _containers.RepeatedCompositeFieldContainer[ModelFault]
    stalled_for: float
    slowdown: float
    slow_since: float
    protocol: int
    def __init__(self, node_id: _Optional[str] = ..., addresses: _Optional[_Iterable[str]] = ..., http_port: _Optional[int] = ..., grpc_port: _Optional[int] = ..., memory_budget: _Optional[int] = ..., total_memory: _Optional[int] = ..., compute: _Optional[float] = ..., version: _Optional[str] = ..., cluster_id: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., started_at: _Optional[float] = ..., tensor_port: _Optional[int] = ..., links: _Optional[_Iterable[_Union[Link, _Mapping]]] = ..., layer_seconds: _Optional[float] = ..., collective_seconds: _Optional[float] = ..., holdings: _Optional[_Iterable[_Union[ModelHolding, _Mapping]]] = ..., faults: _Optional[_Iterable[_Union[ModelFault, _Mapping]]] = ..., stalled_for: _Optional[float] = ..., slowdown: _Optional[float] = ..., slow_since: _Optional[float] = ..., protocol: _Optional[int] = ...) -> None: ...

class ModelFault(_message.Message):
    __slots__ = ("model_id", "count", "error")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    count: int
    error: str
    def __init__(self, model_id: _Optional[str] = ..., count: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ModelHolding(_message.Message):
    __slots__ = ("model_id", "complete", "layers")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    complete: bool
    layers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., complete: _Optional[bool] = ..., layers: _Optional[_Iterable[str]] = ...) -> None: ...

class Link(_message.Message):
    __slots__ = ("peer", "address", "rtt_us", "jitter_us", "bandwidth", "measured_at", "rpc_rtt_us")
    PEER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RTT_US_FIELD_NUMBER: _ClassVar[int]
    JITTER_US_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    RPC_RTT_US_FIELD_NUMBER: _ClassVar[int]
    peer: str
    address: str
    rtt_us: float
    jitter_us: float
    bandwidth: float
    measured_at: float
    rpc_rtt_us: float
    def __init__(self, peer: _Optional[str] = ..., address: _Optional[str] = ..., rtt_us: _Optional[float] = ..., jitter_us: _Optional[float] = ..., bandwidth: _Optional[float] = ..., measured_at: _Optional[float] = ..., rpc_rtt_us: _Optional[float] = ...) -> None: ...

class Stage(_message.Message):
    __slots__ = ("start_layer", "end_layer", "nodes", "bytes", "endpoints")
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    start_layer: int
    end_layer: int
    nodes: _containers.RepeatedScalarFieldContainer[str]
    bytes: int
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., nodes: _Optional[_Iterable[str]] = ..., bytes: _Optional[int] = ..., endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("epoch", "model", "strategy", "stages", "reason", "coordinator", "max_context", "estimate_s", "alternatives", "kv_bits")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_S_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    model: str
    strategy: str
    stages: _containers.RepeatedCompositeFieldContainer[Stage]
    reason: str
    coordinator: str
    max_context: int
    estimate_s: float
    alternatives: str
    kv_bits: int
    def __init__(self, epoch: _Optional[int] = ..., model: _Optional[str] = ..., strategy: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[Stage, _Mapping]]] = ..., reason: _Optional[str] = ..., coordinator: _Optional[str] = ..., max_context: _Optional[int] = ..., estimate_s: _Optional[float] = ..., alternatives: _Optional[str] = ..., kv_bits: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node", "coordinator", "epoch", "alive", "plan", "ready_epoch", "plan_error", "models")
    NODE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    READY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_ERROR_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    coordinator: str
    epoch: int
    alive: _containers.RepeatedScalarFieldContainer[str]
    plan: Plan
    ready_epoch: int
    plan_error: str
    models: _containers.RepeatedCompositeFieldContainer[ModelState]
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., coordinator: _Optional[str] = ..., epoch: _Optional[int] = ..., alive: _Optional[_Iterable[str]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., ready_epoch: _Optional[int] = ..., plan_error: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelState, _Mapping]]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("node", "coordinator", "epoch", "alive", "plan", "known", "ready_epoch", "plan_error", "models")
    NODE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    READY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_ERROR_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    coordinator: str
    epoch: int
    alive: _containers.RepeatedScalarFieldContainer[str]
    plan: Plan
    known: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    ready_epoch: int
    plan_error: str
    models: _containers.RepeatedCompositeFieldContainer[ModelState]
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., coordinator: _Optional[str] = ..., epoch: _Optional[int] = ..., alive: _Optional[_Iterable[str]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., known: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., ready_epoch: _Optional[int] = ..., plan_error: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelState, _Mapping]]] = ...) -> None: ...

class ModelState(_message.Message):
    __slots__ = ("model", "epoch", "plan", "ready_epoch", "plan_error", "last_used", "active", "waiting")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    READY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    model: str
    epoch: int
    plan: Plan
    ready_epoch: int
    plan_error: str
    last_used: float
    active: int
    waiting: int
    def __init__(self, model: _Optional[str] = ..., epoch: _Optional[int] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., ready_epoch: _Optional[int] = ..., plan_error: _Optional[str] = ..., last_used: _Optional[float] = ..., active: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...

class InstallReply(_message.Message):
    __slots__ = ("accepted", "error", "epoch")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    epoch: int
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "start_layer", "end_layer", "input", "next_single", "raw_replies", "work", "resume", "resume_length", "keep", "keep_length", "lockstep", "members", "model", "rewind")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    NEXT_SINGLE_FIELD_NUMBER: _ClassVar[int]
    RAW_REPLIES_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    RESUME_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    KEEP_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    start_layer: int
    end_layer: int
    input: Tensor
    next_single: bool
    raw_replies: bool
    work: int
    resume: str
    resume_length: int
    keep: str
    keep_length: int
    lockstep: bool
    members: _containers.RepeatedScalarFieldContainer[str]
    model: str
    rewind: int
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., next_single: _Optional[bool] = ..., raw_replies: _Optional[bool] = ..., work: _Optional[int] = ..., resume: _Optional[str] = ..., resume_length: _Optional[int] = ..., keep: _Optional[str] = ..., keep_length: _Optional[int] = ..., lockstep: _Optional[bool] = ..., members: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., rewind: _Optional[int] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("output", "code", "error", "stage_seconds")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    code: int
    error: str
    stage_seconds: float
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., code: _Optional[int] = ..., error: _Optional[str] = ..., stage_seconds: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "prompt", "max_tokens", "temperature", "top_p", "has_seed", "seed", "offset", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "grammar", "model", "after")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    prompt: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    has_seed: bool
    seed: int
    offset: int
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: bool
    top_logprobs: int
    grammar: str
    model: str
    after: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., prompt: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., offset: _Optional[int] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., model: _Optional[str] = ..., after: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("token", "has_logprob", "logprob", "top_ids", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    has_logprob: bool
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., has_logprob: _Optional[bool] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class WorkerCommand(_message.Message):
    __slots__ = ("op", "slot", "input", "kept", "positions", "rewind", "all_positions")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FORWARD: _ClassVar[WorkerCommand.Op]
        CLOSE: _ClassVar[WorkerCommand.Op]
        KEEP: _ClassVar[WorkerCommand.Op]
        RESUME: _ClassVar[WorkerCommand.Op]
        FORGET: _ClassVar[WorkerCommand.Op]
    FORWARD: WorkerCommand.Op
    CLOSE: WorkerCommand.Op
    KEEP: WorkerCommand.Op
    RESUME: WorkerCommand.Op
    FORGET: WorkerCommand.Op
    OP_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    ALL_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    op: WorkerCommand.Op
    slot: int
    input: Tensor
    kept: int
    positions: int
    rewind: int
    all_positions: bool
    def __init__(self, op: _Optional[_Union[WorkerCommand.Op, str]] = ..., slot: _Optional[int] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., kept: _Optional[int] = ..., positions: _Optional[int] = ..., rewind: _Optional[int] = ..., all_positions: _Optional[bool] = ...) -> None: ...

class WorkerReply(_message.Message):
    __slots__ = ("output", "error", "info")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    error: str
    info: str
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., error: _Optional[str] = ..., info: _Optional[str] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("payload", "reply_bytes")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    reply_bytes: int
    def __init__(self, payload: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "length", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    length: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class FileEntry(_message.Message):
    __slots__ = ("path", "size", "sha256", "tensors", "header_length")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    HEADER_LENGTH_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    sha256: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    header_length: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., header_length: _Optional[int] = ...) -> None: ...

class ModelManifest(_message.Message):
    __slots__ = ("model_id", "digest", "files", "layers_held", "complete")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_HELD_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    digest: str
    files: _containers.RepeatedCompositeFieldContainer[FileEntry]
    layers_held: _containers.RepeatedScalarFieldContainer[str]
    complete: bool
    def __init__(self, model_id: _Optional[str] = ..., digest: _Optional[str] = ..., files: _Optional[_Iterable[_Union[FileEntry, _Mapping]]] = ..., layers_held: _Optional[_Iterable[str]] = ..., complete: _Optional[bool] = ...) -> None: ...

class ManifestRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("model_id", "path", "offset", "length")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    path: str
    offset: int
    length: int
    def __init__(self, model_id: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DataOpen(_message.Message):
    __slots__ = ("forward",)
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    forward: ForwardRequest
    def __init__(self, forward: _Optional[_Union[ForwardRequest, _Mapping]] = ...) -> None: ...

class DataHello(_message.Message):
    __slots__ = ("open", "ts", "nonce", "node", "mac")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    open: bytes
    ts: str
    nonce: str
    node: str
    mac: str
    def __init__(self, open: _Optional[bytes] = ..., ts: _Optional[str] = ..., nonce: _Optional[str] = ..., node: _Optional[str] = ..., mac: _Optional[str] = ...) -> None: ...

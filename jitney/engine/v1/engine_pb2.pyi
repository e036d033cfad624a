from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_1: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_2: _ClassVar[ProtocolVersion]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_1: ProtocolVersion
PROTOCOL_VERSION_2: ProtocolVersion

class SamplingConfig(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias_ids", "logit_bias_values", "min_tokens", "min_tokens_banned_ids", "top_logprobs", "prompt_logprobs", "num_prompt_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_BANNED_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    min_tokens: int
    min_tokens_banned_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: int
    prompt_logprobs: int
    num_prompt_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., min_tokens: _Optional[int] = ..., min_tokens_banned_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "sampling", "context_token_ids", "draft_context_token_ids", "lora_slot")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    sampling: SamplingConfig
    context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_slot: int
    def __init__(self, seq_id: _Optional[int] = ..., sampling: _Optional[_Union[SamplingConfig, _Mapping]] = ..., context_token_ids: _Optional[_Iterable[int]] = ..., draft_context_token_ids: _Optional[_Iterable[int]] = ..., lora_slot: _Optional[int] = ...) -> None: ...

class LoraLoad(_message.Message):
    __slots__ = ("slot", "name", "path")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    slot: int
    name: str
    path: str
    def __init__(self, slot: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ScheduledChunk(_message.Message):
    __slots__ = ("seq_id", "start_position", "token_ids", "new_block_ids", "sample", "last_token_from_sample", "masked", "num_draft_tokens", "num_proposals")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_FROM_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    MASKED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    last_token_from_sample: bool
    masked: bool
    num_draft_tokens: int
    num_proposals: int
    def __init__(self, seq_id: _Optional[int] = ..., start_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., last_token_from_sample: _Optional[bool] = ..., masked: _Optional[bool] = ..., num_draft_tokens: _Optional[int] = ..., num_proposals: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "freed_seq_ids", "new_sequences", "chunks", "reset", "lora_loads")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FREED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    LORA_LOADS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    freed_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    chunks: _containers.RepeatedCompositeFieldContainer[ScheduledChunk]
    reset: bool
    lora_loads: _containers.RepeatedCompositeFieldContainer[LoraLoad]
    def __init__(self, step_id: _Optional[int] = ..., freed_seq_ids: _Optional[_Iterable[int]] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., chunks: _Optional[_Iterable[_Union[ScheduledChunk, _Mapping]]] = ..., reset: _Optional[bool] = ..., lora_loads: _Optional[_Iterable[_Union[LoraLoad, _Mapping]]] = ...) -> None: ...

class StepMasks(_message.Message):
    __slots__ = ("step_id", "seq_ids", "bitmask")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    bitmask: bytes
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., bitmask: _Optional[bytes] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("plan", "shutdown", "masks", "incarnation")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    plan: StepPlan
    shutdown: Shutdown
    masks: StepMasks
    incarnation: int
    def __init__(self, plan: _Optional[_Union[StepPlan, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., masks: _Optional[_Union[StepMasks, _Mapping]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("protocol_version", "model_name", "vocab_size", "context_length", "eos_token_ids", "num_blocks", "block_size", "dtype", "device", "worker_pid", "max_num_seqs", "max_num_batched_tokens", "warmup_seconds", "batch_invariant", "tensor_parallel_size", "quantization", "model_implementation", "batch_invariance_guaranteed", "sliding_window", "draft_model", "draft_num_blocks", "max_loras", "max_lora_rank", "lora_modules")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WORKER_PID_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_IMPLEMENTATION_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANCE_GUARANTEED_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_MODULES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    model_name: str
    vocab_size: int
    context_length: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    worker_pid: int
    max_num_seqs: int
    max_num_batched_tokens: int
    warmup_seconds: float
    batch_invariant: bool
    tensor_parallel_size: int
    quantization: str
    model_implementation: str
    batch_invariance_guaranteed: bool
    sliding_window: int
    draft_model: str
    draft_num_blocks: int
    max_loras: int
    max_lora_rank: int
    lora_modules: _containers.RepeatedCompositeFieldContainer[LoraModule]
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., worker_pid: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., warmup_seconds: _Optional[float] = ..., batch_invariant: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ..., quantization: _Optional[str] = ..., model_implementation: _Optional[str] = ..., batch_invariance_guaranteed: _Optional[bool] = ..., sliding_window: _Optional[int] = ..., draft_model: _Optional[str] = ..., draft_num_blocks: _Optional[int] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., lora_modules: _Optional[_Iterable[_Union[LoraModule, _Mapping]]] = ...) -> None: ...

class LoraModule(_message.Message):
    __slots__ = ("name", "in_features", "out_features", "num_layers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    OUT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    in_features: int
    out_features: int
    num_layers: int
    def __init__(self, name: _Optional[str] = ..., in_features: _Optional[int] = ..., out_features: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "seq_ids", "token_ids", "logprobs", "worker_seconds", "model_seconds", "top_token_ids", "top_logprobs", "prompt_logprobs", "proposals", "draft_seconds", "draft_proposed_tokens")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WORKER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    worker_seconds: float
    model_seconds: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    proposals: _containers.RepeatedCompositeFieldContainer[DraftProposal]
    draft_seconds: float
    draft_proposed_tokens: int
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., worker_seconds: _Optional[float] = ..., model_seconds: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., proposals: _Optional[_Iterable[_Union[DraftProposal, _Mapping]]] = ..., draft_seconds: _Optional[float] = ..., draft_proposed_tokens: _Optional[int] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("seq_id", "start_position", "token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., start_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "start_position", "token_ids", "logprobs", "top_token_ids", "top_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., start_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("step_id", "message", "discarded")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    message: str
    discarded: bool
    def __init__(self, step_id: _Optional[int] = ..., message: _Optional[str] = ..., discarded: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("worker_pid",)
    WORKER_PID_FIELD_NUMBER: _ClassVar[int]
    worker_pid: int
    def __init__(self, worker_pid: _Optional[int] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("ready", "result", "error", "heartbeat", "incarnation")
    READY_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ready: Ready
    result: StepResult
    error: StepError
    heartbeat: Heartbeat
    incarnation: int
    def __init__(self, ready: _Optional[_Union[Ready, _Mapping]] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class RankMessage(_message.Message):
    __slots__ = ("step", "shutdown", "heartbeat")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    step: RankStep
    shutdown: Shutdown
    heartbeat: Heartbeat
    def __init__(self, step: _Optional[_Union[RankStep, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class RankStep(_message.Message):
    __slots__ = ("plan", "sampled_seq_ids", "sampled_token_ids")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    plan: StepPlan
    sampled_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, plan: _Optional[_Union[StepPlan, _Mapping]] = ..., sampled_seq_ids: _Optional[_Iterable[int]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

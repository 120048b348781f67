"""The planner's typed inputs: what a run trains on (`ModelShape`), how it trains (`PlanSettings`), and where
(`DeviceMemory`). Frozen dataclasses of plain numbers and names, so that a plan is a pure function of them.

`PlanSettings` is built from a `GRPOConfig` by `trainer.memory.plan_settings`, `ModelShape` from a model config by
`planning.shape.model_shape` (or from an instantiated model by `planning.shape.shape_of`); the estimate itself never
sees a config or a model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from grpo_trainer.modeling.forwards import ForwardSettings
from grpo_trainer.rollout.backend import MemoryProfile, memory_profile
from grpo_trainer.rollout.settings import BackendChoice

__all__ = ["DTYPE_BYTES", "DeviceMemory", "ModelShape", "PlanSettings", "RoundsHeld"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """A causal LM as trained (its adapter included), in numbers: sizes from its config, parameter counts taken on
    the meta device (no weights are read).

    Shapes: `V` vocabulary, `E` hidden size, `I` MLP width, `L` decoder layers, `H` query heads, `K` key/value
    heads, `D` head dim.
    """

    model_type: str
    vocab: int  # V
    hidden: int  # E
    intermediate: int  # I
    layers: int  # L
    heads: int  # H
    kv_heads: int  # K
    head_dim: int  # D
    tied_head: bool  # the LM head shares the input embedding's matrix
    parameters: int  # every distinct parameter of the base model (a tied head counted once)
    layer_parameters: int  # one decoder layer's
    linear_parameters: int  # the decoder layers' nn.Linear weights (what 4-bit and 8-bit quantisation pack)
    largest_parameter: int  # elements of the largest parameter tensor
    adapter_parameters: int = 0  # trainable adapter (LoRA) parameters; 0 without an adapter
    dropout_inputs: int = 0  # per layer: input features of the adapted modules with dropout (their dropped copies)
    factored_state: int = 0  # trainable matrices' rows + columns, plus trainable vectors' elements (Adafactor)
    # Which of a Llama-family layer's linear modules keep their input for the backward (trained, or adapted without
    # dropout), and whether its norms' weights train: what autograd saves (`estimate.activation_bytes_per_token`).
    attention_inputs_kept: int = 3  # of q/k/v (1 for a fused qkv projection)
    output_input_kept: bool = True  # o_proj
    mlp_inputs_kept: int = 2  # of gate/up (1 for a fused gate|up projection)
    down_input_kept: bool = True  # down_proj
    norms_trained: bool = True
    # The input embedding is a plain `nn.Embedding` lookup: tied, its rows' gradient goes into the head's
    # (`modeling.tied_embedding`) instead of a V x E matrix of its own
    plain_lookup: bool = True
    # A Mixture-of-Experts model's routers (`modeling.routing`): MoE layers, experts each token is sent to, experts
    # per layer; 0 for a dense model
    routed_layers: int = 0
    routed_top_k: int = 0
    experts: int = 0

    @property
    def trainable(self) -> int:
        """Parameters the optimizer updates: the adapter's, or every parameter."""
        return self.adapter_parameters or self.parameters

    @property
    def head_parameters(self) -> int:
        """V x E: the LM head's matrix (the embedding's when tied)."""
        return self.vocab * self.hidden


@dataclass(frozen=True)
class RoundsHeld:
    """What the trainer's round source holds beside the round that trains (`trainer.source.RoundSource.held`)."""

    ahead: int = 0  # finished rounds waiting for their step, sampled with older weights (never on-policy)
    sampling_overlaps_step: bool = False  # the next round is sampled while the step trains (an in-process sampler)


@dataclass(frozen=True)
class PlanSettings:
    """How one process trains: the GRPOConfig fields (and launch facts) that change its memory.

    Batch fields count completions (rows), as `per_device_train_batch_size` does.
    """

    device: str  # "cpu" or "cuda"
    micro_batch: int  # per_device_train_batch_size: rows per forward/backward
    accumulation_steps: int  # gradient_accumulation_steps
    steps_per_generation: int  # micro-steps one generation round serves
    num_iterations: int
    num_generations: int  # G
    prompt_length: int  # S: the longest prompt, in tokens
    completion_length: int  # T: max_completion_length
    weight_dtype: str = "float32"  # the dtype the weights are loaded in
    mixed_precision: str | None = None  # "bfloat16" / "float16" autocast over the weights (bf16=True, fp16=True)
    checkpointing: bool = True  # activation checkpointing
    beta: float = 0.0
    quantization: str | None = None  # "4bit" / "8bit" (bitsandbytes, QLoRA) or None
    optimizer: str = "adamw_torch_fused"  # TrainingArguments.optim
    sgd_momentum: float = 0.0
    max_grad_norm: float = 1.0
    # the training forward's options, the scorer's own object (`config.settings.forward_settings`): packing, LM-head
    # chunks, the sequence tiling, the recomputed attention, the tied lookup, activation offloading
    forward: ForwardSettings = ForwardSettings(padding_free=False)
    temperature_matches: bool = True  # sampling temperature == loss temperature (rollout values are the loss's)
    entropy_gradient: bool = False  # the loss differentiates the entropy (an entropy bonus)
    # a no-grad forward of each round at the weights that sampled it (`trainer.off_policy`): an engine's
    # importance-sampling correction, asynchronous rounds' 'recompute', the mismatch report's own forward
    sampler_scored: bool = False
    # what the rollout backend holds here (`rollout.backend.memory_profile`, the runtime's own choice of backend)
    rollout: MemoryProfile = memory_profile(BackendChoice(), "cpu")
    vllm_memory_fraction: float = 0.3  # vllm_gpu_memory_utilization
    vllm_max_model_length: int | None = None
    vllm_sleep: bool = False  # vllm_enable_sleep_mode
    vllm_cpu_kv_bytes: int = 4 * 2**30  # VLLM_CPU_KVCACHE_SPACE (vLLM's CPU build)
    continuous_memory_fraction: float = 0.5  # transformers' continuous batching: max_memory_percent
    processes: int = 1  # world size
    processes_per_node: int = 1  # processes sharing one machine's memory (CPU) or one GPU's (never: 1)
    zero_stage: int = 0  # DeepSpeed ZeRO stage (0: no DeepSpeed)
    zero_reduce_bucket: int = 500_000_000  # DeepSpeed reduce_bucket_size (elements)
    offload_optimizer: bool = False  # ZeRO offload of optimizer state to CPU memory
    offload_parameters: bool = False  # ZeRO-3 offload of parameters to CPU memory
    fsdp: bool = False  # FSDP (full sharding)
    gather_for_generation: bool = True  # ds3_gather_for_generation
    device_total_bytes: int = 0  # the GPU's memory (an engine's pool is a fraction of it); 0 when unknown
    heap_held: bool = True  # CPU: glibc's heap held to the live tensors (`runtime.host_memory`)
    routing_replay: bool = False  # a MoE model's rounds carry their routes (`routing_replay`, in-process rollouts)
    rounds: RoundsHeld = RoundsHeld()  # the round source's (`async_rollouts`)
    varlen_attention: bool = False  # flash-attention: attention per sequence, no [W, W] mask (`modeling.forwards`)
    resample_rounds: int = 0  # `zero_variance_groups='resample'`: `max_resample_rounds` extra rounds at most
    # `partial_rollouts` (alpha): a round decodes the groups of (1 + alpha) x its prompts, and a resumed row is
    # re-prefilled with its tokens so far, so its decode cache spans up to S + 2T columns (`rollout.partial`)
    partial_alpha: float = 0.0
    # parallelism_config's sp_size: the loss, old and reference forwards hold 1/sp of each row's positions, one
    # process's micro-batch at a time (ALST's loop, `trainer.sequence_group`), unmasked (Ulysses attention)
    sequence_parallel: int = 1

    def with_forward(self, **options) -> PlanSettings:
        """These settings with some of the forward's options changed."""
        return dataclasses.replace(self, forward=dataclasses.replace(self.forward, **options))

    @property
    def sequence_length(self) -> int:
        """N = S + T: tokens per row of a round (and of a forward without sequence parallelism)."""
        return self.prompt_length + self.completion_length

    @property
    def forward_length(self) -> int:
        """Tokens per row in this process's log-prob forwards: N, or its slice `ceil(N / sp)` under sequence
        parallelism (rows padded to a multiple of sp: `modeling.sequence_parallel.padded_width`)."""
        return -(-self.sequence_length // self.sequence_parallel)

    @property
    def decoded_rows(self) -> int:
        """Rows one rollout of this process decodes: `round_rows`, and with partial rollouts the extra groups'."""
        groups = -(-self.round_rows // self.num_generations)
        return self.round_rows + math.ceil(self.partial_alpha * groups) * self.num_generations

    @property
    def decode_columns(self) -> int:
        """Columns of the rollout's cache: S + T, and S + 2T with partial rollouts (a resumed row's tokens so far
        join its prompt, and the round's fresh rows still have T to go)."""
        return self.sequence_length + (self.completion_length if self.partial_alpha else 0)

    @property
    def round_rows(self) -> int:
        """Rows this process generates per round: micro_batch x steps_per_generation."""
        return self.micro_batch * self.steps_per_generation

    @property
    def on_policy(self) -> bool:
        """Every micro-step of a round runs before the next optimizer step (`trainer.schedule.Schedule.on_policy`);
        a round sampled ahead never is."""
        window = self.steps_per_generation * self.num_iterations
        return self.rounds.ahead == 0 and self.accumulation_steps % window == 0

    @property
    def plain_single_process(self) -> bool:
        """One process whose model no engine wraps (replay of layer outputs needs it: `rollout.capture`)."""
        return self.processes == 1 and self.zero_stage == 0 and not self.fsdp

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of linear layers' outputs: the autocast dtype, else the weights'."""
        return DTYPE_BYTES[self.mixed_precision or self.weight_dtype]

    @property
    def weight_bytes(self) -> int:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def shards_weights(self) -> bool:
        return self.zero_stage == 3 or self.fsdp

    @property
    def packs(self) -> bool:
        """The log-prob forwards run packed: `padding_free`, but not under ZeRO-3 / FSDP, which score padded by rule
        (`modeling.forwards`: the LM head runs inside the forward)."""
        return self.forward.padding_free and not self.shards_weights

    @property
    def shards_gradients(self) -> bool:
        return self.zero_stage >= 2 or self.fsdp

    @property
    def shards_optimizer(self) -> bool:
        return self.zero_stage >= 1 or self.fsdp


@dataclass(frozen=True)
class DeviceMemory:
    """The memory one process may use: a GPU's, or its share of the machine's RAM on CPU."""

    device: str  # "cpu" or "cuda"
    total_bytes: int
    source: str  # where the figure comes from (shown in the verdict)

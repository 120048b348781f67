"""What a rollout keeps for the loss, and within which memory budget. This module alone decides it.

Every backend returns the tokens and masks. Beyond them:

1. Sampling log-probs and entropies `[B, T]` (backends whose capabilities say `sampling_logps`) are kept when they
   are the distribution the loss scores: sampling (not greedy) at the loss's temperature. They are then the old
   log-probs, and on-policy the loss forward's own values (`modeling.logprobs`). An engine's log-probs
   (`SamplerRecord.logps` without `exact`) are never those values: they are kept whenever the rollout sampled (they
   are the sampler's distribution, whatever its temperature and filters), for the importance-sampling correction.
2. For `replay`, on-policy training may also keep every decoder layer's output `[B, L, S + T, E]` (the checkpointed
   loss forward returns them instead of running its layers) and every step's tempered softmax `[B, T, V]` (the LM
   head's backward takes it instead of recomputing the logits). Only on-policy training qualifies (the weights
   must be the sampling weights), in a single process whose model no engine wraps (DDP, DeepSpeed and FSDP hook
   the forward), and only the layer outputs need activation checkpointing.
3. Replay tensors are kept only while they fit together in `Capture.max_bytes`, layer outputs first (they are the
   smaller, and save the most). They live from the rollout to the round's last micro-step.
4. A multi-turn rollout whose completions hold tool results (`Rollout.env_mask`) keeps no sampling tensor of the
   trainer's process: tool tokens were never sampled, so no sampler value exists for them, and the loss must not
   read one there (on-policy stand-ins, old log-probs, replay). The loss computes what it needs with a forward
   instead. The turns after a tool result are rolled out keeping nothing (`KEEP_NOTHING`): only their tokens are
   used. An inference engine's log-probs (not the trainer's values: decision 1) are kept, following their tokens
   turn by turn (`rollout.multiturn.loop`, decision 5), for the importance-sampling correction.
5. Truncated sampling (top-k / top-p / min-p) with the loss's `keep_sampling_mask` (`Capture.kept_support`): the
   sampling log-probs are those of the softmax over each position's kept support, as the loss computes them, and
   the supports themselves are kept, packed, while they fit in `SUPPORT_MAX_BYTES` (`support_buffer`). Without
   them the loss would recompute the supports from its own logits by the truncation rules, which need not be the
   sampler's (other processors, rounding at the boundary), so then the sampling log-probs are dropped too.
6. A Mixture-of-Experts model's routing (`routed`, with `routing_replay`): the experts every prompt and completion
   token went to in every MoE layer, `[B, S + T, L, k]` in one or two bytes each (`modeling.routing`), recorded by
   hooks on the routers of the model the rollout runs in the process (`generate`, the forward tier), whatever the
   temperature (the experts are the sampler's in any case). A rollout whose forwards the hooks cannot lay out
   (continuous batching) keeps none, with the reason logged once. A multi-turn rollout keeps none (decision 4).

Shapes: `B` rows, `S` prompt tokens, `T` completion tokens (the maximum), `L` layers, `E` hidden size, `V` vocab.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from grpo_trainer.modeling import routing
from grpo_trainer.rollout.types import KeptSupports, PromptBatch, Rollout, SamplerRecord

__all__ = ["KEEP_NOTHING", "REPLAY_MAX_BYTES", "SUPPORT_MAX_BYTES", "Capture", "drop_for_tool_results",
           "drop_unusable", "plan", "replay_buffers", "routed", "support_buffer"]

logger = logging.getLogger(__name__)
_UNRECORDED: set[str] = set()  # reasons already logged (decision 6)

# A round of 8 x 1280-token rows of a 24-layer, 896-wide model in float32 keeps 0.9 GB of layer outputs (the tensors
# activation checkpointing keeps during the loss forward anyway); 8 x 256 tokens x a 32k vocabulary of softmax is
# 0.26 GB. A 152k vocabulary at 1024 tokens (5 GB) does not fit and is recomputed instead.
REPLAY_MAX_BYTES = 2**30
# Packed kept supports take one bit per vocabulary entry per position: 8 x 1024 tokens of a 152k vocabulary is 155 MB.
SUPPORT_MAX_BYTES = 2**30


@dataclass(frozen=True)
class Capture:
    """Replay tensors the loss wants from this rollout (a backend that cannot keep them ignores the request)."""

    layer_outputs: bool = False
    probs: bool = False
    max_bytes: int = REPLAY_MAX_BYTES
    kept_support: bool = False  # decision 5: the loss scores over the kept supports (`keep_sampling_mask`)


KEEP_NOTHING = Capture()  # tokens, masks and sampling log-probs only


def plan(*, training: bool, on_policy: bool, plain_single_process: bool, checkpointing: bool,
         kept_support: bool = False) -> Capture:
    """The replay tensors worth keeping for a round (decision 2), within `REPLAY_MAX_BYTES`; `kept_support`:
    decision 5."""
    replayable = training and on_policy
    return Capture(layer_outputs=replayable and plain_single_process and checkpointing,
                   probs=replayable, max_bytes=REPLAY_MAX_BYTES, kept_support=kept_support)


def support_buffer(capture: Capture, *, rows: int, max_new_tokens: int, vocab_size: int, device: torch.device
                   ) -> Tensor | None:
    """An empty `[B, T, ceil(V / 8)]` uint8 buffer for the packed kept supports, when the loss wants them and they
    fit in `SUPPORT_MAX_BYTES` (decision 5)."""
    shape = (rows, max_new_tokens, -(-vocab_size // 8))
    if not capture.kept_support or math.prod(shape) > SUPPORT_MAX_BYTES:
        return None
    return torch.zeros(shape, dtype=torch.uint8, device=device)


def replay_buffers(capture: Capture, *, rows: int, prompt_length: int, max_new_tokens: int, layers: int,
                   hidden_size: int, vocab_size: int, dtype: torch.dtype, device: torch.device
                   ) -> tuple[Tensor | None, Tensor | None]:
    """Empty buffers for the wanted replay tensors that fit within the budget, layer outputs first (decision 3):
    every layer's output `[B, L, S + T, E]` in `dtype` (zeros where nothing runs) and every step's softmax
    `[B, T, V]` float32."""
    budget = capture.max_bytes
    outputs_shape = (rows, layers, prompt_length + max_new_tokens, hidden_size)
    outputs = None
    if capture.layer_outputs and math.prod(outputs_shape) * dtype.itemsize <= budget:
        outputs = torch.zeros(outputs_shape, dtype=dtype, device=device)
        budget -= outputs.nbytes
    probs_shape = (rows, max_new_tokens, vocab_size)
    keep_probs = capture.probs and math.prod(probs_shape) * 4 <= budget
    return outputs, torch.empty(probs_shape, device=device) if keep_probs else None


def drop_unusable(rollout: Rollout, config: GenerationConfig, temperature: float, capture: Capture = KEEP_NOTHING
                  ) -> Rollout:
    """The rollout without its sampling tensors when they are not the distribution the loss scores (decision 1):
    greedy decoding, sampling at another temperature than the loss's, or a truncated sampler whose supports the
    loss would recompute (decision 5); and without the sampler's own values when greedy (no sampling distribution
    to correct for or compare with)."""
    record = original = rollout.sampler
    if not config.do_sample:
        record = replace(record, logps=None, entropy=None, exact=False, kept=KeptSupports(),
                         replay=replace(record.replay, probs=None))
    kept = record.kept
    truncated_unknown = capture.kept_support and kept.log_mass is not None and kept.mask is None
    if record.exact and (config.temperature != temperature or truncated_unknown):  # decision 1: not the loss's
        record = replace(record, logps=None, entropy=None, exact=False, replay=replace(record.replay, probs=None))
    return rollout if record is original else replace(rollout, sampler=record)


def drop_for_tool_results(rollout: Rollout) -> Rollout:
    """The rollout without any sampling tensor when tools wrote part of its completions (decision 4)."""
    if rollout.env_mask is None:
        return rollout
    record = rollout.sampler  # an engine's log-probs follow their tokens (`multiturn.loop`, decision 5)
    return replace(rollout, sampler=SamplerRecord(record.kind, record.version,
                                                  logps=None if record.exact else record.logps))


def routed(lm: nn.Module, prompts: PromptBatch, generate: Callable[[], Rollout]) -> Rollout:
    """`generate()`'s rollout of `prompts` by causal LM `lm` in this process, with the experts its routers chose
    (the sampler record's `routes`, decision 6); None there, with the reason logged once, where the forwards do not lay
    out as a prefill then one token per row."""
    with routing.recording(lm) as calls:
        out = generate()
    experts = routing.find_routers(lm)[0].experts
    routes, reason = routing.assemble(calls, experts, out.prompt_mask, out.completion_mask, prompts.distinct_rows()[1])
    if reason is not None and reason not in _UNRECORDED:
        _UNRECORDED.add(reason)
        logger.warning("routing_replay: this rollout's routing was not recorded (%s); its forwards route freely.",
                       reason)
    return replace(out, sampler=replace(out.sampler, routes=routes))

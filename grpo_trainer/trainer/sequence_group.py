"""Sequence parallelism (docs/DISTRIBUTED.md, "Sequence parallelism"), the one part that owns it beside its layout
(`modeling.sequence_parallel`): one implementation per layout behind one interface, chosen in one place
(`sequence_group`), so the trainer never tests `sp_size`.

- `Unsharded`: every run without `parallelism_config.sp_size > 1`; each method is the identity, its scorer
  `PolicyScorer`.
- `UlyssesGroup`: every process of the run is one group. Each process samples its own rows as under DDP; each
  micro-batch (with its old and reference log-probs, computed by sharded forwards: `ShardedScorer.prepare`) is then
  gathered over the group, and the group trains on one process's rows at a time, as ALST does (arXiv:2506.13996):
  every process runs the policy forward of that share on its slice of the positions through DeepSpeed's Ulysses
  attention (`modeling.sequence_parallel`), computes that share's loss (the loss its own process computes under DDP) and
  back-propagates through its positions, DDP's all-reduce held back (`no_sync`) until the last share. A process
  then holds one share's activations at `1 / sp_size` of their positions: `per_device_train_batch_size` rows of
  `N / sp_size` tokens, where DDP holds them at `N`. The gradients summed over shares and averaged by DDP over the
  group are DDP's mean of the per-process losses' gradients, for every aggregation: no factor on the loss.

What it does not combine with is one table (`REFUSALS`, over `ShardingSettings`), checked before any model loads
(`check`), and the model it cannot train is refused once loaded (`check_model`), as the round source's are.
Accelerate and the Trainer must not see `sp_size` (`hidden_from_accelerate`): their Ulysses path wants a DeepSpeed
engine and re-shards the prompt data loader, while GRPO's sequences exist only after generation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import TrainingArguments

from grpo_trainer.config.refusals import Refusal, check
from grpo_trainer.modeling import routing, sequence_parallel
from grpo_trainer.modeling.logprobs import LogProbs
from grpo_trainer.modeling.routing import ReplayStats
from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.trainer.round import Round
from grpo_trainer.trainer.schedule import Schedule
from grpo_trainer.trainer.scoring import PolicyScorer, ScoringSettings

__all__ = ["REFUSALS", "SequenceGroup", "Shares", "ShardedScorer", "ShardingSettings", "UlyssesGroup", "Unsharded",
           "sequence_group"]


@dataclass(frozen=True)
class ShardingSettings:
    """What the sequence-parallel group and its refusals read of a run (`trainer.parts.sharding_settings`)."""

    size: int = 1  # parallelism_config's sp_size
    processes: int = 1
    engine: str | None = None  # "DeepSpeed" or "FSDP" where one wraps the model
    loss_type: str = "dapo"
    top_entropy_quantile: float = 1.0
    padding_free: bool | None = None  # as set (None: resolved off under a group)
    use_vllm: bool = False
    truncated: bool = False  # top_k / top_p / min_p
    routing_replay: str = "auto"
    async_rollouts: int = 0
    activation_offloading: bool = False
    recompute_attention: bool = False
    multi_turn: bool = False  # tools, environment_factory or rollout_func
    vision: bool = False  # a vision-language model's processor


def _refusal(name: str, reads: tuple[str, ...], wrong: Callable[[ShardingSettings], bool],
             what: Callable[[ShardingSettings], str], fix: str | Callable[[ShardingSettings], str]
             ) -> Refusal[ShardingSettings]:
    def message(s: ShardingSettings) -> str:
        return (f"parallelism_config sp_size={s.size} (DeepSpeed Ulysses sequence parallelism, docs/DISTRIBUTED.md) "
                f"does not combine with {what(s)}; {fix(s) if callable(fix) else fix}.")

    return Refusal(name, ("size", *reads), lambda s: s.size > 1 and wrong(s), message)


# What sequence parallelism is not wired or tested with, each with its fix; the first that applies is raised.
REFUSALS: tuple[Refusal[ShardingSettings], ...] = (
    _refusal("processes", ("processes",), lambda s: s.processes != s.size,
             lambda s: f"{s.processes} processes (only one group, of all processes, is wired)",
             lambda s: f"launch {s.size} processes or set sp_size={s.processes}"),
    _refusal("engine", ("engine",), lambda s: s.engine is not None, lambda s: f"{s.engine} (only DDP is wired)",
             "launch with accelerate_configs/cpu/ddp_sp.yaml"),
    _refusal("bnpo", ("loss_type",), lambda s: s.loss_type == "bnpo",
             lambda s: "loss_type='bnpo' (untested: its token mean over each process's micro-batch needs a "
                       "2-process DDP run as the reference)", "use loss_type='dapo' or 'grpo'"),
    _refusal("entropy_quantile", ("top_entropy_quantile",), lambda s: s.top_entropy_quantile < 1.0,
             lambda s: f"top_entropy_quantile={s.top_entropy_quantile} (its quantile pools every process's tokens "
                       "at once; the group trains one process's rows at a time)", "set top_entropy_quantile=1.0"),
    _refusal("padding_free", ("padding_free",), lambda s: s.padding_free is True,
             lambda s: "padding_free=True (the sharded forward runs the padded, left-aligned layout)",
             "set padding_free=False or leave it None"),
    _refusal("vllm", ("use_vllm",), lambda s: s.use_vllm, lambda s: "use_vllm=True (untested)", "set use_vllm=False"),
    _refusal("truncation", ("truncated",), lambda s: s.truncated,
             lambda s: "truncated sampling (top_k / top_p / min_p: the sharded forward scores over the full softmax, "
                       "not the kept supports)", "set top_k=0, top_p=1.0, min_p=None"),
    _refusal("routing_replay", ("routing_replay",), lambda s: s.routing_replay == "on",
             lambda s: "routing_replay='on' (the sharded forward does not replay routes)", "set routing_replay='off'"),
    _refusal("async", ("async_rollouts",), lambda s: s.async_rollouts > 0,
             lambda s: f"async_rollouts={s.async_rollouts} (untested)", "set async_rollouts=0"),
    _refusal("offloading", ("activation_offloading",), lambda s: s.activation_offloading,
             lambda s: "activation_offloading=True (untested)", "set activation_offloading=False"),
    _refusal("recompute_attention", ("recompute_attention",), lambda s: s.recompute_attention,
             lambda s: "recompute_attention=True (untested: the recomputed attention's all-to-alls would run again in "
                       "the backward)", "set recompute_attention=False"),
    _refusal("multi_turn", ("multi_turn",), lambda s: s.multi_turn,
             lambda s: "multi-turn rollouts (tools, environment_factory or rollout_func; untested)", "set sp_size=1"),
    _refusal("vision", ("vision",), lambda s: s.vision,
             lambda s: "a vision-language model's processor (image inputs; untested)", "set sp_size=1"),
)


# objective(share, last): the loss of one micro-batch; `last` is False for a share whose backward is followed by
# another's in the same micro-step (the optimizer-step bookkeeping, such as adaptive entropy control, waits for it).
Objective = Callable[[Round, bool], Tensor]


@dataclass(frozen=True)
class Shares:
    """A sequence-parallel group's micro-batches, one per process in rank order (every process holds them all)."""

    rounds: tuple[Round, ...]


class SequenceGroup:
    """The interface (and `Unsharded`'s identity behaviour)."""

    size = 1

    @staticmethod
    def check(settings: ShardingSettings) -> None:
        """Refuse, before any model loads, what the layout does not combine with (`REFUSALS`)."""
        check(REFUSALS, settings)

    def check_model(self, model: nn.Module) -> None:
        """Refuse a policy the layout cannot train."""

    def hidden_from_accelerate(self, args: TrainingArguments) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def scorer(self, settings: ScoringSettings, schedule: Schedule, ref_model: nn.Module | None) -> PolicyScorer:
        """The log-prob forwards' part for this layout."""
        return PolicyScorer(settings, schedule, ref_model)

    def attach(self, model: nn.Module) -> None:
        """Make the training forwards of `model` sharded (after the model is prepared)."""

    def rows(self, micro: Round) -> Round | Shares:
        """What this process's micro-step trains on."""
        return micro

    def loss(self, objective: Objective, inputs: Round | Shares, model: nn.Module,
             backward: Callable[[Tensor], None]) -> Tensor:
        """The training loss the Trainer back-propagates; a group runs `backward` itself for what comes before."""
        return objective(inputs, True)

    def logged(self, loss: Tensor) -> Tensor:
        """The loss `training_step` reports (the unsharded run's)."""
        return loss

    def step_done(self) -> None:
        """A micro-step's backward is done (its recomputed forwards too)."""


class Unsharded(SequenceGroup):
    pass


class UlyssesGroup(SequenceGroup):
    def __init__(self, size: int) -> None:
        self.size = size
        self._earlier: list[Tensor] = []  # this micro-step's shares' losses before the last (detached)

    def check_model(self, model: nn.Module) -> None:
        # The sharded forward neither replays a rollout's routes nor returns the router's auxiliary loss: a
        # Mixture-of-Experts model would train silently without both
        if routing.find_routers(causal_lm(model)):
            raise ValueError("parallelism_config.sp_size > 1 cannot train a Mixture-of-Experts model: the sequence-"
                             "sharded policy forward does not replay the rollout's expert routes (routing_replay) nor "
                             "return the router's auxiliary loss. Train it without sp_size (one device: "
                             "gradient_checkpointing, logprob_chunk_size, `grpo-train plan`).")

    def scorer(self, settings: ScoringSettings, schedule: Schedule, ref_model: nn.Module | None) -> PolicyScorer:
        return ShardedScorer(settings, schedule, ref_model)

    @contextlib.contextmanager
    def hidden_from_accelerate(self, args: TrainingArguments) -> Iterator[None]:
        config, args.parallelism_config = args.parallelism_config, None
        try:
            yield
        finally:
            args.parallelism_config = config

    def attach(self, model: nn.Module) -> None:
        self.check_model(model)
        sequence_parallel.install(model)

    def rows(self, micro: Round) -> Shares:
        parts: list[Round | None] = [None] * self.size
        torch.distributed.all_gather_object(parts, micro)
        return Shares(tuple(parts))

    def loss(self, objective: Objective, inputs: Shares, model: nn.Module,
             backward: Callable[[Tensor], None]) -> Tensor:
        # DDP decides at the forward whether the next backward all-reduces: each share before the last runs its
        # forward and backward under no_sync, its gradients accumulating locally; the last one's backward (the
        # Trainer's) all-reduces the sum
        self._earlier = []
        for share in inputs.rounds[:-1]:
            with model.no_sync():
                loss = objective(share, False)
                backward(loss)
            self._earlier.append(loss.detach())
        return objective(inputs.rounds[-1], True)

    def logged(self, loss: Tensor) -> Tensor:
        # Every process computed every share's loss: their mean is DDP's mean of the processes' losses
        total = loss + sum(self._earlier)
        self._earlier = []
        return total / self.size

    def step_done(self) -> None:
        sequence_parallel.deactivate()


class ShardedScorer(PolicyScorer):
    """The group's log-prob forwards: the policy's training forward, and within `prepare` the no-grad ones, each
    process scoring its slice of the positions of the same rows (`modeling.sequence_parallel.sharded_scores`)."""

    def __init__(self, settings: ScoringSettings, schedule: Schedule, ref_model: nn.Module | None) -> None:
        super().__init__(settings, schedule, ref_model)
        self._no_grad_sharded = False  # within `prepare`: the no-grad forwards are sharded too

    def logps(self, model: nn.Module, inputs: Round, with_entropy: bool = False, policy: bool = False,
              with_aux_loss: bool = False, collect: bool = False, routing_stats: ReplayStats | None = None
              ) -> LogProbs:
        if not (self._no_grad_sharded or policy and model.training):
            return super().logps(model, inputs, with_entropy, policy, with_aux_loss, collect, routing_stats)
        input_ids, attention_mask, width = inputs.sequences()
        scores = sequence_parallel.sharded_scores(model, input_ids, attention_mask, width,
                                                  torch.distributed.group.WORLD, self.forward)
        return LogProbs(scores.logps, scores.entropy)

    def prepare(self, part: Round, mode: str, model: nn.Module) -> Round:
        """In training every process calls this for its micro-batch in the same order: the group's micro-batches are
        gathered and each is prepared in turn by every process, its no-grad forwards sharded along positions, and
        this process keeps its own."""
        if mode != "train":
            return super().prepare(part, mode, model)
        shares: list[Round | None] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(shares, part.trimmed())
        self._no_grad_sharded = True
        try:
            prepared = [self._prepare(share, mode, model) for share in shares]
        finally:
            self._no_grad_sharded = False
            sequence_parallel.deactivate()
        return prepared[torch.distributed.get_rank()]


def sequence_group(size: int) -> SequenceGroup:
    """The layout of a group of `size` processes (`Launch.sequence_parallel`): the one place that chooses."""
    return UlyssesGroup(size) if size > 1 else Unsharded()

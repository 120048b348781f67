"""Asynchronous rollouts: a producer thread samples the next rounds while the trainer trains on this one.

Decisions (docs/ASYNC.md explains the schedule to users):

1. The producer runs `RoundBuilder.sample` (rollout and this process's rewards), which holds no collective; every
   collective (the rewards' gather, advantages, metrics) runs on the main thread in `RoundBuilder.finish` when the
   round is handed over. So no collective ever runs from two threads at once.
2. One job at a time. At the start of round r the main thread takes round r (waiting for it if needed) and submits
   round r + k (`async_rollouts` = k), stamped with the weights' version then (the optimizer steps taken). A round is
   sampled with exactly that version: an in-process backend reads the live weights, so the optimizer step waits for
   the job in flight (`drain`); an engine (vLLM) gets the new weights on the main thread only once no job is in
   flight. Staleness is therefore at most k rounds, by pacing, and no sample is ever dropped.
3. Determinism: each job seeds torch's generator from (seed, round index) before sampling, and the main thread draws
   no random number while a job runs (it splits rounds with a generator of its own, and the trainer refuses active
   dropout with an in-process backend). Two runs with the same seed sample the same rounds whatever the threads'
   timing. A job's reward functions see the trainer's state as it was at submission.
4. Failures: an exception in the producer is raised on the main thread, naming the round, chained to the original
   traceback. A job that takes longer than `timeout` seconds stops the run with an error. The thread is a daemon and
   `close` ends it: nothing is left running at exit.
5. A checkpoint stores the rounds sampled but not yet trained (with their versions); a resumed run takes them from
   the checkpoint instead of sampling them again with other weights.
6. A job gives each round the log-probs its correction and report need at the weights that sampled it (nothing
   changes them while a job runs): the behaviour policy's by one no-grad forward where the sampler kept none
   (`generate`), and with `sampling_mismatch_report` the trainer's beside the sampler's own (`Sampled.trainer_scores`,
   `trainer.off_policy` decision 3).

Shapes: none (rounds are `RoundBuilder.Sampled`).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from grpo_trainer.config.refusals import Refusal, check
from grpo_trainer.data.sampler import RoundSource as PromptRows
from grpo_trainer.planning.settings import RoundsHeld
from grpo_trainer.reporting.metrics import MetricsWindow
from grpo_trainer.rollout.backend import CONTINUOUS_BATCHING
from grpo_trainer.runtime.interrupts import SignalStop
from grpo_trainer.trainer.off_policy import OffPolicy
from grpo_trainer.trainer.round import Round
from grpo_trainer.trainer.round_builder import PolicyView, RoundBuilder, Sampled
from grpo_trainer.trainer.schedule import RoundBuffer
from grpo_trainer.trainer.scoring import PolicyScorer
from grpo_trainer.trainer.source import RoundSource, SourceSettings

__all__ = ["REFUSALS", "AsyncFacts", "AsyncRounds", "AsyncSettings", "ProducerError", "ProducerPacing", "RoundProducer",
           "round_seed"]


@dataclass(frozen=True)
class AsyncSettings:
    rounds_ahead: int  # `async_rollouts`
    seed: int  # this process's: the run's seed + its process index
    timeout: float | None  # seconds a round may take (`async_rollout_timeout`); None: no limit


class ProducerError(RuntimeError):
    """A producer job failed; raised on the main thread (decision 4)."""


def round_seed(seed: int, round_index: int) -> int:
    """The sampling seed of round `round_index` (decision 3): a 63-bit mix of the two, different for every round."""
    mixed = (seed * 0x9E3779B97F4A7C15 + round_index * 0xBF58476D1CE4E5B9 + 1) & (2**63 - 1)
    return mixed or 1


@dataclass
class _Job:
    round_index: int
    version: int
    sample: Callable[[], Sampled]


class RoundProducer:
    """Decisions 1-5. `submit` a round's sampling; `take` it on the main thread; `drain` before the weights change."""

    def __init__(self, settings: AsyncSettings) -> None:
        self.settings = settings
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._done: dict[int, Sampled] = {}
        self._failure: tuple[int, BaseException] | None = None
        self._busy = 0  # jobs submitted and not yet finished
        self._condition = threading.Condition()
        self.submitted_through = -1  # the last round index submitted (or restored)
        self.trainer_waited = 0.0  # seconds the main thread spent waiting for rounds (since the last read)
        self.producer_waited = 0.0  # seconds the producer spent idle, waiting for a job
        self._threads = torch.get_num_threads()  # the intra-op thread count a new thread does not inherit
        self._thread = threading.Thread(target=self._run, name="grpo-round-producer", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # ---------------------------------------------------------------------------------------- main thread

    def submit(self, round_index: int, version: int, sample: Callable[[], Sampled]) -> None:
        """Queue round `round_index` to be sampled with the weights of `version` (decision 2)."""
        with self._condition:
            self._busy += 1
            self.submitted_through = max(self.submitted_through, round_index)
        self._jobs.put(_Job(round_index, version, sample))

    def has(self, round_index: int) -> bool:
        with self._condition:
            return round_index in self._done or round_index <= self.submitted_through

    def take(self, round_index: int) -> Sampled:
        """Round `round_index`, waiting for it (decision 4 for failures and the time limit)."""
        started = time.perf_counter()
        with self._condition:
            self._wait(lambda: round_index in self._done, f"round {round_index}")
            sampled = self._done.pop(round_index)
        self.trainer_waited += time.perf_counter() - started
        return sampled

    def drain(self) -> None:
        """Wait until no job is queued or running (before the weights change, an evaluation, a checkpoint)."""
        started = time.perf_counter()
        with self._condition:
            self._wait(lambda: self._busy == 0, "the round in flight")
        self.trainer_waited += time.perf_counter() - started

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def idle(self) -> bool:
        with self._condition:
            return self._busy == 0

    def state_dict(self) -> dict[str, Any]:
        """The rounds sampled and not yet taken (decision 5); call after `drain`."""
        with self._condition:
            return {"done": dict(self._done), "submitted_through": self.submitted_through}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._condition:
            self._done = dict(state["done"])
            self.submitted_through = state["submitted_through"]

    def take_wait_times(self) -> tuple[float, float]:
        """(trainer waited, producer waited) seconds since the last call."""
        waited = self.trainer_waited, self.producer_waited
        self.trainer_waited = self.producer_waited = 0.0
        return waited

    def close(self, timeout: float | None = None) -> None:
        """End the thread after its current job (decision 4); wait for it at most `timeout` seconds (default: the
        job time limit)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=self.settings.timeout if timeout is None else timeout)

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait on the condition (held) until `ready()`; raise the producer's failure or on the time limit."""
        deadline = None if self.settings.timeout is None else time.monotonic() + self.settings.timeout
        while not ready():
            self._raise_failure()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ProducerError(f"{what} took more than async_rollout_timeout={self.settings.timeout} s; the "
                                    "rollout or a reward function may hang. Raise the limit or find the stuck call.")
            self._condition.wait(timeout=1.0 if remaining is None else min(remaining, 1.0))
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            round_index, error = self._failure
            raise ProducerError(f"sampling round {round_index} on the producer thread failed: "
                                f"{type(error).__name__}: {error}") from error

    # ---------------------------------------------------------------------------------------- producer thread

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        while True:
            idle_since = time.perf_counter()
            job = self._jobs.get()
            self.producer_waited += time.perf_counter() - idle_since
            if job is None:
                return
            try:
                torch.manual_seed(round_seed(self.settings.seed, job.round_index))  # decision 3
                with torch.no_grad():
                    sampled = job.sample()
            except BaseException as error:  # noqa: BLE001 - handed to the main thread (decision 4)
                with self._condition:
                    self._failure = (job.round_index, error)
                    self._busy -= 1
                    self._condition.notify_all()
                return
            with self._condition:
                self._done[job.round_index] = sampled
                self._busy -= 1
                self._condition.notify_all()


# Producers whose thread may still run. At interpreter exit a daemon thread is stopped wherever it is; one stopped
# inside a torch operator (a job submitted and never taken, e.g. by a script that stops mid-run) aborts the process
# ("terminate called without an active exception"). So at exit each is asked to finish its job and end first.
_LIVE: weakref.WeakSet[RoundProducer] = weakref.WeakSet()
_EXIT_WAIT_S = 60.0


@atexit.register
def _close_producers() -> None:
    for producer in list(_LIVE):
        producer.close(timeout=_EXIT_WAIT_S)


@dataclass(frozen=True)
class AsyncFacts:
    """What the asynchronous source's refusals read: its settings and the run's backend, dataset and rollout_func."""

    settings: SourceSettings
    backend: str  # the chosen backend's registry name
    own_weights: bool  # an inference engine holding its own weights (vLLM)
    streamed: bool  # an IterableDataset
    rollout_func: bool


def _async(name: str, reads: tuple[str, ...], applies: Callable[[AsyncFacts], bool], reason: str
           ) -> Refusal[AsyncFacts]:
    return Refusal(name, ("rounds_ahead", *reads), lambda f: f.settings.rounds_ahead > 0 and applies(f),
                   lambda f: f"async_rollouts={f.settings.rounds_ahead} is not supported here: {reason(f)}.")


def _sharded_reason(f: AsyncFacts) -> str:
    return (f"an in-process backend samples from the live weights on a second thread, which "
            f"{f.settings.launch.sharded_weights} shards (gathering them is a collective); use a vLLM server "
            "(use_vllm=True, vllm_mode='server'), DDP or ZeRO-2, or async_rollouts=0")


# Asynchronous rollouts where they cannot be made safe, each with the working alternative (`AsyncRounds.check`).
REFUSALS: tuple[Refusal[AsyncFacts], ...] = (
    _async("rollout_func", ("rollout_func",), lambda f: f.rollout_func, lambda f:
           "a rollout_func receives the trainer, which the producer thread would share with the training step; use "
           "tools or environment_factory, or async_rollouts=0"),
    _async("streamed", ("streamed",), lambda f: f.streamed, lambda f:
           "a streamed train_dataset cannot be read rounds ahead; pass a map-style datasets.Dataset, or "
           "async_rollouts=0"),
    _async("continuous_batching", ("backend",), lambda f: f.backend == CONTINUOUS_BATCHING, lambda f:
           "transformers' continuous batching switches the model between train and eval mode while it generates; "
           "use generation_backend='fast' or 'generate'"),
    _async("server_processes", ("own_weights", "vllm_mode", "processes"),
           lambda f: f.own_weights and f.settings.vllm_mode == "server" and f.settings.launch.processes > 1,
           lambda f: "with several training processes the main process's client serves every process's prompts, a "
                     "collective the producer thread cannot run; train with one process beside the vLLM server, use "
                     "vllm_mode='colocate', or async_rollouts=0"),
    _async("colocated_tensor_parallel", ("own_weights", "vllm_mode", "vllm_tensor_parallel_size"),
           lambda f: f.own_weights and f.settings.vllm_mode == "colocate" and f.settings.vllm_tensor_parallel_size > 1,
           lambda f: "tensor-parallel colocated vLLM generates through a collective; use vllm_tensor_parallel_size=1 "
                     "or a vLLM server"),
    _async("in_process_sharded", ("own_weights", "sharded_weights"),
           lambda f: not f.own_weights and f.settings.launch.sharded_weights is not None, _sharded_reason),
    _async("engine_mismatch_report", ("own_weights", "mismatch_report"),
           lambda f: f.own_weights and f.settings.mismatch_report, lambda f:
           "sampling_mismatch_report compares the sampler's log-probs with the trainer's at the weights that sampled "
           "them, which an inference engine's rounds sampled ahead outlive (`trainer.off_policy`, decision 3); use "
           "async_rollouts=0 for the report, or an in-process backend ('fast' or 'generate')"),
)


class AsyncRounds(RoundSource):
    """The asynchronous round source (`trainer.source`): at the start of each training round, take it from the
    producer, correct it for being sampled off-policy (`trainer.off_policy`), prepare its micro-batches, then submit
    the next rounds.

    `rows`: this process's dataset rows of each round; `make_view(version)`: the weights jobs sample with (the bare
    model, no activation-checkpointing switch: grad mode is per thread, so the producer's no-grad forward runs the
    layers plainly); `push_weights()`: hand an engine the current weights (main thread, no job in flight; None for
    in-process backends); `signal_stop`: what a checkpoint saved while a job hangs asks (`ProducerPacing`)."""

    def __init__(self, settings: AsyncSettings, builder: RoundBuilder, corrections: OffPolicy, scorer: PolicyScorer,
                 buffer: RoundBuffer, generate: Callable[[list[dict], str], Round], rows: PromptRows,
                 make_view: Callable[[int], PolicyView], push_weights: Callable[[], None] | None,
                 metrics_window: MetricsWindow, signal_stop: SignalStop) -> None:
        super().__init__(builder, corrections, scorer, buffer, generate)
        self.settings, self.rows, self.schedule = settings, rows, buffer.schedule
        self.make_view, self.engine_push, self.metrics = make_view, push_weights, metrics_window
        self.producer = RoundProducer(settings)
        self.last_round: int | None = None  # the last round a run of `max_steps` trains (set at train start)
        self.pacing = ProducerPacing(self, buffer, signal_stop)

    @classmethod
    def sampled_ahead(cls, settings: SourceSettings) -> tuple[int, str | None]:
        return settings.rounds_ahead, settings.correction

    @classmethod
    def held(cls, settings: SourceSettings) -> RoundsHeld:
        """Decision 2: `async_rollouts` rounds wait for their step, and an in-process sampler reads the live weights
        (no copy) while the step trains."""
        return RoundsHeld(ahead=settings.rounds_ahead, sampling_overlaps_step=True)

    @staticmethod
    def settings(settings: SourceSettings, process_index: int) -> AsyncSettings:
        """This process's settings (its seed: the run's + its index, as `set_seed(device_specific=True)` seeds)."""
        return AsyncSettings(settings.rounds_ahead, settings.seed + process_index, settings.timeout)

    @classmethod
    def check(cls, settings: SourceSettings, backend: Any, train_dataset: Any, rollout_func: Any) -> None:
        """Asynchronous rollouts where they cannot be made safe (`REFUSALS`), refused before any model loads, each
        with the working alternative."""
        from torch.utils.data import IterableDataset

        check(REFUSALS, AsyncFacts(settings, backend.name, backend.capabilities.own_weights,
                                   isinstance(train_dataset, IterableDataset), rollout_func is not None))

    @staticmethod
    def checkpointing_kwargs(in_process: bool) -> dict[str, bool]:
        """The activation checkpointing kwargs this source needs (`gradient_checkpointing_kwargs` defaults): with an
        in-process producer, a checkpointed layer's backward would save and restore torch's generator around its
        recompute, rewinding the producer's draws; without dropout there is nothing to replay (decision 3)."""
        return {"use_reentrant": False, "preserve_rng_state": False} if in_process else {}

    @classmethod
    def check_model(cls, model: nn.Module, settings: SourceSettings, in_process: bool) -> None:
        """An in-process producer samples from torch's generator while the training step runs: active dropout would
        draw from it at the same time and make runs irreproducible (decision 3)."""
        if not in_process:
            return
        active = next((name for name, module in model.named_modules()
                       if (isinstance(module, nn.Dropout) and module.p > 0)
                       or float(getattr(module, "attention_dropout", 0.0) or 0.0) > 0), None)
        if active is not None:
            raise ValueError(f"async_rollouts={settings.rounds_ahead} with an in-process backend needs dropout off, "
                             f"but {active} drops with p > 0: the training step would draw random numbers while the "
                             "producer samples, so runs would not be reproducible. Set disable_dropout=True (it also "
                             "zeroes LoRA's lora_dropout) and the model config's attention_dropout to 0, or sample "
                             "with vLLM.")

    def callbacks(self) -> list[TrainerCallback]:
        return [self.pacing]

    def evaluation_round(self, rows: list[dict]) -> Round:
        self.producer.drain()  # the backend (and torch's generator) are the main thread's now
        return super().evaluation_round(rows)

    def run_state(self, stuck: bool = False) -> dict[str, Any]:
        """`stuck`: saved from the signal watchdog while a job may hang (decision 5): the buffer as the step began
        and no sampled round; else the buffer and the rounds sampled ahead, once the producer is idle."""
        if stuck:
            return self.pacing.stuck_state()
        self.producer.drain()
        return {**self.buffer.state_dict(), "producer": self.producer.state_dict()}

    def load_run_state(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state)
        if "producer" in state:
            self.producer.load_state_dict(state["producer"])

    @property
    def in_process(self) -> bool:
        """Jobs read the live weights, so the optimizer step waits for them (decision 2)."""
        return self.engine_push is None

    def push_weights(self) -> None:
        """An engine's weights become the trainer's, with no job in flight (decision 2)."""
        if self.engine_push is not None:
            self.producer.drain()
            self.engine_push()

    def start(self, max_steps: int) -> None:
        """A fresh producer for a run of `max_steps` optimizer steps (rounds past its last are not sampled)."""
        if not self.producer.alive:
            state = self.producer.state_dict()
            self.producer = RoundProducer(self.settings)
            self.producer.load_state_dict(state)
        micro_steps = max_steps * self.schedule.gradient_accumulation_steps
        self.last_round = -(-micro_steps // self.schedule.micro_steps_per_round) - 1

    def round_index(self, micro_step: int) -> int:
        return micro_step // self.schedule.micro_steps_per_round

    def training_round(self, micro_step: int, delivered: list[dict], model: nn.Module, state: TrainerState
                       ) -> list[Round]:
        """The prepared micro-batches of the round that starts at `micro_step`; `delivered`: the rows the
        Trainer's dataloader gave for it, which must be the rows the producer sampled."""
        r = self.round_index(micro_step)
        expected = self.rows.rows(r)
        if [row.get("prompt") for row in expected] != [row.get("prompt") for row in delivered]:
            raise RuntimeError(f"async_rollouts: round {r}'s rows from the dataloader are not the rows the producer "
                               "sampled; the dataloader's order was changed (a custom sampler, a dataset edited "
                               "during training, or remove_unused_columns). Use async_rollouts=0 with them.")
        if not self.producer.has(r):  # the first round, or a resumed run whose checkpoint held none
            self.push_weights()
            self._submit(r, state)
        sampled = self.producer.take(r)
        round_, log = self.builder.finish(sampled, "train", self.make_view(state.global_step), state)
        round_, columns = self.corrections.correct(round_, "train", model, state.global_step, sampled.trainer_scores)
        self.builder.log(log, columns)
        self._record(sampled, state)
        generator = torch.Generator().manual_seed(round_seed(self.settings.seed, r) ^ 0x5EED)
        parts = [self.scorer.prepare(part, "train", model)
                 for part in round_.split(self.schedule.steps_per_generation, generator)]
        # The next rounds go out only now: the preparation above may switch a PEFT adapter off (reference
        # log-probs), which a job sampling at the same time would see.
        self.push_weights()
        last = r + self.settings.rounds_ahead if self.last_round is None else min(r + self.settings.rounds_ahead,
                                                                                  self.last_round)
        for j in range(self.producer.submitted_through + 1, last + 1):
            self._submit(j, state)
        return parts

    def _submit(self, round_index: int, state: TrainerState) -> None:
        rows, view = self.rows.rows(round_index), self.make_view(state.global_step)
        frozen = copy.deepcopy(state)  # decision 3: the job's reward functions see the state at submission

        def sample() -> Sampled:
            sampled = self.builder.sample(rows, "train", view, frozen)
            out = sampled.rollout
            record = out.sampler
            wants_report = self.corrections.mismatch is not None and self.corrections.mismatch.settings.enabled
            if record.logps is not None and not wants_report:
                return sampled
            round_ = Round(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
                           completion_mask=out.completion_mask, images=sampled.prompt_images, sampler=record)
            with view.for_generation() as bare:  # the sampling weights: no optimizer step runs while a job does
                scores = self.scorer.sampling_scores(bare, round_.trimmed(), collect=False)
            if record.logps is not None:  # the mismatch report's side (`trainer.off_policy`, decision 3)
                sampled.trainer_scores = scores
                return sampled
            # the behaviour policy's log-probs, as the loss computes them (`generate` keeps none)
            logps = nn.functional.pad(scores.logps, (0, out.completion_ids.shape[1] - scores.logps.shape[1]))
            sampled.rollout = dataclasses.replace(out, sampler=dataclasses.replace(record, logps=logps, exact=True))
            return sampled

        self.producer.submit(round_index, view.version, sample)

    def _record(self, sampled: Sampled, state: TrainerState) -> None:
        staleness = float(state.global_step - sampled.version)
        trainer_waited, producer_waited = self.producer.take_wait_times()
        for key, value in (("async/staleness", staleness), ("async/trainer_wait_s", trainer_waited),
                           ("async/producer_wait_s", producer_waited)):
            self.metrics.add("train", key, value)
        self.metrics.add_max("train", "async/staleness_max", staleness)

    def close(self) -> None:
        """Nothing is left running (decision 4)."""
        self.producer.close()


class ProducerPacing(TrainerCallback):
    """The Trainer's events the producer keeps pace with: a run's length at its start, and (in-process backends) the
    optimizer step, which waits for the job reading the weights it is about to change (decision 2). Keeps the round
    buffer's state at each step's start: what a checkpoint saved while a job hangs holds (decision 5)."""

    def __init__(self, rounds: AsyncRounds, buffer: RoundBuffer, signal_stop: SignalStop) -> None:
        self.rounds, self.buffer, self.signal_stop = rounds, buffer, signal_stop
        self.step_start: dict[str, Any] = buffer.state_dict()

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self.rounds.start(state.max_steps)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        snapshot = self.buffer.state_dict()
        self.step_start = {**snapshot, "buffer": list(snapshot["buffer"] or []) or None}

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        if self.rounds.in_process:
            with self.signal_stop.before_update():  # the weights are still the last finished step's
                self.rounds.producer.drain()

    def stuck_state(self) -> dict[str, Any]:
        """The run state a checkpoint saved while a job hangs holds: the buffer as the step began, and no sampled
        round (a resumed run samples them again, with its weights)."""
        return {**self.step_start, "producer": {"done": {}, "submitted_through": -1}}

"""One small GRPO run, as `accelerate launch` runs it in the distributed tests, or in-process (1 process) as
their reference. It records what each process saw and writes `result.json`, `params.pt` (full parameters) and
the saved model under `--out`; the tests in this folder only read those files.

The run: 3 optimizer steps, each one generation round of 12 completions (3 prompts x G=4) over all processes,
2 gradient-accumulation micro-steps, beta > 0 (a reference model), dapo loss, two rewards (a function and a
reward model loaded by path), the policy loaded by path.

Sampling is Gumbel-max with noise seeded by (round, global row, position): every completion is a sample from
the policy at temperature 1, yet a row's completion does not depend on which process generates it. So a
2-process run and a 1-process run over the same global batch get the same rollouts, and their weights can be
compared. Global row r stops at a fixed step, and rows 6-11 (process 1 of 2) are longer than rows 0-5, so
the processes finish generating at different times (ZeRO-3 and FSDP2 must keep stepping together).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from deepspeed_cpu import skip_shm_op_build  # beside this script, on sys.path when it is launched
from teardown import leave_cleanly
from transformers import LogitsProcessor, LogitsProcessorList

ROUND_ROWS = 12  # completions per generation round over all processes: 3 prompts x G
G = 4
ACCUMULATION = 2
STEPS = 3
MAX_COMPLETION = 10
PROBE_PROMPT = "copy 123:"


def stop_step(round_: int, row: int) -> int:
    """Step at which global row `row` emits EOS: 0-3 for rows 0-5, 5-8 for rows 6-11."""
    return (7 * row + 3 * round_) % 4 + 5 * (row // (ROUND_ROWS // 2))


class RowSeededGumbel(LogitsProcessor):
    """Gumbel-max sampling (argmax of logits + Gumbel noise samples from softmax(logits)) with per-row noise."""

    def __init__(self, round_: int, first_row: int, prompt_len: int, eos_ids: list[int]) -> None:
        self.round_, self.first_row, self.prompt_len, self.eos_ids = round_, first_row, prompt_len, eos_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len
        out = torch.empty_like(scores)
        for i in range(scores.shape[0]):
            row = self.first_row + i
            if step == stop_step(self.round_, row):
                out[i] = -torch.inf
                out[i, self.eos_ids[0]] = 0.0
                continue
            generator = torch.Generator().manual_seed(1_000_003 * self.round_ + 1009 * row + step)
            uniform = torch.rand(scores.shape[1], generator=generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
            out[i] = scores[i] - torch.log(-torch.log(uniform)).to(scores.dtype)
            out[i, self.eos_ids] = -torch.inf  # the length comes from stop_step only
        return out


class RowSeededSampling:
    """Stands in for `grpo_trainer.rollout.generate.generate_rollout` while installed; the trainer's own `_rollout`
    (unwrapping, ZeRO-3 gathering, generation config) still runs around it."""

    def __init__(self) -> None:
        from grpo_trainer.rollout import generate

        self.generation, self.original, self.round_ = generate, generate.generate_rollout, 0

    def __call__(self, model, prompts, config):
        from accelerate import PartialState

        first_row = PartialState().process_index * prompts.ids.shape[0]
        processor = RowSeededGumbel(self.round_, first_row, prompts.ids.shape[1], list(config.eos_token_id))
        self.round_ += 1
        greedy = config.__class__(**{**config.to_dict(), "do_sample": False, "temperature": None, "top_p": None,
                                     "top_k": None, "min_p": None})
        model.generate = functools.partial(model.generate, logits_processor=LogitsProcessorList([processor]))
        try:
            return self.original(model, prompts, greedy)
        finally:
            del model.generate

    def __enter__(self):
        self.generation.generate_rollout = self
        return self

    def __exit__(self, *exc):
        self.generation.generate_rollout = self.original


def write_result(trainer, mine: dict, out_dir: Path) -> None:
    """Gather every process's record `mine` (with its "rank") and write them, with the run's log history, to
    `out_dir/result.json` from the main process (a collective: every process calls it)."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    every = gather_object([mine])
    if PartialState().is_main_process:
        result = {"num_processes": trainer.accelerator.num_processes,
                  "distributed_type": trainer.accelerator.distributed_type.value,
                  "log_history": trainer.state.log_history, "ranks": sorted(every, key=lambda r: r["rank"])}
        (out_dir / "result.json").write_text(json.dumps(result, indent=1))


def save_tiny_models(directory: Path) -> None:
    """Policy and reward model (+ tokenizer) on disk, so every process loads the same weights by path."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

    tokenizer = make_tokenizer()
    policy = make_tiny_model(tokenizer, seed=0)
    policy.save_pretrained(directory / "policy")
    tokenizer.save_pretrained(directory / "policy")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(1)
    Qwen2ForSequenceClassification(config).save_pretrained(directory / "reward")
    tokenizer.save_pretrained(directory / "reward")


class Recorder:
    """A reward function with weight 0: records the prompts and completions this process scores."""

    __name__ = "recorder"

    def __init__(self) -> None:
        self.rounds: list[dict] = []

    def __call__(self, prompts, completions, **kwargs):
        self.rounds.append({"prompts": list(prompts), "completions": list(completions)})
        return [0.0] * len(completions)


def _finite_mean(values: list) -> float:
    finite = [float(v) for v in values if float(v) == float(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def _sharding_facts(model: torch.nn.Module) -> dict:
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    facts = {"params": len(params), "dtensor_params": sum(isinstance(p, DTensor) for p in params),
             "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)}
    if any(hasattr(p, "ds_id") for p in params):
        facts["zero3_not_available"] = sum(p.ds_status.name == "NOT_AVAILABLE" for p in params)
        facts["zero3_partition_numel"] = sum(p.ds_tensor.numel() for p in params)
    return facts


def _probe_generation(trainer, zero3: bool) -> dict:
    """Generation after training, with the trainer's own (unpatched) sampling. Same prompt on every process:
    first with the trainer's RNG state (processes are seeded differently, so samples differ), then with rank-
    dependent lengths (rank r makes 3 + 5r tokens) and, under ZeRO-3, gathered and sharded weights alike."""
    from grpo_trainer.rollout.prompts import tokenize_prompts

    rank = trainer.accelerator.process_index
    prompts = tokenize_prompts(trainer.processing_class, [PROBE_PROMPT] * 2, None).to(trainer.accelerator.device)
    args, builder = trainer.args, trainer.rounds
    saved = builder.settings, args.ds3_gather_for_generation

    def with_length(tokens: int):  # the round builder's sampling settings, this probe's length forced
        sampling = dataclasses.replace(saved[0].sampling,
                                       generation_kwargs={"min_new_tokens": tokens, "max_new_tokens": tokens})
        return dataclasses.replace(saved[0], sampling=sampling)

    out = {}
    builder.settings = with_length(4)
    out["same_prompt"] = builder.rollout(prompts, "eval", trainer._policy_view()).completion_ids.tolist()
    builder.settings = with_length(3 + 5 * rank)
    for gather in ([True, False] if zero3 else [args.ds3_gather_for_generation]):
        args.ds3_gather_for_generation = gather
        torch.manual_seed(1234 + rank)
        rolled = builder.rollout(prompts, "eval", trainer._policy_view())
        out[f"uneven_gather_{gather}"] = rolled.completion_ids.tolist()
    builder.settings, args.ds3_gather_for_generation = saved
    return out


def _count_packed_forwards() -> list[int]:
    """Counts this process's packed log-prob forwards (`padding_free`), the self-check's included."""
    from grpo_trainer.modeling import forwards

    count, packed_logprobs = [0], forwards.packed_logprobs

    def counted(*args, **kwargs):
        count[0] += 1
        return packed_logprobs(*args, **kwargs)

    forwards.packed_logprobs = counted
    return count


@contextlib.contextmanager
def _counting_tiled_backwards(counts: dict):
    """Within: counts this process's sequence-tiled MLP backwards (`mlp_tile_tokens`) into counts["backwards"] and
    the tiles they recomputed (calls of the MLP's forward inside them) into counts["tiles"]: more tiles than
    backwards means a tile really split a micro-batch. Restored after, as the 1-process reference runs in pytest."""
    from grpo_trainer.modeling import tiling

    counts.update(backwards=0, tiles=0)
    backward = tiling.TiledMLP.backward

    def counted(ctx, *grads):
        counts["backwards"] += 1
        forward = ctx.forward

        def tile(*args, **kwargs):
            counts["tiles"] += 1
            return forward(*args, **kwargs)

        ctx.forward = tile
        return backward(ctx, *grads)

    tiling.TiledMLP.backward = staticmethod(counted)
    try:
        yield
    finally:
        tiling.TiledMLP.backward = staticmethod(backward)


@contextlib.contextmanager
def _counting_recomputed_attention(counts: dict):
    """Within: counts this process's attention calls under `recompute_attention` (the forwards `tiling._recomputed`
    checkpoints) into counts: per phase ("forward": with a graph; "backward": run by the autograd engine, i.e. a
    checkpoint's recomputation; "no_grad") the calls, the rows they saw and the most rows one call saw. One row per
    call means the block ran a row at a time; backward calls mean its checkpoint recomputed it. Restored after."""
    from grpo_trainer.modeling import tiling

    counts.update({f"{phase}_{what}": 0 for phase in ("forward", "backward", "no_grad")
                   for what in ("calls", "rows", "max_rows")})
    recomputed = tiling._recomputed

    def counted(forward, inner, by_row=True, *, attention):
        def counting(*args, **kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            phase = ("backward" if torch._C._current_graph_task_id() >= 0 else
                     "forward" if torch.is_grad_enabled() else "no_grad")
            counts[f"{phase}_calls"] += 1
            counts[f"{phase}_rows"] += hidden.shape[0]
            counts[f"{phase}_max_rows"] = max(counts[f"{phase}_max_rows"], hidden.shape[0])
            return forward(*args, **kwargs)

        return recomputed(counting, inner, by_row, attention=attention)

    tiling._recomputed = counted
    try:
        yield
    finally:
        tiling._recomputed = recomputed


@contextlib.contextmanager
def _recording_logprobs(record: dict, step: Callable[[], int]):
    """Within: every log-prob forward's (`forwards.score`) log-probs of each row's completion tokens, into
    record["policy"] (forwards with a graph: the loss's) or record["no_grad"] (the reference model's), keyed by
    "<optimizer step>:<the row's real token ids>" (whichever process scored the row, and however the micro-batch
    was split); record["policy_rows"]: the rows of each policy forward. Restored after."""
    from grpo_trainer.modeling import forwards

    record.update(policy={}, no_grad={}, policy_rows=[])
    score = forwards.score

    def recorded(model, input_ids, attention_mask, completion_length, *args, **kwargs):
        out = score(model, input_ids, attention_mask, completion_length, *args, **kwargs)
        kind = "policy" if torch.is_grad_enabled() else "no_grad"
        if kind == "policy":
            record["policy_rows"].append(input_ids.shape[0])
        completion = attention_mask[:, -completion_length:].bool()
        for ids, mask, logps, kept in zip(input_ids, attention_mask.bool(), out.logps.detach(), completion,
                                          strict=True):
            key = f"{step()}:{' '.join(map(str, ids[mask].tolist()))}"
            record[kind][key] = logps[kept].tolist()
        return out

    forwards.score = recorded
    try:
        yield
    finally:
        forwards.score = score


def _sequence_parallel(processes: int) -> dict:
    """Every process one slice of each sequence's positions (DeepSpeed Ulysses), the group being all processes."""
    from accelerate.parallelism_config import ParallelismConfig

    return {"parallelism_config": ParallelismConfig(sp_size=processes, sp_backend="deepspeed")}


def run(out_dir: Path, model_dir: Path, lora: bool = False, ddp_backend: str | None = None,
        ds3_gather: bool = True, per_device_batch: int | None = None, padding_free: bool = False,
        logprob_chunk_size: int = 1024, sequence_parallel: bool = False, loss_type: str = "dapo",
        sgd: bool = False, mlp_tile_tokens: int = 0, recompute_attention: bool = False) -> dict:
    from accelerate import PartialState
    from accelerate.utils import gather_object
    from transformers import set_seed

    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward
    from grpo_trainer.modeling.sequence_parallel import sharded_forwards
    from grpo_trainer.modeling.unwrap import causal_lm
    from grpo_trainer.runtime import compat
    from grpo_trainer.runtime.distributed import launched_world_size
    from tests.helpers import make_args, make_trainer
    from tests.parameters import full_parameters, parameter_digest

    out_dir.mkdir(parents=True, exist_ok=True)
    processes = launched_world_size()
    set_seed(0)  # LoRA's random A matrices are drawn before the trainer seeds; start every run from one state
    args = make_args(
        out_dir / "run",
        per_device_train_batch_size=per_device_batch or ROUND_ROWS // (processes * ACCUMULATION),
        gradient_accumulation_steps=ACCUMULATION, num_generations=G, max_completion_length=MAX_COMPLETION,
        max_steps=STEPS, learning_rate=0.1 if sgd else 1e-2 if lora else 1e-3, beta=0.04,
        reward_weights=[1.0, 0.5, 0.0],
        logging_steps=1, log_completions=True, num_completions_to_print=0, report_to="none", save_strategy="no",
        seed=0, ddp_backend=ddp_backend, ds3_gather_for_generation=ds3_gather, disable_tqdm=True,
        mlp_tile_tokens=mlp_tile_tokens, recompute_attention=recompute_attention,
        # RowSeededSampling stands in for generate_rollout (model.generate)
        generation_backend="generate", padding_free=padding_free, logprob_chunk_size=logprob_chunk_size,
        loss_type=loss_type, **_sequence_parallel(processes) if sequence_parallel else {},
        **{"optim": "sgd"} if sgd else {})  # SGD: a gradient's scale shows in the weights
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    recorder = Recorder()
    trainer = make_trainer(out_dir / "run", None, copy_digits_dataset(num_prompts=16),
                           [copy_digits_reward, str(model_dir / "reward"), recorder], str(model_dir / "policy"),
                           args=args, peft_config=peft_config)
    # Instrumentation: which process writes the completion log, and each process's own metric means before
    # `log` averages them over processes.
    flushes, local_metrics = [], []
    flush, log = trainer.completions.flush, trainer.log
    trainer.completions.flush = lambda step: flushes.append(step) or flush(step)

    def log_and_record(logs: dict, start_time: float | None = None) -> None:
        if "loss" in logs:
            local_metrics.append({k: _finite_mean(v) for k, v in trainer._metrics["train"].items()})
        log(logs, start_time)

    trainer.log = log_and_record
    packed_forwards = _count_packed_forwards()
    tiled, attention, logprobs = {}, {}, {}

    start = time.perf_counter()
    with RowSeededSampling(), _counting_tiled_backwards(tiled), _counting_recomputed_attention(attention), \
            _recording_logprobs(logprobs, lambda: trainer.state.global_step):
        trainer.train()
    train_seconds = time.perf_counter() - start

    state = PartialState()
    zero3 = trainer.is_deepspeed_enabled and \
        trainer.accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"] == 3
    sharding = _sharding_facts(trainer.model)
    params = full_parameters(trainer.model)
    probe = _probe_generation(trainer, zero3)
    trainer.save_model(str(out_dir / "saved"))
    reward_model = trainer.reward_funcs[1].model
    mine = {"rank": state.process_index, "rounds": recorder.rounds, "flushes": flushes, "local_metrics": local_metrics,
            "digest": parameter_digest(params), "sharding": sharding, "probe": probe,
            "packed_forwards": packed_forwards[0], "sharded_forwards": sharded_forwards(), "tiled_mlp": tiled,
            "recomputed_attention": attention, "logprobs": logprobs,
            "checkpointing": compat.checkpointing_is_on(causal_lm(trainer.model))}
    every = gather_object([mine])
    if state.is_main_process:
        torch.save(params, out_dir / "params.pt")
        wrapped = trainer.model_wrapped
        result = {
            "num_processes": trainer.accelerator.num_processes,
            "distributed_type": trainer.accelerator.distributed_type.value,
            "wrapped_mro": [c.__name__ for c in type(wrapped).__mro__],
            "model_class": type(trainer.model).__name__,
            "ref_model_mro": [c.__name__ for c in type(trainer.ref_model).__mro__] if trainer.ref_model else None,
            "reward_model_mro": [c.__name__ for c in type(reward_model).__mro__],
            "zero3": zero3,
            "log_history": trainer.state.log_history,
            "train_seconds": train_seconds,
            "ranks": sorted(every, key=lambda r: r["rank"]),
        }
        (out_dir / "result.json").write_text(json.dumps(result, indent=1))
        return result
    return {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--ddp-backend", default=None)
    parser.add_argument("--no-ds3-gather", action="store_true")
    parser.add_argument("--per-device-batch", type=int, default=None)
    parser.add_argument("--padding-free", action="store_true")
    parser.add_argument("--logprob-chunk-size", type=int, default=1024)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--sgd", action="store_true")
    parser.add_argument("--mlp-tile-tokens", type=int, default=0)
    parser.add_argument("--recompute-attention", action="store_true")
    cli = parser.parse_args()
    skip_shm_op_build()  # ZeRO and Ulysses launches start a group through deepspeed.comm
    run(cli.out, cli.model_dir, lora=cli.lora, ddp_backend=cli.ddp_backend, ds3_gather=not cli.no_ds3_gather,
        per_device_batch=cli.per_device_batch, padding_free=cli.padding_free, logprob_chunk_size=cli.logprob_chunk_size,
        sequence_parallel=cli.sequence_parallel, loss_type=cli.loss_type, sgd=cli.sgd,
        mlp_tile_tokens=cli.mlp_tile_tokens, recompute_attention=cli.recompute_attention)
    leave_cleanly()


if __name__ == "__main__":
    main()  # leaves through leave_cleanly

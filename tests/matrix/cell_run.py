"""Runs cells of the combination matrix (`factors.py`) in this process: in pytest's for one process, or as the
script `accelerate launch` starts on each of 2 processes (`--cells cells.json --out DIR`; rank 0 writes
`DIR/results.json`). Several cells run one after the other in one launch: the start-up is the expensive part.

A cell trains 2 optimizer steps (SGD, so that weights compare exactly) on a tiny model: the toy copy task's
decoder for text prompts (a tiny Qwen3-MoE at routing_replay 'on' / 'off': `make_tiny_moe`), Qwen2.5-VL's tiny model
for image prompts in TRL's placeholder format. What it records, for `test_matrix.py` (and the vLLM stage's
tests/vllm_integration/test_matrix_vllm.py) to check:
  - `losses`: every logged training loss (must be finite);
  - `moved`: whether the trainable parameters changed;
  - `digests`: each process's digest of its full parameters (must be equal);
  - `resume_diff` (resume cells): the largest difference between the run's weights and those of a second run that
    resumes from the first run's step-1 checkpoint (must be 0: the resumed run is the straight run);
  - `twin_diff` (packed cells): the largest difference from the same cell run padded (padding_free=False);
  - `launch`, `routing_replay`, `sp_size`: the trainer's launch facts (`runtime.distributed.Launch`), whether its
    rounds replay the routing, its sequence-parallel group's size;
  - `packed_forwards`: each process's packed log-prob forwards of the training (the packing self-check's not
    counted);
  - `staleness` (async cells): every logged `async/staleness_max` (must be within async_rollouts);
  - `uninformative_groups`, `extra_rounds` (resample cells): groups with all advantages 0 in the rounds the loss
    used, and the extra rounds drawn (resampling must have run and kept informative groups only);
  - `error` for a cell that raised, with its type and message (a refusal cell expects one).
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

G = 2  # tests.helpers.TRAINER_DEFAULTS: 4 rows per process (2 groups of G = 2), 2 steps
STEPS = 2
VLM_FAMILY = "qwen2_5_vl"
VLLM_VLM_FAMILY = "idefics3"  # the family vLLM's CPU build loads; served by tests/vllm_integration/conftest.py
NOT_LOADED = "matrix-refusal/never-loaded"  # a Hub id not in the cache: a refusal cell must stop before reading it
LAUNCH_FACTS = ("processes", "zero_stage", "deepspeed", "fsdp", "sequence_parallel")  # of runtime.distributed.Launch


def reward(prompts, completions, **kwargs) -> list[float]:
    """The first group of each call (this process's first G rows of the round) gets a constant: a zero-variance group
    in every round, so 'skip' has a group to skip and 'resample' one to replace (its extra rounds' other groups are
    informative). Every other completion gets a number that differs between almost any two texts."""
    def text(value) -> str:
        if isinstance(value, str):
            return value
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for message in value
                       for part in (message["content"] if isinstance(message["content"], list)
                                    else [{"text": message["content"]}]))

    return [1.0 if i < G else float(sum(map(ord, text(c))) % 97) for i, c in enumerate(completions)]


def text_dataset(rows: int = 16):
    """The toy copy task with prompts of 1 to 24 digits: rows of a round differ enough in length that packing them
    costs less than padding (`modeling.packing.plan`), so a packed run and its padded twin lay the tokens out
    differently."""
    from datasets import Dataset

    answers = ["".join(str((7 * i + 3 * j) % 10) for j in range(1 + (5 * i) % 24)) for i in range(rows)]
    return Dataset.from_dict({"prompt": [f"copy {a}:" for a in answers], "answer": answers})


def placeholder_dataset(rows: int = 16):
    """TRL's documented VLM format: `{"type": "image"}` in the user's content, the picture in an `image` column."""
    from datasets import Dataset
    from PIL import Image

    colours = ["red", "green", "blue", "yellow", "purple", "orange"]
    prompts = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Colour of {i}?"}]}]
               for i in range(rows)]
    images = [Image.new("RGB", (28 + 6 * (i % 4), 36), colours[i % len(colours)]) for i in range(rows)]
    return Dataset.from_dict({"prompt": prompts, "image": images})


def settings_of(cell: dict, vllm: dict | None = None) -> dict:
    """The GRPOConfig fields of `cell` where they differ from `tests.helpers.TRAINER_DEFAULTS` (4 rows per process,
    G = 2, 2 steps at learning rate 0.1), `vllm`: the vLLM stage's servers. `factors.refusal` reads the package's
    refusal tables on these same fields."""
    settings = dict(optim="sgd", disable_dropout=True, zero_variance_groups=cell["zero_variance_groups"],
                    max_resample_rounds=4, async_rollouts=int(cell["async_rollouts"]),
                    padding_free=cell["padding_free"] == "on", beta=float(cell["beta"]),
                    memory_check=cell["memory_check"], mlp_tile_tokens=int(cell["mlp_tile_tokens"]),
                    recompute_attention=cell["recompute_attention"] == "on",
                    speculative_rollouts=cell["speculative_rollouts"] == "on")
    if cell["routing_replay"] != "dense":  # the MoE model (`make_tiny_moe`), without the router's auxiliary loss,
        # which would refuse packing (modeling.forwards) and 'skip' (once the model loads); tests/trainer covers it
        settings.update(routing_replay=cell["routing_replay"], router_aux_loss_coef=0.0)
    if cell["backend"] in ("fast", "generate"):
        settings["generation_backend"] = cell["backend"]
    else:  # the real-vLLM stage: `vllm` holds the servers' URLs by prompt kind ({"text": url, "image": url})
        mode = cell["backend"].removeprefix("vllm_")
        settings.update(use_vllm=True, vllm_mode=mode, vllm_gpu_memory_utilization=0.2,
                        activation_checkpointing=False)
        if mode == "server":
            settings.update(vllm_server_base_url=(vllm or {}).get(cell["prompts"]), vllm_server_timeout=60)
    if cell["processes"] in ("zero2", "zero3"):
        # accelerate_configs/cpu/deepspeed_zero{2,3}.yaml: DeepSpeed counts 2 processes only over gloo
        settings["ddp_backend"] = "gloo"
    if cell["sp_size"] != "1":  # accelerate_configs/cpu/ddp_sp.yaml: the group is set in the training config
        from accelerate.parallelism_config import ParallelismConfig

        settings["parallelism_config"] = ParallelismConfig(sp_size=int(cell["sp_size"]), sp_backend="deepspeed")
    return settings


def make_tiny_moe(tokenizer):
    """A tiny Qwen3-MoE (a family routing replay serves: 2 layers of 4 experts, top 2), seeded, float32."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def build(cell: dict, output_dir: Path, model=None, vllm: dict | None = None, **overrides):
    """The cell's trainer (its model built here unless given: a refusal cell passes `NOT_LOADED`)."""
    from transformers import set_seed

    from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer
    from tests.helpers import make_args, make_trainer

    set_seed(0)  # LoRA's A matrices are drawn before the trainer seeds: every run of a cell starts from one state
    args = make_args(output_dir, **{**settings_of(cell, vllm), **overrides})
    on_vllm = cell["backend"].startswith("vllm_")
    if cell["prompts"] == "image":
        if on_vllm:  # the family vLLM's CPU build runs, at the head size its kernels take (vllm_helpers)
            from tests.vllm_integration.vllm_helpers import vllm_tiny_vlm

            built, processing_class = vllm_tiny_vlm(VLLM_VLM_FAMILY)
        else:
            from tests.toy_vlm import make_tiny_vlm

            built, processing_class = make_tiny_vlm(VLM_FAMILY)
        dataset = placeholder_dataset()
    else:
        processing_class = make_tokenizer()
        if on_vllm:  # the model the vLLM server serves (head_dim 32: vLLM's CPU kernels start there)
            from tests.vllm_integration.vllm_helpers import vllm_tiny_model

            built = vllm_tiny_model(processing_class)
        elif cell["routing_replay"] != "dense":
            built = make_tiny_moe(processing_class)
        else:
            built = make_tiny_model(processing_class, seed=0)
        dataset = text_dataset()
    peft_config = None
    if cell["adapter"] == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return make_trainer(output_dir, processing_class, dataset, reward, built if model is None else model, args=args,
                        peft_config=peft_config)


def _trained(trainer) -> dict[str, torch.Tensor]:
    from tests.parameters import full_parameters

    return {n: p for n, p in full_parameters(trainer.model).items()
            if dict(trainer.model.named_parameters())[n].requires_grad}


def _largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _sampled(trainer, replay: list | None) -> list:
    """vLLM server cells: the server samples from one random state for its whole life (its requests carry no seed),
    so a second run against it (the resumed run, the padded twin) draws other completions than the straight run,
    and its weights could never equal the straight run's. The straight run records each of its rollouts with the
    step it was drawn at (`replay` None: returned list filled as it trains); a second run is given the rollouts it
    draws again (`replay`) and gets them back in order instead of asking the server, each checked to answer the
    same prompts. What the second run compares (the resume, the packed layout) is then all that differs."""
    import copy

    backend, recorded = trainer.rollout_backend, []
    generate = backend.generate

    def recording(model, prompts, *args, **kwargs):
        out = generate(model, prompts, *args, **kwargs)
        recorded.append((trainer.state.global_step, copy.deepcopy(out)))
        return out

    def replaying(model, prompts, *args, **kwargs):
        if not replay:
            raise AssertionError("the second run drew more rounds than the straight run recorded")
        out = replay.pop(0)
        if not torch.equal(out.prompt_ids, prompts.ids):
            raise AssertionError("the second run's prompts differ from the straight run's at this round")
        return copy.deepcopy(out)

    backend.generate = recording if replay is None else replaying
    return recorded


def _train(cell: dict, output_dir: Path, vllm: dict | None = None, replay: list | None = None,
           **overrides) -> tuple:
    """A trained cell: (trainer, trainable parameters before, after, the rounds' advantages, the rollouts the
    server sampled (server cells: `_sampled`)); the trainer's `packed_forwards` counts its packed log-prob
    forwards."""
    from grpo_trainer.modeling import forwards

    trainer = build(cell, output_dir, vllm=vllm, **overrides)
    sampled = _sampled(trainer, replay) if cell["backend"] == "vllm_server" else []
    before = _trained(trainer)
    rounds, build_round = [], trainer.rounds.build

    def recording(*args, **kwargs):
        built = build_round(*args, **kwargs)  # the round, or (round, its log) since the round source (issue 39)
        round_ = built[0] if isinstance(built, tuple) else built
        rounds.append(round_.advantages.detach().cpu().reshape(-1).tolist())
        return built

    trainer.rounds.build = recording
    # packed forwards of the training itself: the packing self-check's own forwards (once per model) not counted
    packed_forwards, checking, packed_logprobs, self_check = [0], [False], forwards.packed_logprobs, forwards.self_check

    def counted(*args, **kwargs):
        packed_forwards[0] += not checking[0]
        return packed_logprobs(*args, **kwargs)

    def checked(*args, **kwargs):
        checking[0] = True
        try:
            return self_check(*args, **kwargs)
        finally:
            checking[0] = False

    forwards.packed_logprobs, forwards.self_check = counted, checked
    try:
        trainer.train(resume_from_checkpoint=overrides.get("resume_from_checkpoint"))
    finally:
        forwards.packed_logprobs, forwards.self_check = packed_logprobs, self_check
    trainer.packed_forwards = packed_forwards[0]
    return trainer, before, _trained(trainer), rounds, sampled


def run_cell(cell: dict, output_dir: Path, vllm: dict | None = None) -> dict:
    """Train `cell` and record what test_matrix.py checks (see the module's docstring)."""
    from tests.parameters import parameter_digest

    resume = cell["resume"] == "save"
    saving = {"save_strategy": "steps", "save_steps": 1} if resume else {}
    trainer, before, after, rounds, sampled = _train(cell, output_dir / "run", vllm, **saving)
    history = trainer.state.log_history
    record = {
        "losses": [entry["loss"] for entry in history if "loss" in entry],
        "steps": trainer.state.global_step,
        "moved": _largest_difference(before, after) > 0,
        "digest": parameter_digest(after),
        "staleness": [entry["async/staleness_max"] for entry in history if "async/staleness_max" in entry],
        "extra_rounds": sum(entry.get("zero_variance_groups/extra_rounds", 0.0) for entry in history),
        "uninformative_groups": sum(all(a == 0 for a in adv[i:i + G]) for adv in rounds
                                    for i in range(0, len(adv), G)),
        "packed_forwards": trainer.packed_forwards,
        # what the trainer made of the row's settings: its launch facts (`factors.launch_of` read the refusal tables
        # with these), whether its rounds replay the routing, its sequence-parallel group
        "launch": {k: getattr(trainer.launch, k) for k in LAUNCH_FACTS},
        "routing_replay": bool(trainer.rounds.settings.routing_replay),
        "sp_size": trainer.sequence.size,
    }
    del trainer
    if resume:
        checkpoint = output_dir / "run" / "checkpoint-1"
        again = [out for step, out in sampled if step >= 1] if sampled else None  # drawn after checkpoint-1
        resumed = _train(cell, output_dir / "run", vllm, again, save_strategy="no",
                         resume_from_checkpoint=str(checkpoint))
        record["resume_diff"] = _largest_difference(after, resumed[2])
        record["resumed_steps"] = resumed[0].state.global_step
        del resumed
    if cell["padding_free"] == "on":
        twin = _train(cell, output_dir / "padded", vllm, [out for _, out in sampled] if sampled else None,
                      padding_free=False)
        record["twin_diff"] = _largest_difference(after, twin[2])
        del twin
    return record


def refuse_cell(cell: dict, output_dir: Path, vllm: dict | None = None) -> dict:
    """A refused combination: GRPOConfig (`where` "config") or GRPOTrainer ("trainer") must raise before any model
    loads (the model is a Hub id that is not in the cache: reading it would raise OSError instead)."""
    from tests.helpers import make_args

    where = "config"
    try:
        make_args(output_dir, **settings_of(cell, vllm))
        where = "trainer"
        build(cell, output_dir, model=NOT_LOADED, vllm=vllm)
    except Exception as error:  # noqa: BLE001 - the test checks the type and the message
        return {"error": [type(error).__name__, " ".join(str(error).split())], "where": where}
    return {"error": None}


def run_all(cells: list[dict], output_dir: Path, vllm: dict | None = None) -> list[dict]:
    """Each cell (a refusal cell has `"refused": true`) run in turn; a cell that raises is recorded, not fatal."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    results = []
    for i, cell in enumerate(cells):
        row = {k: v for k, v in cell.items() if k != "refused"}
        try:
            record = (refuse_cell if cell.get("refused") else run_cell)(row, output_dir / f"cell{i}", vllm)
        except Exception as error:  # noqa: BLE001 - reported by the test, with the traceback
            record = {"error": [type(error).__name__, " ".join(str(error).split())],
                      "traceback": traceback.format_exc()[-3000:]}
        record["digests"] = gather_object([record.get("digest")])  # every cell, failed or not: a collective
        # each process decides per micro-batch whether packing pays (modeling.forwards, decision 4): all count
        record["packed_forwards"] = gather_object([record.get("packed_forwards", 0)])
        record["processes"] = PartialState().num_processes
        results.append(record)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vllm", type=json.loads, default=None)  # {"text": server URL, "image": server URL}
    cli = parser.parse_args()
    torch.set_num_threads(1)
    from tests.distributed.deepspeed_cpu import skip_shm_op_build

    skip_shm_op_build()  # ZeRO-2 cells start a group through deepspeed.comm
    from accelerate import PartialState

    results = run_all(json.loads(cli.cells.read_text()), cli.out, cli.vllm)
    if PartialState().is_main_process:
        (cli.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    from tests.distributed.teardown import leave_cleanly

    leave_cleanly()


if __name__ == "__main__":
    main()

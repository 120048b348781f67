"""Two training processes with vLLM, as `accelerate launch` runs them in test_vllm_multiprocess.py.

Each process trains 3 steps in server mode with `--url` (the main process talks to the server; the others send
their prompts through it and receive their own completions) or colocated without it (each process its own
engine), then pushes the final weights, samples greedily through vLLM and writes `result-<rank>.json`: its log
history, its rows' prompts and completions in the first round, the final greedy completions next to its own
model's `generate`, and a digest of its parameters.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--url", default=None)  # server mode; colocate without it
    cli = parser.parse_args()

    from grpo_trainer import GRPOConfig, GRPOTrainer
    from grpo_trainer.cli.toy import copy_digits_dataset
    from grpo_trainer.config.settings import sampling_settings
    from grpo_trainer.rewards.library import copy_digits_reward
    from grpo_trainer.rollout.generate import generate_rollout
    from grpo_trainer.rollout.prompts import tokenize_prompts
    from grpo_trainer.rollout.settings import make_generation_config
    from tests.parameters import full_parameters, parameter_digest

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    model = AutoModelForCausalLM.from_pretrained(cli.model, dtype=torch.float32)
    args = GRPOConfig(output_dir=cli.out, use_vllm=True, vllm_mode="server" if cli.url else "colocate",
                      vllm_server_base_url=cli.url, vllm_gpu_memory_utilization=0.2,
                      vllm_server_timeout=60, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=3, logging_steps=1, save_strategy="no", report_to="none",
                      disable_tqdm=True, learning_rate=1e-3, seed=0, activation_checkpointing=False)
    trainer = GRPOTrainer(model, copy_digits_reward, args=args, train_dataset=copy_digits_dataset(num_prompts=32),
                          processing_class=tokenizer)
    first_round = {}
    generate = trainer.rounds.rollout

    def recording_rollout(prompts, mode, *args, **kwargs):
        out = generate(prompts, mode, *args, **kwargs)
        if not first_round:
            first_round.update(prompt_ids=out.prompt_ids.tolist(), completion_ids=out.completion_ids.tolist())
        return out

    trainer.rounds.rollout = recording_rollout
    trainer.train()

    rank = trainer.accelerator.process_index
    prompts = tokenize_prompts(tokenizer, ["copy 123:", "copy 98765:"] if rank == 0 else ["c", "copy 4:"], None)
    config = make_generation_config(sampling_settings(args), trainer.model.generation_config, tokenizer, 12)
    config.do_sample = False
    policy = trainer.accelerator.unwrap_model(trainer.model)
    trainer.rollout_backend.sync_weights(policy, trainer.state.global_step + 1)  # a new version: push again
    served = trainer.rollout_backend.generate(policy, prompts, config)
    own = generate_rollout(policy, prompts, config)
    result = {"rank": rank, "processes": trainer.accelerator.num_processes, "log_history": trainer.state.log_history,
              "first_round": first_round, "served": served.completion_ids.tolist(),
              "generate": own.completion_ids.tolist(), "digest": parameter_digest(full_parameters(policy))}
    Path(cli.out, f"result-{rank}.json").write_text(json.dumps(result))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()

"""GRPO on one page: one training step in plain PyTorch and transformers. Read it before the trainer.

`grpo_trainer.GRPOTrainer` (like TRL 1.16's `GRPOTrainer`) takes this very step under its default settings, spread
over many files because it also batches, packs, accumulates, distributes, checks and logs.
`tests/test_reference_step.py` holds the two to it: fed the same completions and rewards, one SGD step of each moves
every weight by the same amount, to float32 rounding, with and without the KL term.

One step, for P prompts:

1. Sample a group of G completions per prompt from the policy at temperature T (`sample_group`).
2. Score every completion with a reward function: rewards r, [P, G].
3. Advantage of each completion within its group (`group_advantages`, TRL's `scale_rewards='group'`):
       A = (r - mean(r)) / (std(r) + 1e-4), the std Bessel-corrected (divided by G - 1).
   Every token of a completion gets its completion's A.
4. Loss of each completion token (`token_losses`), rho = pi_theta / pi_old its importance ratio:
       -min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A)    the PPO-clipped surrogate
       + beta * rho * k3,  k3 = exp(ref - logp) - (ref - logp) - 1    the KL to a frozen reference (Schulman's k3;
                                                                      the factor rho is TRL 1.16's default
                                                                      use_bias_correction_kl=True)
   Log-probs come from logits / T: the distribution the completions were sampled from.
5. Aggregate as `loss_type='dapo'` (TRL 1.16's default): the sum over every completion token of the batch divided
   by the number of those tokens, so every token weighs the same whatever its completion's length.
6. Backward, clip the gradient norm to `max_grad_norm` (the Trainer's default 1.0), one optimizer step.

Simplifications. None changes the step under the trainer's defaults; each is what the trainer adds:

- One process, one micro-batch: the whole round in one backward. The trainer splits a round into micro-batches
  (`gradient_accumulation_steps`, `steps_per_generation`) and processes; its dapo normaliser counts the tokens of
  the whole accumulated global batch, so the pieces' gradients add up to this one.
- On-policy only (`num_iterations=1`): the completions were sampled by the weights being trained, so pi_old is
  pi_theta, rho = exp(logp - logp.detach()) is 1 in value (its gradient is that of log pi) and the clip never
  binds. Both are written out because with `num_iterations > 1` the later passes over a round see rho != 1.
- One sequence per forward: no padding, no packing (the trainer's `padding_free`), the full [T, V] logits (the
  trainer computes log-probs in chunks), no gradient checkpointing, float32, no dropout.
- A sampling loop with temperature only, without a KV cache: no top_k / top_p / min_p / repetition penalty, no
  vLLM or fast decoder, so no sampler-vs-trainer importance-sampling correction. A completion ends at its first
  EOS (kept, and trained on) or after `max_completion_length` tokens; truncated completions are trained on
  (`mask_truncated_completions=False`).
- One reward function with a number for every completion: no None rewards, `reward_weights` or
  `multi_objective_aggregation`; G >= 2.
- Only `loss_type='dapo'` with token-level ratios. Not here: 'grpo' (the mean of each completion's token mean),
  'bnpo', 'dr_grpo', the CISPO / SAPO / VESPO surrogates, sequence-level ratios (GSPO), `delta`, the entropy
  bonus, the off-policy and high-entropy token masks.
- The reference is a frozen copy of the initial policy (only with beta != 0), never synced.

    python examples/reference_grpo_step.py --smoke      # offline: a tiny random model, 2 steps, seconds
    python examples/reference_grpo_step.py --model Qwen/Qwen2.5-0.5B-Instruct   # downloads it; a GPU is advised
"""

from __future__ import annotations

import argparse
import copy
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config


@dataclass
class Settings:
    """The step's hyperparameters, under GRPOConfig's names, with its defaults."""

    num_generations: int = 8  # G, completions per prompt
    max_completion_length: int = 512
    temperature: float = 1.0
    epsilon: float = 0.2  # lower clip range
    epsilon_high: float = 0.2  # upper clip range (GRPOConfig: None means epsilon; DAPO's clip-higher uses 0.28)
    beta: float = 0.0  # KL coefficient; 0 needs no reference model
    max_grad_norm: float = 1.0  # 0 turns clipping off
    advantage_eps: float = 1e-4  # TRL's: a group whose rewards barely differ is not amplified 1e8-fold


@dataclass
class Group:
    """One prompt and its G sampled completions (token ids, each its own length)."""

    prompt_ids: Tensor  # [S]
    completions: list[Tensor]  # G x [T_i], each ending at its first EOS or at max_completion_length


# -----------------------------------------------------------------------------------------------------------------
# 1. Sampling


@torch.no_grad()
def sample_group(model, prompt_ids: Tensor, settings: Settings, eos_ids: list[int]) -> Group:
    """G completions of one prompt, token by token from softmax(logits / T), each cut after its first EOS."""
    ids = prompt_ids.repeat(settings.num_generations, 1)  # [G, S]: one prompt, so no padding
    eos = torch.tensor(eos_ids, device=ids.device)
    done = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
    for _ in range(settings.max_completion_length):
        logits = model(input_ids=ids).logits[:, -1]  # [G, V]; no KV cache: the whole sequence again, for clarity
        next_ids = torch.multinomial(torch.softmax(logits.float() / settings.temperature, dim=-1), 1)  # [G, 1]
        ids = torch.cat([ids, next_ids], dim=1)
        done |= torch.isin(next_ids[:, 0], eos)
        if done.all():
            break
    sampled = ids[:, len(prompt_ids) :]  # [G, T]; a finished row went on sampling, cut off below
    return Group(prompt_ids, [row[: _length(row, eos)] for row in sampled])


def _length(row: Tensor, eos: Tensor) -> int:
    """Tokens up to and including the first EOS; all of them if there is none (a truncated completion)."""
    hits = torch.isin(row, eos).nonzero()
    return int(hits[0]) + 1 if len(hits) else len(row)


# -----------------------------------------------------------------------------------------------------------------
# 3. Group advantages


def group_advantages(rewards: Tensor, eps: float = 1e-4) -> Tensor:
    """[P, G] rewards -> [P, G] advantages: each reward minus its group's mean, over the group's std + eps.
    A group whose rewards are all equal gets 0: it says nothing about which completion is better."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)  # Bessel-corrected, as TRL's nanstd
    return (rewards - mean) / (std + eps)


# -----------------------------------------------------------------------------------------------------------------
# 4. Per-token log-probs and losses


def completion_logps(model, prompt_ids: Tensor, completion_ids: Tensor, temperature: float) -> Tensor:
    """[T] log pi(token | prompt, tokens before it) of each completion token, at the sampling temperature."""
    ids = torch.cat([prompt_ids, completion_ids]).unsqueeze(0)  # [1, S + T]
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]  # [T, V]: position i predicts token i + 1
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logps.gather(1, completion_ids.unsqueeze(1)).squeeze(1)


def token_losses(logps: Tensor, old_logps: Tensor, ref_logps: Tensor | None, advantage: Tensor,
                 settings: Settings) -> Tensor:
    """[T] the loss of each token of one completion; `advantage` is that completion's (a scalar)."""
    ratio = torch.exp(logps - old_logps)  # rho
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.epsilon_high)
    loss = -torch.min(ratio * advantage, clipped * advantage)
    if settings.beta != 0.0:
        log_ref_ratio = ref_logps - logps
        k3 = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # >= 0, and 0 where policy and reference agree
        loss = loss + settings.beta * ratio * k3  # x rho: use_bias_correction_kl=True
    return loss


# -----------------------------------------------------------------------------------------------------------------
# 5-6. The round's loss and one optimizer step


def train_on_round(policy, reference, optimizer, groups: list[Group], rewards: Tensor, settings: Settings) -> dict:
    """Steps 3 to 6 on sampled completions; `rewards` [P, G] in the groups' order."""
    advantages = group_advantages(rewards, settings.advantage_eps)  # [P, G]
    total, num_tokens = 0.0, 0
    for group, group_advantage in zip(groups, advantages):
        for completion, advantage in zip(group.completions, group_advantage):
            logps = completion_logps(policy, group.prompt_ids, completion, settings.temperature)
            old_logps = logps.detach()  # on-policy: sampled by these very weights (num_iterations=1)
            ref_logps = None
            if settings.beta != 0.0:
                with torch.no_grad():
                    ref_logps = completion_logps(reference, group.prompt_ids, completion, settings.temperature)
            total = total + token_losses(logps, old_logps, ref_logps, advantage, settings).sum()
            num_tokens += len(completion)
    loss = total / num_tokens  # 'dapo': every completion token of the batch weighs the same
    optimizer.zero_grad()
    loss.backward()
    if settings.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(policy.parameters(), settings.max_grad_norm)
    optimizer.step()
    return {"loss": loss.item(), "reward": rewards.mean().item(), "completion_tokens": num_tokens}


RewardFn = Callable[[Tensor, Tensor], float]  # (prompt_ids [S], completion_ids [T]) -> reward


def grpo_step(policy, reference, optimizer, prompts: list[Tensor], reward_fn: RewardFn, settings: Settings,
              eos_ids: list[int]) -> dict:
    """One GRPO step: sample a group per prompt, reward every completion, train on the round once."""
    groups = [sample_group(policy, prompt, settings, eos_ids) for prompt in prompts]
    rewards = torch.tensor([[reward_fn(g.prompt_ids, c) for c in g.completions] for g in groups])  # [P, G]
    return train_on_round(policy, reference, optimizer, groups, rewards, settings)


# -----------------------------------------------------------------------------------------------------------------
# A run: a toy task on a tiny random model (--smoke), or digit copying with a Hub model


def _smoke_task():
    """A random 2-layer Qwen2 over 16 token ids (0 = EOS); the reward is the share of even ids in a completion."""
    config = Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=0, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    prompts = [torch.randint(1, 16, (5,)) for _ in range(4)]
    reward = lambda prompt, completion: (completion % 2 == 0).float().mean().item()
    return model, prompts, reward, [0], Settings(num_generations=4, max_completion_length=8, max_grad_norm=1.0)


def _hub_task(name: str):
    """`name`'s model and tokenizer on 'repeat the number' prompts; reward 1 when the completion contains it."""
    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    numbers = [str(random.randint(100, 99999)) for _ in range(8)]
    prompts = [tokenizer(f"Repeat the number {n}: ", return_tensors="pt").input_ids[0] for n in numbers]
    answers = {tuple(p.tolist()): n for p, n in zip(prompts, numbers)}
    reward = lambda prompt, completion: float(answers[tuple(prompt.tolist())] in tokenizer.decode(completion.tolist()))
    eos = model.generation_config.eos_token_id
    eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos if eos is not None else tokenizer.eos_token_id]
    return model, prompts, reward, eos_ids, Settings(num_generations=8, max_completion_length=32)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--smoke", action="store_true", help="Offline: a tiny random model, 2 steps.")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    random.seed(0)
    policy, prompts, reward_fn, eos_ids, settings = _smoke_task() if args.smoke else _hub_task(args.model)
    settings.beta = args.beta
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy.to(device)
    prompts = [p.to(device) for p in prompts]
    reference = copy.deepcopy(policy).eval().requires_grad_(False) if settings.beta != 0.0 else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3 if args.smoke else 1e-6, weight_decay=0.0)
    history = []
    for step in range(1, (2 if args.smoke else args.steps) + 1):
        history.append(grpo_step(policy, reference, optimizer, prompts, reward_fn, settings, eos_ids))
        print(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in history[-1].items()))
    return history


if __name__ == "__main__":
    main()

"""GRPOTrainer with `partial_rollouts`: alpha = 0 is today's path bit for bit; on the trained policy (lengths it learnt,
heavy-tailed) rounds park groups, resume them with their tokens and version stamps, train a very long group in a later
round instead of dropping it, and resume from a checkpoint exactly; the combinations it cannot run are refused by name
before any model loads.

The trained policy (`tests/trained_policy.py`) is built once per machine and cached (about 160 s the first time)."""

import copy

import pytest
import torch
from datasets import Dataset

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward, make_tiny_model
from tests.helpers import StopAt, make_trainer, sgd_step_args
from tests.trained_policy import countdown_reward, prompt_text, trained_policy

PARTIAL = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=160, optim="sgd",
               learning_rate=0.05, max_grad_norm=0.0, temperature=1.0)


@pytest.fixture(scope="module")
def policy():
    return trained_policy()


def _dataset(starts):
    return Dataset.from_dict({"prompt": [prompt_text(n) for n in starts], "start": list(starts)})


def _recorded(trainer):
    """Every partial round's output (`PartialRound`: trained rows, the assembled rollout with its version stamps),
    in order, with the parked groups as they were before it."""
    part, seen = trainer.rounds.partial, []
    real = part.round

    def round_(batch, version, *args):
        before = copy.deepcopy(part.parked)
        out = real(batch, version, *args)
        seen.append((version, before, out))
        return out

    part.round = round_
    return seen


def test_alpha_zero_is_todays_path_bit_for_bit(tmp_path, tokenizer):
    path = tmp_path / "model"
    make_tiny_model(tokenizer, hidden_size=64, num_layers=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    deltas = []
    for name, extra in (("off", {}), ("zero", {"partial_rollouts": 0.0})):
        trainer = GRPOTrainer(str(path), copy_digits_reward, args=sgd_step_args(tmp_path / name, **extra),
                              train_dataset=copy_digits_dataset(num_prompts=16), processing_class=tokenizer)
        assert trainer.rounds.partial is None and trainer.corrections.settings.partial is None
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        deltas.append({n: p.detach() - before[n] for n, p in trainer.model.named_parameters()})
    assert max(d.abs().max().item() for d in deltas[0].values()) > 1e-4  # the step moved the weights
    assert all(torch.equal(deltas[0][n], deltas[1][n]) for n in deltas[0])


def test_parked_rows_resume_with_their_tokens_and_versions_and_train_weighted(tmp_path, policy):
    """Over 4 rounds with alpha 0.5 some group is parked with open rows and resumed: the trained row starts with
    the tokens parked (same ids, same log-probs), stamped with the version that sampled them, and the rest with the
    round's; the trained stale tokens are weighted (`partial/*` metrics) and the option changed what was trained
    (more groups decoded than trained)."""
    run = make_trainer(tmp_path, policy.tokenizer, _dataset([2, 3, 40, 5, 1, 30, 4, 2, 6, 3, 45, 2, 1, 4, 3, 2]),
                       countdown_reward, copy.deepcopy(policy.model), partial_rollouts=0.5, max_steps=4, **PARTIAL)
    seen = _recorded(run)
    run.train()
    checked = 0
    for version, before, out in seen:
        parked = {(g.row["start"], tuple(r.tokens)): (r.logps, r.versions) for g in before for r in g.rows
                  if r.tokens and not r.ended}
        for i, row in enumerate(out.rows):
            n = int(out.rollout.completion_mask[i].sum())
            tokens = out.rollout.completion_ids[i, :n].tolist()
            for (start, prefix), (logps, versions) in parked.items():
                k = len(prefix)
                if row["start"] == start and tuple(tokens[:k]) == prefix:
                    assert out.rollout.sampler.versions[i, :k].tolist() == versions
                    assert all(v < version for v in versions)
                    assert (out.rollout.sampler.versions[i, k:n] == version).all()
                    torch.testing.assert_close(out.rollout.sampler.logps[i, :k], torch.tensor(logps))
                    checked += 1
    assert checked >= 1, "no parked open row was resumed and trained in 4 rounds"
    history = run.state.log_history[:-1]
    assert any(e["partial/stale_token_share"] > 0 for e in history)
    assert all("partial/importance_sampling_ratio/mean" in e for e in history if e["partial/stale_token_share"] > 0)
    assert sum(e["partial/decoded_tokens"] for e in history) != sum(e["partial/trained_tokens"] for e in history)


def test_a_very_long_group_is_trained_in_a_later_round_not_dropped(tmp_path, policy):
    """One prompt counts down from 45 (about 150 tokens), the others from 1-6 (a dozen or two): the round that starts
    it ends before it completes and parks it; at most `partial_rollout_max_parks` rounds later it is required, so a
    later round trains it whole: every completion ended by EOS, its tokens from two or more versions."""
    run = make_trainer(tmp_path, policy.tokenizer, _dataset([45, 2, 3, 1, 4, 2, 3, 5, 1, 2, 6, 3]), countdown_reward,
                       copy.deepcopy(policy.model), partial_rollouts=0.5, partial_rollout_max_parks=1, max_steps=6,
                       **{**PARTIAL, "max_completion_length": 200, "per_device_train_batch_size": 4,
                          "num_generations": 2})
    seen = _recorded(run)
    run.train()
    trained = [(k, out) for k, (_, _, out) in enumerate(seen) if any(r["start"] == 45 for r in out.rows)]
    assert trained, "the long group was never trained"
    k, out = trained[0]
    rows = [i for i, r in enumerate(out.rows) if r["start"] == 45]
    assert len(rows) == 2 and not bool(out.rollout.is_truncated[rows].any())  # whole, ended by EOS
    assert any(seen[j][1] and any(g.row["start"] == 45 for g in seen[j][1]) for j in range(k + 1))  # it was parked
    versions = {v for i in rows for v in out.rollout.sampler.versions[i][out.rollout.completion_mask[i].bool()]
                .tolist()}
    assert len(versions) >= 2


def _run_to(path, policy, stop_at, resume=None):
    model = copy.deepcopy(policy.model)
    trainer = make_trainer(path, policy.tokenizer, _dataset([2, 3, 40, 5, 1, 30, 4, 2, 6, 3, 45, 2, 1, 4, 3, 2]),
                           countdown_reward, model, partial_rollouts=0.5, max_steps=4, save_strategy="steps",
                           save_steps=2, **PARTIAL)
    trainer.add_callback(StopAt(stop_at))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_resume_with_parked_rows_equals_an_uninterrupted_run(tmp_path, policy):
    straight, weights = _run_to(tmp_path / "straight", policy, 4)
    first, _ = _run_to(tmp_path / "split", policy, 2)
    state = torch.load(tmp_path / "split" / "checkpoint-2" / "grpo_state_0.pt", weights_only=False)
    assert state["partial_rollouts"]["parked"], "the checkpoint holds no parked group: nothing to resume"
    resumed, resumed_weights = _run_to(tmp_path / "split", policy, 4, resume=True)
    assert all(torch.equal(weights[n], resumed_weights[n]) for n in weights)
    assert straight.rounds.partial.state_dict() == resumed.rounds.partial.state_dict()


def test_a_save_killed_half_way_resumes_from_the_last_whole_checkpoint_with_its_parked_rows(tmp_path, policy):
    """kill -9 during the save of checkpoint 4 leaves it half written (its parked-rows file cut short, its model
    truncated): the resumed run takes checkpoint 2 and its parked groups, and ends where the straight run does."""
    from grpo_trainer.runtime.checkpoints import latest_complete

    _, weights = _run_to(tmp_path / "straight", policy, 4)
    _run_to(tmp_path / "split", policy, 2)
    broken = tmp_path / "split" / "checkpoint-4"
    broken.mkdir()
    whole = (tmp_path / "split" / "checkpoint-2" / "grpo_state_0.pt").read_bytes()
    (broken / "grpo_state_0.pt").write_bytes(whole[:len(whole) // 2])
    (broken / "model.safetensors").write_bytes(b"truncated")
    assert latest_complete(str(tmp_path / "split")) == str(tmp_path / "split" / "checkpoint-2")
    _, resumed = _run_to(tmp_path / "split", policy, 4, resume=True)
    assert all(torch.equal(weights[n], resumed[n]) for n in weights)


@pytest.mark.parametrize("fields, refusal", [
    (dict(use_vllm=True), "partial_rollouts=0.5 ends a round inside the fast decoder's plain loop, but use_vllm"),
    (dict(generation_backend="generate"), "but generation_backend='generate'"),
    (dict(speculative_rollouts=True), "but speculative_rollouts=True verifies drafts"),
    (dict(use_transformers_continuous_batching=True), "but use_transformers_continuous_batching=True"),
    (dict(async_rollouts=1), "with async_rollouts=1 rounds are sampled ahead"),
    (dict(zero_variance_groups="resample"), "zero_variance_groups='resample' both decide"),
    (dict(vllm_importance_sampling_correction=False), "vllm_importance_sampling_correction=False turns off"),
    (dict(top_k=5), "not the kept support a truncated sampler drew it from"),
    (dict(sampling_mismatch_report=True), "a partial round's tokens were sampled by several"),
])
def test_combinations_it_cannot_run_are_refused_by_name(tmp_path, fields, refusal):
    with pytest.raises(ValueError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        GRPOConfig(output_dir=str(tmp_path), partial_rollouts=0.5, **fields)


def test_mask_needs_no_correction_and_bad_values_are_refused(tmp_path):
    GRPOConfig(output_dir=str(tmp_path), partial_rollouts=0.5, partial_rollout_stale_tokens="mask",
               vllm_importance_sampling_correction=False)
    for fields, message in ((dict(partial_rollouts=-1), "partial_rollouts must be a number in"),
                            (dict(partial_rollout_max_parks=0), "partial_rollout_max_parks must be >= 1"),
                            (dict(partial_rollout_stale_tokens="drop"), "must be 'weight' or 'mask'")):
        with pytest.raises(ValueError, match=message):
            GRPOConfig(output_dir=str(tmp_path), **{"partial_rollouts": 0.5, **fields})


def test_multi_turn_rollouts_are_refused_at_construction(tmp_path):
    from tests.tool_helpers import get
    from tests.trainer.test_multiturn import trainer

    with pytest.raises(ValueError, match="multi-turn rollouts .* are sampled turn by turn"):
        trainer(tmp_path, tools=[get], partial_rollouts=0.5)

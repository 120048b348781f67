"""The weight-sync check's pure parts, without vLLM (`rollout.vllm.sync_check`, `rollout.vllm.inspection`): which
pushes are checked, the gap between two sets of log-probs, the digests, splitting a fused engine parameter back into
checkpoint tensors, and the error's wording. tests/vllm_integration/test_vllm_sync_check.py runs them on vLLM."""

import math

import pytest
import torch

from grpo_trainer.rollout.types import Rollout
from grpo_trainer.rollout.vllm import inspection, sync_check


def test_the_first_push_and_every_nth_after_it_are_checked():
    schedule, due = sync_check.SyncSchedule(interval=3), []
    for _ in range(1, 8):
        schedule.pushed([])
        due.append(schedule.due)
        schedule.due = False
    assert [push for push, d in zip(range(1, 8), due) if d] == [1, 4, 7]


def test_a_push_that_left_parameters_unreached_is_checked_at_once():
    schedule = sync_check.SyncSchedule(interval=10)
    schedule.pushed([])
    schedule.due = False
    schedule.pushed(["model.norm.weight"])  # push 2: not on the schedule, but something was not reached
    assert schedule.due and schedule.unreached == ["model.norm.weight"]


def test_interval_zero_checks_nothing():
    schedule = sync_check.SyncSchedule(interval=0)
    schedule.pushed(["model.norm.weight"])
    assert not schedule.due


def test_the_tolerance_is_the_least_precise_sides():
    assert sync_check.logp_tolerance(torch.float32) == 1e-3
    assert sync_check.logp_tolerance(torch.float32, torch.bfloat16) == 1e-1


def test_logp_gap_is_the_mean_over_tokens_both_sides_scored():
    engine = torch.tensor([[-1.0, -2.0, math.nan], [-0.5, -4.0, 0.0]])
    trainer = torch.tensor([[-1.5, -2.0, -3.0], [-0.25, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # scored and finite: |-1 + 1.5| = 0.5, |-2 + 2| = 0, |-0.5 + 0.25| = 0.25 (the NaN and the masked ones are out)
    gap, tokens = sync_check.logp_gap(engine, trainer, mask)
    assert tokens == 3 and gap.item() == pytest.approx((0.5 + 0.0 + 0.25) / 3, abs=1e-7)


def test_no_scored_token_is_a_gap_of_zero():
    gap, tokens = sync_check.logp_gap(torch.full((1, 2), math.nan), torch.zeros(1, 2), torch.ones(1, 2))
    assert tokens == 0 and gap.item() == 0.0


def test_engine_completion_logps_take_each_rows_last_tokens():
    # row 0: 3 prompt + 2 completion tokens, so 4 prompt log-probs (every token after the first), the last 2 are the
    # completion's; row 1: 1 completion token the engine gave no value for
    scores = [[-0.1, -0.2, -0.3, -0.4], [-0.7, None]]
    out = sync_check.engine_completion_logps(scores, [2, 1], width=3)
    assert out[0, :2].tolist() == pytest.approx([-0.3, -0.4]) and out[0, 2].isnan()
    assert out[1].isnan().all()


def test_probe_rows_skip_empty_completions_and_keep_the_tokens_without_padding():
    prompt_ids, prompt_mask = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4]]), torch.tensor([[0, 1, 1], [1, 1, 1],
                                                                                             [0, 0, 1]])
    completion_ids, completion_mask = torch.tensor([[1, 2], [3, 0], [0, 0]]), torch.tensor([[1, 1], [0, 0], [1, 0]])
    out = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(3, dtype=torch.bool))
    rows = sync_check.probe_rows(out, 2)
    assert rows.tolist() == [0, 2]  # row 1 has no completion token
    assert sync_check.probe_sequences(out, rows) == [[5, 6, 1, 2], [4, 0]]


def test_a_digest_is_three_float64_sums():
    values = torch.tensor([1.0, -2.0])
    # sum 1 - 2 = -1; sum |x| = 3; weighted 1 cos(0) - 2 cos(0.7071)
    assert inspection.digest(values) == pytest.approx([-1.0, 3.0, 1.0 - 2.0 * math.cos(0.7071)], abs=1e-12)


def test_digests_tell_moved_values_apart_and_ignore_summation_order():
    weights = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    ours = inspection.digest(weights)
    assert inspection.digests_agree(ours, inspection.digest(weights.T.contiguous().T))  # same values, other layout
    assert not inspection.digests_agree(ours, inspection.digest(weights.flip(0)))  # rows swapped: same sums
    assert not inspection.digests_agree(ours, inspection.digest(weights + 1e-4))
    expected = {"a": ours, "b": ours}
    assert sync_check.differing_weights(expected, {"a": ours, "b": inspection.digest(weights * 2)}) == ["b"]


def test_a_fused_engine_parameter_splits_back_into_its_checkpoint_tensors():
    q, k, v = torch.full((4, 3), 1.0), torch.full((2, 3), 2.0), torch.full((2, 3), 3.0)
    fused = torch.cat([q, k, v])  # vLLM's qkv_proj: shards q, k, v along the output dimension
    shapes = {"q.weight": [4, 3], "k.weight": [2, 3], "v.weight": [2, 3]}
    parts = inspection._split(fused, [("v.weight", "v"), ("q.weight", "q"), ("k.weight", "k")], shapes)
    assert all(torch.equal(parts[n], t) for n, t in (("q.weight", q), ("k.weight", k), ("v.weight", v)))


def test_a_padded_engine_parameter_is_cut_to_the_checkpoints_shape():
    embedding = torch.arange(12.0).reshape(4, 3)  # 3 real rows, one row of vocabulary padding
    parts = inspection._split(embedding, [("embed.weight", None)], {"embed.weight": [3, 3]})
    assert torch.equal(parts["embed.weight"], embedding[:3])


def test_a_layout_that_is_not_a_concatenation_is_not_compared():
    shapes = {"a": [2, 3], "b": [2, 3]}
    assert inspection._split(torch.zeros(5, 3), [("a", 0), ("b", 1)], shapes) is None  # 5 rows, not 2 + 2
    assert inspection._split(torch.zeros(4, 3), [("a", "w1"), ("b", "w3")], shapes) is None  # expert shard ids
    assert inspection._split(torch.zeros(1, 3), [("a", None)], shapes) is None  # smaller than the checkpoint's


def test_the_error_names_what_the_diagnosis_found():
    diagnosis = sync_check.Diagnosis(available=True, compared=4, differing=["model.norm.weight"],
                                     unmapped=["model.rotary_emb.inv_freq"], unreached=["model.norm.weight"])
    message = sync_check.failure_message(0.25, 1e-3, 12, 3, 2, "float32", diagnosis)
    assert message.startswith("vLLM's weights are not the policy's after weight push 3 (optimizer step 2): the mean "
                              "|log p_vllm - log p_trainer| over 12 sampled tokens is 0.25, above the 0.001")
    assert "Names that failed to map onto any vLLM parameter: model.rotary_emb.inv_freq." in message
    assert "vLLM parameters the push did not reach: model.norm.weight." in message
    assert "(1 of 4 compared): model.norm.weight." in message and "Every weight differs" not in message


def test_the_error_when_every_weight_agrees_points_at_the_inputs():
    message = sync_check.failure_message(0.5, 1e-3, 8, 1, 0, "float32", sync_check.Diagnosis(available=True,
                                                                                              compared=27))
    assert "Every one of the 27 weights compared equals the policy's" in message
    assert "vision-language model" in message and "could not be compared" not in message


def test_the_error_when_every_compared_weight_agrees_but_experts_were_not_compared_points_at_them():
    # A Mixture-of-Experts model through vLLM's CPU build: its experts are repacked (not compared) and reloaded
    # wrong; blaming image processing would send the user the wrong way.
    diagnosis = sync_check.Diagnosis(available=True, compared=12, uncompared=["model.layers.0.mlp.experts"])
    message = sync_check.failure_message(0.26, 1e-3, 8, 1, 0, "float32", diagnosis)
    assert "the weights that could not be compared" in message and "Mixture-of-Experts" in message
    assert "vision-language" not in message
    assert "Not compared (a layout vLLM splits differently): model.layers.0.mlp.experts." in message


def test_the_error_when_the_engine_cannot_be_read():
    diagnosis = sync_check.Diagnosis(available=False, reason="the server at http://h:1 has no weight inspection")
    message = sync_check.failure_message(0.5, 1e-3, 8, 1, 0, "float32", diagnosis)
    assert "The engine's weights could not be read back: the server at http://h:1 has no weight inspection" in message


def test_sampling_off_the_main_thread_moves_the_check_to_the_push(tiny_model):
    """The asynchronous round source calls `sample_off_main_thread` (`trainer.parts.round_source`): the check then
    runs on the main thread right after a scheduled push, on the last rollout the engine sampled (the producer
    thread cannot run it); synchronously it stays with the rollout after the push. The real-vLLM runs of both are in
    tests/vllm_integration/test_vllm_sync_check.py; here an engine that takes the weights and nothing else."""
    from grpo_trainer.rollout.vllm.backend import VLLMBackend

    class Engine:
        weights_asleep = False

        def load_weights(self, weights):
            return [name for name, _ in weights][:0]  # every weight consumed, none unreached

    def backend():
        made = object.__new__(VLLMBackend)  # no vLLM needed: the engine above, the schedule, the check recorded
        made.engine, made.weights, made.loaded, made.policy = Engine(), None, None, None
        made.schedule, made._check_at_push, made._probe = sync_check.SyncSchedule(1), False, None
        made.checked = []
        made._run_check = lambda model, prompts, out: made.checked.append((model, prompts, out))
        return made

    synchronous = backend()
    synchronous.sync_weights(tiny_model, 1)
    assert synchronous.schedule.due and synchronous.checked == []  # checked by the next rollout instead
    asynchronous = backend()
    asynchronous.sample_off_main_thread()
    asynchronous.sync_weights(tiny_model, 1)  # the first push: no rollout to probe yet
    assert asynchronous.checked == [] and asynchronous.schedule.due
    asynchronous._probe = ("prompts", "rollout")  # what `generate` keeps on the producer thread
    asynchronous.sync_weights(tiny_model, 2)
    assert asynchronous.checked == [(tiny_model, "prompts", "rollout")]


def test_the_check_leaves_torchs_generator_as_it_found_it():
    """The engine draws from torch's generator when it scores the probe: a check that runs in a resumed run but not at
    the same point of the straight one must not change the samples after it (the vLLM matrix's resumed run with
    dynamic sampling differed from the straight run until it did not)."""
    from grpo_trainer.rollout.vllm.backend import VLLMBackend

    backend = object.__new__(VLLMBackend)
    backend.schedule = sync_check.SyncSchedule(1)
    backend._check_sync = lambda model, prompts, out: torch.rand(1000)  # a scoring that consumes the generator
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    backend._run_check(None, None, None)
    assert torch.equal(torch.rand(3), expected) and backend.schedule.checks == 1 and not backend.schedule.due

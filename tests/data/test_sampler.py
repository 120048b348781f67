"""RepeatSampler: which prompt index comes when, and that every process draws the same order."""

import pytest
import torch

from grpo_trainer.data.sampler import RepeatSampler


def test_order_without_shuffle():
    # 5 prompts, G = 2, 2 prompts per round, each round served twice; prompt 4 fills no round and is dropped.
    sampler = RepeatSampler(range(5), mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=False)
    assert list(sampler) == [0, 0, 1, 1, 0, 0, 1, 1,
                             2, 2, 3, 3, 2, 2, 3, 3]
    assert len(sampler) == 16  # (5 // 2) rounds * 2 prompts * G 2 * repeat 2


def test_order_with_shuffle_follows_the_seeded_permutation():
    sampler = RepeatSampler(range(7), mini_repeat_count=3, batch_size=2, repeat_count=1, shuffle=True, seed=42)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(42)).tolist()  # seed + epoch 0
    a, b, c, d, e, f, _ = perm  # 7 prompts -> 3 full rounds of 2; the 7th prompt is dropped
    assert list(sampler) == [a, a, a, b, b, b, c, c, c, d, d, d, e, e, e, f, f, f]
    assert perm != list(range(7))  # the permutation really shuffles (else this test proves nothing)


def test_repeat_counts():
    sampler = RepeatSampler(range(6), mini_repeat_count=4, batch_size=3, repeat_count=2, seed=1)
    indices = list(sampler)
    # every prompt appears G * repeat_count = 8 times, as 2 runs of 4 consecutive copies
    assert sorted(indices) == sorted(list(range(6)) * 8)
    runs = [indices[i:i + 4] for i in range(0, len(indices), 4)]
    assert all(len(set(run)) == 1 for run in runs)
    # each round (3 prompts * G 4 = 12 indices) is served twice in a row
    assert indices[:12] == indices[12:24] and indices[24:36] == indices[36:48]


def test_incomplete_trailing_chunk_is_dropped():
    sampler = RepeatSampler(range(10), mini_repeat_count=1, batch_size=4, shuffle=False)
    assert list(sampler) == list(range(8))  # chunks [0..3], [4..7]; [8, 9] cannot fill a round
    assert len(RepeatSampler(range(3), mini_repeat_count=2, batch_size=4)) == 0
    assert list(RepeatSampler(range(3), mini_repeat_count=2, batch_size=4)) == []


def test_len_matches_iteration():
    for n, g, batch, repeat in [(5, 2, 2, 2), (7, 3, 2, 1), (8, 4, 4, 3), (9, 1, 3, 2), (1, 5, 1, 1)]:
        sampler = RepeatSampler(range(n), mini_repeat_count=g, batch_size=batch, repeat_count=repeat, seed=3)
        assert len(list(sampler)) == len(sampler) == (n // batch) * batch * g * repeat


def test_same_seed_same_order_on_every_process():
    first = RepeatSampler(range(20), mini_repeat_count=2, batch_size=4, repeat_count=2, seed=7)
    second = RepeatSampler(range(20), mini_repeat_count=2, batch_size=4, repeat_count=2, seed=7)
    assert list(first) == list(second)
    assert list(first) == list(first)  # iterating again in the same epoch repeats the order (resume)
    other_seed = RepeatSampler(range(20), mini_repeat_count=2, batch_size=4, repeat_count=2, seed=8)
    assert list(other_seed) != list(first)


def test_set_epoch_changes_the_order_reproducibly():
    sampler = RepeatSampler(range(20), mini_repeat_count=2, batch_size=4, seed=7)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch1 != epoch0 and sorted(epoch1) == sorted(epoch0)
    twin = RepeatSampler(range(20), mini_repeat_count=2, batch_size=4, seed=7)
    twin.set_epoch(1)
    assert list(twin) == epoch1
    sampler.set_epoch(0)
    assert list(sampler) == epoch0


def test_the_first_epoch_is_trls_order_and_later_epochs_reseed_with_seed_plus_epoch():
    """README "Differences from trl.GRPOConfig": TRL 1.16's sampler seeds one generator once and continues it across
    epochs; ours reseeds with `seed + epoch`. Epoch 0 is the same order; epoch 1 is another one."""
    from trl.trainer.utils import RepeatSampler as TRLRepeatSampler

    settings = dict(mini_repeat_count=2, batch_size=4, repeat_count=1, seed=7)
    ours, trl = RepeatSampler(range(20), **settings), TRLRepeatSampler(range(20), **settings)
    assert list(ours) == list(trl)  # epoch 0
    ours.set_epoch(1)
    trl_epoch1, ours_epoch1 = list(trl), list(ours)  # TRL: its generator's second permutation of seed 7
    reseeded = torch.randperm(20, generator=torch.Generator().manual_seed(7 + 1)).tolist()
    assert ours_epoch1 == [index for index in reseeded for _ in range(2)]
    assert ours_epoch1 != trl_epoch1 and sorted(ours_epoch1) == sorted(trl_epoch1)


def test_streaming_eval_is_a_copy_and_leaves_the_arguments_alone(tmp_path):
    """The eval dataloader over a stream is built with no worker processes (each prompt's repeats together); the
    trainer's own arguments keep theirs, and `dispatch_batches=True` is refused by name."""
    from transformers import TrainingArguments

    from grpo_trainer.data.sampler import streaming_eval

    args = TrainingArguments(output_dir=str(tmp_path), dataloader_num_workers=2, report_to="none", use_cpu=True)
    streaming = streaming_eval(args)
    assert streaming.dataloader_num_workers == 0 and args.dataloader_num_workers == 2
    dispatching = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                    accelerator_config={"dispatch_batches": True})
    with pytest.raises(ValueError, match="dispatch_batches=False"):
        streaming_eval(dispatching)

"""The planner's items for the static decode steps (`planning.static_decode`), derived by hand for the small shape
of tests/planning/shapes.py: V 1000, E 64, I 128, H 4, K 2, D 16; B = 4 rows, S 6 + T 10 = L 16, float32."""

import dataclasses

from grpo_trainer.planning import INSTANTS, plan_memory
from grpo_trainer.planning.static_decode import graph_pool_bytes, static_decode_items, with_static_decode
from tests.planning.shapes import SETTINGS, SHAPE, rollout

CUDA = dataclasses.replace(SETTINGS, device="cuda", rollout=rollout("fast"))
ROLLOUT = INSTANTS.index("rollout")


def test_static_buffers_and_graph_pool_by_hand():
    # buffers: logits 4 B x 4 rows x 1000 = 16,000; key mask 4 x (4 x 16) = 256 and rotary tables 4 x (2 x 4 x 10
    # x 16) = 5,120; one layer's gather 4 x (4 x 2 x 16 x 16) = 8,192: 29,568 bytes.
    # pool per row: 4 x (2 x 64 + (4 + 2 x 2) x 16 + 4 x 16 + 3 x 128 + 1000) + 4 x 1000 = 4 x 1,704 + 4,000
    # = 10,816; buckets 1, 2, 4: 7 rows in all -> 75,712 bytes.
    assert graph_pool_bytes(SHAPE, rows=4, columns=16, element_bytes=4) == 75_712
    items = {i.name: i.bytes for i in static_decode_items(CUDA, SHAPE, graphs=True)}
    assert items["static decode buffers"][ROLLOUT] == 29_568
    assert items["CUDA graph pool"][ROLLOUT] == 75_712
    assert all(size == 0 for k, size in enumerate(items["CUDA graph pool"]) if k != ROLLOUT)
    # without graphs, or off CUDA (the step runs eagerly there), no pool
    assert [i.name for i in static_decode_items(CUDA, SHAPE, graphs=False)] == ["static decode buffers"]
    assert [i.name for i in static_decode_items(SETTINGS, SHAPE, graphs=True)] == ["static decode buffers"]


def test_the_plan_with_static_steps_adds_them_at_the_rollout_only():
    plan = plan_memory(CUDA, SHAPE)
    static = with_static_decode(plan, graphs=True)
    added = [a - b for a, b in zip(static.totals(), plan.totals())]
    assert added[ROLLOUT] == 29_568 + 75_712
    assert all(a == 0 for k, a in enumerate(added) if k != ROLLOUT)


def test_a_cuda_run_planned_with_the_static_steps_counts_them(tmp_path, tokenizer, monkeypatch):
    """`trainer.memory.plan_run` on CUDA: by default the fast backend samples with `generate` there (decision 5)
    and no static item appears; with GRPO_TRAINER_FAST_CUDA_DECODE=graphs the rollout is the decoder's, with the buffers
    and the graph pool; with =compact, the buffers only."""
    from grpo_trainer.cli.toy import copy_digits_dataset, make_tiny_model
    from grpo_trainer.config import GRPOConfig
    from grpo_trainer.trainer import memory

    path = tmp_path / "model"
    make_tiny_model(tokenizer, hidden_size=64, num_layers=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=12, report_to="none", bf16=False)
    dataset = copy_digits_dataset(num_prompts=16)

    def names(env):
        if env is None:
            monkeypatch.delenv("GRPO_TRAINER_FAST_CUDA_DECODE", raising=False)
        else:
            monkeypatch.setenv("GRPO_TRAINER_FAST_CUDA_DECODE", env)
        run = memory.plan_run(str(path), args, dataset, tokenizer, device="cuda", with_device=False)
        return {i.name for i in run.plan.items}

    assert not names(None) & {"static decode buffers", "CUDA graph pool"}
    assert {"static decode buffers", "CUDA graph pool"} <= names("graphs")
    compact = names("compact")
    assert "static decode buffers" in compact and "CUDA graph pool" not in compact

"""The planner's items for the static decode steps (`planning.static_decode`), derived by hand for the small shape
of tests/planning/shapes.py: V 1000, E 64, I 128, H 4, K 2, D 16; B = 4 rows, S 6 + T 10 = L 16, float32."""

import dataclasses

from grpo_trainer.planning import INSTANTS, plan_memory
from grpo_trainer.planning.static_decode import graph_pool_bytes, static_decode_bytes
from tests.planning.shapes import SETTINGS, SHAPE, rollout

CUDA = dataclasses.replace(SETTINGS, device="cuda", rollout=rollout("fast"))
GRAPHS = dataclasses.replace(CUDA, rollout=dataclasses.replace(CUDA.rollout, decode_mode="graphs"))
COMPACT = dataclasses.replace(CUDA, rollout=dataclasses.replace(CUDA.rollout, decode_mode="compact"))
ROLLOUT = INSTANTS.index("rollout")


def test_static_buffers_and_graph_pool_by_hand():
    # buffers: logits 4 B x 4 rows x 1000 = 16,000; key mask 4 x (4 x 16) = 256 and rotary tables 4 x (2 x 4 x 10
    # x 16) = 5,120; one layer's gather 4 x (4 x 2 x 16 x 16) = 8,192: 29,568 bytes.
    # pool per row: 4 x (2 x 64 + (4 + 2 x 2) x 16 + 4 x 16 + 3 x 128 + 1000) + 4 x 1000 = 4 x 1,704 + 4,000
    # = 10,816; buckets 1, 2, 4: 7 rows in all -> 75,712 bytes.
    assert graph_pool_bytes(SHAPE, rows=4, columns=16, element_bytes=4) == 75_712
    assert static_decode_bytes(GRAPHS, SHAPE) == (29_568, 75_712)
    # without graphs, or off CUDA (the step runs eagerly there), no pool
    assert static_decode_bytes(COMPACT, SHAPE) == (29_568, 0)
    assert static_decode_bytes(dataclasses.replace(GRAPHS, device="cpu"), SHAPE) == (29_568, 0)


def test_plan_memory_adds_the_static_steps_at_the_rollout_only():
    """Inside `plan_memory` itself, so that fits, the longest-completion search and `grpo-train plan`'s re-plans see
    them too."""
    plan = plan_memory(CUDA, SHAPE)
    for settings, extra in ((GRAPHS, 29_568 + 75_712), (COMPACT, 29_568)):
        static = plan_memory(settings, SHAPE)
        added = [a - b for a, b in zip(static.totals(), plan.totals())]
        assert added[ROLLOUT] == extra
        assert all(a == 0 for k, a in enumerate(added) if k != ROLLOUT)
    assert {"static decode buffers", "CUDA graph pool"} <= {i.name for i in plan_memory(GRAPHS, SHAPE).items}
    other = dataclasses.replace(SHAPE, model_type="gpt2")  # a family the decoder does not serve: generate's rollout
    assert plan_memory(dataclasses.replace(GRAPHS), other).totals() == plan_memory(CUDA, other).totals()


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

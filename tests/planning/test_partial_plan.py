"""The planner's rollout cache under partial rollouts (`rollout.partial`), by hand for the small shape of
tests/planning/shapes.py: 4 rows (2 prompts x G 2), S 6 + T 10 = L 16, 2 layers, 2 key/value heads of 16, float32.
alpha 0.5 decodes ceil(0.5 x 2) = 1 more group (2 rows), and a resumed row's tokens so far join its prompt while
fresh rows still have T to go: S + 2T = 26 columns."""

import dataclasses

from grpo_trainer.planning import INSTANTS, plan_memory
from tests.planning.shapes import SETTINGS, SHAPE

ROLLOUT = INSTANTS.index("rollout")


def test_the_cache_holds_the_extra_groups_rows_and_the_resumed_rows_columns():
    caches = [{i.name: i for i in plan_memory(dataclasses.replace(SETTINGS, partial_alpha=alpha), SHAPE).items}
              ["KV cache"] for alpha in (0.0, 0.5, 1.0)]
    # 2 (k, v) x 2 layers x rows x 2 heads x columns x 16 x 4 B
    assert [c.bytes[ROLLOUT] for c in caches] == [2 * 2 * 4 * 2 * 16 * 16 * 4, 2 * 2 * 6 * 2 * 26 * 16 * 4,
                                                  2 * 2 * 8 * 2 * 26 * 16 * 4]
    assert "partial rollouts" in caches[1].note and "partial rollouts" not in caches[0].note

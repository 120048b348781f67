"""Partial rollouts: a round ends once enough of its groups are complete, and carries the rest into the next round.

A round waits for its longest completion, and completion lengths are heavy-tailed, so its last rows decode alone.
Here a round starts more groups than it trains (`settings.PartialSettings.alpha`), ends as soon as enough groups have
every completion finished (`rollout.types.RoundEnd`, honoured by the fast decoder's plain loop), trains those, and
parks the others with their tokens so far and, per token, the policy version that sampled it (`parking`). The next
round resumes the parked rows first, re-prefilled under the new weights, and `trainer.off_policy` corrects or masks
the tokens an earlier policy sampled. APRIL (arXiv 2509.18521) is the design's source; docs/PARTIAL.md says how to use
it.
"""

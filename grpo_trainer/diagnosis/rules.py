"""One pure function per diagnosis: a log step's metrics (and the previous log steps') in, `Reading`s out.

Decisions:

1. A rule reads only what a log step carries under TRL's metric names (plus `diagnosis.signals`' three), so the same
   rules run live on the trainer's log dicts and afterwards on a `metrics.jsonl` or a TRL `trainer_state.json`.
2. A rule says, per subject (a reward function, or the run), whether its condition holds (`on`), is gone past the
   hysteresis band (`off`), or sits in the band (`hold`); the monitor turns that into onset and clearing. A metric
   that a log step does not carry gives no reading.
3. Each condition asks for evidence that it costs the run something, where the symptom alone is also what a healthy
   run shows: completions cut at a budget that fits the answer exactly (the demo), a near-deterministic policy whose
   groups still differ, a spike that the gradient clip holds. The thresholds and their reasons: docs/HEALTH.md.
4. The finding names the metric, its value, the threshold, the likely cause and the fix as the config fields to
   change, with their values where the run's settings are known (`RunFacts`).
5. A run that has learned its task (`learned`: the reward rose well above its start and stays at its best) is
   expected to have groups of equal rewards (all at the best), a constant reward and a near-deterministic policy:
   those three conditions are not diagnosed then. A reward that never moved, or fell, is not a learned task.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from grpo_trainer.diagnosis.settings import HealthSettings, RunFacts
from grpo_trainer.diagnosis.signals import CLIPPED_REWARD_GAP, missing_key

__all__ = ["Finding", "Past", "RULES", "Reading", "TITLES", "learned", "number", "reward_names"]

State = Literal["on", "off", "hold"]
CLIPPED, ZERO_STD, REWARD_STD = "completions/clipped_ratio", "frac_reward_zero_std", "reward_std"
CLIP_METRICS = ("clip_ratio/region_mean", "cispo_clip_ratio")
ESS_PREFIXES = ("sampling/importance_sampling", "async/importance_ratio")


@dataclass(frozen=True)
class Finding:
    """What one reading measured, and what it means."""

    diagnosis: str
    subject: str | None  # a reward function's name, or None for the run
    metric: str
    value: float
    threshold: float
    above: bool  # the condition is value >= threshold (else value <= threshold)
    evidence: str
    cause: str
    fix: str


@dataclass(frozen=True)
class Reading:
    state: State
    finding: Finding
    event: bool = False  # diagnosed at its first log step (a spike, a non-finite step), not after `patience`

    @property
    def key(self) -> str:
        f = self.finding
        return f.diagnosis if f.subject is None else f"{f.diagnosis}:{f.subject}"


Rows = Sequence[Mapping[str, Any]]  # log steps, oldest first


@dataclass(frozen=True)
class Past:
    """What a rule knows of the log steps before this one: the last few (`rows`, what the trends need) and the
    combined reward's course over the whole run (decision 5)."""

    rows: Rows = ()
    first_reward: float | None = None
    first_reward_std: float | None = None
    best_reward: float | None = None
    worst_reward: float | None = None

    def after(self, row: Mapping[str, Any], keep: int) -> Past:
        """The past as the next log step sees it, `row` included (the last `keep` rows)."""
        reward, rows = number(row, "reward"), (*self.rows, row)[-keep:]
        if reward is None:
            return dataclasses.replace(self, rows=rows)
        first = self.first_reward is None
        return Past(rows, reward if first else self.first_reward,
                    number(row, REWARD_STD) if first else self.first_reward_std,
                    reward if first else max(self.best_reward, reward),
                    reward if first else min(self.worst_reward, reward))


Rule = Callable[[Mapping[str, Any], Past, HealthSettings, RunFacts], list[Reading]]


def number(row: Mapping[str, Any], key: str) -> float | None:
    """`row[key]` as a finite float; None when absent, None (a window with no value) or not finite."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def reward_names(row: Mapping[str, Any], facts: RunFacts) -> list[str]:
    """The reward functions: the run's, else those the row logs `rewards/<name>/mean` for."""
    if facts.reward_names:
        return list(facts.reward_names)
    return [m.group(1) for key in row if (m := re.fullmatch(r"rewards/(.+)/mean", key))]


def _level(value: float, threshold: float, hysteresis: float, above: bool) -> State:
    if above:
        return "on" if value >= threshold else "off" if value < threshold * hysteresis else "hold"
    return "on" if value <= threshold else "off" if value > threshold / hysteresis else "hold"


def _latest(row: Mapping[str, Any], history: Rows, key: str) -> float | None:
    """`key`'s value in this log step, else in the latest one that carried it (round metrics are logged only on the
    steps that generated a round)."""
    for candidate in (row, *reversed(history)):
        if (value := number(candidate, key)) is not None:
            return value
    return None


def learned(row: Mapping[str, Any], past: Past, s: HealthSettings) -> bool:
    """Whether the task looks learned at this log step (decision 5): the combined reward (this step's, else the
    latest) sits within `learned_margin` of the range it has covered from its best, and has risen since the first log
    step by `learned_rise` x its spread over the round (now or at the first log step, the larger). A policy stuck on
    one completion per prompt, right on some prompts and wrong on others, keeps a wide spread: not learned."""
    reward, spread = _latest(row, past.rows, "reward"), _latest(row, past.rows, REWARD_STD)
    if reward is None or past.first_reward is None:
        return False
    best, worst = max(past.best_reward, reward), min(past.worst_reward, reward)
    noise = max(spread or 0.0, past.first_reward_std or 0.0, 1e-12)
    return reward - past.first_reward >= s.learned_rise * noise and reward >= best - s.learned_margin * (best - worst)


def _field(name: str, value: Any) -> str:
    return name if value is None else f"{name}={value}"


# ------------------------------------------------------------------------------------------------ the rules


def truncation(row, past: Past, s: HealthSettings, facts: RunFacts) -> list[Reading]:
    clipped = number(row, CLIPPED)
    gap, spread, zero = number(row, CLIPPED_REWARD_GAP), number(row, REWARD_STD), number(row, ZERO_STD)
    if clipped is None or (gap is None and zero is None):
        return []
    costly = gap is not None and gap > s.truncation_gap * max(spread or 0.0, 1e-12)
    silent = zero is not None and zero >= s.zero_variance_fraction and not learned(row, past, s)
    budget = _field("max_completion_length", facts.max_completion_length)
    evidence = f"{clipped:.0%} of the completions end at {budget} without EOS, " + (
        f"scoring {gap:.3g} below the finished ones ({CLIPPED_REWARD_GAP})" if costly else
        f"and {zero:.0%} of all completions are in groups whose rewards are all equal ({ZERO_STD})")
    finding = Finding("truncation", None, CLIPPED, clipped, s.truncated_fraction, True, evidence,
                      f"the completions run past {budget}: the answers need more tokens, or the policy has not "
                      "learned to stop; a cut completion has no ending, so it scores low or the same as the others",
                      "raise max_completion_length if the answers need more; else reward stopping (a length penalty "
                      "such as the soft_overlong reward) or leave cut completions out of the loss "
                      "(mask_truncated_completions=True)")
    state = _level(clipped, s.truncated_fraction, s.hysteresis, True) if costly or silent else "off"
    return [Reading(state, finding)]


def _zero_variance_cause(row, past: Past, s: HealthSettings, facts: RunFacts) -> str:
    clipped, entropy = _latest(row, past.rows, CLIPPED), _latest(row, past.rows, "entropy")
    if clipped is not None and clipped >= s.truncated_fraction:
        return (f"{clipped:.0%} of the completions are cut at "
                f"{_field('max_completion_length', facts.max_completion_length)}, so they score alike")
    if entropy is not None and entropy <= s.entropy_floor:
        return f"the policy samples nearly the same completion every time (entropy {entropy:.3g})"
    if (spread := number(row, REWARD_STD)) is not None and spread <= s.saturated_std:
        return "every completion gets the same reward (see the saturated reward)"
    return (f"the reward is too sparse for {_field('num_generations', facts.num_generations)}: all completions of "
            "a prompt fail (or all succeed)")


def zero_variance(row, past: Past, s: HealthSettings, facts: RunFacts) -> list[Reading]:
    zero = number(row, ZERO_STD)
    if zero is None:
        return []
    if facts.zero_variance_groups == "resample":
        fix = "raise max_resample_rounds or num_generations, or make the reward denser (partial credit)"
    else:
        fix = (f"raise {_field('num_generations', facts.num_generations)}, make the reward denser (partial credit), "
               "or set zero_variance_groups='resample' (extra prompts until the groups differ) or 'skip' (no "
               "compute spent on them)")
    finding = Finding("zero_variance", None, ZERO_STD, zero, s.zero_variance_fraction, True,
                      f"{zero:.0%} of the completions are in groups whose rewards are all equal: their advantage is 0 "
                      "and they teach nothing", _zero_variance_cause(row, past, s, facts), fix)
    state = "off" if learned(row, past, s) else _level(zero, s.zero_variance_fraction, s.hysteresis, True)
    return [Reading(state, finding)]


def reward_saturated(row, past: Past, s: HealthSettings, facts: RunFacts) -> list[Reading]:
    readings = []
    for name in reward_names(row, facts):
        key = f"rewards/{name}/std"
        spread, mean = number(row, key), number(row, f"rewards/{name}/mean")
        if spread is None or mean is None:
            continue
        limit = s.saturated_std * max(1.0, abs(mean))
        seen = [v for r in past.rows if (v := number(r, f"rewards/{name}/mean")) is not None]
        where = "" if not seen else ", the only value it gave in this run" if min(seen) == max(seen) == mean \
            else ", its highest in this run" if mean >= max(seen) else ", its lowest in this run" if mean <= min(seen) \
            else ""
        finding = Finding("reward_saturated", name, key, spread, limit, False,
                          f"every completion gets the same {name} reward ({mean:.3g}{where})",
                          "the task is solved (every completion at the best value) or never solved (at the worst), "
                          f"or {name} does not depend on the completion",
                          f"harder prompts when solved, easier ones or partial credit when never solved; check that "
                          f"{name} scores different completions differently, else drop it from reward_funcs")
        state = "on" if spread <= limit else "off" if spread > limit / s.hysteresis else "hold"
        readings.append(Reading("off" if learned(row, past, s) else state, finding))
    return readings


def reward_missing(row, past: Past, s: HealthSettings, facts: RunFacts) -> list[Reading]:
    readings = []
    for name in reward_names(row, facts):
        missing = number(row, missing_key(name))
        if missing is None and f"rewards/{name}/mean" in row and number(row, "reward") is not None:
            missing = 1.0 if number(row, f"rewards/{name}/mean") is None else None  # TRL logs no share: all or none
        if missing is None:
            continue
        policy = " (reward_error_policy='none' turns its errors into missing rewards)" \
            if facts.reward_error_policy == "none" else ""
        finding = Finding("reward_missing", name, missing_key(name), missing, s.missing_fraction, True,
                          f"{name} returned None or failed for {missing:.0%} of the completions{policy}",
                          f"{name} raises or returns None on most inputs: those completions are scored by the other "
                          "functions only, or left out of the advantages when none scores them",
                          f"fix {name} (call it on a few logged completions by hand); if it applies to some prompts "
                          "only (None: not applicable), this is expected: raise health_thresholds' missing_fraction")
        readings.append(Reading(_level(missing, s.missing_fraction, s.hysteresis, True), finding))
    return readings


def reward_dominance(row, past: Past, s: HealthSettings, facts: RunFacts) -> list[Reading]:
    names = reward_names(row, facts)
    spreads = {n: v for n in names if (v := number(row, f"rewards/{n}/std")) is not None}
    weights = {n: facts.weight(n) for n in spreads}
    if len(spreads) < 2 or len({abs(w) for w in weights.values()}) < 2:
        return []  # one function, or equal weights: no weight makes one dominate
    normalised = facts.multi_objective_aggregation == "normalize_then_sum"  # each function scaled within its group
    say = {n: abs(weights[n]) * (float(spreads[n] > 0) if normalised else spreads[n]) for n in spreads}
    total = sum(say.values())
    if total <= 0 or sum(v > 0 for v in spreads.values()) < 2:
        return []
    top = max(say, key=say.get)
    share = say[top] / total
    others = ", ".join(f"{n} (weight {weights[n]:g}) {say[n] / total:.0%}" for n in say if n != top)
    balanced = ", ".join(f"{n}: {1 / v:.3g}" for n, v in spreads.items() if v > 0)
    finding = Finding("reward_dominance", top, f"rewards/{top}/std", share, s.dominant_share, True,
                      f"{top} (weight {weights[top]:g}) carries {share:.0%} of the weighted reward spread (|weight| x "
                      f"rewards/<f>/std); {others}",
                      f"reward_weights={[weights[n] for n in spreads]} make {top}'s differences decide the advantage: "
                      "the other functions hardly change which completions are reinforced",
                      f"rebalance reward_weights (1 / std gives each function an equal say: {balanced})")
    return [Reading(_level(share, s.dominant_share, s.hysteresis, True), finding)]


def entropy_collapse(row, past: Past, s: HealthSettings, facts: RunFacts) -> list[Reading]:
    entropy, zero = number(row, "entropy"), _latest(row, past.rows, ZERO_STD)
    if entropy is None:
        return []
    finding = Finding("entropy_collapse", None, "entropy", entropy, s.entropy_floor, False,
                      f"the policy's entropy is {entropy:.3g} nats per token" + (
                          f" and {zero:.0%} of the completions are in groups of equal rewards" if zero is not None
                          else ""),
                      "the policy samples nearly the same completion every time: it stopped exploring "
                      f"({_field('learning_rate', facts.learning_rate)} too high, or a clip that lets probable tokens "
                      "grow but not improbable ones)",
                      "lower learning_rate; raise epsilon_high (clip-higher, e.g. 0.28); add an entropy bonus "
                      "(entropy_coef, or use_adaptive_entropy=True); or raise temperature")
    if learned(row, past, s):  # a near-deterministic policy on a learned task is the goal
        state: State = "off"
    elif zero is not None and zero < s.zero_variance_fraction:  # the groups still differ: not (yet) costly
        state = "off" if zero < s.zero_variance_fraction * s.hysteresis else "hold"
    else:
        state = _level(entropy, s.entropy_floor, s.hysteresis, False)
    return [Reading(state, finding)]


def kl_growth(row, past: Past, s: HealthSettings, facts: RunFacts) -> list[Reading]:
    if number(row, "kl") is None:
        return []
    points = [(r["step"], v) for r in (*past.rows, row) if (v := number(r, "kl")) is not None and "step" in r]
    w = s.trend_window
    if len(points) < 2 * w:
        return []
    before, last = points[-2 * w:-w], points[-w:]
    kl_before, kl_last = statistics.fmean(v for _, v in before), statistics.fmean(v for _, v in last)
    steps = statistics.fmean(t for t, _ in last) - statistics.fmean(t for t, _ in before)
    rate = (kl_last - kl_before) / steps if steps > 0 else 0.0
    factor = kl_last / kl_before if kl_before > 0 else math.inf
    finding = Finding("kl_growth", None, "kl", rate, s.kl_growth_per_step, True,
                      f"kl rose from {kl_before:.3g} to {kl_last:.3g} nats per token (means of {w} log steps) over "
                      f"{steps:.0f} steps: x{factor:.3g}, {rate:.3g} per step",
                      "updates too large for the KL term to hold the policy near the reference "
                      f"({_field('learning_rate', facts.learning_rate)}, {_field('beta', facts.beta)})",
                      "lower learning_rate; raise beta; or fewer optimisation passes per round (num_iterations)")
    if factor >= s.kl_growth_factor and rate >= s.kl_growth_per_step:
        state: State = "on"
    elif factor < 1 + (s.kl_growth_factor - 1) * s.hysteresis or rate < s.kl_growth_per_step * s.hysteresis:
        state = "off"
    else:
        state = "hold"
    return [Reading(state, finding)]


def clipping(row, past: Past, s: HealthSettings, facts: RunFacts) -> list[Reading]:
    metric = next((key for key in CLIP_METRICS if number(row, key) is not None), None)
    if metric is None:
        return []
    value = number(row, metric)
    finding = Finding("clipping", None, metric, value, s.clipped_fraction, True,
                      f"the clip holds {value:.0%} of the tokens' probability ratios",
                      "each round moves the policy further than the trust region allows "
                      f"({_field('learning_rate', facts.learning_rate)} too large for the batch, or many passes "
                      f"over one round: {_field('num_iterations', facts.num_iterations)}, steps_per_generation)",
                      "lower learning_rate; fewer optimisation passes per round (num_iterations, "
                      f"steps_per_generation); a larger {_field('epsilon', facts.epsilon)} only if the policy is meant "
                      "to move that far")
    return [Reading(_level(value, s.clipped_fraction, s.hysteresis, True), finding)]


_ESS_CAUSES = {
    "sampling/importance_sampling": (
        "the sampler's log-probs disagree with the trainer's: other weights (an inference engine out of sync, or "
        "rounds sampled async_rollouts steps ahead), another dtype, or other sampling settings",
        "sampling_mismatch_report=True names the cause; keep vllm_sync_check_interval > 0; a *_truncate "
        "vllm_importance_sampling_mode bounds the weights instead of zeroing them"),
    "async/importance_ratio": (
        "rounds sampled too many steps ahead (async_rollouts) for how fast the policy moves",
        "lower async_rollouts or learning_rate; or async_correction='behaviour'"),
}


def ess_collapse(row, past: Past, s: HealthSettings, facts: RunFacts) -> list[Reading]:
    readings = []
    for prefix in ESS_PREFIXES:
        value = number(row, f"{prefix}_ess_fraction")
        if value is None:
            continue
        cause, fix = _ESS_CAUSES[prefix]
        finding = Finding("ess_collapse", prefix, f"{prefix}_ess_fraction", value, s.ess_fraction, False,
                          f"the importance weights' effective sample size, (sum w)^2 / sum w^2, is {value:.0%} of the "
                          "tokens: a few tokens carry the update", cause, fix)
        readings.append(Reading(_level(value, s.ess_fraction, s.hysteresis, False), finding))
    return readings


def grad_spike(row, past: Past, s: HealthSettings, facts: RunFacts) -> list[Reading]:
    norm = number(row, "grad_norm")
    before = [v for r in past.rows if (v := number(r, "grad_norm")) is not None][-3 * s.trend_window:]
    if norm is None or len(before) < s.trend_window:
        return []
    median = statistics.median(before)
    clip = 1.0 if facts.max_grad_norm is None else facts.max_grad_norm  # TrainingArguments' default
    limit = s.grad_spike_factor * max(median, clip if clip > 0 else 0.0)
    finding = Finding("grad_spike", None, "grad_norm", norm, limit, True,
                      f"grad_norm {norm:.3g} is {norm / max(median, 1e-30):.3g}x the median of the previous "
                      f"{len(before)} log steps ({median:.3g})" + (f" and {norm / clip:.3g}x max_grad_norm={clip:g}"
                                                                   if clip > 0 else ""),
                      "one batch with outlier advantages or tokens (huge or unscaled rewards: scale_rewards='none'), "
                      f"or {_field('learning_rate', facts.learning_rate)} at the edge of stability",
                      "keep max_grad_norm set; look for outlier rewards in that step's completions; lower "
                      "learning_rate")
    return [Reading("on" if norm >= limit else "off", finding, event=True)]


def nonfinite(row, past: Past, s: HealthSettings, facts: RunFacts) -> list[Reading]:
    count = number(row, "nonfinite_steps")
    if count is None:
        return []
    finding = Finding("nonfinite", None, "nonfinite_steps", count, s.nonfinite_steps, True,
                      f"{count:g} micro-steps had a non-finite loss or gradient and were dropped",
                      "overflowing values: huge or infinite rewards, fp16 overflow, or "
                      f"{_field('learning_rate', facts.learning_rate)} too high",
                      "check the rewards for huge values; lower learning_rate; bf16 instead of fp16; keep "
                      "max_grad_norm set (the run stops after max_nonfinite_steps in a row)")
    return [Reading("on" if count >= s.nonfinite_steps else "off", finding, event=True)]


# name -> (rule, a title for the messages); the order of the summary and of docs/HEALTH.md
RULES: dict[str, Rule] = {
    "truncation": truncation, "zero_variance": zero_variance, "reward_saturated": reward_saturated,
    "reward_missing": reward_missing, "reward_dominance": reward_dominance, "entropy_collapse": entropy_collapse,
    "kl_growth": kl_growth, "clipping": clipping, "ess_collapse": ess_collapse, "grad_spike": grad_spike,
    "nonfinite": nonfinite,
}
TITLES: dict[str, str] = {
    "truncation": "completions cut at max_completion_length",
    "zero_variance": "groups with equal rewards (no gradient)",
    "reward_saturated": "a reward function gives every completion the same score",
    "reward_missing": "a reward function returns None or fails for most completions",
    "reward_dominance": "one reward function dominates through reward_weights",
    "entropy_collapse": "entropy collapse",
    "kl_growth": "KL to the reference growing without bound",
    "clipping": "most probability ratios clipped",
    "ess_collapse": "importance weights' effective sample size collapsed",
    "grad_spike": "gradient norm spike",
    "nonfinite": "non-finite steps",
}

"""The sampler/trainer mismatch report in real tiny runs, each cause injected on CPU without vLLM: an engine whose
weights are never synced, an engine computing in bfloat16 against the float32 trainer, and the fast decoder with
top_k while the trainer scores the full softmax. The fast decoder itself (its own kernels) against the model's
forward is the control: it agrees, and nothing is flagged."""

import copy
import dataclasses
import json
import logging

import pytest
import torch

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.rewards.library import copy_digits_reward
from grpo_trainer.rollout.backend import BACKENDS, Capabilities, RolloutBackend, register_backend
from grpo_trainer.rollout.fast.backend import FastBackend
from grpo_trainer.rollout.types import SamplerRecord

LOGGER = "grpo_trainer.trainer.grpo_trainer"


class _CopyEngine(RolloutBackend):
    """An inference engine with its own copy of the weights in `dtype`, sampling with the fast decoder on it and
    returning only its own log-probs (as vLLM does); `sync`: whether new weights are loaded when they change."""

    capabilities = Capabilities(engine_logps=True, own_weights=True)
    dtype, sync = torch.float32, True

    def __init__(self):
        self.copy, self.loaded = None, None

    def sync_weights(self, model, version):
        if self.copy is None or (self.sync and version != self.loaded):
            self.copy, self.loaded = copy.deepcopy(model).to(self.dtype), version

    def generate(self, model, prompts, config, capture=None):
        out = FastBackend().generate(self.copy, prompts, config)
        return dataclasses.replace(out, sampler=SamplerRecord("engine", logps=out.sampler.logps.float()))

    def sampler_dtype(self, model):
        return self.dtype


class _StaleEngine(_CopyEngine):
    sync = False


class _Bf16Engine(_CopyEngine):
    dtype = torch.bfloat16


@pytest.fixture
def engines():
    names = {"stale_engine": _StaleEngine, "bf16_engine": _Bf16Engine, "synced_engine": _CopyEngine}
    for name, cls in names.items():
        register_backend(name)(type(name, (cls,), {}))
    yield
    for name in names:
        del BACKENDS[name]


def _train(tmp_path, tokenizer, dataset, caplog, **overrides):
    settings = {"output_dir": str(tmp_path), "per_device_train_batch_size": 8, "num_generations": 4,
                "max_completion_length": 6, "report_to": "none", "save_strategy": "no", "seed": 0, "max_steps": 3,
                "logging_steps": 1, "learning_rate": 0.05, "sampling_mismatch_report": True,
                "sampling_mismatch_threshold": 2e-3, "disable_tqdm": True, **overrides}
    trainer = GRPOTrainer(make_tiny_model(tokenizer, seed=2), copy_digits_reward, args=GRPOConfig(**settings),
                          train_dataset=dataset, processing_class=tokenizer)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train()
    reports = [json.loads(path.read_text()) for path in sorted((tmp_path / "sampling_mismatch").glob("*.json"))]
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return trainer, reports, logs


def test_weights_not_synced_are_named_stale_weights(tmp_path, tokenizer, toy_dataset, caplog, engines):
    _, reports, logs = _train(tmp_path, tokenizer, toy_dataset, caplog, generation_backend="stale_engine")
    assert [r["step"] for r in reports] == [0, 1, 2]
    # the first round's weights are the trainer's: the engine agrees (float32 kernels); after updates it does not
    assert reports[0]["mean_abs_difference"] < 1e-4 and reports[0]["cause"] == "kernel difference"
    assert reports[2]["mean_abs_difference"] > 2e-3 and reports[2]["cause"] == "stale weights"
    assert "Likely cause: stale weights" in caplog.text
    assert logs[2]["sampling/sampling_logp_difference/mean"] == pytest.approx(reports[2]["mean_abs_difference"])


def test_a_synced_engine_is_not_flagged(tmp_path, tokenizer, toy_dataset, caplog, engines):
    _, reports, logs = _train(tmp_path, tokenizer, toy_dataset, caplog, generation_backend="synced_engine")
    assert all(r["mean_abs_difference"] < 1e-4 and r["cause"] == "kernel difference" for r in reports)
    assert "Likely cause" not in caplog.text
    assert all(e["sampling/sampling_logp_difference/max"] < 1e-3 for e in logs)


def test_a_bfloat16_engine_against_a_float32_trainer_is_named_dtype(tmp_path, tokenizer, toy_dataset, caplog,
                                                                   engines):
    _, reports, logs = _train(tmp_path, tokenizer, toy_dataset, caplog, generation_backend="bf16_engine",
                              sampling_mismatch_threshold=5e-4)
    # bfloat16 rounding from the first round on: 1000x what the float32 engine shows (< 1e-7 there)
    assert reports[0]["mean_abs_difference"] > 1e-4
    assert all(r["cause"] == "dtype" for r in reports)
    assert "Likely cause: dtype: the sampler computes in torch.bfloat16 and the trainer in torch.float32" in \
        caplog.text


def test_top_k_without_the_mask_is_named_truncated_support(tmp_path, tokenizer, toy_dataset, caplog):
    """The fast decoder samples with top_k = 5; the trainer scores the full softmax (keep_sampling_mask=False): the
    difference is the cut mass, on every token. With the mask the same run agrees."""
    _, reports, logs = _train(tmp_path / "off", tokenizer, toy_dataset, caplog, top_k=5, keep_sampling_mask=False)
    assert all(r["cause"] == "truncated support" for r in reports)
    assert "Likely cause: truncated support" in caplog.text and "set keep_sampling_mask=True" in caplog.text
    for entry in logs:  # the difference is the cut mass: -log p(kept) on every token
        assert entry["sampling/sampling_logp_difference/mean"] == pytest.approx(
            -entry["sampling/log_kept_mass/mean"], rel=0.05)
    caplog.clear()
    _, reports, _ = _train(tmp_path / "on", tokenizer, toy_dataset, caplog, top_k=5)
    assert all(r["mean_abs_difference"] < 1e-4 for r in reports)
    assert "Likely cause" not in caplog.text


def test_the_report_by_position_by_token_and_in_the_completions_table(tmp_path, tokenizer, toy_dataset, caplog,
                                                                      engines):
    trainer, reports, logs = _train(tmp_path, tokenizer, toy_dataset, caplog, generation_backend="bf16_engine",
                                    log_completions=True, max_steps=1)
    report = reports[0]
    assert len(report["worst_tokens"]) == 10
    sizes = [abs(w["delta"]) for w in report["worst_tokens"]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == pytest.approx(
        logs[0]["sampling/sampling_logp_difference/max"])
    assert all({"token", "context", "position", "row"} <= w.keys() for w in report["worst_tokens"])
    assert report["by_token"] and all(t["count"] >= 1 for t in report["by_token"])
    # 6 completion tokens at most: one position bucket, whose mean is the overall mean
    assert logs[0]["sampling/sampling_logp_difference/position_0-15/mean"] == pytest.approx(
        logs[0]["sampling/sampling_logp_difference/mean"])
    assert logs[0]["sampling/sampling_logp_difference/p50"] <= logs[0]["sampling/sampling_logp_difference/p99"]
    extra = trainer._logs["extra"]
    assert len(extra["logp_difference_mean"]) == 8 and all(v is not None for v in extra["logp_difference_max"])
    assert max(extra["logp_difference_max"]) == pytest.approx(logs[0]["sampling/sampling_logp_difference/max"])


def test_a_round_reported_without_the_option_logs_metrics_but_writes_no_file(tmp_path, tokenizer, toy_dataset):
    """What an engine correction's round gets without `sampling_mismatch_report` (the report called as the correction
    calls it): the metrics, the completions-table columns, no file."""
    trainer = GRPOTrainer(make_tiny_model(tokenizer, seed=2), copy_digits_reward, processing_class=tokenizer,
                          args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                                          max_completion_length=6, report_to="none", save_strategy="no"),
                          train_dataset=toy_dataset)
    round_ = trainer._generate_and_score([toy_dataset[i // 4] for i in range(8)], "train")
    trainer._metrics["train"].clear()
    columns = trainer.corrections.mismatch.report(round_, round_.sampler.logps + 0.1, None, 0, torch.float32, False)
    assert trainer._metrics["train"]["sampling/sampling_logp_difference/mean"][0] == pytest.approx(0.1, abs=1e-6)
    assert len(columns["logp_difference_mean"]) == 8
    assert not (tmp_path / "sampling_mismatch").exists()


def test_asynchronous_rounds_are_reported_against_the_weights_that_sampled_them(tmp_path, tokenizer, toy_dataset,
                                                                               caplog):
    """async_rollouts=1 with the fast decoder: each round is compared with the trainer's log-probs at the weights
    that sampled it (its producer job computes them). The decoder agrees with the model's forward there on every
    round, also on those trained a step after they were sampled, whose drift from the training weights the
    'recompute' correction measures well above that (`async/importance_ratio_raw_*`). A file per sampling step."""
    _, reports, logs = _train(tmp_path, tokenizer, toy_dataset, caplog, async_rollouts=1, max_steps=4,
                              async_correction="recompute")
    # rounds 0 and 1 are sampled with the first weights (step 0), rounds 2 and 3 after steps 1 and 2
    assert [r["step"] for r in reports] == [0, 1, 2]
    assert all(r["mean_abs_difference"] < 1e-4 and r["cause"] == "kernel difference" for r in reports)
    assert "Likely cause" not in caplog.text
    assert len(logs) == 4 and all(e["sampling/sampling_logp_difference/p99"] < 1e-3 for e in logs)
    stale = [e for e in logs if e["async/staleness"] > 0]
    assert stale and all(max(e["async/importance_ratio_raw_max"] - 1, 1 - e["async/importance_ratio_raw_min"]) > 1e-2
                         for e in stale)


def test_the_report_is_refused_for_an_engines_rounds_sampled_ahead(tmp_path, tokenizer, toy_dataset, engines):
    with pytest.raises(ValueError, match="sampling_mismatch_report compares the sampler's log-probs"):
        GRPOTrainer(make_tiny_model(tokenizer, seed=2), copy_digits_reward, processing_class=tokenizer,
                    args=GRPOConfig(output_dir=str(tmp_path), generation_backend="synced_engine", async_rollouts=1,
                                    sampling_mismatch_report=True, report_to="none"),
                    train_dataset=toy_dataset)

"""`GRPOConfig.health_checks` and `health_thresholds` (docs/HEALTH.md): each wrong value fails when the config is
built, naming the field and the fix; a JSON string from the command line or a YAML file is a dict."""

import pytest

from grpo_trainer import GRPOConfig
from grpo_trainer.cli import command as cli
from grpo_trainer.diagnosis.settings import HealthSettings

BASE = dict(output_dir="unused", per_device_train_batch_size=4, num_generations=2, report_to="none")


@pytest.mark.parametrize("overrides, message", [
    ({"health_checks": "yes"}, "health_checks must be True or False (got 'yes'); False turns the training-health"),
    ({"health_thresholds": {"truncated": 0.5}}, "health_thresholds has an unknown threshold 'truncated'; choose from "
                                                "['patience', 'recovery'"),
    ({"health_thresholds": {"truncated_fraction": 2}}, "health_thresholds['truncated_fraction'] must be in (0, 1] "
                                                       "(got 2)"),
    ({"health_thresholds": {"patience": 1.5}}, "health_thresholds['patience'] must be a whole number >= 1 (got 1.5)"),
    ({"health_thresholds": {"grad_spike_factor": -1}}, "health_thresholds['grad_spike_factor'] must be >= 0 (got -1)"),
    ({"health_thresholds": {"kl_growth_factor": None}}, "health_thresholds['kl_growth_factor'] must be a finite "
                                                        "number (got None)"),
])
def test_wrong_health_settings_name_the_field(overrides, message):
    with pytest.raises(ValueError) as error:
        GRPOConfig(**{**BASE, **overrides})
    assert message in str(error.value)


def test_health_settings_from_the_command_line():
    _, config = cli.parse_args(["--demo", "--health_thresholds", '{"truncated_fraction": 0.8, "patience": 3}',
                                "--health_checks", "false"])
    assert config.health_thresholds == {"truncated_fraction": 0.8, "patience": 3} and config.health_checks is False
    settings = HealthSettings.of(config.health_thresholds)
    assert (settings.truncated_fraction, settings.patience, settings.recovery) == (0.8, 3, HealthSettings.recovery)
    assert GRPOConfig(**BASE).health_checks is True and GRPOConfig(**BASE).health_thresholds is None


def test_a_health_thresholds_string_that_is_not_json():
    with pytest.raises(ValueError, match="health_thresholds is not a JSON dict"):
        GRPOConfig(**BASE, health_thresholds="{truncated_fraction: 0.8}")

"""Advantage estimators against hand-derived numbers (the behaviour of twinkle 0.5.1's `twinkle/advantage/`) and
their algebraic properties.

The running example: rewards [0,1,0,1, 1,0,0,0], G = 4, so two groups.
    group 0 = [0,1,0,1]: mean 0.5,  sample std sqrt(((.5^2) * 4) / 3) = sqrt(1/3) = 0.577350
    group 1 = [1,0,0,0]: mean 0.25, sample std sqrt((.75^2 + 3 * .25^2) / 3) = sqrt(.75 / 3) = 0.5
    batch:               mean 3/8 = 0.375, sample std sqrt((3 * .625^2 + 5 * .375^2) / 7) = sqrt(15/56) = 0.517549
"""

import math

import pytest
import torch

from grpo_trainer.algorithms import advantage
from grpo_trainer.algorithms.advantage import (
    Advantage,
    DrGRPOAdvantage,
    GRPOAdvantage,
    ReinforcePlusPlusBaselineAdvantage,
    RLOOAdvantage,
    as_reward_vector,
    get_advantage_estimator,
    group_std,
    register_advantage,
)
from tests.algorithms.numeric import ATOL, close

REWARDS = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
S_GROUP0 = math.sqrt(1 / 3)  # 0.577350
S_BATCH = math.sqrt(15 / 56)  # 0.517549

# Centred values: r - group mean = [0-.5, 1-.5, ...], [1-.25, 0-.25, ...].
CENTRED = [-0.5, 0.5, -0.5, 0.5, 0.75, -0.25, -0.25, -0.25]
TABLE = {
    ("grpo", "none"): CENTRED,
    # group 0: +-0.5 / sqrt(1/3) = +-sqrt(3)/2 = +-0.866025; group 1: 0.75 / 0.5 = 1.5, -0.25 / 0.5 = -0.5
    ("grpo", "group"): [-0.866025, 0.866025, -0.866025, 0.866025, 1.5, -0.5, -0.5, -0.5],
    # every centred value / 0.517549: 0.5 -> 0.966092, 0.75 -> 1.449138, 0.25 -> 0.483046
    ("grpo", "batch"): [-0.966092, 0.966092, -0.966092, 0.966092, 1.449138, -0.483046, -0.483046, -0.483046],
    # RLOO: r_i - mean of the other 3 = 4/3 * (r_i - mean): 0.5 * 4/3 = 0.666667, 0.75 * 4/3 = 1, 0.25 * 4/3 = 1/3
    ("rloo", "none"): [-0.666667, 0.666667, -0.666667, 0.666667, 1.0, -0.333333, -0.333333, -0.333333],
    # the same divided by the raw group std: 0.666667 / 0.577350 = 1.154701; 1 / 0.5 = 2; 0.333333 / 0.5 = 0.666667
    ("rloo", "group"): [-1.154701, 1.154701, -1.154701, 1.154701, 2.0, -0.666667, -0.666667, -0.666667],
    # / 0.517549: 0.666667 -> 1.288122, 1 -> 1.932184, 0.333333 -> 0.644061
    ("rloo", "batch"): [-1.288122, 1.288122, -1.288122, 1.288122, 1.932184, -0.644061, -0.644061, -0.644061],
}
CLASSES = {"grpo": GRPOAdvantage, "rloo": RLOOAdvantage}




@pytest.fixture
def clean_registry():
    """Registering estimators mutates a module-level dict; restore it so tests stay independent."""
    saved = dict(advantage.ADVANTAGE_ESTIMATORS)
    yield advantage.ADVANTAGE_ESTIMATORS
    advantage.ADVANTAGE_ESTIMATORS.clear()
    advantage.ADVANTAGE_ESTIMATORS.update(saved)


# ---------------------------------------------------------------------------------------------------------------
# The table of twinkle 0.5.1's advantage module (GRPOAdvantage, RLOOAdvantage on the running example)
# ---------------------------------------------------------------------------------------------------------------


def test_seed_example_scale_none():
    out = GRPOAdvantage()([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0], num_generations=4, scale="none")
    close(out, [-0.5, 0.5, -0.5, 0.5, 0.75, -0.25, -0.25, -0.25])


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
@pytest.mark.parametrize("key", sorted(TABLE), ids=lambda k: f"{k[0]}-{k[1]}")
def test_table(key, as_tensor):
    name, scale = key
    rewards = torch.tensor(REWARDS) if as_tensor else REWARDS
    out = CLASSES[name]()(rewards, num_generations=4, scale=scale)
    assert out.shape == (8,) and out.dtype == torch.float32
    close(out, TABLE[key])


def test_default_scale_is_group():
    close(GRPOAdvantage()(REWARDS, num_generations=4), TABLE[("grpo", "group")])
    close(RLOOAdvantage()(REWARDS, num_generations=4), TABLE[("rloo", "group")])


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_grpo_single_generation_rows(as_tensor):
    rewards = torch.tensor(REWARDS) if as_tensor else REWARDS
    grpo = GRPOAdvantage()
    # K=1 'group': no group baseline exists, the raw rewards come back uncentred.
    close(grpo(rewards, num_generations=1, scale="group"), REWARDS)
    # K=1 'none': r - batch mean 0.375 -> 0 - .375 = -.375, 1 - .375 = .625
    close(grpo(rewards, num_generations=1, scale="none"), [r - 0.375 for r in REWARDS])
    # K=1 'batch': (r - .375) / sqrt(15/56): -.375 / .517549 = -0.724569, .625 / .517549 = 1.207615
    expected = [-0.724569, 1.207615, -0.724569, 1.207615, 1.207615, -0.724569, -0.724569, -0.724569]
    close(grpo(rewards, num_generations=1, scale="batch"), expected)


def test_grpo_single_reward_batch_scale_uses_unit_std():
    # One reward, K=1, 'batch': the std of one value is undefined, so it divides by 1: (3 - 3) / 1 = 0.
    close(GRPOAdvantage()([3.0], num_generations=1, scale="batch"), [0.0])


# ---------------------------------------------------------------------------------------------------------------
# Degenerate and missing rewards
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [GRPOAdvantage, RLOOAdvantage, DrGRPOAdvantage, ReinforcePlusPlusBaselineAdvantage])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_equal_rewards_give_zero_not_nan(cls, scale):
    # Group std 0 -> 0 / (0 + eps) = 0; a whole batch of equal rewards also has batch std 0.
    out = cls()([2.0] * 8, num_generations=4, scale=scale)
    close(out, [0.0] * 8)


def test_all_equal_group_next_to_informative_group():
    # group 0 = [1,1,1,1] -> 0; group 1 = [1,0,0,0] -> 0.75/0.5 = 1.5, -0.25/0.5 = -0.5
    out = GRPOAdvantage()([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0], num_generations=4, scale="group")
    close(out, [0.0, 0.0, 0.0, 0.0, 1.5, -0.5, -0.5, -0.5])


def test_missing_rewards_are_left_out_of_the_baseline_and_get_zero():
    # group 0 = [1, None, 0, 1]: valid mean 2/3 -> centred [1/3, -, -2/3, 1/3];
    #   valid sample std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3) -> 'group' [0.577350, 0, -1.154701, 0.577350]
    # group 1 = [NaN, 2, NaN, NaN]: one valid reward -> centred 0, std undefined -> 0 (never NaN)
    rewards = [1.0, None, 0.0, 1.0, math.nan, 2.0, None, None]
    grpo = GRPOAdvantage()
    close(grpo(rewards, num_generations=4, scale="none"), [1 / 3, 0, -2 / 3, 1 / 3, 0, 0, 0, 0])
    close(grpo(rewards, num_generations=4, scale="group"), [0.577350, 0, -1.154701, 0.577350, 0, 0, 0, 0])
    # RLOO with n = 3 valid: r_0 = 1 - mean(0, 1) = 0.5; r_2 = 0 - mean(1, 1) = -1; the lone valid 2 has no
    # leave-one-out baseline -> 0.
    close(RLOOAdvantage()(rewards, num_generations=4, scale="none"), [0.5, 0, -1.0, 0.5, 0, 0, 0, 0])
    # 'batch': std over the 4 valid rewards [1, 0, 1, 2]: mean 1, sample std sqrt((0+1+0+1)/3) = sqrt(2/3) = 0.816497
    # -> [1/3, -2/3, 1/3] / 0.816497 = [0.408248, -0.816497, 0.408248]
    close(grpo(rewards, num_generations=4, scale="batch"), [0.408248, 0, -0.816497, 0.408248, 0, 0, 0, 0])


def test_missing_rewards_as_nan_tensor():
    rewards = torch.tensor([1.0, math.nan, 0.0, 1.0])
    close(GRPOAdvantage()(rewards, num_generations=4, scale="none"), [1 / 3, 0, -2 / 3, 1 / 3])


def test_whole_batch_missing_gives_zero():
    close(GRPOAdvantage()([None] * 4, num_generations=2, scale="batch"), [0.0] * 4)
    close(RLOOAdvantage()([None] * 4, num_generations=2, scale="group"), [0.0] * 4)


def test_group_std_ignores_nan():
    # [0,1,0,1] -> sqrt(1/3); [1, NaN, 0, 0] -> mean 1/3, sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    out = group_std(torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, math.nan, 0.0, 0.0]), 4)
    close(out, [S_GROUP0, S_GROUP0])


# ---------------------------------------------------------------------------------------------------------------
# [B, F] matrices and reward_weights
# ---------------------------------------------------------------------------------------------------------------


def test_reward_matrix_weighted_nansum():
    # weights [2, 1]: row 0: 2*1 + 0.5 = 2.5; row 1: NaN skipped -> 2; row 2: 2*0 = 0; row 3: all NaN -> stays NaN
    rewards = [[1.0, 0.5], [None, 2.0], [0.0, math.nan], [None, None]]
    vector = as_reward_vector(rewards, reward_weights=[2.0, 1.0])
    assert torch.isnan(vector[3])
    close(vector[:3], [2.5, 2.0, 0.0])
    # The missing row is left out of the group mean (2.5 + 2 + 0) / 3 = 1.5 and gets advantage 0.
    out = GRPOAdvantage()(rewards, num_generations=4, scale="none", reward_weights=torch.tensor([2.0, 1.0]))
    close(out, [1.0, 0.5, -1.5, 0.0])


def test_reward_matrix_without_weights_is_unweighted_nansum():
    # rows: 1 + 0.5 = 1.5; NaN + 2 = 2; 0 + NaN = 0; 3 + 1 = 4
    rewards = torch.tensor([[1.0, 0.5], [math.nan, 2.0], [0.0, math.nan], [3.0, 1.0]])
    close(as_reward_vector(rewards), [1.5, 2.0, 0.0, 4.0])


def test_integer_tensor_rewards_are_accepted():
    close(GRPOAdvantage()(torch.tensor([0, 1, 0, 1, 1, 0, 0, 0]), num_generations=4, scale="none"), CENTRED)


# ---------------------------------------------------------------------------------------------------------------
# The other estimators
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_rloo_is_g_over_g_minus_one_times_grpo(scale):
    rewards = torch.rand(24, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for g in (2, 3, 4, 6):
        expected = g / (g - 1) * GRPOAdvantage()(rewards, num_generations=g, scale=scale)
        torch.testing.assert_close(RLOOAdvantage()(rewards, num_generations=g, scale=scale), expected,
                                   atol=1e-12, rtol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_dr_grpo_centres_and_ignores_scale(scale):
    # Dr. GRPO never divides by a std: the 'none' row of the table whatever `scale` says.
    close(DrGRPOAdvantage()(REWARDS, num_generations=4, scale=scale), CENTRED)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_reinforce_pp_baseline_by_hand(scale):
    # centred = [-.5, .5, -.5, .5, .75, -.25, -.25, -.25], batch mean 0;
    # sample std of the centred values: sqrt((4 * .25 + .5625 + 3 * .0625) / 7) = sqrt(1.75 / 7) = 0.5
    # (not the raw-reward std 0.517549), so A = centred / 0.5; `scale` is ignored.
    out = ReinforcePlusPlusBaselineAdvantage()(REWARDS, num_generations=4, scale=scale)
    close(out, [-1.0, 1.0, -1.0, 1.0, 1.5, -0.5, -0.5, -0.5])


def test_eps_is_added_to_the_std():
    # [0, 2]: mean 1, sample std sqrt(2) -> 1 / (sqrt(2) + 0.1) = 0.660254
    out = GRPOAdvantage(eps=0.1)([0.0, 2.0], num_generations=2, scale="group")
    close(out, [-1 / (math.sqrt(2) + 0.1), 1 / (math.sqrt(2) + 0.1)])


# ---------------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------------


def test_get_estimator_by_name_class_instance_and_callable():
    by_name = get_advantage_estimator("rloo", eps=0.5)
    assert isinstance(by_name, RLOOAdvantage) and by_name.eps == 0.5
    close(get_advantage_estimator("grpo")(REWARDS, num_generations=4, scale="none"), CENTRED)
    close(get_advantage_estimator("dr_grpo")(REWARDS, num_generations=4), CENTRED)
    assert isinstance(get_advantage_estimator("reinforce_pp_baseline"), ReinforcePlusPlusBaselineAdvantage)
    by_class = get_advantage_estimator(GRPOAdvantage, eps=1e-4)
    assert isinstance(by_class, GRPOAdvantage) and by_class.eps == 1e-4
    instance = RLOOAdvantage()
    assert get_advantage_estimator(instance) is instance

    def mine(rewards, num_generations=1, scale="group", **kwargs):
        return torch.zeros(len(rewards))

    assert get_advantage_estimator(mine) is mine


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="unknown advantage_estimator 'grop'") as info:
        get_advantage_estimator("grop")
    for name in ("grpo", "rloo", "dr_grpo", "reinforce_pp_baseline", "register_advantage"):
        assert name in str(info.value)


def test_not_callable_is_rejected():
    with pytest.raises(ValueError, match="must be a name, an Advantage or a callable; got int"):
        get_advantage_estimator(3)


def test_register_a_user_estimator(clean_registry):
    @register_advantage("sign")
    def sign(rewards, num_generations=1, scale="group", **kwargs):
        return torch.sign(as_reward_vector(rewards) - 0.5)

    assert clean_registry["sign"] is sign
    assert get_advantage_estimator("sign") is sign
    close(get_advantage_estimator("sign")([0.0, 1.0], num_generations=2), [-1.0, 1.0])

    @register_advantage("centre_only")
    class CentreOnly(Advantage):
        def compute(self, grouped, scale):
            return grouped - grouped.mean(dim=1, keepdim=True)

    estimator = get_advantage_estimator("centre_only")
    assert isinstance(estimator, CentreOnly)
    close(estimator(REWARDS, num_generations=4), CENTRED)
    # Registering the same object again under its name is harmless (e.g. a module imported twice).
    assert register_advantage("sign")(sign) is sign


def test_register_clash_on_a_taken_name(clean_registry):
    with pytest.raises(ValueError, match="already registered as 'grpo'"):
        register_advantage("grpo")(lambda rewards, **kwargs: rewards)
    assert clean_registry["grpo"] is GRPOAdvantage


# ---------------------------------------------------------------------------------------------------------------
# Bad input: the message says what is wrong
# ---------------------------------------------------------------------------------------------------------------


def test_num_generations_below_one():
    with pytest.raises(ValueError, match=r"num_generations must be an integer >= 1; got 0"):
        GRPOAdvantage()(REWARDS, num_generations=0)


def test_rloo_needs_two_generations():
    with pytest.raises(ValueError, match=r"num_generations must be an integer >= 2; got 1"):
        RLOOAdvantage()(REWARDS, num_generations=1)


def test_rewards_not_divisible_by_num_generations():
    with pytest.raises(ValueError, match=r"number of rewards \(8\) must be a multiple of num_generations \(3\)"):
        GRPOAdvantage()(REWARDS, num_generations=3)


@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_infinite_reward(bad):
    with pytest.raises(ValueError, match="rewards contain \\+/-inf"):
        GRPOAdvantage()([0.0, bad, 1.0, 0.0], num_generations=2)


def test_bad_scale():
    with pytest.raises(ValueError, match=r"scale must be one of \('group', 'batch', 'none'\); got 'std'"):
        GRPOAdvantage()(REWARDS, num_generations=4, scale="std")


def test_reward_weights_length_mismatch():
    with pytest.raises(ValueError, match="reward_weights has 3 entries but rewards have 2 columns"):
        GRPOAdvantage()([[1.0, 0.0], [0.0, 1.0]], num_generations=2, reward_weights=[1.0, 1.0, 1.0])


def test_reward_weights_with_one_dimensional_rewards():
    with pytest.raises(ValueError, match="reward_weights only applies to a 2-D"):
        GRPOAdvantage()([1.0, 0.0], num_generations=2, reward_weights=[1.0])


def test_three_dimensional_rewards():
    with pytest.raises(ValueError, match=r"rewards must be 1-D \[B\] or 2-D \[B, F\]; got shape \(2, 2, 1\)"):
        GRPOAdvantage()(torch.zeros(2, 2, 1), num_generations=2)


# ---------------------------------------------------------------------------------------------------------------
# Properties (float64 rewards so the identities hold to rounding)
# ---------------------------------------------------------------------------------------------------------------

ESTIMATORS = [GRPOAdvantage, RLOOAdvantage, DrGRPOAdvantage, ReinforcePlusPlusBaselineAdvantage]


def random_rewards(seed: int, n: int = 24) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_invariant_to_adding_a_constant(cls, scale):
    rewards = random_rewards(1)
    torch.testing.assert_close(cls()(rewards + 3.7, num_generations=4, scale=scale),
                               cls()(rewards, num_generations=4, scale=scale), atol=1e-10, rtol=0)


@pytest.mark.parametrize("cls", [GRPOAdvantage, RLOOAdvantage], ids=lambda c: c.__name__)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scaling_rewards(cls, scale):
    # Dividing by a std cancels a factor c; without a std the advantages scale by c.
    rewards, c = random_rewards(2), 2.5
    factor = c if scale == "none" else 1.0
    torch.testing.assert_close(cls()(rewards * c, num_generations=4, scale=scale),
                               factor * cls()(rewards, num_generations=4, scale=scale), atol=1e-7, rtol=0)


def test_scaling_rewards_dr_grpo_and_reinforce_pp():
    rewards, c = random_rewards(3), 2.5
    torch.testing.assert_close(DrGRPOAdvantage()(rewards * c, num_generations=4),
                               c * DrGRPOAdvantage()(rewards, num_generations=4), atol=1e-10, rtol=0)
    torch.testing.assert_close(ReinforcePlusPlusBaselineAdvantage()(rewards * c, num_generations=4),
                               ReinforcePlusPlusBaselineAdvantage()(rewards, num_generations=4), atol=1e-7, rtol=0)


@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_permutation_equivariance_within_groups(cls, scale):
    rewards = random_rewards(4)
    rewards[5] = math.nan  # a missing reward travels with its completion too
    generator = torch.Generator().manual_seed(5)
    # a different permutation inside each of the 6 groups of 4, as flat indices
    perm = torch.cat([4 * g + torch.randperm(4, generator=generator) for g in range(6)])
    out = cls()(rewards, num_generations=4, scale=scale)
    torch.testing.assert_close(cls()(rewards[perm], num_generations=4, scale=scale), out[perm], atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Several reward functions: sum_then_normalize (default) and normalize_then_sum (GDPO)
# ---------------------------------------------------------------------------------------------------------------


def test_multi_objective_registry():
    assert advantage.MULTI_OBJECTIVE_AGGREGATIONS == {"sum_then_normalize": advantage.sum_then_normalize,
                                                      "normalize_then_sum": advantage.normalize_then_sum}


def test_sum_then_normalize_is_the_estimator_on_the_weighted_sum():
    rewards = [[1.0, 2.0], [0.0, None], [3.0, 1.0], [2.0, 2.0]]
    estimator = GRPOAdvantage(eps=1e-4)
    expected = estimator(rewards, num_generations=2, scale="batch", reward_weights=[1.0, 0.5])
    actual = advantage.sum_then_normalize(estimator, rewards, 2, "batch", [1.0, 0.5], 1e-4)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def test_normalize_then_sum_matches_trls_gdpo_by_hand():
    """G = 3, two groups, two reward functions weighted (1, 0.5), eps 1e-4; None = not applicable; the last
    completion is scored by no function.

    function 1, group 0 [1, 0, 2]: mean 1, std sqrt((0 + 1 + 1) / 2) = 1 -> z = [0, -1/1.0001, 1/1.0001]
                group 1 [3, 3, -]: std 0 -> z = [0, 0, -]
    function 2, group 0 [-, 4, 2]: mean 3, std sqrt(2)  -> z = [-, 1/(sqrt 2 + 1e-4), -1/(sqrt 2 + 1e-4)]
                                                                = [-, 0.707057, -0.707057]
                group 1 [0, 6, -]: mean 3, std sqrt(18) -> z = [-3/(sqrt 18 + 1e-4), 3/(sqrt 18 + 1e-4), -]
                                                                = [-0.707090, 0.707090, -]
    weighted sums (missing z skipped): [0, -0.999900 + 0.353528, 0.999900 - 0.353528, -0.353545, 0.353545, -]
        = [0, -0.646372, 0.646372, -0.353545, 0.353545, unscored]
    over the 5 scored: mean 0, sample std sqrt((2 * 0.646372^2 + 2 * 0.353545^2) / 4) = 0.520956
    advantages = sum / (0.520956 + 1e-4): [0, -1.240503, 1.240503, -0.678516, 0.678516], and 0 for the unscored.
    """
    rewards = [[1.0, None], [0.0, 4.0], [2.0, 2.0], [3.0, 0.0], [3.0, 6.0], [None, None]]
    actual = advantage.normalize_then_sum(GRPOAdvantage(eps=1e-4), rewards, 3, "group", [1.0, 0.5], 1e-4)
    torch.testing.assert_close(actual, torch.tensor([0.0, -1.240503, 1.240503, -0.678516, 0.678516, 0.0]),
                               atol=ATOL, rtol=0)
    # scale is not used: GDPO's per-function step is always the group normalisation (TRL ignores scale_rewards)
    for scale in ("batch", "none"):
        other = advantage.normalize_then_sum(GRPOAdvantage(eps=1e-4), rewards, 3, scale, [1.0, 0.5], 1e-4)
        torch.testing.assert_close(other, actual, atol=0, rtol=0)


def test_normalize_then_sum_with_another_estimator():
    # rloo, one function weighted 2, G = 2: group [1, 0] -> leave-one-out [1, -1] / (std sqrt(.5) + 1e-4)
    # = +-1.413938; group [3, 3] -> 0. Weighted: [2.827876, -2.827876, 0, 0]; batch mean 0, sample std
    # 2.827876 * sqrt(2/3) = 2.308976 -> 2.827876 / (2.308976 + 1e-4) = 1.224692
    rewards = torch.tensor([[1.0], [0.0], [3.0], [3.0]])
    actual = advantage.normalize_then_sum(RLOOAdvantage(eps=1e-4), rewards, 2, "group", [2.0], 1e-4)
    x = 2 / (math.sqrt(0.5) + 1e-4)
    a = x / (x * math.sqrt(2 / 3) + 1e-4)
    torch.testing.assert_close(actual, torch.tensor([a, -a, 0.0, 0.0]), atol=ATOL, rtol=0)
    assert a == pytest.approx(1.224692, abs=1e-6)
    # a user callable works the same way; NaN it returns counts as 0
    calls = []

    def centred(rewards, num_generations, scale, **kwargs):
        calls.append((tuple(rewards.tolist()), num_generations, scale))
        return torch.tensor([1.0, -1.0, math.nan, 0.0])

    out = advantage.normalize_then_sum(centred, rewards, 2, "none", None, 1e-4)
    assert calls == [((1.0, 0.0, 3.0, 3.0), 2, "group")]
    # [1, -1, 0, 0]: mean 0, std sqrt(2/3) = 0.816497 -> +-1 / 0.816597 = +-1.224597
    torch.testing.assert_close(out, torch.tensor([1.0, -1.0, 0.0, 0.0]) / (math.sqrt(2 / 3) + 1e-4), atol=ATOL,
                               rtol=0)


def test_normalize_then_sum_checks_the_weights():
    with pytest.raises(ValueError, match="reward_weights has 1 entries but rewards have 2 columns"):
        advantage.normalize_then_sum(GRPOAdvantage(), [[1.0, 2.0], [0.0, 1.0]], 2, "group", [1.0], 1e-4)


def test_nanstd_by_hand():
    # [1, NaN, 3]: mean 2, squares 1 + 1 over 2 - 1 -> 2 -> sqrt(2); one value or none -> NaN, never -0
    assert advantage.nanstd(torch.tensor([1.0, math.nan, 3.0])).item() == pytest.approx(math.sqrt(2), abs=1e-7)
    assert math.isnan(advantage.nanstd(torch.tensor([4.0, math.nan])).item())
    assert math.isnan(advantage.nanstd(torch.tensor([math.nan, math.nan])).item())
    # along a dim: rows [0, 2] -> sqrt(2), [NaN, NaN] -> NaN
    rows = advantage.nanstd(torch.tensor([[0.0, 2.0], [math.nan, math.nan]]), dim=1)
    assert rows[0].item() == pytest.approx(math.sqrt(2), abs=1e-7) and math.isnan(rows[1].item())

"""The prefill cost model without engines: `fit_compute` and the pair's running `ComputeModel`
(src/agentkv/_engines/_compute.py)."""

from __future__ import annotations

import pytest

from agentkv._engines._compute import ComputeCost, ComputeModel, ComputePoint, attended, fit_compute

TRUE = ComputeCost(pass_s=0.05, per_token_s=1.5e-3, per_attended_s=5e-7)


def _point(computed: int, context: int, cost: ComputeCost = TRUE) -> ComputePoint:
    return ComputePoint(computed, context, cost.seconds(computed, context))


def test_each_new_token_attends_to_the_context_and_the_new_tokens_before_it() -> None:
    assert attended(1, 0) == 0.5 and attended(4, 10) == 4 * 12
    assert TRUE.seconds(0, 500) == 0.0  # nothing computed, no pass


def test_the_fit_recovers_the_three_costs_from_prefills_of_several_shapes() -> None:
    shapes = [(771, 0), (521, 794), (547, 768), (521, 1338), (605, 1792), (45, 256), (89, 256)]
    fit = fit_compute(_point(n, c) for n, c in shapes)
    assert (fit.pass_s, fit.per_token_s, fit.per_attended_s) == pytest.approx(
        (TRUE.pass_s, TRUE.per_token_s, TRUE.per_attended_s)
    )


def test_a_term_the_points_cannot_tell_apart_is_not_fitted() -> None:
    one = fit_compute([_point(100, 0)])  # one prefill: a cost per token alone
    assert (one.pass_s, one.per_attended_s) == (0.0, 0.0) and one.seconds(100, 0) == pytest.approx(TRUE.seconds(100, 0))
    same = fit_compute([_point(100, 0), _point(100, 0)])  # the same shape twice tells no more
    assert same.seconds(300, 50) == pytest.approx(one.seconds(300, 50)) and same.pass_s == 0.0
    sized = fit_compute([_point(45, 0, ComputeCost(0.06, 1.4e-3, 0.0)), _point(89, 0, ComputeCost(0.06, 1.4e-3, 0.0))])
    assert (sized.pass_s, sized.per_token_s) == pytest.approx((0.06, 1.4e-3))  # two sizes: the pass apart
    assert fit_compute([]) == ComputeCost(0.0, 0.0, 0.0)


def test_a_cost_that_noise_fits_below_zero_is_dropped() -> None:
    falling = [ComputePoint(100, 0, 0.30), ComputePoint(200, 0, 0.35), ComputePoint(300, 2000, 0.36)]
    fit = fit_compute(falling)
    assert min(fit.pass_s, fit.per_token_s, fit.per_attended_s) >= 0.0


def test_the_model_refits_over_its_latest_prefills_only() -> None:
    model = ComputeModel()
    assert model.seconds(100, 0) == pytest.approx(0.2) and len(model) == 0  # the prior: 2 ms a token
    model.observe(ComputePoint(0, 100, 0.1))  # nothing computed: nothing learned
    model.observe(ComputePoint(100, 0, 0.0))
    assert len(model) == 0
    slow = ComputeCost(0.0, 4e-3, 0.0)
    for n in range(100, 130):
        model.observe(_point(n, 0, slow))
    fast = ComputeCost(0.0, 1e-3, 0.0)
    for n in range(100, 124):  # a whole window of the engines' new state
        model.observe(_point(n, 0, fast))
    assert len(model) == 24 and model.seconds(200, 0) == pytest.approx(0.2)


def test_a_prefill_adds_its_tokens_to_a_pass_that_runs_anyway() -> None:
    assert TRUE.added_s(100, 500) == pytest.approx(TRUE.seconds(100, 500) - TRUE.pass_s)
    assert TRUE.added_s(0, 500) == 0.0

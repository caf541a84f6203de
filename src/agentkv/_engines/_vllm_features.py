"""Which of agentkv's features the installed vLLM can serve, asked in agentkv's process.

agentkv is tested on vLLM 0.32.x; on any other version it warns once and runs. Each feature that needs
vLLM internals (`_agentkv_vllm._patches.FEATURES`: clean shutdown, idle sleep, auto placement, elastic
cores, prefill stats, the server's read-outs and streamed handle, push with push-back) is probed here as the
plugin probes it in the engines, and where a probe fails agentkv turns the feature off with one warning
(`has_feature`) or, where a setting asks for it explicitly, refuses that setting by name
(`require_feature`). See docs/vllm-patches.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from _agentkv_vllm._patches import engine_features, installed_vllm, probe, warn_feature_off, warn_if_untested

from .._errors import UserError

__all__ = ["check_vllm_version", "feature_problem", "has_feature", "require_feature", "warn_engine_features"]


def check_vllm_version(version: str | None = None) -> None:
    """Warn once when vLLM ``version`` (default: the installed one) is not the tested series (0.32.x).

    Never refuses: the features that need vLLM internals are probed one by one (`has_feature`)."""
    warn_if_untested(version)


@functools.cache
def feature_problem(feature: str) -> str | None:
    """What the installed vLLM lacks for ``feature`` (the plugin's `probe`, once per process); None: nothing."""
    return probe(feature)


def has_feature(feature: str) -> bool:
    """Whether the installed vLLM has what ``feature`` needs; if not, the one warning that it is off."""
    problem = feature_problem(feature)
    if problem is not None:
        warn_feature_off(feature, problem)
    return problem is None


def require_feature(feature: str, asked: str) -> None:
    """Refuse (`UserError`) the setting ``asked`` when the installed vLLM lacks what ``feature`` needs."""
    problem = feature_problem(feature)
    if problem is not None:
        raise UserError(
            f"{asked} needs agentkv's {feature}, which vLLM {installed_vllm()} cannot serve: {problem} "
            "(docs/vllm-patches.md)"
        )


def warn_engine_features(env: Mapping[str, str]) -> None:
    """Before an engine with environment ``env`` starts: warn once of an untested vLLM, and of each feature its
    plugin would apply that is off. The engine's processes inherit what was said (`WARNED_ENV`) and stay quiet."""
    check_vllm_version()
    for feature in engine_features(env):
        has_feature(feature)

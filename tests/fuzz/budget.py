"""How much each Hypothesis fuzzer runs: one place for the settings every fuzz suite shares."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

__all__ = ["SCALE", "fuzz_settings"]

#: ``LMPF_FUZZ_SCALE`` multiplies every fuzzer's example count (the nightly runs use more).
SCALE = float(os.environ.get("LMPF_FUZZ_SCALE", "1"))


def fuzz_settings(examples: int, *tolerated: HealthCheck) -> settings:
    """``examples`` (times :data:`SCALE`) examples, no deadline, and no "explain" phase: it
    traces every line of every failing example again, which takes minutes for examples that
    start threads and sockets.  ``tolerated``: health checks besides ``too_slow`` that the
    suite's examples trip by design."""
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, *tolerated],
    )

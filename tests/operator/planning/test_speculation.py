"""Speculation in the engines' unit of acceptance, and the engine's acceptance window in predictions."""

from __future__ import annotations

import pytest

from kvpilot.engine.contract.acceptance_window import AcceptancePolicy
from kvpilot.engine.contract.config import SPECULATIVE_BACKOFF_STEPS
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller.correction import Correction
from kvpilot.operator.planning import speculation
from kvpilot.operator.planning.plan import PlanContext, plan


@pytest.mark.parametrize("per_token", [0.0, 0.3, 0.5, 0.75, 1.0])
def test_the_share_of_drafts_kept_gives_leviathans_tokens_per_verification(per_token: float) -> None:
    k = 4
    share = speculation.accepted_share(per_token, k)
    leviathan = k + 1 if per_token == 1 else (1 - per_token ** (k + 1)) / (1 - per_token)
    assert 1 + k * share == pytest.approx(leviathan)
    assert speculation.per_token(share, k) == pytest.approx(per_token, abs=1e-9)


def test_a_request_that_keeps_no_draft_verifies_its_window_then_one_probe_per_back_off() -> None:
    # 4 verifications of 1 token each, a back-off of 32 plain steps, a probe: 37 tokens in 37 steps.
    assert speculation.verifying_share(0.0, 4, 4 + SPECULATIVE_BACKOFF_STEPS + 1) == pytest.approx(5 / 37)


def test_a_request_that_keeps_its_drafts_verifies_every_step() -> None:
    assert speculation.verifying_share(1.0, 4, 500) == 1.0
    # A window that never judges (min acceptance 0, the engine before the window) verifies every step too.
    assert speculation.verifying_share(0.0, 4, 500, AcceptancePolicy(4, 0.0, 32)) == 1.0


def test_the_share_verifying_grows_with_the_acceptance_and_falls_with_the_length() -> None:
    grid = [i / 20 for i in range(21)]
    for tokens in (47, 255):
        shares = [speculation.verifying_share(a, 4, tokens) for a in grid]
        # Seeded simulations: allow their ~0.01 noise, never a jump back.
        assert all(later >= earlier - 0.02 for earlier, later in zip(shares, shares[1:])), shares
        assert shares[0] < 0.15 and shares[-1] == 1.0
    assert speculation.verifying_share(0.1, 4, 1023) < speculation.verifying_share(0.1, 4, 47)


def _spec(speculative: str) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {
            "model": {"name": "smollm2-135m"},
            "accelerator": {"type": "cpu", "profile": "amd-epyc-zen5-2c"},
            "runtime": "kvpilot",
            "serving": {"speculative": speculative, "quantization": "none", "maxContextLength": 2048},
            "slo": {"ttftP95Ms": 2000, "tpotP95Ms": 200},
            "load": {"requestsPerSecond": 0.5, "meanPromptTokens": 60, "meanOutputTokens": 96, "temperature": 0},
        }
    )


def test_drafts_mostly_rejected_cost_a_few_verifications_not_one_per_step() -> None:
    """On a CPU a verification costs ~1.5x a decode step. With drafts kept 2 % of the time, the
    window leaves a request verifying ~1 step in 10, so its TPOT is close to no speculation's
    (within the ~1 % the step model wobbles by between measured batches), not 1.3x it as one
    verification per step would be; drafts kept often make it faster."""
    off = plan(_spec("off"))
    rejected = plan(_spec("ngram"), PlanContext(correction=Correction(1.0, 1.0, (("ngram", 0.02),))))
    kept = plan(_spec("ngram"), PlanContext(correction=Correction(1.0, 1.0, (("ngram", 0.8),))))
    assert off.fits and rejected.fits and kept.fits
    assert off.predicted_tpot_ms * 0.97 < rejected.predicted_tpot_ms < off.predicted_tpot_ms * 1.1
    assert kept.predicted_tpot_ms < off.predicted_tpot_ms * 0.7

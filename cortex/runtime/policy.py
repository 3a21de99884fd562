"""Run policies: what the scheduler may do on a request beyond running every CU exactly.

- `strict`: every CU runs, exactly; no cache, no variants. For debugging and audits: its results
  are the reference the others are checked against.
- `balanced` (the default): conditional CUs of an untaken branch and CUs no requested output needs
  are skipped; the result cache is on; a reduced-precision variant runs where its calibrated trust
  is at least `trust_threshold`, with the run-time guards on.
- `aggressive`: as balanced, with a lower trust threshold; the guards stay on.
- `offline`: no CUs at all: the source model recorded in dag.json runs on onnxruntime, the
  emergency fallback.

A policy is chosen per model (`cortex.load(..., policy=)`, `cortex run --policy`) and may be
overridden per call (`model.run(feeds, policy=)`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ir.errors import CortexError

DEFAULT_TRUST_THRESHOLD = 0.99      # balanced: a variant within 1% relative L2 error of the exact CU
AGGRESSIVE_TRUST_THRESHOLD = 0.95


@dataclass(frozen=True)
class Policy:
    name: str
    skip_inactive: bool = True          # skip untaken branches' CUs and CUs no requested output needs
    cache: bool = True                  # reuse a CU's outputs for byte-identical inputs
    trust_threshold: float | None = DEFAULT_TRUST_THRESHOLD   # None: exact CUs only
    guards: bool = True                 # check a variant's outputs; rerun the exact CU on a violation
    offline: bool = False               # run the source model on onnxruntime instead of the CUs

    def with_threshold(self, threshold: float | None) -> Policy:
        if threshold is not None and not 0.0 <= threshold <= 1.0:
            raise CortexError(f"--trust-threshold must be in [0, 1] (got {threshold})")
        return replace(self, trust_threshold=threshold)


POLICIES = {
    "strict": Policy("strict", skip_inactive=False, cache=False, trust_threshold=None, guards=False),
    "balanced": Policy("balanced"),
    "aggressive": Policy("aggressive", trust_threshold=AGGRESSIVE_TRUST_THRESHOLD),
    "offline": Policy("offline", skip_inactive=False, cache=False, trust_threshold=None, guards=False, offline=True),
}
DEFAULT_POLICY = "balanced"


def policy(name_or_policy: str | Policy | None) -> Policy:
    if name_or_policy is None:
        return POLICIES[DEFAULT_POLICY]
    if isinstance(name_or_policy, Policy):
        return name_or_policy
    found = POLICIES.get(name_or_policy)
    if found is None:
        raise CortexError(f"unknown policy {name_or_policy!r}: expected one of {', '.join(POLICIES)}")
    return found

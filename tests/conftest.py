"""Shared pytest setup: `import testdata` works from every test module, the run ends with the
node-test tally (passed / skipped because onnxruntime cannot reproduce the case / failed), and
`hash_calls` records what the result cache hashes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from cortex.runtime import cache as result_cache
from cortex.runtime.cache import hash_tensor

# Test modules import the shared data helpers as `testdata`, whether or not tests/ is a package.
sys.path.insert(0, str(Path(__file__).resolve().parent))

NODE_TEST_PREFIX = "tests/test_roundtrip.py::test_node_test_"


def pytest_terminal_summary(terminalreporter) -> None:
    counts = {}
    for outcome in ("passed", "skipped", "failed"):
        reports = terminalreporter.stats.get(outcome, [])
        counts[outcome] = sum(1 for r in reports if getattr(r, "nodeid", "").startswith(NODE_TEST_PREFIX)
                              and (outcome != "passed" or r.when == "call"))
    if any(counts.values()):
        terminalreporter.write_line(
            f"ONNX node tests through import/export and the pipeline: {counts['passed']} passed, "
            f"{counts['skipped']} skipped (onnxruntime cannot reproduce them), {counts['failed']} failed")


@pytest.fixture(scope="session")
def minilm_case():
    """MiniLM-L6 at batch 1, seq 128, with its onnxruntime reference (exported on first use)."""
    from testdata import minilm
    return minilm(batch=1, seq=128)


@pytest.fixture
def hash_calls(monkeypatch):
    """The arrays `hash_tensor` is called on, in order."""
    calls = []

    def counting(array):
        calls.append(np.array(array))
        return hash_tensor(array)

    monkeypatch.setattr(result_cache, "hash_tensor", counting)
    return calls

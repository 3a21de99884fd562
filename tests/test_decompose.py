"""`cortex decompose` + `cortex build-dag` end to end: running the CU models one by one with
onnxruntime, in dag.json's order, reproduces the original model (rtol 1e-5, atol 1e-6)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest

from cortex.commands.decompose import decompose_model
from cortex.dag import SCHEMA_FILE, build_dag, validate_dag
from cortex.tools.onnx_reference import run_dag
from ir.errors import CortexError
from passes.partition import PartitionIntoCUs
from testdata import (LIGHT_MODEL_NAMES, SAMPLE_NAMES, assert_values_close, light_model, node_test_case,
                      node_test_names, onnxruntime_reproduces, run_onnxruntime, sample_model)

DEFAULTS = dict(min_cu_size=256, max_cu_size=1_000_000, max_cu_depth=3)
SETTINGS = {
    "defaults": DEFAULTS,
    "depth1": dict(DEFAULTS, max_cu_depth=1),
    "small-cus": dict(min_cu_size=4096, max_cu_depth=4, max_cu_size=100_000),
}
RTOL, ATOL = 1e-5, 1e-6
MANIFEST_SCHEMA = SCHEMA_FILE.with_name("manifest.schema.json")


def decompose_and_run(case, folder: Path, **limits) -> dict:
    """Decompose, build the dag, check the artifacts' contracts, and run the CUs in order."""
    cus = folder / "cus"
    decompose_model(case.path, cus, PartitionIntoCUs(**limits), input_shapes=case.input_shapes, dims=case.dims)
    dag = build_dag(cus, folder / "dag.json")
    validate_dag(dag)
    (folder / "dag.json").write_text(json.dumps(dag))
    manifest = json.loads((cus / "manifest.json").read_text())
    jsonschema.validate(manifest, json.loads(MANIFEST_SCHEMA.read_text()))
    for cu in manifest["cus"]:
        assert cu["params"] <= limits["max_cu_size"]
        assert 1 <= cu["depth"] <= limits["max_cu_depth"]
        if source_passes_full_check(case.path):
            onnx.checker.check_model(onnx.load(cus / cu["path"]), full_check=True)
    return run_dag(folder / "dag.json", case.inputs)


def source_passes_full_check(path: Path) -> bool:
    """A few node tests fail onnx's full check themselves (function bodies onnx cannot infer)."""
    try:
        onnx.checker.check_model(onnx.load(path), full_check=True)
        return True
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
        return False


def assert_reproduces(case, folder: Path, **limits) -> None:
    expected = run_onnxruntime(case.path, case.inputs)
    got = decompose_and_run(case, folder, **limits)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert_values_close(got[name], value, *tolerance(value))


def tolerance(value) -> tuple[float, float]:
    """rtol 1e-5, atol 1e-6; for half-precision results, two units in the last place: the CUs may
    round an fp16 intermediate where the whole model did not (constant folding, split kernels)."""
    value = np.asarray(value)
    if value.dtype.kind == "f" and value.dtype.itemsize < 4 or value.dtype.name == "bfloat16":
        eps = float(np.finfo(value.dtype).eps) if value.dtype.kind == "f" else 2.0 ** -7
        return max(RTOL, 2 * eps), ATOL
    return RTOL, ATOL


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_samples_are_reproduced_cu_by_cu(name, setting, tmp_path):
    assert_reproduces(sample_model(name), tmp_path, **SETTINGS[setting])


def _light_params():
    """squeezenet under every setting and shufflenet under the defaults run by default; the rest
    (up to 140 M parameters once folded) are slow."""
    for name in LIGHT_MODEL_NAMES:
        for setting in SETTINGS:
            fast = name == "squeezenet" or (name == "shufflenet" and setting == "defaults")
            yield pytest.param(name, setting, id=f"{name}-{setting}", marks=[] if fast else [pytest.mark.slow])


@pytest.mark.parametrize("name, setting", list(_light_params()))
def test_light_models_are_reproduced_cu_by_cu(name, setting, tmp_path):
    assert_reproduces(light_model(name), tmp_path, **SETTINGS[setting])


@pytest.mark.parametrize("setting", [
    "defaults", pytest.param("depth1", marks=pytest.mark.slow), pytest.param("small-cus", marks=pytest.mark.slow)])
def test_minilm_is_reproduced_cu_by_cu(setting, tmp_path, minilm_case):
    assert_reproduces(minilm_case, tmp_path, **SETTINGS[setting])


def test_minilm_embedding_table_is_split_to_respect_max_cu_size(tmp_path, minilm_case):
    summary = decompose_model(minilm_case.path, tmp_path / "cus", PartitionIntoCUs(),
                              input_shapes=minilm_case.input_shapes, dims=minilm_case.dims)
    manifest = json.loads((tmp_path / "cus" / "manifest.json").read_text())
    assert summary["split_ops"] >= 1  # the 30522 x 384 word embedding alone holds 11.7 M parameters
    assert max(cu["params"] for cu in manifest["cus"]) <= 1_000_000
    assert any("Concat" in cu["op_types"] for cu in manifest["cus"]), "the split table's slices are joined"


# -- ONNX node tests ------------------------------------------------------------------------------
def _node_params():
    names = node_test_names()
    # Every 25th case runs by default (a spread over op families); the full set is slow.
    return [pytest.param(n, id=n, marks=[] if i % 25 == 0 else [pytest.mark.slow]) for i, n in enumerate(names)]


@pytest.mark.parametrize("name", _node_params())
def test_node_tests_are_reproduced_cu_by_cu(name, tmp_path):
    case = node_test_case(name)
    why = onnxruntime_reproduces(case)
    if why:
        pytest.skip(why)
    # Node tests declare some inputs with symbolic dims: bind them to the feed's shapes.
    case = dataclasses.replace(case, input_shapes={k: v.shape for k, v in case.inputs.items()
                                                   if isinstance(v, np.ndarray)})
    try:
        decompose_model(case.path, tmp_path / "probe", PartitionIntoCUs(**DEFAULTS), input_shapes=case.input_shapes)
    except CortexError as e:
        pytest.skip(f"not decomposable: {e}")
    got = decompose_and_run(case, tmp_path / "run", **DEFAULTS)
    expected = run_onnxruntime(case.path, case.inputs)
    for out_name, value in expected.items():
        assert_values_close(got[out_name], value, *tolerance(value))

"""Whole models through decompose -> build-dag -> compile-wasm -> cortex.load(...).run(...) match
onnxruntime (rtol 1e-4, atol 1e-5) at opt-level 0 and 3, with and without relaxed SIMD; every
module imports nothing but, at most, one memory."""

from __future__ import annotations

import json

import numpy as np
import pytest

import cortex
from testdata import LIGHT_MODEL_NAMES, SAMPLE_NAMES, light_model, minilm, sample_model
from wasm_cases import compile_pipeline, module_imports

RTOL, ATOL = 1e-4, 1e-5
SCALAR, SIMD, RELAXED = ("", "0"), ("simd,bulk-memory", "3"), ("simd,bulk-memory,relaxed-simd", "3")
CONFIGS = {"scalar-O0": SCALAR, "simd-O3": SIMD, "relaxed-O3": RELAXED}


def check_case(case, out_dir, config, **partition):
    features, level = config
    dag_path = compile_pipeline(case.path, out_dir, features, level, case.input_shapes, case.dims, **partition)
    got = cortex.load(dag_path, device="wasm").run(case.inputs)
    assert sorted(got) == sorted(case.outputs)
    for name, want in case.outputs.items():
        assert got[name].dtype == np.asarray(want).dtype
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL, err_msg=f"{case.name} {name} {config}")
    return dag_path


def assert_imports_at_most_one_memory(dag_path):
    dag = json.loads(dag_path.read_text())
    for cu in dag["cus"]:
        imports = module_imports(dag_path.parent / cu["artifacts"]["wasm"]["path"])
        assert imports == [] or (len(imports) == 1 and imports[0][2] == "MemoryType"), (cu["id"], imports)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_samples_match_onnxruntime(name, config, tmp_path):
    dag_path = check_case(sample_model(name), tmp_path, config, min_cu_size=64, max_cu_depth=3)
    assert_imports_at_most_one_memory(dag_path)


def _light_params():
    params = []
    for name in LIGHT_MODEL_NAMES:
        for cid, config in CONFIGS.items():
            fast = name in ("squeezenet", "shufflenet") and cid == "simd-O3"
            params.append(pytest.param(name, config, id=f"{name}-{cid}", marks=[] if fast else [pytest.mark.slow]))
    return params


@pytest.mark.parametrize("name,config", _light_params())
def test_light_models_match_onnxruntime(name, config, tmp_path):
    case = light_model(name)
    dag_path = check_case(case, tmp_path, config)
    assert_imports_at_most_one_memory(dag_path)


@pytest.mark.parametrize("config", [pytest.param(c, id=i, marks=[] if i == "relaxed-O3" else [pytest.mark.slow])
                                    for i, c in CONFIGS.items()])
def test_minilm_matches_onnxruntime(config, tmp_path):
    dag_path = check_case(minilm(batch=1, seq=128), tmp_path, config)
    assert_imports_at_most_one_memory(dag_path)

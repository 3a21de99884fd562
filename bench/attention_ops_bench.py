"""MiniLM-L6's non-GEMM float work at sequence length 128, op by op, against onnxruntime (native, one
thread), interleaved: each case is a one-op (or one-block) model compiled through the CLI like a real
model (decompose, build-dag, compile-wasm with relaxed SIMD) and checked against onnxruntime first.

Cases: scaled dot-product attention (Kᵀ, QKᵀ, scale, mask Add, Softmax, AV) over 12 heads of 128x32,
its two batched MatMuls alone, the masked Softmax alone, the erf GELU on the FFN's [128, 1536]
activation, and DynamicQuantizeLinear on the [128, 384] and [128, 1536] activations.

    python -m bench.attention_ops_bench [--rounds 5] [--cases attention,softmax,...]

Prints one line per case: Cortex's and onnxruntime's median CPU ms, their ratio, and the spread
(min-max over runs) of each."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from bench import cortex_side
from bench.timing import InProcess, interleave, repeats_for

HEADS, SEQ, HEAD_DIM, FFN = 12, 128, 32, 1536


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "case", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _attention():
    heads = (1, HEADS, SEQ, HEAD_DIM)
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"]),
             helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
             helper.make_node("Add", ["scaled", "mask"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
             helper.make_node("MatMul", ["probs", "v"], ["context"])]
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [], [HEAD_DIM ** -0.5])
    model = _model(nodes, [_f32("q", heads), _f32("k", heads), _f32("v", heads), _f32("mask", (1, 1, 1, SEQ))],
                   [_f32("context", heads)], [scale])
    rng = np.random.default_rng(0)
    mask = np.zeros((1, 1, 1, SEQ), np.float32)
    mask[..., SEQ - 16:] = np.finfo(np.float32).min   # padding tokens, as BERT's extended mask writes them
    feed = {n: rng.standard_normal(heads).astype(np.float32) for n in ("q", "k", "v")}
    return model, {**feed, "mask": mask}


def _qk():
    heads = (1, HEADS, SEQ, HEAD_DIM)
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"])]
    model = _model(nodes, [_f32("q", heads), _f32("k", heads)], [_f32("scores", (1, HEADS, SEQ, SEQ))])
    rng = np.random.default_rng(1)
    return model, {n: rng.standard_normal(heads).astype(np.float32) for n in ("q", "k")}


def _av():
    nodes = [helper.make_node("MatMul", ["p", "v"], ["context"])]
    model = _model(nodes, [_f32("p", (1, HEADS, SEQ, SEQ)), _f32("v", (1, HEADS, SEQ, HEAD_DIM))],
                   [_f32("context", (1, HEADS, SEQ, HEAD_DIM))])
    rng = np.random.default_rng(2)
    return model, {"p": rng.random((1, HEADS, SEQ, SEQ), np.float32),
                   "v": rng.standard_normal((1, HEADS, SEQ, HEAD_DIM)).astype(np.float32)}


def _softmax():
    scores = (1, HEADS, SEQ, SEQ)
    nodes = [helper.make_node("Add", ["s", "mask"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["probs"], axis=-1)]
    model = _model(nodes, [_f32("s", scores), _f32("mask", (1, 1, 1, SEQ))], [_f32("probs", scores)])
    rng = np.random.default_rng(3)
    mask = np.zeros((1, 1, 1, SEQ), np.float32)
    mask[..., SEQ - 16:] = np.finfo(np.float32).min
    return model, {"s": (4 * rng.standard_normal(scores)).astype(np.float32), "mask": mask}


def _gelu():
    shape = (1, SEQ, FFN)
    consts = [helper.make_tensor(n, TensorProto.FLOAT, [], [v])
              for n, v in (("sqrt2", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["x", "p"], ["xp"]),
             helper.make_node("Mul", ["xp", "half"], ["y"])]
    model = _model(nodes, [_f32("x", shape)], [_f32("y", shape)], consts)
    return model, {"x": (2 * np.random.default_rng(4).standard_normal(shape)).astype(np.float32)}


def _dynamic_quantize(width):
    def case():
        nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zero"])]
        outputs = [helper.make_tensor_value_info("y", TensorProto.UINT8, [SEQ, width]),
                   helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
                   helper.make_tensor_value_info("zero", TensorProto.UINT8, [])]
        model = _model(nodes, [_f32("x", (SEQ, width))], outputs)
        return model, {"x": (3 * np.random.default_rng(5).standard_normal((SEQ, width))).astype(np.float32)}
    return case


CASES = {"attention": _attention, "qk": _qk, "av": _av, "softmax": _softmax, "gelu": _gelu,
         "dynamicquantize-384": _dynamic_quantize(384), "dynamicquantize-1536": _dynamic_quantize(FFN)}


def _onnxruntime(path: Path, feed: dict):
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session, InProcess("onnxruntime", lambda: session.run(None, feed))


def run_case(name: str, rounds: int, workdir: Path) -> str:
    model, feed = CASES[name]()
    path = workdir / f"{name}.onnx"
    onnx.save(model, path)
    session, ort_side = _onnxruntime(path, feed)
    reference = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
    built = cortex_side.build(path, {k: v.shape for k, v in feed.items()}, {}, feed, reference,
                              workdir / name, atol=2e-4)
    seconds = min(ort_side.time(1, 3))[1]
    results = interleave([built.contestant, ort_side], rounds, repeats_for(seconds))
    ours, theirs = results[built.contestant.name], results["onnxruntime"]
    spread = " ".join(f"{label} {min(t.seconds) * 1e3:.3f}-{max(t.seconds) * 1e3:.3f}"
                      for label, t in (("cortex", ours), ("ort", theirs)))
    return (f"{name:22s} cortex {ours.median * 1e3:8.3f} ms  onnxruntime {theirs.median * 1e3:8.3f} ms  "
            f"ratio {ours.median / theirs.median:5.2f}  (spread ms: {spread})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from: {', '.join(CASES)}")
    args = parser.parse_args(argv)
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; choose from {', '.join(CASES)}")
    with tempfile.TemporaryDirectory(prefix="attention-ops-") as tmp:
        for name in chosen:
            print(run_case(name, args.rounds, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()

"""The loop-nest IR: expression folding, stride analysis, broadcast collapsing, the builder's
kernels, and which loops the WebAssembly renderer vectorises."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

from backends.wasm.memory_plan import describe_plan, place_storages
from backends.wasm.vectorize import vectorizable
from codegen.affine import affine, stride_of
from codegen.reductions import accumulators, reduction_step
from ir.errors import UnsupportedError
from ir.loops import (Assign, If, Intrinsic, Local, Loop, Store, Var, buffers_accessed, const, loads_in,
                      lt, maximum, walk_stmts)
from codegen.lower import lower_graph
from ir.loops.contraction import ContractionOperands, GemmSpec
from ir.loops.builder import collapse_broadcast
from ir.loops.program import Buffer, Storage
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from wasm_cases import make_model


def buffer(shape, dtype="float32"):
    return Buffer(Storage("b", dtype, int(np.prod(shape)), "temp"), tuple(shape))


def test_index_arithmetic_folds_neutral_terms():
    i = Var("i")
    assert (i * 1 + 0) is i
    assert (const(3, "i32") * 4 + 2).value == 14


def test_stride_of_affine_and_gathered_indices():
    i, j = Var("i"), Var("j")
    x = buffer((4, 8))
    assert stride_of(x.flat_index((i, j)), j) == 1
    assert stride_of(x.flat_index((i, j)), i) == 8
    assert stride_of(x.flat_index((i, j * 2 + 1)), j) == 2
    table = buffer((8,), "int32")
    assert stride_of(x.flat_index((i, table[j])), j) is None
    assert stride_of(x.flat_index((i, table[i])), j) == 0


def test_affine_form_is_exact_unless_told_what_is_opaque():
    i, j = Var("i"), Var("j")
    x, table = buffer((4, 8)), buffer((8,), "int32")
    assert affine(x.flat_index((i, j * 2 + 1))) == ({i.uid: 8, j.uid: 2}, 1)
    gathered = x.flat_index((i, table[i]))
    assert affine(gathered) is None
    # a gathered offset taken as an unknown constant keeps the variable terms, not the constant
    assert affine(gathered + j, lambda e: True) == ({i.uid: 8, j.uid: 1}, None)
    assert stride_of(gathered * j, j) is None and stride_of(gathered + j * 3, j) == 3


def test_statement_walks_see_every_expression_and_buffer():
    i = Var("i")
    x, y, z, w = buffer((4,)), buffer((4,)), buffer((4,)), buffer((4,))
    acc = Local("acc", "f32")
    add = Assign(acc, acc + x[i])
    store = Store(y, i, z[i])
    call = Intrinsic(GemmSpec(4, 1, 1), ContractionOperands(w, x, y))
    guard = If(lt(i, 2), [add], [store])
    body = [Loop(i, 4, [guard]), call]
    assert [type(s) for s in walk_stmts(body)] == [Loop, If, Assign, Store, Intrinsic]
    assert guard.exprs() == (guard.cond,) and store.exprs() == (store.index, store.value)
    assert [load.buffer for load in loads_in(body)] == [x, z]
    assert list(buffers_accessed(body)) == [x, y, z, w, x, y]


def test_reduction_steps_fold_a_term_free_of_the_accumulator():
    i = Var("i")
    x = buffer((4,))
    acc, other = Local("acc", "f32"), Local("other", "f32")
    term = x[i]
    step = reduction_step(Assign(acc, term * acc))
    assert step.op == "mul" and step.operand is term
    assert reduction_step(Assign(acc, acc - x[i])) is None                  # not associative
    assert reduction_step(Assign(acc, acc + acc * x[i])) is None            # the term reads acc
    assert accumulators([Loop(i, 4, [Assign(acc, acc + x[i]), Assign(other, other + 1.0)])]) == \
        {acc.uid: (acc, "add"), other.uid: (other, "add")}
    assert accumulators([Assign(acc, acc + x[i]), Assign(acc, maximum(acc, x[i]))]) is None   # two ops


@pytest.mark.parametrize("out,ins,expected", [
    ((2, 3, 4), [(2, 3, 4), (2, 3, 4)], ((24,), [(24,), (24,)])),
    ((2, 3, 4), [(2, 3, 4), (4,)], ((6, 4), [(6, 4), (1, 4)])),
    ((2, 3, 4), [(2, 3, 4), (3, 1)], ((2, 3, 4), [(2, 3, 4), (1, 3, 1)])),
    ((2, 3, 4), [(2, 3, 4), ()], ((24,), [(24,), (1,)])),
])
def test_broadcast_collapses_to_the_fewest_loops(out, ins, expected):
    assert collapse_broadcast(out, ins) == expected


def lowered(nodes, inputs, outputs, initializers=()):
    graph = import_model(make_model(nodes, inputs, outputs, initializers))
    graph, _ = run_pipeline(graph, optimize_pipeline(require_static=True))
    return lower_graph(graph)


def test_elementwise_kernel_is_one_contiguous_vectorisable_loop():
    program = lowered([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", T.FLOAT, [2, 3, 5])],
                      [helper.make_tensor_value_info("y", T.FLOAT, [2, 3, 5])])
    (kernel,) = program.kernels
    (loop,) = kernel.body
    assert isinstance(loop, Loop) and loop.extent == 30 and vectorizable(loop)


def test_gather_loop_is_not_vectorised():
    program = lowered([helper.make_node("Gather", ["table", "ids"], ["y"])],
                      [helper.make_tensor_value_info("ids", T.INT64, [8])],
                      [helper.make_tensor_value_info("y", T.FLOAT, [8])],
                      [helper.make_tensor("table", T.FLOAT, [16], np.arange(16, dtype=np.float32).tolist())])
    loops = [s for s in walk_stmts(program.kernels[0].body) if isinstance(s, Loop)]
    assert loops and not any(vectorizable(loop) for loop in loops)


def test_matmul_inner_loop_streams_rows():
    program = lowered([helper.make_node("MatMul", ["x", "w"], ["y"])],
                      [helper.make_tensor_value_info("x", T.FLOAT, [3, 5])],
                      [helper.make_tensor_value_info("y", T.FLOAT, [3, 8])],
                      [helper.make_tensor("w", T.FLOAT, [5, 8], np.ones(40, dtype=np.float32).tolist())])
    innermost = [s for s in walk_stmts(program.kernels[0].body)
                 if isinstance(s, Loop) and all(isinstance(b, Store) for b in s.body)]
    assert innermost and all(vectorizable(loop) for loop in innermost)


def test_reshape_is_a_view_not_a_copy():
    program = lowered([helper.make_node("Reshape", ["x", "s"], ["r"]), helper.make_node("Neg", ["r"], ["y"])],
                      [helper.make_tensor_value_info("x", T.FLOAT, [2, 6])],
                      [helper.make_tensor_value_info("y", T.FLOAT, [3, 4])],
                      [helper.make_tensor("s", T.INT64, [2], [3, 4])])
    assert [k.op_type for k in program.kernels if k.body] == ["Neg"]
    assert len([s for s in program.storages if s.kind == "temp"]) == 0


def test_unsupported_ops_are_named_with_their_nodes():
    with pytest.raises(UnsupportedError, match=r"TfIdfVectorizer \(count_ngrams\)"):
        lowered([helper.make_node("TfIdfVectorizer", ["x"], ["y"], name="count_ngrams", mode="TF", min_gram_length=1,
                                  max_gram_length=1, max_skip_count=0, ngram_counts=[0], ngram_indexes=[0, 1, 2],
                                  pool_int64s=[2, 3, 5])],
                [helper.make_tensor_value_info("x", T.INT64, [2, 6])],
                [helper.make_tensor_value_info("y", T.FLOAT, [2, 3])])


def test_temporaries_share_memory_once_dead():
    """A chain of elementwise ops needs two live temporaries at a time, not one per op."""
    nodes = [helper.make_node("Neg", [f"t{i}"], [f"t{i + 1}"]) for i in range(6)]
    program = lowered(nodes, [helper.make_tensor_value_info("t0", T.FLOAT, [256])],
                      [helper.make_tensor_value_info("t6", T.FLOAT, [256])])
    memory, arena = place_storages(program)
    plan = describe_plan(program, memory, arena)
    assert plan["temp_bytes"] == 5 * 1024 and arena == 2 * 1024
    temps = [s for s in program.storages if s.kind == "temp"]
    for a, b in zip(temps, temps[1:]):      # neighbours in the chain are alive together
        assert a.offset != b.offset


def test_sum_and_max_reductions_vectorise_with_partial_lanes():
    program = lowered([helper.make_node("ReduceSum", ["x", "axes"], ["s"]), helper.make_node("ReduceMax", ["x", "axes"], ["m"])],
                      [helper.make_tensor_value_info("x", T.FLOAT, [3, 64])],
                      [helper.make_tensor_value_info("s", T.FLOAT, None), helper.make_tensor_value_info("m", T.FLOAT, None)],
                      [helper.make_tensor("axes", T.INT64, [1], [1])])
    inner = [s for k in program.kernels for s in walk_stmts(k.body) if isinstance(s, Loop) and s.extent == 64]
    assert len(inner) == 2 and all(vectorizable(loop) for loop in inner)


def test_selecting_accumulators_stay_scalar():
    """ArgMax's running best and its index update together through selects: no partial lanes."""
    from ir.loops import Assign
    program = lowered([helper.make_node("ArgMax", ["x"], ["y"], axis=1)], [helper.make_tensor_value_info("x", T.FLOAT, [2, 16])],
                      [helper.make_tensor_value_info("y", T.INT64, None)])
    loops = [s for s in walk_stmts(program.kernels[0].body) if isinstance(s, Loop) and any(isinstance(b, Assign) for b in s.body)]
    assert loops and not any(vectorizable(loop) for loop in loops)

"""The Ray executor and parallel compile on a local multi-node cluster that never leaves loopback:
outputs equal a local run (and onnxruntime), a batch is pipelined, a node removed mid-batch
changes nothing the caller sees, the actors load from their node's copy of the artifacts (the dag
folder may be gone), conditional CUs skip and trace as locally, and CUs compiled as Ray tasks are
byte-identical to a local build.

The cluster (`ray.cluster_utils.Cluster`, a head and two workers of 1 CPU each) is started once per
session. `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, set before Ray is imported, keeps every node on
127.0.0.1 (by default Ray swaps it for the machine's interface address); the CLI subprocesses
inherit it. A test checks that no connection of the Ray processes leaves loopback.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli
from test_conditional_cus import build, if_model, with_output_z
from testdata import run_onnxruntime, sample_model
from wasm_cases import compile_pipeline

import cortex
from backends.registry import target
from backends.wasm.options import parse_options
from cortex.compile import compile_cu_dir
from cortex.runtime.ray_cluster import lost_errors, ray_map
from cortex.runtime.ray_plan import pipeline_shape, stage_cuts
from cortex.runtime.trace import validate_trace
from ir.errors import CortexError

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray reads it once, when it is first imported: it must be set before that, for this process.
os.environ.update(LOOPBACK_ENV)
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster

from bench.bench_ray import chain_model  # imports Ray

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


@pytest.fixture(scope="session")
def cluster():
    # A removed node is declared dead after 2 missed health checks 0.5 s apart, not Ray's 15 s.
    config = {"health_check_period_ms": 500, "health_check_failure_threshold": 2}
    started = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "_system_config": config})
    for _ in range(2):
        started.add_node(num_cpus=1)
    started.wait_for_nodes()
    ray.init(address=started.address, logging_level="ERROR", log_to_driver=False)
    yield started
    ray.shutdown()
    started.shutdown()


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    case = sample_model("cnn")
    return case, compile_pipeline(case.path, tmp_path_factory.mktemp("cnn"), min_cu_size=64, max_cu_depth=3)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Six MatMul [32,256]x[256,256] + Relu, a CU each: requests slow enough (a millisecond or so)
    that a batch's later ones are still queued on an actor when a node goes."""
    folder = tmp_path_factory.mktemp("chain")
    model = chain_model(folder / "chain.onnx", layers=6, rows=32, width=256)
    return "r5", compile_pipeline(model, folder, min_cu_size=0, max_cu_depth=2)


@pytest.fixture(scope="module")
def branching(tmp_path_factory):
    """The If model of test_conditional_cus with a computed condition (sum(x @ w0) > 0: x's sign
    picks the branch) and a second output z that needs no branch CU."""
    folder = tmp_path_factory.mktemp("branching")
    build(folder, with_output_z(if_model("computed")))
    x = np.abs(np.random.default_rng(3).standard_normal((1, 64))).astype(np.float32)
    return folder, [{"x": x}, {"x": -x}]


def _feeds(case, n: int) -> list[dict]:
    rng = np.random.default_rng(7)
    return [{name: rng.standard_normal(v.shape).astype(v.dtype) for name, v in case.inputs.items()} for _ in range(n)]


# -- without a cluster ------------------------------------------------------------------------


def test_stage_cuts_balance_the_costliest_stage():
    costs = [10, 1, 1, 1, 10, 1, 1, 1]
    cuts = stage_cuts(costs, 2)
    parts = [sum(costs[a:b]) for a, b in zip([0, *cuts], [*cuts, len(costs)])]
    assert cuts == [4] and parts == [13, 13]
    assert stage_cuts([5.0], 3) == []                       # never more stages than CUs
    assert len(stage_cuts([1.0] * 6, 3)) == 2               # every stage asked for is used


def test_the_default_shape_is_a_replica_per_free_cpu_unless_no_node_holds_the_model():
    gib = 1 << 30
    # (stages, replicas) from: asked stages, asked replicas, free CPUs, CPUs per actor, CUs, model
    # bytes, largest node's bytes, compiled_graph.
    assert pipeline_shape(None, None, 3.0, 1.0, 8, gib, 4 * gib, False) == (1, 3)
    assert pipeline_shape(None, None, 3.0, 1.0, 8, 8 * gib, 4 * gib, False) == (3, 1)      # no node holds it
    assert pipeline_shape(None, None, 3.0, 1.0, 2, 8 * gib, 4 * gib, False) == (2, 1)      # one stage per CU at most
    assert pipeline_shape(None, None, 3.0, 1.0, 8, gib, 4 * gib, True) == (3, 1)           # a graph drives one pipeline
    assert pipeline_shape(2, None, 3.0, 1.0, 8, gib, 4 * gib, False) == (2, 1)
    assert pipeline_shape(None, 2, 3.0, 1.0, 8, gib, 4 * gib, False) == (1, 2)
    assert pipeline_shape(None, None, 3.0, 2.0, 8, gib, 4 * gib, False) == (1, 1)
    with pytest.raises(CortexError, match=r"3 free CPUs, 2 x 2 stages of 1 CPUs need 4"):
        pipeline_shape(2, 2, 3.0, 1.0, 8, gib, 4 * gib, False)
    with pytest.raises(CortexError, match="compiled_graph drives one pipeline, not 2 replicas"):
        pipeline_shape(None, 2, 3.0, 1.0, 8, gib, 4 * gib, True)


def test_cli_refuses_an_unknown_executor_or_an_address_without_ray(cnn):
    _, dag_path = cnn
    assert_one_line_error(*run_cli(["run", dag_path, "--example-inputs", "--executor", "mpi"])[::2],
                          "--executor mpi", "local or ray")
    assert_one_line_error(*run_cli(["run", dag_path, "--example-inputs", "--address", "127.0.0.1:1"])[::2],
                          "--address", "--executor ray")
    assert_one_line_error(*run_cli(["run", dag_path, "--example-inputs", "--executor-option", "replicas=2"])[::2],
                          "--executor-option", "--executor ray")
    assert_one_line_error(*run_cli(["bench", dag_path, "--executor", "ray", "--executor-option", "replicas"])[::2],
                          "--executor-option 'replicas'", "KEY=VALUE")
    assert_one_line_error(*run_cli(["run", dag_path, "--example-inputs", "--executor", "ray",
                                    "--executor-option", "stage=2"])[::2], "unknown executor option 'stage'")


@pytest.mark.slow
def test_cli_names_an_address_where_no_ray_head_answers(cnn):
    _, dag_path = cnn
    assert_one_line_error(*run_cli(["run", dag_path, "--example-inputs", "--executor", "ray",
                                    "--address", "127.0.0.1:1"], env=LOOPBACK_ENV)[::2],
                          "--address 127.0.0.1:1", "no Ray head answers")


# -- on the local cluster -----------------------------------------------------------------------


@pytest.mark.slow
def test_outputs_equal_a_local_run_and_onnxruntime(cluster, cnn):
    case, dag_path = cnn
    local = cortex.load(dag_path, policy="strict").run(case.inputs)
    model = cortex.load(dag_path, policy="strict", executor="ray", executor_options={"stages": 2})
    try:
        placement = model.scheduler.placement()
        assert len(placement) == 2 and placement[0]["node"] != placement[1]["node"]   # one stage per node
        got = model.run(case.inputs)
        np.testing.assert_array_equal(got["y"], local["y"])
        np.testing.assert_allclose(got["y"], case.outputs["y"], rtol=1e-4, atol=1e-5)
        validate_trace(model.last_trace)
        assert model.last_trace["activated_cus"] == json.loads(dag_path.read_text())["order"]
        # The same input checks, with the same words, as a local model.
        with pytest.raises(CortexError, match="input 'x' has dtype float64, the model expects float32"):
            model.run({"x": case.inputs["x"].astype(np.float64)})
        with pytest.raises(CortexError, match="unknown output 'z'"):
            model.run(case.inputs, outputs=["z"])
    finally:
        model.close()


@pytest.mark.slow
def test_replicas_spread_over_the_nodes_and_take_turns(cluster, cnn):
    case, dag_path = cnn
    batch = _feeds(case, 9)
    local = cortex.load(dag_path, policy="strict")
    model = cortex.load(dag_path, policy="strict", executor="ray")      # the default: a replica per free CPU
    try:
        placement = model.scheduler.placement()
        order = json.loads(dag_path.read_text())["order"]
        assert [p["replica"] for p in placement] == [0, 1, 2] and all(p["cus"] == order for p in placement)
        assert len({p["node"] for p in placement}) == 3          # one replica per node
        for feeds, got in zip(batch, model.run_many(batch), strict=True):
            np.testing.assert_array_equal(got["y"], local.run(feeds)["y"])
        assert model.last_trace["activated_cus"] == order and model.last_trace["skipped_cus"] == []
    finally:
        model.close()
    with pytest.raises(CortexError, match="replicas must be a whole number, at least 1"):
        cortex.load(dag_path, executor="ray", executor_options={"replicas": 0})


@pytest.mark.slow
def test_a_changed_artifact_is_refused_with_the_local_error(cluster, cnn, tmp_path):
    _, dag_path = cnn
    copy = tmp_path / "bundle"
    shutil.copytree(dag_path.parent, copy)
    module = next((copy / "wasm-bin").glob("*.wasm"))
    module.write_bytes(module.read_bytes() + b"\0")
    with pytest.raises(CortexError) as local:
        cortex.load(copy / "dag.json")
    with pytest.raises(CortexError) as remote:
        cortex.load(copy / "dag.json", executor="ray", executor_options={"stages": 1})
    assert str(remote.value) == str(local.value)
    with pytest.raises(CortexError, match="unknown executor option 'stage'"):
        cortex.load(dag_path, executor="ray", executor_options={"stage": 1})


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 4, 5])
def test_a_pipelined_batch_equals_request_by_request_local_runs(cluster, cnn, group):
    case, dag_path = cnn
    batch = _feeds(case, 11)          # groups of 4 and of 5 leave a short last one
    local = cortex.load(dag_path)
    model = cortex.load(dag_path, executor="ray", executor_options={"stages": 2, "group": group})
    try:
        for feeds, got in zip(batch, model.run_many(batch), strict=True):
            np.testing.assert_array_equal(got["y"], local.run(feeds)["y"])
        assert model.run_many([]) == []
    finally:
        model.close()


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, stack = set(), [root]
    while stack:
        pid = stack.pop()
        for child in children.get(pid, []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


@pytest.mark.slow
def test_no_connection_of_the_cluster_leaves_loopback(cluster, cnn):
    case, dag_path = cnn
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    model = cortex.load(dag_path, executor="ray", executor_options={"stages": 2})
    try:
        pids = _descendants(os.getpid()) | {os.getpid()}
        seen = []
        for _ in range(3):
            model.run_many(_feeds(case, 4))
            lines = subprocess.run(["ss", "-tnp"], check=True, capture_output=True, text=True, timeout=30).stdout.splitlines()
            for line in lines[1:]:
                owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
                if owners & pids:
                    local, peer = line.split()[3:5]
                    seen.append((local.rsplit(":", 1)[0].strip("[]"), peer.rsplit(":", 1)[0].strip("[]")))
        assert seen, "no connection of the Ray processes was seen"
        assert {address for pair in seen for address in pair} <= LOOPBACK, seen
    finally:
        model.close()


@pytest.mark.slow
# The node goes while later requests are queued on its actor: its actor's process is killed with
# it (a process can outlive its raylet for a moment and serve what it has queued), so those calls
# fail and are resubmitted, to the other replica where there is one.
@pytest.mark.parametrize("shape", [{"stages": 2}, {"replicas": 2}], ids=["stages", "replicas"])
def test_a_node_removed_mid_batch_changes_no_output(cluster, chain, shape):
    output, dag_path = chain
    rng = np.random.default_rng(9)
    batch = [{"x": rng.standard_normal((32, 256)).astype(np.float32)} for _ in range(48)]
    local = cortex.load(dag_path)
    expected = [local.run(feeds)[output] for feeds in batch]
    model = cortex.load(dag_path, executor="ray", executor_options={**shape, "group": 1})
    executor = model.scheduler
    head = cluster.head_node.node_id
    placement = executor.placement()
    victim_id = next(p["node"] for p in placement if p["node"] != head)
    victim = next(n for n in cluster.list_all_nodes() if n.node_id == victim_id)
    removed = []

    def remove_a_node(index: int) -> None:
        if index == 1 and not removed:      # requests 2.. are in flight, some queued on the victim's actor
            for p in placement:
                if p["node"] == victim_id:
                    os.kill(p["pid"], signal.SIGKILL)
            cluster.remove_node(victim, allow_graceful=False)
            removed.append(victim_id)

    try:
        done = executor.run_many(batch, model.policy, [output], window=24, on_done=remove_a_node)
        assert removed and executor.resubmitted >= 1
        for (got, _), want in zip(done, expected, strict=True):
            np.testing.assert_array_equal(got[output], want)
        # The restarted actor serves the next requests on a node that is still there.
        assert victim_id not in {p["node"] for p in executor.placement()}
        np.testing.assert_array_equal(model.run(batch[0])[output], expected[0])
    finally:
        model.close()
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()


@pytest.mark.slow
def test_parallel_compile_is_byte_identical_to_a_local_compile(cluster, cnn, tmp_path):
    _, dag_path = cnn
    cu_dir, options = dag_path.parent / "cus", parse_options(None, "simd,bulk-memory", "2")
    compile_cu_dir(target("wasm"), cu_dir, tmp_path / "local", options)
    compile_cu_dir(target("wasm"), cu_dir, tmp_path / "ray", options, map_cus=ray_map)
    names = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "ray").iterdir()) and len(names) > 2
    for name in names:
        assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name


@pytest.mark.slow
def test_the_cli_compiles_and_runs_on_the_cluster(cluster, cnn, tmp_path):
    case, dag_path = cnn
    address = cluster.address
    code, out, err = run_cli(["compile-wasm", "--cu-dir", dag_path.parent / "cus", "--output", tmp_path / "wasm",
                              "--features", "simd,bulk-memory", "--opt-level", "2",
                              "--executor", "ray", "--address", address, "--json"], env=LOOPBACK_ENV)
    assert code == 0, err
    assert json.loads(out)["cus"] == len(json.loads(dag_path.read_text())["cus"])
    for built in (tmp_path / "wasm").glob("*.wasm"):
        assert built.read_bytes() == (dag_path.parent / "wasm-bin" / built.name).read_bytes(), built.name
    np.save(tmp_path / "x.npy", case.inputs["x"])
    code, out, err = run_cli(["run", dag_path, "--input", f"x={tmp_path / 'x.npy'}", "--output", tmp_path / "y.npz",
                              "--executor", "ray", "--address", address, "--executor-option", "replicas=2",
                              "--executor-option", "group=2", "--executor-option", "timeout_s=120.5"],
                             env=LOOPBACK_ENV)
    assert code == 0, err
    local = cortex.load(dag_path).run(case.inputs)
    np.testing.assert_array_equal(np.load(tmp_path / "y.npz")["y"], local["y"])
    code, out, err = run_cli(["bench", dag_path, "--repeat", "2", "--warmup", "1", "--executor", "ray",
                              "--address", address, "--json"], env=LOOPBACK_ENV)
    assert code == 0, err
    assert json.loads(out)["runs"] == 2


# -- without the dag folder on the nodes --------------------------------------------------------


@pytest.mark.slow
def test_actors_load_from_their_nodes_copy_when_the_folder_is_gone(cluster, cnn, tmp_path):
    case, dag_path = cnn
    bundle, moved, node_cache = tmp_path / "bundle", tmp_path / "moved", tmp_path / "node-cache"
    shutil.copytree(dag_path.parent, bundle)
    local = cortex.load(dag_path, policy="strict").run(case.inputs)
    model = cortex.load(bundle / "dag.json", policy="strict", executor="ray",
                        executor_options={"stages": 2, "cache_dir": str(node_cache)})
    try:
        bundle.rename(moved)           # from here on no process can read the driver's folder
        placement = model.scheduler.placement()
        for stage in placement:
            assert Path(stage["dag_path"]).is_relative_to(node_cache), stage
        np.testing.assert_array_equal(model.run(case.inputs)["y"], local["y"])
        # The node's copy: each file a hard link to a blob named by its sha256, at dag.json's path.
        dag = json.loads((moved / "dag.json").read_text())
        copy = Path(placement[0]["dag_path"]).parent
        for cu in dag["cus"]:
            shipped = copy / cu["artifacts"]["wasm"]["path"]
            assert hashlib.sha256(shipped.read_bytes()).hexdigest() == cu["artifacts"]["wasm"]["sha256"]
            assert (node_cache / "blobs" / cu["artifacts"]["wasm"]["sha256"]).samefile(shipped)
        assert not (copy / "cus").exists()          # a wasm stage needs no cu.onnx
        # A live actor whose node copy was deleted makes it again before it serves.
        shutil.rmtree(node_cache)
        np.testing.assert_array_equal(model.run(case.inputs)["y"], local["y"])
        assert all(Path(stage["dag_path"]).is_file() for stage in placement)
        first = dag["cus"][0]["artifacts"]["wasm"]
        assert (node_cache / "blobs" / first["sha256"]).samefile(copy / first["path"])
        # Actors restarted on an empty cache fetch every file again from the object store.
        shutil.rmtree(node_cache)
        for stage in model.scheduler.stages:
            ray.kill(stage.actor, no_restart=False)
        restarted = _restarted(model.scheduler, [stage["pid"] for stage in placement])
        assert (node_cache / "blobs").is_dir()
        assert all(Path(stage["dag_path"]).is_file() for stage in restarted)
        np.testing.assert_array_equal(model.run(case.inputs)["y"], local["y"])
    finally:
        model.close()


def _restarted(executor, pids: list[int], patience_s: float = 60.0) -> list[dict]:
    """Each stage's placement once every actor answers from a process other than `pids`' (ray.kill
    returns before the actor dies, and until then the old process still serves calls)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            now = ray.get([stage.actor.where.remote() for stage in executor.stages],
                          timeout=max(0.1, deadline - time.monotonic()))
            if all(place["pid"] != pid for place, pid in zip(now, pids, strict=True)):
                return now
        except (*lost_errors(ray), ray.exceptions.GetTimeoutError):
            pass                        # dead, not yet restarted
        assert time.monotonic() < deadline, f"the killed actors did not restart in {patience_s:g} s"
        time.sleep(0.1)


# -- conditional CUs ----------------------------------------------------------------------------


def _skips(trace: dict) -> list[tuple[str, str]]:
    return [(s["cu"], s["reason"]) for s in trace["skipped_cus"]]


@pytest.mark.slow
def test_conditional_cus_skip_and_trace_as_in_a_local_run(cluster, branching):
    folder, batch = branching
    dag_path = folder / "dag.json"
    dag = json.loads(dag_path.read_text())
    branch_cus = {cu["id"] for cu in dag["cus"] if "activation" in cu}
    local = cortex.load(dag_path, cache_bytes=0, threads=1)
    model = cortex.load(dag_path, cache_bytes=0, executor="ray", executor_options={"stages": 3})
    try:
        executor = model.scheduler
        stages = [set(s["cus"]) for s in executor.placement()]
        (reader,) = [cu["id"] for cu in dag["cus"] if "picked" in cu["inputs"]]
        # The If's select crosses stages: its cases and its reader are not all on one actor.
        assert not any(branch_cus | {reader} <= stage for stage in stages)
        taken = set()
        # Under strict every CU runs whatever is asked for: one set of outputs is enough.
        for policy, outputs in (("balanced", None), ("balanced", ["z"]), ("balanced", ["y"]), ("strict", ["z"])):
            for feeds in batch:
                want = local.run(feeds, outputs=outputs, policy=policy)
                got = model.run(feeds, outputs=outputs, policy=policy)
                assert got.keys() == want.keys()
                for name in got:
                    np.testing.assert_array_equal(got[name], want[name])
                assert model.last_trace["activated_cus"] == local.last_trace["activated_cus"]
                assert _skips(model.last_trace) == _skips(local.last_trace)
                validate_trace(model.last_trace)
                if policy == "balanced" and outputs is None:
                    np.testing.assert_allclose(got["y"], run_onnxruntime(folder / "m.onnx", feeds)["y"],
                                               rtol=1e-5, atol=1e-5)
                    inactive = {cu for cu, reason in _skips(local.last_trace) if reason == "inactive branch"}
                    assert inactive and inactive < branch_cus
                    taken.add(frozenset(branch_cus - inactive))
                if outputs == ["z"] and policy == "balanced":
                    assert not branch_cus & set(model.last_trace["activated_cus"])
        assert len(taken) == 2                       # x's sign took each branch once
        # A CU of the untaken branch leaves no tensor on any actor: the stages return only what exists.
        model.run(batch[0], outputs=["y"])
        plan = executor.planner.plan(executor.needed(["y"]), ["y"])
        refs, _ = executor._submit([batch[0]], model.policy, plan)
        shipped = {name for stage in refs for part in ray.get(stage) for name in part}
        made = {name for cu in dag["cus"] if cu["id"] in model.last_trace["activated_cus"] for name in cu["outputs"]}
        unmade = {name for cu in dag["cus"] if cu["id"] in branch_cus for name in cu["outputs"]} - made
        assert unmade and not shipped & unmade
    finally:
        model.close()


@pytest.mark.slow
def test_a_compiled_graph_runs_a_static_dag_as_the_actor_path_does(cluster, cnn):
    case, dag_path = cnn
    batch = _feeds(case, 6)
    local = cortex.load(dag_path, cache_bytes=0, threads=1)
    # Every wait is bounded: a hang ends in a minute, as one CortexError.
    model = cortex.load(dag_path, cache_bytes=0, executor="ray",
                        executor_options={"stages": 2, "compiled_graph": True, "timeout_s": 60})
    executor = model.scheduler
    try:
        # The first stage is on this process's node: requests enter through shared memory.
        placement = executor.placement()
        assert placement[0]["node"] == ray.get_runtime_context().get_node_id() != placement[1]["node"]
        for _ in range(2):              # the second batch through the same graph
            for feeds, got in zip(batch, model.run_many(batch), strict=True):
                np.testing.assert_array_equal(got["y"], local.run(feeds)["y"])
        graph = executor._graph
        assert graph is not None and executor.resubmitted == 0
        assert model.last_trace["activated_cus"] == local.last_trace["activated_cus"]
        validate_trace(model.last_trace)
        # Another policy is another plan through the same graph, not another graph.
        np.testing.assert_array_equal(model.run(case.inputs, policy="strict")["y"], local.run(case.inputs)["y"])
        assert executor._graph is graph
    finally:
        model.close()


@pytest.mark.slow
def test_a_compiled_graph_skips_conditional_cus_as_a_local_run(cluster, branching):
    folder, batch = branching
    dag_path = folder / "dag.json"
    local = cortex.load(dag_path, cache_bytes=0, threads=1)
    model = cortex.load(dag_path, cache_bytes=0, executor="ray",
                        executor_options={"stages": 3, "compiled_graph": True, "timeout_s": 60})
    try:
        graph = None
        for policy, outputs in (("balanced", None), ("balanced", ["z"]), ("strict", ["z"]), ("balanced", None)):
            got_batch = model.run_many(batch * 2, outputs=outputs, policy=policy)
            for feeds, got in zip(batch * 2, got_batch, strict=True):
                want = local.run(feeds, outputs=outputs, policy=policy)
                assert got.keys() == want.keys()
                for name in got:
                    np.testing.assert_array_equal(got[name], want[name])
            # The last request's trace: the branch its condition took, the CUs no output needed.
            assert model.last_trace["activated_cus"] == local.last_trace["activated_cus"]
            assert _skips(model.last_trace) == _skips(local.last_trace)
            validate_trace(model.last_trace)
            graph = graph or model.scheduler._graph
            assert model.scheduler._graph is graph and model.scheduler.resubmitted == 0
    finally:
        model.close()

"""What the Ray executor ships and plans, without a cluster: the files each CU's device loads, each
node's copy of them (blobs by sha256, hard-linked into a dag folder, fetched only when missing or
corrupted), errors that name the driver's folder, and the plan of a conditional model's calls
(which stage returns a select, where a condition goes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortex.runtime.ray_artifacts import (
    bundle_key,
    local_error,
    materialise,
    read_files,
    stage_files,
)
from cortex.runtime.ray_plan import Planner, stage_dag
from cortex.runtime.scheduler import needed_cus
from ir.errors import CortexError
from ir.fs import sha256_bytes


def _bundle(folder: Path, files: dict[str, bytes]) -> list[str]:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return list(files)


def test_each_content_is_fetched_once_and_linked_where_dag_json_names_it(tmp_path):
    driver, node = tmp_path / "driver", tmp_path / "node"
    paths = _bundle(driver, {"wasm-bin/a.wasm": b"module", "weights/w.bin": b"weights", "wasm-bin/b.wasm": b"module"})
    files, contents = read_files(driver, [*paths, "wasm-bin/gone.wasm"])
    assert sorted(contents) == sorted({sha256_bytes(b"module"), sha256_bytes(b"weights")})
    assert files[-1].sha256 is None                       # a missing file is shipped as missing
    fetched = []

    def fetch(sha256):
        fetched.append(sha256)
        return contents[sha256]

    dag_path = materialise(node, bundle_key({"v": 1}, files), {"v": 1}, files, fetch)
    assert sorted(fetched) == sorted(contents)            # "module" twice in the bundle, fetched once
    for path in paths:
        assert (dag_path.parent / path).read_bytes() == (driver / path).read_bytes()
        assert (dag_path.parent / path).samefile(node / "blobs" / sha256_bytes((driver / path).read_bytes()))
    assert not (dag_path.parent / "wasm-bin/gone.wasm").exists()
    assert dag_path.read_text().strip().startswith("{")

    # Another bundle on the node: its blobs are there (hashed once, not fetched); a corrupted one is fetched.
    fetched.clear()
    materialise(node, bundle_key({"v": 2}, files), {"v": 2}, files, fetch)
    assert fetched == []
    blob = node / "blobs" / sha256_bytes(b"weights")
    blob.unlink()
    blob.write_bytes(b"wEights")
    materialise(node, bundle_key({"v": 3}, files), {"v": 3}, files, fetch)
    assert fetched == [sha256_bytes(b"weights")] and blob.read_bytes() == b"weights"


def test_a_content_damaged_on_the_way_is_refused(tmp_path):
    driver = tmp_path / "driver"
    files, _ = read_files(driver, _bundle(driver, {"m.wasm": b"module"}))
    with pytest.raises(CortexError, match="m.wasm: the copy Ray delivered to this node differs"):
        materialise(tmp_path / "node", "k", {}, files, lambda sha256: b"other")


def test_a_changed_file_is_a_different_bundle(tmp_path):
    driver = tmp_path / "driver"
    paths = _bundle(driver, {"m.wasm": b"module"})
    before = bundle_key({}, read_files(driver, paths)[0])
    (driver / "m.wasm").write_bytes(b"module!")
    assert bundle_key({}, read_files(driver, paths)[0]) != before


def test_an_error_on_a_node_names_the_drivers_folder(tmp_path):
    copy = tmp_path / "node" / "bundles" / "k" / "dag.json"
    error = CortexError(f"{copy.parent / 'wasm-bin' / 'cu-0001.wasm'}: sha256 differs from {copy} (modified)")
    assert str(local_error(error, copy, "out/dag.json", "/home/me/out")) == \
        "/home/me/out/wasm-bin/cu-0001.wasm: sha256 differs from out/dag.json (modified)"


def _wasm(path: str, weights: list[str] = ()) -> dict:
    return {"path": path, "sha256": "0" * 64, "weights": [{"path": w, "offset": 0, "bytes": 1, "sha256": "0" * 64}
                                                         for w in weights]}


def test_each_cu_ships_what_its_device_loads():
    dag = {"cus": [
        {"id": "a", "path": "cus/a/cu.onnx", "artifacts": {"wasm": _wasm("wasm-bin/a.wasm", ["wasm-bin/weights/w.bin"])},
         "variants": {"fp16": {"artifacts": {"wasm": _wasm("wasm-bin/a.fp16.wasm")}}}},
        {"id": "b", "path": "cus/b/cu.onnx", "runs_on": "onnxruntime", "artifacts": {}},
        {"id": "c", "path": "cus/c/cu.onnx", "artifacts": {"wasm": _wasm("wasm-bin/c.wasm")}}]}
    assert stage_files(dag, "wasm", ["a", "b"]) == ["wasm-bin/a.wasm", "wasm-bin/weights/w.bin",
                                                    "wasm-bin/a.fp16.wasm", "cus/b/cu.onnx"]
    assert stage_files(dag, "onnxruntime", ["a", "c"]) == ["cus/a/cu.onnx", "cus/c/cu.onnx"]


def _if_dag() -> dict:
    """a: x -> h, cond; b (cond True): h -> t; c (cond False): h -> e; d: picked, h -> y; z from a."""
    def cu(cu_id, inputs, outputs, when=None):
        record = {"id": cu_id, "inputs": inputs, "outputs": outputs}
        return {**record, "activation": {"tensor": "cond", "equals": when}} if when is not None else record
    cus = [cu("a", ["x"], ["h", "cond", "z"]), cu("b", ["h"], ["t"], True), cu("c", ["h"], ["e"], False),
           cu("d", ["picked", "h"], ["y"])]
    producer = {name: c["id"] for c in cus for name in c["outputs"]}
    tensors = {name: {"producer": producer.get(name)} for name in ["x", "h", "cond", "z", "t", "e", "picked", "y"]}
    return {"cus": cus, "order": ["a", "b", "c", "d"], "tensors": tensors, "inputs": [{"name": "x"}],
            "selects": [{"tensor": "picked", "condition": "cond",
                         "cases": [{"equals": True, "tensor": "t"}, {"equals": False, "tensor": "e"}]}]}


def test_a_select_comes_from_each_stage_holding_one_of_its_cases():
    dag = _if_dag()
    planner = Planner(dag, [["a"], ["b"], ["c", "d"]])
    everything = needed_cus(dag, planner.producer, planner.cus, ["y", "z"])
    calls = {call.stage: call for call in planner.plan(everything, ["y", "z"])}
    assert calls[0].returns == ["h", "cond", "z"] and calls[0].feeds
    assert calls[1].returns == ["picked"] and calls[1].reads == [0] and not calls[1].feeds
    assert calls[2].returns == ["y"] and calls[2].reads == [0, 1]
    # Stage 2 writes the other case of the select itself; stage 1 knows only its own.
    assert stage_dag(dag, ["c", "d"])["selects"][0]["cases"] == [{"equals": False, "tensor": "e"}]
    assert stage_dag(dag, ["b"])["tensors"]["h"]["producer"] is None
    # Asking for z alone calls only the first stage.
    only_z = planner.plan(needed_cus(dag, planner.producer, planner.cus, ["z"]), ["z"])
    assert [(c.stage, c.returns) for c in only_z] == [(0, ["z"])]

"""dag.json: follows its shipped JSON Schema, its order and levels respect every edge, its tensors
and edges agree with the manifest, and the DOT rendering shows the same graph."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from cortex.commands.decompose import decompose_model
from cortex.dag import SCHEMA_FILE, build_dag, dag_schema, to_dot, validate_dag
from ir.fs import write_bytes_atomically
from testdata import sample_model
from passes.partition import PartitionIntoCUs


@pytest.fixture(scope="module")
def transformer_dag(tmp_path_factory) -> tuple[dict, Path]:
    case = sample_model("transformer_block")
    folder = tmp_path_factory.mktemp("dag")
    decompose_model(case.path, folder / "cus", PartitionIntoCUs(min_cu_size=256, max_cu_size=1_000_000,
                                                                max_cu_depth=1),
                    input_shapes=case.input_shapes, dims=case.dims)
    dag = build_dag(folder / "cus", folder / "out" / "dag.json")
    return dag, folder


def test_the_schema_ships_inside_the_package():
    assert SCHEMA_FILE.parent.name == "schemas" and SCHEMA_FILE.parent.parent.name == "cortex"
    jsonschema.Draft202012Validator.check_schema(dag_schema())


def test_written_dag_follows_the_schema(transformer_dag):
    dag, _ = transformer_dag
    validate_dag(json.loads(json.dumps(dag)))
    assert dag["schema"] == "cortex.dag/1"
    assert all(cu["artifacts"] == {} for cu in dag["cus"])


def test_the_schema_rejects_a_broken_dag(transformer_dag):
    dag = json.loads(json.dumps(transformer_dag[0]))
    del dag["cus"][0]["sha256"]
    with pytest.raises(jsonschema.ValidationError):
        validate_dag(dag)


def test_order_and_levels_respect_every_edge(transformer_dag):
    dag, _ = transformer_dag
    position = {cu: i for i, cu in enumerate(dag["order"])}
    level = {cu: i for i, lv in enumerate(dag["levels"]) for cu in lv}
    assert sorted(position) == sorted(level) == sorted(cu["id"] for cu in dag["cus"])
    assert dag["edges"], "a transformer block at depth 1 has several CUs"
    for e in dag["edges"]:
        assert position[e["from"]] < position[e["to"]]
        assert level[e["from"]] < level[e["to"]]


def test_tensors_name_their_producer_and_consumers(transformer_dag):
    dag, _ = transformer_dag
    for e in dag["edges"]:
        t = dag["tensors"][e["tensor"]]
        assert t["producer"] == e["from"] and e["to"] in t["consumers"] and t["bytes"] == e["bytes"]
    for spec in dag["inputs"]:
        assert dag["tensors"][spec["name"]]["producer"] is None
    for cu in dag["cus"]:
        for name in cu["outputs"]:
            assert dag["tensors"][name]["producer"] == cu["id"]


def test_critical_path_is_a_chain_of_edges_with_the_summed_flops(transformer_dag):
    dag, _ = transformer_dag
    path = dag["critical_path"]["cus"]
    linked = {(e["from"], e["to"]) for e in dag["edges"]}
    assert all((a, b) in linked for a, b in zip(path, path[1:]))
    flops = {cu["id"]: cu["flops"] for cu in dag["cus"]}
    assert dag["critical_path"]["flops"] == sum(flops[c] for c in path)
    assert dag["critical_path"]["flops"] >= max(flops.values()) > 0


def test_cu_paths_are_relative_to_the_dag_folder(transformer_dag):
    dag, folder = transformer_dag
    for cu in dag["cus"]:
        assert not Path(cu["path"]).is_absolute()
        assert (folder / "out" / cu["path"]).resolve().is_file()


def test_dot_shows_every_cu_and_edge(transformer_dag):
    dag, _ = transformer_dag
    dot = to_dot(dag)
    assert dot.startswith("digraph ") and dot.rstrip().endswith("}")
    for cu in dag["cus"]:
        assert f'"{cu["id"]}" [label=' in dot
    assert dot.count(" -> ") >= len(dag["edges"])


def test_build_dag_output_is_byte_identical_across_runs(transformer_dag, tmp_path):
    _, folder = transformer_dag
    texts = []
    for name in ("a.json", "b.json"):
        dag = build_dag(folder / "cus", folder / "out" / name)
        write_bytes_atomically(tmp_path / name, (json.dumps(dag, indent=2) + "\n").encode())
        texts.append((tmp_path / name).read_bytes())
    assert texts[0] == texts[1]

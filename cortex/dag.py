"""Build `dag.json` (`cortex.dag/1`) from a CU folder: CUs as nodes, tensors as edges, costs, a
topological order, the parallel schedule (levels) and the critical path by flops.

An If decomposed into branch CUs adds `selects` (its outputs, which no CU produces): a CU reading
one waits for the CUs writing the condition and every case, and a branch CU for the one writing
its condition; `edges`, `order`, `levels` and the critical path include those dependencies.

The JSON Schema ships in the package (`cortex/schemas/dag.schema.json`); `validate_dag` checks a
document against it.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import jsonschema
import networkx as nx

from cortex.cus import read_manifest
from cortex.dag_checks import first_violation
from ir.errors import CortexError
from ir.fs import file_sha256
from ir.ops import RANDOM, kind_of

DAG_SCHEMA = "cortex.dag/1"
# Several input-shape specializations, each section a cortex.dag/1 body (cortex/specializations.py).
SPECIALIZED_DAG_SCHEMA = "cortex.dag/2"
SCHEMA_FILE = Path(__file__).resolve().parent / "schemas" / "dag.schema.json"


def variant_id(cu_id: str, precision: str) -> str:
    """The name of a CU's reduced-precision variant: its files (`cu-0007-fp16.wasm`), kernels and
    the id a device loads it under."""
    return f"{cu_id}-{precision}"


def build_dag(cu_dir: Path, output: Path) -> dict:
    """The dag.json document for the CUs in `cu_dir`, with paths relative to `output`'s folder."""
    cu_dir = Path(cu_dir)
    manifest = read_manifest(cu_dir)
    cus = manifest["cus"]
    producer = {t: cu["id"] for cu in cus for t in cu["outputs"]}
    consumers: dict[str, list[str]] = {}
    for cu in cus:
        for t in cu["inputs"]:
            consumers.setdefault(t, []).append(cu["id"])
    info = manifest["tensors"]
    selects = manifest.get("selects", [])
    selected = {s["tensor"]: s for s in selects}

    def sources(t: str) -> list[str]:
        """The CUs a reader of `t` waits for."""
        if t in selected:
            s = selected[t]
            return [c for name in [s["condition"], *(case["tensor"] for case in s["cases"])] for c in sources(name)]
        return [producer[t]] if t in producer else []

    reads = {(src, cu["id"], t) for cu in cus for t in cu["inputs"] for src in sources(t)}
    reads |= {(src, cu["id"], cu["activation"]["tensor"]) for cu in cus if "activation" in cu
              for src in sources(cu["activation"]["tensor"])}
    edges = [{"from": src, "to": dst, "tensor": t, "bytes": info[t]["bytes"]} for src, dst, t in sorted(reads)]
    graph = nx.DiGraph()
    graph.add_nodes_from(cu["id"] for cu in cus)
    graph.add_edges_from((e["from"], e["to"]) for e in edges)
    if not nx.is_directed_acyclic_graph(graph):
        raise CortexError(f"{cu_dir}: the CUs in the manifest form a cycle; run 'cortex decompose' again")
    order = list(nx.lexicographical_topological_sort(graph))
    flops = {cu["id"]: int(cu.get("flops", 0)) for cu in cus}
    base = Path(os.path.relpath(cu_dir.resolve(), Path(output).resolve().parent))

    model = manifest["model"]
    source = source_model(model, cu_dir, output)
    return {
        "schema": DAG_SCHEMA,
        "model": {"name": model.get("name", ""), "sha256": model.get("sha256", ""),
                  "opsets": model.get("opsets", {})},
        **({"source_model": source} if source else {}),
        "options": manifest.get("options", {}),
        "inputs": manifest["inputs"],
        "outputs": manifest["outputs"],
        "tensors": {name: {**t, "producer": producer.get(name), "consumers": sorted(consumers.get(name, []))}
                    for name, t in sorted(info.items())},
        "cus": [{"id": cu["id"], "path": Path(os.path.normpath(base / cu["path"])).as_posix(), "sha256": cu["sha256"],
                 "params": cu["params"], "depth": cu["depth"], "flops": flops[cu["id"]],
                 "op_types": cu["op_types"], "inputs": cu["inputs"], "outputs": cu["outputs"],
                 **{key: cu[key] for key in ("runs_on", "activation", "cache", "quantizes") if key in cu},
                 **({"random": True} if any(kind_of(op) == RANDOM for op in cu["op_types"]) else {}),
                 "artifacts": {}} for cu in cus],
        **({"selects": selects} if selects else {}),
        "edges": edges,
        "order": order,
        "levels": _levels(graph, order),
        "critical_path": _critical_path(graph, order, flops),
    }


def source_model(model: dict, cu_dir: Path, output: Path) -> dict | None:
    """`{"path", "sha256"}` of the model the CUs were decomposed from, its path relative to the
    folder of `output` (it may lie outside it: the offline policy checks the sha256 before running
    it). The manifest holds the path decompose was given, relative to the folder decompose ran in,
    which is usually this one; failing that, the CU folder's parent. None when neither holds a
    file with the manifest's sha256 (moved or edited since)."""
    given = Path(model.get("path", ""))
    if not model.get("path") or not model.get("sha256"):
        return None
    candidates = [given] if given.is_absolute() else [given, Path(cu_dir).parent / given]
    for candidate in candidates:
        if candidate.is_file() and file_sha256(candidate) == model["sha256"]:
            relative = os.path.relpath(candidate.resolve(), Path(output).resolve().parent)
            return {"path": Path(relative).as_posix(), "sha256": model["sha256"]}
    return None


def _levels(graph: nx.DiGraph, order: list[str]) -> list[list[str]]:
    """CUs grouped by longest distance from a source: each level only needs earlier levels."""
    level: dict[str, int] = {}
    for cu in order:
        level[cu] = 1 + max((level[p] for p in graph.predecessors(cu)), default=-1)
    grouped: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for cu in order:
        grouped[level[cu]].append(cu)
    return [sorted(g) for g in grouped]


def _critical_path(graph: nx.DiGraph, order: list[str], flops: dict[str, int]) -> dict:
    best: dict[str, tuple[int, str | None]] = {}
    for cu in order:
        prev = max(graph.predecessors(cu), key=lambda p: (best[p][0], p), default=None)
        best[cu] = (flops[cu] + (best[prev][0] if prev else 0), prev)
    if not best:
        return {"cus": [], "flops": 0}
    end = max(order, key=lambda c: (best[c][0], c))
    path = [end]
    while best[path[-1]][1] is not None:
        path.append(best[path[-1]][1])
    return {"cus": path[::-1], "flops": best[end][0]}


def to_dot(dag: dict) -> str:
    """Graphviz DOT of the same graph: CUs as boxes, tensors as labelled edges."""
    lines = [f"digraph {json.dumps(dag['model']['name'] or 'model')} {{", "  rankdir=TB;",
             "  node [shape=box, fontname=\"Helvetica\"];"]
    for cu in dag["cus"]:
        label = f"{cu['id']}\\n{', '.join(cu['op_types'])}\\nparams {cu['params']:,}  depth {cu['depth']}"
        if "activation" in cu:
            label += f"\\nwhen {cu['activation']['tensor']} is {cu['activation']['equals']}"
        if "cache" in cu:
            label += f"\\n{cu['cache']}"
        lines.append(f"  {json.dumps(cu['id'])} [label=\"{label}\"];")
    for name in (i["name"] for i in dag["inputs"]):
        lines.append(f"  {json.dumps('input:' + name)} [shape=ellipse, label={json.dumps(name)}];")
    for name in (o["name"] for o in dag["outputs"]):
        lines.append(f"  {json.dumps('output:' + name)} [shape=ellipse, label={json.dumps(name)}];")
    for e in dag["edges"]:
        lines.append(f"  {json.dumps(e['from'])} -> {json.dumps(e['to'])} "
                     f"[label={json.dumps(e['tensor'] + ' (' + str(e['bytes']) + ' B)')}];")
    model_inputs = {i["name"] for i in dag["inputs"]}
    for name, t in dag["tensors"].items():
        if name in model_inputs:
            for c in t["consumers"]:
                lines.append(f"  {json.dumps('input:' + name)} -> {json.dumps(c)};")
    selects = {s["tensor"]: s for s in dag.get("selects", [])}
    for o in dag["outputs"]:
        if o["name"] in selects:     # an If's output: whichever branch's case the condition picks
            sources = [dag["tensors"][c["tensor"]]["producer"] for c in selects[o["name"]]["cases"]]
        else:
            src = dag["tensors"][o["name"]]["producer"]
            sources = [src if src is not None else "input:" + o["name"]]
        for src_node in sources:
            lines.append(f"  {json.dumps(src_node)} -> {json.dumps('output:' + o['name'])};")
    lines.append("}")
    return "\n".join(lines) + "\n"


@cache
def dag_schema() -> dict:
    return json.loads(SCHEMA_FILE.read_text())


def validate_dag(dag: dict) -> None:
    """Raise jsonschema.ValidationError if `dag` does not follow the cortex.dag/1 schema."""
    jsonschema.validate(dag, dag_schema())


def read_dag(path: Path, option: str | None = None) -> dict:
    """A dag.json written by build-dag, checked before anything uses it: a dag.json may come from
    an artifact store or a CDN. Any problem is one line naming the file (and the option it came
    from, when there is one): not JSON, not the schema, or an invariant the schema cannot say
    (see `dag_checks`)."""
    path = Path(path)
    label = f"{option} {path}" if option else str(path)
    if not path.is_file():
        raise CortexError(f"{label}: no such file (run 'cortex build-dag' first)")
    try:
        dag = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CortexError(f"{label}: not readable JSON: {e}") from None
    if isinstance(dag, dict) and dag.get("schema") == SPECIALIZED_DAG_SCHEMA:
        names = ", ".join(str(s.get("name", "?")) for s in dag.get("specializations", []) if isinstance(s, dict))
        raise CortexError(f"{label}: holds shape specializations ({names}); this command reads a single-shape "
                          "dag.json (cortex.load and 'cortex run' pick a specialization)")
    if not isinstance(dag, dict) or dag.get("schema") != DAG_SCHEMA:
        raise CortexError(f"{label}: not a {DAG_SCHEMA} document")
    check_dag(dag, label, path.parent)
    return dag


def check_dag(dag: dict, label: str, folder: Path) -> None:
    """The schema and the invariants of `dag_checks`, one line naming `label` for the first problem."""
    error = jsonschema.exceptions.best_match(_validator().iter_errors(dag))
    if error is not None:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
        message = error.message if len(error.message) <= 160 else error.message[:160] + "..."
        raise CortexError(f"{label}: does not follow the {DAG_SCHEMA} schema at {where or 'the top'}: {message}")
    problem = first_violation(dag, folder)
    if problem is not None:
        raise CortexError(f"{label}: {problem}")


@cache
def _validator():
    return jsonschema.Draft202012Validator(dag_schema())

"""The wasm target: one CU's graph -> `cu-NNNN.wasm` (+ `.wat` with `--emit-wat`) and its record.

The record in dag.json (`cus[i].artifacts.wasm`) holds the module's path relative to dag.json, its
sha256 and size, the options it was built with, and its memory plan (where the host writes inputs
and reads outputs).

With several feature sets (`--features simd,relaxed-simd;simd`) the record also lists the CU's
`alternates`, one per further set, in the order given: the set, the module's path, sha256 and size,
and its memory plan and weight files only where they differ from the primary module's (a kernel's
scratch or a packed weight layout can depend on the features: relaxed SIMD's int8 dot packs 7-bit
panels). A runtime whose engine lacks a feature of the primary set runs the first alternate it has.
"""

from __future__ import annotations

from backends.registry import BuiltCU
from backends.wasm.compile import compile_graph
from backends.wasm.options import WasmOptions, show_sets
from backends.wasm.weights_files import MODULES_FOLDER, weight_files
from ir.graph import Graph


def build_cu(graph: Graph, options: WasmOptions, cu_id: str) -> BuiltCU:
    files, record = _build_module(graph, options, cu_id)
    alternates = []
    for features in options.alternate_features:
        more, alternate = _build_module(graph, options.for_features(features), f"{cu_id}.{feature_tag(features)}")
        files.update(more)
        found = {"features": list(features), "file": alternate["file"], "sha256": alternate["sha256"],
                 "bytes": alternate["bytes"]}
        for key in ("memory", "weights"):
            if key in alternate and alternate[key] != record[key]:
                found[key] = alternate[key]
        alternates.append(found)
    if alternates:
        record["alternates"] = alternates
    return BuiltCU(files, record)


def feature_tag(features: tuple[str, ...]) -> str:
    """How an alternate module's file name says its features: cu-0003.simd.wasm."""
    return "_".join(features) or "scalar"


def _build_module(graph: Graph, options: WasmOptions, stem: str) -> tuple[dict[str, bytes], dict]:
    artifact = compile_graph(graph, options)
    # Content-addressed names let builds that make the same module (or weights) store it once.
    if options.external_weights:
        stem = f"{MODULES_FOLDER}/{artifact.sha256}"
    name = f"{stem}.wasm"
    files = {name: artifact.wasm}
    if options.emit_wat:
        files[f"{stem}.wat"] = artifact.wat.encode()
    record = {"file": name, "sha256": artifact.sha256, "bytes": len(artifact.wasm),
              "options": options.to_json(), "memory": artifact.plan}
    if options.external_weights:
        weights, record["weights"] = weight_files(artifact.weights)
        files.update(weights)
    return files, record


def place(record: dict, folder: str) -> dict:
    """The record as dag.json holds it: the module's path instead of its file name (its
    alternates' too)."""
    placed = dict(record)
    placed["path"] = f"{folder}/{placed.pop('file')}"
    if "weights" in placed:
        placed["weights"] = [{"path": f"{folder}/{w['file']}", **{k: v for k, v in w.items() if k != "file"}}
                             for w in placed["weights"]]
    if "alternates" in placed:
        placed["alternates"] = [{"features": a["features"], **place({k: v for k, v in a.items() if k != "features"},
                                                                    folder)} for a in placed["alternates"]]
    return placed


def summarize(records: dict[str, dict], options: WasmOptions) -> dict:
    """Bytes as stored: a content-addressed module or weight file shared by several CUs counts once;
    alternate modules are counted too (`alternate_bytes` says how many of the bytes they are)."""
    modules = [m for r in records.values() for m in (r, *r.get("alternates", ()))]
    stored = {m["file"]: m["bytes"] for m in modules}
    stored.update({w["file"]: w["bytes"] for m in modules for w in m.get("weights", ())})
    summary = {"bytes": sum(stored.values()), "options": options.to_json()}
    if options.alternate_features:
        primary = {r["file"]: r["bytes"] for r in records.values()}
        primary.update({w["file"]: w["bytes"] for r in records.values() for w in r.get("weights", ())})
        summary["alternate_bytes"] = summary["bytes"] - sum(primary.values())
        summary["alternate_features"] = show_sets(options.alternate_features)
    return summary

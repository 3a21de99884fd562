"""`cortex compile-<target>`: build every CU of a CU folder for one registered target.

What every target shares lives here: the CU folder it reads (each cu.onnx loaded and optimised as
decompose left it), the check that every op has a lowering (before anything is built, so a model
Cortex cannot lower fails at once with one line naming the ops and nodes), the output folder
written atomically (a temporary sibling that replaces it only when every CU built), `index.json`,
and each CU's record written back into dag.json. A target contributes `build` (one CU) and
`place` (its record as dag.json holds it). Fallback CUs (`runs_on`, from `decompose --fallback`)
are skipped: their cu.onnx is their artifact, already in dag.json as the CU's path and sha256.

With `variants` (`--variants fp16,bf16,int8`), each CU that has weights is also built with its
weights stored in each of those precisions (`passes/narrow_weights.py`), as `cu-NNNN-<precision>`
files beside the exact one, recorded as `cus[i].variants[<precision>].artifacts.<artifact>`. A
target may build variants of its own from the exact graph (`Target.variants`: compile-cuda's
`tf32`, its contractions on tensor cores); a CU that such a precision would not change gets none,
and another target asked for it is one line of error naming the target that builds it. A
variant's `trust` stays null (never run) until `cortex calibrate` measures it; rebuilding a variant
whose artifact changed resets it.

A target whose options link the CUs (`Target.links`: one model-level memory) is handed every CU's
graph first and says the options each CU builds with (`Target.link`); those options are the CU's
cache key. CUs build independently, each a pure function of its graph and the options: `map_cus` says how
the builds are spread (threads by default; `compile-<target> --executor ray` passes one Ray task
per CU), and the files are written here, in manifest order, so where they were built never shows.
With a `cache` (`cortex.compile_cache`), each CU (and each variant) whose key is in the cache is
taken from it instead of being loaded and built; only the others are. The summary says how many
CUs were compiled and how many reused.

A CU folder of shape specializations (`decompose --dim seq=32,64,128`) goes through the same steps,
cache and variants included, every specialization's CUs into one folder: the target names its files
by content (`external_weights`, forced on), so what several shapes make is written once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from backends.registry import Target
from backends.registry import targets as registered_targets
from cortex.compile_cache import NO_VARIANT, CompileCache, options_json
from cortex.cus import read_manifest
from cortex.dag import read_dag, variant_id
from cortex.pipeline import load_and_optimize
from cortex.specializations import read_listing, read_specialized_dag
from ir.errors import CortexError, UnsupportedError
from ir.fs import write_bytes_atomically, write_directory_atomically
from ir.graph import Graph
from codegen.lower import describe_unsupported, unsupported_nodes
from passes.narrow_weights import PRECISIONS, narrowed

INDEX_SCHEMA = "cortex.{target}/1"


@dataclass(frozen=True)
class _Work:
    """One CU to build: its manifest entry, the CU folder holding it, and how messages name it."""
    cu: dict
    folder: Path
    label: str


def compile_cu_dir(target: Target, cu_dir: Path, output: Path, options, dag_path: Path | None = None,
                   on_cu: Callable[[str], None] | None = None, jobs: int | None = None,
                   variants: tuple[str, ...] = (), map_cus: Callable[[Callable, list], list] | None = None,
                   cache: CompileCache | None = None) -> dict:
    cu_dir, output = Path(cu_dir), Path(output)
    variants = parse_variants(variants, target)
    listing = read_listing(cu_dir)
    if listing is not None:
        return compile_specializations(target, cu_dir, output, options, listing, dag_path, on_cu, jobs, variants,
                                       map_cus, cache)
    start = time.perf_counter()
    target.check(options)
    check_variants(target, options, variants)
    manifest = read_manifest(cu_dir)
    compiled = [_Work(cu, cu_dir, cu["id"]) for cu in manifest["cus"] if "runs_on" not in cu]
    dag = read_dag_for_cus(dag_path, manifest, cu_dir) if dag_path is not None else None
    folder_in_dag = _folder_relative_to(output, dag_path) if dag_path is not None else None

    linked = linked_options(target, options, cu_dir, manifest, [w.cu for w in compiled], variants)

    def fill(folder: Path):
        built, rebuilt = build_cus(target, options, compiled, variants, cache, jobs, map_cus, linked)
        records, variant_records = _write_built(folder, compiled, built, on_cu)
        index = {"schema": INDEX_SCHEMA.format(target=target.name), "options": options_json(options), "cus": records,
                 **({"variants": variant_records} if variants else {})}
        (folder / "index.json").write_text(json.dumps(index, indent=2) + "\n")
        return records, variant_records, rebuilt

    records, variant_records, rebuilt = write_directory_atomically(output, fill)
    if dag is not None:
        _record_artifacts(dag["cus"], records, variant_records, target, folder_in_dag)
        write_bytes_atomically(Path(dag_path), (json.dumps(dag, indent=2) + "\n").encode())
    if cache is not None:
        cache.prune()
    return {"output": str(output), "dag": str(dag_path) if dag_path else None, "cus": len(records),
            "fallback_cus": len(manifest["cus"]) - len(compiled),
            "compiled_cus": rebuilt, "reused_cus": len(compiled) - rebuilt,
            **_summary(target, options, records, variant_records, variants),
            "seconds": round(time.perf_counter() - start, 3)}


def compile_specializations(target: Target, cu_dir: Path, output: Path, options, listing: list[dict],
                            dag_path: Path | None, on_cu: Callable[[str], None] | None, jobs: int | None,
                            variants: tuple[str, ...], map_cus: Callable[[Callable, list], list] | None = None,
                            cache: CompileCache | None = None) -> dict:
    """Every specialization's CUs (and their variants) into one folder. The target names its files
    by content (`external_weights`), so a module or a weight file several specializations make is
    written and counted once; each section of the cortex.dag/2 dag.json gets its CUs' records."""
    start = time.perf_counter()
    if "external_weights" not in {f.name for f in dataclasses.fields(options)}:
        raise CortexError(f"{cu_dir} holds shape specializations; compile-{target.name} cannot store their "
                          "shared weights once yet (compile-wasm and compile-cuda can)")
    if target.links(options):
        raise CortexError(f"{cu_dir} holds shape specializations; their CUs cannot share one memory plan yet")
    options = dataclasses.replace(options, external_weights=True)
    target.check(options)
    check_variants(target, options, variants)
    folders = {entry["name"]: cu_dir / entry["folder"] for entry in listing}
    manifests = {name: read_manifest(folder) for name, folder in folders.items()}
    dag = read_specialized_dag(dag_path, option="--dag") if dag_path is not None else None
    if dag is not None:
        sections = {s["name"]: s for s in dag["specializations"]}
        for name, manifest in manifests.items():
            shas = {cu["id"]: cu["sha256"] for cu in manifest["cus"]}
            section = sections.get(name)
            if section is None or {cu["id"]: cu["sha256"] for cu in section["cus"]} != shas:
                raise CortexError(f"--dag {dag_path} does not describe the CUs of specialization {name} in "
                                  f"{cu_dir}; run 'cortex build-dag' again")
    folder_in_dag = _folder_relative_to(output, dag_path) if dag_path is not None else None
    work = {name: [_Work(cu, folders[name], f"{name} {cu['id']}") for cu in manifest["cus"] if "runs_on" not in cu]
            for name, manifest in manifests.items()}
    every = [w for ws in work.values() for w in ws]

    def fill(folder: Path):
        built, rebuilt = build_cus(target, options, every, variants, cache, jobs, map_cus)
        records, variant_records, at = {}, {}, 0
        for name, ws in work.items():
            records[name], variant_records[name] = _write_built(folder, ws, built[at:at + len(ws)], on_cu)
            at += len(ws)
        index = {"schema": INDEX_SCHEMA.format(target=target.name), "options": options_json(options),
                 "specializations": records, **({"variants": variant_records} if variants else {})}
        (folder / "index.json").write_text(json.dumps(index, indent=2) + "\n")
        return records, variant_records, rebuilt

    records, variant_records, rebuilt = write_directory_atomically(output, fill)
    if dag is not None:
        for section in dag["specializations"]:
            _record_artifacts(section["cus"], records[section["name"]], variant_records[section["name"]], target,
                              folder_in_dag)
        write_bytes_atomically(Path(dag_path), (json.dumps(dag, indent=2) + "\n").encode())
    if cache is not None:
        cache.prune()
    flat = {f"{name}/{cu}": r for name, by_cu in records.items() for cu, r in by_cu.items()}
    flat_variants = {f"{name}/{cu}": v for name, by_cu in variant_records.items() for cu, v in by_cu.items()}
    return {"output": str(output), "dag": str(dag_path) if dag_path else None, "specializations": len(records),
            "cus": len(flat), "fallback_cus": sum(len(m["cus"]) for m in manifests.values()) - len(every),
            "compiled_cus": rebuilt, "reused_cus": len(every) - rebuilt,
            **_summary(target, options, flat, flat_variants, variants),
            "seconds": round(time.perf_counter() - start, 3)}


def build_cus(target: Target, options, work: list[_Work], variants: tuple[str, ...], cache: CompileCache | None,
              jobs: int | None, map_cus: Callable[[Callable, list], list] | None,
              linked: tuple[dict[str, Graph], dict[str, object]] | None = None) -> tuple[list, int]:
    """Each CU's exact build and its variants by precision ({} for a CU without weights), in the
    order of `work`, and how many CUs were (partly) built rather than all taken from the cache.
    `linked` (from `linked_options`): every CU's graph, already loaded, and the options each builds with."""
    precisions = (None, *variants)
    per_cu = [linked[1][w.cu["id"]] if linked else options for w in work]
    keys = {(i, p): cache.key(target, per_cu[i], w.cu["id"], w.cu["sha256"], p)
            for i, w in enumerate(work) for p in precisions} if cache is not None else {}
    found = {slot: cache.get(key) for slot, key in keys.items()}
    found = {slot: built for slot, built in found.items() if built is not None}
    rebuilt = [i for i in range(len(work)) if any((i, p) not in found for p in precisions)]
    graphs = {i: linked[0][work[i].cu["id"]] for i in rebuilt} if linked else {}
    for folder in dict.fromkeys(work[i].folder for i in rebuilt if i not in graphs):
        here = [i for i in rebuilt if work[i].folder == folder]
        loaded = load_cu_graphs(folder, [work[i].cu for i in here], target.name)
        graphs.update((i, loaded[work[i].cu["id"]]) for i in here)

    # What each CU still needs built: a pure function of its graph and the options, so it may run on
    # another machine (`map_cus`); the cache is read and written here, never where the build runs.
    missing = [(i, [p for p in precisions if (i, p) not in found]) for i in rebuilt]

    def build_missing(item: tuple[int, list]) -> dict:
        i, wanted = item
        graph, cu, built = graphs[i], work[i].cu, {}
        try:
            for precision in wanted:
                if precision is None:
                    built[precision] = target.build(graph, per_cu[i], cu["id"])
                elif precision in target.variants:
                    built[precision] = target.variants[precision].build(graph, options,
                                                                        variant_id(cu["id"], precision))
                else:
                    narrow = narrowed(graph, precision, target.integer_gemm)
                    built[precision] = None if narrow is None else target.build(
                        narrow, options, variant_id(cu["id"], precision))
        except CortexError as e:
            raise type(e)(f"{work[i].label} ({work[i].folder / cu['path']}): {e}") from None
        return built

    if map_cus is not None:
        fresh = list(map_cus(build_missing, missing))
    else:
        with ThreadPoolExecutor(max_workers=jobs or min(target.jobs, os.cpu_count() or 1)) as pool:
            fresh = list(pool.map(build_missing, missing))
    slots = {(i, p): value for (i, _), made in zip(missing, fresh) for p, value in made.items()}
    if cache is not None:
        for slot, value in slots.items():
            cache.put(keys[slot], value)
    slots.update((slot, None if value is NO_VARIANT else value) for slot, value in found.items())
    return [(slots[i, None], {p: slots[i, p] for p in variants if slots[i, p] is not None})
            for i in range(len(work))], len(rebuilt)


def linked_options(target: Target, options, cu_dir: Path, manifest: dict, compiled: list[dict],
                   variants: tuple[str, ...]) -> tuple[dict[str, Graph], dict[str, object]] | None:
    """For a target whose options link the CUs (one model-level memory): every CU's graph and the
    options its `link` plans for each CU from all of them. None for any other target."""
    if not target.links(options):
        return None
    if variants:
        raise CortexError(f"--variants: the CUs of this compile-{target.name} build share one memory plan "
                          "(--memory shared); variants of them are not built yet")
    graphs = load_cu_graphs(cu_dir, compiled, target.name)
    return graphs, target.link(options, graphs, manifest)


def _write_built(folder: Path, work: list[_Work], built: list, on_cu: Callable[[str], None] | None
                 ) -> tuple[dict, dict]:
    """The CUs' files written into `folder` (a content-addressed name already there holds the same
    bytes, so it is written once); their records and their variants' records by CU id."""
    records, variant_records = {}, {}
    for w, (result, by_precision) in zip(work, built):
        for one in (result, *by_precision.values()):
            for name, data in one.files.items():
                if not (folder / name).exists():
                    (folder / name).parent.mkdir(parents=True, exist_ok=True)   # modules/, weights/
                    (folder / name).write_bytes(data)
        records[w.cu["id"]] = result.record
        variant_records[w.cu["id"]] = {p: r.record for p, r in by_precision.items()}
        if on_cu:
            on_cu(w.label)
    return records, variant_records


def _record_artifacts(cus: list[dict], records: dict, variant_records: dict, target: Target, folder: str) -> None:
    """Each built CU's record (and its variants') into its dag.json entry."""
    for cu in cus:
        if cu["id"] in records:
            old = cu.setdefault("artifacts", {}).get(target.artifact, {}).get("sha256")
            cu["artifacts"][target.artifact] = target.place(records[cu["id"]], folder)
            _record_variants(cu, target, {p: target.place(r, folder) for p, r in variant_records[cu["id"]].items()},
                             exact_changed=old != records[cu["id"]].get("sha256"))


def _summary(target: Target, options, records: dict, variant_records: dict, variants: tuple[str, ...]) -> dict:
    summary = target.summarize(records, options)
    if variants:
        summary["variant_bytes"] = {p: target.summarize({c: v[p] for c, v in variant_records.items() if p in v},
                                                        options).get("bytes") for p in variants}
    return summary


def parse_variants(variants, target: Target) -> tuple[str, ...]:
    """`--variants fp16,bf16,int8` (text, or already a sequence) as a tuple of the precisions `target`
    builds: the narrow-weight ones, and its own (`Target.variants`)."""
    items = variants.split(",") if isinstance(variants, str) else list(variants or ())
    chosen = tuple(dict.fromkeys(v.strip() for v in items if v.strip()))
    known = (*PRECISIONS, *target.variants)
    others = {p: name for name, t in registered_targets().items() if name != target.name for p in t.variants}
    elsewhere = [v for v in chosen if v not in known and v in others]
    if elsewhere:
        builders = sorted({others[v] for v in elsewhere})
        raise CortexError(f"--variants {','.join(elsewhere)}: only compile-{', compile-'.join(builders)} builds "
                          f"{'them' if len(elsewhere) > 1 else 'it'}; compile-{target.name} builds a comma-separated "
                          f"subset of {','.join(known)}")
    unknown = [v for v in chosen if v not in known]
    if unknown:
        raise CortexError(f"unknown --variants {', '.join(unknown)}: expected a comma-separated subset of "
                          f"{','.join(known)}")
    return chosen


def check_variants(target: Target, options, variants: tuple[str, ...]) -> None:
    """The target's own variants checked against the options before any work."""
    for precision in variants:
        if precision in target.variants:
            target.variants[precision].check(options)


def variant_order() -> tuple[str, ...]:
    """How `cus[i].variants` lists its precisions: the narrow-weight ones, then the targets' own."""
    return tuple(dict.fromkeys([*PRECISIONS, *(p for t in registered_targets().values() for p in t.variants)]))


def _record_variants(cu: dict, target: Target, placed: dict[str, dict], exact_changed: bool) -> None:
    """This target's variant artifacts in `cus[i].variants`: the output folder was replaced, so
    the target's earlier variants are gone; a variant whose artifact (or whose exact CU's) changed
    is uncalibrated again, since its trust was measured against those bytes."""
    variants = cu.get("variants", {})
    for precision in list(variants):
        old = variants[precision].get("artifacts", {}).pop(target.artifact, None)
        new = placed.get(precision)
        if old is not None and (exact_changed or new is None or old.get("sha256") != new.get("sha256")):
            variants[precision] = {"artifacts": variants[precision]["artifacts"], "trust": None}
        if not variants[precision]["artifacts"] and new is None:
            del variants[precision]
    for precision, record in placed.items():
        entry = variants.setdefault(precision, {"artifacts": {}, "trust": None})
        entry["artifacts"][target.artifact] = record
    if variants:
        order = variant_order()
        cu["variants"] = {p: variants[p] for p in (*order, *sorted(set(variants) - set(order))) if p in variants}
    else:
        cu.pop("variants", None)


def read_cus(cu_dir: Path, target_name: str) -> tuple[dict, dict[str, Graph]]:
    """The manifest and each compiled CU's optimised graph (fallback CUs have none)."""
    manifest = read_manifest(cu_dir)
    return manifest, load_cu_graphs(cu_dir, [cu for cu in manifest["cus"] if "runs_on" not in cu], target_name)


def load_cu_graphs(cu_dir: Path, cus: list[dict], target_name: str) -> dict[str, Graph]:
    """The optimised graph of each of `cus`; fails at once, in one line, when any of them holds ops
    without a loop-nest lowering."""
    graphs, missing = {}, []
    for cu in cus:
        graph = load_and_optimize(cu_dir / cu["path"], require_static=True).graph
        missing += unsupported_nodes(graph)
        graphs[cu["id"]] = graph
    if missing:
        raise UnsupportedError(f"{cu_dir}: cannot compile to {target_name}: {describe_unsupported(missing)}; "
                               "decompose with --fallback onnxruntime to run them on onnxruntime")
    return graphs


def read_dag_for_cus(dag_path: Path, manifest: dict, cu_dir: Path) -> dict:
    """dag.json, checked to describe the same CUs as the manifest (not a stale one)."""
    dag = read_dag(dag_path, option="--dag")
    by_id = {cu["id"]: cu for cu in manifest["cus"]}
    for cu in dag["cus"]:
        mine = by_id.get(cu["id"])
        if mine is None or mine["sha256"] != cu["sha256"]:
            raise CortexError(f"--dag {dag_path} does not describe the CUs in {cu_dir} ({cu['id']} differs); "
                              "run 'cortex build-dag' again")
    if len(dag["cus"]) != len(by_id):
        raise CortexError(f"--dag {dag_path} has {len(dag['cus'])} CUs, {cu_dir} has {len(by_id)}; "
                          "run 'cortex build-dag' again")
    return dag


def _folder_relative_to(output: Path, dag_path: Path) -> str:
    """The output folder as dag.json names it. It must lie inside the folder of dag.json: the
    runtimes refuse artifact paths that leave it, so that a bundle is self-contained."""
    base = Path(dag_path).resolve().parent
    folder = Path(output).resolve()
    if not folder.is_relative_to(base) or folder == base:
        raise CortexError(f"--output {output} must be a folder inside {base} (the folder of --dag {dag_path}), "
                          "so that dag.json and its artifacts form one self-contained bundle")
    return Path(os.path.relpath(folder, base)).as_posix()

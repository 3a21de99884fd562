"""`cortex bundle out/dag.json --output site/`: a folder any static web server can host, holding the
compiled model, the JavaScript runtime (js/src, as `cortex-runtime/`) and an example page that runs
the model on the example inputs of `cortex run --example-inputs` and charts each CU's time. The
runtime's modules are js/src's, which a page importing index.js fetches a level of imports per
round trip; when js/dist holds the one-file build of this tree's js/src (`make js-runtime`), it goes
in too, as `cortex-runtime/one-file/` (index.js holding every module, each Worker's entry point
beside it), and the page imports that: one fetch, as onnxruntime-web ships ort.*.bundle.min.mjs.
Either way the page preloads the runtime's modules (`<link rel="modulepreload">`), so their fetches run at once.

The bundle's dag.json is the compiled one with its reduced-precision variants (their modules copied
too: the runtime picks them by the calibrated trust dag.json records) and its alternate modules
(`compile-wasm --features simd,relaxed-simd;simd`: the runtime runs the first an engine validates). The source model, which the
offline policy runs on onnxruntime-web, usually lies outside the folder and is as large as all the
modules together, so it is left out unless `--with-source` asks for it: then it is copied to
`source/<its name>` and dag.json's `source_model` names that copy. Each file is copied after its
sha256 is checked against dag.json, so a stale build is refused here rather than in the browser.
The folder is built beside --output and renamed into place.

A dag.json of shape specializations (cortex.dag/2) or of `compile-wasm --external-weights` names
content-addressed modules and weight files that several CUs and specializations share: each is
checked and copied once. The page runs the first specialization's shapes, unless the sections
are a language model's (new tokens) x (cache bucket) specializations: then it has a prompt-ids box
and shows the generated ids one by one as they are made (js/src/generate.js decides, from dag.json).

The runtime imports onnxruntime-web by name when fallback CUs or the offline policy need it. When
the bundle has fallback CUs or carries the source model, it also carries onnxruntime-web's browser
build (its ES module with the wasm backend, and that backend's .wasm, in `onnxruntime-web/`) from
`--onnxruntime-web`, or else from the copy `make ortweb` installs or one in js/node_modules when
there is one, and the page maps the name to it with an import map; without one the page says, in
one line, that onnxruntime-web is missing when it needs it. The page runs under `?policy=NAME`
(`index.html?policy=offline`), the runtime's default otherwise.
"""

from __future__ import annotations

import hashlib
import json as jsonlib
import shutil
from pathlib import Path
from typing import Annotated

import typer

from cortex.console import print_json, print_summary
from cortex.dag import read_dag, validate_dag
from cortex.specializations import is_specialized, read_specialized_dag, section_dag
from ir.errors import CortexError
from ir.fs import (
    confined_path,
    read_artifact,
    write_bytes_atomically,
    write_directory_atomically,
)

JS_DIR = Path(__file__).resolve().parents[2] / "js"
RUNTIME_FOLDER = "cortex-runtime"
# js/build.mjs's output folder: the one-file runtime in RUNTIME_FOLDER/, and RUNTIME_FOLDER.json
# holding the sha256 of each js/src file it was built from.
RUNTIME_BUILD = JS_DIR / "dist"
ONE_FILE_FOLDER = "one-file"
PAGE_RUNTIME_IMPORT = f'"./{RUNTIME_FOLDER}/index.js"'
SOURCE_FOLDER = "source"
ORTWEB_FOLDER = "onnxruntime-web"
# onnxruntime-web's wasm-only ES module with its glue inside, and the one .wasm it fetches (found
# beside the module): what a page needs for the wasm backend, 14 MB of its 140.
ORTWEB_FILES = ("ort.wasm.bundle.min.mjs", "ort-wasm-simd-threaded.wasm")
ORTWEB_PACKAGES = (JS_DIR / "node_modules" / "onnxruntime-web",
                   JS_DIR.parent / "bench" / "ortweb" / "node_modules" / "onnxruntime-web")
IMPORT_MAP_SLOT = "<!-- cortex bundle: onnxruntime-web import map -->"
# The page imports the runtime's modules as a chain of imports, one round trip a level; preload
# links let the browser fetch every one of them at once (the Workers' entry points load in Workers).
# They follow the import map: a module load before it would make the browser ignore the map.
PRELOAD_SLOT = "<!-- cortex bundle: runtime preloads -->"


def bundle(
    dag: Annotated[Path, typer.Argument(help="The dag.json, compiled with 'cortex compile-wasm'.")],
    output: Annotated[Path, typer.Option("--output", help="The folder to write (replaced as a whole).")],
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
    with_source: Annotated[bool, typer.Option("--with-source", help="Also copy the source model dag.json records, "
                                              "so that the offline policy runs in the browser.")] = False,
    onnxruntime_web: Annotated[Path | None, typer.Option(
        "--onnxruntime-web", help="onnxruntime-web's package folder (node_modules/onnxruntime-web), whose browser "
        "build is copied when fallback CUs or --with-source need it; by default the one 'make ortweb' installs, "
        "if any.")] = None,
    runtime: Annotated[str | None, typer.Option(
        "--runtime", help="'one-file': the page imports the runtime's one-file build, which must match js/src; "
        "'modules': js/src's modules. By default the one-file build when there is one that matches.")] = None,
    runtime_build: Annotated[Path | None, typer.Option(
        "--runtime-build", help="js/build.mjs's output folder, holding the one-file build (default js/dist, "
        "which 'make js-runtime' writes).")] = None,
) -> None:
    """Write a static site that runs the model in a browser: dag.json, modules, JS runtime, example page."""
    specialized = is_specialized(dag)
    document = read_specialized_dag(dag) if specialized else read_dag(dag)
    sections = document["specializations"] if specialized else [document]
    sources = _runtime_sources()
    if runtime not in (None, "one-file", "modules"):
        raise CortexError(f"--runtime {runtime}: expected one-file or modules")
    one_file = [] if runtime == "modules" else _one_file_runtime(sources, runtime_build or RUNTIME_BUILD)
    if runtime == "one-file" and not one_file:
        raise CortexError(f"--runtime one-file: {runtime_build or RUNTIME_BUILD} holds no one-file runtime built from "
                          "this tree's js/src (run 'make js-runtime', or 'node js/build.mjs FOLDER' and pass "
                          "--runtime-build FOLDER)")
    page_runtime = f"{RUNTIME_FOLDER}/{ONE_FILE_FOLDER}" if one_file else RUNTIME_FOLDER
    files = _artifacts([cu for section in sections for cu in section["cus"]], dag)
    source_copy = _source_model(document, dag) if with_source else None
    if source_copy is not None:
        files[source_copy[0]["path"]] = source_copy[1]
    fallback = any("runs_on" in cu for section in sections for cu in section["cus"])
    ortweb = _onnxruntime_web(onnxruntime_web) if (source_copy is not None or fallback) else None
    if onnxruntime_web is not None and ortweb is None:
        raise CortexError(f"--onnxruntime-web {onnxruntime_web}: nothing in the bundle needs it (no fallback CUs, "
                          "no --with-source)")
    if dag.resolve().is_relative_to(output.resolve()):      # replacing --output would delete the model
        raise CortexError(f"--output {output}: it holds {dag}; bundle into another folder")

    def fill(folder: Path) -> int:
        total = 0
        for relative, data in files.items():
            write_bytes_atomically(folder / relative, data)
            total += len(data)
        bundled = _bundled_dag(document, source_copy[0] if source_copy else None)
        for section in bundled.get("specializations", [bundled]):
            validate_dag(section_dag(section) if specialized else section)
        write_bytes_atomically(folder / "dag.json", jsonlib.dumps(bundled, indent=2).encode())
        (folder / RUNTIME_FOLDER).mkdir()
        for source in sources:
            shutil.copyfile(source, folder / RUNTIME_FOLDER / source.name)
        if one_file:
            (folder / RUNTIME_FOLDER / ONE_FILE_FOLDER).mkdir()
            for built in one_file:
                shutil.copyfile(built, folder / RUNTIME_FOLDER / ONE_FILE_FOLDER / built.name)
        for name, data in (ortweb or {}).items():          # not the model's bytes: not in module_bytes
            write_bytes_atomically(folder / ORTWEB_FOLDER / name, data)
        main = (JS_DIR / "page" / "main.js").read_text()
        if PAGE_RUNTIME_IMPORT not in main:
            raise CortexError(f"{JS_DIR / 'page' / 'main.js'} does not import {PAGE_RUNTIME_IMPORT}")
        write_bytes_atomically(folder / "main.js", main.replace(PAGE_RUNTIME_IMPORT, f'"./{page_runtime}/index.js"').encode())
        page = (JS_DIR / "page" / "index.html").read_text()
        page = page.replace(PRELOAD_SLOT, "\n".join(
            f'<link rel="modulepreload" href="{page_runtime}/{source.name}">'
            for source in (one_file or sources) if not source.name.endswith("_worker.js")))
        if ortweb:
            imports = {"imports": {"onnxruntime-web": f"./{ORTWEB_FOLDER}/{ORTWEB_FILES[0]}"}}
            page = page.replace(IMPORT_MAP_SLOT, f'<script type="importmap">{jsonlib.dumps(imports)}</script>')
        write_bytes_atomically(folder / "index.html", page.encode())
        return total

    module_bytes = write_directory_atomically(output, fill)
    summary = {"output": str(output), "cus": sum(len(s["cus"]) for s in sections), "files": len(files),
               "module_bytes": module_bytes, "runtime": f"{RUNTIME_FOLDER}/ ({len(sources)} files)",
               "page_runtime": f"{page_runtime}/index.js", "page": "index.html",
               "specializations": [s["name"] for s in sections] if specialized else [],
               "source_model": source_copy[0]["path"] if source_copy else None,
               "onnxruntime_web": f"{ORTWEB_FOLDER}/" if ortweb else None}
    if json:
        print_json(summary)
    else:
        rows = [("output", str(output)), ("CUs", str(summary["cus"])), ("module bytes", f"{module_bytes:,}"),
                ("runtime", summary["runtime"]), ("page", f"index.html (serve {output} and open it)")]
        if source_copy is not None or fallback:
            rows.append(("onnxruntime-web", f"{ORTWEB_FOLDER}/" if ortweb else
                         "not found (pass --onnxruntime-web, or run 'make ortweb'): the page cannot run "
                         + ("fallback CUs" if fallback else "offline")))
        print_summary("cortex bundle", rows)


def _runtime_sources() -> list[Path]:
    sources = sorted((JS_DIR / "src").glob("*.js"))
    if not sources or not (JS_DIR / "page" / "index.html").is_file():
        raise CortexError(f"the JavaScript runtime is missing ({JS_DIR / 'src'}): cortex bundle needs the js/ "
                          "folder of the Cortex source tree")
    return sources


def _one_file_runtime(sources: list[Path], build: Path) -> list[Path]:
    """js/build.mjs's files in `build` (index.js first), when they were built from exactly these
    js/src files; none otherwise (a stale build would ship old code)."""
    try:
        built = jsonlib.loads((build / f"{RUNTIME_FOLDER}.json").read_text())
        files = [build / RUNTIME_FOLDER / name for name in built["entry_points"]]
        current = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sources}
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if built.get("sources") != current or not files or not all(p.is_file() for p in files):
        return []
    return files


def _onnxruntime_web(given: Path | None) -> dict[str, bytes] | None:
    """onnxruntime-web's browser files by name, from `given` (refused in one line when it lacks
    them) or the first installed copy; None when there is none."""
    for package in [given] if given is not None else ORTWEB_PACKAGES:
        paths = [package / "dist" / name for name in ORTWEB_FILES]
        if all(p.is_file() for p in paths):
            return {p.name: p.read_bytes() for p in paths}
        if given is not None:
            missing = next(p for p in paths if not p.is_file())
            raise CortexError(f"--onnxruntime-web {given}: no {missing.relative_to(given)} (expected onnxruntime-web's "
                              "package folder, node_modules/onnxruntime-web)")
    return None


def _artifacts(cus: list[dict], dag: Path) -> dict[str, bytes]:
    """Each file the browser fetches (modules, weight files, fallback models), by its path relative
    to dag.json, its sha256 checked once however many CUs name it."""
    files = {}
    for cu in cus:
        record = {"path": cu["path"], "sha256": cu["sha256"]} if "runs_on" in cu else cu.get("artifacts", {}).get("wasm")
        if record is None:
            raise CortexError(f"{dag}: {cu['id']} has no wasm artifact; run 'cortex compile-wasm --dag {dag}' first")
        if "shared" in record.get("memory", {}):     # its modules import env.memory, which js/ does not provide
            raise CortexError(f"{dag}: built with compile-wasm --memory shared, which the JavaScript runtime does not "
                              "run yet; bundle a --memory per-cu build")
        variants = [v["artifacts"]["wasm"] for v in cu.get("variants", {}).values() if "wasm" in v.get("artifacts", {})]
        # Alternate modules (compile-wasm --features A;B): the runtime picks the first the engine runs.
        modules = [m for rec in [record, *variants] for m in [rec, *rec.get("alternates", ())]]
        for entry in [r for m in modules for r in [m, *m.get("weights", ())]]:
            if entry["path"] in files:
                continue
            path = confined_path(dag.parent, entry["path"])       # read_dag checked it stays inside
            files[entry["path"]] = read_artifact(path, entry["sha256"], f"{dag} ({cu['id']})",
                                                 f"rerun 'cortex compile-wasm --dag {dag}'")
    return files


def _source_model(document: dict, dag: Path) -> tuple[dict, bytes]:
    """The source model's record in the bundle and its checked bytes (`--with-source`)."""
    record = document.get("source_model")
    if record is None:
        raise CortexError(f"--with-source: {dag} records no source model; run 'cortex build-dag' again next to the "
                          "model it was decomposed from")
    if Path(record["path"]).is_absolute():
        raise CortexError(f"--with-source: {dag} names its source model by an absolute path, {record['path']}")
    data = read_artifact(dag.parent / record["path"], record["sha256"], f"{dag} (source_model)",
                         "run 'cortex build-dag' again next to the model it was decomposed from")
    return {"path": f"{SOURCE_FOLDER}/{Path(record['path']).name}", "sha256": record["sha256"]}, data


def _bundled_dag(document: dict, source: dict | None) -> dict:
    """dag.json as the bundle holds it: `source_model` names the copy, or is left out without one."""
    bundled = {k: v for k, v in document.items() if k != "source_model"}
    if source is not None:
        bundled["source_model"] = source
    if "specializations" in document:
        bundled["specializations"] = [_bundled_dag(section, source) for section in document["specializations"]]
    return bundled

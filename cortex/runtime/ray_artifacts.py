"""The files a Ray actor's CUs load, shipped through Ray's object store, so that no node needs the
dag folder (`cortex/runtime/ray_executor.py`).

The driver reads each file a stage's CUs need once, while it loads the model: the module and its
weight files of the artifact each CU's device runs (`artifacts.<artifact>`, its variants' too), or
its cu.onnx when that device runs cu.onnx files (a fallback CU on onnxruntime). dag.json names
those files in two ways: a `path` relative to its folder (wasm modules, weight files, cu.onnx), or
a `folder` whose entries each name a `file` (cuda). Each distinct file content is put in the
object store once, named by its sha256; the model holds the refs for its life, so an actor that
restarts on another node after its node died fetches them again, even once the folder is gone.

On each node an actor materialises its files in a cache folder (`$CORTEX_CACHE_DIR/ray-artifacts`,
else `~/.cache/cortex/ray-artifacts`, or `executor_options={"cache_dir": ...}`):
`blobs/<sha256>` holds each content, written through a temporary file, checked against its name,
then renamed, and fetched from the object store only when the node lacks it (a model loaded again,
or another stage on the node, fetches nothing). `bundles/<key>/` is a dag folder of hard links to
the blobs, at the paths dag.json names, plus the dag.json itself; its key is the sha256 of the
dag.json and of every file's content, so a changed file is a different bundle. The devices then
load from that folder exactly as from a local one, sha256 checks included: a file the driver
found changed is shipped as it is and refused by the device with the local error, whose paths the
actor writes back to the driver's folder, so the caller reads the same line as in a local run.

Why the object store and not a runtime_env `working_dir`: Ray zips a working_dir whole and keeps
it in the head's GCS, refused from 512 MiB (its gRPC message limit: a vgg19's weights alone pass
it); every node unpacks the whole folder (every CU, every target's files, cu.onnx copies of the
weights), an actor with its own runtime_env needs worker processes of its own, and nothing checks
the files against dag.json. Through the object store a node fetches only its stage's files, once
per content, verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from backends.registry import device as device_spec
from ir.errors import CortexError
from ir.fs import confined_path, sha256_bytes, write_bytes_atomically

CACHE_FOLDER = "ray-artifacts"
DAG_FILE = "dag.json"


def node_cache_dir() -> Path:
    """Where this node keeps shipped artifacts (read on the node, so each node may set its own)."""
    return Path(os.environ.get("CORTEX_CACHE_DIR") or Path.home() / ".cache" / "cortex") / CACHE_FOLDER


def placement_rule(dag: dict, device: str):
    """The device that runs each CU: the rule `SequentialScheduler` applies (its record's
    `runs_on`, else the model device's placement rule, else the model's device)."""
    spec = device_spec(device)
    place = spec.place(dag) if spec.place else (lambda cu: device)
    return lambda cu: cu.get("runs_on") or place(cu)


def record_files(record: dict) -> list[str]:
    """The files an artifact record names, relative to dag.json's folder."""
    found = [record["path"]] if isinstance(record.get("path"), str) else []
    for entry in record.get("weights") or ():
        if isinstance(entry, dict) and isinstance(entry.get("path"), str):
            found.append(entry["path"])
    folder = record.get("folder")
    if isinstance(folder, str):
        entries = [v for v in record.values() if isinstance(v, dict)]
        entries += [v for v in (record.get("cubins") or {}).values() if isinstance(v, dict)]
        found += [f"{folder}/{e['file']}" for e in entries if isinstance(e.get("file"), str)]
    return found


def cu_files(cu: dict, artifact: str | None) -> list[str]:
    """What a device running `artifact` (None: cu.onnx files) reads to load `cu` and its variants."""
    if artifact is None:
        return [cu["path"]]
    records = [cu.get("artifacts", {}).get(artifact)]
    records += [v.get("artifacts", {}).get(artifact) for v in cu.get("variants", {}).values()]
    return [path for record in records if record for path in record_files(record)]


def stage_files(dag: dict, device: str, cu_ids: list[str]) -> list[str]:
    rule = placement_rule(dag, device)
    cus = {cu["id"]: cu for cu in dag["cus"]}
    return list(dict.fromkeys(path for cu_id in cu_ids
                              for path in cu_files(cus[cu_id], device_spec(rule(cus[cu_id])).artifact)))


@dataclass(frozen=True)
class ShippedFile:
    path: str               # relative to dag.json's folder
    sha256: str | None      # of the content the driver read; None: the driver found no such file
    size: int


def read_files(folder: Path, paths: list[str]) -> tuple[list[ShippedFile], dict[str, bytes]]:
    """Each file as the driver reads it, and the distinct contents by sha256. A missing file is
    shipped as missing: the device names it on the actor as it would here."""
    shipped, contents = [], {}
    for path in dict.fromkeys(paths):
        where = confined_path(folder, path)       # read_dag checked every path stays inside
        try:
            data = where.read_bytes() if where is not None else None
        except OSError:
            data = None
        if data is None:
            shipped.append(ShippedFile(path, None, 0))
            continue
        digest = sha256_bytes(data)
        contents.setdefault(digest, data)
        shipped.append(ShippedFile(path, digest, len(data)))
    return shipped, contents


def bundle_key(dag: dict, files: list[ShippedFile]) -> str:
    text = json.dumps([dag, sorted((f.path, f.sha256) for f in files)], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def materialise(root: Path, key: str, dag: dict, files: list[ShippedFile], fetch) -> Path:
    """The dag.json of a folder on this node holding `files`; `fetch(sha256)` returns a content
    the node's blobs lack (from the object store)."""
    bundle = root / "bundles" / key
    for f in files:
        target = bundle / f.path
        if f.sha256 is None or _same_size(target, f.size):
            continue
        blob = root / "blobs" / f.sha256
        if not _verified_blob(blob, f):
            data = fetch(f.sha256)
            if sha256_bytes(data) != f.sha256:
                raise CortexError(f"{f.path}: the copy Ray delivered to this node differs from the driver's "
                                  "(sha256); load the model again")
            write_bytes_atomically(blob, data)
        _link(blob, target)
    if not (bundle / DAG_FILE).is_file():
        write_bytes_atomically(bundle / DAG_FILE, json.dumps(dag, indent=1).encode())
    return bundle / DAG_FILE


def _same_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _verified_blob(blob: Path, f: ShippedFile) -> bool:
    """A blob already on the node is hashed once, as a new bundle links it: a corrupted cache
    costs a fetch, never a wrong file. Bundles already made are the devices' to check (sha256 at
    load, as for any dag folder)."""
    if not _same_size(blob, f.size):
        return False
    h = hashlib.sha256()
    with open(blob, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest() == f.sha256


def _link(blob: Path, target: Path) -> None:
    """A hard link, not a symlink: the devices refuse a path that links out of the dag folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        os.link(blob, temporary)
    except OSError:                     # a filesystem without hard links
        shutil.copyfile(blob, temporary)
    os.replace(temporary, target)


def local_error(error: CortexError, bundle_dag: Path, dag_path: str, folder: str) -> CortexError:
    """`error` as the caller reads it from a local load: naming the driver's dag.json (`dag_path`,
    as the caller gave it) and folder (resolved, as the devices name files), not the node's copy."""
    text = str(error).replace(str(bundle_dag), dag_path)
    for copy in dict.fromkeys([str(bundle_dag.parent.resolve()), str(bundle_dag.parent)]):
        text = text.replace(copy, folder)
    return type(error)(text)

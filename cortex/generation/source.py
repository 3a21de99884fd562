"""What `cortex generate` and `cortex.generate` accept as a model: what `cortex build --kv-buckets`
wrote (its folder or dag.json), or a model folder as onnxruntime-genai's builder writes it
(model.onnx, genai_config.json, tokenizer.json) or any decoder's .onnx file, which is built on first
use into the build cache and reused after.

The build cache is content-addressed: the key hashes the model's files (model.onnx and its external
data), the generation options and the compiler's version, so an edited model or a new compiler
builds again and nothing stale is ever read. Builds land atomically (cortex build stages them)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from cortex.compile_cache import compiler_version, default_cache_dir
from cortex.decoder_io import GENAI_CONFIG, genai_config
from cortex.specializations import is_specialized
from ir.errors import CortexError
from ir.fs import file_sha256
from ir.options import option

DAG_FILE, MODEL_FILE, TOKENIZER_FILE = "dag.json", "model.onnx", "tokenizer.json"


@dataclass(frozen=True)
class GenerationBuild:
    kv_buckets: str | None = field(default=None, metadata=option(
        "For a model built on first use: the key/value cache lengths to compile (default: 256 and 1024, within the "
        "model's context length)."))
    prefill_chunks: str = field(default="64,8", metadata=option(
        "For a model built on first use: the prompt chunk lengths prefill runs."))
    targets: str = field(default="wasm", metadata=option("For a model built on first use: the targets to compile."))


@dataclass(frozen=True)
class ModelSource:
    dag: Path
    tokenizer: Path | None
    stop_ids: tuple[int, ...]       # the end-of-sequence ids genai_config.json names, if any


def builds_dir() -> Path:
    return default_cache_dir().parent / "builds"


def resolve(path: Path, build: GenerationBuild = GenerationBuild(), progress: bool = True) -> ModelSource:
    path = Path(path)
    if path.is_dir() and (path / DAG_FILE).is_file():
        dag = path / DAG_FILE
    elif path.is_file() and path.suffix == ".json":
        dag = path
    elif path.is_dir() and (path / MODEL_FILE).is_file():
        dag = _built(path / MODEL_FILE, build, progress)
    elif path.is_file() and path.suffix == ".onnx":
        dag = _built(path, build, progress)
    else:
        raise CortexError(f"{path}: not a model: expected a build's folder or dag.json, or a folder with {MODEL_FILE}")
    if not is_specialized(dag):
        raise CortexError(f"{dag}: built for one input shape, not for generation (build with --kv-buckets)")
    # beside the build, beside what was given, or beside the model the build was made from
    folders = [f for f in (dag.parent, path if path.is_dir() else path.parent, _source_folder(dag)) if f]
    tokenizer = next((f / TOKENIZER_FILE for f in folders if (f / TOKENIZER_FILE).is_file()), None)
    return ModelSource(dag, tokenizer, next((ids for f in folders[1:] if (ids := _eos_ids(f))), ()))


def _eos_ids(folder: Path) -> tuple[int, ...]:
    eos = genai_config(folder).get("eos_token_id", [])
    try:
        return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    except (ValueError, TypeError):
        raise CortexError(f"{folder / GENAI_CONFIG}: eos_token_id is not a list of ids") from None


def _source_folder(dag: Path) -> Path | None:
    try:
        source = json.loads(dag.read_text()).get("source_model", {}).get("path")
    except (OSError, ValueError, AttributeError):
        return None
    return (dag.parent / source).resolve().parent if isinstance(source, str) else None


def _built(model: Path, build: GenerationBuild, progress: bool) -> Path:
    buckets = build.kv_buckets or _default_buckets(model)
    hashes = {p.name: file_sha256(p) for p in sorted(model.parent.iterdir())
              if p == model or p.name.startswith(model.name + ".") or p.suffix == ".data"}
    key = hashlib.sha256(json.dumps({"files": hashes, "kv_buckets": buckets, "prefill_chunks": build.prefill_chunks,
                                     "targets": build.targets, "compiler": compiler_version()},
                                    sort_keys=True).encode()).hexdigest()[:32]
    folder = builds_dir() / key
    if (folder / DAG_FILE).is_file():
        return folder / DAG_FILE
    folder.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-c", "from cortex.entry import main; main()", "build", str(model),
               "--output", str(folder), "--targets", build.targets, "--kv-buckets", buckets,
               "--prefill-chunks", build.prefill_chunks, "--json"]
    console = Console(stderr=True)
    with console.status(f"building {model} for generation (first use; kept in {builds_dir()})",
                        spinner="dots") if progress and console.is_terminal else contextlib.nullcontext():
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["cortex build failed"])[-1]
        raise CortexError(f"building {model} for generation: {last.removeprefix('error: ')}")
    return folder / DAG_FILE


def _default_buckets(model: Path) -> str:
    try:
        context = int(genai_config(model.parent).get("context_length", 1024))
    except (ValueError, TypeError):
        raise CortexError(f"{model.parent / GENAI_CONFIG}: context_length is not a number") from None
    return ",".join(str(b) for b in sorted({min(256, context), min(1024, context)}))


"""The sha256 of every generated artifact for the samples, the light models and MiniLM.

A refactor that claims to leave code generation alone proves it by two runs, before and after,
whose files compare equal (`diff` or `python -m bench.codegen_digest --compare A B`). Each model
goes through the installed `cortex` command, as a user runs it: decompose with defaults, build-dag,
compile-wasm at the default options and at `--opt-level 3 --features simd,relaxed-simd` (WAT and
.wasm), compile-cuda (the .cu sources; PTX and cubins depend on the toolkit, not on Cortex), also with
the scratch offsets masked.

    python -m bench.codegen_digest --output before.json [--models cnn,minilm]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from samples import light_models, minilm

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
SAMPLE_BINDINGS = {"mlp": ["--dim", "batch=2"], "cnn": [], "transformer_block": ["--dim", "seq=16"]}
# Where a temporary sits in a CUDA kernel's scratch space: the memory planner's choice. The masked
# digest shows that a change of placement is all that changed.
SCRATCH_OFFSET = re.compile(rb"\(scratch \+ \d+\)")
WASM_VARIANTS = {"default": [], "o3-relaxed": ["--opt-level", "3", "--features", "simd,relaxed-simd"]}


def models() -> dict[str, tuple[Path, list[str]]]:
    found = {name: (SAMPLES / f"{name}.onnx", args) for name, args in SAMPLE_BINDINGS.items()}
    for name in light_models.LIGHT_MODEL_NAMES:
        found[f"light_{name}"] = (light_models.LIGHT_DIR / f"light_{name}.onnx", [])
    m = minilm.minilm(1, 128)
    found["minilm"] = (m.path, [arg for k, v in m.dims.items() for arg in ("--dim", f"{k}={v}")])
    return found


def cortex(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "cortex.cli", *argv], check=True, stdout=subprocess.DEVNULL)


def digest_model(path: Path, bindings: list[str], work: Path) -> dict[str, str]:
    cus, dag = work / "cus", work / "dag.json"
    cortex("decompose", "--model-path", str(path), "--output-dir", str(cus), *bindings, "--json")
    cortex("build-dag", "--cu-dir", str(cus), "--output", str(dag), "--json")
    hashes = {}
    for variant, args in WASM_VARIANTS.items():
        out = work / f"wasm-{variant}"
        cortex("compile-wasm", "--cu-dir", str(cus), "--output", str(out), "--emit-wat", *args, "--json")
        for f in sorted([*out.glob("*.wat"), *out.glob("*.wasm")]):
            hashes[f"{variant}/{f.name}"] = hashlib.sha256(f.read_bytes()).hexdigest()
    out = work / "cuda"
    cortex("compile-cuda", "--cu-dir", str(cus), "--output", str(out), "--compiler", "nvrtc", "--json")
    for f in sorted([*out.glob("*.cu"), *out.glob("*.weights")]):
        hashes[f"cuda/{f.name}"] = hashlib.sha256(f.read_bytes()).hexdigest()
        if f.suffix == ".cu":
            masked = SCRATCH_OFFSET.sub(b"(scratch + ?)", f.read_bytes())
            hashes[f"cuda-offsets-masked/{f.name}"] = hashlib.sha256(masked).hexdigest()
    return hashes


def compare(a: dict, b: dict) -> list[str]:
    """The files that differ, for the models both runs digested."""
    differences = []
    for model in sorted(set(a) & set(b)):
        fa, fb = a.get(model, {}), b.get(model, {})
        for name in sorted(set(fa) | set(fb)):
            if fa.get(name) != fb.get(name):
                differences.append(f"{model}: {name}")
    return differences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path)
    parser.add_argument("--models", help="comma-separated subset (default: all)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        differences = compare(a, b)
        common = sorted(set(a) & set(b))
        print("\n".join(differences) or f"identical: {sum(len(a[m]) for m in common)} files of {len(common)} models")
        sys.exit(1 if differences else 0)
    chosen = models()
    if args.models:
        chosen = {k: chosen[k] for k in args.models.split(",")}
    result = {}
    for name, (path, bindings) in chosen.items():
        with tempfile.TemporaryDirectory() as work:
            result[name] = digest_model(path, bindings, Path(work))
        print(f"{name}: {len(result[name])} files", flush=True)
    text = json.dumps(result, indent=1, sort_keys=True) + "\n"
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()

"""Make Cortex's sample models and test data.

    python samples/make_samples.py --all         # everything below
    python samples/make_samples.py --samples     # samples/{mlp,cnn,transformer_block}.onnx (committed)
    python samples/make_samples.py --node-tests  # .cache/onnx-node-tests/<case>/ (ONNX backend node tests)
    python samples/make_samples.py --minilm      # .cache/models/minilm-l6.onnx

Cached data is rebuilt only when missing unless --force is given. The nine light models need no
step: they ship inside the onnx wheel (see samples/light_models.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from samples.cache import ensure_file  # noqa: E402
from samples.light_models import LIGHT_DIR, LIGHT_MODEL_NAMES  # noqa: E402
from samples.minilm import ensure_minilm  # noqa: E402
from samples.node_tests import ensure_node_tests  # noqa: E402


def make_committed_samples() -> list[Path]:
    from samples.small_models import SAMPLE_NAMES, SAMPLES_DIR, export_sample

    written = []
    for name in SAMPLE_NAMES:
        data = export_sample(name)
        written.append(ensure_file(SAMPLES_DIR / f"{name}.onnx", lambda tmp: tmp.write_bytes(data), force=True))
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="make everything")
    parser.add_argument("--samples", action="store_true", help="re-export the committed sample models")
    parser.add_argument("--node-tests", action="store_true", help="generate the ONNX backend node tests")
    parser.add_argument("--minilm", action="store_true", help="export MiniLM-L6 to ONNX")
    parser.add_argument("--force", action="store_true", help="rebuild cached data even if present")
    args = parser.parse_args(argv)
    if not (args.all or args.samples or args.node_tests or args.minilm):
        parser.error("say what to make: --all, --samples, --node-tests or --minilm")
    if args.all or args.samples:
        for path in make_committed_samples():
            print(f"wrote {path}")
    if args.all or args.node_tests:
        folder = ensure_node_tests(force=args.force)
        print(f"node tests: {sum(1 for _ in folder.iterdir())} cases in {folder}")
    if args.all or args.minilm:
        print(f"MiniLM-L6: {ensure_minilm(force=args.force)}")
    if args.all:
        print(f"light models: {len(LIGHT_MODEL_NAMES)} in {LIGHT_DIR}")


if __name__ == "__main__":
    main()

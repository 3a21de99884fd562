"""The wasm device: runs CUs compiled by `cortex compile-wasm` under wasmtime.

One wasmtime Engine, configured with the features the modules were built with, serves every CU.
`load` checks each module's sha256 against dag.json (a tampered or stale file is refused) and
instantiates it from its cached native code (`native_cache`). Running copies a CU's inputs into
its memory, makes one call, and hands its outputs on as zero-copy views of that memory, valid until
the CU runs again; `to_host` copies them out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import wasmtime

from backends.registry import HostTensors
from backends.wasm.assemble import make_engine
from backends.wasm.instance import WasmInstance
from backends.wasm.native_cache import Stamps, load_module
from backends.wasm.options import WasmOptions, parse_options
from ir.errors import CortexError
from ir.fs import confined_path


class WasmDevice(HostTensors):
    name = "wasm"
    concurrent_runs = True   # one store per instance, and wasmtime's engine and modules are shared safely between threads

    def __init__(self, dag: dict, dag_path: Path):
        self.dag_path = Path(dag_path)
        for cu in dag["cus"]:
            if "wasm" not in cu.get("artifacts", {}):
                raise CortexError(f"{dag_path}: {cu['id']} has no wasm artifact; run 'cortex compile-wasm "
                                  f"--dag {dag_path}' first")
        self.options = _common_options([cu["artifacts"]["wasm"] for cu in dag["cus"]], self.dag_path)
        self.engine = make_engine(self.options)
        self.instances: dict[str, WasmInstance] = {}

    def load(self, cus: list[dict]) -> None:
        stamps = Stamps()
        for cu in cus:
            if cu["id"] in self.instances:
                continue
            record = cu["artifacts"]["wasm"]
            path = confined_path(self.dag_path.parent, record["path"])   # read_dag checked it stays inside
            module = load_module(self.engine, path, record["sha256"], self.dag_path, cu["id"], stamps)
            self.instances[cu["id"]] = WasmInstance(self.engine, module, record["memory"])
        stamps.save()

    def run(self, cu: dict, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            return self.instances[cu["id"]].run(inputs)
        except wasmtime.Trap as e:
            raise CortexError(f"{cu['id']} ({', '.join(cu.get('op_types', []))}) trapped: {_trap_reason(e)}") from None

    def resident_bytes(self, cu_id: str) -> int:
        instance = self.instances.get(cu_id)
        return instance.memory.data_len(instance.store) if instance else 0


def _trap_reason(trap: wasmtime.Trap) -> str:
    """wasmtime puts the backtrace first and the reason ("wasm trap: ...") last."""
    lines = [line.strip() for line in str(trap).splitlines() if line.strip()]
    reasons = [line.removeprefix("wasm trap: ") for line in lines if line.startswith("wasm trap:")]
    return reasons[-1] if reasons else (lines[-1] if lines else "unknown trap")


def _common_options(records: list[dict], dag_path: Path) -> WasmOptions:
    """One engine for all modules: it enables the union of the features they were built with."""
    features = sorted({f for r in records for f in r["options"]["features"]})
    target = records[0]["options"].get("target") if records else None
    try:
        return parse_options(target, ",".join(features), None)
    except CortexError as e:
        raise CortexError(f"{dag_path}: wasm artifacts record unusable options: {e}") from None

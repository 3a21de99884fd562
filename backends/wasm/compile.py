"""One static-shape model (a computation unit) -> one WebAssembly module.

The graph goes through the loop-nest lowerings of its ops, the memory plan, the WAT renderer and
the assembler. Everything here is a pure function of the graph and the options, so the same inputs
give byte-identical modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.wasm.assemble import assemble
from backends.wasm.intrinsics import kernels as contraction_kernels
from backends.wasm.memory_plan import describe_plan, place_storages
from backends.wasm.options import WasmOptions
from backends.wasm.render import render_module
from backends.wasm.shared_memory import place_shared
from backends.wasm.weights_files import weight_segments
from codegen.lower import lower_graph
from ir.fs import sha256_bytes
from ir.graph import Graph
from ir.loops.program import WEIGHT

# WAT files show weights inline only up to this size; bigger ones are elided (the .wasm has them).
_WAT_INLINE_WEIGHTS = 1 << 20


@dataclass
class WasmArtifact:
    wasm: bytes
    wat: str
    plan: dict
    weights: list[tuple[int, bytes]] = field(default_factory=list)   # outside the module (external_weights)

    @property
    def sha256(self) -> str:
        return sha256_bytes(self.wasm)


def compile_graph(graph: Graph, options: WasmOptions) -> WasmArtifact:
    program = lower_graph(graph, contraction_kernels(options))
    layout = options.shared_layout
    if layout is None:
        memory_bytes, arena_bytes = place_storages(program)
        wat, threads = render_module(program, options, memory_bytes)
    else:   # one region of the model's memory, which the module imports (--memory shared)
        memory_bytes, arena_bytes = layout.region_bytes, place_shared(program, layout)
        wat, threads = render_module(program, options, layout.memory_bytes)
    wasm = assemble(wat, program, options)
    plan = describe_plan(program, memory_bytes, arena_bytes)
    if layout is not None:
        plan["shared"] = layout.to_json()
    if threads is not None:     # a shared memory of this many pages, parts on threads (kernel_parts.py)
        plan["threads"] = threads
        plan["memory_bytes"] = threads["pages"] * 65536
    if options.external_weights:
        return WasmArtifact(wasm, wat, plan, weight_segments(program))
    return WasmArtifact(wasm, _with_inline_weights(wat, program), plan)


def _with_inline_weights(wat: str, program) -> str:
    """The WAT a reader can inspect (and reassemble when the weights are small enough)."""
    weights = [s for s in program.storages if s.kind == WEIGHT and s.nbytes]
    if sum(s.nbytes for s in weights) > _WAT_INLINE_WEIGHTS:
        return ";; weights elided from this listing (see the data section of the .wasm)\n" + wat
    for s in weights:
        escaped = "".join(f"\\{b:02x}" for b in s.data)
        for placeholder in (f"(data ${_ident(s.name)} \"\")", f"(data (i32.const {s.offset}) \"\")"):
            wat = wat.replace(placeholder, placeholder[:-3] + f"\"{escaped}\")", 1)
    return wat


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_.-" else "_" for c in name)

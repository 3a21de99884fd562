"""WAT text -> validated .wasm bytes.

`wasmtime.wat2wasm` assembles the code; the weights are then written straight into the binary's
data section (the WAT carries empty segments as placeholders), which keeps multi-megabyte weights
out of the text. The result is validated against an engine with the module's features enabled.
"""

from __future__ import annotations

import wasmtime

from backends.wasm.options import WasmOptions
from ir.errors import CortexError
from ir.loops.program import WEIGHT, Program

_DATA_SECTION = 11


def assemble(wat: str, program: Program, options: WasmOptions) -> bytes:
    try:
        code = bytes(wasmtime.wat2wasm(wat))
    except wasmtime.WasmtimeError as e:
        raise RuntimeError(f"generated WAT does not assemble: {str(e).splitlines()[0]}") from e
    weights = [s for s in program.storages if s.kind == WEIGHT and s.nbytes]
    if weights and not options.external_weights:
        code = _replace_data_section(code, _data_section(weights, passive=options.bulk_memory))
    validate(code, options)
    return code


def make_engine(options: WasmOptions, epoch_interruption: bool = False, segments: bool = False) -> wasmtime.Engine:
    """An engine for modules built with `options`; with `epoch_interruption`, compiled code checks
    the store's epoch deadline (the sandbox's time limit, backends/wasm/sandbox.py); with
    `segments`, it also runs the driver modules of segments (backends/wasm/segment.py), which copy
    between memories (bulk memory, multi-memory) whatever the CUs were built with."""
    config = wasmtime.Config()
    config.epoch_interruption = epoch_interruption
    config.wasm_simd = options.simd
    config.wasm_relaxed_simd = options.relaxed_simd
    config.wasm_bulk_memory = options.bulk_memory or segments
    config.wasm_multi_memory = segments
    config.wasm_threads = options.threads
    config.shared_memory = options.threads
    # The host's own lowering of relaxed SIMD, not wasmtime's deterministic one: that emulates a
    # signed x signed i16x8.relaxed_dot in several instructions and halves the 4-bit GEMV (1x4096x4096
    # int4 at accuracy level 4: 1.56 ms against 0.80 ms). Every relaxed instruction the kernels emit
    # keeps to the inputs on which all lowerings agree (the dot's second operand 7-bit, truncation of
    # integral |k| <= 151), but relaxed_madd: fused on hosts with FMA (every x86-64 since 2013, ARM64),
    # as the deterministic mode fuses it; mul then add, last bits apart, on x86 without FMA.
    config.wasm_relaxed_simd_deterministic = False
    config.cranelift_opt_level = "speed"
    return wasmtime.Engine(config)


def validate(code: bytes, options: WasmOptions) -> None:
    try:
        wasmtime.Module.validate(make_engine(options), code)
    except wasmtime.WasmtimeError as e:
        raise CortexError(f"generated module is invalid for features {','.join(options.features) or 'none'}: "
                          f"{str(e).splitlines()[0]}") from None


def _data_section(weights, passive: bool) -> bytes:
    body = bytearray(_uleb(len(weights)))
    for s in weights:
        if passive:  # flag 1: passive segment, no memory index or offset
            body += b"\x01" + _uleb(len(s.data)) + s.data
            continue
        offset = s.offset if s.offset < 1 << 31 else s.offset - (1 << 32)
        body += b"\x00\x41" + _sleb(offset) + b"\x0b" + _uleb(len(s.data)) + s.data
    return bytes(body)


def _replace_data_section(module: bytes, payload: bytes) -> bytes:
    pos, out = 8, bytearray(module[:8])
    while pos < len(module):
        section_id = module[pos]
        size, after = _read_uleb(module, pos + 1)
        end = after + size
        if section_id == _DATA_SECTION:
            out += bytes([_DATA_SECTION]) + _uleb(len(payload)) + payload
        else:
            out += module[pos:end]
        pos = end
    return bytes(out)


def _uleb(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _sleb(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if (n == 0 and not byte & 0x40) or (n == -1 and byte & 0x40):
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def _read_uleb(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos

"""What `compile-wasm` can be asked for: target, WebAssembly features and optimisation level."""

from __future__ import annotations

from dataclasses import dataclass

from ir.errors import CortexError

TARGETS = ("wasm32-unknown-unknown",)
FEATURES = ("simd", "bulk-memory", "relaxed-simd")
OPT_LEVELS = ("0", "1", "2", "3", "s", "z")
# Without bulk-memory weights stay in active segments that wasmtime maps copy-on-write at load.
DEFAULT_FEATURES = ("simd",)


@dataclass(frozen=True)
class WasmOptions:
    target: str = TARGETS[0]
    features: tuple[str, ...] = DEFAULT_FEATURES     # sorted, no duplicates
    opt_level: str = "2"

    @property
    def simd(self) -> bool:
        return "simd" in self.features

    @property
    def relaxed_simd(self) -> bool:
        return "relaxed-simd" in self.features

    @property
    def bulk_memory(self) -> bool:
        return "bulk-memory" in self.features

    @property
    def vectorize(self) -> bool:
        """Level 0 is plain loops and z favours size over speed; the others use SIMD128 when enabled."""
        return self.simd and self.opt_level not in ("0", "z")

    @property
    def unroll(self) -> int:
        """How many vector iterations one loop trip does (more code, fewer branches)."""
        return {"2": 2, "3": 4}.get(self.opt_level, 1)

    def to_json(self) -> dict:
        return {"target": self.target, "features": list(self.features), "opt_level": self.opt_level}


def parse_options(target: str | None, features: str | None, opt_level: str | None) -> WasmOptions:
    target = target or TARGETS[0]
    if target not in TARGETS:
        raise CortexError(f"unknown --target {target!r}: expected one of {', '.join(TARGETS)}")
    if features is None:
        chosen = set(DEFAULT_FEATURES)
    else:
        chosen = {f.strip() for f in features.split(",") if f.strip()}
        unknown = sorted(chosen - set(FEATURES))
        if unknown:
            raise CortexError(f"unknown --features {', '.join(unknown)}: expected a comma-separated "
                              f"subset of {', '.join(FEATURES)}")
    if "relaxed-simd" in chosen and "simd" not in chosen:
        raise CortexError("--features relaxed-simd needs simd as well")
    level = str(opt_level if opt_level is not None else "2")
    if level not in OPT_LEVELS:
        raise CortexError(f"unknown --opt-level {level!r}: expected one of {', '.join(OPT_LEVELS)}")
    return WasmOptions(target, tuple(sorted(chosen)), level)

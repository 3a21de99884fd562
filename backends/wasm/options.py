"""What `compile-wasm` can be asked for: target, WebAssembly features, optimisation level and
whether to write the WAT listing. The fields are the CLI's options (`ir.options`).

`--features` takes one feature set or several separated by ';' (`simd,relaxed-simd;simd`): the
first is the primary set, the module the Python runtime runs; each further set builds every CU
again into an alternate module that dag.json records beside it, so that an engine without a
feature of the primary set (Node 20 without --experimental-wasm-relaxed-simd, Safari) runs the
first alternate it validates instead, as onnxruntime-web picks one of its builds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from backends.wasm.shared_layout import SharedLayout
from ir.errors import CortexError
from ir.options import from_text, option

TARGETS = ("wasm32-unknown-unknown",)
# threads: the threads proposal (a shared memory, atomics): a CU's large contractions run as
# `kernel_parts` parts on several threads (backends/wasm/kernel_parts.py).
FEATURES = ("simd", "bulk-memory", "relaxed-simd", "threads")
OPT_LEVELS = ("0", "1", "2", "3", "s", "z")
# Without bulk-memory weights stay in active segments that wasmtime maps copy-on-write at load.
DEFAULT_FEATURES = ("simd",)
# per-cu: each CU's module owns its memory (the sandbox's unit); shared: one model memory (docs/runtime.md).
MEMORY_MODES = ("per-cu", "shared")


FEATURE_SET_SEPARATOR = ";"


def parse_features(text: str) -> tuple[tuple[str, ...], ...]:
    """The feature sets of `--features`, the primary one first: `simd,relaxed-simd;simd` ->
    (("relaxed-simd", "simd"), ("simd",)). WasmOptions splits them into `features` and
    `alternate_features`."""
    sets = text.split(FEATURE_SET_SEPARATOR)
    if len(sets) > 1 and any(not s.strip() for s in sets):
        raise CortexError(f"--features {text!r}: an empty feature set between '{FEATURE_SET_SEPARATOR}'s; "
                          f"give each set as a comma-separated subset of {', '.join(FEATURES)}")
    return tuple(_parse_feature_set(s) for s in sets)


def _parse_feature_set(text: str) -> tuple[str, ...]:
    chosen = {f.strip() for f in text.split(",") if f.strip()}
    unknown = sorted(chosen - set(FEATURES))
    if unknown:
        raise CortexError(f"unknown --features {', '.join(unknown)}: expected a comma-separated "
                          f"subset of {', '.join(FEATURES)} (several sets separated by '{FEATURE_SET_SEPARATOR}')")
    return tuple(sorted(chosen))


def show_features(features: tuple[str, ...]) -> str:
    return ",".join(features)


@dataclass(frozen=True)
class WasmOptions:
    target: str = field(default=TARGETS[0], metadata=option(f"One of: {', '.join(TARGETS)}.", choices=TARGETS))
    features: tuple[str, ...] = field(default=DEFAULT_FEATURES, metadata=option(
        f"Comma-separated subset of {','.join(FEATURES)}; several sets separated by '{FEATURE_SET_SEPARATOR}' "
        "(simd,relaxed-simd;simd): the first is the primary module, each further set an alternate module of "
        "every CU that an engine lacking a feature of the first runs instead.",
        parse=parse_features, show=show_features))
    opt_level: str = field(default="2", metadata=option(
        f"One of {', '.join(OPT_LEVELS)}: 0 plain loops, 1-3 more vectorisation and unrolling, s/z smaller code.",
        choices=OPT_LEVELS))
    emit_wat: bool = field(default=False, compare=False, metadata=option(
        "Also write cu-NNNN.wat next to each module."))
    external_weights: bool = field(default=False, metadata=option(
        "Store weights in content-addressed weights/<sha256>.bin files, written into memory at load, and "
        "each module as modules/<sha256>.wasm, so identical weights and modules are stored once (always on "
        "for shape specializations)."))
    memory: str = field(default=MEMORY_MODES[0], metadata=option(
        "per-cu: each CU's module owns its linear memory and tensors are copied across CU borders; shared: "
        "every module imports one model memory, and a tensor crossing a CU border is read in place.",
        choices=MEMORY_MODES))
    kernel_parts: int = field(default=4, metadata=option(
        "With --features threads: each large contraction is cut into this many parts, which as many threads "
        "share at run time (1 to 16; the result is the same whatever the number of threads)."))
    # Not an option: the driver sets it per CU from the model-level plan (backends/wasm/shared_memory.py).
    shared_layout: SharedLayout | None = None
    # Not an option of its own: the sets after the first that --features names (its parser hands
    # every set to `features`, and __post_init__ keeps the first there).
    alternate_features: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self):
        if self.features and all(isinstance(s, tuple) for s in self.features):     # parse_features' sets
            object.__setattr__(self, "alternate_features", (*self.features[1:], *self.alternate_features))
            object.__setattr__(self, "features", self.features[0])
        self._check_alternates()
        if "relaxed-simd" in self.features and "simd" not in self.features:
            raise CortexError("--features relaxed-simd needs simd as well")
        if isinstance(self.kernel_parts, bool) or not isinstance(self.kernel_parts, int) \
                or not 1 <= self.kernel_parts <= 16:
            raise CortexError(f"--kernel-parts must be a whole number from 1 to 16, got {self.kernel_parts!r}")
        if self.threads and self.shared:
            raise CortexError("--features threads and --memory shared both decide the memory; choose one")
        if self.external_weights and self.bulk_memory:
            # Both move the weights out of active segments; external files leave no segment to copy.
            raise CortexError("--external-weights and --features bulk-memory both place the weights; choose one")

    def _check_alternates(self) -> None:
        sets = [self.features, *self.alternate_features]
        for i, chosen in enumerate(self.alternate_features):
            if chosen in sets[:i + 1]:
                raise CortexError(f"--features names the set {','.join(chosen) or '(none)'} twice")
            if ("threads" in chosen) != self.threads:
                # A threads module imports a shared memory and is run by workers: another way to load it.
                raise CortexError(f"--features {show_sets(sets)}: every set must have threads or none may")
            self.for_features(chosen)             # each set must make sense on its own
        if self.alternate_features and self.shared:
            raise CortexError(f"--features {show_sets(sets)}: --memory shared plans one model memory for the "
                              "primary set's modules; alternate sets need --memory per-cu")

    def for_features(self, features: tuple[str, ...]) -> "WasmOptions":
        """These options with `features` as their only set: what an alternate module is built with."""
        return dataclasses.replace(self, features=features, alternate_features=())

    @property
    def shared(self) -> bool:
        return self.memory == "shared"

    @property
    def simd(self) -> bool:
        return "simd" in self.features

    @property
    def relaxed_simd(self) -> bool:
        return "relaxed-simd" in self.features

    @property
    def threads(self) -> bool:
        return "threads" in self.features

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
        """What the module depends on, as dag.json records it."""
        found = {"target": self.target, "features": list(self.features), "opt_level": self.opt_level}
        if self.shared:     # per-cu records stay as they were
            found["memory"] = self.memory
        if self.threads:
            found["kernel_parts"] = self.kernel_parts
        return found


def show_sets(sets) -> str:
    return FEATURE_SET_SEPARATOR.join(",".join(s) for s in sets)


def parse_options(target: str | None, features: str | None, opt_level: str | None) -> WasmOptions:
    """The options as typed (None: the default), e.g. parse_options(None, "simd,relaxed-simd", "3")."""
    return from_text(WasmOptions, target=target, features=features,
                     opt_level=None if opt_level is None else str(opt_level))

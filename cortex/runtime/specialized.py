"""A model compiled for several input shapes or input values (a cortex.dag/2 dag.json): each
request runs on the specialization whose input values (`--specialize`) equal its inputs' and whose
input shapes match them exactly, whose CUs load when a request first picks it (`SpecializedModel`:
locks, eager loading, one memory budget for all). An input specialised by value is checked (dtype,
shape, a compiled value) and left out of the feeds of the section, whose build froze it.

With `pad_to_bucket` (a dim name given to `--dim`, or an input given several `--input-shape`s), a
request no specialization matches exactly is padded with `pad_value` up to the nearest larger
bucket along the axes that carry that dim, run there, and its outputs sliced back along theirs.
An axis carries the dim when its extent equals the bucket's value in every specialization (inputs
and outputs alike). That is only sound for models that ignore padded positions (docs/runtime.md,
"Shape specializations"): the caller asks for it by name, it is never done silently.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from backends.limits import no_sandbox_events
from cortex.runtime.feeds import checked_input
from cortex.runtime.memory import required_bytes
from cortex.runtime.options import RuntimeOptions
from cortex.specializations import frozen_specs, read_specialized_dag, section_dag, shapes_text
from cortex.value_specializations import values_text
from ir.errors import CortexError

class SpecializedModel:
    """One `CompiledModel` per specialization, made at load with its dag checked but its CUs not
    loaded: a specialization's CUs load when a request first picks it (`specializations="eager"` in
    its `RuntimeOptions`: all at load), so a process serving one shape holds one copy of the weights,
    not one per shape. It also reads the options' `pad_to_bucket` and `pad_value`.

    Requests may come from several threads. Each specialization has a lock: its CUs load once,
    under it, however many first requests wait, and one request at a time enters its stores
    (wasmtime's rule), while requests of other specializations run meanwhile. Under a memory
    budget the budget is the whole model's: one lock for all, and before a request its
    specialization may hold what the others do not (`_share_budget`)."""

    def __init__(self, dag_path: Path, open_model: Callable[[dict], object], options: RuntimeOptions | None = None):
        options = RuntimeOptions() if options is None else options
        pad_to_bucket = options.pad_to_bucket
        self.path = Path(dag_path)
        self.dag = read_specialized_dag(self.path)
        self.sections = self.dag["specializations"]
        self.models = [open_model(section_dag(s)) for s in self.sections]
        self.value_inputs = frozen_specs(self.sections[0], self.sections[0].get("input_values", {}))
        self.buckets = Buckets(self.sections, pad_to_bucket) if pad_to_bucket is not None else None
        self.pad_value = options.pad_value
        self.memory_budget = self.models[0].memory_budget       # bytes, or None; the same for every one
        shared = threading.Lock()
        self._locks = [shared if self.memory_budget is not None else threading.Lock() for _ in self.sections]
        self._last_run = [0] * len(self.sections)      # request count when each last ran (0: never)
        self._requests = 0
        self._chosen = 0
        self.specialization: str | None = None     # the name the last request ran on
        if options.specializations == "eager":
            for i in range(len(self.sections)):
                self.specialization_model(i)

    @property
    def chosen(self):
        """The model of the specialization the last request ran on (before any: the first's)."""
        return self.models[self._chosen]

    @property
    def inputs(self) -> list[dict]:
        """What a caller feeds: the chosen section's inputs and those specialised by value."""
        return [*self.chosen.inputs, *self.value_inputs]

    @property
    def outputs(self) -> list[dict]:
        return self.chosen.outputs

    @property
    def trace(self) -> list[dict]:
        return self.chosen.trace

    @property
    def last_trace(self) -> dict:
        return self.chosen.last_trace

    @property
    def scheduler(self):
        """The scheduler of the specialization the last request ran on (loading it if need be)."""
        return self.specialization_model(self._chosen).scheduler

    def trace_document(self) -> dict:
        return self.chosen.trace_document()

    def loaded_specializations(self) -> list[str]:
        """The specializations whose CUs are loaded (or were: a budget may have evicted them since)."""
        return [s["name"] for s, model in zip(self.sections, self.models) if model.loaded]

    def sandbox_events(self) -> dict[str, int]:
        """The sandbox's counts over the model's life, every loaded specialization's summed."""
        totals = no_sandbox_events()
        for model in self.models:
            if model.loaded:
                for counter, count in model.sandbox_events().items():
                    totals[counter] += count
        return totals

    def resident_bytes(self) -> int:
        """What the loaded specializations' resident CUs hold, all together."""
        return sum(model.scheduler.resident_bytes() for model in self.models if model.loaded)

    def close(self) -> None:
        for model in self.models:
            model.close()

    def run(self, feeds: dict, outputs: list[str] | None = None, policy=None) -> dict[str, np.ndarray]:
        if not isinstance(feeds, dict):
            raise CortexError("inputs must be a dict of name -> numpy array")
        i, length = self._pick({name: list(np.shape(value)) for name, value in feeds.items()}, str(self.path), feeds)
        feeds = {name: value for name, value in feeds.items() if name not in self.sections[i].get("input_values", {})}
        if length is None:
            return self._run_on(i, feeds, outputs, policy)
        padded = {name: self.buckets.pad(name, np.asarray(value), i, self.pad_value) for name, value in feeds.items()}
        results = self._run_on(i, padded, outputs, policy)
        return {name: self.buckets.slice(name, value, i, length) for name, value in results.items()}

    def specialization_for(self, shapes: dict[str, list[int]], label: str | None = None,
                           feeds: dict | None = None) -> str:
        """The name of the specialization that inputs of these shapes run on (exactly, or padded up
        under `pad_to_bucket`), by the rule `run` applies; when none takes them, the one error `run`
        raises, listing the compiled shapes, with `label` naming the model (default: its path).
        Without `feeds` the inputs specialised by value are not looked at (a server asks about the
        shapes before it reads the data), with them they are. It reads only dag.json, so any thread
        may ask while another runs the model."""
        return self.sections[self._pick(shapes, label or str(self.path), feeds)[0]]["name"]

    def _pick(self, shapes: dict[str, list[int]], label: str, feeds: dict | None = None) -> tuple[int, int | None]:
        """The specialization these shapes (and the values in `feeds`) run on, and their length
        along the padded dim (None: an exact match, no padding)."""
        among = self.with_values(feeds, label) if feeds is not None else range(len(self.sections))
        i = self.exact(shapes, among)
        if i is not None:
            return i, None
        if self.buckets is None:
            raise CortexError(f"no shape specialization matches the inputs ({shapes_text(shapes)}); {label} "
                              f"was compiled for: {self.compiled_shapes()}")
        return self.buckets.nearest(shapes, label, self.compiled_shapes(), among)

    def with_values(self, feeds: dict, label: str) -> list[int]:
        """The specializations compiled for the values `feeds` give the inputs specialised by value
        (all, for a model of shape specializations only); a missing input, one of another dtype or
        shape, or a value not compiled is one error."""
        if not self.value_inputs:
            return list(range(len(self.sections)))
        given = {}
        for spec in self.value_inputs:
            given[spec["name"]] = checked_input(spec["name"], spec, feeds).reshape(-1)[0].item()
        among = [i for i, s in enumerate(self.sections) if s["input_values"] == given]
        if not among:
            raise CortexError(f"no value specialization matches the inputs ({values_text(given)}); {label} was "
                              f"compiled for: {self.compiled_values()}")
        return among

    def compiled_values(self) -> str:
        return "; ".join(dict.fromkeys(values_text(s["input_values"]) for s in self.sections))

    def exact(self, shapes: dict[str, list[int]], among=None) -> int | None:
        """The specialization compiled for exactly these input shapes (of those `among`), if one is."""
        return next((i for i in (range(len(self.sections)) if among is None else among)
                     if shapes == self.sections[i]["input_shapes"]), None)

    def select(self, shapes: dict[str, list[int]], name: str | None = None, feeds: dict | None = None) -> int:
        """The specialization named `name`, or else the first one whose inputs have these shapes
        (`shapes` may name only some inputs, and other names, such as frozen inputs, are not
        compared) and, when `feeds` give every input specialised by value, those values; a
        conflict is one error."""
        if name is not None:
            found = next((i for i, s in enumerate(self.sections) if s["name"] == name), None)
            if found is None:
                raise CortexError(f"--specialization {name}: {self.path} has no such specialization; it has "
                                  f"{', '.join(s['name'] for s in self.sections)}")
            want = self.sections[found]["input_shapes"]
            wrong = [n for n, shape in shapes.items() if n in want and shape != want[n]]
            if wrong:
                raise CortexError(f"--specialization {name} takes {shapes_text({n: want[n] for n in wrong})}, "
                                  f"the inputs have {shapes_text({n: shapes[n] for n in wrong})}")
            return found
        gives_values = feeds is not None and all(spec["name"] in feeds for spec in self.value_inputs)
        among = self.with_values(feeds, str(self.path)) if gives_values else range(len(self.sections))
        for i in among:
            section = self.sections[i]
            if all(shape == section["input_shapes"][n] for n, shape in shapes.items() if n in section["input_shapes"]):
                return i
        raise CortexError(f"no shape specialization matches the inputs ({shapes_text(shapes)}); {self.path} "
                          f"was compiled for: {self.compiled_shapes()}")

    def compiled_shapes(self) -> str:
        return "; ".join(f"{s['name']} ({shapes_text(s['input_shapes'])})" for s in self.sections)

    def specialization_model(self, i: int):
        """Specialization `i`'s own model, its CUs loaded (`cortex verify --bisect` observes it)."""
        with self._locks[i]:
            self._share_budget(i)
            return self._loaded(i)

    def _run_on(self, i: int, feeds: dict, outputs, policy) -> dict[str, np.ndarray]:
        with self._locks[i]:
            self._share_budget(i)
            model = self._loaded(i)
            self._requests += 1
            self._last_run[i] = self._requests
            self._chosen, self.specialization = i, self.sections[i]["name"]
            return model.run(feeds, outputs=outputs, policy=policy)

    def _loaded(self, i: int):
        """Specialization `i`'s model with its CUs loaded (under a budget: its pins; under the
        offline policy none, as for one shape); the caller holds its lock."""
        model = self.models[i]
        if not model.loaded and not model.policy.offline:
            model.load_cus()
        return model

    def _share_budget(self, i: int) -> None:
        """Under a memory budget, make the resident CUs of every specialization together fit it:
        the other specializations' CUs are evicted, least recently run specialization first and
        its least recently used CUs first, until specialization `i` has room to run (its pins plus
        its largest other CU); what the others still hold is taken from `i`'s share. A
        specialization not loaded yet gets the whole budget: the others are emptied before its
        pins load. The caller holds the (shared) lock."""
        if self.memory_budget is None:
            return
        residency = self.models[i].scheduler.residency if self.models[i].loaded else None
        room = required_bytes(residency.set.footprints, residency.set.pins)[0] if residency else self.memory_budget
        others = sorted((j for j in range(len(self.sections)) if j != i and self.models[j].loaded),
                        key=lambda j: self._last_run[j])
        held = sum(self._resident_set(j).used() for j in others)
        for j in others:
            if self.memory_budget - held >= room:
                break
            held -= self.models[j].scheduler.residency.evict_idle(held - (self.memory_budget - room))
        if residency is not None:
            residency.set.budget = self.memory_budget - held

    def _resident_set(self, j: int):
        return self.models[j].scheduler.residency.set


class Buckets:
    """Where the padded dim sits in each specialization: its value, and the input and output axes
    that carry it."""

    def __init__(self, sections: list[dict], name: str):
        self.name = name
        if all(name in s["dims"] for s in sections):
            self.values = [s["dims"][name] for s in sections]
        elif all(name in s["input_shapes"] for s in sections):
            shapes = [s["input_shapes"][name] for s in sections]
            varying = [axis for axis in range(len(shapes[0])) if len({tuple(s)[axis] for s in shapes}) > 1]
            if len(varying) != 1:
                raise CortexError(f"--pad-to-bucket {name}: its compiled shapes differ in {len(varying)} axes; "
                                  "padding needs exactly one")
            self.values = [s[varying[0]] for s in shapes]
        else:
            known = sorted({d for s in sections for d in s["dims"]} | set(sections[0]["input_shapes"]))
            raise CortexError(f"--pad-to-bucket {name}: not a dim or input of the specializations "
                              f"(they have {', '.join(known)})")
        if len(set(self.values)) < 2:
            raise CortexError(f"--pad-to-bucket {name}: it has one value in every specialization; nothing to pad")
        self.sections = sections
        self.input_axes = _carrying_axes({i["name"]: [i["shape"] for i in _all(sections, "inputs", i["name"])]
                                          for i in sections[0]["inputs"]}, self.values)
        self.output_axes = _carrying_axes({o["name"]: [o["shape"] for o in _all(sections, "outputs", o["name"])]
                                           for o in sections[0]["outputs"]}, self.values)

    def nearest(self, shapes: dict[str, list[int]], label: str, compiled: str, among=None) -> tuple[int, int]:
        """The smallest bucket (of the specializations `among`) the inputs fit when padded, and
        their length along the dim."""
        lengths = {shape[axis] for name, shape in shapes.items() for axis in self.input_axes.get(name, ())
                   if axis < len(shape)}
        fits = []
        if len(lengths) == 1:
            length = lengths.pop()
            for i in range(len(self.sections)) if among is None else among:
                want = self.sections[i]["input_shapes"]
                if set(shapes) == set(want) and length <= self.values[i] \
                        and all(_fits(shapes[n], want[n], self.input_axes.get(n, ())) for n in want):
                    fits.append((self.values[i], i, length))
        if not fits:
            raise CortexError(f"no shape specialization matches or holds the inputs padded along "
                              f"{self.name} ({shapes_text(shapes)}); {label} was compiled for: {compiled}")
        _, i, length = min(fits)
        return i, length

    def pad(self, name: str, value: np.ndarray, i: int, pad_value: float) -> np.ndarray:
        axes = self.input_axes.get(name, ())
        if not axes:
            return value
        widths = [(0, self.values[i] - value.shape[a] if a in axes else 0) for a in range(value.ndim)]
        return np.pad(value, widths, constant_values=np.asarray(pad_value).astype(value.dtype))

    def slice(self, name: str, value: np.ndarray, i: int, length: int) -> np.ndarray:
        axes = self.output_axes.get(name, ())
        index = tuple(slice(0, length) if a in axes else slice(None) for a in range(value.ndim))
        return np.ascontiguousarray(value[index]) if axes else value


def _all(sections: list[dict], key: str, name: str) -> list[dict]:
    return [next(t for t in s[key] if t["name"] == name) for s in sections]


def _carrying_axes(shapes: dict[str, list[list[int]]], values: list[int]) -> dict[str, tuple[int, ...]]:
    """Per tensor, the axes whose extent is the bucket's value in every specialization."""
    found = {}
    for name, per_section in shapes.items():
        ranks = {len(s) for s in per_section}
        if len(ranks) == 1:
            axes = tuple(a for a in range(ranks.pop()) if all(s[a] == v for s, v in zip(per_section, values)))
            if axes:
                found[name] = axes
    return found


def _fits(shape: list[int], bucket: list[int], axes: tuple[int, ...]) -> bool:
    return len(shape) == len(bucket) and all(d <= b if a in axes else d == b
                                             for a, (d, b) in enumerate(zip(shape, bucket)))

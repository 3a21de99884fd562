"""`cortex calibrate`: measure each reduced-precision variant against the exact CU it replaces.

For every calibration feed the exact model runs CU by CU (strictly: no variant, no cache), and
each CU's inputs and outputs are kept. Then, per CU and variant:
- agreement: the variant runs on the inputs this CU actually saw, and its outputs are compared with
  the exact CU's: relative L2 error ||v - e|| / ||e|| per output (0 when both are all zeros, inf when
  only the exact one is), and the largest absolute difference;
- end to end: the variant's outputs are swapped in alone and the CUs downstream of it rerun exactly;
  the model's outputs are compared with the exact model's the same way;
- trust = max(0, 1 - the worst relative L2 error of the variant's outputs over the calibration
  set), so 0.99 means "within 1% relative L2 of the exact CU on every calibration feed". A variant
  of a CU that no feed activated keeps trust null: nothing was measured, so it never runs. A
  variant without an artifact for the device (a CUDA-only tf32 variant, calibrated on wasm) is
  left as it was.
Each CU also records the range (min / max over finite values) of each of its outputs and how many
feeds activated it (`cus[i].calibration`): the runtime's guards check variants against that range.
`cus[i].residency` records how long the CU takes to run (median) and to load from warm (its native
code cached, once unloaded), and whether it is hot: activated by every feed, and slower to load than to run, so
that under a memory budget reloading it each request would cost more than running it; the runtime
pins hot CUs when no `--pin` is given (docs/runtime.md, "Memory tiers").

A dag.json of shape specializations (cortex.dag/2) is calibrated per specialization: each feed
goes to the specialization whose input shapes are its own, and each specialization's variants are
measured on its feeds only (one that no feed matches is left as it was). The dag.json is rewritten
atomically, checked against its schema first.
"""

from __future__ import annotations

import json
import statistics
import time
import zipfile
from pathlib import Path

import numpy as np

from cortex.dag import validate_dag
from cortex.runtime.loader import CompiledModel
from cortex.runtime.variants import variant_record
from cortex.specializations import (
    is_specialized,
    read_specialized_dag,
    section_dag,
    shapes_text,
    validate_specialized_dag,
)
from ir.errors import CortexError
from ir.fs import write_bytes_atomically


def read_feeds(data: Path, inputs: list[dict]) -> list[dict[str, np.ndarray]]:
    """Calibration feeds: each .npz of a folder (sorted by name) is one feed; one .npz whose
    arrays have a leading batch axis is one feed per row. Each feed is checked against the model's
    inputs, in one line naming the file."""
    data = Path(data)
    if data.is_dir():
        files = sorted(data.glob("*.npz"))
        if not files:
            raise CortexError(f"--data {data}: the folder holds no .npz files")
        return [_feed(_arrays(f), inputs, f, batched=False)[0] for f in files]
    if not data.is_file():
        raise CortexError(f"--data {data}: no such file or folder")
    return _feed(_arrays(data), inputs, data, batched=True)


def _arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CortexError(f"--data {path}: not a readable .npz file ({e})") from None


def _feed(arrays: dict, inputs: list[dict], path: Path, batched: bool) -> list[dict[str, np.ndarray]]:
    missing = [spec["name"] for spec in inputs if spec["name"] not in arrays]
    if missing:
        raise CortexError(f"--data {path}: missing input {', '.join(map(repr, missing))} "
                          f"(it holds {', '.join(map(repr, arrays)) or 'nothing'})")
    rows = None
    for spec in inputs:
        value, shape = arrays[spec["name"]], tuple(spec["shape"])
        if value.dtype != np.dtype(spec["dtype"]):
            raise CortexError(f"--data {path}: input {spec['name']!r} has dtype {value.dtype}, "
                              f"the model expects {spec['dtype']}")
        if value.shape == shape:
            count = 1
        elif batched and value.shape[1:] == shape and value.shape[0] > 0:
            count = value.shape[0]
        else:
            raise CortexError(f"--data {path}: input {spec['name']!r} has shape {list(value.shape)}, the model "
                              f"expects {list(shape)}" + (" (or [N, ...] for N feeds)" if batched else ""))
        if rows is not None and count != rows:
            raise CortexError(f"--data {path}: the inputs hold different numbers of feeds ({rows} and {count})")
        rows = count
    if rows == 1:
        return [{spec["name"]: arrays[spec["name"]].reshape(spec["shape"]) for spec in inputs}]
    return [{spec["name"]: arrays[spec["name"]][i] for spec in inputs} for i in range(rows)]


def relative_l2(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    error, norm = float(np.linalg.norm(got - want)), float(np.linalg.norm(want))
    if norm == 0.0:
        return 0.0 if error == 0.0 else float("inf")
    return error / norm if np.isfinite(error) else float("inf")


class ExactRun:
    """One feed through the exact CUs, keeping every tensor on the host."""

    def __init__(self, model: CompiledModel):
        self.model = model
        self.scheduler = model.scheduler
        self.seconds: dict[str, list[float]] = {}     # exact CU -> wall seconds of each of its runs

    def run_cu(self, cu: dict, env: dict, where: str | None = None) -> dict[str, np.ndarray]:
        """One CU (or, on device `where`, a variant record) on host copies of its inputs."""
        device = self.scheduler.devices[where or self.scheduler.placement[cu["id"]]]
        results = device.run(cu, {name: device.to_device(env[name]) for name in cu["inputs"]})
        return {name: device.to_host(t) for name, t in results.items()}

    def active(self, cu: dict, env: dict) -> bool:
        activation = cu.get("activation")
        return activation is None or bool(np.asarray(env[activation["tensor"]]).reshape(-1)[0]) == activation["equals"]

    def outputs(self, env: dict) -> dict[str, np.ndarray]:
        for select in self.model.dag.get("selects", []):
            value = bool(np.asarray(env[select["condition"]]).reshape(-1)[0])
            case = next(c for c in select["cases"] if c["equals"] == value)
            env[select["tensor"]] = env[case["tensor"]]
        return {spec["name"]: env[spec["name"]] for spec in self.model.dag["outputs"]}

    def forward(self, feed: dict, start: int = 0, env: dict | None = None, changed: set | None = None
                ) -> tuple[dict, list[str]]:
        """All tensors of one run; from `start` in `order` with `env` given, only the CUs that read
        a tensor in `changed` (and what they change) are rerun."""
        env = dict(feed) if env is None else dict(env)
        ran = []
        for cu_id in self.model.dag["order"][start:]:
            cu = self.scheduler.cus[cu_id]
            if changed is not None and not changed.intersection(cu["inputs"]):
                continue
            if not self.active(cu, env):
                continue
            start = time.perf_counter()
            env.update(self.run_cu(cu, env))
            self.seconds.setdefault(cu_id, []).append(time.perf_counter() - start)
            ran.append(cu_id)
            if changed is not None:
                changed.update(cu["outputs"])
        return env, ran


def calibrate(dag_path: Path, data: Path, device: str = "wasm") -> dict:
    dag_path = Path(dag_path)
    if is_specialized(dag_path):
        return calibrate_specializations(dag_path, data, device)
    model = CompiledModel(dag_path, device, policy="strict", segments=False)
    feeds = read_feeds(data, model.dag["inputs"])
    found = calibrate_model(model, feeds, device)
    validate_dag(model.dag)
    write_bytes_atomically(dag_path, (json.dumps(model.dag, indent=2) + "\n").encode())
    return {"dag": str(dag_path), "device": device, "feeds": len(feeds), **found}


def calibrate_specializations(dag_path: Path, data: Path, device: str) -> dict:
    """A cortex.dag/2 file: each specialization calibrated on the feeds whose shapes are its own.
    A specialization no feed matches is left as it was (its variants uncalibrated, trust null, until
    feeds of its shapes are given), since a variant's error at one shape says nothing certain about
    another's."""
    document = read_specialized_dag(dag_path)
    sections = document["specializations"]
    grouped = feeds_by_specialization(data, sections, dag_path)
    variants, hot = {}, []
    for section, feeds in zip(sections, grouped):
        if not feeds:
            variants.update({f"{section['name']} {cu['id']} {p}": None for cu in section["cus"]
                             for p in cu.get("variants", {})})
            continue
        model = CompiledModel(dag_path, device, policy="strict", segments=False, dag=section_dag(section))
        found = calibrate_model(model, feeds, device)
        section["cus"] = model.dag["cus"]
        variants.update({f"{section['name']} {name}": trust for name, trust in found["variants"].items()})
        hot += [f"{section['name']} {cu_id}" for cu_id in found["hot_cus"]]
    validate_specialized_dag(document)
    write_bytes_atomically(dag_path, (json.dumps(document, indent=2) + "\n").encode())
    return {"dag": str(dag_path), "device": device, "feeds": sum(map(len, grouped)),
            "specializations": {s["name"]: len(f) for s, f in zip(sections, grouped)},
            "variants": variants, "hot_cus": hot}


def feeds_by_specialization(data: Path, sections: list[dict], dag_path: Path) -> list[list[dict[str, np.ndarray]]]:
    """The calibration feeds of each specialization: a feed (an .npz of a folder, or one .npz of
    batched rows) belongs to the specialization whose input shapes are its own."""
    data = Path(data)
    if data.is_dir():
        files = sorted(data.glob("*.npz"))
        if not files:
            raise CortexError(f"--data {data}: the folder holds no .npz files")
    elif data.is_file():
        files = [data]
    else:
        raise CortexError(f"--data {data}: no such file or folder")
    grouped: list[list[dict]] = [[] for _ in sections]
    for path in files:
        arrays = _arrays(path)
        for i, section in enumerate(sections):
            try:
                grouped[i] += _feed(arrays, section["inputs"], path, batched=not data.is_dir())
                break
            except CortexError:
                continue
        else:
            compiled = "; ".join(f"{s['name']} ({shapes_text(s['input_shapes'])})" for s in sections)
            shapes = shapes_text({name: list(a.shape) for name, a in arrays.items()})
            raise CortexError(f"--data {path}: its arrays ({shapes}) match no shape specialization of {dag_path}, "
                              f"which was compiled for: {compiled}")
    return grouped


def calibrate_model(model: CompiledModel, feeds: list[dict], device: str) -> dict:
    """Measure every variant of the model's CUs on `feeds` and record trust, ranges and speed in
    `model.dag`'s CUs; returns the trust of each variant measured and the hot CUs."""
    dag = model.dag
    # Without variants there is still each CU's speed to record: the hot CUs a memory budget pins.
    with_variants = [cu for cu in dag["cus"] if cu.get("variants")]
    exact = ExactRun(model)
    artifact = {name: model.scheduler.variants.artifacts[name] for name in model.scheduler.devices}
    position = {cu_id: i for i, cu_id in enumerate(dag["order"])}
    stats = {cu["id"]: _CuStats(cu) for cu in dag["cus"]}
    measured: dict[tuple[str, str], _VariantStats] = {}
    for feed in feeds:
        env, ran = exact.forward(feed)
        reference = exact.outputs(dict(env))
        for cu_id in ran:
            stats[cu_id].observe(env)
        for cu in with_variants:
            if cu["id"] not in ran:
                continue
            where = model.scheduler.placement[cu["id"]]
            for precision, variant in cu["variants"].items():
                if artifact.get(where) not in variant["artifacts"]:
                    continue
                record = variant_record(cu, precision)
                _load_once(model, where, record)
                got = exact.run_cu(record, env, where)
                swapped, _ = exact.forward(feed, position[cu["id"]] + 1, {**env, **got}, set(cu["outputs"]))
                key = (cu["id"], precision)
                measured.setdefault(key, _VariantStats()).observe(got, env, exact.outputs(swapped), reference)
    loading = load_seconds(model)
    for cu in dag["cus"]:
        cu["calibration"] = {**stats[cu["id"]].record(len(feeds)), "device": device}
        # Timings vary from run to run: kept apart from the calibration proper, which is deterministic.
        cu["residency"] = speed_record(exact.seconds.get(cu["id"], []), loading[cu["id"]],
                                       stats[cu["id"]].activations, len(feeds))
        where = model.scheduler.placement.get(cu["id"])
        for precision, variant in cu.get("variants", {}).items():
            if artifact.get(where) not in variant["artifacts"]:
                continue    # one this device cannot run (tf32 on wasm) keeps what another device measured
            found = measured.get((cu["id"], precision))
            cu["variants"][precision] = {"artifacts": variant["artifacts"],
                                         **(found.record(device) if found else {"trust": None})}
    return {"variants": {f"{cu_id} {p}": s.trust for (cu_id, p), s in measured.items()},
            "hot_cus": [cu["id"] for cu in dag["cus"] if cu["residency"]["hot"]]}


def load_seconds(model: CompiledModel) -> dict[str, float]:
    """Each exact CU's warm load: unloaded from its device, loaded again, timed."""
    seconds = {}
    for cu_id in model.dag["order"]:
        device, cu = model.scheduler.devices[model.scheduler.placement[cu_id]], model.scheduler.cus[cu_id]
        device.unload(cu_id)
        start = time.perf_counter()
        device.load([cu])
        seconds[cu_id] = time.perf_counter() - start
    return seconds


def speed_record(run_seconds: list[float], load_s: float, activations: int, samples: int) -> dict:
    run_ms = statistics.median(run_seconds) * 1e3 if run_seconds else None
    return {"run_ms": run_ms, "load_ms": load_s * 1e3,
            "hot": bool(samples and activations == samples and run_ms is not None and load_s * 1e3 >= run_ms)}


def _load_once(model: CompiledModel, device_name: str, record: dict) -> None:
    loaded = model.scheduler.variants.loaded
    if record["id"] not in loaded:
        model.scheduler.devices[device_name].load([record])
        loaded.add(record["id"])


class _CuStats:
    def __init__(self, cu: dict):
        self.outputs = cu["outputs"]
        self.activations = 0
        self.lo: dict[str, float] = {}
        self.hi: dict[str, float] = {}
        self.nonfinite: set[str] = set()

    def observe(self, env: dict) -> None:
        self.activations += 1
        for name in self.outputs:
            value = np.asarray(env[name])
            if value.size == 0 or not np.issubdtype(value.dtype, np.number) and value.dtype != np.bool_:
                continue
            value = value.astype(np.float64)
            finite = value[np.isfinite(value)]
            if finite.size < value.size:
                self.nonfinite.add(name)
            if finite.size:
                self.lo[name] = min(self.lo.get(name, np.inf), float(finite.min()))
                self.hi[name] = max(self.hi.get(name, -np.inf), float(finite.max()))

    def record(self, samples: int) -> dict:
        return {"samples": samples, "activations": self.activations,
                "outputs": {name: {"min": self.lo.get(name), "max": self.hi.get(name),
                                   **({"nonfinite": True} if name in self.nonfinite else {})}
                            for name in self.outputs if name in self.lo}}


class _VariantStats:
    def __init__(self):
        self.samples = 0
        self.worst = self.total = self.max_abs = 0.0
        self.end_to_end: dict[str, dict[str, float]] = {}

    def observe(self, got: dict, env: dict, outputs: dict, reference: dict) -> None:
        self.samples += 1
        errors = [relative_l2(got[name], env[name]) for name in got]
        self.worst = max(self.worst, *errors)
        self.total += max(errors)
        self.max_abs = max(self.max_abs, *(_max_abs(got[n], env[n]) for n in got))
        for name, want in reference.items():
            e = self.end_to_end.setdefault(name, {"worst_relative_l2": 0.0, "max_abs": 0.0})
            e["worst_relative_l2"] = max(e["worst_relative_l2"], relative_l2(outputs[name], want))
            e["max_abs"] = max(e["max_abs"], _max_abs(outputs[name], want))

    @property
    def trust(self) -> float:
        return max(0.0, 1.0 - self.worst) if np.isfinite(self.worst) else 0.0

    def record(self, device: str) -> dict:
        return {"trust": self.trust, "device": device,
                "agreement": {"worst_relative_l2": _finite(self.worst), "mean_relative_l2": _finite(self.total / self.samples),
                              "max_abs": _finite(self.max_abs), "samples": self.samples},
                "end_to_end": {n: {k: _finite(v) for k, v in e.items()} for n, e in self.end_to_end.items()}}


def _max_abs(got, want) -> float:
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    return float(diff.max()) if diff.size else 0.0


def _finite(value: float) -> float:
    """JSON has no infinity: an unbounded error is recorded as the largest double."""
    return float(value) if np.isfinite(value) else float(np.finfo(np.float64).max)

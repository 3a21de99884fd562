"""Input-shape specializations: one model built for several input shapes in one bundle.

`--dim seq=32,64,128` (a named dynamic dim bound to several values) or `--input-shape` with several
shapes for one input (`x=1x3x48x160,1x3x48x320`, or the option repeated) makes one specialization
per shape: `decompose` writes one CU folder per specialization under its output folder, listed in
`specializations.json`; `build-dag` writes one dag.json (`cortex.dag/2`) whose `specializations`
each hold a whole `cortex.dag/1` body (CUs, order, tensors...) with their `name`, `input_shapes`
and `dims`; compile-wasm builds every section into one folder with content-addressed modules and
weight files, so whatever the specializations share is stored once (backends/wasm/weights_files.py).
Each section passes the checks of a single-shape dag.json; the runtime picks the section whose
input shapes match a request's exactly (cortex/runtime/specialized.py). Value specializations
(`--specialize sr=8000,16000`, cortex/value_specializations.py) are sections too: each combines with
every shape specialization, and records its values in `input_values`.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import numpy as np

from cortex.cus import SPECIALIZATIONS_LISTING
from cortex.dag import (
    DAG_SCHEMA,
    SPECIALIZED_DAG_SCHEMA,
    build_dag,
    check_dag,
    validate_dag,
)
from cortex.value_specializations import values_text
from ir.errors import CortexError

LISTING = SPECIALIZATIONS_LISTING
LISTING_SCHEMA = "cortex.specializations/1"
SCHEMA_FILE = Path(__file__).resolve().parent / "schemas" / "dag-specializations.schema.json"

_SHAPE_ITEM = re.compile(r"^\s*([^=\s]+)\s*=\s*(.+?)\s*$")
_SHAPE = re.compile(r"^\d+(?:\s*x\s*\d+)*$")


@dataclass(frozen=True)
class Specialization:
    name: str                                   # what varies, e.g. "seq=32" or "x=1x3x48x160"
    input_shapes: dict[str, tuple[int, ...]]    # every --input-shape, this specialization's value
    dims: dict[str, int]                        # every --dim, this specialization's value
    input_values: dict[str, np.ndarray] = field(default_factory=dict)   # every --specialize input's value
    graph_passes: tuple = ()                    # passes run on this shape's optimised graph (before fusion)

    @property
    def folder(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]", "-", self.name.replace(",", "_"))

    def to_json(self) -> dict:
        return {"name": self.name, "folder": self.folder,
                "input_shapes": {k: list(v) for k, v in sorted(self.input_shapes.items())},
                "dims": dict(sorted(self.dims.items())),
                **({"input_values": {k: v.item() for k, v in self.input_values.items()}} if self.input_values else {})}


def with_values(specializations: list[Specialization], rows_for) -> list[Specialization]:
    """Every specialization once per row of input values (`rows_for(specialization)`: its rows,
    cortex/value_specializations.py's value_rows), named by what varies: `sr=8000`, `seq=32,sr=8000`."""
    return [Specialization(",".join(filter(None, [spec.name, values_text(row)])), spec.input_shapes, spec.dims, row,
                           spec.graph_passes)
            for spec in specializations for row in rows_for(spec)]


def parse_specializations(input_shapes: list[str] | None, dims: list[str] | None) -> list[Specialization] | None:
    """The specializations the options ask for; None when they bind one shape (a plain build).
    Several inputs given several shapes pair them in order (input_ids and attention_mask of one
    length); several dims given several values build every combination."""
    shapes = _shape_values(input_shapes or [])
    values = _dim_values(dims or [])
    varying = {name: v for name, v in shapes.items() if len(v) > 1}
    counts = {len(v) for v in varying.values()}
    if len(counts) > 1:
        raise CortexError("--input-shape: inputs given several shapes must each be given as many ("
                          + ", ".join(f"{n}: {len(v)}" for n, v in varying.items()) + "); they pair up in order")
    rows = [{n: v[i] for n, v in varying.items()} for i in range(counts.pop())] if counts else [{}]
    varying_dims = [n for n, v in values.items() if len(v) > 1]
    if not varying and not varying_dims:
        return None
    found = []
    for row in rows:
        for combo in itertools.product(*(values[n] for n in varying_dims)):
            chosen = dict(zip(varying_dims, combo))
            name = ",".join([*(f"{n}={'x'.join(map(str, s))}" for n, s in row.items()),
                             *(f"{n}={v}" for n, v in chosen.items())])
            found.append(Specialization(name, {**{n: v[0] for n, v in shapes.items()}, **row},
                                        {**{n: v[0] for n, v in values.items()}, **chosen}))
    return found


def _shape_values(items: list[str]) -> dict[str, list[tuple[int, ...]]]:
    """NAME=1x3x48x160,1x3x48x320 (commas separate shapes when the dims are joined by x; a shape
    spelled 1,3,48 stays one shape, as plain --input-shape reads it) or the option repeated."""
    shapes: dict[str, list[tuple[int, ...]]] = {}
    for item in items:
        m = _SHAPE_ITEM.match(item)
        text = m.group(2) if m else ""
        parts = [p.strip() for p in text.split(",")] if "x" in text else [text.replace(",", "x")]
        if not m or not all(p == "scalar" or _SHAPE.match(p) for p in parts):
            raise CortexError(f"bad --input-shape {item!r}: expected NAME=D1xD2x... with integers, "
                              "e.g. input=1x3x224x224, or several shapes: input=1x3x48x160,1x3x48x320")
        for part in parts:
            shape = () if part == "scalar" else tuple(int(d) for d in re.split(r"\s*x\s*", part))
            if shape in shapes.get(m.group(1), []):
                raise CortexError(f"--input-shape given {'x'.join(map(str, shape))} twice for {m.group(1)!r}")
            shapes.setdefault(m.group(1), []).append(shape)
    return shapes


def _dim_values(items: list[str]) -> dict[str, list[int]]:
    values: dict[str, list[int]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        numbers = [p.strip() for p in text.split(",")]
        if not sep or not name.strip() or not all(p.isdigit() for p in numbers):
            raise CortexError(f"bad --dim {item!r}: expected NAME=N with integers, e.g. batch=1 "
                              "or seq=32,64,128 (0: empty)")
        chosen = [int(p) for p in numbers]
        if len(set(chosen)) != len(chosen) or name.strip() in values:
            raise CortexError(f"bad --dim {item!r}: each dim and value once")
        values[name.strip()] = chosen
    return values


# -- the CU folder -----------------------------------------------------------------------------
def listing_document(specializations: list[Specialization]) -> dict:
    return {"schema": LISTING_SCHEMA, "specializations": [s.to_json() for s in specializations]}


def read_listing(cu_dir: Path) -> list[dict] | None:
    """The specializations a CU folder holds; None for a plain (one-shape) CU folder."""
    path = Path(cu_dir) / LISTING
    if not path.is_file():
        return None
    try:
        listing = json.loads(path.read_text())
        entries = listing["specializations"]
        if listing["schema"] != LISTING_SCHEMA or not entries:
            raise ValueError(f"expected a non-empty {LISTING_SCHEMA} listing")
        for entry in entries:
            if Path(entry["folder"]).name != entry["folder"] or not (Path(cu_dir) / entry["folder"]).is_dir():
                raise ValueError(f"specialization {entry['name']!r} names a missing folder {entry['folder']!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CortexError(f"{path}: not a readable listing of specializations: {e}") from None
    return entries


def build_specialized_dag(cu_dir: Path, output: Path, listing: list[dict]) -> dict:
    """The cortex.dag/2 document: one cortex.dag/1 body per specialization, paths relative to
    `output`'s folder."""
    sections = []
    for entry in listing:
        body = build_dag(Path(cu_dir) / entry["folder"], output)
        body.pop("schema")
        values = entry.get("input_values", {})
        shapes = {i["name"]: i["shape"] for i in [*body["inputs"], *frozen_specs(body, values)]}
        sections.append({"name": entry["name"], "input_shapes": shapes, "dims": entry["dims"],
                         **({"input_values": values} if values else {}), **body})
    first = sections[0]
    return {"schema": SPECIALIZED_DAG_SCHEMA, "model": first["model"],
            **({"source_model": first["source_model"]} if "source_model" in first else {}),
            "specializations": sections}


# -- dag.json ----------------------------------------------------------------------------------
def is_specialized(path: Path) -> bool:
    """Whether the file at `path` is a cortex.dag/2 document (anything unreadable is left to read_dag)."""
    try:
        return json.loads(Path(path).read_text()).get("schema") == SPECIALIZED_DAG_SCHEMA
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        return False


def read_specialized_dag(path: Path, option: str | None = None) -> dict:
    """A cortex.dag/2 document, checked: its own schema, each section as a cortex.dag/1, and that
    the sections agree on the interface and differ in their input shapes."""
    path = Path(path)
    label = f"{option} {path}" if option else str(path)
    try:
        dag = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CortexError(f"{label}: not readable JSON: {e}") from None
    error = jsonschema.exceptions.best_match(_validator().iter_errors(dag))
    if error is not None:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
        raise CortexError(f"{label}: does not follow the {SPECIALIZED_DAG_SCHEMA} schema at {where or 'the top'}: "
                          f"{error.message[:160]}")
    seen: dict[str, str] = {}
    first = dag["specializations"][0]
    for section in dag["specializations"]:
        check_dag(section_dag(section), f"{label} (specialization {section['name']})", path.parent)
        if _interface(section) != _interface(first):
            return _fail(label, f"specialization {section['name']} has other inputs or outputs than {first['name']}")
        values = section.get("input_values", {})
        if set(values) != set(first.get("input_values", {})):
            return _fail(label, f"specialization {section['name']} is specialised by the values of other inputs "
                                f"than {first['name']}")
        specs = frozen_specs(section, values)
        if len(specs) != len(values) or any(section["input_shapes"].get(s["name"]) != s["shape"] for s in specs):
            return _fail(label, f"specialization {section['name']}: its input_values name inputs that its build "
                                "did not freeze, or with other shapes than input_shapes")
        key = json.dumps([section["input_shapes"], values], sort_keys=True)
        if key in seen:
            return _fail(label, f"specializations {seen[key]} and {section['name']} have the same input shapes"
                                + (" and values" if values else ""))
        seen[key] = section["name"]
    return dag


def validate_specialized_dag(dag: dict) -> None:
    """Raise jsonschema.ValidationError unless `dag` follows the cortex.dag/2 schema and each
    section the cortex.dag/1 one (a document about to be written back, e.g. by calibrate)."""
    jsonschema.validate(dag, json.loads(SCHEMA_FILE.read_text()))
    for section in dag["specializations"]:
        validate_dag(section_dag(section))


def section_dag(section: dict) -> dict:
    """One specialization as the cortex.dag/1 document the scheduler and the devices read."""
    return {"schema": DAG_SCHEMA, **{k: v for k, v in section.items()
                                     if k not in ("name", "input_shapes", "dims", "input_values")}}


def frozen_specs(section: dict, values: dict) -> list[dict]:
    """The name, dtype and shape of each input a section is specialised on by value: inputs its
    build froze (`options.frozen_inputs`), which the caller still gives."""
    frozen = {f["name"]: f for f in section.get("options", {}).get("frozen_inputs", [])}
    return [{"name": name, "dtype": frozen[name]["dtype"], "shape": frozen[name]["shape"]}
            for name in values if name in frozen]


def shapes_text(shapes: dict[str, list[int]]) -> str:
    return " ".join(f"{name}={'x'.join(map(str, shape)) or 'scalar'}" for name, shape in shapes.items())


def _interface(section: dict) -> tuple:
    return ([(i["name"], i["dtype"]) for i in section["inputs"]], [(o["name"], o["dtype"]) for o in section["outputs"]])


def _fail(label: str, problem: str):
    raise CortexError(f"{label}: {problem}")


def _validator():
    return jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))

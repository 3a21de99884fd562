"""Recurrent layers (RNN, GRU, LSTM): per time step, the gates' matrix-vector products over the
input and the previous hidden state, their activations, then the state update.

The input term X_t W^T does not depend on the state, so it is computed for every step and
direction first, as one GEMM (the summed biases in its epilogue) where the target offers one. The
step loop then holds only the recurrent product H_{t-1} R^T of all batch rows at once, which reads
R once per step as the target packed it at compile time (on wasm the GEMV kernel; an R larger
than a core's L2 a gate at a time, in alternating order, see `_step_products`), and the gate
activations and state update, loops along the hidden units that vectorise (Sigmoid and Tanh as
the rational approximations onnxruntime's MLAS uses, see `_rational`). GRU's candidate
product is computed once: with linear_before_reset in the same product as the other gates, without
it as a second product over the reset gate times the state.

One direction at a time (a reverse one walks the steps backwards, inside each sequence's own
length when `sequence_lens` is given). Steps past a sequence's length leave its state unchanged
and write zeros to Y, as the spec says.

`cortex::LSTMRecurrence`, `GRURecurrence` and `RNNRecurrence` are the same layers with the input
projection X W^T already computed (passes/split_recurrent.py splits a too-large layer so): the
standard inputs without W, X being the gates [seq, batch, directions*gates*hidden], the same
attributes. Their ONNX meaning is the model-local function that pass adds.
"""

from dataclasses import dataclass

import numpy as np

from ir.errors import UnsupportedError
from ir.loops.contraction import ContractionOperands, EpilogueSpec, GemmSpec
from ir.loops.expr import cast, fma, gt, lift, lt, maximum, minimum, select, unary
from ir.ops.registry import OTHER, lowering, register

register("RNN", "GRU", "LSTM", kind=OTHER)
RECURRENCE_DOMAIN = "cortex"
register("RNNRecurrence", "GRURecurrence", "LSTMRecurrence", domain=RECURRENCE_DOMAIN, kind=OTHER)

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
DEFAULT_ACTIVATIONS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}


# Which of activation_alpha / activation_beta each activation takes.
TAKES = {"Affine": (True, True), "LeakyRelu": (True, False), "ThresholdedRelu": (True, False),
         "ScaledTanh": (True, True), "HardSigmoid": (True, True), "Elu": (True, False)}


def activation_parameters(names, alphas, betas) -> list[tuple[float | None, float | None]]:
    """(alpha, beta) of each activation, None where it takes none or the list ran out (its default
    then): each list is consumed in order by the activations that take that parameter, as
    onnxruntime reads the spec."""
    alphas, betas = iter(alphas or []), iter(betas or [])
    found = []
    for name in names:
        takes_alpha, takes_beta = TAKES.get(name, (False, False))
        alpha = next(alphas, None) if takes_alpha else None
        beta = next(betas, None) if takes_beta else None
        found.append((None if alpha is None else float(alpha), None if beta is None else float(beta)))
    return found


# onnxruntime's MLAS rational approximations (mlas/lib/logistic.cpp, tanh.cpp): x p(x^2) / q(x^2)
# over a clamped x, one division each. The exp-based forms cost an exp, a division and for tanh a
# polynomial per call; a step's gates make those a fifth of a small LSTM's time.
LOGISTIC_RANGE = 18.0
LOGISTIC_P = (2.48287947061529e-01, 8.51377133304701e-03, 6.08574864600143e-05, 1.15627324459942e-07,
              4.37031012579801e-11)
LOGISTIC_Q = (9.93151921023180e-01, 1.16817656904453e-01, 1.70198817374094e-03, 6.29106785017040e-06,
              5.76102136993427e-09, 6.10247389755681e-13)
TANH_RANGE = 9.0
TANH_P = (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05, 5.12229709037114e-08,
          -8.60467152213735e-11, 2.00018790482477e-13, -2.76076847742355e-16)
TANH_Q = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04, 1.19825839466702e-06)


def _between(b, v, low: float, high: float, name: str):
    """A local holding v limited to [low, high], as select(x < c, x, c) and select(x > c, x, c),
    which vectorise as one pmin and one pmax (each reads a local, so no operand is computed twice)."""
    x = b.local(v.type, v, name)
    high_c, low_c = lift(high, v.type), lift(low, v.type)
    below = b.local(v.type, select(lt(x, high_c), x, high_c), name)
    return b.local(v.type, select(gt(below, low_c), below, low_c), name)


def _even_polynomial(x2, coeffs):
    acc = lift(coeffs[-1], x2.type)
    for c in reversed(coeffs[:-1]):
        acc = fma(acc, x2, c)
    return acc


def _rational(b, v, bound: float, p, q):
    """x p(x^2) / q(x^2) with x = v clamped to [-bound, bound] (held in locals: x and x^2 are read
    by both polynomials)."""
    x = _between(b, v, -bound, bound, "x")
    x2 = b.local(v.type, x * x, "x2")
    return x * _even_polynomial(x2, p) / _even_polynomial(x2, q)


def _activation(b, name: str, alpha, beta):
    """The activation `name` as a function of its input expression; Sigmoid and Tanh with the MLAS
    approximations onnxruntime's recurrent kernels call (`_rational`), which emit locals into the
    statements being built."""
    def sigmoid(v):
        return _between(b, _rational(b, v, LOGISTIC_RANGE, LOGISTIC_P, LOGISTIC_Q) + 0.5, 0.0, 1.0, "sigmoid")
    table = {
        "Sigmoid": sigmoid,
        "Tanh": lambda v: _rational(b, v, TANH_RANGE, TANH_P, TANH_Q),
        "Relu": lambda v: maximum(v, 0.0),
        "HardSigmoid": lambda v: maximum(0.0, minimum(1.0, v * (0.2 if alpha is None else alpha) + (0.5 if beta is None else beta))),
        "LeakyRelu": lambda v: select(lt(v, 0.0), v * (0.01 if alpha is None else alpha), v),
        "ThresholdedRelu": lambda v: select(lt(1.0 if alpha is None else alpha, v), v, 0.0),
        "ScaledTanh": lambda v: unary("tanh", v * (1.0 if beta is None else beta)) * (1.0 if alpha is None else alpha),
        "Affine": lambda v: v * (1.0 if alpha is None else alpha) + (0.0 if beta is None else beta),
        "Elu": lambda v: select(lt(v, 0.0), (unary("exp", v) - 1.0) * (1.0 if alpha is None else alpha), v),
        "Softsign": lambda v: v / (1.0 + unary("abs", v)),
        "Softplus": lambda v: unary("log", 1.0 + unary("exp", v)),
    }
    if name not in table:
        raise UnsupportedError(f"recurrent activation {name!r} is not supported")
    return table[name]


@lowering("loops", "RNN", "GRU", "LSTM")
def _recurrent(b, node):
    _lower(b, node, node.op_type, projected=False)


@lowering("loops", "RNNRecurrence", "GRURecurrence", "LSTMRecurrence", domain=RECURRENCE_DOMAIN)
def _recurrence(b, node):
    _lower(b, node, node.op_type.removesuffix("Recurrence"), projected=True)


@dataclass(frozen=True)
class _Layer:
    """One recurrent node as its lowering reads it. `projected`: X holds the gates' input projection
    (no W input; the later inputs move up one)."""
    node: object
    op: str
    projected: bool
    hidden: int
    seq: int
    batch: int
    layout: int
    directions: tuple[str, ...]
    clip: float | None
    linear_before_reset: bool

    @property
    def gates(self) -> int:
        return GATES[self.op]

    @property
    def width(self) -> int:
        """Gate rows of one direction."""
        return self.gates * self.hidden

    def value(self, i: int):
        """Input `i` of the standard op (X, W, R, B, sequence_lens, initial_h, initial_c, P), or None."""
        if self.projected and i == 1:
            return None
        k = i - 1 if self.projected and i > 1 else i
        inputs = self.node.inputs
        return inputs[k] if k < len(inputs) else None

    def state_index(self, d, n, j):
        return (n, d, j) if self.layout else (d, n, j)


def _layer(node, op: str, projected: bool, x_shape) -> _Layer:
    layout = int(node.attrs.get("layout", 0))
    batch, seq = (x_shape[0], x_shape[1]) if layout else (x_shape[1], x_shape[0])
    directions = {"forward": ("forward",), "reverse": ("reverse",), "bidirectional": ("forward", "reverse")}[
        node.attrs.get("direction", "forward")]
    return _Layer(node, op, projected, int(node.attrs["hidden_size"]), int(seq), int(batch), layout, directions,
                  node.attrs.get("clip"), bool(node.attrs.get("linear_before_reset", 0)))


def _lower(b, node, op, projected):
    """All steps' input projections first (one GEMM over every step when the target offers one),
    then, per direction, the steps: the recurrent product H R^T of all batch rows (a GEMV kernel),
    then the gates' activations and the state update, vectorised along the hidden units."""
    if node.attrs.get("input_forget", 0):
        raise UnsupportedError(f"{node.describe()}: LSTM with input_forget is not supported")
    x = b.input(node, 0)
    layer = _layer(node, op, projected, x.shape)
    per_dir = len(DEFAULT_ACTIVATIONS[op])
    names = node.attrs.get("activations") or DEFAULT_ACTIVATIONS[op] * len(layer.directions)
    parameters = activation_parameters(names, node.attrs.get("activation_alpha"), node.attrs.get("activation_beta"))
    gates = _input_gates(b, layer, x, _step_bias(b, layer))
    outputs = [b.output(node, i) if len(node.outputs) > i and node.outputs[i].dtype else None for i in range(3)]
    for d, direction in enumerate(layer.directions):
        acts = [_activation(b, names[d * per_dir + i], *parameters[d * per_dir + i]) for i in range(per_dir)]
        _direction(b, layer, (d, direction), acts, gates, outputs)


@dataclass(frozen=True)
class _Gates:
    """Where a step reads each gate's input term: the projection of X over all steps (`read(t, n,
    column)`), plus `bias` ([directions, gate rows]) where the projection did not add it."""
    read: object
    bias: object | None
    width: int
    hidden: int

    def at(self, t, n, d, gate, j):
        value = self.read(t, n, d * self.width + gate * self.hidden + j)
        return value + self.bias[(d, gate * self.hidden + j)] if self.bias is not None else value


def _step_bias(b, layer: _Layer):
    """Wb + Rb per direction and gate row ([directions, gate rows]), or None without B. GRU's
    candidate keeps its Rb apart when linear_before_reset (the reset gate multiplies it, see
    `_gru_update`)."""
    bias_value = layer.value(3)
    if bias_value is None:
        return None
    dirs, width, hidden = len(layer.directions), layer.width, layer.hidden
    keeps_apart = layer.op == "GRU" and layer.linear_before_reset
    if bias_value.is_const:
        both = np.asarray(bias_value.const, dtype=np.float64).reshape(dirs, 2, width)
        recurrent = both[:, 1].copy()
        if keeps_apart:
            recurrent[:, 2 * hidden:] = 0.0
        return b.constant((both[:, 0] + recurrent).astype(np.asarray(bias_value.const).dtype), bias_value.name + "_steps")
    bias = b.buffer(bias_value)
    summed = b.temp(bias.dtype, (dirs, width), "step_bias")
    with b.loop(dirs, "d") as d, b.loop(width, "g") as g:
        recurrent = bias[(d, width + g)]
        if keeps_apart:
            recurrent = select(lt(g, 2 * hidden), recurrent, 0.0)
        b.store(summed, (d, g), bias[(d, g)] + recurrent)
    return summed


def _input_gates(b, layer: _Layer, x, step_bias) -> _Gates:
    """X W^T (+ the step bias) for every step and direction, as `_Gates`."""
    if layer.projected:
        def given(t, n, column):
            return x[(n, t, column) if layer.layout else (t, n, column)]
        return _Gates(given, step_bias, layer.width, layer.hidden)
    w_value = layer.value(1)
    rows, columns, k = layer.seq * layer.batch, len(layer.directions) * layer.width, int(x.shape[2])
    projection = b.temp(x.dtype, (rows, columns), "input_gates")
    spec = GemmSpec(rows, columns, k, trans_b=True, epilogue=EpilogueSpec(bias=step_bias is not None))
    if w_value.is_const and x.dtype == "float32" and b.offers(spec):
        packed = b.contraction_weight(spec, w_value, np.asarray(w_value.const).reshape(columns, k))
        bias = step_bias.view((columns,)) if step_bias is not None else None
        b.call_contraction(spec, ContractionOperands(x.view((rows, k)), packed, projection, bias), x.name, w_value.name)
        step_bias = None
    else:
        xs, w = x.view((rows, k)), b.buffer(w_value).view((columns, k))
        with b.loop(rows, "row") as row, b.loop(columns, "col") as col:
            acc = b.local(x.compute_type, 0.0, "acc")
            with b.loop(k, "k") as i:
                b.assign(acc, acc + xs[(row, i)] * w[(col, i)])
            b.store(projection, (row, col), acc)

    def projected(t, n, column):
        return projection[(n * layer.seq + t if layer.layout else t * layer.batch + n, column)]
    return _Gates(projected, step_bias, layer.width, layer.hidden)


class _RecurrentProducts:
    """The recurrent products of one direction: out[n, g] = sum_i state[n, i] R[d, rows[g], i] for
    every batch row at once, so each step reads R once (as the target's GEMV/GEMM kernel packed it
    at compile time, where it offers one: each row range packed once, however often it is called)."""

    def __init__(self, layer: _Layer, d: int):
        self.layer, self.d, self.packed = layer, d, {}

    def emit(self, b, rows: range, state, out) -> None:
        layer, d, r_value = self.layer, self.d, self.layer.value(2)
        spec = GemmSpec(layer.batch, len(rows), layer.hidden, trans_b=True)
        if r_value.is_const and state.dtype == "float32" and b.offers(spec):
            key = (rows.start, rows.stop)
            if key not in self.packed:
                self.packed[key] = b.contraction_weight(spec, r_value, np.asarray(r_value.const)[d, rows.start:rows.stop])
            b.call_contraction(spec, ContractionOperands(state, self.packed[key], out), state.name, r_value.name)
            return
        r = b.buffer(r_value)
        with b.loop(layer.batch, "n") as n, b.loop(len(rows), "g") as g:
            acc = b.local(state.compute_type, 0.0, "rec")
            with b.loop(layer.hidden, "i") as i:
                b.assign(acc, acc + state[(n, i)] * r[(d, rows.start + g, i)])
            b.store(out, (n, g), acc)


def _step_time(b, layer: _Layer, direction: str, s, n):
    """(the time step row `n` handles at step `s`, whether it is inside the row's sequence or None
    without sequence_lens): a reverse direction walks each sequence's own length backwards."""
    lengths_value = layer.value(4)
    lengths = b.buffer(lengths_value) if lengths_value is not None else None
    length = cast(lengths[(n,)], "i32") if lengths is not None else layer.seq
    if direction == "forward":
        t = s
    else:
        t = select(lt(s, length), length - 1 - s, s) if lengths is not None else layer.seq - 1 - s
    return t, (lt(s, length) if lengths is not None else None)


def _direction(b, layer: _Layer, where: tuple[int, str], acts, gates: _Gates, outputs) -> None:
    d, direction = where
    hidden, batch, dtype = layer.hidden, layer.batch, b.input(layer.node, 0).dtype
    state = b.temp(dtype, (batch, hidden), "h")
    cell = b.temp(dtype, (batch, hidden), "c") if layer.op == "LSTM" else None
    for buf, init_value in ((state, layer.value(5)), (cell, layer.value(6))):
        if buf is None:
            continue
        init = b.buffer(init_value) if init_value is not None else None
        with b.loop(batch, "n") as n, b.loop(hidden, "j") as j:
            b.store(buf, (n, j), init[layer.state_index(d, n, j)] if init is not None else 0.0)
    reset_first = layer.op == "GRU" and not layer.linear_before_reset
    product_gates = 2 if reset_first else layer.gates
    parts = _product_parts(layer, product_gates)
    products = [b.temp(dtype, (batch, len(rows)), "recurrent") for rows in parts]
    steps = _Steps(layer, acts, gates, d, state, cell, products)
    recurrent = _RecurrentProducts(layer, d)
    with b.loop(layer.seq, "s") as s:
        _step_products(b, recurrent, s, parts, state, products)
        if reset_first:     # the candidate's product reads the reset gate times the state
            steps.reset_gate_times_state(b, direction, s)
            recurrent.emit(b, range(2 * hidden, 3 * hidden), steps.reset_state, steps.candidate)
        with b.loop(batch, "n") as n:
            t, active = _step_time(b, layer, direction, s, n)
            with b.when(active) if active is not None else _nothing():
                with b.loop(hidden, "j") as j:
                    steps.update(b, t, n, j)
            y = outputs[0]
            if y is not None:
                with b.loop(hidden, "j") as j:
                    value = state[(n, j)] if active is None else select(active, state[(n, j)], 0.0)
                    b.store(y, (n, t, d, j) if layer.layout else (t, d, n, j), value)
    for i, buf in ((1, state), (2, cell)):
        if outputs[i] is not None and buf is not None:
            with b.loop(batch, "n") as n, b.loop(hidden, "j") as j:
                b.store(outputs[i], layer.state_index(d, n, j), buf[(n, j)])


# R above this many bytes outgrows a core's L2 (2 MiB on the machines measured): its product is
# then computed a gate at a time, in alternating order from one step to the next, so that the
# gates read last in one step are read first in the next, still in L2 (see `_step_products`).
L2_BYTES = 1_500_000


def _product_parts(layer: _Layer, gates: int) -> list[range]:
    """The gate rows of R each recurrent product covers: all at once, or one gate each where R
    outgrows the L2 budget (and there is more than one gate)."""
    rows = gates * layer.hidden
    if gates == 1 or rows * layer.hidden * 4 <= L2_BYTES:
        return [range(rows)]
    return [range(g * layer.hidden, (g + 1) * layer.hidden) for g in range(gates)]


def _step_products(b, recurrent: _RecurrentProducts, s, parts: list[range], state, products) -> None:
    """The recurrent products of step `s`, part by part; with several parts, odd steps walk them
    backwards. Measured on a 2x1536x384 product (R 2.36 MB, 2 MiB L2): 63.7 us a step in one
    order, 57.7 alternating."""
    if len(parts) == 1:
        recurrent.emit(b, parts[0], state, products[0])
        return
    with b.branches(lt(s % 2, 1)) as (even, odd):
        for branch, order in ((even, range(len(parts))), (odd, reversed(range(len(parts))))):
            with branch:
                for i in order:
                    recurrent.emit(b, parts[i], state, products[i])


class _Steps:
    """The gate activations and state update of one direction's step, one hidden unit `j` of batch
    row `n` at a time (so the loop over `j` vectorises): the recurrent products are in `products`
    (one [batch, gate rows] buffer, or one [batch, hidden] per gate, see `_product_parts`), the
    input terms in `gates`."""

    def __init__(self, layer: _Layer, acts, gates: _Gates, d: int, state, cell, products):
        self.layer, self.acts, self.gates, self.d = layer, acts, gates, d
        self.state, self.cell, self.products = state, cell, products
        self.reset_state = self.candidate = self.update_gate = None

    def clipped(self, v):
        clip = self.layer.clip
        return minimum(maximum(v, -float(clip)), float(clip)) if clip is not None else v

    def product(self, n, gate, j):
        """Gate `gate`'s recurrent product at hidden unit j."""
        if len(self.products) == 1:
            return self.products[0][(n, gate * self.layer.hidden + j)]
        return self.products[gate][(n, j)]

    def pre(self, t, n, gate, j):
        """Gate `gate`'s pre-activation at hidden unit j: its recurrent product plus its input term."""
        return self.product(n, gate, j) + self.gates.at(t, n, self.d, gate, j)

    def update(self, b, t, n, j):
        {"RNN": self._rnn, "GRU": self._gru, "LSTM": self._lstm}[self.layer.op](b, t, n, j)

    def _rnn(self, b, t, n, j):
        b.store(self.state, (n, j), self.acts[0](self.clipped(self.pre(t, n, 0, j))))

    def _lstm(self, b, t, n, j):
        f, g, h = self.acts      # gate rows: i, o, f, c
        hidden, peep_value = self.layer.hidden, self.layer.value(7)
        peep = b.buffer(peep_value) if peep_value is not None else None
        c_prev = self.cell[(n, j)]
        p_i = peep[(self.d, j)] * c_prev if peep is not None else 0.0
        p_f = peep[(self.d, 2 * hidden + j)] * c_prev if peep is not None else 0.0
        i_gate = f(self.clipped(self.pre(t, n, 0, j) + p_i))
        f_gate = f(self.clipped(self.pre(t, n, 2, j) + p_f))
        c_new = b.local(self.cell.compute_type, f_gate * c_prev + i_gate * g(self.clipped(self.pre(t, n, 3, j))), "c")
        p_o = peep[(self.d, hidden + j)] * c_new if peep is not None else 0.0
        o_gate = f(self.clipped(self.pre(t, n, 1, j) + p_o))
        b.store(self.cell, (n, j), c_new)
        b.store(self.state, (n, j), o_gate * h(c_new))

    def _gru(self, b, t, n, j):
        f, g = self.acts         # gate rows: z, r, h
        hidden, h_prev = self.layer.hidden, self.state[(n, j)]
        candidate_input = self.gates.at(t, n, self.d, 2, j)
        if self.layer.linear_before_reset:
            z = b.local(self.state.compute_type, f(self.clipped(self.pre(t, n, 0, j))), "z")
            r = f(self.clipped(self.pre(t, n, 1, j)))
            recurrent = self.product(n, 2, j) + self._candidate_bias(b, j)
            cand = g(self.clipped(candidate_input + r * recurrent))
        else:
            z = self.update_gate[(n, j)]
            cand = g(self.clipped(candidate_input + self.candidate[(n, j)]))
        b.store(self.state, (n, j), (1.0 - z) * cand + z * h_prev)

    def _candidate_bias(self, b, j):
        bias_value = self.layer.value(3)
        if bias_value is None:
            return 0.0
        width = self.layer.width
        return b.buffer(bias_value)[(self.d, width + 2 * self.layer.hidden + j)]

    def reset_gate_times_state(self, b, direction, s):
        """GRU without linear_before_reset: the update gate, and the reset gate times the state,
        which the candidate's recurrent product reads (`candidate`)."""
        layer, f = self.layer, self.acts[0]
        if self.reset_state is None:
            dtype = self.state.dtype
            self.reset_state = b.temp(dtype, (layer.batch, layer.hidden), "reset_h")
            self.candidate = b.temp(dtype, (layer.batch, layer.hidden), "candidate")
            self.update_gate = b.temp(dtype, (layer.batch, layer.hidden), "z")
        with b.loop(layer.batch, "n") as n:
            t, _ = _step_time(b, layer, direction, s, n)
            with b.loop(layer.hidden, "j") as j:
                b.store(self.update_gate, (n, j), f(self.clipped(self.pre(t, n, 0, j))))
                b.store(self.reset_state, (n, j), f(self.clipped(self.pre(t, n, 1, j))) * self.state[(n, j)])


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

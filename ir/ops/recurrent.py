"""Recurrent layers (RNN, GRU, LSTM): per time step, the gates' matrix-vector products over the
input and the previous hidden state, their activations, then the state update.

One direction at a time (a reverse one walks the steps backwards, inside each sequence's own
length when `sequence_lens` is given). Steps past a sequence's length leave its state unchanged
and write zeros to Y, as the spec says.

`cortex::LSTMRecurrence`, `GRURecurrence` and `RNNRecurrence` are the same layers with the input
projection X W^T already computed (passes/split_recurrent.py splits a too-large layer so): the
standard inputs without W, X being the gates [seq, batch, directions*gates*hidden], the same
attributes. Their ONNX meaning is the model-local function that pass adds.
"""

from dataclasses import dataclass

from ir.errors import UnsupportedError
from ir.loops.expr import cast, lt, maximum, minimum, select, unary
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


def _activation(name: str, alpha, beta):
    def sigmoid(v):
        return 1.0 / (1.0 + unary("exp", -v))
    table = {
        "Sigmoid": sigmoid,
        "Tanh": lambda v: unary("tanh", v),
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


def _lower(b, node, op, projected):
    """`projected`: X holds the gates' input projection (no W input; the later inputs move up one)."""
    gates = GATES[op]
    if node.attrs.get("input_forget", 0):
        raise UnsupportedError(f"{node.describe()}: LSTM with input_forget is not supported")
    shift = 1 if projected else 0
    x, r = b.input(node, 0), b.input(node, 2 - shift)
    w = None if projected else b.input(node, 1)
    bias, lengths, h0 = b.input(node, 3 - shift), b.input(node, 4 - shift), b.input(node, 5 - shift)
    c0 = b.input(node, 6 - shift) if op == "LSTM" else None
    peep = b.input(node, 7 - shift) if op == "LSTM" else None
    layout = int(node.attrs.get("layout", 0))
    if layout:      # batch-major: the same loops with the first two axes of X/Y and of the states swapped
        batch, seq, _ = x.shape
    else:
        seq, batch, _ = x.shape
    hidden = int(node.attrs["hidden_size"])
    directions = {"forward": ["forward"], "reverse": ["reverse"], "bidirectional": ["forward", "reverse"]}[
        node.attrs.get("direction", "forward")]
    per_dir = len(DEFAULT_ACTIVATIONS[op])
    names = node.attrs.get("activations") or DEFAULT_ACTIVATIONS[op] * len(directions)
    parameters = activation_parameters(names, node.attrs.get("activation_alpha"), node.attrs.get("activation_beta"))
    clip = node.attrs.get("clip")
    linear_before_reset = bool(node.attrs.get("linear_before_reset", 0))
    outputs = [b.output(node, i) if len(node.outputs) > i and node.outputs[i].dtype else None for i in range(3)]
    t_f32 = x.compute_type

    def at_x(t, n, k):
        return x[(n, t, k) if layout else (t, n, k)]

    def state_index(d, n, j):
        return (n, d, j) if layout else (d, n, j)

    state = b.temp(x.dtype, (batch, hidden), "h")
    cell = b.temp(x.dtype, (batch, hidden), "c") if op == "LSTM" else None
    pre = b.temp(x.dtype, (batch, gates * hidden), "gates")
    for d, direction in enumerate(directions):
        acts = [_activation(names[d * per_dir + i], *parameters[d * per_dir + i]) for i in range(per_dir)]
        for buf, init in ((state, h0), (cell, c0)):
            if buf is None:
                continue
            with b.loop(batch, "n") as n, b.loop(hidden, "j") as j:
                b.store(buf, (n, j), init[state_index(d, n, j)] if init is not None else 0.0)
        with b.loop(seq, "s") as s, b.loop(batch, "n") as n:
            length = cast(lengths[(n,)], "i32") if lengths is not None else seq
            if direction == "forward":
                t = s
            else:
                t = select(lt(s, length), length - 1 - s, s) if lengths is not None else seq - 1 - s
            active = lt(s, length) if lengths is not None else None

            def gate_sum(g_row):
                acc = b.local(t_f32, 0.0, "acc")
                if bias is not None:
                    recurrent_bias = bias[(d, gates * hidden + g_row)]
                    if op == "GRU":      # the candidate's recurrent bias goes with its recurrent term (step 2)
                        recurrent_bias = select(lt(g_row, 2 * hidden), recurrent_bias, 0.0)
                    b.assign(acc, bias[(d, g_row)] + recurrent_bias)
                if projected:
                    b.assign(acc, acc + at_x(t, n, d * gates * hidden + g_row))
                    return acc
                with b.loop(x.shape[2], "k") as k:
                    b.assign(acc, acc + at_x(t, n, k) * w[(d, g_row, k)])
                return acc

            # 1. pre-activations of every gate row (GRU's candidate gets its recurrent part later)
            with b.loop(gates * hidden, "g") as g:
                acc = gate_sum(g)
                rec = b.local(t_f32, 0.0, "rec")
                with b.loop(hidden, "i") as i:
                    b.assign(rec, rec + state[(n, i)] * r[(d, g, i)])
                if op == "GRU":      # the candidate row's recurrent term depends on the reset gate
                    b.store(pre, (n, g), select(lt(g, 2 * hidden), acc + rec, acc))
                else:
                    b.store(pre, (n, g), acc + rec)
            # 2. state update
            cond_ctx = b.when(active) if active is not None else _nothing()
            with cond_ctx:
                _update(b, _Layer(op, hidden, gates, clip, linear_before_reset, r, bias, peep), acts,
                        (pre, state, cell), n, d)
            y = outputs[0]
            if y is not None:
                with b.loop(hidden, "j") as j:
                    value = state[(n, j)] if active is None else select(active, state[(n, j)], 0.0)
                    b.store(y, (n, t, d, j) if layout else (t, d, n, j), value)
        for i, buf in ((1, state), (2, cell)):
            if outputs[i] is not None and buf is not None:
                with b.loop(batch, "n") as n, b.loop(hidden, "j") as j:
                    b.store(outputs[i], state_index(d, n, j), buf[(n, j)])


@dataclass(frozen=True)
class _Layer:
    """What one recurrent layer's state update reads besides the step's buffers."""
    op: str
    hidden: int
    gates: int
    clip: float | None
    linear_before_reset: bool
    r: object              # the recurrence weights (buffer)
    bias: object | None
    peep: object | None


def _update(b, layer: _Layer, acts, buffers, n, d):
    """The state update of one batch row `n` in direction `d`; `buffers` = (gate pre-activations,
    hidden state, cell state or None)."""
    pre, state, cell = buffers
    op, hidden, gates, clip = layer.op, layer.hidden, layer.gates, layer.clip
    linear_before_reset, r, bias, peep = layer.linear_before_reset, layer.r, layer.bias, layer.peep

    def clipped(v):
        return minimum(maximum(v, -float(clip)), float(clip)) if clip is not None else v
    if op == "RNN":
        with b.loop(hidden, "j") as j:
            b.store(state, (n, j), acts[0](clipped(pre[(n, j)])))
        return
    if op == "GRU":
        f, g = acts
        # z and r gates in place, then the candidate, which needs r and the old state
        with b.loop(2 * hidden, "j") as j:
            b.store(pre, (n, j), f(clipped(pre[(n, j)])))
        with b.loop(hidden, "j") as j:
            row = 2 * hidden + j
            rec = b.local(pre.compute_type, 0.0, "rec")
            with b.loop(hidden, "i") as i:
                h_i = state[(n, i)] if linear_before_reset else pre[(n, hidden + i)] * state[(n, i)]
                b.assign(rec, rec + h_i * r[(d, row, i)])
            rb = bias[(d, gates * hidden + row)] if bias is not None else 0.0
            if linear_before_reset:
                cand = pre[(n, row)] + pre[(n, hidden + j)] * (rec + rb)
            else:
                cand = pre[(n, row)] + rec + rb
            b.store(pre, (n, row), g(clipped(cand)))
        with b.loop(hidden, "j") as j:
            z = pre[(n, j)]
            b.store(state, (n, j), (1.0 - z) * pre[(n, 2 * hidden + j)] + z * state[(n, j)])
        return
    f, g, h = acts      # LSTM gate rows: i, o, f, c
    with b.loop(hidden, "j") as j:
        c_prev = cell[(n, j)]
        p_i = peep[(d, j)] * c_prev if peep is not None else 0.0
        p_f = peep[(d, 2 * hidden + j)] * c_prev if peep is not None else 0.0
        i_gate = f(clipped(pre[(n, j)] + p_i))
        f_gate = f(clipped(pre[(n, 2 * hidden + j)] + p_f))
        c_new = b.local(pre.compute_type, f_gate * c_prev + i_gate * g(clipped(pre[(n, 3 * hidden + j)])), "c")
        p_o = peep[(d, hidden + j)] * c_new if peep is not None else 0.0
        o_gate = f(clipped(pre[(n, hidden + j)] + p_o))
        b.store(cell, (n, j), c_new)
        b.store(state, (n, j), o_gate * h(c_new))


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

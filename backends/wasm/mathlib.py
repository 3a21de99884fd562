"""Scalar math functions in WAT, for the operations WebAssembly has no instruction for.

They compute in f64 (f32 callers promote and demote), which leaves several digits of headroom over
the float32 tolerance results are checked against: range reduction plus a short Taylor or
continued-fraction evaluation, written out with Horner's scheme. Only the functions a module uses
are emitted, with what they depend on.
"""

from __future__ import annotations

import math


def _horner(var: str, coeffs: list[float]) -> str:
    """c0 + v*(c1 + v*(c2 + ...)) as folded WAT."""
    text = f"(f64.const {coeffs[-1]!r})"
    for c in reversed(coeffs[:-1]):
        text = f"(f64.add (f64.const {c!r}) (f64.mul (local.get ${var}) {text}))"
    return text


_EXP_TAYLOR = [1.0 / math.factorial(n) for n in range(15)]
_LOG_SERIES = [1.0 / (2 * k + 1) for k in range(12)]                 # in s = f^2
_SIN_SERIES = [(-1) ** k / math.factorial(2 * k + 1) for k in range(10)]   # in r^2, times r
_COS_SERIES = [(-1) ** k / math.factorial(2 * k) for k in range(11)]       # in r^2
_ATAN_SERIES = [(-1) ** k / (2 * k + 1) for k in range(24)]               # in u^2, times u

def _erf_function() -> str:
    """erf as Taylor polynomials about the centres of the intervals of width 1/2 on [1/2, 6)
    (beyond, erf is 1 in float64). Derivatives: erf^(n)(c) = 2/sqrt(pi) (-1)^(n-1) H_(n-1)(c) e^(-c^2),
    so the coefficients are exact to float64 and no iteration runs at evaluation time."""
    from numpy.polynomial import hermite

    # Below 1/2 the odd Maclaurin series keeps tiny arguments exact (erf(x) ~ 2x/sqrt(pi)).
    maclaurin = [2 / math.sqrt(math.pi) * (-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(16)]
    branches = [f"  (if (i32.eqz (local.get $k)) (then (local.set $d (f64.mul (local.get $x) (local.get $x)))"
                f" (return (f64.mul (local.get $x) {_horner('d', maclaurin)}))))"]
    for k in range(1, 12):
        c = 0.25 + 0.5 * k
        coeffs = [math.erf(c)]
        for n in range(1, 19):
            h = hermite.hermval(c, [0] * (n - 1) + [1])
            coeffs.append(2 / math.sqrt(math.pi) * (-1) ** (n - 1) * h * math.exp(-c * c) / math.factorial(n))
        branches.append(f"  (if (i32.eq (local.get $k) (i32.const {k})) (then (return (f64.copysign "
                        f"{_horner('d', [float(v) for v in coeffs])} (local.get $x)))))")
    body = "\n".join(branches)
    return f"""
(func $erf (param $x f64) (result f64) (local $a f64) (local $d f64) (local $k i32)
  (if (f64.ne (local.get $x) (local.get $x)) (then (return (local.get $x))))
  (local.set $a (f64.abs (local.get $x)))
  (if (f64.ge (local.get $a) (f64.const 6)) (then (return (f64.copysign (f64.const 1) (local.get $x)))))
  (local.set $k (i32.trunc_f64_s (f64.mul (local.get $a) (f64.const 2))))
  (local.set $d (f64.sub (local.get $a) (f64.add (f64.mul (f64.convert_i32_s (local.get $k)) (f64.const 0.5)) (f64.const 0.25))))
{body}
  (f64.copysign (f64.const 1) (local.get $x)))
"""


FUNCTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "exp": ((), f"""
(func $exp (param $x f64) (result f64) (local $k f64) (local $r f64) (local $ki i64) (local $k1 i64)
  (if (f64.ne (local.get $x) (local.get $x)) (then (return (local.get $x))))
  (if (f64.gt (local.get $x) (f64.const 709.782712893384)) (then (return (f64.const inf))))
  (if (f64.lt (local.get $x) (f64.const -745.2)) (then (return (f64.const 0))))
  (local.set $k (f64.nearest (f64.mul (local.get $x) (f64.const 1.4426950408889634))))
  (local.set $r (f64.sub (f64.sub (local.get $x) (f64.mul (local.get $k) (f64.const 0.6931471803691238)))
                         (f64.mul (local.get $k) (f64.const 1.9082149292705877e-10))))
  (local.set $ki (i64.trunc_f64_s (local.get $k)))
  (local.set $k1 (i64.div_s (local.get $ki) (i64.const 2)))
  ;; 2^k as two factors so that neither overflows nor goes subnormal on its own
  (f64.mul (f64.mul {_horner("r", _EXP_TAYLOR)}
    (f64.reinterpret_i64 (i64.shl (i64.add (local.get $k1) (i64.const 1023)) (i64.const 52))))
    (f64.reinterpret_i64 (i64.shl (i64.add (i64.sub (local.get $ki) (local.get $k1)) (i64.const 1023)) (i64.const 52)))))
"""),
    "log": ((), f"""
(func $log (param $x f64) (result f64) (local $bits i64) (local $e f64) (local $m f64) (local $f f64) (local $s f64)
  (if (f64.ne (local.get $x) (local.get $x)) (then (return (local.get $x))))
  (if (f64.lt (local.get $x) (f64.const 0)) (then (return (f64.const nan))))
  (if (f64.eq (local.get $x) (f64.const 0)) (then (return (f64.const -inf))))
  (if (f64.eq (local.get $x) (f64.const inf)) (then (return (local.get $x))))
  (if (f64.lt (local.get $x) (f64.const 2.2250738585072014e-308))
    (then (local.set $x (f64.mul (local.get $x) (f64.const 18014398509481984)))
          (local.set $e (f64.const -54))))
  (local.set $bits (i64.reinterpret_f64 (local.get $x)))
  (local.set $e (f64.add (local.get $e) (f64.convert_i64_s
    (i64.sub (i64.and (i64.shr_u (local.get $bits) (i64.const 52)) (i64.const 0x7ff)) (i64.const 1023)))))
  (local.set $m (f64.reinterpret_i64 (i64.or (i64.and (local.get $bits) (i64.const 0x000fffffffffffff))
                                             (i64.const 0x3ff0000000000000))))
  (if (f64.gt (local.get $m) (f64.const 1.4142135623730951))
    (then (local.set $m (f64.mul (local.get $m) (f64.const 0.5)))
          (local.set $e (f64.add (local.get $e) (f64.const 1)))))
  (local.set $f (f64.div (f64.sub (local.get $m) (f64.const 1)) (f64.add (local.get $m) (f64.const 1))))
  (local.set $s (f64.mul (local.get $f) (local.get $f)))
  (f64.add (f64.mul (local.get $e) (f64.const 0.6931471805599453))
           (f64.mul (f64.mul (f64.const 2) (local.get $f)) {_horner("s", _LOG_SERIES)})))
"""),
    "pow": (("exp", "log"), """
(func $pow (param $x f64) (param $y f64) (result f64) (local $odd i32) (local $int i32)
  (if (f64.eq (local.get $y) (f64.const 0)) (then (return (f64.const 1))))
  (if (f64.ne (local.get $x) (local.get $x)) (then (return (local.get $x))))
  (if (f64.ne (local.get $y) (local.get $y)) (then (return (local.get $y))))
  (local.set $int (f64.eq (f64.floor (local.get $y)) (local.get $y)))
  (local.set $odd (i32.and (local.get $int)
    (f64.ne (f64.sub (local.get $y) (f64.mul (f64.const 2) (f64.floor (f64.mul (local.get $y) (f64.const 0.5)))))
            (f64.const 0))))
  (if (f64.eq (local.get $x) (f64.const 0))
    (then (if (f64.gt (local.get $y) (f64.const 0))
            (then (return (select (local.get $x) (f64.const 0) (local.get $odd))))
            (else (return (select (f64.div (f64.const 1) (local.get $x)) (f64.const inf) (local.get $odd)))))))
  (if (f64.lt (local.get $x) (f64.const 0))
    (then (if (i32.eqz (local.get $int)) (then (return (f64.const nan))))
          (return (select (f64.neg (call $exp (f64.mul (local.get $y) (call $log (f64.neg (local.get $x))))))
                          (call $exp (f64.mul (local.get $y) (call $log (f64.neg (local.get $x)))))
                          (local.get $odd)))))
  (call $exp (f64.mul (local.get $y) (call $log (local.get $x)))))
"""),
    "tanh": (("exp",), """
(func $tanh (param $x f64) (result f64) (local $e f64)
  (if (f64.gt (f64.abs (local.get $x)) (f64.const 22)) (then (return (f64.copysign (f64.const 1) (local.get $x)))))
  (if (f64.lt (f64.abs (local.get $x)) (f64.const 1e-5)) (then (return (local.get $x))))
  (local.set $e (call $exp (f64.mul (f64.const 2) (local.get $x))))
  (f64.div (f64.sub (local.get $e) (f64.const 1)) (f64.add (local.get $e) (f64.const 1))))
"""),
    "erf": ((), _erf_function()),
    "trig": ((), f"""
(func $trig (param $x f64) (param $shift i64) (result f64) (local $k f64) (local $r f64) (local $s f64) (local $q i64)
  (if (f64.ne (f64.sub (local.get $x) (local.get $x)) (f64.const 0)) (then (return (f64.const nan))))
  (local.set $k (f64.nearest (f64.mul (local.get $x) (f64.const 0.6366197723675814))))
  (local.set $r (f64.sub (f64.sub (local.get $x) (f64.mul (local.get $k) (f64.const 1.5707963267341256)))
                         (f64.mul (local.get $k) (f64.const 6.077100506506192e-11))))
  (local.set $s (f64.mul (local.get $r) (local.get $r)))
  (local.set $q (i64.and (i64.add (i64.trunc_f64_s (local.get $k)) (local.get $shift)) (i64.const 3)))
  (if (i64.eq (local.get $q) (i64.const 0)) (then (return (f64.mul (local.get $r) {_horner("s", _SIN_SERIES)}))))
  (if (i64.eq (local.get $q) (i64.const 1)) (then (return {_horner("s", _COS_SERIES)})))
  (if (i64.eq (local.get $q) (i64.const 2)) (then (return (f64.neg (f64.mul (local.get $r) {_horner("s", _SIN_SERIES)})))))
  (f64.neg {_horner("s", _COS_SERIES)}))
"""),
    "sin": (("trig",), "(func $sin (param $x f64) (result f64) (call $trig (local.get $x) (i64.const 0)))"),
    "cos": (("trig",), "(func $cos (param $x f64) (result f64) (call $trig (local.get $x) (i64.const 1)))"),
    "tan": (("trig",), """(func $tan (param $x f64) (result f64)
  (f64.div (call $trig (local.get $x) (i64.const 0)) (call $trig (local.get $x) (i64.const 1))))"""),
    "atan": ((), f"""
(func $atan_series (param $u f64) (result f64) (local $s f64)
  (local.set $s (f64.mul (local.get $u) (local.get $u)))
  (f64.mul (local.get $u) {_horner("s", _ATAN_SERIES)}))
(func $atan (param $x f64) (result f64) (local $a f64) (local $r f64)
  (if (f64.ne (local.get $x) (local.get $x)) (then (return (local.get $x))))
  (local.set $a (f64.abs (local.get $x)))
  (if (f64.gt (local.get $a) (f64.const 1)) (then (local.set $r (f64.div (f64.const 1) (local.get $a)))) (else (local.set $r (local.get $a))))
  (if (f64.gt (local.get $r) (f64.const 0.41421356237309503))
    (then (local.set $r (f64.add (f64.const 0.7853981633974483)
            (call $atan_series (f64.div (f64.sub (local.get $r) (f64.const 1)) (f64.add (local.get $r) (f64.const 1)))))))
    (else (local.set $r (call $atan_series (local.get $r)))))
  (if (f64.gt (local.get $a) (f64.const 1)) (then (local.set $r (f64.sub (f64.const 1.5707963267948966) (local.get $r)))))
  (f64.copysign (local.get $r) (local.get $x)))
"""),
    "asin": (("atan",), """(func $asin (param $x f64) (result f64)
  (call $atan (f64.div (local.get $x) (f64.sqrt (f64.sub (f64.const 1) (f64.mul (local.get $x) (local.get $x)))))))"""),
    "acos": (("asin",), """(func $acos (param $x f64) (result f64)
  (f64.sub (f64.const 1.5707963267948966) (call $asin (local.get $x))))"""),
    "sinh": (("exp",), """(func $sinh (param $x f64) (result f64)
  (if (f64.lt (f64.abs (local.get $x)) (f64.const 1e-5)) (then (return (local.get $x))))
  (f64.mul (f64.const 0.5) (f64.sub (call $exp (local.get $x)) (call $exp (f64.neg (local.get $x))))))"""),
    "cosh": (("exp",), """(func $cosh (param $x f64) (result f64)
  (f64.mul (f64.const 0.5) (f64.add (call $exp (local.get $x)) (call $exp (f64.neg (local.get $x))))))"""),
    "asinh": (("log",), """(func $asinh (param $x f64) (result f64) (local $a f64)
  (local.set $a (f64.abs (local.get $x)))
  (if (f64.lt (local.get $a) (f64.const 1e-5)) (then (return (local.get $x))))
  (f64.copysign (call $log (f64.add (local.get $a) (f64.sqrt (f64.add (f64.mul (local.get $a) (local.get $a)) (f64.const 1)))))
                (local.get $x)))"""),
    "acosh": (("log",), """(func $acosh (param $x f64) (result f64)
  (call $log (f64.add (local.get $x) (f64.sqrt (f64.sub (f64.mul (local.get $x) (local.get $x)) (f64.const 1))))))"""),
    "atanh": (("log",), """(func $atanh (param $x f64) (result f64)
  (if (f64.lt (f64.abs (local.get $x)) (f64.const 1e-5)) (then (return (local.get $x))))
  (f64.mul (f64.const 0.5) (call $log (f64.div (f64.add (f64.const 1) (local.get $x)) (f64.sub (f64.const 1) (local.get $x))))))"""),
    "fmod": ((), """(func $fmod (param $a f64) (param $b f64) (result f64)
  ;; C fmod: a finite dividend keeps its value under an infinite divisor
  (if (i32.and (f64.eq (f64.abs (local.get $b)) (f64.const inf)) (f64.eq (f64.sub (local.get $a) (local.get $a)) (f64.const 0)))
    (then (return (local.get $a))))
  (f64.sub (local.get $a) (f64.mul (local.get $b) (f64.trunc (f64.div (local.get $a) (local.get $b))))))"""),
    "f16_to_f32": ((), """
(func $f16_to_f32 (param $h i32) (result f32) (local $e i32) (local $m i32) (local $sign i32)
  (local.set $sign (i32.shl (i32.and (local.get $h) (i32.const 0x8000)) (i32.const 16)))
  (local.set $e (i32.and (i32.shr_u (local.get $h) (i32.const 10)) (i32.const 0x1f)))
  (local.set $m (i32.and (local.get $h) (i32.const 0x3ff)))
  (if (i32.eq (local.get $e) (i32.const 0x1f))
    (then (return (f32.reinterpret_i32 (i32.or (i32.or (local.get $sign) (i32.const 0x7f800000))
                                               (i32.shl (local.get $m) (i32.const 13)))))))
  (if (i32.eqz (local.get $e))
    (then (return (f32.copysign (f32.mul (f32.convert_i32_u (local.get $m)) (f32.const 5.960464477539063e-08))
                                (f32.reinterpret_i32 (i32.or (local.get $sign) (i32.const 0x3f800000)))))))
  (f32.reinterpret_i32 (i32.or (local.get $sign) (i32.or (i32.shl (i32.add (local.get $e) (i32.const 112)) (i32.const 23))
                                                       (i32.shl (local.get $m) (i32.const 13))))))
"""),
    "f32_to_f16": ((), """
(func $f32_to_f16 (param $x f32) (result i32) (local $b i32) (local $a i32) (local $sign i32)
  (local.set $b (i32.reinterpret_f32 (local.get $x)))
  (local.set $sign (i32.and (i32.shr_u (local.get $b) (i32.const 16)) (i32.const 0x8000)))
  (local.set $a (i32.and (local.get $b) (i32.const 0x7fffffff)))
  (if (i32.ge_u (local.get $a) (i32.const 0x7f800000))
    (then (return (i32.or (i32.or (local.get $sign) (i32.const 0x7c00))
                          (select (i32.const 0x200) (i32.const 0) (i32.gt_u (local.get $a) (i32.const 0x7f800000)))))))
  (if (i32.ge_u (local.get $a) (i32.const 0x477ff000)) (then (return (i32.or (local.get $sign) (i32.const 0x7c00)))))
  (if (i32.lt_u (local.get $a) (i32.const 0x38800000))
    ;; subnormal half: scale so one unit is 2^-24 and round to nearest even
    (then (return (i32.or (local.get $sign) (i32.trunc_f32_u (f32.nearest (f32.mul (f32.reinterpret_i32 (local.get $a))
                                                                                  (f32.const 16777216))))))))
  (local.set $a (i32.add (i32.add (local.get $a) (i32.const 0xfff)) (i32.and (i32.shr_u (local.get $a) (i32.const 13)) (i32.const 1))))
  (i32.or (local.get $sign) (i32.shr_u (i32.sub (local.get $a) (i32.const 0x38000000)) (i32.const 13))))
"""),
    "f32_to_bf16": ((), """
(func $f32_to_bf16 (param $x f32) (result i32) (local $b i32)
  (local.set $b (i32.reinterpret_f32 (local.get $x)))
  (if (f32.ne (local.get $x) (local.get $x))
    (then (return (i32.or (i32.shr_u (local.get $b) (i32.const 16)) (i32.const 0x40)))))
  ;; round to nearest even on the 16 bits dropped
  (i32.shr_u (i32.add (i32.add (local.get $b) (i32.const 0x7fff)) (i32.and (i32.shr_u (local.get $b) (i32.const 16)) (i32.const 1)))
             (i32.const 16)))
"""),
}


def render_functions(used: set[str]) -> str:
    """The WAT of the used functions and their dependencies, in a fixed order."""
    needed: set[str] = set()

    def add(name: str) -> None:
        if name not in needed:
            needed.add(name)
            for dep in FUNCTIONS[name][0]:
                add(dep)

    for name in used:
        add(name)
    return "\n".join(FUNCTIONS[name][1].strip() for name in FUNCTIONS if name in needed)

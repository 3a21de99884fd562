"""Scalar math functions in WAT, for the operations WebAssembly has no instruction for.

They compute in f64 (f32 callers promote and demote), which leaves several digits of headroom over
the float32 tolerance results are checked against: range reduction plus a short Taylor or
continued-fraction evaluation, written out with Horner's scheme. Only the functions a module uses
are emitted, with what they depend on.
"""

from __future__ import annotations

import math
import re


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


# --- f32x4 versions, for the loops the vectoriser turns into SIMD128 (float32 only) ---------------
# Evaluated in float32 with Cephes-style range reduction and polynomials: a few ulp instead of the
# correctly rounded scalar results, which is what makes four lanes at a time worth it.

def _c4(value: float) -> str:
    """A v128 with the float32 constant in every lane."""
    text = "inf" if value == math.inf else "-inf" if value == -math.inf else "nan" if value != value else repr(float(value))
    return f"(v128.const f32x4 {text} {text} {text} {text})"


def _madd(a: str, b: str, c: str, fused: bool) -> str:
    """a * b + c on f32x4 lanes: relaxed_madd (one FMA where the engine has it) or mul + add."""
    return f"(f32x4.relaxed_madd {a} {b} {c})" if fused else f"(f32x4.add {c} (f32x4.mul {a} {b}))"


def _nmadd(a: str, b: str, c: str, fused: bool) -> str:
    """c - a * b on f32x4 lanes."""
    return f"(f32x4.relaxed_nmadd {a} {b} {c})" if fused else f"(f32x4.sub {c} (f32x4.mul {a} {b}))"


def _vhorner(var: str, coeffs: list[float], fused: bool = False) -> str:
    """c0 + v*(c1 + v*(c2 + ...)) on f32x4 lanes."""
    text = _c4(coeffs[-1])
    for c in reversed(coeffs[:-1]):
        text = _madd(f"(local.get ${var})", text, _c4(c), fused)
    return text


# Cephes expf: exp(r) = 1 + r + r^2 P(r) on |r| <= ln2/2, coefficients lowest first
_EXPF_POLY = [5.0000001201e-1, 1.6666665459e-1, 4.1665795894e-2, 8.3334519073e-3, 1.3981999507e-3, 1.9875691500e-4]
# Cephes logf: log(1+m) = m - m^2/2 + m^3 P(m) on sqrt(1/2)-1 <= m < sqrt(2)-1
_LOGF_POLY = [3.3333331174e-1, -2.4999993993e-1, 2.0000714765e-1, -1.6668057665e-1, 1.4249322787e-1,
              -1.2420140846e-1, 1.1676998740e-1, -1.1514610310e-1, 7.0376836292e-2]
# Cephes tanhf below |x| = 0.625: x + x^3 P(x^2)
_TANHF_POLY = [-3.33332819422e-1, 1.33314422036e-1, -5.37397155531e-2, 2.06390887954e-2, -5.70498872745e-3]
# erf(x) = x P(x^2) / Q(x^2) on [-4, 4] (beyond, erf is +-1 in float32); the rational approximation
# Eigen and XLA use for float32, within 7e-8 of erf
_ERFF_P = [-1.60960333262415e-02, -2.95459980854025e-03, -7.34990630326855e-04, -5.69250639462346e-05,
           -2.10102402082508e-06, 2.77068142495902e-08, -2.72614225801306e-10]
_ERFF_Q = [-1.42647390514189e-02, -7.37332916720468e-03, -1.68282697438203e-03, -2.13374055278905e-04,
           -1.45660718464996e-05]

# Math ops with an f32x4 version: op -> WAT function taking and returning v128
VECTOR_MATH = {"exp": "exp_f32x4", "log": "log_f32x4", "tanh": "tanh_f32x4", "erf": "erf_f32x4"}
VECTOR_MATH_BINARY = {"pow": "pow_f32x4"}


def _exp_exponent(relaxed: bool) -> str:
    """$k = nearest(x log2 e) and $ki, its i32, without the saturating truncation (a long sequence on
    x86: NaN and overflow fix-ups; ~15% of a Softmax). k is integral and within +-151, so relaxed
    truncation (one cvttps2dq) is exact; without relaxed-simd, 1.5 * 2^23 + t rounds t to nearest
    even (|t| < 2^22) and holds k in its low mantissa bits. A NaN lane gives some integer either way,
    and the result stays NaN through the polynomial."""
    if relaxed:
        return f"""  (local.set $k (f32x4.nearest (f32x4.mul (local.get $x) {_c4(1.4426950408889634)})))
  (local.set $ki (i32x4.relaxed_trunc_f32x4_s (local.get $k)))"""
    return f"""  (local.set $ki (f32x4.add (f32x4.mul (local.get $x) {_c4(1.4426950408889634)}) {_c4(12582912.0)}))
  (local.set $k (f32x4.sub (local.get $ki) {_c4(12582912.0)}))
  (local.set $ki (i32x4.sub (local.get $ki) (v128.const i32x4 0x4b400000 0x4b400000 0x4b400000 0x4b400000)))"""


def _vector_functions(fused: bool) -> dict[str, tuple[tuple[str, ...], str]]:
    """The f32x4 functions; with `fused` their polynomials use relaxed_madd (relaxed-simd)."""
    def horner(var, coeffs):
        return _vhorner(var, coeffs, fused)
    return {
        "exp_f32x4": ((), f"""
(func $exp_f32x4 (param $x v128) (result v128) (local $k v128) (local $r v128) (local $ki v128) (local $k1 v128)
  ;; clamping keeps the exponent arithmetic in range: exp(89) is inf and exp(-104) is 0 in float32;
  ;; pmin(x, c) is `c < x ? c : x` and pmax(x, c) `x < c ? c : x`, so NaN lanes stay NaN (one
  ;; minps/maxps each, where the NaN-propagating f32x4.min/max are long sequences on x86)
  (local.set $x (f32x4.pmax (f32x4.pmin (local.get $x) {_c4(89.0)}) {_c4(-104.0)}))
{_exp_exponent(fused)}
  ;; ln2 split in two: k * 0.693359375 is exact for |k| <= 150
  (local.set $r {_madd("(local.get $k)", _c4(2.12194440e-4),
                        _nmadd("(local.get $k)", _c4(0.693359375), "(local.get $x)", fused), fused)})
  (local.set $k1 (i32x4.shr_s (local.get $ki) (i32.const 1)))
  ;; 2^k as two factors so that neither overflows nor goes subnormal on its own
  (f32x4.mul (f32x4.mul
      {_madd("(f32x4.mul (local.get $r) (local.get $r))", horner("r", _EXPF_POLY),
             f"(f32x4.add {_c4(1.0)} (local.get $r))", fused)}
      (i32x4.shl (i32x4.add (local.get $k1) (v128.const i32x4 127 127 127 127)) (i32.const 23)))
    (i32x4.shl (i32x4.add (i32x4.sub (local.get $ki) (local.get $k1)) (v128.const i32x4 127 127 127 127)) (i32.const 23))))
"""),
        "log_f32x4": ((), f"""
(func $log_f32x4 (param $x v128) (result v128) (local $y v128) (local $e v128) (local $m v128) (local $small v128) (local $z v128)
  ;; subnormals are scaled by 2^23 first, so that the exponent field is exact
  (local.set $small (f32x4.lt (local.get $x) {_c4(1.1754943508222875e-38)}))
  (local.set $y (v128.bitselect (f32x4.mul (local.get $x) {_c4(8388608.0)}) (local.get $x) (local.get $small)))
  (local.set $e (f32x4.add (f32x4.convert_i32x4_s (i32x4.sub (i32x4.shr_u (local.get $y) (i32.const 23))
                                                             (v128.const i32x4 126 126 126 126)))
                           (v128.bitselect {_c4(-23.0)} {_c4(0.0)} (local.get $small))))
  ;; mantissa in [1/2, 1), then in [sqrt(1/2), sqrt(2)) shifted by one
  (local.set $m (v128.or (v128.and (local.get $y) (v128.const i32x4 0x807fffff 0x807fffff 0x807fffff 0x807fffff))
                         {_c4(0.5)}))
  (local.set $small (f32x4.lt (local.get $m) {_c4(0.7071067811865476)}))
  (local.set $e (f32x4.sub (local.get $e) (v128.and {_c4(1.0)} (local.get $small))))
  (local.set $m (f32x4.sub (f32x4.add (local.get $m) (v128.and (local.get $m) (local.get $small))) {_c4(1.0)}))
  (local.set $z (f32x4.mul (local.get $m) (local.get $m)))
  (local.set $y (f32x4.mul (f32x4.mul (local.get $m) (local.get $z)) {horner("m", _LOGF_POLY)}))
  (local.set $y (f32x4.sub (f32x4.sub (local.get $y) (f32x4.mul (local.get $e) {_c4(2.12194440e-4)}))
                           (f32x4.mul (local.get $z) {_c4(0.5)})))
  (local.set $y (f32x4.add (f32x4.add (local.get $m) (local.get $y)) (f32x4.mul (local.get $e) {_c4(0.693359375)})))
  ;; log(+-0) = -inf, log(inf) = inf, log(negative) = NaN, NaN stays itself
  (local.set $y (v128.bitselect {_c4(-math.inf)} (local.get $y) (f32x4.eq (local.get $x) {_c4(0.0)})))
  (local.set $y (v128.bitselect (local.get $x) (local.get $y) (f32x4.eq (local.get $x) {_c4(math.inf)})))
  (local.set $y (v128.bitselect {_c4(math.nan)} (local.get $y) (f32x4.lt (local.get $x) {_c4(0.0)})))
  (v128.bitselect (local.get $x) (local.get $y) (f32x4.ne (local.get $x) (local.get $x))))
"""),
        "tanh_f32x4": (("exp_f32x4",), f"""
(func $tanh_f32x4 (param $x v128) (result v128) (local $a v128) (local $z v128) (local $big v128)
  (local.set $a (f32x4.abs (local.get $x)))
  (local.set $z (f32x4.mul (local.get $x) (local.get $x)))
  (local.set $z (f32x4.add (local.get $x) (f32x4.mul (f32x4.mul (local.get $z) (local.get $x)) {horner("z", _TANHF_POLY)})))
  ;; from 0.625 on, 1 - 2 / (exp(2|x|) + 1) no longer cancels; exp overflowing to inf gives 1
  (local.set $big (f32x4.sub {_c4(1.0)} (f32x4.div {_c4(2.0)}
    (f32x4.add (call $exp_f32x4 (f32x4.add (local.get $a) (local.get $a))) {_c4(1.0)}))))
  (local.set $big (v128.or (local.get $big) (v128.and (local.get $x) (v128.const i32x4 0x80000000 0x80000000 0x80000000 0x80000000))))
  (v128.bitselect (local.get $big) (local.get $z) (f32x4.ge (local.get $a) {_c4(0.625)})))
"""),
        "pow_f32x4": (("exp_f32x4", "log_f32x4"), f"""
(func $pow_f32x4 (param $x v128) (param $y v128) (result v128) (local $r v128) (local $int v128) (local $odd v128)
  ;; exp(y log|x|), then the C rules of the scalar $pow: the error grows with |y log|x||, up to
  ;; 2 ulps per unit of it: at most about 2e-5 relative for results in float32 range (|y log|x|| < 89)
  (local.set $r (call $exp_f32x4 (f32x4.mul (local.get $y) (call $log_f32x4 (f32x4.abs (local.get $x))))))
  (local.set $int (f32x4.eq (f32x4.floor (local.get $y)) (local.get $y)))
  (local.set $odd (v128.and (local.get $int) (f32x4.ne (f32x4.sub (local.get $y)
    (f32x4.mul {_c4(2.0)} (f32x4.floor (f32x4.mul (local.get $y) {_c4(0.5)})))) {_c4(0.0)})))
  ;; an odd integer power keeps the sign of x (zeros and infinities included)
  (local.set $r (v128.or (local.get $r)
    (v128.and (v128.and (local.get $x) (v128.const i32x4 0x80000000 0x80000000 0x80000000 0x80000000)) (local.get $odd))))
  (local.set $r (v128.bitselect {_c4(math.nan)} (local.get $r)
    (v128.andnot (f32x4.lt (local.get $x) {_c4(0.0)}) (local.get $int))))
  (v128.bitselect {_c4(1.0)} (local.get $r) (f32x4.eq (local.get $y) {_c4(0.0)})))
"""),
        "erf_f32x4": ((), f"""
(func $erf_f32x4 (param $x v128) (result v128) (local $c v128) (local $s v128)
  (local.set $c (f32x4.pmax (f32x4.pmin (local.get $x) {_c4(4.0)}) {_c4(-4.0)}))    ;; NaN stays NaN
  (local.set $s (f32x4.mul (local.get $c) (local.get $c)))
  ;; x times P/Q rather than (x P)/Q: tiny x then meet one rounding, not a subnormal product;
  ;; the rational function overshoots 1 by an ulp next to |x| = 4
  (f32x4.pmax (f32x4.pmin
    (f32x4.mul (local.get $c) (f32x4.div {horner("s", _ERFF_P)} {horner("s", _ERFF_Q)}))
    {_c4(1.0)}) {_c4(-1.0)}))
"""),
    }

VECTOR_FUNCTIONS = _vector_functions(fused=False)
FUNCTIONS.update(VECTOR_FUNCTIONS)
FUSED_VECTOR_FUNCTIONS = _vector_functions(fused=True)


def render_functions(used: set[str], fused: bool = False) -> str:
    """The WAT of the used functions and their dependencies, in a fixed order; with `fused`
    (relaxed-simd) the f32x4 polynomials use relaxed_madd."""
    needed: set[str] = set()
    texts = {**FUNCTIONS, **FUSED_VECTOR_FUNCTIONS} if fused else FUNCTIONS

    def add(name: str) -> None:
        if name not in needed:
            needed.add(name)
            for dep in FUNCTIONS[name][0]:
                add(dep)

    for name in used:
        add(name)
    return "\n".join(texts[name][1].strip() for name in FUNCTIONS if name in needed)


# f32x4 functions that call no other function: the vectoriser may write their bodies inline
INLINE_VECTOR_FUNCTIONS = ("exp_f32x4", "log_f32x4", "erf_f32x4")


def inline_vector_call(name: str, args: list[str], fused: bool, fresh_local) -> str:
    """The body of f32x4 function `name` as one `(block (result v128) ...)` expression on `args`,
    its parameters and locals renamed to v128 locals that `fresh_local()` gives the caller. A call
    would spill every v128 value live across it (x86 has no callee-saved xmm registers in
    Cranelift's ABI) and keeps Cranelift from interleaving the unrolled iterations."""
    text = (FUSED_VECTOR_FUNCTIONS if fused else VECTOR_FUNCTIONS)[name][1].strip()
    header, _, body = text.partition("\n")
    params = re.findall(r"\(param \$(\w+) v128\)", header)
    names = {n: fresh_local() for n in params + re.findall(r"\(local \$(\w+) v128\)", header)}
    body = body.rstrip()[:-1]                     # the closing parenthesis of the func
    body = re.sub(r"\$(\w+)", lambda m: names.get(m.group(1), m.group(0)), body)
    sets = " ".join(f"(local.set {names[p]} {a})" for p, a in zip(params, args))
    return f"(block (result v128) (; {name} inline ;) {sets}\n{body})"


"""Elementwise ops: each output element depends on the same (broadcast) position of the inputs."""

from ir.ops.registry import ELEMENTWISE, RANDOM, register

register("Abs", "Neg", "Reciprocal", "Floor", "Ceil", "Round", "Sqrt", "Exp", "Log", "Sign",
         "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "ThresholdedRelu", "Sigmoid",
         "HardSigmoid", "HardSwish", "Tanh", "Softplus", "Softsign", "Gelu", "Mish", "Erf",
         "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
         "Not", "IsNaN", "IsInf", "Clip", "Cast", "CastLike", "Identity", "BitwiseNot",
         "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean",
         "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor",
         "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Where",
         "QuantizeLinear", "DequantizeLinear", "Shrink", "Swish",
         kind=ELEMENTWISE)

register("Dropout", kind=ELEMENTWISE)  # inference mode is Identity; Simplify removes it

register("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
         "Bernoulli", kind=RANDOM)

"""Contractions and neural-network ops: the ops that own weights."""

from ir.ops.registry import CONTRACTION, NORMALIZATION, OTHER, register


def _gemm_weight_axis(node):
    return 0 if node.attrs.get("transB", 0) else 1


register("MatMul", kind=CONTRACTION, weight_input=1,
         weight_axis=lambda node: -1, output_axis=lambda node: -1)
register("Gemm", kind=CONTRACTION, weight_input=1,
         weight_axis=_gemm_weight_axis, output_axis=lambda node: 1)
register("Conv", kind=CONTRACTION, weight_input=1,
         weight_axis=lambda node: 0, output_axis=lambda node: 1)
register("ConvTranspose", "ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul",
         "DeformConv", "Einsum", kind=CONTRACTION)

register("BatchNormalization", "InstanceNormalization", "LayerNormalization", "GroupNormalization",
         "LpNormalization", "MeanVarianceNormalization", "LRN", "RMSNormalization",
         "Softmax", "LogSoftmax", "Hardmax", kind=NORMALIZATION)

register("MaxPool", "AveragePool", "GlobalMaxPool", "GlobalAveragePool", "LpPool", "GlobalLpPool",
         "MaxRoiPool", "RoiAlign", "MaxUnpool", "Resize", "Upsample", "GridSample", "AffineGrid",
         "Col2Im", "CumSum", "TopK", "NonMaxSuppression", "LSTM", "GRU", "RNN", "Attention",
         "RotaryEmbedding", "DFT", "STFT", "MelWeightMatrix", "BlackmanWindow", "HannWindow",
         "HammingWindow", "DynamicQuantizeLinear", "CenterCropPad", "ImageDecoder",
         "StringNormalizer", "StringConcat", "StringSplit", "RegexFullMatch", "TfIdfVectorizer",
         "Det", "Unique", "NonZero", "Compress", "Trilu", "EyeLike", "OneHot", "Range",
         kind=OTHER)

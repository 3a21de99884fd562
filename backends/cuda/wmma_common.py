"""What both tensor-core kernels (tensor_cores, wmma_tiled) spell alike: fragment shapes and element
types per precision, the rounding of a staged float, and how one operand element is staged."""

from __future__ import annotations

from ir.loops.expr import Load

# The fragment shape per precision: tf32 is m16n16k8, the 16-bit types m16n16k16.
KSTEP = {"tf32": 8, "fp16": 16, "bf16": 16}
ELEMENT = {"tf32": "wmma::precision::tf32", "fp16": "half", "bf16": "__nv_bfloat16"}
ROUND = {"fp16": "__float2half", "bf16": "__float2bfloat16"}


def stage_element(r, operand, destination: str, inside: str, indent: str) -> list[str]:
    """One staged element: an async copy of a plain float32 load, else the value computed here.
    `r` is the CUDA renderer (render.CudaRenderer), whose names and expressions it prints."""
    if isinstance(operand, Load) and operand.buffer.storage.dtype == "float32" and id(operand.buffer.storage) not in r._registers:
        source = f"&{r.buffer_name(operand.buffer.storage)}[{r.expr(operand.index)}]"
        return [f"{indent}if ({inside}) __pipeline_memcpy_async(&{destination}, {source}, sizeof(float));",
                f"{indent}else {destination} = 0.0f;"]
    return [f"{indent}{destination} = ({inside}) ? (float)({r.expr(operand)}) : 0.0f;"]

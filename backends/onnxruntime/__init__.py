"""The onnxruntime device: runs CUs' own cu.onnx files. It is where fallback CUs run (`cortex
decompose --fallback onnxruntime`: nodes no target lowers), and it can run a whole dag.json."""

from backends.onnxruntime.device import OnnxruntimeDevice
from backends.registry import DeviceSpec, register_device

DEVICE = register_device(DeviceSpec(name="onnxruntime", artifact=None, open=OnnxruntimeDevice,
                                    description="onnxruntime (CPU), each CU's cu.onnx in a session of its own"))

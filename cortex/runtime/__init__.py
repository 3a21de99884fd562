"""Load a dag.json and run its CUs on a device (`cortex.load`, `cortex run`)."""

from cortex.runtime.loader import CompiledModel, device_names, load

__all__ = ["CompiledModel", "device_names", "load"]

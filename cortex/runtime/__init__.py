"""Load a dag.json and run its CUs on a device (`cortex.load`, `cortex run`)."""

from cortex.runtime.loader import DEVICES, CompiledModel, load

__all__ = ["DEVICES", "CompiledModel", "load"]

"""The Python end of bench/ortweb/runner.mjs: one long-lived Node process that holds onnxruntime-web
sessions and raw WebAssembly instances, timed inside V8."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

ORTWEB_DIR = Path(__file__).resolve().parent / "ortweb"
NODE = "/usr/bin/node"


class NodeUnavailable(RuntimeError):
    pass


class NodeRunner:
    """A Node script answering one JSON request per line (`script`: onnxruntime-web's runner by default)."""

    def __init__(self, script: Path = ORTWEB_DIR / "runner.mjs"):
        if not (ORTWEB_DIR / "node_modules" / "onnxruntime-web").is_dir():
            raise NodeUnavailable("onnxruntime-web is not installed (make bench installs it into bench/ortweb/node_modules)")
        # Node 20 keeps relaxed SIMD behind a flag.
        self.proc = subprocess.Popen([NODE, "--experimental-wasm-relaxed-simd", str(script)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=script.parent)

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise NodeUnavailable(f"the Node runner exited (code {self.proc.poll()})")
        reply = json.loads(line)
        if not reply.pop("ok"):
            # onnxruntime's messages carry a build path and a C++ signature before what went wrong
            raise RuntimeError(reply["error"].split("ERROR_MESSAGE:")[-1].split(") ")[-1].strip())
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


@dataclass
class NodeContestant:
    name: str
    runner: NodeRunner
    id: str

    def time(self, warmup: int, repeat: int) -> list[tuple[float, float]]:
        reply = self.runner.ask(cmd="time", id=self.id, warmup=warmup, repeat=repeat)
        return list(zip(reply["seconds"], reply["cpu_seconds"]))

"""The GPU tests' child process: the test session runs Triton under the interpreter (tests/conftest.py), so the
checks that need compiled kernels run `module.func()` in a child with the interpreter off, which prints one JSON
line per check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compiled_rows(module: str, func: str, timeout: int = 900) -> list[dict]:
    """The JSON rows `module.func()` printed in a child process with TRITON_INTERPRET=0 (tests/ and the repository
    root on its path); fails the test with the child's output when it exits non-zero."""
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join([TESTS, os.path.dirname(TESTS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", f"import {module} as t; t.{func}()"], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    print("\n".join(json.dumps(r) for r in rows))
    return rows

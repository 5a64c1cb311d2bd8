"""Command line: `python -m bertfast <command>` (also the `bertfast` console script).

Each command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`
(the exit code); this file only dispatches, importing a command's module when it is used.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": ("bertfast.tools.demo", "encode sentences with the default model, check it, time it"),
    "validate": ("bertfast.tools.validate.cli", "check a backend's ops (or a whole model) against the reference"),
    "kernels": ("bertfast.tools.aot", "compile every Triton kernel ahead of time for GPU archs and report"),
    "bench": ("bertfast.tools.bench.cli", "benchmark bertfast against Hugging Face, ONNX Runtime, torch.compile"),
    "serve": ("bertfast.tools.serve.cli", "HTTP embedding / classification / rerank server (TEI and OpenAI routes), batched on one engine thread"),
    "embed": ("bertfast.tools.embed.cli", "embed a corpus (txt/jsonl/csv/parquet) into Parquet shards or .npy, resumable"),
    "gpucheck": ("bertfast.tools.gpucheck.cli", "on a CUDA GPU: gpu tests, parity, sweep, sanitizer, bench, as JSON"),
}


def main(argv=None) -> int:
    from bertfast import cap_libraries

    cap_libraries()  # BERTFAST_ISA's cap for oneDNN, MKL and ATen, before any command runs a GEMM
    parser = argparse.ArgumentParser(prog="bertfast", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(module=module_name)
        try:
            importlib.import_module(module_name).add_arguments(p)
        except ImportError as e:  # a dependency of that command is missing: say which when it is asked for
            p.set_defaults(missing=f"{type(e).__name__}: {e}")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "missing", False):
        print(f"bertfast {args.command}: not available in this build ({args.missing})", file=sys.stderr)
        return 2
    return int(importlib.import_module(args.module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""`bertfast validate`: check a backend's ops (`sweep`), or a whole checkpoint (`model_check`, or the
int8 report with `--dtype int8`), against the eager reference, and print one table row per check.
Every row is judged by the one accuracy rule (`accuracy`): the error against an fp64 oracle may be at
most twice the same-dtype reference's own error plus a small floor, within the per-dtype table.

Exit codes: 0 all checks passed (skips allowed), 1 some check failed, 2 bad usage (unknown or
unavailable backend, unreadable model, nothing left to check).
"""

from __future__ import annotations

import sys

import torch

from bertfast.backends.cpu import isa
from bertfast.tools.validate import int8_report
from bertfast.accuracy import DTYPE_IDS, Row
from bertfast.tools.validate.cases import OP_NAMES
from bertfast.tools.validate.model_check import run_model_check
from bertfast.tools.validate.sweep import run_op_sweep

DEFAULT_DTYPES = "fp32,fp16,bf16"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def format_table(rows: list[Row]) -> str:
    """The rows as an aligned text table, one line per row, the status and note last."""
    head = ("op", "shape", "dtype", "max abs err", "max rel err", "ref rel err", "tolerance", "pass")
    body = [(r.op, r.shape, r.dtype, _fmt(r.abs_err), _fmt(r.rel_err), _fmt(r.ref_err), _fmt(r.tol),
             r.status + (f"  {r.note}" if r.note else "")) for r in rows]
    widths = [max(len(str(c[i])) for c in [head] + body) for i in range(len(head) - 1)]

    def line(cells):
        return "  ".join(str(c).ljust(w) for c, w in zip(cells[:-1], widths)) + "  " + cells[-1]

    out = [line(head), line(tuple("-" * w for w in widths) + ("-" * 4,))]
    out += [line(b) for b in body]
    return "\n".join(out)


def summary(rows: list[Row]) -> str:
    """The counts line: "N passed, N failed, N skipped"."""
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    return f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"


def add_arguments(parser) -> None:
    parser.add_argument("--backend", default="auto",
                        help="backend to check: triton, cpu, torch or auto (default: auto)")
    parser.add_argument("--dtype", default=DEFAULT_DTYPES,
                        help=f"comma-separated dtypes to check (default: {DEFAULT_DTYPES}; 'auto': the backend's "
                             "choice on this CPU tier or GPU); 'int8' alone, "
                             "with --model: the int8 accuracy report (per layer and sentence embeddings vs fp32)")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="check a whole checkpoint layer by layer instead of the op sweep "
                             "('default' = the embedded all-MiniLM-L6-v2)")
    parser.add_argument("--adapter", default=None, metavar="DIR",
                        help="with --model: a PEFT LoRA directory run on every other row of the batch, judged "
                             "against the reference forward with it (fp32, fp16, bf16)")
    parser.add_argument("--device", default=None,
                        help="device to run the backend on (default: cuda when available, else cpu)")
    parser.add_argument("--quick", action="store_true", help="a smaller op sweep (still every op)")
    parser.add_argument("--ops", default=None,
                        help=f"comma-separated subset of ops to sweep ({', '.join(OP_NAMES)})")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each op check as it finishes")


def _usage_error(msg: str) -> int:
    print(f"bertfast validate: {msg}", file=sys.stderr)
    return 2


def parse_dtypes(text: str, backend=None, device: str = "cpu") -> list[torch.dtype]:
    """Comma-separated dtype names; "auto" is `backend`'s choice on `device` (Backend.precision)."""
    from bertfast.loading import resolve_dtype

    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError("--dtype is empty (expected e.g. fp32,fp16,bf16)")
    if "auto" in names and backend is None:
        raise ValueError("--dtype auto needs a backend to ask")
    auto = backend.precision(torch.device(device).type).auto if "auto" in names else None
    return list(dict.fromkeys(auto if n == "auto" else resolve_dtype(n) for n in names))


def run(args) -> int:
    from bertfast.backends import BackendUnavailable, get_backend

    if "int8" in [d.strip() for d in args.dtype.split(",")]:
        return run_int8(args)
    try:
        ops = None
        if args.ops:
            ops = [s.strip() for s in args.ops.split(",") if s.strip()]
            unknown = [o for o in ops if o not in OP_NAMES]
            if unknown:
                raise ValueError(f"unknown op(s) {', '.join(unknown)}; ops are {', '.join(OP_NAMES)}")
        if args.model is not None and (args.ops or args.quick):
            raise ValueError("--ops and --quick shape the op sweep; they do not apply with --model")
        if getattr(args, "adapter", None) is not None and args.model is None:
            raise ValueError("--adapter needs --model DIR: the adapter is checked on that checkpoint")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch.device(device)  # raises on a malformed device string
    except (ValueError, RuntimeError) as e:
        return _usage_error(str(e))
    try:
        backend = get_backend(args.backend, device)
        dtypes = parse_dtypes(args.dtype, backend, device)
    except (ValueError, BackendUnavailable) as e:
        return _usage_error(str(e))
    return run_with_backend(backend, args, dtypes=dtypes, device=device, ops=ops)


def run_with_backend(backend, args, dtypes=None, device="cpu", ops=None, out=None) -> int:
    """The command body for an already constructed backend (tests pass their own)."""
    out = out or sys.stdout
    dtypes = dtypes if dtypes is not None else parse_dtypes(getattr(args, "dtype", DEFAULT_DTYPES), backend, device)
    model = getattr(args, "model", None)
    weights = directory = adapter = None
    if model is not None:
        try:
            from bertfast.loading import load_pretrained

            directory = _model_dir(model)
            weights = load_pretrained(directory)
            adapter = _adapter(getattr(args, "adapter", None), weights)
        except (ValueError, RuntimeError, OSError) as e:
            return _usage_error(str(e))
        what = (f"model {directory} ({weights.config.num_hidden_layers} layers, hidden "
                f"{weights.config.hidden_size}, {weights.config.num_attention_heads} heads)")
        if adapter is not None:
            what += f", LoRA adapter {args.adapter} on the even rows"
    else:
        what = "quick op sweep" if getattr(args, "quick", False) else "op sweep"
    dnames = ", ".join(DTYPE_IDS[d] for d in dtypes)
    print(f"bertfast validate: {what}, backend {backend.name!r} on {device}, dtypes {dnames}", file=out)
    if device == "cpu":
        print(isa.describe(), file=out)
    print("rel = max|out - fp64 oracle| / max|oracle|; ref = the reference's own rel error in the same "
          "dtype; tolerance = 2 * ref + floor, capped by the dtype table (fp32 1e-5, fp16 1e-2, "
          "bf16 2e-2) unless the reference itself is above it", file=out)
    if weights is None:
        def progress(r):
            print(f"  {r.op} {r.shape} {r.dtype}: {r.status}", file=out, flush=True)

        progress = progress if getattr(args, "verbose", False) else None
        rows = run_op_sweep(backend, dtypes, device, getattr(args, "quick", False), ops, progress)
    else:
        try:
            rows = run_model_check(backend, weights, directory, dtypes, device, adapter)
        except ValueError as e:  # e.g. a tokenizer whose ids do not fit the model
            return _usage_error(str(e))
    print(format_table(rows), file=out)
    print(summary(rows), file=out)
    if not any(r.status in ("PASS", "FAIL") for r in rows):
        print("bertfast validate: nothing was checked (every dtype or case was skipped)", file=out)
        return 2
    return 1 if any(r.status == "FAIL" for r in rows) else 0


def run_int8(args, out=None) -> int:
    """`--dtype int8 --model DIR`: the int8 accuracy report (`int8_report`)."""
    from bertfast.backends import BackendUnavailable, get_backend
    from bertfast.loading import load_pretrained

    out = out or sys.stdout
    if [d.strip() for d in args.dtype.split(",") if d.strip()] != ["int8"]:
        return _usage_error("--dtype int8 runs alone (it is compared with fp32 itself)")
    if args.model is None:
        return _usage_error("--dtype int8 needs --model DIR: the int8 report checks a whole checkpoint")
    if args.ops or args.quick:
        return _usage_error("--ops and --quick shape the op sweep; they do not apply with --model")
    if getattr(args, "adapter", None) is not None:
        return _usage_error("--adapter is checked in fp32, fp16 and bf16; the int8 report takes none")
    device = args.device or "cpu"
    try:
        backend = get_backend(args.backend, device, quantize="int8")
        directory = _model_dir(args.model)
        weights = load_pretrained(directory, torch.float32)
    except (ValueError, BackendUnavailable, RuntimeError, OSError) as e:
        return _usage_error(str(e))
    print(f"bertfast validate: int8 report for model {directory}, backend {backend.name!r} on {device}; "
          "rel = max|out - fp64 oracle| / max|oracle| (oracle on the fp32 weights); ref = the fp32 "
          "reference's own rel error; a stage passes with min token cosine >= "
          f"{int8_report.LAYER_MIN_COSINE}", file=out)
    rows = int8_report.layer_rows(backend, weights, directory, device)
    print(format_table(rows), file=out)
    print(summary(rows), file=out)
    failed = any(r.status == "FAIL" for r in rows)
    rep = int8_report.sentence_report(directory, args.backend)
    if rep is None:
        print("sentence embeddings: skipped (the checkpoint has no tokenizer)", file=out)
    else:
        print(int8_report.format_sentence_report(rep), file=out)
        failed = failed or not rep["passed"]
    return 1 if failed else 0


def _adapter(path: str | None, weights):
    """The adapter at `path` loaded against `weights` (None: none); ValueError (a LoadError) saying why not."""
    if path is None:
        return None
    from bertfast.adapters import load_adapters

    adapter = load_adapters(path, weights, "validate")
    if any(slot.startswith("pos_") for slots in adapter.layers for slot in slots):
        raise ValueError(f"--adapter {path}: LoRA on DeBERTa's position projections is not checked here (the "
                         "reference forward runs none); tests/test_adapters.py checks it against PEFT")
    return adapter


def _model_dir(model: str) -> str:
    if model == "default":
        from bertfast import default_model_path

        return default_model_path()
    return model

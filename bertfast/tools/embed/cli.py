"""`bertfast embed INPUT OUTPUT`: sentence embeddings for a corpus, streamed, sharded and resumable.

INPUT: a .txt (one text per line), .jsonl, .csv or .parquet file, a directory of them or a glob.
OUTPUT: a directory of Parquet shards (id, embedding, optional text) with a manifest, or FILE.npy
((N, D) float32, the embedded rows in input order; with --precision the quantized form: int8/uint8 (N, D) or
packed bits (N, ceil(D / 8)), as `bertfast.quantize_embeddings` makes them). The command parses, checks, and hands
over to the job (`job.run`) with one `bertfast.ray.Embedder` whose chunks run on worker threads (`--workers`,
`bertfast.workers`), or a pool of them on a Ray cluster (`--ray`). SIGINT
and SIGTERM stop it between shard commits (`signals`): a message, exit status 128 + the signal.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import signal
import sys

from bertfast.precision import PRECISIONS, load_ranges, quantize_embeddings
from bertfast.profiling import profile, stage, timed_iter
from bertfast.ray import BATCH_TOKENS, WORKER_BATCH_TOKENS, worker_batch_tokens

from . import signals
from .readers import InputError, count_rows, find_inputs, read_rows
from .writer import OutputError, ShardWriter

# Texts a worker thread takes at a time (--workers > 1): enough for token batches of --batch-tokens, few enough
# that the workers finish a shard together.
WORKER_CHUNK = 256


def add_arguments(p):
    p.add_argument("input", help="a .txt/.jsonl/.csv/.parquet file, a directory of them, or a glob")
    p.add_argument("output", help="a directory (Parquet shards + _manifest.json) or a FILE.npy")
    p.add_argument("--model", default=None, help="model directory (default: the embedded all-MiniLM-L6-v2)")
    p.add_argument("--column", default="text", help="text column of .jsonl/.csv/.parquet inputs (default text)")
    p.add_argument("--id-column", default=None, help="column carried through as the id (default: the row's "
                   "0-based position among all input rows)")
    p.add_argument("--keep-text", action="store_true", help="store the text next to its embedding (Parquet)")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) every text runs "
                        "through, as Encoder.encode(texts, adapter=...); loaded by each worker and Ray actor")
    p.add_argument("--dtype", default=None, help="fp32, bf16, int8, or auto (default: the checkpoint's)")
    p.add_argument("--backend", default="auto", help="backend: auto, cpu, torch, triton (default auto)")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help=f"padded tokens per forward (default {BATCH_TOKENS}; on each of several workers by dtype: "
                        + ", ".join(f"{k} {v}" for k, v in WORKER_BATCH_TOKENS.items()) + ")")
    p.add_argument("--workers", type=int, default=None,
                   help="threads that each embed their own batches on a share of the cores (default: one per "
                        "torch thread, up to 8, on a CPU; 1: each batch on all the cores in turn). Not with --ray")
    p.add_argument("--pooling", default=None, help="pooling mode(s), comma-separated: cls, mean, max, "
                   "mean_sqrt_len_tokens, weightedmean, lasttoken (default: the model's configuration)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="unit-length vectors (default: the model's configuration)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-name", default=None, help="a prompt configured by the model (e.g. query)")
    prompt.add_argument("--prompt", default=None, help="text prepended to every input text")
    p.add_argument("--truncate-dim", type=int, default=None, help="keep the first N dimensions")
    p.add_argument("--precision", default="float32", choices=PRECISIONS,
                   help="store the vectors quantized as sentence-transformers' quantize_embeddings does "
                        "(default float32); int8 and uint8 need --ranges")
    p.add_argument("--ranges", default=None, metavar="FILE.npy",
                   help="int8/uint8: the (2, D) per-dimension minimum and maximum, computed once on a sample "
                        "(numpy.save(FILE, bertfast.quantization_ranges(sample_embeddings)))")
    p.add_argument("--shard-rows", type=int, default=10000, help="embedded rows per output shard (default 10000)")
    p.add_argument("--resume", action="store_true", help="finish an interrupted run into the same OUTPUT")
    p.add_argument("--strict", action="store_true", help="stop at the first bad row instead of counting it")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr: texts/s, tokens/s, ETA (default: on a terminal)")
    p.add_argument("--profile", nargs="?", const="-", default=None, metavar="FILE.json",
                   help="print where the time goes at the end (read, tokenize, each op of the forward with each "
                        "GEMM's GFLOP/s, pooling, write); with FILE.json also write it there. In this process only "
                        "(not with --ray)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="embed on a Ray cluster: 'auto', an address, or none for a local cluster")
    p.add_argument("--ray-actors", type=int, default=None, help="embedding actors (default: cluster CPUs "
                   "divided by --ray-cpus-per-actor)")
    p.add_argument("--ray-cpus-per-actor", type=int, default=1, help="CPUs (torch threads) per actor (default 1)")


def _fail(message: str, code: int = 2) -> int:
    print(f"bertfast embed: error: {message}", file=sys.stderr)
    return code


def _check_args(args, files: list[str]) -> str | None:
    for name in ("batch_tokens", "workers", "shard_rows", "ray_actors", "ray_cpus_per_actor", "truncate_dim"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {value}"
    if args.output.endswith(".npy") and (args.id_column or args.keep_text):
        return "--id-column and --keep-text need Parquet output (a directory): a .npy holds embeddings only"
    if args.id_column and any(f.endswith(".txt") for f in files):
        return ".txt inputs have no columns: --id-column needs .jsonl, .csv or .parquet inputs"
    if args.pooling is not None:
        from bertfast.sentence import pooling_modes

        try:
            args.pooling = pooling_modes([m.strip() for m in args.pooling.split(",")])
        except ValueError as e:
            return str(e)
    if args.precision in ("int8", "uint8") and args.ranges is None:
        return (f"--precision {args.precision} needs --ranges FILE.npy: a corpus embedded in shards cannot take "
                "its quantization ranges from itself (compute them once on a sample: "
                "numpy.save(FILE, bertfast.quantization_ranges(embeddings)))")
    if args.ranges is not None and args.precision not in ("int8", "uint8"):
        return f"--ranges applies to --precision int8 or uint8, not {args.precision}"
    if args.workers is not None and args.ray is not None:
        return "--workers sets this process's threads: with --ray, size the actors (--ray-cpus-per-actor)"
    if args.profile is not None and args.ray is not None:
        return "--profile times the stages in this process: it cannot see into Ray actors (leave out --ray)"
    if os.path.isfile(args.output) and not args.output.endswith(".npy"):
        return f"OUTPUT {args.output} is a file: give a directory, or a path ending in .npy"
    if args.adapter is not None and not os.path.isdir(args.adapter):
        return (f"--adapter {args.adapter} is not a directory: give a PEFT LoRA directory (adapter_config.json + "
                "adapter_model.safetensors)")
    return None


def settings(args, files: list[str]) -> dict:
    """What decides the output's bytes: a --resume must match it (batch sizes and --ray do not)."""
    return {"model": os.path.abspath(args.model), "dtype": args.dtype, "backend": args.backend,
            "pooling": list(args.pooling) if args.pooling else None, "normalize": args.normalize,
            "prompt_name": args.prompt_name, "prompt": args.prompt, "truncate_dim": args.truncate_dim,
            "column": args.column, "id_column": args.id_column, "keep_text": args.keep_text,
            "shard_rows": args.shard_rows, "precision": args.precision,
            "ranges_sha256": _sha256(args.ranges) if args.ranges else None,
            "adapter": os.path.realpath(args.adapter) if args.adapter else None,
            "adapter_sha256": _adapter_sha256(args.adapter) if args.adapter else None,
            "inputs": [[os.path.abspath(f), os.path.getsize(f)] for f in files]}


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _adapter_sha256(directory: str) -> str:
    """One digest of the adapter's config and weights: an adapter retrained in place is another adapter."""
    from bertfast.adapters_peft import CONFIG_FILE, WEIGHTS_FILE

    files = [(name, os.path.join(directory, name)) for name in (CONFIG_FILE, WEIGHTS_FILE)]
    listing = "".join(f"{name} {_sha256(path) if os.path.isfile(path) else None}\n" for name, path in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def _load_ranges(path: str | None):
    """The --ranges array, or None; ValueError saying what is wrong with the file."""
    if path is None:
        return None
    try:
        return load_ranges(path)
    except ValueError as e:
        raise ValueError(f"--ranges {e}") from None


def _quantized(embed_chunks, precision: str, ranges):
    """embed_chunks with each chunk's vectors quantized (row by row the same whatever the chunk: binary needs no
    range, int8/uint8 use the fixed --ranges)."""
    if precision == "float32":
        return embed_chunks
    def quantized(emb):
        with stage("quantize output"):
            return quantize_embeddings(emb, precision, ranges)

    def quantized_chunks(chunks):
        inner = embed_chunks(chunks)
        try:
            for emb, tokens in inner:
                yield quantized(emb), tokens
        finally:
            close = getattr(inner, "close", None)  # now, not when collected (job.run)
            if close is not None:
                close()

    return quantized_chunks


class _Progress:
    writer = None  # the ShardWriter, once there is one: what an interrupted run has committed


def run(args) -> int:
    """Embed INPUT into OUTPUT; SIGINT (Ctrl-C) and SIGTERM stop it between shard commits (signals.py)."""
    progress = _Progress()
    with signals.catching():
        try:
            return _run(args, progress)
        except KeyboardInterrupt:  # signals.Interrupted, or a Ctrl-C that Ray's get re-raised as a plain one
            return _stopped(progress.writer)


def _stopped(writer) -> int:
    signum = signals.received() or signal.SIGINT
    name = signal.Signals(signum).name
    if writer is None:
        return _fail(f"interrupted by {name} before any shard was written", 128 + signum)
    rows = sum(shard["rows"] for shard in writer.shards.values())
    return _fail(f"interrupted by {name}: {len(writer.shards)} shard(s) ({rows} texts) are committed in "
                 f"{writer.directory}; run the same command with --resume to finish", 128 + signum)


@contextlib.contextmanager
def _profiled(args, embedder):
    """A running `bertfast.profile` of the embedder's encoder (None without --profile)."""
    if args.profile is None:
        yield None
        return
    import torch

    from bertfast.backends.cpu import isa

    enc = embedder.encoder
    where = f"tier {isa.active_cap()}, {torch.get_num_threads()} threads" if enc.device.type == "cpu" else str(
        enc.device)
    c = enc.config
    dtype = enc.quantize or str(enc.dtype).replace("torch.", "")
    label = (f"bertfast embed, {c.family} {c.num_hidden_layers} layers x {c.hidden_size}, {dtype}, {where}")
    with profile(enc, label=label) as prof:
        yield prof


def _run(args, progress: _Progress) -> int:
    import bertfast
    from bertfast.ray import Embedder
    from bertfast.workers import ordered_map, plan

    from . import cluster, job

    try:
        files = find_inputs(args.input)
    except InputError as e:
        return _fail(str(e))
    problem = _check_args(args, files)
    if problem:
        return _fail(problem)
    try:
        args.model = args.model or bertfast.default_model_path()
    except RuntimeError as e:
        return _fail(str(e))
    options = dict(model=args.model, dtype=args.dtype, backend=args.backend, column=args.column,
                   batch_tokens=args.batch_tokens or BATCH_TOKENS, pooling=args.pooling, normalize=args.normalize,
                   prompt_name=args.prompt_name, prompt=args.prompt, truncate_dim=args.truncate_dim,
                   adapter=os.path.abspath(args.adapter) if args.adapter else None)
    pool = None
    try:
        run_settings = settings(args, files)  # before the adapter loads: its digest is of the files it loads
        if args.ray is None:
            # Worker threads take whole chunks (tokenizing them too), each chunk's batches on the worker's cores.
            embedder = Embedder(**options, workers=1)
            workers, threads = plan(embedder.encoder.device, sys.maxsize, args.workers, embedder.encoder.backend)
            chunk, takers = (job.CHUNK, 1) if workers == 1 else (WORKER_CHUNK, workers)
            if workers > 1 and args.batch_tokens is None:
                embedder.options["batch_tokens"] = worker_batch_tokens(embedder.encoder)
            embed_chunks = lambda chunks: ordered_map(embedder.embed, chunks, workers, threads)  # noqa: E731
            rows = read_rows(files, args.column, args.id_column)
        else:
            ray = cluster.connect(args.ray)
            signals.install()  # ray.init sets its own SIGTERM handler
            pool = embed_chunks = cluster.ActorPool(ray, options, args.ray_actors, args.ray_cpus_per_actor)
            counted = cluster.count_all_rows(ray, files)  # on the cluster while the actors load their model
            pool.ready()  # a model or adapter the actors cannot load fails here, before OUTPUT is created
            chunk, takers = job.CHUNK, 1
            rows = cluster.read_rows_on(ray, files, args.column, args.id_column)
        embed_chunks = _quantized(embed_chunks, args.precision, _load_ranges(args.ranges))
        progress.writer = writer = ShardWriter(args.output, run_settings, resume=args.resume)
    except (OutputError, ValueError, RuntimeError, OSError) as e:  # LoadError, ConfigError are ValueErrors
        if pool is not None:
            pool.close()
        return _fail(str(e))
    try:
        if writer.complete:
            print(f"{args.output}: already complete, nothing to do")
            return 0
        total = (sum(count_rows(f) for f in files) if args.ray is None else counted())
        adapter = f", adapter {run_settings['adapter']}" if args.adapter else ""
        print(f"embedding {len(files)} file(s) into {args.output} ({args.model}{adapter}, "
              f"{'Ray ' + args.ray if args.ray else 'this process'})", file=sys.stderr)
        # The model and the libraries are loaded: their objects (~200k: torch's, transformers', pyarrow's) leave
        # the cyclic collector's generations, which the run's allocations made it walk again and again
        # (benchmarks/results/embed-cpu/README.md); back in them after the run (finally), where a cycle among them can
        # be freed again.
        gc.freeze()
        with _profiled(args, embedder if args.ray is None else None) as prof:
            report = job.run(timed_iter(rows, "read") if prof else rows, writer, embed_chunks,
                             shard_rows=args.shard_rows, total=total, keep_text=args.keep_text, strict=args.strict,
                             use_row_ids=args.id_column is None, progress=args.progress, chunk_size=chunk,
                             workers=takers)
    except job.BadRow as e:
        return _fail(f"bad row (--strict): {e}", 1)
    finally:
        gc.unfreeze()
        rows.close()  # a Ray Data read stops here, not at exit
        if pool is not None:
            pool.close()
    print(report.summary())
    if prof:
        print(prof.table())
        if args.profile != "-":
            with open(args.profile, "w") as f:
                json.dump(prof.as_dict(), f, indent=1)
    if report.embedded + report.skipped == 0:
        return _fail("no texts to embed: every row was bad (see above)", 1)
    print(f"wrote {writer.finish()}")
    return 0

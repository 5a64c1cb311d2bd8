"""`bertfast bench`: bertfast against the engines users would pick instead, in one run.

Each provider (a named row: `bertfast-<backend>`, `hf-eager`, `hf-sdpa`, `onnxruntime`,
`torch-compile`, and the int8 rows `bertfast-int8`, `onnxruntime-int8`, `ctranslate2-int8`) is set up
once per dtype by `setup(provider, source, dtype)`, warmed up, then validated against the untouched
fp32 Hugging Face model on the real (unpadded) positions before any timing: a row whose output is
wrong is an error, never a number. Int8 rows (int8 GEMM operands, fp32 activations) run in the fp32
pass and are validated by the cosine of every real token's output with the reference instead of a
max-abs bound, which quantization error is not meant to meet. Timings are medians and p90
over repetitions interleaved round-robin across the providers of a workload, so the machine's
noise is shared, each provider built and run in a worker process of its own by default
(`bench_process`: libraries sharing a process slow each other's thread pools); tokens/s counts real
tokens only. A provider that is not installed or fails to
set up is reported as a skipped row with its reason.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from bertfast.backends.cpu import isa
from bertfast.tools.workloads import DEFAULT_WORKLOADS, QUICK_WORKLOADS, Batch, Workload

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FIXED_PROVIDERS = ("hf-eager", "hf-sdpa", "onnxruntime", "torch-compile", "bertfast-int8", "onnxruntime-int8",
                   "ctranslate2-int8")
BASELINE = "hf-sdpa"

# Max abs error allowed on real positions: ATOL[dtype] + 2 x the error of the Hugging Face eager
# model itself run in that dtype (the low-precision reference's own error). fp32 providers differ
# from the fp32 reference by ~1e-6 (reordered sums); a dropped bias or mask shows up at >= 1e-2.
ATOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# Int8 rows: the smallest cosine similarity between a real token's output and the fp32 reference's.
# A dropped bias, mask or zero point falls far below it (measured: bertfast int8 >= 0.999 on random
# BERT-base; ONNX Runtime int8 >= 0.99).
INT8_MIN_COSINE = 0.98
# How a round isolates its providers: before each timed call, this many idle seconds, then one untimed
# call of the same provider. The providers' thread pools keep spinning after a call and would take the
# cores of whichever provider is timed next (measured here, CPU burnt by the process while idle after
# a call: torch's OpenMP workers ~8 ms, ONNX Runtime's intra-op threads 40-60 ms, CTranslate2's none;
# back to back with no pause, ONNX Runtime's spinning made the OpenMP providers timed after it 1.5-2.6x
# slower at BERT-base b1 x s16 on 2 cores). After the pause they are asleep. The untimed call then wakes
# this provider's own threads and caches, so the timed call runs as in back-to-back serving of that
# provider alone, whatever ran before it (a pause alone would make every call pay its pool's wake-up
# and a cold cache).
SETTLE_S = 0.1
# A provider whose call takes longer than this (after its first) gets no extra warm-up call and no
# untimed call before its timed ones: thread wake-up and cold caches cost milliseconds, noise for such a
# call, and each extra call would add seconds to the row (portable int8 BERT-base b8 x s128: ~5 s a call;
# first, validation and 3 timed calls keep the row near 25 s).
SLOW_CALL_S = 1.0
# Where providers run: each in a worker process of its own (bench_process explains why), or all in
# this one.
ISOLATIONS = ("process", "none")


class ProviderSkipped(Exception):
    """A provider cannot run here (not installed, unsupported dtype or device); the message says why."""


# ----------------------------------------------------------------------------------------------
# The model under test


@dataclass
class Source:
    """The model all providers run. `reference` is fp32, eager attention, and never exported,
    compiled or cast: providers work on deep copies of it."""

    label: str
    config: object  # bertfast.ModelConfig
    reference: torch.nn.Module
    model_dir: str | None = None
    device: str = "cpu"
    spec: dict | None = None  # load_source's arguments: how a worker process rebuilds this source

    def hf_copy(self, attn_implementation: str, dtype: torch.dtype) -> torch.nn.Module:
        model = copy.deepcopy(self.reference)
        model.set_attn_implementation(attn_implementation)
        return model.to(device=self.device, dtype=dtype).eval()


def load_source(model_dir: str | None = None, config_name: str | None = None, device: str = "cpu",
                seed: int = 0, label: str | None = None) -> Source:
    """The reference model: a checkpoint directory, or random weights of a named config."""
    from bertfast.tools import workloads
    from bertfast.config import ModelConfig

    spec = {"model_dir": model_dir, "config_name": config_name, "device": device, "seed": seed, "label": label}
    if config_name is not None:
        model = workloads.random_hf_model(config_name, seed, attn_implementation="eager")
        return Source(f"random {config_name} (seed {seed})", workloads.model_config(config_name),
                      model.to(device), None, device, spec)
    from transformers import BertModel

    if not os.path.isdir(model_dir):
        raise ValueError(f"--model {model_dir}: not a directory")
    model = BertModel.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    return Source(label or _dir_label(model_dir), ModelConfig.from_json(model_dir), model.eval().to(device),
                  model_dir, device, spec)


def _dir_label(model_dir: str) -> str:
    # Packaged checkpoints often sit in a directory called "model": name the parent instead.
    parts = [p for p in os.path.normpath(os.path.abspath(model_dir)).split(os.sep) if p]
    while len(parts) > 1 and parts[-1] in ("model", "snapshots") or (parts and len(parts[-1]) == 40
                                                                       and parts[-1].isalnum()):
        parts.pop()
    return parts[-1] if parts else model_dir


# ----------------------------------------------------------------------------------------------
# Providers


@dataclass
class Provider:
    """A ready-to-time provider: `fn(batch)` returns last_hidden_state (B, S, H) on the device."""

    name: str
    dtype: torch.dtype
    fn: Callable[[Batch], torch.Tensor]
    build_s: float = 0.0
    info: dict = field(default_factory=dict)


def _bertfast_factory(backend: str):
    def factory(source: Source, dtype: torch.dtype) -> Provider:
        from bertfast.encoder import Encoder
        from bertfast.loading import load_hf_model, load_pretrained

        t0 = time.perf_counter()
        # From the checkpoint files when there are some (the user's path), else from the model.
        if source.model_dir is not None:
            weights = load_pretrained(source.model_dir, dtype)
        else:
            weights = load_hf_model(source.reference, dtype)
        enc = Encoder(weights.to(device=source.device), backend=backend, model_dir=source.model_dir)
        build = time.perf_counter() - t0

        def fn(b: Batch):
            return enc(b.input_ids, b.attention_mask, b.token_type_ids).last_hidden_state

        return Provider(f"bertfast-{backend}", dtype, fn, build, {"backend": enc.backend})

    return factory


def _hf_factory(attn: str):
    def factory(source: Source, dtype: torch.dtype) -> Provider:
        t0 = time.perf_counter()
        model = source.hf_copy(attn, dtype)
        build = time.perf_counter() - t0

        @torch.inference_mode()
        def fn(b: Batch):
            return model(**b.inputs()).last_hidden_state

        return Provider(f"hf-{attn}", dtype, fn, build)

    return factory


class _LastHidden(torch.nn.Module):
    """Positional (input_ids, attention_mask, token_type_ids) -> last_hidden_state, for export."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state


def _export_onnx(source: Source, path: str, names: list[str]) -> None:
    """Plain torch.onnx.export of the reference (dynamic batch and sequence axes) to `path`."""
    from bertfast.tools.workloads import make_batch

    cfg = source.config
    # torch.onnx.export (torch 2.13, transformers 5) leaves the exported module changed: export a
    # deep copy so the reference and the other providers keep the original.
    wrapper = _LastHidden(copy.deepcopy(source.reference).eval())
    # A sample with one padded row so the traced graph keeps the general masking path.
    sample = make_batch(2, 16, [16, 9], vocab_size=cfg.vocab_size, type_vocab_size=cfg.type_vocab_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(
                wrapper, (sample.input_ids, sample.attention_mask, sample.token_type_ids), path,
                input_names=names, output_names=["last_hidden_state"],
                dynamic_axes={n: {0: "batch", 1: "seq"} for n in names + ["last_hidden_state"]},
                opset_version=17, dynamo=False,
            )
        except Exception as e:
            raise ProviderSkipped(f"torch.onnx.export failed: {type(e).__name__}: {e}") from None


def _onnxruntime_factory(source: Source, dtype: torch.dtype) -> Provider:
    try:
        import onnx  # noqa: F401  (the exporter and the optimizer need it)
        import onnxruntime as ort
        from onnxruntime.transformers import optimizer
    except ImportError as e:
        raise ProviderSkipped(f"not installed ({e.name}): pip install onnxruntime onnx") from None

    cfg = source.config
    t0 = time.perf_counter()
    names = ["input_ids", "attention_mask", "token_type_ids"]
    with tempfile.TemporaryDirectory(prefix="bertfast-bench-") as tmp:
        raw, opt = os.path.join(tmp, "model.onnx"), os.path.join(tmp, "model.opt.onnx")
        _export_onnx(source, raw, names)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimized = optimizer.optimize_model(raw, model_type="bert", num_heads=cfg.num_attention_heads,
                                                 hidden_size=cfg.hidden_size)
            fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
            optimized.save_model_to_file(opt)
        fn = _ort_forward(ort, opt, names)
    build = time.perf_counter() - t0
    return Provider("onnxruntime", dtype, fn, build, {"fused_ops": fused, "opset": 17})


def _ort_forward(ort, path: str, names: list[str]):
    """An ONNX Runtime CPU session on the model at `path` (loaded now), as a Batch -> last_hidden_state."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])

    def fn(b: Batch):
        feeds = {n: t.numpy() for n, t in zip(names, (b.input_ids, b.attention_mask, b.token_type_ids))}
        return torch.from_numpy(session.run(["last_hidden_state"], feeds)[0])

    return fn


def _bertfast_int8_factory(source: Source, dtype: torch.dtype) -> Provider:
    from bertfast.encoder import Encoder
    from bertfast.loading import load_hf_model, load_pretrained

    t0 = time.perf_counter()
    weights = (load_pretrained(source.model_dir, torch.float32) if source.model_dir is not None
               else load_hf_model(source.reference, torch.float32))
    enc = Encoder(weights.to(device=source.device), backend="cpu", model_dir=source.model_dir, quantize="int8")
    build = time.perf_counter() - t0

    def fn(b: Batch):
        return enc(b.input_ids, b.attention_mask, b.token_type_ids).last_hidden_state

    return Provider("bertfast-int8", dtype, fn, build, {"backend": enc.backend, "quantized": "int8"})


def _onnxruntime_int8_factory(source: Source, dtype: torch.dtype) -> Provider:
    try:
        import onnx  # noqa: F401
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError as e:
        raise ProviderSkipped(f"not installed ({e.name}): pip install onnxruntime onnx") from None
    import logging

    t0 = time.perf_counter()
    names = ["input_ids", "attention_mask", "token_type_ids"]
    with tempfile.TemporaryDirectory(prefix="bertfast-bench-") as tmp:
        raw, q8 = os.path.join(tmp, "model.onnx"), os.path.join(tmp, "model.int8.onnx")
        _export_onnx(source, raw, names)
        # quantize_dynamic works on the plain export (not on the transformers-optimized graph);
        # defaults as a user would call it: int8 weights per tensor, uint8 activations per tensor.
        level = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)  # its "consider pre-processing" warning
        try:
            quantize_dynamic(raw, q8, weight_type=QuantType.QInt8)
        finally:
            logging.getLogger().setLevel(level)
        fn = _ort_forward(ort, q8, names)
    build = time.perf_counter() - t0
    return Provider("onnxruntime-int8", dtype, fn, build,
                    {"quantized": "int8", "scheme": "quantize_dynamic, QInt8 weights per tensor"})


def _ctranslate2_int8_factory(source: Source, dtype: torch.dtype) -> Provider:
    try:
        import ctranslate2
        import numpy as np
    except ImportError:
        raise ProviderSkipped("not installed (ctranslate2): pip install ctranslate2") from None
    import contextlib
    import io

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bertfast-bench-") as tmp:
        hf_dir, ct2_dir = os.path.join(tmp, "hf"), os.path.join(tmp, "ct2")
        with contextlib.redirect_stderr(io.StringIO()):  # save_pretrained's and the converter's progress bars
            source.reference.save_pretrained(hf_dir)
            # Its BERT converter reads position_embedding_type, which transformers 5 may leave out.
            cfg_path = os.path.join(hf_dir, "config.json")
            with open(cfg_path) as f:
                cfg = json.load(f)
            cfg.setdefault("position_embedding_type", "absolute")
            with open(cfg_path, "w") as f:
                json.dump(cfg, f)
            ctranslate2.converters.TransformersConverter(hf_dir).convert(ct2_dir, quantization="int8")
        # The encoder reads the whole model at construction; the directory can go afterwards.
        encoder = ctranslate2.Encoder(ct2_dir, device="cpu", compute_type="int8",
                                      intra_threads=torch.get_num_threads())
    build = time.perf_counter() - t0

    def fn(b: Batch):
        ids = ctranslate2.StorageView.from_array(b.input_ids.to(torch.int32).numpy())
        lengths = ctranslate2.StorageView.from_array(b.attention_mask.sum(1).to(torch.int32).numpy())
        out = encoder.forward_batch(ids, lengths, b.token_type_ids.tolist())
        return torch.from_numpy(np.asarray(out.last_hidden_state))

    return Provider("ctranslate2-int8", dtype, fn, build,
                    {"quantized": "int8", "scheme": f"ctranslate2 {ctranslate2.__version__} converter "
                                                    "quantization=int8, compute_type=int8"})


def _torch_compile_factory(source: Source, dtype: torch.dtype) -> Provider:
    import torch._dynamo
    import torch._inductor.config as inductor_config

    t0 = time.perf_counter()
    model = source.hf_copy("sdpa", dtype)
    if source.device == "cpu":
        # Freezing folds the weights into the graph as constants (and lets oneDNN prepack them).
        inductor_config.freezing = True
    # Each new shape/dtype recompiles; without a higher limit dynamo falls back to eager silently.
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
    compiled = torch.compile(model)
    build = time.perf_counter() - t0

    @torch.no_grad()
    def fn(b: Batch):
        return compiled(**b.inputs()).last_hidden_state

    return Provider("torch-compile", dtype, fn, build,
                    {"freezing": bool(inductor_config.freezing), "note": "compiles on first call per shape"})


# Fixed providers; `bertfast-<backend>` names are added from the backend registry.
FACTORIES: dict[str, Callable[[Source, torch.dtype], Provider]] = {
    "hf-eager": _hf_factory("eager"),
    "hf-sdpa": _hf_factory("sdpa"),
    "onnxruntime": _onnxruntime_factory,
    "torch-compile": _torch_compile_factory,
    "bertfast-int8": _bertfast_int8_factory,
    "onnxruntime-int8": _onnxruntime_int8_factory,
    "ctranslate2-int8": _ctranslate2_int8_factory,
}


def _factory(name: str):
    if name in FACTORIES:
        return FACTORIES[name]
    if name.startswith("bertfast-"):
        return _bertfast_factory(name[len("bertfast-"):])
    raise ValueError(f"unknown provider {name!r}; known: {', '.join(known_providers())}")


def known_providers() -> list[str]:
    from bertfast.backends import REGISTRY

    return [f"bertfast-{b}" for b in REGISTRY] + list(FACTORIES)


INT8_PROVIDERS = ("bertfast-int8", "onnxruntime-int8", "ctranslate2-int8")


def check_runnable(provider: str, source: Source, dtype: torch.dtype) -> None:
    """The reasons `provider` cannot run that need no build (dtype, device, backend availability):
    raises ProviderSkipped. `setup` checks them first; run_bench also before spawning a worker."""
    from bertfast import available_backends

    if provider in INT8_PROVIDERS and dtype != torch.float32:
        raise ProviderSkipped("int8 rows run in the fp32 pass (int8 GEMM operands, fp32 activations)")
    if provider in ("onnxruntime", "onnxruntime-int8", "ctranslate2-int8") and source.device != "cpu":
        raise ProviderSkipped("only the CPU device is wired in this bench")
    if provider == "onnxruntime" and dtype != torch.float32:
        raise ProviderSkipped("fp32 only on CPU (ONNX Runtime's fused BERT kernels are fp32 on CPU, "
                              "fp16 on GPU)")
    if provider.startswith("bertfast-"):
        backend = "cpu" if provider == "bertfast-int8" else provider[len("bertfast-"):]
        reason = available_backends(source.device).get(backend, f"unknown backend {backend!r}")
        if reason is not None:
            raise ProviderSkipped(reason)


def setup(provider: str, source: Source, dtype: torch.dtype) -> Provider:
    """Build `provider` for `source` in `dtype`. Raises ProviderSkipped(reason) if it cannot run."""
    factory = _factory(provider)
    check_runnable(provider, source, dtype)
    try:
        return factory(source, dtype)
    except ProviderSkipped:
        raise
    except Exception as e:  # a set-up failure is reported as a skipped row with its reason
        raise ProviderSkipped(f"set-up failed: {type(e).__name__}: {e}") from e


def default_providers(device: str) -> tuple[list[str], dict[str, str]]:
    """(providers to run, {provider: reason} for bertfast backends skipped by default)."""
    from bertfast.backends import REGISTRY

    names, skipped = [], {}
    for backend in REGISTRY:
        name = f"bertfast-{backend}"
        if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            skipped[name] = ("Triton runs in its interpreter on CPU (TRITON_INTERPRET=1): a correctness "
                             "tool, far too slow to time; name it in --providers to force")
        else:
            names.append(name)  # unavailable ones become skipped rows with the registry's reason
    return names + list(FIXED_PROVIDERS), skipped


# ----------------------------------------------------------------------------------------------
# Measuring


class PeakMemory:
    """Peak extra memory of the code in the `with` block, in MB (None when it cannot be measured).

    CPU: resets the kernel's RSS high-water mark (/proc/self/clear_refs) after returning freed heap
    pages (malloc_trim), so re-used allocator memory counts again. Allocators that keep their own
    pool across calls (ONNX Runtime's arena) only show growth. CUDA: torch's allocator peak.
    """

    def __init__(self, device: str):
        self.device, self.mb = device, None

    @staticmethod
    def _status_kb(field_name):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
        raise OSError(f"{field_name} not in /proc/self/status")

    def __enter__(self):
        self._base = None
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        try:
            gc.collect()
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):
                pass
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = self._status_kb("VmRSS")
        except OSError:
            self._base = None
        return self

    def __exit__(self, *exc):
        if self._base is None:
            return False
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.mb = (torch.cuda.max_memory_allocated() - self._base) / 2**20
        else:
            try:
                self.mb = max(0, self._status_kb("VmHWM") - self._base) / 1024
            except OSError:
                self.mb = None
        return False


def time_call(fn, batch: Batch, device: str) -> tuple[float, torch.Tensor]:
    """Seconds for one call (CUDA: event timing around a synchronised call), and the output."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        out = fn(batch)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3, out
    t0 = time.perf_counter()
    out = fn(batch)
    return time.perf_counter() - t0, out


def max_error(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    """Max abs difference on real positions (mask (B, S) 1 = real); inf for a shape mismatch or NaN."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    real = mask.bool().to(out.device)
    diff = (out.float() - ref.to(out.device).float())[real]
    if not bool(torch.isfinite(diff).all()):
        return float("inf")
    return float(diff.abs().max()) if diff.numel() else 0.0


def min_token_cosine(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    """Smallest cosine similarity between out and ref (B, S, H) over real positions (mask 1); -1 for
    a shape mismatch or a non-finite output."""
    if tuple(out.shape) != tuple(ref.shape) or not bool(torch.isfinite(out).all()):
        return -1.0
    real = mask.bool().to(out.device)
    cos = torch.nn.functional.cosine_similarity(out[real].double(), ref.to(out.device)[real].double(), dim=-1)
    return float(cos.min()) if cos.numel() else 1.0


def reference_output(source: Source, batch: Batch) -> torch.Tensor:
    """last_hidden_state (B, S, H) fp32 of the untouched fp32 eager reference model."""
    with torch.inference_mode():
        return source.reference(**batch.inputs()).last_hidden_state.float()


def tolerance(source: Source, batch: Batch, ref: torch.Tensor, dtype: torch.dtype,
              lowp_models: dict | None = None) -> float:
    """Max abs error a provider in `dtype` may show on `batch`: ATOL[dtype] plus twice the error
    of the reference model itself run in `dtype` (cached in `lowp_models` by dtype)."""
    if dtype == torch.float32:
        return ATOL[dtype]
    lowp_models = {} if lowp_models is None else lowp_models
    if dtype not in lowp_models:
        lowp_models[dtype] = source.hf_copy("eager", dtype)
    with torch.inference_mode():
        own = max_error(lowp_models[dtype](**batch.inputs()).last_hidden_state, ref, batch.attention_mask)
    return ATOL[dtype] + 2 * own


def _quantile(xs, q):
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Row:
    workload: str
    batch: int
    seqlen: int
    lengths: str
    real_tokens: int
    provider: str
    dtype: str
    status: str  # "ok" | "skipped" | "error"
    reason: str = ""
    ms_median: float | None = None
    ms_p90: float | None = None
    ms_min: float | None = None
    repeats: int = 0
    times_ms: list = field(default_factory=list)
    tokens_per_s: float | None = None
    speedup_vs_hf_sdpa: float | None = None
    max_abs_err: float | None = None
    tolerance: float | None = None
    peak_mem_mb: float | None = None
    build_s: float | None = None
    warmup_s: float | None = None
    info: dict = field(default_factory=dict)


def _log(msg: str, progress) -> None:
    if progress is not None:
        print(msg, file=progress, flush=True)


def run_bench(source: Source, workloads, dtypes, providers, *, repeats: int = 10, min_repeats: int = 3,
              budget_s: float = 60.0, warmup: int = 1, seed: int = 0, progress=sys.stderr,
              preskipped: dict | None = None, settle_s: float = SETTLE_S,
              isolation: str = "process") -> list[Row]:
    """Run every (workload, dtype, provider); returns one Row each, ordered workload, dtype, provider.

    Per workload and dtype: each provider is set up (once per dtype), warmed up (first call timed
    as set-up), checked against the fp32 reference on real positions (peak memory measured on
    that call), then timed over `repeats` rounds (fewer, at least `min_repeats`, when one round
    would overrun `budget_s`), each round calling every valid provider once in rotated order, each
    timed call preceded by `settle_s` seconds idle and one untimed call (see SETTLE_S; 0: neither).
    isolation: "process" builds and runs each provider in a worker process of its own (see
    bench_process; needs `source.spec`), "none" in this process.
    """
    from bertfast.tools.bench.process import Local, Worker

    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    if isolation == "process" and source.spec is None:
        raise ValueError("isolation='process' needs a source made by load_source (source.spec)")
    device = source.device
    preskipped = dict(preskipped or {})
    rows: dict[tuple, Row] = {}
    refs: dict[str, tuple[Batch, torch.Tensor]] = {}
    n_steps = len(workloads) * len(dtypes)
    step = 0
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        built: dict[str, Provider | str] = {}
        lowp_models: dict = {}
        for wl in workloads:
            step += 1
            tag = f"[bench {step}/{n_steps}] {wl.name} {dtype_name}"
            if wl.name not in refs:
                batch = wl.make_batch(source.config, seed).to(device)
                _log(f"{tag}: fp32 reference (hf eager)", progress)
                refs[wl.name] = (batch, reference_output(source, batch))
            batch, ref = refs[wl.name]
            tol = tolerance(source, batch, ref, dtype, lowp_models)

            def new_row(name, status, reason="", **kw):
                row = Row(wl.name, wl.batch, wl.seqlen, wl.lengths, batch.real_tokens, name, dtype_name,
                          status, reason, tolerance=tol, **kw)
                rows[(wl.name, dtype_name, name)] = row
                return row

            active: list[tuple[Provider, Row, float]] = []  # with its validation call's seconds
            for name in providers:
                if name in preskipped:
                    new_row(name, "skipped", preskipped[name])
                    continue
                build_s = None
                if name not in built:
                    where = " in a worker process" if isolation == "process" else ""
                    _log(f"{tag}: set up {name}{where}", progress)
                    try:
                        if isolation == "process":
                            check_runnable(name, source, dtype)
                            built[name] = Worker(source.spec, name, dtype_name, device)
                        else:
                            built[name] = Local(setup(name, source, dtype), device)
                        build_s = built[name].build_s
                    except ProviderSkipped as e:
                        built[name] = str(e)
                if isinstance(built[name], str):
                    new_row(name, "skipped", built[name])
                    _log(f"{tag}: {name} skipped: {built[name]}", progress)
                    continue
                prov = built[name]
                row = new_row(name, "error", build_s=build_s, info=dict(prov.info))
                _log(f"{tag}: warm up and validate {name}", progress)
                try:
                    prov.load(batch)
                    t_first = prov.call()[0]
                    for _ in range(warmup if t_first <= SLOW_CALL_S else 0):
                        prov.call()
                    row.warmup_s = t_first
                    t_call, out, row.peak_mem_mb = prov.call(measure_memory=True)
                    err = max_error(out, ref, batch.attention_mask)
                except Exception as e:
                    row.reason = f"failed while running: {type(e).__name__}: {e}"
                    _log(f"{tag}: {name} ERROR: {row.reason}", progress)
                    continue
                row.max_abs_err = err
                if prov.info.get("quantized"):
                    cos = min_token_cosine(out, ref, batch.attention_mask)
                    row.info["min_token_cosine"] = cos
                    row.tolerance = None
                    if not cos >= INT8_MIN_COSINE:
                        row.reason = (f"wrong output: a real token's cosine with the fp32 reference is "
                                      f"{cos:.4f} < {INT8_MIN_COSINE}; not timed")
                        _log(f"{tag}: {name} ERROR: {row.reason}", progress)
                        continue
                elif not err <= tol:
                    row.reason = (f"wrong output: max abs error {err:.3g} on real positions exceeds "
                                  f"{tol:.3g} (vs the fp32 reference); not timed")
                    _log(f"{tag}: {name} ERROR: {row.reason}", progress)
                    continue
                active.append((prov, row, t_call))

            if not active:
                continue
            # Round length from each provider's validation call, so the budget bounds the slowest
            # workloads; with a settle pause, fast providers also make an untimed call (SLOW_CALL_S).
            round_s = sum(t * (2 if settle_s > 0 and t <= SLOW_CALL_S else 1) + settle_s for _, _, t in active)
            reps = max(min_repeats, min(repeats, int(budget_s / max(round_s, 1e-9))))
            _log(f"{tag}: timing {reps} interleaved rounds x {len(active)} providers "
                 f"(~{reps * round_s:.0f} s)", progress)
            gc.collect()
            gc_was_enabled = gc.isenabled()
            gc.disable()  # a collection inside a timed call would charge one provider for all
            try:
                for r in range(reps):
                    k = r % len(active)
                    for prov, row, t_call in active[k:] + active[:k]:
                        try:
                            dt = prov.timed(settle_s, untimed_call=t_call <= SLOW_CALL_S)
                        except Exception as e:
                            row.reason = f"failed while timing: {type(e).__name__}: {e}"
                            continue
                        row.times_ms.append(dt * 1e3)
            finally:
                if gc_was_enabled:
                    gc.enable()
            for prov, row, _ in active:
                if row.reason:
                    continue
                row.status = "ok"
                row.repeats = len(row.times_ms)
                row.ms_median = _quantile(row.times_ms, 0.5)
                row.ms_p90 = _quantile(row.times_ms, 0.9)
                row.ms_min = min(row.times_ms)
                row.tokens_per_s = batch.real_tokens / (row.ms_median / 1e3)
        for handle in built.values():
            if not isinstance(handle, str):
                handle.close()
        del built, lowp_models
        gc.collect()

    out = []
    for wl in workloads:
        for dtype_name in dtypes:
            base = rows.get((wl.name, dtype_name, BASELINE))
            for name in providers:
                row = rows.get((wl.name, dtype_name, name))
                if row is None:
                    continue
                if row.status == "ok" and base is not None and base.status == "ok":
                    row.speedup_vs_hf_sdpa = base.ms_median / row.ms_median
                out.append(row)
    return out


# ----------------------------------------------------------------------------------------------
# Reporting


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat, or None where there is none. Steal is time the
    hypervisor gave this virtual machine's CPUs to someone else: on a shared host it inflates every
    timing, and OpenMP's fork-join (which waits for its slowest thread) more than most."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    return fields[7], sum(fields[:8])


def steal_fraction(before, after) -> float | None:
    """Share of CPU time stolen by the hypervisor between two `cpu_ticks()` readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def environment(device: str) -> dict:
    """Machine, library versions and thread counts, for the JSON report."""
    import importlib

    from bertfast import __version__

    cpu, flags = isa.proc_cpuinfo()
    cpu = cpu or platform.processor()
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            mem_gb = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    versions = {"python": platform.python_version(), "bertfast": __version__, "torch": torch.__version__}
    for mod in ("transformers", "onnxruntime", "onnx", "triton", "numpy", "matplotlib"):
        try:
            versions[mod] = importlib.import_module(mod).__version__
        except Exception:
            versions[mod] = None
    machine = {
        "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "isa": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"}),
        "cpu_info": isa.cpu_info(),  # the ISA tier the kernels ran (and the libraries' caps)
        "memory_gb": mem_gb, "torch_threads": torch.get_num_threads(), "device": device,
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    if device.startswith("cuda"):
        machine["gpu"] = torch.cuda.get_device_name(device)
    return {"machine": machine, "versions": versions}


def _fmt(x, spec, missing="-"):
    return missing if x is None else format(x, spec)


def format_table(rows: list[Row]) -> str:
    """The printed results table (one line per row; skipped and error rows carry their reason)."""
    header = ("workload", "provider", "dtype", "ms med", "ms p90", "tokens/s", "vs sdpa", "max err",
              "peak MB", "setup s")
    lines = []
    for r in rows:
        if r.status != "ok":
            lines.append((r.workload, r.provider, r.dtype, f"{r.status.upper()}: {r.reason}"))
            continue
        setup_s = (r.build_s or 0.0) + (r.warmup_s or 0.0)
        lines.append((r.workload, r.provider, r.dtype, _fmt(r.ms_median, ".2f"), _fmt(r.ms_p90, ".2f"),
                      _fmt(r.tokens_per_s, ",.0f"),
                      _fmt(r.speedup_vs_hf_sdpa, ".2f") + ("x" if r.speedup_vs_hf_sdpa else ""),
                      _fmt(r.max_abs_err, ".1e"), _fmt(r.peak_mem_mb, ".0f"), f"{setup_s:.1f}"))
    full = [ln for ln in lines if len(ln) == len(header)]
    widths = [max([len(header[i])] + [len(ln[i]) for ln in full]) for i in range(len(header))]
    for i in range(3):
        widths[i] = max([widths[i]] + [len(ln[i]) for ln in lines])

    def render(cells):
        out = []
        for i, c in enumerate(cells):
            if len(cells) < len(header) and i == 3:
                out.append(c)
                break
            out.append(c.ljust(widths[i]) if i < 3 else c.rjust(widths[i]))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([render(header), sep] + [render(ln) for ln in lines])


def plot(rows: list[Row], path: str, title: str) -> str:
    """Bar chart of speedup vs hf-sdpa (same dtype), one panel per dtype, one bar group per
    workload, one bar per provider. Returns how it was drawn ('matplotlib' or 'built-in')."""
    dtypes = list(dict.fromkeys(r.dtype for r in rows))
    wls = list(dict.fromkeys(r.workload for r in rows))
    val = {(r.dtype, r.workload, r.provider): r.speedup_vs_hf_sdpa for r in rows if r.status == "ok"
           and r.speedup_vs_hf_sdpa is not None}
    # Providers with no timed row (skipped or failed everywhere) get no bar and no legend entry.
    provs = [p for p in dict.fromkeys(r.provider for r in rows)
             if p != BASELINE and any(k[2] == p for k in val)]
    if not val:
        raise ValueError(f"nothing to plot: no row has a speedup vs {BASELINE} (is {BASELINE} among the providers?)")
    panels = [(d, [[val.get((d, w, p)) for p in provs] for w in wls]) for d in dtypes]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _bar_chart_png(path, title, panels, wls, provs)
        return "built-in"
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.6 * len(wls)), 3.6 * len(panels)),
                             squeeze=False)
    width = 0.8 / max(1, len(provs))
    for ax, (d, groups) in zip(axes[:, 0], panels):
        for j, p in enumerate(provs):
            xs = [i + (j - (len(provs) - 1) / 2) * width for i in range(len(wls))]
            ys = [g[j] if g[j] is not None else 0.0 for g in groups]
            bars = ax.bar(xs, ys, width, label=p)
            for b, g in zip(bars, groups):
                if g[j] is not None:
                    ax.annotate(f"{g[j]:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(wls)), wls)
        ax.set_ylabel(f"speedup vs {BASELINE} ({d})")
        ax.legend(fontsize=8)
    axes[0, 0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


# ----------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser) -> None:
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--model", metavar="DIR", help="Hugging Face model directory (default: the embedded "
                   "all-MiniLM-L6-v2 checkpoint)")
    g.add_argument("--config", choices=("bert-base", "minilm", "tiny"),
                   help="random weights of a known shape instead of a checkpoint")
    parser.add_argument("--quick", action="store_true",
                        help=f"small grid ({', '.join(QUICK_WORKLOADS)}), up to 10 rounds, 20 s budget per workload")
    parser.add_argument("--workloads", help="comma list like b8xs128,b8xs128-uniform,b32xs128-short "
                        f"(default: {','.join(DEFAULT_WORKLOADS)})")
    parser.add_argument("--providers", help="comma list (default: every bertfast backend, "
                        f"{', '.join(FIXED_PROVIDERS)}); 'bertfast' means every bertfast backend")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16, fp16, or auto (what "
                        "dtype='auto' loads on this machine's tier) (default fp32,bf16)")
    parser.add_argument("--repeats", type=int, help="max timed rounds per workload and dtype (default 20, --quick 10)")
    parser.add_argument("--budget", type=float, help="seconds per workload and dtype that bound the "
                        "rounds, never below 3 (default 60, --quick 20)")
    parser.add_argument("--threads", type=int, help="intra-op threads for torch and ONNX Runtime")
    parser.add_argument("--settle-ms", type=float, default=SETTLE_S * 1e3,
                        help=f"idle ms, then one untimed call, before each timed call, so the providers do "
                        f"not slow each other down (default {SETTLE_S * 1e3:.0f}; 0: plain back-to-back rounds)")
    parser.add_argument("--isolation", choices=ISOLATIONS, default="process",
                        help="process (default): each provider is built and run in a worker process of its "
                        "own, as a user would serve it (libraries sharing a process slow each other's "
                        "thread pools); none: all in this process")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--isa", metavar="all|TIER,...", help="run the grid once per CPU ISA tier (portable, avx2, "
                        "avx512_vnni, amx), each in a child process with BERTFAST_ISA set: one table per tier, "
                        "one JSON with every tier's rows; tiers this CPU lacks are listed as skipped")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs and random weights")
    parser.add_argument("--json", metavar="F", help="write machine-readable results to F")
    parser.add_argument("--plot", metavar="F.png", help="write a speedup bar chart to F.png")


def _split(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def _parse(args):
    """Validated run settings from CLI args; raises ValueError with a message."""
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")
    wl_names = _split(args.workloads) if args.workloads else list(QUICK_WORKLOADS if args.quick else DEFAULT_WORKLOADS)
    workloads = list(dict.fromkeys(Workload.parse(w) for w in wl_names))
    if not workloads:
        raise ValueError("--workloads is empty")
    dtypes = list(dict.fromkeys(auto_dtype_name(device) if d == "auto" else d for d in _split(args.dtypes)))
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtypes: unknown dtype {d!r}; use {', '.join(DTYPES)}")
    if not dtypes:
        raise ValueError("--dtypes is empty")
    defaults, preskipped = default_providers(device)
    if args.providers:
        names = []
        for p in _split(args.providers):
            expanded = [n for n in defaults + list(preskipped) if n.startswith("bertfast-")] if p == "bertfast" else [p]
            for n in expanded:
                _factory(n)  # raises ValueError for an unknown name
                if n not in names:
                    names.append(n)
        preskipped = {k: v for k, v in preskipped.items() if k not in _split(args.providers)}
        providers = names
    else:
        providers = defaults + list(preskipped)
    repeats = args.repeats if args.repeats is not None else (10 if args.quick else 20)
    budget = args.budget if args.budget is not None else (20.0 if args.quick else 60.0)
    if args.settle_ms < 0:
        raise ValueError(f"--settle-ms must be >= 0, got {args.settle_ms:g}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    return device, workloads, dtypes, providers, preskipped, repeats, budget


def auto_dtype_name(device: str) -> str:
    """The DTYPES name of what dtype="auto" loads with backend "auto" on `device` (this process's tier)."""
    from bertfast.backends import get_backend

    auto = get_backend("auto", device).precision(torch.device(device).type).auto
    return next(name for name, dtype in DTYPES.items() if dtype == auto)


def run(args) -> int:
    if getattr(args, "isa", None):
        from bertfast.tools.bench import tiers as bench_tiers

        return bench_tiers.run(args)
    try:
        device, workloads, dtypes, providers, preskipped, repeats, budget = _parse(args)
    except ValueError as e:
        print(f"bertfast bench: {e}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        if args.config:
            source = load_source(config_name=args.config, device=device, seed=args.seed)
        else:
            from bertfast import default_model_path

            if args.model:
                source = load_source(model_dir=args.model, device=device)
            else:
                source = load_source(model_dir=default_model_path(), device=device,
                                     label="all-MiniLM-L6-v2 (embedded default)")
    except (ValueError, RuntimeError, OSError) as e:
        print(f"bertfast bench: cannot load the model: {e}", file=sys.stderr)
        return 2
    c = source.config
    print(f"bertfast bench: {source.label} (hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
          f"{c.num_attention_heads} heads) on {device}, {torch.get_num_threads()} threads; "
          f"{len(workloads)} workloads x {len(dtypes)} dtypes x {len(providers)} providers",
          file=sys.stderr, flush=True)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    ticks_before = cpu_ticks()
    t0 = time.perf_counter()
    rows = run_bench(source, workloads, dtypes, providers, repeats=repeats, budget_s=budget,
                     seed=args.seed, preskipped=preskipped, settle_s=args.settle_ms / 1e3,
                     isolation=args.isolation)
    elapsed = time.perf_counter() - t0
    steal = steal_fraction(ticks_before, cpu_ticks())
    env = environment(device)
    if device == "cpu":
        print(isa.describe(env["machine"]["cpu_info"]))
    print(f"\n{source.label} on {env['machine']['cpu'] or device}, {env['machine']['torch_threads']} threads, "
          f"torch {env['versions']['torch']}; median/p90 of interleaved rounds; tokens/s counts real "
          f"tokens; {args.settle_ms:g} ms idle and an untimed call before each timed one; "
          f"{'each provider in its own process' if args.isolation == 'process' else 'all providers in one process'}; "
          f"'vs sdpa' = hf-sdpa median / row median "
          f"(same dtype); max err = max abs "
          f"difference from the fp32 HF model on real positions")
    print(format_table(rows))
    loads = [x for x in (load_before, env["machine"]["load_average_1m"]) if x is not None]
    cores = env["machine"]["cpu_affinity"] or env["machine"]["cpu_count"] or 1
    if loads and max(loads) > cores:
        print(f"note: the machine was busy (1-min load average up to {max(loads):.1f} on {cores} cores): "
              "absolute times are inflated and noisy; compare ratios within this run")
    if steal is not None and steal > 0.05:
        print(f"note: the hypervisor took {steal:.0%} of this machine's CPU time during the run (steal): "
              "timings are inflated, multi-threaded runtimes unevenly; rerun on a quieter host before "
              "drawing conclusions")
    status = 0
    errors = [r for r in rows if r.status == "error"]
    if errors:
        print(f"\n{len(errors)} row(s) failed validation or crashed: see ERROR lines", file=sys.stderr)
        status = 1
    if args.json:
        report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **env,
                  "model": {"label": source.label, "dir": source.model_dir, "config": asdict(source.config)},
                  "settings": {"workloads": [w.name for w in workloads], "dtypes": dtypes,
                               "providers": providers, "repeats": repeats, "budget_s": budget,
                               "settle_ms": args.settle_ms, "isolation": args.isolation,
                               "seed": args.seed, "baseline": BASELINE, "tolerance_atol":
                               {str(k).replace("torch.", ""): v for k, v in ATOL.items()}},
                  "elapsed_s": elapsed, "load_average_1m_at_start": load_before, "steal_fraction": steal,
                  "rows": [asdict(r) for r in rows]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        try:
            how = plot(rows, args.plot, f"bertfast bench: {source.label}, speedup vs {BASELINE}")
        except Exception as e:
            print(f"bertfast bench: could not write the plot {args.plot}: {type(e).__name__}: {e}",
                  file=sys.stderr)
            return 1
        if how == "built-in":
            print(f"wrote {args.plot} (matplotlib is not installed: drawn with bertfast's built-in PNG "
                  "writer; pip install matplotlib for a nicer chart)", file=sys.stderr)
        else:
            print(f"wrote {args.plot}", file=sys.stderr)
    return status


# ----------------------------------------------------------------------------------------------
# Built-in PNG bar chart, used when matplotlib is not installed (it is not a dependency): numpy
# draws into an RGB array, zlib writes the PNG, labels use a 5x7 bitmap font (upper case only).

_FONT = {  # 7 rows of 5 bits, top to bottom
    "A": "0E11111F111111", "B": "1E11111E11111E", "C": "0E11101010110E", "D": "1C12111111121C",
    "E": "1F10101E10101F", "F": "1F10101E101010", "G": "0E11101711110F", "H": "1111111F111111",
    "I": "0E04040404040E", "J": "0702020202120C", "K": "11121418141211", "L": "1010101010101F",
    "M": "111B1515111111", "N": "11111915131111", "O": "0E11111111110E", "P": "1E11111E101010",
    "Q": "0E11111115120D", "R": "1E11111E141211", "S": "0F10100E01011E", "T": "1F040404040404",
    "U": "1111111111110E", "V": "11111111110A04", "W": "1111111515150A", "X": "11110A040A1111",
    "Y": "11110A04040404", "Z": "1F01020408101F", "0": "0E11131519110E", "1": "040C040404040E",
    "2": "0E11010204081F", "3": "1F02040201110E", "4": "02060A121F0202", "5": "1F101E0101110E",
    "6": "0608101E11110E", "7": "1F010204080808", "8": "0E11110E11110E", "9": "0E11110F01020C",
    ".": "00000000000C0C", "-": "0000001F000000", ":": "000C0C000C0C00", "/": "01010204081010",
    "(": "02040808080402", ")": "08040202020408", "_": "0000000000001F", ",": "000000000C0408",
    "%": "18190204081303", "+": "0004041F040400", "=": "00001F001F0000", " ": "00000000000000",
    "?": "0E110102040004",
}
_PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
            (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def _glyph(ch):
    import numpy as np

    code = _FONT.get(ch.upper(), _FONT["?"])
    rows = [int(code[i:i + 2], 16) for i in range(0, 14, 2)]
    return np.array([[(r >> (4 - c)) & 1 for c in range(5)] for r in rows], dtype=bool)


def _text(img, x, y, s, scale=2, color=(0, 0, 0)):
    """Draw `s` with its top-left corner at (x, y); returns the width in pixels."""
    import numpy as np

    for i, ch in enumerate(s):
        g = np.kron(_glyph(ch), np.ones((scale, scale), dtype=bool))
        x0 = x + i * 6 * scale
        h, w = g.shape
        if x0 < 0 or y < 0 or x0 + w > img.shape[1] or y + h > img.shape[0]:
            continue
        img[y:y + h, x0:x0 + w][g] = color
    return len(s) * 6 * scale


def _text_width(s, scale=2):
    return len(s) * 6 * scale


def _bar_chart_png(path, title, panels, groups, series):
    """panels: [(panel label, [[value or None per series] per group])]; writes an RGB PNG."""
    import struct
    import zlib

    import numpy as np

    s = 2
    bar_w, gap = 18, 28
    group_w = max(len(series) * bar_w + gap, max(_text_width(g, s) for g in groups) + 12)
    left, right, top_pad, panel_h, label_h = 90, 30, 60, 300, 40
    legend_h = 24 * ((len(series) + 2) // 3) + 20
    width = left + right + group_w * len(groups)
    width = max(width, left + 3 * (_text_width(max(series, key=len), s) + 50))
    width = max(width, left + _text_width(title, s) + 20)
    height = top_pad + len(panels) * (20 + panel_h + label_h + 30) + legend_h
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    _text(img, left, 20, title, s)
    finite = [v for _, grid in panels for g in grid for v in g if v is not None]
    vmax = max([1.0] + finite) * 1.15
    step = next(t for t in (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100) if vmax / t <= 8)
    y0 = top_pad
    for label, grid in panels:
        base = y0 + 20 + panel_h  # pixel row of value 0

        def ypix(v):
            return int(round(base - v / vmax * panel_h))

        _text(img, 10, y0, f"{label}: speedup vs {BASELINE}", s)
        t = 0.0
        while t <= vmax:
            yy = ypix(t)
            img[yy, left:width - right] = (225, 225, 225)
            tick = f"{t:g}"
            _text(img, left - 8 - _text_width(tick, s), yy - 7, tick, s)
            t += step
        img[ypix(1.0), left:width - right] = (0, 0, 0)  # parity with the baseline
        img[y0 + 20:base + 1, left] = (0, 0, 0)
        img[base, left:width - right] = (0, 0, 0)
        for gi, (gname, values) in enumerate(zip(groups, grid)):
            gx = left + gi * group_w + (group_w - len(series) * bar_w) // 2
            for si, v in enumerate(values):
                if v is None:
                    continue
                x0 = gx + si * bar_w
                img[ypix(v):base, x0 + 1:x0 + bar_w - 1] = _PALETTE[si % len(_PALETTE)]
                vs = f"{v:.1f}"
                _text(img, x0 + bar_w // 2 - _text_width(vs, 1) // 2, ypix(v) - 10, vs, 1)
            cx = left + gi * group_w + group_w // 2
            _text(img, cx - _text_width(gname, s) // 2, base + 8, gname, s)
        y0 = base + label_h + 30
    col_w = (width - 20) // 3
    for si, name in enumerate(series):
        lx, ly = 10 + (si % 3) * col_w, y0 + (si // 3) * 24
        img[ly:ly + 14, lx:lx + 14] = _PALETTE[si % len(_PALETTE)]
        _text(img, lx + 22, ly, name, s)

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(height))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)

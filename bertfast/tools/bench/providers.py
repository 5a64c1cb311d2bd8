"""The named rows of `bertfast bench`: `setup(provider, source, dtype)` builds one, ready to time.

Rows: `bertfast-<backend>` (one per registered backend; on CUDA `bertfast-triton` replays CUDA graphs and
`bertfast-triton-eager` launches each kernel; `bertfast-triton-fp8`, CUDA sm_89+, runs its GEMMs on e4m3 in the fp16
pass), `hf-eager`, `hf-sdpa` (the baseline), `hf-fa2` (transformers'
flash_attention_2, CUDA), `onnxruntime` (CPU, or CUDA with onnxruntime-gpu), `torch-compile` (default mode) and
`torch-compile-max` (mode="max-autotune"), `torch-varlen` (CUDA, fp16/bf16: text-embeddings-inference's
padding-free recipe, cuBLAS GEMMs on packed tokens and torch's varlen flash attention, `varlen_peer`), `openvino`
(CPU: fp32, and bf16 where the CPU has it natively), and the int8 rows `bertfast-int8`, `onnxruntime-int8`,
`ctranslate2-int8`, `openvino-int8` (int8 GEMM operands, fp32 activations: run in the fp32 pass). The default rows
differ by device (`default_providers`). A provider that is not installed, cannot run this dtype or device, or fails
to build raises `ProviderSkipped` with the reason, reported as a skipped row. Each factory works on deep copies of
the reference (`source.Source`) and times its own build (`Provider.build_s`). The rows that run a converted model
(ONNX Runtime, CTranslate2, OpenVINO) live in `exported`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import time
from typing import Callable

import torch

from bertfast.backends import REGISTRY, available_backends
from bertfast.encoder import Encoder
from bertfast.loading import load_hf_model, load_pretrained
from bertfast.tools.bench.exported import (_ctranslate2_int8_factory, _onnxruntime_factory, _onnxruntime_int8_factory,
                                           _openvino_factory)
from bertfast.tools.bench.rows import Provider, ProviderSkipped
from bertfast.tools.bench.source import Source
from bertfast.tools.bench.varlen_peer import FAMILIES as VARLEN_FAMILIES, VarlenEncoder
from bertfast.tools.workloads import Batch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FIXED_PROVIDERS = ("hf-eager", "hf-sdpa", "onnxruntime", "openvino", "torch-compile", "bertfast-int8",
                   "onnxruntime-int8", "ctranslate2-int8", "openvino-int8")
INT8_PROVIDERS = ("bertfast-int8", "onnxruntime-int8", "ctranslate2-int8", "openvino-int8")
# The rows of `bench --device cuda`: the engine with and without CUDA graphs against what a GPU user would run.
CUDA_PROVIDERS = ("bertfast-triton", "bertfast-triton-eager", "bertfast-triton-fp8", "hf-sdpa", "hf-fa2",
                  "torch-compile", "torch-compile-max", "torch-varlen", "onnxruntime")
CUDA_ONLY = ("hf-fa2", "torch-varlen", "bertfast-triton-fp8")
BASELINE = "hf-sdpa"  # the row every speedup is relative to (same dtype)
EAGER_BASELINE = "hf-eager"  # the baseline of a model transformers runs eager only (DeBERTa-v2, MPNet: no SDPA)


def has_sdpa(source: Source) -> bool:
    """Whether transformers has an SDPA attention for the source's model class."""
    return bool(getattr(source.reference, "_supports_sdpa", True))


def baseline_of(source: Source) -> str:
    """The row speedups are relative to: hf-sdpa, or hf-eager where transformers has no SDPA for the model."""
    return BASELINE if has_sdpa(source) else EAGER_BASELINE


def _bertfast_factory(backend: str, quantize: str | None = None, graphs: bool | None = None):
    """bertfast on `backend` (int8: the cpu backend's int8 GEMMs on fp32 weights, in the fp32 pass; graphs=False:
    eager launches where the engine would replay CUDA graphs)."""
    name = (f"bertfast-{backend}-{quantize}" if quantize == "fp8" else "bertfast-int8" if quantize
            else f"bertfast-{backend}" + ("-eager" if graphs is False else ""))

    def factory(source: Source, dtype: torch.dtype) -> Provider:
        t0 = time.perf_counter()
        load_dtype = dtype if quantize == "fp8" else torch.float32 if quantize else dtype  # fp8: from fp16 weights
        # From the checkpoint files when there are some (the user's path), else from the model.
        if source.model_dir is not None:
            weights = load_pretrained(source.model_dir, load_dtype)
        else:
            weights = load_hf_model(source.reference, load_dtype)
        enc = Encoder(weights.to(device=source.device), backend=backend, model_dir=source.model_dir,
                      quantize=quantize, graphs=graphs)
        build = time.perf_counter() - t0

        def fn(b: Batch):
            return enc(**b.inputs()).last_hidden_state

        info = {"backend": enc.backend, "graphs": enc.engine.graphs, **({"quantized": quantize} if quantize else {})}
        return Provider(name, dtype, fn, build, info)

    return factory


def _hf_factory(attn: str, name: str | None = None):
    def factory(source: Source, dtype: torch.dtype) -> Provider:
        t0 = time.perf_counter()
        model = source.hf_copy(attn, dtype)
        build = time.perf_counter() - t0

        @torch.inference_mode()
        def fn(b: Batch):
            return model(**b.inputs()).last_hidden_state

        return Provider(name or f"hf-{attn}", dtype, fn, build, {"attn_implementation": attn})

    return factory


def _torch_compile_factory(mode: str | None = None):
    """torch.compile of the HF SDPA model: default mode, or `mode` ("max-autotune": Inductor's GEMM autotuning and
    CUDA graphs). On CUDA each shape gets a static graph of its own (dynamic=False), as a served model would."""
    name = "torch-compile" if mode is None else "torch-compile-max"

    def factory(source: Source, dtype: torch.dtype) -> Provider:
        import torch._dynamo
        import torch._inductor.config as inductor_config

        t0 = time.perf_counter()
        attn = "sdpa" if has_sdpa(source) else "eager"  # what transformers can run: compiled as it is
        model = source.hf_copy(attn, dtype)
        if source.device == "cpu":
            # Freezing folds the weights into the graph as constants (and lets oneDNN prepack them).
            inductor_config.freezing = True
        # Each new shape/dtype recompiles; without a higher limit dynamo falls back to eager silently.
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
        compiled = torch.compile(model, mode=mode, dynamic=False if source.device != "cpu" else None)
        build = time.perf_counter() - t0
        # Its CUDA graphs reuse their output buffers: a step marker per call, as an inference loop must.
        mark_step = (torch.compiler.cudagraph_mark_step_begin
                     if mode == "max-autotune" and source.device != "cpu" else lambda: None)

        @torch.no_grad()
        def fn(b: Batch):
            mark_step()
            return compiled(**b.inputs()).last_hidden_state

        return Provider(name, dtype, fn, build, {"mode": mode or "default", "freezing": bool(inductor_config.freezing),
                                                 "attn_implementation": attn,
                                                 "note": "compiles on first call per shape"})

    return factory


def _torch_varlen_factory(source: Source, dtype: torch.dtype) -> Provider:
    """TEI's GPU recipe in torch (`varlen_peer.VarlenEncoder`): unpad, F.linear GEMMs, varlen flash attention, pad."""
    t0 = time.perf_counter()
    model = VarlenEncoder(source.reference, source.config, dtype, source.device)
    build = time.perf_counter() - t0

    def fn(b: Batch):
        return model(**b.inputs())

    return Provider("torch-varlen", dtype, fn, build, {"attention": "torch.nn.attention.varlen.varlen_attn",
                                                       "gemm": "F.linear on packed tokens"})


# Fixed providers; `bertfast-<backend>` names are added from the backend registry.
FACTORIES: dict[str, Callable[[Source, torch.dtype], Provider]] = {
    "hf-eager": _hf_factory("eager"),
    "hf-sdpa": _hf_factory("sdpa"),
    "hf-fa2": _hf_factory("flash_attention_2", "hf-fa2"),
    "onnxruntime": _onnxruntime_factory,
    "torch-compile": _torch_compile_factory(),
    "torch-compile-max": _torch_compile_factory("max-autotune"),
    "torch-varlen": _torch_varlen_factory,
    "bertfast-triton-eager": _bertfast_factory("triton", graphs=False),
    "bertfast-int8": _bertfast_factory("cpu", quantize="int8"),
    "bertfast-triton-fp8": _bertfast_factory("triton", quantize="fp8"),
    "onnxruntime-int8": _onnxruntime_int8_factory,
    "ctranslate2-int8": _ctranslate2_int8_factory,
    "openvino": _openvino_factory(),
    "openvino-int8": _openvino_factory("int8"),
}


def factory_of(name: str):
    """The factory of provider `name`; ValueError for an unknown name."""
    if name in FACTORIES:
        return FACTORIES[name]
    if name.startswith("bertfast-"):
        return _bertfast_factory(name[len("bertfast-"):])
    raise ValueError(f"unknown provider {name!r}; known: {', '.join(known_providers())}")


def known_providers() -> list[str]:
    return [f"bertfast-{b}" for b in REGISTRY] + list(FACTORIES)


def check_runnable(provider: str, source: Source, dtype: torch.dtype) -> None:
    """The reasons `provider` cannot run that need no build (dtype, device, backend availability):
    raises ProviderSkipped. `setup` checks them first; run_bench also before spawning a worker."""
    cuda = source.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise ProviderSkipped("CUDA is not available here (torch.cuda.is_available() is False)")
    if provider in INT8_PROVIDERS and dtype != torch.float32:
        raise ProviderSkipped("int8 rows run in the fp32 pass (int8 GEMM operands, fp32 activations)")
    if provider in INT8_PROVIDERS and cuda:
        raise ProviderSkipped("an int8 row of the CPU (no CUDA path is wired in this bench)")
    if provider == "bertfast-triton-fp8" and dtype != torch.float16:
        raise ProviderSkipped("fp8 rows run in the fp16 pass (e4m3 GEMM operands, fp16 activations)")
    if provider == "bertfast-triton-fp8" and cuda and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        raise ProviderSkipped(f"fp8 GEMMs need sm_89 or later (this GPU is sm_{major}{minor})")
    if provider in CUDA_ONLY and not cuda:
        raise ProviderSkipped("needs a CUDA device (--device cuda)")
    if provider in ("hf-sdpa", "hf-fa2") and not has_sdpa(source):
        raise ProviderSkipped(f"transformers runs {type(source.reference).__name__} with eager attention only "
                              f"(hf-eager, the baseline of this model)")
    if provider == "ctranslate2-int8" and source.config.family != "bert":
        raise ProviderSkipped(f"wired for BERT checkpoints only here (this is {source.config.family})")
    if provider == "onnxruntime":
        _check_onnxruntime(cuda, dtype)
    if provider == "torch-varlen":
        _check_torch_varlen(source, dtype)
    if provider == "openvino":
        if cuda:
            raise ProviderSkipped("a CPU row (OpenVINO's CPU plugin; no GPU path is wired in this bench)")
        if dtype == torch.float16:
            raise ProviderSkipped("fp32 and bf16 rows only (wired here as OpenVINO's f32 and bf16 CPU inference)")
    if provider == "hf-fa2":
        if dtype == torch.float32:
            raise ProviderSkipped("flash_attention_2 runs fp16 and bf16 only")
        if importlib.util.find_spec("flash_attn") is None:
            raise ProviderSkipped("flash_attn is not installed (transformers' flash_attention_2 needs it: "
                                  "pip install flash-attn)")
    if provider.startswith("bertfast-"):
        backend = ("cpu" if provider == "bertfast-int8"
                   else provider[len("bertfast-"):].removesuffix("-eager").removesuffix("-fp8"))
        reason = available_backends(source.device).get(backend, f"unknown backend {backend!r}")
        if reason is not None:
            raise ProviderSkipped(reason)


def _check_onnxruntime(cuda: bool, dtype: torch.dtype) -> None:
    if not cuda:
        if dtype != torch.float32:
            raise ProviderSkipped("fp32 only on CPU (ONNX Runtime's fused BERT kernels are fp32 on CPU, "
                                  "fp16 on GPU)")
        return
    if dtype == torch.bfloat16:
        raise ProviderSkipped("fp32 and fp16 only on CUDA (ONNX Runtime's BERT optimizer converts to fp16)")
    try:
        import onnxruntime as ort
    except ImportError:
        raise ProviderSkipped("not installed (onnxruntime): pip install onnxruntime-gpu onnx") from None
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise ProviderSkipped(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider here (a CPU build): "
                              "pip install onnxruntime-gpu")


def _check_torch_varlen(source: Source, dtype: torch.dtype) -> None:
    try:
        varlen = importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        varlen = None
    if not hasattr(varlen, "varlen_attn"):
        raise ProviderSkipped(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn "
                              "(the row's attention): a newer torch has it")
    if source.config.family not in VARLEN_FAMILIES:
        raise ProviderSkipped(f"wired for {', '.join(VARLEN_FAMILIES)} only (absolute positions, post-LayerNorm; "
                              f"this is {source.config.family})")
    if dtype == torch.float32:
        raise ProviderSkipped("fp16 and bf16 only (varlen flash attention, varlen_attn, has no fp32 kernel)")


def setup(provider: str, source: Source, dtype: torch.dtype) -> Provider:
    """Build `provider` for `source` in `dtype`. Raises ProviderSkipped(reason) if it cannot run."""
    factory = factory_of(provider)
    check_runnable(provider, source, dtype)
    try:
        return factory(source, dtype)
    except ProviderSkipped:
        raise
    except Exception as e:  # a set-up failure is reported as a skipped row with its reason
        raise ProviderSkipped(f"set-up failed: {type(e).__name__}: {e}") from e


def default_providers(device: str) -> tuple[list[str], dict[str, str]]:
    """(providers to run, {provider: reason} for bertfast backends skipped by default). On CUDA: CUDA_PROVIDERS."""
    if device.startswith("cuda"):
        return list(CUDA_PROVIDERS), {}
    names, skipped = [], {}
    for backend in REGISTRY:
        name = f"bertfast-{backend}"
        if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            skipped[name] = ("Triton runs in its interpreter on CPU (TRITON_INTERPRET=1): a correctness "
                             "tool, far too slow to time; name it in --providers to force")
        else:
            names.append(name)  # unavailable ones become skipped rows with the registry's reason
    return names + list(FIXED_PROVIDERS), skipped

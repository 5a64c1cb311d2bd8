"""The named rows of `bertfast bench`: `setup(provider, source, dtype)` builds one, ready to time.

Rows: `bertfast-<backend>` (one per registered backend; on CUDA `bertfast-triton` replays CUDA graphs and
`bertfast-triton-eager` launches each kernel), `hf-eager`, `hf-sdpa` (the baseline), `hf-fa2` (transformers'
flash_attention_2, CUDA), `onnxruntime` (CPU, or CUDA with onnxruntime-gpu), `torch-compile` (default mode) and
`torch-compile-max` (mode="max-autotune"), `openvino` (CPU: fp32, and bf16 where the CPU has it natively), and the
int8 rows `bertfast-int8`, `onnxruntime-int8`, `ctranslate2-int8`, `openvino-int8` (int8 GEMM operands, fp32
activations: run in the fp32 pass). The default rows differ by device (`default_providers`). A provider that is
not installed, cannot run this dtype or device, or fails to build raises `ProviderSkipped` with the reason, reported
as a skipped row. Each factory works on deep copies of the reference (`source.Source`) and times its own build
(`Provider.build_s`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import logging
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from bertfast.backends import REGISTRY, available_backends
from bertfast.encoder import Encoder
from bertfast.loading import load_hf_model, load_pretrained
from bertfast.tools.bench.source import Source
from bertfast.tools.workloads import Batch, make_batch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FIXED_PROVIDERS = ("hf-eager", "hf-sdpa", "onnxruntime", "openvino", "torch-compile", "bertfast-int8",
                   "onnxruntime-int8", "ctranslate2-int8", "openvino-int8")
INT8_PROVIDERS = ("bertfast-int8", "onnxruntime-int8", "ctranslate2-int8", "openvino-int8")
# The rows of `bench --device cuda`: the engine with and without CUDA graphs against what a GPU user would run.
CUDA_PROVIDERS = ("bertfast-triton", "bertfast-triton-eager", "hf-sdpa", "hf-fa2", "torch-compile",
                  "torch-compile-max", "onnxruntime")
CUDA_ONLY = ("hf-fa2",)
BASELINE = "hf-sdpa"  # the row every speedup is relative to (same dtype)


class ProviderSkipped(Exception):
    """A provider cannot run here (not installed, unsupported dtype or device); the message says why."""


@dataclass
class Provider:
    """A ready-to-time provider: `fn(batch)` returns last_hidden_state (B, S, H) on the device."""

    name: str
    dtype: torch.dtype
    fn: Callable[[Batch], torch.Tensor]
    build_s: float = 0.0
    info: dict = field(default_factory=dict)


def _bertfast_factory(backend: str, quantize: str | None = None, graphs: bool | None = None):
    """bertfast on `backend` (int8: the cpu backend's int8 GEMMs on fp32 weights, in the fp32 pass; graphs=False:
    eager launches where the engine would replay CUDA graphs)."""
    name = "bertfast-int8" if quantize else f"bertfast-{backend}" + ("-eager" if graphs is False else "")

    def factory(source: Source, dtype: torch.dtype) -> Provider:
        t0 = time.perf_counter()
        load_dtype = torch.float32 if quantize else dtype
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


class _LastHidden(torch.nn.Module):
    """Positional (input_ids, attention_mask[, token_type_ids]) -> last_hidden_state, for export."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        types = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **types).last_hidden_state


def _onnx_names(source: Source) -> list[str]:
    """The exported graph's inputs: token types only where the model has them."""
    return ["input_ids", "attention_mask"] + (["token_type_ids"] if source.config.type_vocab_size else [])


def _export_onnx(source: Source, path: str, names: list[str]) -> None:
    """Plain torch.onnx.export of the reference (dynamic batch and sequence axes) to `path`."""
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
                wrapper, (sample.input_ids, sample.attention_mask, sample.token_type_ids)[:len(names)], path,
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
    cuda = source.device != "cpu"
    t0 = time.perf_counter()
    names = _onnx_names(source)
    with tempfile.TemporaryDirectory(prefix="bertfast-bench-") as tmp:
        raw, opt = os.path.join(tmp, "model.onnx"), os.path.join(tmp, "model.opt.onnx")
        _export_onnx(source, raw, names)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimized = optimizer.optimize_model(raw, model_type="bert", num_heads=cfg.num_attention_heads,
                                                 hidden_size=cfg.hidden_size, use_gpu=cuda)
            if dtype == torch.float16:  # fp16 weights and math, fp32 inputs and outputs
                optimized.convert_float_to_float16(keep_io_types=True)
            fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
            optimized.save_model_to_file(opt)
        fn = _ort_cuda_forward(ort, opt, names, source) if cuda else _ort_forward(ort, opt, names)
    build = time.perf_counter() - t0
    return Provider("onnxruntime", dtype, fn, build, {"fused_ops": fused, "opset": 17, "device": source.device})


def _ort_forward(ort, path: str, names: list[str]):
    """An ONNX Runtime CPU session on the model at `path` (loaded now), as a Batch -> last_hidden_state."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])

    def fn(b: Batch):
        feeds = {n: b.inputs()[n].numpy() for n in names}
        return torch.from_numpy(session.run(["last_hidden_state"], feeds)[0])

    return fn


def _ort_cuda_forward(ort, path: str, names: list[str], source: Source):
    """An ONNX Runtime CUDA session: inputs and the fp32 output bound to torch's CUDA tensors (no host copies)."""
    import numpy as np

    index = torch.device(source.device).index or 0
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(path, opts, providers=[("CUDAExecutionProvider", {"device_id": index})])
    hidden = source.config.hidden_size

    def fn(b: Batch):
        binding = session.io_binding()
        inputs = {n: b.inputs()[n].contiguous() for n in names}
        for n, t in inputs.items():
            binding.bind_input(n, "cuda", index, np.int64, tuple(t.shape), t.data_ptr())
        out = torch.empty(*b.input_ids.shape, hidden, dtype=torch.float32, device=source.device)
        binding.bind_output("last_hidden_state", "cuda", index, np.float32, tuple(out.shape), out.data_ptr())
        session.run_with_iobinding(binding)
        return out

    return fn


def _onnxruntime_int8_factory(source: Source, dtype: torch.dtype) -> Provider:
    try:
        import onnx  # noqa: F401
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError as e:
        raise ProviderSkipped(f"not installed ({e.name}): pip install onnxruntime onnx") from None
    t0 = time.perf_counter()
    names = _onnx_names(source)
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


def _openvino_factory(quantize: str | None = None):
    """OpenVINO's CPU plugin on the plain ONNX export (`openvino.convert_model`; batch and sequence stay dynamic),
    its inference precision set to the row's dtype (left unset it is bf16 on a CPU with bf16); int8: NNCF's
    data-free weight compression (int8 weights per channel, activations quantized per group by the plugin at run
    time), in the fp32 pass."""
    name = "openvino-int8" if quantize else "openvino"

    def factory(source: Source, dtype: torch.dtype) -> Provider:
        try:
            import openvino as ov
            if quantize:
                import nncf
        except ImportError as e:
            raise ProviderSkipped(f"not installed ({e.name}): pip install openvino"
                                  + (" nncf" if quantize else "")) from None
        t0 = time.perf_counter()
        names = _onnx_names(source)
        with tempfile.TemporaryDirectory(prefix="bertfast-bench-") as tmp:
            raw = os.path.join(tmp, "model.onnx")
            _export_onnx(source, raw, names)
            model = ov.convert_model(raw)
        if quantize:
            nncf_logger = logging.getLogger("nncf")
            level = nncf_logger.level
            nncf_logger.setLevel(logging.ERROR)  # its table of compressed layers
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # its progress bar
                    model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
            finally:
                nncf_logger.setLevel(level)
        precision = "bf16" if dtype == torch.bfloat16 else "f32"
        compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": precision,
                                                          "INFERENCE_NUM_THREADS": torch.get_num_threads(),
                                                          "PERFORMANCE_HINT": "LATENCY"})
        # The plugin ignores a bf16 hint on a CPU without native bf16 and runs f32: not a bf16 row.
        ran = compiled.get_property("INFERENCE_PRECISION_HINT").to_string()
        if ran != precision:
            raise ProviderSkipped(f"OpenVINO {ov.__version__} runs {ran}, not {precision}, on this CPU: no native "
                                  "bf16 (BF16 is not in its OPTIMIZATION_CAPABILITIES)")
        request = compiled.create_infer_request()
        build = time.perf_counter() - t0

        def fn(b: Batch):
            out = request.infer({n: b.inputs()[n].numpy() for n in names})  # outputs copied out of the request
            return torch.from_numpy(out["last_hidden_state"])

        info = {"openvino": ov.__version__, "inference_precision": ran,
                "threads": compiled.get_property("INFERENCE_NUM_THREADS")}
        if quantize:
            info.update(quantized="int8", scheme=f"nncf {nncf.__version__} compress_weights INT8_ASYM per channel, "
                        f"dynamic activation groups of {compiled.get_property('DYNAMIC_QUANTIZATION_GROUP_SIZE')}")
        return Provider(name, dtype, fn, build, info)

    return factory


def _torch_compile_factory(mode: str | None = None):
    """torch.compile of the HF SDPA model: default mode, or `mode` ("max-autotune": Inductor's GEMM autotuning and
    CUDA graphs). On CUDA each shape gets a static graph of its own (dynamic=False), as a served model would."""
    name = "torch-compile" if mode is None else "torch-compile-max"

    def factory(source: Source, dtype: torch.dtype) -> Provider:
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
                                                 "note": "compiles on first call per shape"})

    return factory


# Fixed providers; `bertfast-<backend>` names are added from the backend registry.
FACTORIES: dict[str, Callable[[Source, torch.dtype], Provider]] = {
    "hf-eager": _hf_factory("eager"),
    "hf-sdpa": _hf_factory("sdpa"),
    "hf-fa2": _hf_factory("flash_attention_2", "hf-fa2"),
    "onnxruntime": _onnxruntime_factory,
    "torch-compile": _torch_compile_factory(),
    "torch-compile-max": _torch_compile_factory("max-autotune"),
    "bertfast-triton-eager": _bertfast_factory("triton", graphs=False),
    "bertfast-int8": _bertfast_factory("cpu", quantize="int8"),
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
    if provider in CUDA_ONLY and not cuda:
        raise ProviderSkipped("needs a CUDA device (--device cuda)")
    if provider == "ctranslate2-int8" and source.config.family != "bert":
        raise ProviderSkipped(f"wired for BERT checkpoints only here (this is {source.config.family})")
    if provider == "onnxruntime":
        _check_onnxruntime(cuda, dtype)
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
        backend = "cpu" if provider == "bertfast-int8" else provider[len("bertfast-"):].removesuffix("-eager")
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

"""The bench rows that run the model converted out of torch: ONNX Runtime (the ONNX export, fp32 on CPU or CUDA, and
its dynamic int8 quantization), CTranslate2 (int8) and OpenVINO (the ONNX export through its CPU plugin, fp32/bf16,
and NNCF's int8 weight compression). Each factory takes a `source.Source` and a dtype and returns a
`providers.Provider`, or raises `ProviderSkipped` with the reason."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import tempfile
import time
import warnings

import torch

from bertfast.tools.bench.rows import Provider, ProviderSkipped
from bertfast.tools.bench.source import Source
from bertfast.tools.workloads import Batch, make_batch

# oneDNN caps (ONEDNN_MAX_CPU_ISA, as BERTFAST_ISA sets it) below its first ISA with bf16 dot products.
_ONEDNN_NO_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
# oneDNN caps under which OpenVINO's int8 weight-compressed layers found no kernel (AMD Zen 5, OpenVINO 2026.x, at
# SSE41 and AVX2: "could not create a primitive descriptor for the inner product"), where its fp32 ones ran.
_ONEDNN_NO_INT8_FC = {"SSE41", "AVX", "AVX2"}
# ... and under which its fp32 layers did not run either ("MVN node ... bad combination" at SSE41).
_ONEDNN_NO_OPENVINO = {"SSE41"}


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
        capped = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()
        if capped in _ONEDNN_NO_OPENVINO:
            raise ProviderSkipped(f"OpenVINO's CPU plugin fails under ONEDNN_MAX_CPU_ISA={capped} (the oneDNN cap "
                                  "BERTFAST_ISA sets)")
        if quantize and capped in _ONEDNN_NO_INT8_FC:
            raise ProviderSkipped(f"OpenVINO's int8 weight-compressed layers find no kernel under ONEDNN_MAX_CPU_ISA="
                                  f"{capped} (the oneDNN cap BERTFAST_ISA sets)")
        if dtype == torch.bfloat16 and capped in _ONEDNN_NO_BF16:
            # Its plugin still lists BF16 there, then finds no bf16 kernel for some node (Softmax, on Zen 5 under
            # BERTFAST_ISA=avx2) and fails to compile.
            raise ProviderSkipped(f"no native bf16 under ONEDNN_MAX_CPU_ISA={capped} (OpenVINO's CPU plugin runs "
                                  "on oneDNN; its bf16 kernels need AVX512_CORE_BF16 or AMX)")
        if dtype == torch.bfloat16 and "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
            # Its plugin takes a bf16 hint on any AVX-512 CPU and emulates bf16 there: BERT-base b8 x s128 83 s
            # against 1.4 s in fp32 on a Cascade Lake (2026-11-27), a row that would hold a bench for hours.
            raise ProviderSkipped(f"no native bf16 for OpenVINO {ov.__version__} on this CPU (BF16 is not in its "
                                  "OPTIMIZATION_CAPABILITIES: no AVX-512 BF16 or AMX); it would emulate bf16, 58x "
                                  "its fp32 time on a Cascade Lake")
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
        # A guard: where it lists BF16 the plugin runs the bf16 hint; were it to run f32, that is not a bf16 row.
        ran = compiled.get_property("INFERENCE_PRECISION_HINT").to_string()
        if ran != precision:
            raise ProviderSkipped(f"OpenVINO {ov.__version__} runs {ran}, not {precision}, on this CPU: no native "
                                  "bf16")
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

"""LoRA adapters per row: a batch mixing N adapters against the base model's batch on the cpu backend, and against
running PEFT's model (transformers, the same adapters) on each adapter's own rows one adapter after another.

    python benchmarks/bench_adapters.py [--adapters 8] [--rank 16] [--layers 12] [--dtype fp32]
                                        [--workloads b8xs128,ragged] [--rounds 7] [--no-peft] [--device cpu]
                                        [--fp32-lora]

BERT-base random weights (`BertConfig()`, --layers of them), N random adapters of rank --rank on query, key, value
and every dense (attention out, FFN in and out, the pooler), both factors drawn at 0.02 (PEFT's B starts at zero).
Rows: `base` (no adapter), `mixed` (row i on adapter i mod N), `peft` (for each adapter, PEFT's model with that
adapter active on its rows, padded as transformers runs them). `mixed` is checked against PEFT per row before it is
timed (fp32: within 1e-4 of the largest value). Timed interleaved in one process
(`bertfast.tools.bench.measure.interleaved`), medians; mixed/base also as the median of the rounds' own ratios (a
round's two calls run back to back: a drift of the host's speed moves both). Also the bytes of the tensors the loaded
adapters hold, and the resident memory loading them adds, before and after glibc's malloc_trim (the heap keeps the
loads' freed transient buffers resident until then).
--fp32-lora (bf16 or int8 on an AMX tier): also `mixed-fp32-lora`, the same adapters loaded again with
BERTFAST_LORA_TILES=0 (their shrink and terms in fp32 instead of on the tiles), timed in the same rounds.
Targets (issue 59): mixed <= 1.15x base, peft >= 4x mixed.
--device cuda: the triton backend (its segmented LoRA kernels) on the GPU, PEFT's model there in the same dtype
(fp32, fp16 or bf16), each call timed between synchronizations.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bertfast  # noqa: E402
from bertfast.accuracy import rel_error  # noqa: E402
from bertfast.adapters_peft import write_peft_dir  # noqa: E402
from bertfast.tools.bench.measure import interleaved, timer  # noqa: E402

TARGETS = ["query", "key", "value", "dense"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": "int8"}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trimmed_rss_bytes() -> int | None:
    """rss_bytes after glibc's malloc_trim(0) hands the heap's free pages back; None without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return rss_bytes()


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of the distinct tensors an object holds (tensors, tuples, lists, dicts, dataclasses, slotted objects):
    what the loaded adapters keep, whatever the allocator reuses."""
    seen = set() if seen is None else seen
    if torch.is_tensor(obj):
        key = (obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes())
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else getattr(obj, "__slots__", ())
    return sum(tensor_bytes(getattr(obj, n, None), seen) for n in names)


def lengths_of(workload: str) -> list[int]:
    if workload == "ragged":
        return [16 + (112 * i) // 7 for i in range(8)]
    b, s = workload.lstrip("b").split("xs")
    return [int(s)] * int(b)


def save_adapters(model, root: str, n: int, rank: int) -> list[str]:
    """n PEFT LoRA directories (rank, alpha 2 rank, TARGETS) written without PEFT, which a GPU machine may lack."""
    paths = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        factors = {name: (torch.randn(rank, module.in_features, generator=g) * 0.02,
                          torch.randn(module.out_features, rank, generator=g) * 0.02)
                   for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in TARGETS}
        paths.append(os.path.join(root, f"a{i}"))
        write_peft_dir(paths[-1], factors, rank=rank, alpha=2 * rank, target_modules=TARGETS)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--workloads", default="b8xs128,ragged")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-peft", action="store_true", help="leave out the PEFT row (and its check)")
    ap.add_argument("--fp32-lora", action="store_true",
                    help="also time the mixed batch with LoRA in fp32 (BERTFAST_LORA_TILES=0)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: the cpu backend; cuda: the triton backend on the GPU")
    args = ap.parse_args()
    device = args.device
    backend = "cpu" if device == "cpu" else "triton"
    offered = {"cpu": ("fp32", "bf16", "int8"), "cuda": ("fp32", "fp16", "bf16")}[device]
    if args.dtype not in offered:
        raise SystemExit(f"--dtype {args.dtype} is not offered on {device} (offered: {', '.join(offered)})")
    bertfast.cap_libraries()
    import transformers

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=args.layers)).eval()
    with tempfile.TemporaryDirectory() as root:
        model.save_pretrained(os.path.join(root, "base"))
        paths = save_adapters(model, root, args.adapters, args.rank)
        if device == "cpu":
            enc = bertfast.Encoder.from_pretrained(os.path.join(root, "base"), dtype=DTYPES[args.dtype], backend="cpu")
        else:
            enc = bertfast.Encoder.from_hf(copy.deepcopy(model).to(device), dtype=DTYPES[args.dtype], backend=backend)
        names = [f"a{i}" for i in range(args.adapters)]
        before = trimmed_rss_bytes() or rss_bytes()
        for name, path in zip(names, paths):
            enc.load_adapter(name, path)
        added = rss_bytes() - before
        trimmed = trimmed_rss_bytes()
        trimmed = "" if trimmed is None else f", {(trimmed - before) / 2**20:.1f} MiB after malloc_trim"
        held = tensor_bytes([enc._adapters[name] for name in names])
        file_bytes = sum(os.path.getsize(os.path.join(p, "adapter_model.safetensors")) for p in paths)
        where = (f"cpu tier {bertfast.cpu_info()['active']}, torch threads {torch.get_num_threads()}" if device == "cpu"
                 else f"{torch.cuda.get_device_name()}, backend triton")
        print(f"{where}, {args.layers} layers, {args.adapters} adapters of rank {args.rank}, {args.dtype}")
        print(f"memory: the adapters hold {held / 2**20:.1f} MiB of tensors (their safetensors files: "
              f"{file_bytes / 2**20:.1f} MiB); loading them added {added / 2**20:.1f} MiB resident{trimmed}")
        fp32_names = []
        if args.fp32_lora:
            if device != "cpu" or args.dtype == "fp32":
                raise SystemExit("--fp32-lora compares the cpu backend's bf16 or int8 LoRA on the AMX tiles")
            os.environ["BERTFAST_LORA_TILES"] = "0"
            fp32_names = [f"f{i}" for i in range(args.adapters)]
            for name, path in zip(fp32_names, paths):
                enc.load_adapter(name, path)
            del os.environ["BERTFAST_LORA_TILES"]
            tiles = any(f.tiles is not None for layer in enc._adapters[names[0]].layers for f in layer.values())
            print(f"LoRA: {'on the tiles' if tiles else 'fp32 (no AMX tier)'} in `mixed`, fp32 in `mixed-fp32-lora`")
        pm = None
        if not args.no_peft:
            import peft
            peft_dtype = torch.float32 if device == "cpu" else DTYPES[args.dtype]
            pm = peft.PeftModel.from_pretrained(copy.deepcopy(model).to(device, peft_dtype), paths[0],
                                                adapter_name=names[0]).eval()
            for name, path in zip(names[1:], paths[1:]):
                pm.load_adapter(path, adapter_name=name)
        g = torch.Generator().manual_seed(1)
        for workload in args.workloads.split(","):
            lengths = lengths_of(workload)
            B, S = len(lengths), max(lengths)
            ids = torch.randint(1000, 30000, (B, S), generator=g).to(device)
            mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long().to(device)
            mixed_ids = [names[i % len(names)] for i in range(B)]
            groups = {name: [i for i in range(B) if mixed_ids[i] == name] for name in names}

            def base():
                enc(ids, mask)

            def mixed():
                enc(ids, mask, adapter_ids=mixed_ids)

            def peft_rows():
                with torch.inference_mode():
                    for name, rows in groups.items():
                        if rows:
                            pm.set_adapter(name)
                            pm(input_ids=ids[rows], attention_mask=mask[rows])

            contenders = {"base": timer(base, device=device), "mixed": timer(mixed, device=device)}
            if fp32_names:
                fp32_ids = [fp32_names[names.index(n)] for n in mixed_ids]
                contenders["mixed-fp32-lora"] = timer(lambda: enc(ids, mask, adapter_ids=fp32_ids), device=device)
            if pm is not None:
                with torch.inference_mode():
                    ours = enc(ids, mask, adapter_ids=mixed_ids).last_hidden_state.float()
                    for name, rows in groups.items():
                        if not rows:
                            continue
                        pm.set_adapter(name)
                        ref = pm(input_ids=ids[rows], attention_mask=mask[rows]).last_hidden_state
                        keep = mask[rows].bool()
                        err = rel_error(ours[rows][keep], ref[keep].float())
                        if args.dtype == "fp32" and err > 1e-4:
                            raise SystemExit(f"{workload}: adapter {name}'s rows differ from PEFT's by {err:.2e}")
                contenders["peft"] = timer(peft_rows, device=device)
            times = interleaved(contenders, args.rounds, warmup=1)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            line = "  ".join(f"{k} {v:8.1f} ms" for k, v in med.items())
            per_round = statistics.median(m / b for m, b in zip(times["mixed"], times["base"]))
            ratio = f"mixed/base x{med['mixed'] / med['base']:.3f} (per round x{per_round:.3f})"
            if fp32_names:
                fp32 = statistics.median(m / b for m, b in zip(times["mixed-fp32-lora"], times["base"]))
                ratio += f"  mixed-fp32-lora/base per round x{fp32:.3f}"
            if "peft" in med:
                ratio += f"  peft/mixed x{med['peft'] / med['mixed']:.2f}"
            print(f"{workload:8s} {line}   {ratio}")


if __name__ == "__main__":
    main()

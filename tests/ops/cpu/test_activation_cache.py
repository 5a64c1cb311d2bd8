"""The native ops' cache of freed activation blocks (csrc/bindings/alloc.cpp, `_C.testing.activation_cache_stats`).

A steady workload's forward takes its large outputs and scratch from blocks earlier forwards freed (no fresh pages
from the kernel), a block is never handed out while a tensor still uses it, outputs are the same bits with the cache
off, and BERTFAST_ACTIVATION_CACHE_MB bounds it (0: off).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

try:
    from bertfast import _C
except ImportError:
    _C = None

pytestmark = pytest.mark.skipif(
    _C is None, reason="the native extension bertfast._C is not built (run bash install.sh)"
)

# A 2-layer BERT (hidden 256, FFN 1024) on 4 x 300 tokens: its FFN output (1200 x 1024 fp32, 4.9 MB) and the native
# layer's scratch are past the 1 MiB the cache starts at.
SCRIPT = textwrap.dedent("""
    import json, sys, torch, transformers, bertfast
    from bertfast import _C
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=256, num_attention_heads=4, num_hidden_layers=2,
                                  intermediate_size=1024, vocab_size=1000, max_position_embeddings=512)
    enc = bertfast.Encoder.from_hf(transformers.BertModel(cfg).eval(), backend="cpu")
    ids = torch.randint(5, 1000, (4, 300))
    with torch.inference_mode():
        first = enc(input_ids=ids).last_hidden_state
        stats = [list(_C.testing.activation_cache_stats())]
        kept = first.clone()
        second = enc(input_ids=ids).last_hidden_state
        stats.append(list(_C.testing.activation_cache_stats()))
        third = enc(input_ids=ids).last_hidden_state
        stats.append(list(_C.testing.activation_cache_stats()))
    torch.save(third, sys.argv[1])
    print(json.dumps(dict(stats=stats, first_kept=torch.equal(first, kept), same=torch.equal(second, third)
                          and torch.equal(first, second))))
""")


def _run(tmp_path, cache_mb: str | None, name: str):
    import json

    env = dict(os.environ)
    env.pop("BERTFAST_ACTIVATION_CACHE_MB", None)
    if cache_mb is not None:
        env["BERTFAST_ACTIVATION_CACHE_MB"] = cache_mb
    out = tmp_path / f"{name}.pt"
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), torch.load(out)


def test_steady_forwards_reuse_blocks_and_match_the_cache_off(tmp_path):
    on, hidden_on = _run(tmp_path, None, "on")
    (cached1, cap, reused1, allocated1), (_, _, reused2, allocated2), (cached3, _, reused3, allocated3) = on["stats"]
    assert cap == 1024 << 20
    assert allocated1 > 0 and reused2 > reused1 and reused3 > reused2  # the later forwards take freed blocks
    assert allocated3 == allocated2  # and no new ones once steady
    assert 0 < cached3 <= cap
    assert on["first_kept"] and on["same"]  # a block in use is never handed out again
    off, hidden_off = _run(tmp_path, "0", "off")
    assert off["stats"][-1][1:] == [0, 0, 0]  # off: nothing cached, reused or allocated by the cache
    assert off["first_kept"] and off["same"]
    assert torch.equal(hidden_on, hidden_off)


def test_cap_bounds_what_is_kept(tmp_path):
    small, _ = _run(tmp_path, "3", "small")  # 3 MiB: one 2 MiB block fits, the larger ones are freed
    for cached, cap, _, _ in small["stats"]:
        assert cap == 3 << 20 and cached <= cap
    assert small["first_kept"] and small["same"]

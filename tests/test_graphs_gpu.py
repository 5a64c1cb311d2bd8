"""CUDA-graph replay equals eager launches bit for bit (triton backend, fp32/fp16/bf16), at the token buckets' edges,
across buckets sharing one memory pool, above the largest bucket (eager), with hidden states, MPNet's relative
bias and ModernBERT's windows and rotary tables.

The test session runs Triton under the interpreter (tests/conftest.py), so the GPU check runs in a child process
with the interpreter off and prints one JSON line per comparison; skipped without CUDA. The same check runs on CPU
as a dry run (`test_graph_check_dry_run_on_cpu`): the interpreter, the bucketed launches without capture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))

# (name, lengths): T at a bucket, one past it (the next bucket pads with an extra sequence), the exact powers of two
# around the last exact bucket, a ragged batch with 1-token rows; "-replay" cases fall in a bucket already captured
# (another T, the same B and longest-sequence buckets) and must add no graph.
CASES = [("T16", [16]), ("T17", [17]), ("T18-replay", [18]), ("T256", [256]), ("T257", [200, 57]),
         ("ragged", [5, 1, 200, 50, 1]), ("one-token", [1]), ("T20-replay", [20])]
DRY_CASES = [("T16", [16]), ("T17", [17]), ("ragged", [5, 1, 20, 1]), ("T18-replay", [18])]


def _encoders(model, dtype, device):
    from bertfast import Encoder
    from bertfast.backends.cuda.graphs import GraphRunner

    eager = Encoder.from_hf(model, backend="triton", dtype=dtype, graphs=False)
    if device == "cuda":
        graphed = Encoder.from_hf(model, backend="triton", dtype=dtype, graphs=True)
    else:  # the interpreter: the bucketed launches without capture
        graphed = Encoder.from_hf(model, backend="triton", dtype=dtype, graphs=False)
        graphed.engine.run = GraphRunner(graphed.engine.encode, "cpu", capture=False)
    return eager, graphed


def _report(case, dtype, ours, theirs, **extra):
    pairs = [(a, b) for a, b in zip(ours, theirs) if a is not None or b is not None]
    flat = []
    for a, b in pairs:
        flat += list(zip(a, b)) if isinstance(a, tuple) else [(a, b)]
    equal = all(a is not None and b is not None and torch.equal(a, b) for a, b in flat)
    diff = max(((a.float() - b.float()).abs().max().item() for a, b in flat if a is not None and b is not None),
               default=0.0)
    print(json.dumps({"case": case, "dtype": str(dtype), "equal": equal, "max_diff": diff, **extra}), flush=True)


def _graph_checks(device="cuda", dtypes=("float32", "float16", "bfloat16"), cases=None):
    """Child process body: prints one JSON line per (case, dtype)."""
    import conftest
    import modern_models
    import helpers.families as families
    from bertfast.backends.cuda.graphs import GraphRunner
    from bertfast.kernels.triton import INTERPRET

    assert INTERPRET == (device == "cpu"), "CUDA checks need the compiled kernels, the dry run the interpreter"
    cases = CASES if cases is None else cases
    small = max(n for _, lengths in cases for n in lengths) <= 64
    hidden = 64 if small else 128  # the dry run interprets every program: smaller there
    model = conftest.hf_bert(hidden_size=hidden, num_attention_heads=2, intermediate_size=2 * hidden,
                             max_position_embeddings=64 if small else 512).to(device)

    def call(enc, lengths, hidden=False):
        ids, mask, types = (t.to(device) for t in conftest.ragged_batch(lengths, vocab=97))
        out = enc(ids, mask, types, output_hidden_states=hidden)
        return out.last_hidden_state, out.pooler_output, out.hidden_states

    for name in dtypes:
        dtype = getattr(torch, name)
        eager, graphed = _encoders(model, dtype, device)
        for case, lengths in cases:
            _report(case, dtype, call(graphed, lengths), call(eager, lengths),
                    captured=len(graphed.engine.run.captured))
        # Inputs on the host (a tokenizer's tensors) give the bits of inputs on the device.
        host = graphed(*conftest.ragged_batch(cases[0][1], vocab=97))
        _report("host-inputs", dtype, (host.last_hidden_state, host.pooler_output), call(graphed, cases[0][1])[:2])
        lengths = cases[-1][1]
        _report("hidden-states", dtype, call(graphed, lengths, True), call(eager, lengths, True))
        # Above the largest bucket: eager launches, the same bits.
        graphed.engine.run = GraphRunner(graphed.engine.encode, device, buckets=(16,), capture=device == "cuda")
        _report("over-largest", dtype, call(graphed, [20, 3]), call(eager, [20, 3]),
                captured=len(graphed.engine.run.captured))
        _report("at-largest", dtype, call(graphed, [10, 6]), call(eager, [10, 6]),
                captured=len(graphed.engine.run.captured))
    lengths = [9, 1, 30, 17] if small else [90, 1, 300, 17]
    for name, build, batch in (
            ("mpnet", lambda: families.build("mpnet"), lambda: families.batch_for(families.build("mpnet"), lengths)),
            ("modernbert", lambda: modern_models.build("modernbert"), lambda: modern_models.batch(lengths))):
        model = build().to(device)
        made = batch()
        ids, mask = (made[0]["input_ids"], made[1]) if name == "mpnet" else made
        for dtype in (torch.float32, torch.float16)[:1 if device == "cpu" else 2]:
            eager, graphed = _encoders(model, dtype, device)
            ours = graphed(ids.to(device), mask.to(device))
            theirs = eager(ids.to(device), mask.to(device))
            _report(name, dtype, (ours.last_hidden_state,), (theirs.last_hidden_state,),
                    captured=len(graphed.engine.run.captured))


def _run_child(device: str, *args) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1" if device == "cpu" else "0",
               PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    code = f"import test_graphs_gpu as t; t._graph_checks({device!r}, *{args!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _check(rows, cases, dtypes, device):
    per_dtype = len(cases) + 4
    assert len(rows) == per_dtype * len(dtypes) + (2 if device == "cpu" else 4), rows
    for row in rows:
        assert row["equal"], row
    for i in range(len(dtypes)):
        chunk = rows[i * per_dtype:(i + 1) * per_dtype]
        names = [r["case"] for r in chunk]
        # The replays of buckets already captured add no graph; an over-largest call adds none either.
        assert names[-2:] == ["over-largest", "at-largest"]
        if device == "cuda":
            captured = [0] + [r["captured"] for r in chunk[:len(cases)]]
            added = [after - before for before, after in zip(captured, captured[1:])]
            assert added == [0 if name.endswith("-replay") else 1 for name, _ in cases], (names, captured)
            assert chunk[-2]["captured"] == 0 and chunk[-1]["captured"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")
def test_graph_replay_equals_eager_bit_for_bit_on_gpu():
    dtypes = ("float32", "float16", "bfloat16")
    _check(_run_child("cuda", dtypes, CASES), CASES, dtypes, "cuda")


def test_graph_check_dry_run_on_cpu():
    """The GPU check's own code, on the interpreter with the bucketed launches (no capture): it runs, and the
    padded buckets give the eager bits there too."""
    _check(_run_child("cpu", ("float32",), DRY_CASES), DRY_CASES, ("float32",), "cpu")


def test_replay_cases_fall_in_buckets_already_captured():
    """The GPU test's bookkeeping, checked here: each "-replay" case reuses an earlier case's bucket, no other does."""
    from bertfast.backends.cuda.graphs import bucket_for
    from helpers.tokens import tokens_of

    seen = []
    for name, lengths in CASES:
        bucket = bucket_for(tokens_of(lengths))
        assert (bucket in seen) == name.endswith("-replay"), (name, bucket)
        seen.append(bucket)

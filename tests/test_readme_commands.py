"""The README's commands as a user runs them: `python3 -m bertfast demo` and `bench --quick` in a child process (exit
0, the demo's OK line, the bench table's bertfast row validated), and its task heads on the triton backend (under
the Triton interpreter here) against transformers in fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

import bertfast
from bertfast.heads import TaskModel
from helpers.families import COMMON, batch_for
from helpers.outputs import check_against

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 600  # minutes on a loaded 2-core machine; seconds on an idle one


def _bertfast(*args) -> subprocess.CompletedProcess:
    """`python3 -m bertfast ARGS` in a child process from the repository root."""
    return subprocess.run([sys.executable, "-m", "bertfast", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_demo_prints_ok():
    """The README's first command (fewer timed rounds: the timing is not what is tested)."""
    run = _bertfast("demo", "--repeats", "2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[-1] == "OK", run.stdout[-3000:]
    assert any(line.startswith("engine vs fp64 reference, real tokens: max relative error") for line in lines)


def test_bench_quick_validates_the_bertfast_row(tmp_path):
    """`bench --quick` on the tiny random config, one workload: exit 0, and the bertfast row validated against
    transformers' fp32 model before it was timed (status ok, error within its tolerance) and printed in the table."""
    provider = "bertfast-cpu" if bertfast.available_backends("cpu")["cpu"] is None else "bertfast-torch"
    out = tmp_path / "bench.json"
    run = _bertfast("bench", "--quick", "--config", "tiny", "--workloads", "b1xs16", "--dtypes", "fp32",
                    "--providers", f"{provider},hf-sdpa", "--threads", "1", "--repeats", "2", "--budget", "3",
                    "--json", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["provider"]: r for r in json.loads(out.read_text())["rows"]}
    row = rows[provider]
    assert row["status"] == "ok", row["reason"]
    assert row["max_abs_err"] <= row["tolerance"] <= 1e-3
    table = [line.split() for line in run.stdout.splitlines()]
    assert any(cells[:3] == ["b1xs16", provider, "fp32"] and cells[3] != "SKIPPED:" for cells in table), run.stdout


HEADS = ["SequenceClassification", "TokenClassification"]


@pytest.mark.parametrize("task", HEADS)
def test_task_head_on_triton_matches_transformers(tmp_path, task):
    """`bertfast.load(dir, backend="triton")` of a random BertFor<task> saved to disk: every output within 1e-5
    relative of transformers' fp32 (real positions only), on a ragged batch with a 1-token row."""
    from bertfast.kernels.triton import INTERPRET

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 before bertfast.kernels.triton is imported (tests/conftest.py)")
    torch.manual_seed(0)
    model = getattr(transformers, f"BertFor{task}")(transformers.BertConfig(**COMMON, num_labels=3)).eval()
    with torch.no_grad():  # random init leaves LayerNorms at identity and biases at zero
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    kwargs, mask = batch_for(model, [17, 1, 9], seed=4)
    with torch.no_grad():
        ref = model(**kwargs, output_hidden_states=True)
    ours = bertfast.load(tmp_path, backend="triton")
    assert isinstance(ours, TaskModel) and ours.architecture == f"BertFor{task}" and ours.encoder.backend == "triton"
    check_against(ours(**kwargs, output_hidden_states=True), ref, mask)

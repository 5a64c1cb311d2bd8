"""`bertfast gpucheck` on a machine without CUDA: arguments, stage selection, the clean "no CUDA" exit, the stage
runner (child process, JSON result, timeout), the summary, and the parity suite on the cpu backend."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from bertfast import Encoder
from bertfast.tools import cli
from bertfast.tools.gpucheck import cli as gpucheck
from bertfast.tools.gpucheck import parity, stages

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def _args(*argv):
    parser = argparse.ArgumentParser()
    gpucheck.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_stage_selection_keeps_order_and_rejects_unknown_names():
    assert gpucheck.parse_stages("bench, tests,bench") == ["bench", "tests"]
    with pytest.raises(ValueError, match="unknown stage 'benchmark'; known: tests, parity, sweep, sanitizer, bench"):
        gpucheck.parse_stages("benchmark")
    with pytest.raises(ValueError, match="empty"):
        gpucheck.parse_stages(" , ")
    assert _args().stages == ",".join(stages.DEFAULT_STAGES) and "gemm" not in stages.DEFAULT_STAGES


def test_registered_and_bad_usage_exits_2(capsys, tmp_path):
    assert "gpucheck" in cli.COMMANDS
    assert cli.main(["gpucheck", "--out", str(tmp_path), "--stages", "nope"]) == 2
    assert "unknown stage 'nope'" in capsys.readouterr().err
    assert cli.main(["gpucheck", "--out", str(tmp_path), "--deadline", "0"]) == 2
    assert not os.path.exists(tmp_path / "summary.json")


def test_no_cuda_exits_2_with_a_clear_message_and_a_summary(capsys, tmp_path):
    code = cli.main(["gpucheck", "--out", str(tmp_path), "--quick", "--stages", "parity,bench"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no CUDA device here" in err and "torch.cuda.is_available() is False" in err and "nothing was run" in err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "no-cuda" and summary["quick"] is True
    assert summary["stages"] == {"parity": {"status": "skip", "reason": "no CUDA device"},
                                 "bench": {"status": "skip", "reason": "no CUDA device"}}
    env = summary["environment"]
    assert env["torch"] == torch.__version__ and env["cuda_available"] is False and "triton" in env["packages"]


def test_gpu_check_script_passes_its_arguments_and_out(tmp_path):
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=root)
    proc = subprocess.run(["bash", os.path.join(root, "benchmarks", "gpu_check.sh"), "--stages", "sweep"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device here" in proc.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["stages_selected"] == ["sweep"]


def _fake_gpu(monkeypatch):
    real = gpucheck.environment

    def environment():
        env = real()
        env.update(cuda_available=True, gpu={"name": "Fake GPU", "capability": "9.0", "memory_gib": 80.0,
                                             "multiprocessors": 132})
        return env

    monkeypatch.setattr(gpucheck, "environment", environment)


def test_stages_run_in_children_and_the_summary_records_them(monkeypatch, capsys, tmp_path):
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(stages, "find_sanitizer", lambda: None)  # the parent's environment()
    assert cli.main(["gpucheck", "--out", str(tmp_path), "--stages", "sanitizer"]) == 0
    result = json.loads((tmp_path / "sanitizer.json").read_text())
    assert result["status"] == "skip" and "compute-sanitizer not found" in result["reason"]
    assert result["exit_code"] == 0 and result["seconds"] >= 0 and "log_tail" in result
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "pass" and summary["stages"]["sanitizer"]["status"] == "skip"
    assert "stage sanitizer: skip" in capsys.readouterr().out


def test_a_stage_past_its_budget_is_killed_and_fails(tmp_path):
    result = gpucheck.run_stage("tests", _args("--quick"), str(tmp_path), timeout=1.0, device="NVIDIA H200")
    assert result["status"] == "fail" and "timed out after 1 s" in result["reason"]
    written = json.loads((tmp_path / "tests.json").read_text())
    assert written["status"] == "fail" and written["device"] == "NVIDIA H200"  # every result names its device


def test_no_time_left_marks_stages_not_run(monkeypatch, tmp_path):
    _fake_gpu(monkeypatch)
    assert cli.main(["gpucheck", "--out", str(tmp_path), "--stages", "parity", "--deadline", "5"]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stages"]["parity"]["status"] == "not-run" and summary["status"] == "fail"


def test_bench_stage_settings():
    quick = stages.bench_settings(_args("--quick"))
    assert quick["workloads"] == ["b1xs16", "b8xs128", "b32xs512-ragged64"] and quick["dtypes"] == ["fp16"]
    assert quick["providers"] == ["bertfast-triton", "bertfast-triton-eager", "hf-sdpa"]
    full = stages.bench_settings(_args())
    assert full["workloads"] == ["b1xs16", "b1xs128", "b8xs128", "b32xs512", "b32xs512-ragged64"]
    assert full["dtypes"] == ["fp16", "bf16"] and "torch-compile-max" in full["providers"] and full["repeats"] == 30
    mine = stages.bench_settings(_args("--providers", "hf-sdpa", "--dtypes", "bf16", "--workloads", "b2xs8"))
    assert (mine["providers"], mine["dtypes"], mine["workloads"]) == (["hf-sdpa"], ["bf16"], ["b2xs8"])
    result = stages.stage_bench(_args("--providers", "hf-sdpa,nope"))
    assert result["status"] == "fail" and "unknown provider 'nope'" in result["reason"]
    assert "dtype fp8" in stages.stage_bench(_args("--dtypes", "fp8"))["reason"]


def test_bench_stage_dry_run_on_cpu(tmp_path):
    """The stage's loop on CPU with a tiny model: a row per (workload, provider), the file rewritten per workload."""
    args = _args("--config", "tiny", "--workloads", "b1xs8,b2xs8-ragged4", "--providers", "hf-sdpa,bertfast-torch",
                 "--dtypes", "fp32", "--repeats", "2")
    args.result = str(tmp_path / "bench.json")
    result = stages.stage_bench(args, device="cpu")
    assert result["status"] == "pass", result
    assert [(r["workload"], r["provider"]) for r in result["table"]] == [
        ("b1xs8", "hf-sdpa"), ("b1xs8", "bertfast-torch"), ("b2xs8-ragged4", "hf-sdpa"),
        ("b2xs8-ragged4", "bertfast-torch")]
    assert all(r["status"] == "ok" and r["ms_median"] > 0 for r in result["table"])
    assert json.loads((tmp_path / "bench.json").read_text())["status"] == "running"  # the last partial write


def test_gpu_test_files_and_junit_counts(tmp_path):
    found = [os.path.basename(f) for f in stages.gpu_test_files(os.path.join(stages.REPO, "tests"))]
    assert "test_triton_gpu.py" in found and "test_graphs_gpu.py" in found and "test_gpucheck.py" not in found
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                   '<testcase classname="t" name="a"/><testcase classname="t" name="b">'
                   '<failure message="boom">x</failure></testcase><testcase classname="t" name="c"><skipped/>'
                   '</testcase></testsuite></testsuites>')
    counts = stages.junit_counts(str(xml))
    assert counts["tests"] == 3 and counts["failures"] == 1 and counts["skipped"] == 1
    assert counts["failed"] == [{"test": "t::b", "message": "boom"}]


# --- the parity suite, on the cpu backend (the native engine) -------------------------------------------------------


def test_every_family_builds_with_limit_rows_and_one_token_rows():
    import transformers

    skipped = set()
    for family in parity.FAMILIES:
        try:
            model = parity.build_model(family)
        except parity.FamilySkipped:  # the reference itself is missing from this transformers (5.17: no Gte*)
            skipped.add(family)
            continue
        assert model.config.model_type.replace("-", "_") == family.replace("-", "_")
        lengths = parity.batch_lengths(126)
        assert lengths[0].count(1) == 2 and 126 in lengths[0] and lengths[1] == [1]
        inputs, mask = parity.make_inputs(model, lengths[0])
        pad = model.config.pad_token_id or 0
        assert bool((inputs["input_ids"][mask.bool()] != pad).all()) and mask.sum(1).tolist() == lengths[0]
    assert skipped == {f for f, (prefix, _) in parity.FAMILIES.items() if not hasattr(transformers, prefix + "Model")}


def test_parity_suite_passes_on_the_cpu_backend():
    families = ("bert", "mpnet", "modernbert")  # plain; relative bias; rotary, windows, gated FFN
    rows = parity.run_parity("cpu", "cpu", ("fp32",), families)  # the native engine: batch-invariant
    assert len(rows) == 3 * len(families) and all(r.status == "PASS" for r in rows), rows
    assert {r.mode for r in rows} == {"default"}
    judged = [r for r in rows if not r.batch.startswith("alone:")]
    assert len(judged) == 2 * len(families) and all(r.tol == parity.FP32_LIMIT for r in judged)
    alone = [r for r in rows if r.batch.startswith("alone:")]
    assert len(alone) == len(families) and all(r.batch.startswith("alone:1x57x12") and
                                               r.batch.endswith(f"+in{parity.LARGE_BATCH_ROWS}rows") for r in alone)
    assert all(r.note == "invariance: bit for bit" for r in alone)
    limit_rows = [r for r in rows if r.family == "bert" and r.batch.startswith("128x1x")]
    assert limit_rows  # the row at the position limit (128) ran
    assert parity.summarize(rows)["counts"] == {"PASS": len(rows), "FAIL": 0, "SKIP": 0}


def test_invariance_check_names_a_row_that_changes_with_its_batch():
    model = parity.build_model("bert")
    enc = Encoder.from_hf(model, backend="cpu")
    inputs, mask = parity.make_inputs(model, parity.batch_lengths(128)[0])
    batch_out = parity._outputs(enc, inputs)[0]
    assert parity._invariance(enc, inputs, batch_out, mask) == (True, 0.0, "")
    moved = batch_out.clone()
    moved[2, 5, 0] += 1e-6  # the 57-token row, inside the batch
    equal, diff, differing = parity._invariance(enc, inputs, moved, mask)
    assert not equal and differing == "57" and 0 < diff < 1e-5
    large = parity.large_batch(model, inputs, 128)
    assert len(large["input_ids"]) == parity.LARGE_BATCH_ROWS and torch.equal(large["input_ids"][:6],
                                                                               inputs["input_ids"])
    assert parity._invariance(enc, inputs, batch_out, mask, large) == (True, 0.0, "")
    equal, _, differing = parity._invariance(enc, inputs, moved, mask, large)
    assert not equal and differing.split(",") == ["57", f"57 (in {int(large['attention_mask'].sum())} tokens)"]


def test_budgets_override_the_stage_defaults_and_reject_bad_items():
    base = gpucheck.QUICK_BUDGET_S
    assert gpucheck.parse_budgets("", base) == base
    got = gpucheck.parse_budgets("parity=200, bench=90.5", base)
    assert got == {**base, "parity": 200.0, "bench": 90.5}
    for bad in ("parity", "paritee=10", "bench=0", "bench=x"):
        with pytest.raises(ValueError, match="--budgets"):
            gpucheck.parse_budgets(bad, base)


def test_parity_judge_fails_a_wrong_output_and_a_missing_pooler():
    oracle = (torch.randn(2, 3, 4), torch.randn(2, 4))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    off = (oracle[0] + 1e-3, oracle[1])
    row = parity._judge(parity.ParityRow("bert", "fp32", "default", "2x1", "FAIL"), torch.float32, off, oracle,
                        oracle, mask)
    assert row.status == "FAIL" and row.rel_err > parity.FP32_LIMIT
    row = parity._judge(parity.ParityRow("bert", "fp16", "default", "2x1", "FAIL"), torch.float16,
                        (oracle[0], None), oracle, oracle, mask)
    assert row.status == "FAIL" and "pooler_output is missing" in row.note
    lowp = (oracle[0] + 1e-3, oracle[1])  # transformers' own fp16 error is what ours may double
    row = parity._judge(parity.ParityRow("bert", "fp16", "default", "2x1", "FAIL"), torch.float16,
                        (oracle[0] + 1.5e-3, oracle[1]), lowp, oracle, mask)
    assert row.status == "PASS" and row.ref_rel_err > 0


# --- benchmarks/gpu_overhead.py: where a small forward's time goes ----------------------------------------------


def _gpu_overhead():
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("gpu_overhead", os.path.join(root, "benchmarks", "gpu_overhead.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_overhead_needs_cuda(capsys, tmp_path):
    assert _gpu_overhead().main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err and not os.listdir(tmp_path)


def test_gpu_overhead_times_every_host_stage(monkeypatch):
    # The stages on the cpu backend (no graphs): each a positive median, the pooler included.
    module = _gpu_overhead()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    model = parity.build_model("bert")
    enc = Encoder.from_hf(model, backend="cpu")
    inputs, _ = parity.make_inputs(model, [5, 1, 9])
    times = module.stages(enc, inputs, calls=3)
    assert set(times) == {"inputs to host", "check_inputs (host)", "pack (host)", "to device",
                          "run (graph replay + fill)", "pad", "whole call", "pooler"}
    assert all(t > 0 for t in times.values())
    assert module.graph_gpu_us(enc, inputs, 3) is None  # no captured graph off CUDA

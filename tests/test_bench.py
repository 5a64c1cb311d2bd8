"""`bertfast bench` end to end on the tiny config, its validation gate, and the shared input builders.

Timings are never asserted (the machine is shared); what is checked is the code path: every
requested row is present with a status, valid rows are timed and consistent, a wrong provider is
refused before timing, and an uninstallable one is reported as skipped with its reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import sys
import time
import zlib

import pytest
import torch

from bertfast.tools.bench import measure, providers, report, runner
from bertfast.tools.bench.source import load_source
from bertfast.tools import workloads
from bertfast.tools.cli import main


@pytest.fixture(autouse=True)
def _restore_threads():
    # The CLI runs with --threads 1 (OpenMP barriers stall under a loaded machine and make tiny
    # models crawl); it sets torch's global thread count, which other tests must get back.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _run_cli(args) -> int:
    # In this process: the tests swap in providers of their own (monkeypatch), which a worker process
    # would not see; test_process_isolation covers the workers.
    return main(["bench", "--config", "tiny", "--threads", "1", "--repeats", "3", "--budget", "5",
                 "--isolation", "none", *args])


def _rows(path):
    with open(path) as f:
        report = json.load(f)
    return report, {(r["workload"], r["dtype"], r["provider"]): r for r in report["rows"]}


def _png_size(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR"
    assert zlib.crc32(data[12:16 + length]) & 0xFFFFFFFF == struct.unpack(">I", data[16 + length:20 + length])[0]
    return struct.unpack(">II", data[16:24])


def test_bench_end_to_end_tiny(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    try:
        import onnxruntime  # noqa: F401
        has_ort = True
    except ImportError:
        has_ort = False
    rc = _run_cli(["--workloads", "b2xs16,b3xs24-uniform", "--dtypes", "fp32,bf16",
                   "--providers", "bertfast-torch,hf-sdpa,hf-eager,onnxruntime",
                   "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    report, rows = _rows(out_json)
    assert len(report["rows"]) == 2 * 2 * 4
    assert report["machine"]["torch_threads"] == 1
    assert report["versions"]["torch"] == torch.__version__
    for wl, real in (("b2xs16", 32), ("b3xs24-uniform", sum(workloads.sample_lengths(3, 24, "uniform")))):
        for dtype in ("fp32", "bf16"):
            for prov in ("bertfast-torch", "hf-sdpa", "hf-eager"):
                r = rows[(wl, dtype, prov)]
                assert r["status"] == "ok", r["reason"]
                assert r["real_tokens"] == real
                assert len(r["times_ms"]) == r["repeats"] >= 3
                assert r["ms_min"] <= r["ms_median"] <= r["ms_p90"]
                assert r["tokens_per_s"] == pytest.approx(real / (r["ms_median"] / 1e3))
                assert r["max_abs_err"] <= r["tolerance"]
                assert r["warmup_s"] > 0
            assert rows[(wl, dtype, "hf-sdpa")]["speedup_vs_hf_sdpa"] == pytest.approx(1.0)
            ratio = rows[(wl, dtype, "hf-sdpa")]["ms_median"] / rows[(wl, dtype, "bertfast-torch")]["ms_median"]
            assert rows[(wl, dtype, "bertfast-torch")]["speedup_vs_hf_sdpa"] == pytest.approx(ratio)
        # Only the fp32 tolerance is tight; bf16 adds twice HF's own bf16 error.
        assert rows[(wl, "fp32", "bertfast-torch")]["max_abs_err"] < 1e-4
        ort_fp32, ort_bf16 = rows[(wl, "fp32", "onnxruntime")], rows[(wl, "bf16", "onnxruntime")]
        assert ort_bf16["status"] == "skipped" and "fp32 only" in ort_bf16["reason"]
        if has_ort:
            assert ort_fp32["status"] == "ok", ort_fp32["reason"]
            assert ort_fp32["max_abs_err"] < 1e-4
        else:
            assert ort_fp32["status"] == "skipped" and "not installed" in ort_fp32["reason"]
    width, height = _png_size(out_png)
    assert width > 200 and height > 200
    table = capsys.readouterr().out
    assert "tokens/s" in table and "vs sdpa" in table
    assert sum(line.startswith("b3xs24-uniform") for line in table.splitlines()) == 8


def _wrong_mask_provider(source, dtype):
    """bertfast's torch backend called without the attention mask: right for full rows only."""
    from bertfast import Encoder

    enc = Encoder.from_hf(source.reference, backend="torch", dtype=dtype)
    return providers.Provider("wrong-mask", dtype, lambda b: enc(b.input_ids, None, b.token_type_ids).last_hidden_state)


def test_validation_refuses_a_wrong_provider_before_timing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(providers.FACTORIES, "wrong-mask", _wrong_mask_provider)
    out_json = tmp_path / "bench.json"
    rc = _run_cli(["--workloads", "b2xs16,b4xs16-uniform", "--dtypes", "fp32",
                   "--providers", "bertfast-torch,hf-sdpa,wrong-mask", "--json", str(out_json)])
    assert rc == 0  # a peer's wrong row is reported in the table; only a bertfast row fails the run
    printed = capsys.readouterr()
    assert any(line.startswith("b4xs16-uniform") and "wrong-mask" in line and "ERROR: wrong output" in line
               for line in printed.out.splitlines()), printed.out
    assert "1 row(s) failed validation or crashed, 0 of them bertfast's" in printed.err
    _, rows = _rows(out_json)
    # Full rows: ignoring the mask changes nothing, and the gate lets it through.
    assert rows[("b2xs16", "fp32", "wrong-mask")]["status"] == "ok"
    bad = rows[("b4xs16-uniform", "fp32", "wrong-mask")]
    assert bad["status"] == "error"
    assert "wrong output" in bad["reason"]
    assert bad["max_abs_err"] > bad["tolerance"]
    assert bad["times_ms"] == [] and bad["ms_median"] is None and bad["speedup_vs_hf_sdpa"] is None
    assert rows[("b4xs16-uniform", "fp32", "bertfast-torch")]["status"] == "ok"


def test_a_wrong_bertfast_row_fails_the_run(monkeypatch, capsys):
    # The same mask-ignoring provider as a bertfast row: its refusal fails the run.
    monkeypatch.setitem(providers.FACTORIES, "bertfast-torch", _wrong_mask_provider)
    rc = _run_cli(["--workloads", "b4xs16-uniform", "--dtypes", "fp32", "--providers", "bertfast-torch,hf-sdpa"])
    assert rc == 1
    printed = capsys.readouterr()
    assert any(line.startswith("b4xs16-uniform") and "bertfast-torch" in line and "ERROR: wrong output" in line
               for line in printed.out.splitlines()), printed.out
    assert "1 row(s) failed validation or crashed, 1 of them bertfast's" in printed.err


def test_openvino_rows_match_the_reference():
    import openvino as ov
    has_nncf = importlib.util.find_spec("nncf") is not None
    from bertfast.tools.bench import exported

    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in exported._ONEDNN_NO_BF16  # BERTFAST_ISA=avx2 ...
    # The bf16 row runs where OpenVINO's CPU plugin lists BF16 (AVX-512 BF16, AMX); on other AVX-512 CPUs it would
    # emulate bf16 (58x its fp32 time on a Cascade Lake), and the provider skips it.
    bf16_runs = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES") and not capped
    source = load_source(config_name="tiny")
    rows = runner.run_bench(source, [workloads.Workload.parse("b2xs16-uniform")], ["fp32", "bf16"],
                            ["openvino", "openvino-int8"], repeats=1, min_repeats=1, progress=None, isolation="none")
    by = {(r.provider, r.dtype): r for r in rows}
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in exported._ONEDNN_NO_OPENVINO:  # BERTFAST_ISA=portable
        assert all(r.status == "skipped" and ("fails under ONEDNN_MAX_CPU_ISA" in r.reason or "fp32 pass" in r.reason)
                   for r in rows), [(r.provider, r.dtype, r.reason) for r in rows]
        return
    fp32 = by[("openvino", "fp32")]
    assert fp32.status == "ok", fp32.reason
    assert fp32.info["inference_precision"] == "f32" and fp32.max_abs_err < 1e-4
    bf16 = by[("openvino", "bf16")]
    if bf16_runs:
        assert bf16.status == "ok", bf16.reason
        assert bf16.info["inference_precision"] == "bf16" and bf16.max_abs_err <= bf16.tolerance
    else:
        assert bf16.status == "skipped" and "no native bf16" in bf16.reason
    int8 = by[("openvino-int8", "fp32")]
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in exported._ONEDNN_NO_INT8_FC:
        assert int8.status == "skipped" and "find no kernel under ONEDNN_MAX_CPU_ISA" in int8.reason
    elif has_nncf:
        assert int8.status == "ok", int8.reason
        assert int8.info["min_token_cosine"] >= runner.INT8_MIN_COSINE and int8.tolerance is None
    else:
        assert int8.status == "skipped" and "not installed (nncf)" in int8.reason
    assert by[("openvino-int8", "bf16")].status == "skipped" and "fp32 pass" in by[("openvino-int8", "bf16")].reason
    with pytest.raises(providers.ProviderSkipped, match="fp32 and bf16 rows only"):
        providers.check_runnable("openvino", source, torch.float16)


def test_failed_or_missing_providers_are_skipped_with_reason(monkeypatch, tmp_path):
    def broken(source, dtype):
        raise RuntimeError("no such device")

    monkeypatch.setitem(providers.FACTORIES, "broken", broken)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime -> ImportError
    monkeypatch.setitem(sys.modules, "openvino", None)
    source = load_source(config_name="tiny")
    rows = runner.run_bench(source, [workloads.Workload.parse("b1xs8")], ["fp32"],
                           ["bertfast-torch", "broken", "onnxruntime", "openvino", "hf-sdpa"], repeats=1,
                           min_repeats=1, progress=None, isolation="none")
    by = {r.provider: r for r in rows}
    assert [r.provider for r in rows] == ["bertfast-torch", "broken", "onnxruntime", "openvino", "hf-sdpa"]
    assert by["broken"].status == "skipped" and "RuntimeError: no such device" in by["broken"].reason
    assert by["onnxruntime"].status == "skipped" and "not installed" in by["onnxruntime"].reason
    assert by["openvino"].status == "skipped" and "not installed (openvino)" in by["openvino"].reason
    assert by["bertfast-torch"].status == by["hf-sdpa"].status == "ok"
    table = report.format_table(rows)
    assert "SKIPPED: set-up failed: RuntimeError: no such device" in table


@pytest.mark.parametrize("settle_ms", [0.0, 1.0])
def test_settle_pause_and_untimed_call_before_each_timed_call(settle_ms, tmp_path, monkeypatch):
    # With a settle time every timed call is preceded by a pause and one untimed call of the same
    # provider (so the previous provider's threads are asleep and this one's are awake); without, plain
    # back-to-back rounds.
    calls = []

    def counting(source, dtype):
        from bertfast import Encoder

        enc = Encoder.from_hf(source.reference, backend="torch", dtype=dtype)

        def fn(b):
            calls.append(time.perf_counter())
            return enc(b.input_ids, b.attention_mask, b.token_type_ids).last_hidden_state

        return providers.Provider("counting", dtype, fn)

    monkeypatch.setitem(providers.FACTORIES, "counting", counting)
    out_json = tmp_path / "bench.json"
    assert _run_cli(["--workloads", "b2xs16", "--dtypes", "fp32", "--providers", "counting",
                     "--settle-ms", str(settle_ms), "--json", str(out_json)]) == 0
    report, rows = _rows(out_json)
    row = rows[("b2xs16", "fp32", "counting")]
    assert report["settings"]["settle_ms"] == settle_ms
    # Set-up: first call, 1 warm-up, the validated call (its time sizes the rounds); then the rounds.
    assert len(calls) == 3 + row["repeats"] * (2 if settle_ms else 1)


def test_process_isolation_runs_each_provider_in_its_own_worker(tmp_path):
    # Each provider is built and timed in a worker process; its output comes back for validation and
    # matches the same provider run in this process exactly (same code, same single thread).
    from bertfast.tools.bench.process import Local, Worker

    torch.set_num_threads(1)
    out_json = tmp_path / "bench.json"
    assert main(["bench", "--config", "tiny", "--threads", "1", "--repeats", "3", "--budget", "5",
                 "--settle-ms", "1", "--workloads", "b2xs16-ragged", "--dtypes", "fp32",
                 "--providers", "bertfast-torch,hf-sdpa", "--json", str(out_json)]) == 0
    report, rows = _rows(out_json)
    assert report["settings"]["isolation"] == "process"
    for provider in ("bertfast-torch", "hf-sdpa"):
        row = rows[("b2xs16-ragged", "fp32", provider)]
        assert row["status"] == "ok" and row["repeats"] == 3 and row["max_abs_err"] <= row["tolerance"]

    source = load_source(config_name="tiny")
    batch = workloads.make_batch(2, 16, "ragged", vocab_size=source.config.vocab_size)
    worker = Worker(source.spec, "bertfast-torch", "fp32", "cpu")
    try:
        local = Local(providers.setup("bertfast-torch", source, torch.float32), "cpu")
        worker.load(batch)
        local.load(batch)
        out_w, out_l = worker.call()[1], local.call()[1]
        assert out_w.dtype == out_l.dtype == torch.float32
        assert torch.equal(out_w, out_l)
        assert worker.timed(0.0) > 0
        # An error inside the worker comes back as the parent's exception, and the worker lives on.
        worker.load(workloads.make_batch(1, 8, "full", vocab_size=30522))  # ids past the tiny vocabulary
        with pytest.raises(RuntimeError, match="ValueError: input_ids values must be in"):
            worker.call()
        worker.load(batch)
        assert torch.equal(worker.call()[1], out_l)
    finally:
        worker.close()
    # What cannot run is refused in the parent before a worker starts, and by the worker itself too.
    with pytest.raises(providers.ProviderSkipped, match="fp32 pass"):
        providers.check_runnable("bertfast-int8", source, torch.bfloat16)
    with pytest.raises(providers.ProviderSkipped, match="fp32 pass"):
        Worker(source.spec, "bertfast-int8", "bf16", "cpu")


@pytest.mark.parametrize("args, message", [
    pytest.param(["--providers", "nope"], "unknown provider 'nope'", id="unknown-provider"),
    pytest.param(["--workloads", "b8s128"], "is not of the form", id="bad-workload"),
    pytest.param(["--dtypes", "fp8"], "unknown dtype 'fp8'", id="bad-dtype"),
    pytest.param(["--repeats", "0"], "--repeats must be >= 1", id="zero-repeats"),
    pytest.param(["--settle-ms", "-1"], "--settle-ms must be >= 0", id="negative-settle"),
])
def test_bad_arguments_exit_2_with_message(args, message, capsys):
    assert _run_cli(args) == 2
    assert message in capsys.readouterr().err


def test_isa_tiers_each_in_a_child_with_one_json(tmp_path, capfd):
    """--isa runs the grid once per tier in a child process (BERTFAST_ISA set there), prints each tier's
    cpu_info line and table, lists tiers the CPU lacks as skipped, and merges every tier's rows."""
    from bertfast.backends.cpu import isa

    supported = isa.supported_tiers()
    if not supported:
        pytest.skip("bertfast._C is not built: no tier to run")
    lacking = [t for t in reversed(isa.TIERS) if t not in supported]
    tiers = ["portable"] + lacking[:1]
    out_json = tmp_path / "tiers.json"
    assert _run_cli(["--isa", ",".join(tiers), "--workloads", "b1xs16", "--dtypes", "fp32,auto",
                     "--providers", "bertfast-cpu", "--repeats", "1", "--settle-ms", "0",
                     "--json", str(out_json)]) == 0
    printed = capfd.readouterr().out
    assert "=== ISA tier portable" in printed and "isa portable (detected" in printed
    report = json.loads(out_json.read_text())
    assert report["isa_tiers"]["ran"] == ["portable"]
    assert list(report["tiers"]) == ["portable"]
    assert report["tiers"]["portable"]["machine"]["cpu_info"]["active"] == "portable"
    rows = report["rows"]
    assert {(r["isa"], r["dtype"], r["status"]) for r in rows} == {("portable", "fp32", "ok")}  # auto = fp32 there
    for tier in lacking[:1]:
        assert f"=== ISA tier {tier}: skipped: this CPU does not support the {tier} tier" in printed
        assert tier in report["isa_tiers"]["skipped"]


def test_isa_argument_errors(capsys):
    assert _run_cli(["--isa", "sse9"]) == 2
    assert "--isa: unknown tier(s) sse9" in capsys.readouterr().err
    from bertfast.tools.bench.tiers import parse_tiers

    assert parse_tiers("all") == ["amx", "avx512_vnni", "avx512_vnni-nobf16", "avx2", "portable"]
    assert parse_tiers("avx2,avx512_vnni-nobf16") == ["avx512_vnni-nobf16", "avx2"]
    assert parse_tiers("portable,avx2") == ["avx2", "portable"]
    assert parse_tiers("avx2,amx_emulated") == ["amx_emulated", "avx2"]  # by name only: not in "all"


def test_peak_memory_sees_a_large_temporary():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here: peak RSS cannot be reset")
    with measure.PeakMemory("cpu") as mem:
        t = torch.ones(64 * 2**20 // 4)  # 64 MB, touched
        del t
    assert 56 <= mem.mb <= 200



def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert _run_cli(["--workloads", "b1xs8", "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "bertfast[plot]" in err
    assert not (tmp_path / "x.png").exists()


def test_interleaved_rotates_the_start_and_pauses_the_collector():
    import gc

    order, gc_on = [], []

    def contender(name):
        def call():
            order.append(name)
            gc_on.append(gc.isenabled())
            return 1.0

        return call

    times = measure.interleaved({"a": contender("a"), "b": contender("b"), "c": contender("c")}, 3, warmup=1)
    assert times == {"a": [1.0] * 3, "b": [1.0] * 3, "c": [1.0] * 3}
    assert order == ["a", "b", "c"] + ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # warm-up, then rotated
    assert gc_on[3:] == [False] * 9 and gc.isenabled()
    failures = []

    def broken():
        raise RuntimeError("boom")

    times = measure.interleaved({"ok": measure.timer(lambda: None), "bad": broken}, 2,
                                on_error=lambda name, e: failures.append((name, str(e))))
    assert len(times["ok"]) == 2 and all(t >= 0 for t in times["ok"]) and times["bad"] == []
    assert failures == [("bad", "boom")] * 2
    with pytest.raises(RuntimeError, match="boom"):
        measure.interleaved({"bad": broken}, 1)


# --- shared input builders ---------------------------------------------------------------------

@pytest.mark.parametrize("dist", workloads.LENGTH_DISTRIBUTIONS)
def test_make_batch_lengths_and_mask(dist):
    b = workloads.make_batch(16, 48, dist, vocab_size=30522, seed=3)
    assert b.shape == (16, 48)
    assert b.attention_mask.sum(1).tolist() == b.lengths
    lo = {"full": 48, "uniform": 12, "ragged": 16, "short": 4}[dist]
    assert all(lo <= n <= 48 for n in b.lengths)
    real = b.attention_mask.bool()
    assert bool((b.input_ids[~real] == 0).all()) and bool((b.token_type_ids[~real] == 0).all())
    assert bool((b.input_ids[:, 0] == 101).all())
    assert int(b.input_ids[real].min()) >= 101 and int(b.input_ids.max()) < 30522
    again = workloads.make_batch(16, 48, dist, vocab_size=30522, seed=3)
    assert torch.equal(again.input_ids, b.input_ids)


def test_ragged_distribution_is_stratified_uniform_16_to_seqlen():
    # The batch's lengths are the evenly spaced quantiles of U{16..128}: its fill is the mean's.
    lengths = workloads.sample_lengths(8, 128, "ragged", seed=1)
    assert sorted(lengths) == [23, 37, 51, 65, 79, 93, 107, 121]
    assert sum(lengths) / (8 * 128) == pytest.approx(72 / 128)
    assert workloads.sample_lengths(8, 128, "ragged", seed=2) != lengths  # order shuffled by seed
    big = workloads.sample_lengths(1000, 128, "ragged")
    assert min(big) == 16 and max(big) == 128
    assert workloads.sample_lengths(3, 10, "ragged") == [10, 10, 10]  # seqlen below 16: full


def test_short_distribution_is_short():
    lengths = workloads.sample_lengths(2000, 512, "short")
    median = sorted(lengths)[1000]
    assert 16 <= median <= 24 and max(lengths) < 512 / 2


def test_random_weights_match_random_hf_model():
    model = workloads.random_hf_model("tiny", seed=5)
    w = workloads.random_weights("tiny", seed=5)
    sd = model.state_dict()
    assert torch.equal(w.layers[1].qkv_weight[:64], sd["encoder.layer.1.attention.self.query.weight"])
    assert torch.equal(w.layers[0].ffn_ln_bias, sd["encoder.layer.0.output.LayerNorm.bias"])
    assert not torch.equal(w.layers[0].ffn_ln_bias, torch.zeros_like(w.layers[0].ffn_ln_bias))


@pytest.mark.parametrize("text", ["b8s128", "b0xs16", "b8xs128-long", "8x128"])
def test_workload_parse_rejects(text):
    with pytest.raises(ValueError, match="b<batch>xs<seqlen>"):
        workloads.Workload.parse(text)


def test_workload_parse_roundtrip():
    for name in workloads.DEFAULT_WORKLOADS + workloads.QUICK_WORKLOADS:
        assert workloads.Workload.parse(name).name == name


def test_steal_fraction_from_proc_stat_ticks():
    assert measure.steal_fraction((10, 1000), (60, 2000)) == pytest.approx(0.05)
    assert measure.steal_fraction(None, (1, 2)) is None
    assert measure.steal_fraction((5, 100), (5, 100)) is None  # no time passed
    ticks = measure.cpu_ticks()
    if ticks is not None:  # Linux: steal <= total
        assert 0 <= ticks[0] <= ticks[1]


def test_several_configs_one_table_and_json_each(tmp_path, monkeypatch, capsys):
    # A small ModernBERT next to the tiny BERT: the other families' random models come from their own classes
    # and take no token types.
    monkeypatch.setitem(workloads.CONFIGS, "tiny-modernbert", dict(
        model_type="modernbert", hidden_size=64, num_attention_heads=4, num_hidden_layers=3, intermediate_size=96,
        vocab_size=1000, pad_token_id=0, local_attention=8, global_attn_every_n_layers=2))
    out = tmp_path / "bench.json"
    assert main(["bench", "--config", "tiny,tiny-modernbert", "--threads", "1", "--repeats", "2", "--budget", "3",
                 "--isolation", "none", "--settle-ms", "0", "--workloads", "b2xs32-ragged", "--dtypes", "fp32",
                 "--providers", "bertfast-torch,hf-sdpa", "--json", str(out)]) == 0
    assert capsys.readouterr().out.count("\nworkload ") == 2
    for name in ("tiny", "tiny-modernbert"):
        report, rows = _rows(tmp_path / f"bench.{name}.json")
        assert all(r["status"] == "ok" and r["max_abs_err"] <= r["tolerance"] for r in rows.values()), rows
        assert len(rows) == 2
    assert not workloads.make_batch(2, 8, vocab_size=50, type_vocab_size=0).inputs().get("token_type_ids")
    assert main(["bench", "--config", "tiny,nope"]) == 2
    assert "unknown config 'nope'" in capsys.readouterr().err


def test_a_model_without_sdpa_is_timed_against_hf_eager(tmp_path, monkeypatch, capsys):
    # DeBERTa-v2 (deberta-v3-base's layout, small): transformers runs it eager only, so hf-sdpa is a skipped row
    # that says so and every speedup is relative to hf-eager, in the table, the JSON and torch-compile's model.
    cfg = {**workloads.CONFIGS["deberta-v3-base"], "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 1000, "position_buckets": 16}
    monkeypatch.setitem(workloads.CONFIGS, "tiny-deberta", cfg)
    assert workloads.model_config("deberta-v3-base").family == "deberta-v2"
    out = tmp_path / "bench.json"
    assert main(["bench", "--config", "tiny-deberta", "--threads", "1", "--repeats", "2", "--budget", "3",
                 "--isolation", "none", "--settle-ms", "0", "--workloads", "b2xs40-ragged", "--dtypes", "fp32",
                 "--providers", "bertfast-torch,hf-eager,hf-sdpa", "--json", str(out)]) == 0
    assert "'vs sdpa' = hf-eager median" in capsys.readouterr().out
    report, rows = _rows(out)
    assert report["settings"]["baseline"] == "hf-eager"
    sdpa, eager, ours = (rows[("b2xs40-ragged", "fp32", p)] for p in ("hf-sdpa", "hf-eager", "bertfast-torch"))
    assert sdpa["status"] == "skipped" and "DebertaV2Model with eager attention only" in sdpa["reason"]
    assert eager["speedup_vs_hf_sdpa"] == pytest.approx(1.0)
    assert ours["status"] == "ok" and ours["max_abs_err"] <= ours["tolerance"]
    assert ours["speedup_vs_hf_sdpa"] == pytest.approx(eager["ms_median"] / ours["ms_median"])

"""PyLate run in a child process on its side environment, for tests/test_colbert.py.

PyLate 1.6 pins sentence-transformers 5.3.0 and the test extra asks for 6.2 or later, so `bash install.sh --test`
installs those two alone (pip --no-deps --target) into the repository's .side/pylate folder. `run` starts this module
with that folder first on PYTHONPATH, so sentence-transformers 5.3 shadows the main environment's in the child only
(torch, transformers and the rest are the main environment's). The child builds and saves random checkpoints with
PyLate (`helpers.colbert.save_with_pylate`), writes PyLate's `encode` vectors and `pylate.scores`' MaxSim as .npy
files (ragged lists as .npz), and reports `ColBERT.from_pylate` and `bertfast.optimize` on an in-memory PyLate model;
the test process compares them with bertfast's. Nothing is downloaded (HF_HUB_OFFLINE=1); the child is bounded by
a timeout.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
SIDE = REPO / ".side" / "pylate"
TESTS = REPO / "tests"
DISTRIBUTIONS = ("pylate", "sentence-transformers")  # what install.sh puts there, pinned
TIMEOUT_S = 600
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def side_missing() -> str | None:
    """None when the side environment holds PyLate and sentence-transformers, else what is missing and the fix."""
    found = {d.metadata["Name"].lower().replace("_", "-") for d in metadata.distributions(path=[str(SIDE)])}
    missing = [name for name in DISTRIBUTIONS if name not in found]
    if not missing:
        return None
    return (f"PyLate's side environment {SIDE} is not installed ({' and '.join(missing)} missing there; PyLate "
            "1.6 pins sentence-transformers 5.3.0, the test extra asks >= 6.2): run `bash install.sh --test` "
            "(BERTFAST_ALLOW_MISSING=1 skips these tests instead)")


def save_ragged(path, arrays) -> None:
    np.savez(path, *[np.asarray(a) for a in arrays])


def load_ragged(path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def run(job: dict, out: pathlib.Path) -> dict:
    """Runs `main` on `job` in a child on the side environment, writing into `out`; returns its report.

    job: tokenizer (a directory), texts, batch_size, models ({name: {seed, options}}: `save_with_pylate`'s
    arguments), from_pylate (a model's name), scores ([[queries, documents]]: .npz names in `out`, ragged lists).
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(job), encoding="utf-8")
    path = [str(SIDE), str(TESTS)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join(path)}
    try:
        child = subprocess.run([sys.executable, "-m", "helpers.pylate_side", str(out)], cwd=TESTS, env=env,
                               capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"PyLate's child ran past {TIMEOUT_S} s; its stderr ended:\n{(e.stderr or '')[-4000:]}")
    if child.returncode != 0:
        raise RuntimeError(f"PyLate's child exited {child.returncode}; its stderr ended:\n{child.stderr[-4000:]}")
    return json.loads((out / "report.json").read_text(encoding="utf-8"))


def _from_pylate(model, texts) -> dict:
    """bertfast.ColBERT.from_pylate's vectors of an in-memory PyLate model, and what bertfast.optimize does to it."""
    import bertfast

    ours = bertfast.ColBERT.from_pylate(model, backend="cpu")
    arrays = {f"from_pylate-{kind}": ours.encode(texts, is_query=kind == "query") for kind in ("query", "document")}
    try:
        bertfast.optimize(model, strict=True)
        strict = None
    except bertfast.EngineUnsupported as e:
        strict = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        returned_model = bertfast.optimize(model) is model
    arrays["after_optimize"] = model.encode(texts[:4])
    arrays["from_pylate-first4"] = ours.encode(texts[:4])
    return dict(arrays=arrays, strict_error=strict, returned_model=returned_model,
                warnings=[f"{w.category.__name__}: {w.message}" for w in caught])


def main(out: pathlib.Path) -> None:
    import sentence_transformers
    import torch
    import transformers
    from pylate import models, scores

    from helpers.colbert import save_with_pylate

    job = json.loads((out / "job.json").read_text(encoding="utf-8"))
    report = dict(versions={m.__name__: m.__version__ for m in (sentence_transformers, transformers, torch)},
                  pylate=metadata.version("pylate"), sentence_transformers_file=sentence_transformers.__file__)
    if not pathlib.Path(sentence_transformers.__file__).is_relative_to(SIDE):
        raise SystemExit(f"sentence-transformers was imported from {sentence_transformers.__file__}, not {SIDE}")

    def load(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return models.ColBERT(str(path), device="cpu")

    texts = job["texts"]
    for name, spec in job["models"].items():
        save_with_pylate(out / name, job["tokenizer"], seed=spec["seed"], **spec["options"])
        model = load(out / name)
        for kind in ("query", "document"):
            save_ragged(out / f"{name}-{kind}.npz",
                        model.encode(texts, is_query=kind == "query", batch_size=job["batch_size"]))
    if job.get("from_pylate"):
        result = _from_pylate(load(out / job["from_pylate"]), texts)
        for name, arrays in result.pop("arrays").items():
            save_ragged(out / f"{name}.npz", arrays)
        report["from_pylate"] = result
    for queries_name, documents_name in job.get("scores", []):
        queries = [torch.from_numpy(q) for q in load_ragged(out / f"{queries_name}.npz")]
        documents = [torch.from_numpy(d) for d in load_ragged(out / f"{documents_name}.npz")]
        padded = torch.nn.utils.rnn.pad_sequence(documents, batch_first=True)
        mask = (torch.arange(padded.shape[1])[None, :] < torch.tensor([len(d) for d in documents])[:, None]).float()
        n = min(len(queries), len(documents))
        stem = f"{queries_name}-{documents_name}"
        np.save(out / f"{stem}-scores.npy", scores.colbert_scores(
            torch.nn.utils.rnn.pad_sequence(queries, batch_first=True), padded, documents_mask=mask).numpy())
        np.save(out / f"{stem}-pairwise.npy", scores.colbert_scores_pairwise(queries[:n], documents[:n]).numpy())
    (out / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))

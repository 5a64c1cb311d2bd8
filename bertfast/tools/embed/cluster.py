"""`bertfast embed --ray`: the job's chunks embedded by a pool of Ray actors, each a `bertfast.ray.Embedder`.

The driver reads the input and writes the shards (so resume, bad-row handling and the output are those
of the single-process job); the actors only embed. Chunks go out round robin with at most `IN_FLIGHT`
per actor and come back in order.
"""

from __future__ import annotations

from collections import deque

IN_FLIGHT = 2  # chunks queued per actor: one running, one waiting


class ActorPool:
    """`actors` Embedder actors of `cpus` CPUs each on the cluster at `address` ('local': start one)."""

    def __init__(self, address: str, embedder_kwargs: dict, actors: int | None = None, cpus: int = 1):
        try:
            import ray
        except ImportError:
            raise RuntimeError("--ray needs the package ray (pip install 'bertfast[ray]')") from None
        from bertfast.ray import Embedder

        if not ray.is_initialized():
            ray.init(address=None if address == "local" else address, log_to_driver=False)
        self.ray = ray
        if actors is None:
            actors = max(1, int(ray.cluster_resources().get("CPU", 1) // cpus))
        remote = ray.remote(num_cpus=cpus)(Embedder)
        self.actors = [remote.remote(**embedder_kwargs) for _ in range(actors)]

    def __call__(self, chunks):
        """Yields (embeddings, tokens) per chunk, in the chunks' order."""
        pending = deque()
        limit = IN_FLIGHT * len(self.actors)
        for i, chunk in enumerate(chunks):
            pending.append(self.actors[i % len(self.actors)].embed.remote(chunk))
            if len(pending) >= limit:
                yield self.ray.get(pending.popleft())
        while pending:
            yield self.ray.get(pending.popleft())

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)

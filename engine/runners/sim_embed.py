"""The sim runner's embeddings: SIM-ONLY fake vectors, so the embedding routes, their checks,
metrics and fuzzing run on the zero-cost model. They mean nothing about the text beyond being
a deterministic function of its token ids; the real model's are `llama/embed.py`'s.

Each token id `t` at any position has the state `sin((t + 1) * (k + 1))` in dimension `k`;
an input's vector is the mean of its tokens' states, L2-normalised, 16 floats. Costs no time
on the sim clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..embeddings import EmbeddingModel, Vector
from ..request import ModelInfo

__all__ = ["SIM_EMBEDDING_DIMENSIONS", "SimEmbeddings"]

#: Floats in a sim vector.
SIM_EMBEDDING_DIMENSIONS = 16

_K = np.arange(1, SIM_EMBEDDING_DIMENSIONS + 1, dtype=np.float64)


class SimEmbeddings:
    """A layer of `SimRunner` (the `Embeds` protocol, engine/embeddings.py)."""

    info: ModelInfo

    @property
    def embedding_model(self) -> EmbeddingModel:
        return EmbeddingModel(
            dimensions=SIM_EMBEDDING_DIMENSIONS,
            pooling="mean",
            pooling_source="sim",
            max_input_tokens=self.info.context_length,
        )

    async def embed(self, inputs: Sequence[Sequence[int]]) -> list[Vector]:
        out = []
        for ids in inputs:
            states = np.sin(np.outer(np.asarray(ids, np.float64) + 1, _K))
            vector = states.mean(axis=0)
            norm = np.linalg.norm(vector)
            out.append((vector / norm if norm > 0 else vector).astype(np.float32))
        return out

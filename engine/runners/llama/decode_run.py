"""A decode run: several decodes in one compute-thread job, each decode's tokens sampled and
handed to the event loop as soon as they are, without a step between them.

Synopsis::

    runner._run_sync(plan, run, publish)  # via `LlamaRunner.decode_run`, on the compute thread

A run starts with a step, and ends at `run.limit` decodes, when `run.stop()` is called, when
a stop token is sampled, when no slot is left to decode, or when the event loop lags behind a
run that wakes it for each decode (`MAX_UNTAKEN`). With `overlap_decode`, a run stopped during
a decode leaves that decode's logits for the next step, and one that ends otherwise queues
the next decode ahead, as a step does. A failed decode raises RunnerFailure.
`LlamaDecodeRuns` is a layer of `LlamaRunner`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import llama_cpp
import numpy as np

from ...compute_thread import compute_thread
from ..base import DecodeRun, SeqStep
from .step import DecodeAhead, LlamaSteps, batch_fields

__all__ = ["MAX_UNTAKEN", "LlamaDecodeRuns"]

#: A run that wakes the event loop for each decode ends when more than this many decodes
#: wait to be taken: the event loop is busy, and running on would only decode further past
#: an end (a stop string) it has not seen yet, and hand over frames several tokens at once.
MAX_UNTAKEN = 1


class LlamaDecodeRuns(LlamaSteps):
    """Runs of decodes (`Runner.decode_run`)."""

    def _run_sync(
        self, plan: Sequence[SeqStep], run: DecodeRun, publish: Callable[[list[int], bool], int]
    ) -> None:
        tokens = self._step_sync(plan, launch_ahead=False)
        wake = run.wake_each
        publish(tokens, wake)
        n = len(plan)
        seq_ids = [s.seq_id for s in plan]
        #: Each entry's next position: its sampled token goes there; its slot holds that
        #: many cells once the token is decoded.
        positions = [s.start_pos + 1 for s in plan]
        live = sorted(range(n), key=seq_ids.__getitem__)  # llama.cpp wants ascending ids
        samplers, argmax, freeing, stops = self._samplers, self._argmax, self._freeing, run.stop_ids
        batch = self._batch
        b_token, b_pos, b_n_seq, b_seq, b_logits = batch_fields(batch)
        decodes = 1
        while (
            decodes < run.limit
            and not run.stopped
            and not any(t in stop for t, stop in zip(tokens, stops, strict=True))
        ):
            # A slot the scheduler closed meanwhile (its request ended) is decoded no further.
            live = [k for k in live if tokens[k] >= 0 and seq_ids[k] not in freeing]
            if not live:
                return
            for b, k in enumerate(live):
                b_token[b] = tokens[k]
                b_pos[b] = positions[k]
                b_n_seq[b] = 1
                b_seq[b][0] = seq_ids[k]
                b_logits[b] = 1
            batch.n_tokens = len(live)
            rc = llama_cpp.llama_decode(self._ctx, batch)
            if rc != 0:
                raise self._stop.failure(rc)
            # Each slot now ends at its entry's position (every sequence starts at 0).
            cells = dict(self._slot_cells)
            for k in live:
                if seq_ids[k] not in freeing:
                    cells[seq_ids[k]] = positions[k] + 1
            self._slot_cells = cells
            if run.stopped and self._overlap:
                # Stopped while this decode ran (a request arrived, or one ended): leave its
                # logits unsampled, as a decode launched ahead, for the step the scheduler
                # plans next, which asks for exactly these entries.
                self._ahead = DecodeAhead(
                    {(seq_ids[k], tokens[k], positions[k]): b for b, k in enumerate(live)}
                )
                return
            sampled = [-1] * n
            for b, k in enumerate(live):
                positions[k] += 1
                seq_id = seq_ids[k]
                chain = samplers.get(seq_id)
                if chain is None:
                    continue  # closed since the decode began: its token is nobody's
                if seq_id in argmax:
                    sampled[k] = int(np.argmax(self._row(b)))
                else:
                    sampled[k] = int(llama_cpp.llama_sampler_sample(chain, self._ctx, b))
            tokens = sampled
            decodes += 1
            if publish(tokens, wake) > MAX_UNTAKEN and wake:
                break  # the event loop lags: hand back to single steps rather than run ahead
        if self._overlap:
            eog = self.info.eos_token_ids
            nxt = [
                (seq_ids[k], tokens[k], positions[k])
                for k in live
                if tokens[k] >= 0 and tokens[k] not in eog
            ]
            if nxt:
                compute_thread().submit(self._decode_ahead, nxt)

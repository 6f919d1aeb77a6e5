"""A handed-over request continues on the decode engine exactly as it would have on one.

After a remote prefill the client already has the first token(s) the prefill engine
sampled. The decode engine gets the original prompt (its KV loaded, the last prompt
token recomputed, as vLLM does for a full prompt hit) and samples those tokens again,
forced here, before it samples on its own. Everything that depends on what a request
has generated so far then holds as on one engine: the structured-output grammar has
accepted the tokens, penalties and ``min_tokens`` count them, stop strings see their
text, and a seeded generator has drawn once per token (vLLM draws each step whatever
the logits). Feeding them as part of the prompt instead, as a plain hand-over does,
restarts all of that: through pd_always a regex ``[0-9]{3}-[a-z]{4}`` came back as
``7772-fxxx``.

Loaded by every engine that takes KV from another (``build_engine_args``); a request
without the key is untouched. Logprobs are vLLM's raw ones (before any processor), so
forcing does not change what a client reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from engines.protocol import CONTINUE_FROM


def forced_prefix(tokens: list[int]) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
    """The per-request processor: while the output is shorter than ``tokens``, only its
    next token may be sampled."""

    def force(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        position = len(output_token_ids)
        if position >= len(tokens):
            return logits
        token = tokens[position]
        # Its own logit stays (penalties and temperature act as they would have); one
        # another rule masked would leave nothing to sample, so it becomes 0 instead.
        kept = torch.nan_to_num(logits[token].clone(), neginf=0.0)
        logits.fill_(float("-inf"))
        logits[token] = kept
        return logits

    return force


class ContinuationProcessor(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        # It changes the argmax: greedy requests must go through it too.
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> Any:
        tokens = (params.extra_args or {}).get(CONTINUE_FROM)
        return forced_prefix([int(t) for t in tokens]) if tokens else None

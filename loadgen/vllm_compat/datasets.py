"""Two of ``vllm bench serve``'s datasets as workloads of ours (``--dataset-name``).

- ``prefix-repetition`` (vLLM's ``prefix_repetition``): ``num_prefixes`` distinct
  prefixes of ``prefix_len`` tokens, ``num_requests // num_prefixes`` requests each,
  every one ``prefix_len + suffix_len`` tokens in, ``output_len`` out, shuffled. The
  server's prefix cache sees what vLLM's dataset shows it; the tokens are our own random
  ids (vLLM's are random too, through its tokenizer).
- ``prompt-file`` (vLLM's ``custom``): a JSONL file, one ``{"prompt": "...",
  "output_tokens": N}`` a line, shuffled and oversampled as vLLM does it (Python's
  ``random`` seeded with ``--seed``, so the same rows come out in the same order).
  Prompts are sent as they are: without a tokenizer we cannot apply a chat template
  (vLLM's default; ``--skip-chat-template`` turns it off there), and their token counts
  are the server's (``usage``), as in vLLM's results.

vLLM's ``random`` dataset is our ``custom`` workload (with ``input_range_ratio``,
``output_range_ratio`` and ``prefix_len``) and its ``burstgpt`` one our ``T-general``
subset of the GPT-4 rows (``loadgen.vllm_compat.cli``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from loadgen.config import (
    PREFIX_REPETITION_WORKLOAD,
    PROMPT_FILE_WORKLOAD,
    WORKLOADS,
    WorkloadConfig,
)
from loadgen.data.workloads import LengthDraws, RequestSize, WorkloadPlan


class PrefixRepetition:
    """Requests over a few long shared prefixes (vLLM's ``prefix_repetition``)."""

    def plan(self, config: WorkloadConfig, draws: LengthDraws) -> WorkloadPlan:
        assert config.suffix_len is not None and config.output_len is not None
        per_prefix = draws.num_requests // config.num_prefixes
        if per_prefix == 0:
            raise ValueError(
                f"{draws.num_requests} requests cannot share {config.num_prefixes} prefixes:"
                " give at least one request per prefix"
            )
        input_len = config.prefix_len + config.suffix_len
        if input_len + config.output_len > draws.max_model_len:
            raise ValueError(
                f"{config.label}: {input_len} + {config.output_len} tokens exceed the"
                f" server's context of {draws.max_model_len}"
            )
        sizes = [
            RequestSize(input_len, config.output_len, (f"prefix-{index}",))
            for index in range(config.num_prefixes)
            for _ in range(per_prefix)
        ]
        if config.shuffle:
            sizes = [sizes[i] for i in draws.main_rng.permutation(len(sizes))]
        # Warm-ups get a prefix of their own, so that no measured prefix starts cached.
        warmups = [
            RequestSize(input_len, config.output_len, ("warmup-prefix",))
            for _ in range(draws.warmup_requests)
        ]
        return WorkloadPlan(
            name=config.name,
            label=config.label,
            sizes=sizes,
            warmup_sizes=warmups,
            source="synthetic",
            prefix_block_tokens=config.prefix_len,
        )


class PromptFileError(ValueError):
    """A prompt file that vLLM's custom dataset would not read either."""


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    output_tokens: int | None


def read_prompt_file(path: Path) -> list[PromptRow]:
    """The rows of a vLLM custom-dataset JSONL file."""
    if path.suffix != ".jsonl":
        raise PromptFileError(f"{path}: the custom dataset is a .jsonl file (as vLLM's)")
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise PromptFileError(f"{path}: {error}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            raise PromptFileError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise PromptFileError(f"{path}:{number}: no 'prompt' string")
        output = row.get("output_tokens")
        rows.append(PromptRow(row["prompt"], None if output is None else int(output)))
    if not rows:
        raise PromptFileError(f"{path}: no prompt")
    return rows


class PromptFile:
    """A JSONL file's prompts, in vLLM's custom dataset's order."""

    def plan(self, config: WorkloadConfig, draws: LengthDraws) -> WorkloadPlan:
        assert config.prompt_file is not None
        rows = read_prompt_file(config.prompt_file)
        if config.shuffle:
            random.Random(draws.seed).shuffle(rows)
        chosen = rows[: draws.num_requests]
        if config.oversample and len(chosen) < draws.num_requests:
            again = random.Random(draws.seed)
            chosen += [again.choice(chosen) for _ in range(draws.num_requests - len(chosen))]
        sizes = [self._shape(row, config) for row in chosen]
        return WorkloadPlan(
            name=config.name,
            label=config.label,
            sizes=sizes,
            # vLLM warms up with its first request; so do we, with the first rows.
            warmup_sizes=[sizes[i % len(sizes)] for i in range(draws.warmup_requests)],
            source=str(config.prompt_file),
        )

    @staticmethod
    def _shape(row: PromptRow, config: WorkloadConfig) -> RequestSize:
        output_len = config.output_len or row.output_tokens
        if output_len is None:
            raise PromptFileError(
                f"{config.prompt_file}: a row without 'output_tokens', and no output length"
                " given (--custom-output-len)"
            )
        # The prompt's tokens are unknown until the server counts them (input_len 0).
        return RequestSize(0, output_len, text=row.prompt)


WORKLOADS.register(PREFIX_REPETITION_WORKLOAD)(PrefixRepetition())
WORKLOADS.register(PROMPT_FILE_WORKLOAD)(PromptFile())

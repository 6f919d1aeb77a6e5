"""The main job on the embedded default: start DP=2, stream one chat answer, stop.

``python -m deployments.demo [--config dp]`` starts the application with
``serve run``, asks it one question through the official ``openai`` client, prints
the answer's token ids and the replica that served it, and shuts everything down.
"""

from __future__ import annotations

import argparse

import openai
from rich.console import Console

from deployments.launcher import serve_run
from splitserve.metric_catalogue import REPLICA_HEADER

console = Console()


def ask(base_url: str, model: str, question: str, max_tokens: int) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    token_ids: list[int] = []
    text: list[str] = []
    with client.chat.completions.with_streaming_response.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    ) as response:
        replica = response.headers.get(REPLICA_HEADER, "?")
        for chunk in response.parse():
            for choice in chunk.choices:
                token_ids.extend(getattr(choice, "token_ids", None) or [])
                text.append(choice.delta.content or "")
            if chunk.usage:
                usage = chunk.usage
    console.print(f"[bold]question[/]    {question}")
    console.print(f"[bold]replica[/]     {replica}")
    console.print(f"[bold]token ids[/]   {token_ids}")
    console.print(f"[bold]text[/]        {''.join(text)!r}  (random weights: bytes, not words)")
    console.print(
        f"[bold]usage[/]       {usage.prompt_tokens} prompt + {usage.completion_tokens} completion"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="dp", help="a name under deployments/ or a YAML path")
    parser.add_argument("--question", default="Which way should I split my GPUs?")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--model", default="splitserve-tiny-llama")
    args = parser.parse_args()
    console.print(f"starting [bold]python -m deployments.serve {args.config}[/] (about a minute)")
    with serve_run(args.config) as app:
        console.print(f"[green]serving[/] {app.config_path.name} at {app.base_url}/v1")
        ask(app.base_url, args.model, args.question, args.max_tokens)
        console.print("stopping the application and its engines...")
    console.print("[green]stopped[/]: no engine process left behind")


if __name__ == "__main__":
    main()

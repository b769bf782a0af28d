"""The online mode: each method behind `vllm serve` on loopback, measured as users measure it.

Requests go through the OpenAI chat API (the server applies the chat template); the
counters are the server's Prometheus ``/metrics``, read before and after each dataset.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.evaluate.config import EvalConfig
from draftsmith.evaluate.runs import Method, measure
from draftsmith.evaluate.server import vllm_server


def server_runs(
    cfg: EvalConfig,
    model: str,
    method: Method,
    chats: dict[str, list[list[dict]]],
    engine_kwargs: dict,
) -> tuple[list[dict], dict]:
    """Like `runs.offline_runs`, through a server started for this method."""
    args = dict(engine_kwargs, max_num_seqs=cfg.concurrency, seed=cfg.seed)
    name = method.name + (f"-k{method.k}" if method.k else "")
    log = Path(cfg.output) / "logs" / f"server-{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with vllm_server(model, args, method.speculative_config(cfg), log_path=log) as server:

        def generate(messages, temperature):
            extra = {"chat_template_kwargs": cfg.chat_template_kwargs}
            replies = server.complete(
                messages, cfg.max_tokens, temperature, cfg.concurrency,
                extra_body=extra if cfg.chat_template_kwargs else None,
            )  # fmt: skip
            tokens = [r["token_ids"] or [] for r in replies]
            return tokens, sum(r["completion_tokens"] or 0 for r in replies), replies.seconds

        return measure(cfg, method, "server", chats, generate, server.metrics)

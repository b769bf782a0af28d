"""Answer: the target writes the replies of the samples it regenerates, round by round.

Every round but the last is answered here, one engine call per round for a shard's samples
(:func:`answer_rounds`); each reply joins its sample's history, as a chat client sends it
back (the answer without its reasoning, for per-turn samples). The last round is answered
by the request that also captures the states (:func:`answer_last`, greedy: the states then
match the tokens the target produced), beside the final sequences that are only prefilled.

Sampled regeneration cannot run in the capturing engine: in vLLM 0.32 the
``extract_hidden_states`` method's dummy draft token is accepted far too often under
sampling (replies degenerate into repeated tokens; greedy is exact). Sampled replies are
therefore written whole by a plain engine first (:func:`write_replies`) and captured later
by prefilling their exact token ids.

Earlier rounds are captured only as per-turn samples; the others are sent with
``save: False``, and a prefix-stable sample's earlier replies become part of its final
prompt, in its loss mask.
"""

from __future__ import annotations

from typing import Any

from draftsmith.conversations.sources import SkipLog
from draftsmith.conversations.template import mask_reasoning
from draftsmith.extract.records import Answered, Chat, Item, Sequence
from draftsmith.extract.render import Dialogue, render_round


def answer_rounds(
    llm, items: list[Item], chat: Chat, skips: SkipLog, capture: bool
) -> tuple[list[Answered], list[Sequence]]:
    """Render and answer every round but the last of the items without final ids (the
    others keep their replies); return the answered rounds of per-turn samples (captured
    as they were written when `capture`) and the prompts of the last rounds, in item order."""
    dialogues = [Dialogue(it, list(it.messages)) for it in items if not it.input_ids]
    if not dialogues:
        return [], []
    rounds = max(sum(m["role"] == "user" for m in d.item.messages) for d in dialogues)
    earlier: list[tuple[Sequence, Any]] = []  # per-turn rounds: prompt, vLLM's output
    for r in range(rounds):
        batch = [
            (d, prompt)
            for d in dialogues
            if not d.done and (prompt := render_round(d, r, chat, skips)) is not None
        ]
        if not batch:
            continue
        # Earlier turns are captured only as per-turn samples.
        params = [
            reply_params(chat, len(p.input_ids), capture=capture and d.item.rounds > 0)
            for d, p in batch
        ]
        outs = llm.generate(
            [{"prompt_token_ids": p.input_ids} for _, p in batch], params, use_tqdm=False
        )
        for (d, prompt), out in zip(batch, outs, strict=True):
            text = out.outputs[0].text
            if d.item.rounds:
                earlier.append((prompt, out))
                reply = list(out.outputs[0].token_ids)
                text = _answer_text(chat.tokenizer, reply, chat.reasoning_ends, text)
            d.history.append({"role": "assistant", "content": text})
    answered = [Answered(with_reply(prompt, out, skips), out) for prompt, out in earlier]
    return answered, [d.final for d in dialogues if d.final is not None]


def answer_last(
    llm, last: list[Sequence], ready: list[Sequence], chat: Chat, skips: SkipLog
) -> list[Answered]:
    """One call of the capturing engine: the last rounds answered, each reply captured with
    its prompt (``include_output_tokens``), and the `ready` sequences prefilled."""
    requests = last + ready
    if not requests:
        return []
    from vllm import SamplingParams

    params = [reply_params(chat, len(p.input_ids), capture=True) for p in last]
    params += [SamplingParams(max_tokens=1, temperature=0.0)] * len(ready)
    outputs = llm.generate(
        [{"prompt_token_ids": p.input_ids} for p in requests], params, use_tqdm=False
    )
    return [
        Answered(with_reply(seq, out, skips) if n < len(last) else seq, out)
        for n, (seq, out) in enumerate(zip(requests, outputs, strict=True))
    ]


def write_replies(llm, items: list[Item], chat: Chat, skips: SkipLog) -> list[Sequence]:
    """Answer every user turn of the items without final ids with a plain (non-capturing)
    engine; return their whole sequences (each round's, for per-turn samples)."""
    earlier, last = answer_rounds(llm, items, chat, skips, capture=False)
    params = [reply_params(chat, len(p.input_ids), capture=False) for p in last]
    outputs = llm.generate(
        [{"prompt_token_ids": p.input_ids} for p in last], params, use_tqdm=False
    )
    finals = [with_reply(prompt, out, skips) for prompt, out in zip(last, outputs, strict=True)]
    return [seq for seq in [a.sequence for a in earlier] + finals if seq is not None]


def with_reply(prompt: Sequence, out, skips: SkipLog) -> Sequence | None:
    """Prompt + reply minus its last token (never fed back, so it has no state), the reply
    in the loss; None (a counted skip) for a reply of at most one token."""
    reply = list(out.outputs[0].token_ids)
    if len(reply) < 2:
        sid = prompt.sample.id
        skips.add(sid, None, "empty_reply", "the target answered with at most one token")
        return None
    ids = list(prompt.input_ids) + reply[:-1]
    return Sequence(prompt.sample, ids, list(prompt.loss_mask) + [1] * (len(reply) - 1))


def reply_params(chat: Chat, prompt_len: int, capture: bool):
    """A reply's sampling: at most ``max_new_tokens``, within ``max_length`` once stored;
    its states captured with the prompt's (`capture`) or not saved at all."""
    from vllm import SamplingParams

    budget = chat.max_length + 1 - prompt_len  # prompt + reply - 1 tokens are stored
    return SamplingParams(
        max_tokens=max(1, min(chat.max_new_tokens, budget)),
        temperature=chat.temperature,
        extra_args={
            "kv_transfer_params": {"include_output_tokens": True} if capture else {"save": False}
        },
    )


def _answer_text(tokenizer, reply: list[int], ends: list[list[int]], text: str) -> str:
    """The reply as a chat client sends it back: the answer after its reasoning (vLLM's
    reasoning parsers split it off), or `text` when the reply has no reasoning marker."""
    cut = len(reply) - sum(mask_reasoning(reply, [1] * len(reply), ends))
    return tokenizer.decode(reply[cut:], skip_special_tokens=True) if cut else text

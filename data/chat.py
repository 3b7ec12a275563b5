"""Where the assistant replies are in a conversation rendered by the tokenizer's own chat template.

The rule, for any template: render the conversation once (``text``). For the assistant turn at
message i, ``prompt = render(messages[:i], add_generation_prompt=True)`` ends where the reply
starts and ``upto = render(messages[:i+1])`` ends after the template's end-of-turn text. The reply
span is ``[len(prompt), len(upto))`` with trailing whitespace removed: so it holds whatever the
model generates after the role header -- the content and the end-of-turn token(s) that close it
(``<|im_end|>``, ``<|eot_id|>``, or an empty think block a template puts there) -- and not the
header or the newline a template writes after end-of-turn.

This only holds when each render is a prefix of the next (the template is *prefix-stable*); a
template that rewrites earlier turns (real Qwen3 templates drop ``<think>`` from history) is
reported as a `DataError` naming the sample. An assistant turn at message 0 answers no prompt: it
has no generation-prompt render, so it stays context (loss 0).
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from .errors import DataError


def render(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool,
           source: str) -> str:
    """The template's text for `messages`; a template that refuses them is a bad record."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except TemplateError as e:
        raise DataError(f"{source}: chat template rejected the conversation ({e})",
                        "template_error") from e


def render_with_reply_spans(tokenizer: Any, messages: list[dict[str, str]],
                            source: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant replies (see module doc)."""
    text = render(tokenizer, messages, add_generation_prompt=False, source=source)
    spans = []
    for i in range(1, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True, source=source)
        upto = render(tokenizer, messages[:i + 1], add_generation_prompt=False, source=source)
        if not (upto.startswith(prompt) and text.startswith(upto)):
            raise DataError(f"{source}: chat template is not prefix-stable at turn {i + 1} "
                            "(rendering the conversation up to this reply is not a prefix of the "
                            "whole; the template rewrites earlier turns)", "template_not_prefix_stable")
        spans.append((len(prompt), max(len(prompt), len(upto.rstrip()))))
    return text, spans


END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def stop_token_ids(tokenizer: Any, generation_eos: int | list[int] | None = None) -> set[int]:
    """Ids that end a generated reply: the tokenizer's and the model's EOS, and the end-of-turn
    token of common chat templates where the vocabulary has it."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if generation_eos is not None:
        ids.update([generation_eos] if isinstance(generation_eos, int) else generation_eos)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return ids

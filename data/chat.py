"""Where the assistant replies are in a conversation rendered by the tokenizer's own chat template.

The rule, for any template: render the conversation once (``text``). For the assistant turn at
message i, ``prompt = render(messages[:i], add_generation_prompt=True)`` ends where the reply
starts and ``upto = render(messages[:i+1])`` ends after the template's end-of-turn text. The reply
span is ``[len(prompt), len(upto))`` with trailing whitespace removed: so it holds whatever the
model generates after the role header -- the content and the end-of-turn token(s) that close it
(``<|im_end|>``, ``<|eot_id|>``, or an empty think block a template puts there) -- and not the
header or the newline a template writes after end-of-turn.

A reply marked ``"unfinished": true`` (cut by a length limit: `extract.regenerate` marks the replies
it stopped at ``max_new_tokens``) ends where its text ends: the end-of-turn the template writes after
it closes the rendered turn, but the target never produced it there, so it is context, not a label.

This only holds when each render is a prefix of the next (the template is *prefix-stable*); a
template that rewrites earlier turns (real Qwen3 templates drop ``<think>`` from history) is
reported as a `DataError` naming the sample. An assistant turn at message 0 answers no prompt: it
has no generation-prompt render, so it stays context (loss 0).

Template options (``template_kwargs``, passed to ``apply_chat_template``) go into every render, so
they move the spans too: Qwen3's ``enable_thinking=False`` writes the empty think block into the
generation prompt, which makes it prompt (loss 0), whereas without it the block is reply.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from .errors import DataError

UNFINISHED = "unfinished"  # the key marking an assistant message whose reply was cut by a length limit


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    source: str,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The template's text for `messages`, with the template's own options (`template_kwargs`, e.g.
    ``{"enable_thinking": False}``); a template that refuses them is a bad record."""
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
        )
    except TemplateError as e:
        raise DataError(f"{source}: chat template rejected the conversation ({e})", "template_error") from e


def render_with_reply_spans(
    tokenizer: Any, messages: list[dict[str, Any]], source: str, *, template_kwargs: dict[str, Any] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant replies (see module doc)."""
    text = render(tokenizer, messages, add_generation_prompt=False, source=source, template_kwargs=template_kwargs)
    spans = []
    for i in range(1, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        prompt = render(
            tokenizer, messages[:i], add_generation_prompt=True, source=source, template_kwargs=template_kwargs
        )
        upto = render(
            tokenizer, messages[: i + 1], add_generation_prompt=False, source=source, template_kwargs=template_kwargs
        )
        if not (upto.startswith(prompt) and text.startswith(upto)):
            raise DataError(
                f"{source}: chat template is not prefix-stable at turn {i + 1} "
                "(rendering the conversation up to this reply is not a prefix of the "
                "whole; the template rewrites earlier turns)",
                "template_not_prefix_stable",
            )
        end = max(len(prompt), len(upto.rstrip()))
        if messages[i].get(UNFINISHED):
            end = _reply_text_end(upto, len(prompt), end, messages[i]["content"], f"{source}: turn {i + 1}")
        spans.append((len(prompt), end))
    return text, spans


def _reply_text_end(upto: str, start: int, end: int, content: str, where: str) -> int:
    """Where an unfinished reply's text ends in its rendered turn [start, end): the last place the
    content (or, for a template that trims it, the trimmed content) ends before the end-of-turn."""
    for text in (content, content.strip()):
        if not text:
            return start
        at = upto.rfind(text, start, end)
        if at >= 0:
            return at + len(text)
    raise DataError(
        f"{where}: the reply is marked unfinished, but the chat template does not write its text as it is "
        "(its end cannot be told from the end-of-turn)",
        "template_rewrites_reply",
    )


def generation_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], *, template_kwargs: dict[str, Any] | None = None, source: str = ""
) -> list[int]:
    """Ids of `messages` with the generation prompt, tokenized as `tokenize_record` tokenizes a
    conversation (the template writes the special tokens): a reply generated after them is the
    reply span extraction later finds, behind the same rendered prompt text. The ids themselves are
    a prefix of the conversation's only where no token spans the prompt/reply boundary (so for
    Qwen and Llama 3, whose pre-tokenizers keep a newline run whole; a GPT-2-style one may split a
    trailing ``"\\n\\n"`` differently once the reply follows)."""
    text = render(tokenizer, messages, add_generation_prompt=True, source=source, template_kwargs=template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


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

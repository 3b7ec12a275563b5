"""How far regenerated replies stray from the target's own, for `bench.regenerate --chat --score-replies`.

A lossy setting (an fp8 KV cache) makes replies that are no longer exactly the target's. What a drafter
trained on them sees is each reply token as a label after its (regenerated) context, so the measure is
per token, on the conversation as extraction tokenizes it: how often the label is the reference model's
own greedy choice after that context, and the reference's mean negative log-likelihood of the labels.
Greedy replies of the reference itself score an agreement of 1 (up to re-tokenization of the reply
text); the shortfall of a lossy setting is the share of labels the target would not have written.
For sampled replies the NLL gap to lossless sampled replies estimates the per-token KL of the lossy
sampler from the target's."""

from __future__ import annotations

from typing import Any

import torch

from dflash_pipeline.data.records import Record
from dflash_pipeline.data.tokens import tokenize_record


@torch.no_grad()
def score_replies(model: Any, tokenizer: Any, conversations: list[list[dict[str, Any]]], max_length: int) -> dict:
    """The reply tokens of `conversations` (message lists) teacher-forced through `model`: their count,
    the share that are the model's argmax after their context, and their mean NLL (nats)."""
    device = next(model.parameters()).device
    tokens = agree = 0
    nll = 0.0
    for i, messages in enumerate(conversations):
        sample = tokenize_record(Record(i, f"conversation {i}", messages=messages), tokenizer, max_length)
        ids = torch.as_tensor(sample.input_ids, dtype=torch.long, device=device)
        is_label = torch.as_tensor(sample.loss_mask[1:], dtype=torch.bool, device=device)
        logits = model(ids[None]).logits[0, :-1][is_label].float()
        labels = ids[1:][is_label]
        nll -= float(torch.log_softmax(logits, -1).gather(1, labels[:, None]).sum())
        agree += int((logits.argmax(-1) == labels).sum())
        tokens += len(labels)
    return {
        "reply_tokens": tokens,
        "argmax_agreement": agree / tokens if tokens else None,
        "mean_nll": nll / tokens if tokens else None,
    }


def reply_divergence(first: list[list[dict[str, Any]]], other: list[list[dict[str, Any]]], tokenizer: Any) -> dict:
    """Replies of `other` against `first` (the same conversations, regenerated two ways), pairing
    each conversation's regenerated turns in order (assistant turns after the first message; one that
    opens a conversation answers nothing and is kept as it was): how many are identical, and the share
    of their tokens (of the shorter of each pair) before the first that differs."""

    def replies(messages: list[dict[str, Any]]) -> list[str]:
        return [m["content"] for m in messages[1:] if m["role"] == "assistant"]

    pairs = identical = common = compared = 0
    for a_messages, b_messages in zip(first, other, strict=True):
        a_replies, b_replies = replies(a_messages), replies(b_messages)
        for a, b in zip(a_replies, b_replies, strict=True):
            ta = tokenizer(a, add_special_tokens=False)["input_ids"]
            tb = tokenizer(b, add_special_tokens=False)["input_ids"]
            n = min(len(ta), len(tb))
            common += next((j for j in range(n) if ta[j] != tb[j]), n)
            compared += n
            identical += a == b
            pairs += 1
    return {
        "replies": pairs,
        "identical_replies": identical,
        "common_prefix_fraction": common / compared if compared else None,
    }

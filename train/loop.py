"""Stage two on one rank: DDP drafter training from the feature store, checkpoints, evaluation.

`train_rank` is the whole run in order: `Trainer.build` (store checks, drafter, data plan, optimizer)
-> `Trainer.resume` (the last checkpoint, if asked) -> `Trainer.fit` (the steps, with their metrics,
evaluations and checkpoints) -> `Trainer.save_drafter`.

The loss is normalised by the weight summed over *all* ranks (one all-reduce of a scalar before the
backward), so a DDP step equals a single-process step on the same global batch exactly.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from dflash_pipeline.shared.model.config import DFLASH2_KEYS, DFlashConfig
from dflash_pipeline.shared.model.drafter import DFlashDrafter
from dflash_pipeline.shared.model.loss import default_gamma
from dflash_pipeline.shared.model.target_head import TargetHead
from dflash_pipeline.shared.runtime.cluster import Cluster, group_timeout
from dflash_pipeline.shared.runtime.config import ConfigError
from dflash_pipeline.shared.runtime.errors import UserError
from dflash_pipeline.shared.runtime.progress import progress_bar
from dflash_pipeline.shared.runtime.run_lock import RunLockError, run_lock
from dflash_pipeline.shared.runtime.stop import (
    STOP_SIGNALS,
    StoppedTogether,
    cause_of,
    signal_name,
    stop_cause,
    stop_requested,
    stop_votes,
    stopping_gracefully,
)
from dflash_pipeline.shared.store.layout import StoreLayout
from dflash_pipeline.shared.store.reader import FeatureStore
from dflash_pipeline.shared.target.identity import TargetIdentity
from dflash_pipeline.train import checkpoint as ckpt
from dflash_pipeline.train.config import RESUME_HINT, TrainConfig
from dflash_pipeline.train.dataset import (
    PackContext,
    PackSpec,
    StepDataset,
    StepPlan,
    batch_layout,
    draw_anchors,
    read_pack_context,
)
from dflash_pipeline.train.decode_tau import decode_chain, every_anchor
from dflash_pipeline.train.feed import device_batches
from dflash_pipeline.train.holdout import prompt_groups
from dflash_pipeline.train.metrics import MetricsLog, Throughput
from dflash_pipeline.train.packing import plan_packs, rank_slice, split_holdout
from dflash_pipeline.train.setup import (
    load_target_config,
    resolve_mask_token,
    store_identity,
    validate_store,
)
from dflash_pipeline.train.step import (
    block_acceptance,
    compiled_drafter,
    kl_share,
    loss_term_sums,
    pack_loss,
    to_device,
)

# Held-out packs and their anchors are drawn with this "epoch", apart from every training epoch.
EVAL_EPOCH = 2**31 - 1


class TrainingError(UserError, RuntimeError):
    """Training cannot continue (bad store, diverged loss, mismatched checkpoint)."""


class TrainingStopped(TrainingError, StoppedTogether):
    """A rank got SIGTERM or Ctrl-C: every rank stopped at a step boundary, after the same step with its
    checkpoint written, or during one whose helper processes the signal ended (its line names which)."""


@dataclass
class RankResult:
    steps: int
    final_loss: float | None
    eval_tau: float | None  # the last evaluation's, this session's or (resumed) an earlier one's
    tokens_per_s: float  # of the last logged window, likewise
    out: str
    already_complete: bool = False  # resumed a run that had done all its steps: nothing trained now
    epoch_limit: bool = False  # --epochs ended the run before --max-steps


@dataclass(frozen=True)
class StepResult:
    """One optimizer step over all ranks: the global batch's loss and (DFlash-2) its terms
    (`loss_term_sums`' keys) as weighted means, the mean gradient norm, and per block position the
    correct predictions and labelled tokens."""

    loss: float
    terms: dict[str, float]
    grad_norm: float
    correct: np.ndarray
    total: np.ndarray
    stop: bool  # a rank got a stop signal (which: `Trainer.stopped_by`): every rank stops after this step


def backend_for(cfg: TrainConfig, device: torch.device) -> str:
    """Compiled flex on GPU; on CPU compiled flex has no backward, so the eager/SDPA reference."""
    if cfg.attention != "auto":
        return cfg.attention
    return "flex_compiled" if device.type == "cuda" else "sdpa_dense"


def lr_lambda(total_steps: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def all_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def from_rank0(
    compute: Callable[[], np.ndarray], length: int, device: torch.device, cluster: Cluster | None = None
) -> np.ndarray:
    """`compute()` (int64 [length]) run on rank 0 only and sent to every rank: the held-out prompt
    groups read every sample's ids and mask (5 bytes per token of the store), once is enough.
    With `cluster`, the others wait for it at a meeting point, not in the broadcast (it may take long)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return compute()
    if dist.get_rank() == 0:
        values = torch.as_tensor(compute(), dtype=torch.int64).to(device)
    else:
        values = torch.empty(length, dtype=torch.int64, device=device)
    if cluster is not None:
        cluster.meet("prompt-groups")
    dist.broadcast(values, src=0)
    return values.cpu().numpy()


def dflash2_settings(cfg: TrainConfig, target_config) -> dict[str, int]:
    """The DFlash-2 fields of the drafter config (none for --arch dflash), checked against the target."""
    if cfg.arch != "dflash2":
        return {}
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    if hidden % cfg.conv_group_size:
        raise ConfigError(f"--conv-group-size {cfg.conv_group_size} does not divide the target's hidden size {hidden}")
    if cfg.selector_top_k > vocab:
        raise ConfigError(f"--selector-top-k {cfg.selector_top_k} exceeds the target's vocabulary of {vocab}")
    return {name: getattr(cfg, name) for name in DFLASH2_KEYS}


def build_model(cfg: TrainConfig, store: FeatureStore, device: torch.device) -> tuple[DFlashDrafter, TargetHead]:
    """The drafter, freshly initialised from `cfg.seed`, with the attention backend it trains and
    evaluates with; and the target's frozen embedding and LM head. Its config is the one source of the
    block size and mask token from here on."""
    target_config = load_target_config(store)
    dcfg = DFlashConfig.for_target(
        target_config,
        store.layer_ids,
        num_layers=cfg.num_layers,
        block_size=cfg.block_size,
        mask_token_id=resolve_mask_token(store, cfg.mask_token_id),
        sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types) or None,
        is_causal=cfg.is_causal,
        **dflash2_settings(cfg, target_config),
    )
    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(dcfg, attention_backend=backend_for(cfg, device)).to(device)
    head = TargetHead.load(StoreLayout(store.root).target_head, device=device)
    return model, head


@dataclass(eq=False)
class Trainer:
    """What one rank trains with, made once by `build`; `state` is where the run stands (restored by
    `resume`, advanced by `fit`)."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    cluster: Cluster | None  # with several ranks, where they wait for one another's unequal work
    store: FeatureStore
    model: DFlashDrafter
    head: TargetHead
    spec: PackSpec
    gamma: float
    plan: StepPlan
    schedule: list[tuple[int, int]]  # every (epoch, k) of --epochs, in order
    total_steps: int  # the schedule cut at --max-steps
    eval_packs: list[list[int]]  # this rank's share of the held-out packs
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: ckpt.TrainState
    stopped_by: str | None = None  # the stop signals any rank got, once the ranks learnt of them

    @classmethod
    def build(
        cls, rank: int, world: int, cfg: TrainConfig, device: torch.device, cluster: Cluster | None = None
    ) -> Trainer:
        """Check the store, build the drafter, split off the held-out prompts, plan the packs of every
        step, and make the optimizer and LR schedule; a step 0 state."""
        store = FeatureStore(cfg.store)
        validate_store(store, cfg)
        model, head = build_model(cfg, store, device)
        topk = store.store_topk if cfg.loss != "ce" else 0  # carried only when the loss reads it
        spec = PackSpec.for_drafter(model.config, cfg.pack_tokens, cfg.num_blocks, cfg.max_anchors_per_sample, topk)
        gamma = cfg.gamma if cfg.gamma is not None else default_gamma(spec.block_size)

        lengths = np.asarray(store.lengths)
        # a held-out prompt never also trains
        groups = from_rank0(lambda: prompt_groups(store), len(store), device, cluster) if cfg.eval_samples else None
        train_ids, eval_ids = split_holdout(len(store), cfg.eval_samples, cfg.seed, groups)
        plan = StepPlan(train_ids, lengths, cfg.pack_tokens, cfg.seed, rank, world, cfg.packs_per_step)
        schedule = plan.schedule(cfg.epochs)
        empty = sorted(set(range(cfg.epochs)) - {epoch for epoch, _ in schedule})
        if empty:
            raise TrainingError(
                f"{cfg.store}: {len(train_ids)} training samples fill fewer packs than one step needs "
                f"({world} ranks x {cfg.packs_per_step} packs of {cfg.pack_tokens} tokens) in epoch "
                f"{empty[0]}; lower --pack-tokens"
            )
        eval_packs = (
            rank_slice(plan_packs(eval_ids, lengths, cfg.pack_tokens, cfg.seed, EVAL_EPOCH), rank, world, 1)
            if len(eval_ids)
            else []
        )

        total_steps = len(schedule) if cfg.max_steps is None else min(cfg.max_steps, len(schedule))
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=device.type == "cuda"
        )
        warmup = max(1, int(round(cfg.warmup_ratio * total_steps)))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, warmup, cfg.min_lr_ratio))
        state = ckpt.TrainState(step=0, epoch=0, step_in_epoch=0, store_identity=store_identity(store))
        return cls(
            replace(cfg, compile_drafter=cfg.compiles_drafter(device.type)),  # train_config.json says which
            rank,
            world,
            device,
            cluster,
            store,
            model,
            head,
            spec,
            gamma,
            plan,
            schedule,
            total_steps,
            eval_packs,
            trainable,
            optimizer,
            scheduler,
            state,
        )

    @property
    def kl_weight(self) -> float:
        """The KL term's share of the draft loss (`--loss`, `--kl-weight`)."""
        return kl_share(self.cfg.loss, self.cfg.kl_weight)

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    @property
    def epoch_limit(self) -> bool:
        """--epochs ends the run before --max-steps."""
        return self.cfg.max_steps is not None and len(self.schedule) < self.cfg.max_steps

    def epoch_limit_warning(self) -> str:
        """Said before the first step of a run that `epoch_limit` will end (a --resume with a larger
        --max-steps, say), not only in the summary after it; the epochs asked for are an estimate,
        as epochs differ a little in steps."""
        cfg, steps = self.cfg, len(self.schedule)
        epochs = math.ceil(cfg.max_steps * cfg.epochs / steps)
        return (
            f"dflash-train: warning: --epochs {cfg.epochs} caps this run at {steps} steps, below --max-steps "
            f"{cfg.max_steps}; raise --epochs (to about {epochs}) to train {cfg.max_steps} steps"
        )

    def resume(self) -> bool:
        """With --resume, restore the drafter, optimizer, schedule and state of the last checkpoint
        (True if there was one); without, refuse an --out that holds an earlier run's checkpoints."""
        out = self.out
        resume_from = ckpt.latest_checkpoint(out) if self.cfg.resume else None
        if self.cfg.resume and resume_from is None and self.rank == 0:
            print(f"dflash-train: no checkpoint under {out}; starting from scratch")
        if resume_from is None:
            if self.rank == 0 and out.exists() and ckpt.latest_checkpoint(out) is not None:
                raise TrainingError(
                    f"{out}: holds checkpoints of an earlier run; pass --resume to continue it or choose a new --out"
                )
            return False
        state = ckpt.load_state(resume_from)
        if state.store_identity != self.state.store_identity:
            raise TrainingError(f"{resume_from}: checkpoint was trained on another store or target; use a new --out")
        saved = DFlashDrafter.from_pretrained(resume_from)
        if saved.config != self.model.config:
            raise TrainingError(f"{resume_from}: checkpoint drafter config differs from this run's settings")
        self.model.load_state_dict(saved.state_dict())
        ckpt.load_trainer_state(resume_from, self.optimizer, self.scheduler)
        self.state = state
        return True

    def autocast(self) -> torch.autocast:
        return (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if self.device.type == "cuda"
            else torch.autocast("cpu", enabled=False)
        )

    def fit(self, metrics: MetricsLog) -> tuple[float | None, float]:
        """The steps from `state.step` to `total_steps`, each logged, checkpointed and evaluated at
        its interval (first the evaluation a cut lost, see `evaluation_was_cut`); (last tau, tokens/s
        of the last logged window), the kept log's if no step logs them."""
        cfg, state = self.cfg, self.state
        tau, rate = metrics.kept_results()
        if self.evaluation_was_cut(metrics):
            tau = self.log_evaluation(metrics)
            if tau is None:  # a stop signal again: the checkpoint resumed from is this step's
                raise self.stopped()
        ddp = (
            DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
            if self.world > 1
            else self.model
        )
        if cfg.compile_drafter:  # the training forward only: evaluation's shapes differ and stay eager
            ddp = compiled_drafter(ddp)
        bar = progress_bar(
            total=self.total_steps, initial=state.step, desc="train", unit="step", disable=self.rank != 0
        )
        throughput = Throughput()
        workers = cfg.resolved_loader_workers(int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
        dataset = StepDataset(cfg.store, self.plan, self.spec)
        with closing(
            device_batches(dataset, self.schedule[state.step : self.total_steps], workers, self.device)
        ) as batches:
            for epoch, k, batch, result in self.trained_steps(ddp, batches, bar):
                state.step += 1
                state.epoch, state.step_in_epoch = epoch, k + 1
                state.last_loss = result.loss
                throughput.add(int((batch["context_doc"] >= 0).sum()) * self.world)
                if state.step % cfg.log_every == 0 or state.step == self.total_steps:
                    rate = throughput.rate()
                    metrics.write(self.step_record(result, rate))
                    bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{rate:,.0f}")
                bar.update(1)
                saved = state.step % cfg.checkpoint_every == 0 or state.step == self.total_steps
                if saved:
                    self.save_checkpoint()  # before the evaluation: a cut while it runs loses no steps
                stop = result.stop
                if not stop and self.evaluation_due(state.step):
                    evaluated = self.log_evaluation(metrics)
                    if evaluated is None:
                        stop = True
                    else:
                        tau = evaluated
                if stop:  # the resumed run runs this step's evaluation first, if one was due
                    if not saved:
                        self.save_checkpoint()
                    bar.close()
                    raise self.stopped()
        bar.close()
        return tau, rate

    def trained_steps(
        self, ddp: torch.nn.Module, batches: Iterator[tuple[int, int, dict[str, torch.Tensor]]], bar: tqdm
    ) -> Iterator[tuple[int, int, dict[str, torch.Tensor], StepResult]]:
        """(epoch, index in it, batch, its step's result) for each batch fetched. A fetch or step that
        fails after a stop signal ends with the stop's line: the signal reached the step's helper
        processes too (loader workers still starting, compile workers), so the step cannot end."""
        while True:
            try:
                fetched = next(batches, None)
                if fetched is None:
                    return
                epoch, k, batch = fetched
                result = self.train_step(ddp, batch)
            except Exception as exc:
                if not stop_requested():
                    raise
                bar.close()
                raise TrainingStopped(
                    f"stopped by {stop_cause()} during step {self.state.step + 1:,} of {self.total_steps:,}, which "
                    f"its helper processes did not survive ({type(exc).__name__}); {RESUME_HINT}"
                ) from exc
            yield epoch, k, batch, result

    def stopped(self) -> TrainingStopped:
        """What every rank raises once they agreed to stop: its line says how to go on."""
        return TrainingStopped(
            f"stopped by {self.stopped_by or stop_cause()} after step {self.state.step:,} of {self.total_steps:,}; "
            f"its checkpoint is written: {RESUME_HINT}"
        )

    def evaluation_due(self, step: int) -> bool:
        return bool(self.eval_packs) and (step % self.cfg.eval_every == 0 or step == self.total_steps)

    def evaluation_was_cut(self, metrics: MetricsLog) -> bool:
        """Whether the resumed step is one whose evaluation the log lacks: the run was cut while it ran
        (its checkpoint is written first). Rank 0 reads the log; every rank gets its answer."""
        if self.state.step == 0 or not self.evaluation_due(self.state.step):
            return False
        lacking = self.rank == 0 and not metrics.has_evaluation(self.state.step)
        return all_sum([float(lacking)], self.device)[0] > 0

    def log_evaluation(self, metrics: MetricsLog) -> float | None:
        """`evaluate` at the current step, logged with the seconds it took (`eval_s`); -> its tau, or
        None where a stop signal cut it (nothing logged)."""
        start = time.perf_counter()
        held_out = self.evaluate()
        if held_out is None:
            return None
        metrics.write(
            {"step": self.state.step, "type": "eval", **held_out, "eval_s": round(time.perf_counter() - start, 3)}
        )
        return held_out["tau"]

    def train_step(self, ddp: torch.nn.Module, batch: dict[str, torch.Tensor]) -> StepResult:
        """One optimizer step on this rank's share of the global batch; what it did over all ranks."""
        self.model.train()
        with self.autocast():
            loss_sum, weight, stats = pack_loss(
                ddp,
                self.head,
                batch,
                self.gamma,
                self.cfg.selector_loss_weight,
                self.kl_weight,
                self.cfg.compile_drafter,
            )
        (global_weight,) = all_sum([float(weight)], self.device)
        loss = loss_sum * (self.world / max(global_weight, 1e-12))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.grad_clip)
        terms = loss_term_sums(stats)
        reduced = all_sum(  # a stop signal on any rank rides along, so all stop at the same step
            [float(loss_sum.detach()), float(grad_norm), *terms.values()]
            + stats["correct"].tolist()
            + stats["total"].tolist()
            + stop_votes(),
            self.device,
        )
        self.stopped_by = cause_of(reduced[-len(STOP_SIGNALS) :])
        reduced = reduced[: -len(STOP_SIGNALS)]
        denominator = max(global_weight, 1e-12)
        step_loss = reduced[0] / denominator
        if not math.isfinite(step_loss) or not math.isfinite(float(grad_norm)):
            raise TrainingError(
                f"loss became {step_loss} at step {self.state.step + 1}; stopped, the last good checkpoint is "
                f"{ckpt.latest_checkpoint(self.out) or 'none (no checkpoint was written yet)'}"
            )
        self.optimizer.step()
        self.scheduler.step()
        counts = np.array(reduced[2 + len(terms) :])
        return StepResult(
            step_loss,
            {key: value / denominator for key, value in zip(terms, reduced[2:])},
            reduced[1] / self.world,
            *np.split(counts, 2),
            self.stopped_by is not None,
        )

    def step_record(self, result: StepResult, rate: float) -> dict:
        """The metrics line of the step just done (DFlash-2's loss terms beside its loss)."""
        return {
            "step": self.state.step,
            "epoch": self.state.epoch,
            "loss": result.loss,
            **result.terms,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": result.grad_norm,
            "tokens_per_s": rate,
            "acc": [round(c / t, 4) if t else None for c, t in zip(result.correct, result.total)],
        }

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """The held-out packs of all ranks, the drafter in eval mode: the mean offline acceptance length
        over the drawn anchors (`tau`), the acceptance greedy decoding would see (`tau_decode`, and
        `tau_decode_head` over each reply's first `eval_decode_head` tokens; unless --no-eval-decode) and, for DFlash-2, the loss terms (`loss_term_sums`' keys) as weighted means.
        None on every rank if a stop signal reached any of them meanwhile: each stops at its next pack."""
        self.model.eval()
        total, count, weight, terms = 0.0, 0, 0.0, {}
        chain = [0, 0, 0, 0]  # tokens and steps of the whole chain, then of its head
        for pack in self.eval_packs:
            if stop_requested():
                break
            ctx, blocks_batch = self.eval_context(pack)
            batch, pack_weight, stats = blocks_batch(draw_anchors(ctx, self.spec, self.cfg.seed, EVAL_EPOCH))
            accepted = block_acceptance(batch, stats["pred"], self.spec.block_size)
            total += float(accepted.sum())
            count += accepted.numel()
            weight += float(pack_weight)
            for key, value in loss_term_sums(stats).items():
                terms[key] = terms.get(key, 0.0) + value
            if self.cfg.eval_decode:
                chain = [a + b for a, b in zip(chain, self.decode_chain_of(ctx, blocks_batch))]
        total, count, weight, *sums = all_sum(
            [total, float(count), weight, *map(float, chain), *terms.values(), *stop_votes()], self.device
        )
        self.stopped_by = cause_of(sums[-len(STOP_SIGNALS) :])
        (tokens, steps, head_tokens, head_steps), sums = sums[:4], sums[4 : -len(STOP_SIGNALS)]
        self.model.train()
        if self.stopped_by:
            return None
        decode = {
            "tau_decode": tokens / steps if steps else float("nan"),
            "tau_decode_head": head_tokens / head_steps if head_steps else float("nan"),
        }
        return {
            "tau": total / count if count else float("nan"),
            **(decode if self.cfg.eval_decode else {}),
            **{key: value / max(weight, 1e-12) for key, value in zip(terms, sums)},
        }

    def decode_chain_of(self, ctx: PackContext, blocks_batch: Callable) -> tuple[int, int, int, int]:
        """(tokens, steps) of greedy decoding through the pack's held-out replies, then the same for
        the first `eval_decode_head` tokens of each: a block at every anchor, then the chain through
        their acceptance lengths (`train.decode_tau`)."""
        lengths = torch.zeros(self.spec.pack_tokens, dtype=torch.long)
        for anchors in every_anchor(ctx.mask, ctx.doc, self.spec.num_blocks):
            batch, _, stats = blocks_batch(anchors)
            lengths[anchors] = block_acceptance(batch, stats["pred"], self.spec.block_size).long().cpu()
        head = decode_chain(lengths, ctx.mask, ctx.doc, within=self.cfg.eval_decode_head)
        return (*decode_chain(lengths, ctx.mask, ctx.doc), *head)

    def eval_context(self, pack: list[int]) -> tuple[PackContext, Callable]:
        """A held-out pack's context read once (its states on the device) and a function from anchors
        to (batch, weight, stats) of `pack_loss` on their blocks."""
        layout = batch_layout(self.spec, 1, self.store.hidden_width, self.store.hidden_dtype, self.store.scale_groups)
        states = {
            key: torch.empty(shape, dtype=dtype)
            for key, (shape, dtype) in layout.items()
            if key in ("context_hidden", "context_scales")
        }
        scales = states["context_scales"][0] if "context_scales" in states else None
        ctx = read_pack_context(self.store, pack, self.spec, states["context_hidden"][0], scales)
        on_device = to_device(states, self.device)

        def blocks_batch(anchors: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict]:
            batch = {
                **on_device,
                **to_device({k: v[None] for k, v in ctx.blocks(anchors, self.spec).items()}, self.device),
            }
            with self.autocast():
                _, pack_weight, stats = pack_loss(
                    self.model, self.head, batch, self.gamma, self.cfg.selector_loss_weight, self.kl_weight
                )
            return batch, pack_weight, stats

        return ctx, blocks_batch

    @cached_property
    def target_identity(self) -> TargetIdentity:
        """Written beside every checkpoint and the drafter; read from the store once."""
        return TargetIdentity.of_store(self.store.root, self.store.manifest.target)

    def save_checkpoint(self) -> None:
        """Rank 0 writes the checkpoint of the step just done; every rank meets after it."""
        if self.rank == 0:
            ckpt.save_checkpoint(
                self.out,
                self.model,
                self.optimizer,
                self.scheduler,
                self.state,
                self.cfg.keep_checkpoints,
                self.target_identity,
            )
        if self.cluster is not None:
            self.cluster.meet(f"checkpoint-{self.state.step}")

    def save_drafter(self) -> None:
        """Rank 0 writes the trained drafter to OUT/drafter; every rank meets after it."""
        if self.rank == 0:
            ckpt.save_drafter(self.model, self.out / "drafter", self.target_identity)
        if self.cluster is not None:
            self.cluster.meet("drafter-saved")


def train_rank(
    rank: int, world: int, cfg: TrainConfig, device: torch.device, cluster: Cluster | None = None
) -> RankResult:
    """`cluster`: with several ranks, where they wait for one another's unequal work (see `Cluster.meet`)."""
    trainer = Trainer.build(rank, world, cfg, device, cluster)
    resumed = trainer.resume()
    out = trainer.out
    out.mkdir(parents=True, exist_ok=True)
    metrics = MetricsLog(out / "metrics.jsonl", rank == 0, trainer.state.step if resumed else None)
    if rank == 0:
        (out / "train_config.json").write_text(json.dumps(trainer.cfg.to_dict(), indent=1))  # as it runs
        if trainer.epoch_limit:
            print(trainer.epoch_limit_warning(), file=sys.stderr, flush=True)
    already_complete = resumed and trainer.state.step >= trainer.total_steps
    tau, rate = trainer.fit(metrics)
    trainer.save_drafter()
    state = trainer.state
    return RankResult(state.step, state.last_loss, tau, rate, str(out), already_complete, trainer.epoch_limit)


def init_distributed(
    rank: int,
    world: int,
    device: torch.device,
    init_method: str | None,
    timeout_s: float = TrainConfig.collective_timeout,
) -> None:
    if world == 1 and init_method is None:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"timeout": group_timeout(timeout_s)}
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=rank, world_size=world)
    dist.init_process_group(backend, **kwargs)


def lock_out_on_rank0(rank: int, cfg: TrainConfig, held: ExitStack) -> None:
    """Under torchrun, where no process of ours started the ranks to hold --out's run lock for them:
    rank 0 takes it into `held`, and its refusal reaches every rank, so every node stops with its line."""
    refusal = [None]
    if rank == 0:
        try:
            held.enter_context(run_lock(Path(cfg.out), "dflash-train"))
        except RunLockError as exc:
            refusal = [str(exc)]
    if dist.is_initialized():
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise RunLockError(refusal[0])


def stop_announcement(signum: int) -> str:
    """What a stop signal does to a training run, said at once by each host's first rank."""
    line = f"dflash-train: {signal_name(signum)}: stopping after this step, with its checkpoint"
    return line + ("; press Ctrl-C again to stop at once, without it" if signum == signal.SIGINT else "")


def rank_entry(rank: int, world: int, cfg: TrainConfig, init_method: str | None, torchrun: bool = False) -> RankResult:
    """Body of one training process, spawned or (`torchrun`) started by torchrun. A process that spawns
    the ranks holds --out's run lock for them; under torchrun rank 0 takes it."""
    if cfg.device == "cuda":
        gpu = cfg.gpus[rank] if cfg.gpus and init_method is not None else int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
        # one thread, whatever OMP_NUM_THREADS or the host: a run and its resume must round alike, and
        # with 2 threads about 1 process in 10 computed the drafter's RoPE cos differently (16 of 64
        # columns off by up to 1.5e-4, so another step-1 loss); with 1 thread, 30 of 30 runs agreed
        torch.set_num_threads(1)
    init_distributed(rank, world, device, init_method, cfg.collective_timeout)
    try:
        with ExitStack() as held:
            first_on_host = (int(os.environ.get("LOCAL_RANK", rank)) if torchrun else rank) == 0
            held.enter_context(stopping_gracefully(announce=stop_announcement if first_on_host else None))
            cluster = None
            if dist.is_initialized():
                cluster = held.enter_context(
                    Cluster("dflash-train", cfg.collective_timeout, RESUME_HINT, interrupt_on_failure=torchrun)
                )
                cluster.require_shared(Path(cfg.out), "--out")
            if torchrun:
                lock_out_on_rank0(rank, cfg, held)
            return train_rank(rank, world, cfg, device, cluster)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

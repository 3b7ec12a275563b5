"""Stage two on one rank: DDP drafter training from the feature store, checkpoints, evaluation.

The loss is normalised by the weight summed over *all* ranks (one all-reduce of a scalar before the
backward), so a DDP step equals a single-process step on the same global batch exactly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dflash_pipeline.shared.blocks import default_gamma
from dflash_pipeline.shared.cluster import Cluster, group_timeout
from dflash_pipeline.shared.drafter import DFlashConfig, DFlashDrafter, TargetHead
from dflash_pipeline.shared.durable import replace_dir_durably, write_bytes_durably
from dflash_pipeline.shared.errors import UserError
from dflash_pipeline.shared.progress import progress_bar
from dflash_pipeline.shared.store import FeatureStore
from dflash_pipeline.train import checkpoint as ckpt
from dflash_pipeline.train.config import TrainConfig
from dflash_pipeline.train.dataset import PackSpec, StepDataset, StepPlan, build_batch
from dflash_pipeline.train.feed import device_batches
from dflash_pipeline.train.holdout import prompt_groups
from dflash_pipeline.train.metrics import read_records
from dflash_pipeline.train.packing import plan_packs, rank_slice, split_holdout
from dflash_pipeline.train.setup import (
    load_target_config,
    resolve_mask_token,
    store_identity,
    validate_store,
)
from dflash_pipeline.train.step import block_acceptance, pack_loss, to_device
from dflash_pipeline.train.target_identity import TargetIdentity


# Held-out packs and their anchors are drawn with this "epoch", apart from every training epoch.
EVAL_EPOCH = 2**31 - 1


RESUME_HINT = "rerun with --resume to continue from the last checkpoint"


class TrainingError(UserError, RuntimeError):
    """Training cannot continue (bad store, diverged loss, mismatched checkpoint)."""


@dataclass
class RankResult:
    steps: int
    final_loss: float | None
    eval_tau: float | None  # the last evaluation's, this session's or (resumed) an earlier one's
    tokens_per_s: float  # of the last logged window, likewise
    out: str
    already_complete: bool = False  # resumed a run that had done all its steps: nothing trained now
    epoch_limit: bool = False  # --epochs ended the run before --max-steps


def backend_for(cfg: TrainConfig, device: torch.device) -> str:
    """Compiled flex on GPU; on CPU compiled flex has no backward, so the eager/SDPA reference."""
    if cfg.attention != "auto":
        return cfg.attention
    return "flex_compiled" if device.type == "cuda" else "sdpa_dense"


def lr_lambda(total_steps: int, warmup: int, min_ratio: float):
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


def from_rank0(compute: Callable[[], np.ndarray], length: int, device: torch.device,
               cluster: Cluster | None = None) -> np.ndarray:
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


class MetricsLog:
    """metrics.jsonl on rank 0; on resume, lines after the resumed step are dropped first. A new
    run's log is started by its first record, so a run that fails before its first step leaves none."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None):
        self.path = path
        self.enabled = enabled
        self.mode = "w" if resume_step is None else "a"
        self.kept: list[dict] = []  # the records up to the resumed step, which a resumed run reports from
        if enabled and resume_step is not None and path.exists():
            records, warning = read_records(path)  # a line cut short by the crash is dropped
            if warning:
                print(f"dflash-train: warning: {warning}", file=sys.stderr)
            self.kept = [r for r in records if r.get("step", 0) <= resume_step]
            write_bytes_durably(path, "".join(json.dumps(r) + "\n" for r in self.kept).encode())  # a crash keeps the old log

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, self.mode) as f:
                f.write(json.dumps(record) + "\n")
            self.mode = "a"


def build_model(cfg: TrainConfig, store: FeatureStore, device: torch.device) -> tuple[DFlashDrafter, TargetHead]:
    target_config = load_target_config(store)
    mask_token = resolve_mask_token(store, cfg.mask_token_id)
    dcfg = DFlashConfig.for_target(
        target_config,
        store.layer_ids,
        num_layers=cfg.num_layers,
        block_size=cfg.block_size,
        mask_token_id=mask_token,
    )
    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(dcfg).to(device)
    head = TargetHead.load(Path(store.root) / "target" / "target_head.safetensors", device=device)
    return model, head


def train_rank(rank: int, world: int, cfg: TrainConfig, device: torch.device, cluster: Cluster | None = None) -> RankResult:
    """`cluster`: with several ranks, where they wait for one another's unequal work (see `Cluster.meet`)."""
    out = Path(cfg.out)
    store = FeatureStore(cfg.store)
    validate_store(store, cfg)
    identity = store_identity(store)
    model, head = build_model(cfg, store, device)
    backend = backend_for(cfg, device)
    model.attention_backend = backend
    gamma = cfg.gamma if cfg.gamma is not None else default_gamma(cfg.block_size)

    lengths = np.asarray(store.lengths)
    # a held-out prompt never also trains
    groups = from_rank0(lambda: prompt_groups(store), len(store), device, cluster) if cfg.eval_samples else None
    train_ids, eval_ids = split_holdout(len(store), cfg.eval_samples, cfg.seed, groups)
    spec = PackSpec(cfg.pack_tokens, cfg.num_blocks, cfg.block_size, model.config.mask_token_id, cfg.max_anchors_per_sample)
    plan = StepPlan(train_ids, lengths, cfg.pack_tokens, cfg.seed, rank, world, cfg.packs_per_step)
    schedule = plan.schedule(cfg.epochs)
    empty = sorted(set(range(cfg.epochs)) - {epoch for epoch, _ in schedule})
    if empty:
        raise TrainingError(
            f"{cfg.store}: {len(train_ids)} training samples fill fewer packs than one step needs "
            f"({world} ranks x {cfg.packs_per_step} packs of {cfg.pack_tokens} tokens) in epoch "
            f"{empty[0]}; lower --pack-tokens"
        )
    total_steps = len(schedule) if cfg.max_steps is None else min(cfg.max_steps, len(schedule))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                  fused=device.type == "cuda")
    warmup = max(1, int(round(cfg.warmup_ratio * total_steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, warmup, cfg.min_lr_ratio))

    state = ckpt.TrainState(step=0, epoch=0, step_in_epoch=0, store_identity=identity)
    resume_from = ckpt.latest_checkpoint(out) if cfg.resume else None
    if cfg.resume and resume_from is None and rank == 0:
        print(f"dflash-train: no checkpoint under {out}; starting from scratch")
    if resume_from is not None:
        state = ckpt.load_state(resume_from)
        if state.store_identity != identity:
            raise TrainingError(f"{resume_from}: checkpoint was trained on another store or target; use a new --out")
        saved = DFlashDrafter.from_pretrained(resume_from)
        if saved.config != model.config:
            raise TrainingError(f"{resume_from}: checkpoint drafter config differs from this run's settings")
        model.load_state_dict(saved.state_dict())
        ckpt.load_trainer_state(resume_from, optimizer, scheduler)
    elif rank == 0 and out.exists() and ckpt.latest_checkpoint(out) is not None:
        raise TrainingError(f"{out}: holds checkpoints of an earlier run; pass --resume to continue it or choose a new --out")

    out.mkdir(parents=True, exist_ok=True)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else model
    metrics = MetricsLog(out / "metrics.jsonl", rank == 0, state.step if resume_from is not None else None)
    if rank == 0:
        (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    eval_packs = rank_slice(plan_packs(eval_ids, lengths, cfg.pack_tokens, cfg.seed, EVAL_EPOCH), rank, world, 1) if len(eval_ids) else []

    bar = progress_bar(total=total_steps, initial=state.step, desc="train", unit="step", disable=rank != 0)
    last_loss, tau, rate = state.last_loss, None, 0.0
    for record in metrics.kept:  # a resumed run that trains no further still reports its last results
        tau = record["tau"] if record.get("type") == "eval" else tau
        rate = record.get("tokens_per_s", rate)
    already_complete = resume_from is not None and state.step >= total_steps
    epoch_limit = cfg.max_steps is not None and len(schedule) < cfg.max_steps
    window_tokens, window_start = 0, time.perf_counter()
    workers = cfg.resolved_loader_workers(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    batches = device_batches(StepDataset(cfg.store, plan, spec), schedule[state.step : total_steps], workers, device)
    for epoch, k, batch in batches:
        model.train()
        with autocast:
            loss_sum, weight, stats = pack_loss(ddp, head, batch, backend, gamma)
        global_weight, = all_sum([float(weight)], device)
        loss = loss_sum * (world / max(global_weight, 1e-12))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
        reduced = all_sum([float(loss_sum.detach()), float(grad_norm)] + stats["correct"].tolist() + stats["total"].tolist(), device)
        step_loss = reduced[0] / max(global_weight, 1e-12)
        if not math.isfinite(step_loss) or not math.isfinite(float(grad_norm)):
            raise TrainingError(
                f"loss became {step_loss} at step {state.step + 1}; stopped, the last good checkpoint is "
                f"{ckpt.latest_checkpoint(out) or 'none (no checkpoint was written yet)'}"
            )
        optimizer.step()
        scheduler.step()
        state.step += 1
        state.epoch, state.step_in_epoch = epoch, k + 1
        state.last_loss = last_loss = step_loss
        window_tokens += int((batch["context_doc"] >= 0).sum()) * world
        if state.step % cfg.log_every == 0 or state.step == total_steps:
            elapsed = time.perf_counter() - window_start
            rate = window_tokens / elapsed if elapsed > 0 else 0.0
            n_pos = (len(reduced) - 2) // 2
            correct, totals = np.array(reduced[2 : 2 + n_pos]), np.array(reduced[2 + n_pos :])
            metrics.write({
                "step": state.step, "epoch": state.epoch, "loss": step_loss, "lr": scheduler.get_last_lr()[0],
                "grad_norm": reduced[1] / world, "tokens_per_s": rate,
                "acc": [round(c / t, 4) if t else None for c, t in zip(correct, totals)],
            })
            window_tokens, window_start = 0, time.perf_counter()
            bar.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{rate:,.0f}")
        bar.update(1)
        if eval_packs and (state.step % cfg.eval_every == 0 or state.step == total_steps):
            tau = evaluate(model, head, cfg, store, eval_packs, spec, backend, device, autocast, gamma)
            metrics.write({"step": state.step, "type": "eval", "tau": tau})
        if state.step % cfg.checkpoint_every == 0 or state.step == total_steps:
            save_all(rank, out, model, optimizer, scheduler, state, cfg, store, cluster)
    bar.close()
    if rank == 0:
        save_drafter(model, out / "drafter", TargetIdentity.of_store(store.root, store.manifest.target))
    if cluster is not None:
        cluster.meet("drafter-saved")
    return RankResult(state.step, last_loss, tau, rate, str(out), already_complete, epoch_limit)


def save_drafter(model: DFlashDrafter, folder: Path, target: TargetIdentity) -> None:
    """The trained drafter with its target's identity, written whole or not at all."""
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    target.save(tmp)
    replace_dir_durably(tmp, folder)


def save_all(rank, out, model, optimizer, scheduler, state, cfg, store, cluster=None) -> None:
    if rank == 0:
        ckpt.save_checkpoint(out, model, optimizer, scheduler, state, cfg.keep_checkpoints,
                             TargetIdentity.of_store(store.root, store.manifest.target))
    if cluster is not None:
        cluster.meet(f"checkpoint-{state.step}")


@torch.no_grad()
def evaluate(model, head, cfg, store, eval_packs, spec, backend, device, autocast, gamma) -> float:
    """Mean offline acceptance length over the held-out packs (all ranks), the drafter in eval mode."""
    model.eval()
    total, count = 0.0, 0
    for pack in eval_packs:
        batch = to_device(build_batch(store, [pack], spec, cfg.seed, EVAL_EPOCH), device)
        with autocast:
            _, _, stats = pack_loss(model, head, batch, backend, gamma)
        accepted = block_acceptance(batch, stats["pred"], cfg.block_size)
        total += float(accepted.sum())
        count += accepted.numel()
    total, count = all_sum([total, float(count)], device)
    model.train()
    return total / count if count else float("nan")


def init_distributed(rank: int, world: int, device: torch.device, init_method: str | None,
                     timeout_s: float = TrainConfig.collective_timeout) -> None:
    if world == 1 and init_method is None:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"timeout": group_timeout(timeout_s)}
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=rank, world_size=world)
    dist.init_process_group(backend, **kwargs)


def rank_entry(rank: int, world: int, cfg: TrainConfig, init_method: str | None) -> RankResult:
    """Body of one training process (spawned or under torchrun)."""
    if cfg.device == "cuda":
        gpu = cfg.gpus[rank] if cfg.gpus and init_method is not None else int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
        # fixed by the host and world size alone (not OMP_NUM_THREADS or the caller's setting): a
        # parallel CPU kernel splits its sums by thread count, and a run and its resume must round alike
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_distributed(rank, world, device, init_method, cfg.collective_timeout)
    try:
        if not dist.is_initialized():
            return train_rank(rank, world, cfg, device)
        with Cluster("dflash-train", cfg.collective_timeout, RESUME_HINT) as cluster:
            cluster.require_shared(Path(cfg.out), "--out")
            return train_rank(rank, world, cfg, device, cluster)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

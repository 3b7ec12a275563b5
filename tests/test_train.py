"""Stage two on CPU: DDP == single process, exact resume after kill -9, and clear refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_extract_resume import spawned_children

from dflash_pipeline.data import sample_corpus_path
from dflash_pipeline.shared.runtime.launch import free_port, spawn_ranks
from dflash_pipeline.shared.store.reader import FeatureStore
from dflash_pipeline.train import feed
from dflash_pipeline.train.config import TrainConfig
from dflash_pipeline.train.dataset import PackSpec, StepDataset, StepPlan, batch_layout, build_batch, build_pack
from dflash_pipeline.train.feed import SlotLayout, SlotRing, device_batches, slots_needed
from dflash_pipeline.train.loop import TrainingError, build_model, init_distributed
from dflash_pipeline.train.packing import plan_packs, rank_slice
from dflash_pipeline.train.run import run_training
from dflash_pipeline.train.step import pack_loss

TRAIN_ARGS = [
    "--device",
    "cpu",
    "--num-layers",
    "1",
    "--block-size",
    "8",
    "--pack-tokens",
    "256",
    "--num-blocks",
    "16",
    "--eval-samples",
    "4",
    "--loader-workers",
    "0",
    "--lr",
    "1e-3",
]


@pytest.fixture(scope="module")
def store_dir(extract_cpu_store, tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    data.write_text("\n".join(sample_corpus_path().read_text().splitlines()[:48]) + "\n")
    return extract_cpu_store(data, tmp_path_factory.mktemp("store") / "store")


def base_config(store: Path, out: Path, **kw) -> TrainConfig:
    return TrainConfig(
        store=str(store),
        out=str(out),
        device="cpu",
        num_layers=1,
        block_size=8,
        pack_tokens=256,
        num_blocks=16,
        eval_samples=4,
        loader_workers=0,
        lr=1e-3,
        **kw,
    )


def global_batch_grads(rank: int, world: int, cfg: TrainConfig, init: str | None) -> dict[str, np.ndarray]:
    """Gradients after one backward on the first global batch (2 packs), as DDP would see them."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    init_distributed(rank, world, device, init)
    try:
        # the DDP wrapper is freed when this call returns, before the group is destroyed: freed after,
        # its reducer drops the last reference to the gloo group, whose destructor can wait forever
        # on a peer that has exited (this test hung twice under CI load)
        return ddp_backward_grads(rank, world, cfg, device)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def ddp_backward_grads(rank: int, world: int, cfg: TrainConfig, device: torch.device) -> dict[str, np.ndarray]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dflash_pipeline.train.loop import all_sum

    store = FeatureStore(cfg.store)
    model, head = build_model(cfg, store, device)
    ddp = DDP(model) if world > 1 else model
    lengths = np.asarray(store.lengths)
    spec = PackSpec.for_drafter(model.config, cfg.pack_tokens, cfg.num_blocks, 512)
    per_rank = 2 // world
    packs = rank_slice(plan_packs(np.arange(len(store)), lengths, cfg.pack_tokens, 0, 0), rank, world, per_rank)
    batch = build_batch(store, packs[:per_rank], spec, 0, 0)
    loss_sum, weight, _ = pack_loss(ddp, head, batch, 4.0)
    (global_weight,) = all_sum([float(weight)], device)
    (loss_sum * (world / global_weight)).backward()
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("workers, prefetch", [(2, 2), (1, 1)])
def test_loader_workers_deliver_the_planned_batches_across_epochs(store_dir, workers, prefetch):
    """One loader for the whole run: spawned workers decoding into the slot ring, an epoch boundary
    crossed, and (1 worker, prefetch 1: 3 slots for 7 steps) every slot refilled; every batch equals
    the same step built in this process, so no batch saw another's states or a stale tail."""
    store = FeatureStore(store_dir)
    plan = StepPlan(np.arange(len(store)), np.asarray(store.lengths), 256, seed=3, rank=1, world=2, packs_per_step=2)
    spec = PackSpec(256, 16, 8, 0, 512)
    first = plan.steps_in(0)
    schedule = plan.schedule(6)[first - 1 : first + 6]
    assert len(schedule) == 7 > 2 * slots_needed(1, 1) and len({e for e, _ in schedule}) >= 3
    dataset = StepDataset(str(store_dir), plan, spec)
    got = list(device_batches(dataset, schedule, workers, torch.device("cpu"), prefetch=prefetch))
    assert [(e, k) for e, k, _ in got] == schedule and dataset.slots is None
    for epoch, k, batch in got:
        packs = plan.epoch_packs(epoch)[2 * k : 2 * k + 2]
        want = build_batch(store, packs, spec, 3, epoch)
        assert batch.keys() == want.keys() and batch["context_hidden"].shape == (2, 256, store.hidden_width)
        assert all(torch.equal(batch[key], want[key]) for key in want), (epoch, k)
    padded = [(b["context_hidden"], b["context_doc"]) for _, _, b in got if (b["context_doc"] < 0).any()]
    assert padded and all(not h[d < 0].any() and h[d >= 0].abs().sum() > 0 for h, d in padded)  # padding is zero


class _WorkerTaggedSteps(StepDataset):
    """Each batch says which worker built it."""

    def __getitem__(self, item):
        epoch, k, batch = super().__getitem__(item)
        return epoch, k, {**batch, "worker": torch.tensor(torch.utils.data.get_worker_info().id)}


def test_each_worker_fills_only_its_own_slots(store_dir):
    """The slot of step i is i % slots and the DataLoader gives step i to worker i % workers; with a
    slot count that is a multiple of the worker count each worker keeps to its own slots (the ones it
    mapped at start). Checks both halves: the count, and torch's dispatch order."""
    for workers, prefetch in [(1, 1), (2, 2), (3, 2), (4, 1), (5, 3)]:
        count = slots_needed(workers, prefetch)
        assert count % workers == 0 and workers * prefetch + 2 <= count < workers * prefetch + 2 + workers
    store = FeatureStore(store_dir)
    plan = StepPlan(np.arange(len(store)), np.asarray(store.lengths), 256, seed=1, rank=0, world=1, packs_per_step=1)
    schedule = plan.schedule(3)[:10]
    got = list(
        device_batches(
            _WorkerTaggedSteps(str(store_dir), plan, PackSpec(256, 16, 8, 0, 512)),
            schedule,
            3,
            torch.device("cpu"),
            prefetch=2,
        )
    )
    assert [int(b["worker"]) for _, _, b in got] == [i % 3 for i in range(len(schedule))]


def test_in_process_batches_equal_worker_batches(store_dir):
    store = FeatureStore(store_dir)
    plan = StepPlan(np.arange(len(store)), np.asarray(store.lengths), 256, seed=5, rank=0, world=1, packs_per_step=1)
    dataset = StepDataset(str(store_dir), plan, PackSpec(256, 16, 8, 0, 512))
    schedule = plan.schedule(1)[:4]
    inline = list(device_batches(dataset, schedule, 0, torch.device("cpu")))
    spawned = list(device_batches(dataset, schedule, 1, torch.device("cpu"), prefetch=1))
    assert [(e, k) for e, k, _ in inline] == [(e, k) for e, k, _ in spawned] == schedule
    for (_, _, a), (_, _, b) in zip(inline, spawned):
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_no_steps_start_no_loader(store_dir, monkeypatch):
    """A resumed run already at its end asks for no batches: no slot ring, no worker processes."""
    store = FeatureStore(store_dir)
    plan = StepPlan(np.arange(len(store)), np.asarray(store.lengths), 256, seed=5, rank=0, world=1, packs_per_step=1)
    dataset = StepDataset(str(store_dir), plan, PackSpec(256, 16, 8, 0, 512))

    def no_loader(*args, **kwargs):
        raise AssertionError("a loader was built for no steps")

    monkeypatch.setattr(feed, "DataLoader", no_loader)
    monkeypatch.setattr(feed, "SlotRing", no_loader)
    assert list(device_batches(dataset, [], 8, torch.device("cpu"))) == []


def test_batch_layout_is_what_build_pack_makes(store_dir):
    """The slots are allocated from `batch_layout` before any batch exists, and a pack is written into
    them by assignment, which would silently cast a dtype or leave a key it lacks uninitialised."""
    store = FeatureStore(store_dir)
    spec = PackSpec(256, 16, 8, 0, 512)
    layout = batch_layout(spec, 3, store.hidden_width, store.hidden_dtype)
    hidden = torch.empty(256, store.hidden_width, dtype=store.hidden_dtype)
    part = build_pack(store, [0, 1], spec, 0, 0, hidden)
    assert set(layout) == {"context_hidden", *part}
    assert layout["context_hidden"] == ((3, *hidden.shape), hidden.dtype)
    for key, value in part.items():
        assert layout[key] == ((3, *value.shape), value.dtype), key


def test_slot_layout_views_are_aligned_and_disjoint():
    shapes = {"h": ((2, 3, 5), torch.bfloat16), "flag": ((7,), torch.bool), "ids": ((2, 9), torch.long)}
    layout = SlotLayout.of(shapes)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.carve(buffer)
    assert {k: (tuple(v.shape), v.dtype) for k, v in views.items()} == shapes
    offsets = [v.data_ptr() - buffer.data_ptr() for v in views.values()]
    assert offsets == [0, 256, 512] and layout.nbytes == 512 + 2 * 9 * 8 + 112  # each view starts 256-aligned
    views["h"].fill_(-1.5)
    views["ids"].fill_(-1)
    assert not views["flag"].any() and (views["h"] == -1.5).all()  # writes stay inside their own view
    assert int((buffer != 0).sum()) == 2 * 3 * 5 * 2 + 2 * 9 * 8


def test_a_slot_item_sends_only_its_number(store_dir):
    """With a slot ring the batch is built in the slot, and the item that crosses the DataLoader's
    pipe holds nothing else (the hand-over was the loader's limit, not the decode)."""
    store = FeatureStore(store_dir)
    plan = StepPlan(np.arange(len(store)), np.asarray(store.lengths), 256, seed=2, rank=0, world=1, packs_per_step=2)
    spec = PackSpec(256, 16, 8, 0, 512)
    ring = SlotRing(3, SlotLayout.of(batch_layout(spec, 2, store.hidden_width, store.hidden_dtype)), pin=False)
    dataset = StepDataset(str(store_dir), plan, spec, slots=ring)
    dataset.slots.buffers[1].fill_(0xFF)  # stale bytes: every one of them must be overwritten
    assert dataset[(0, 1, 1)] == (0, 1, {"slot": 1})
    want = build_batch(store, plan.epoch_packs(0)[2:4], spec, 2, 0)
    got = dataset.slots.views(1)
    assert got.keys() == want.keys() and all(torch.equal(got[key], want[key]) for key in want)


def groups_from_rank0(rank: int, world: int, store_dir: str, init: str) -> np.ndarray:
    """Each rank's copy of the held-out prompt groups; any rank but 0 computing them fails."""
    from dflash_pipeline.train.holdout import prompt_groups
    from dflash_pipeline.train.loop import from_rank0

    device = torch.device("cpu")
    init_distributed(rank, world, device, init)
    try:
        store = FeatureStore(store_dir)

        def compute():
            if rank != 0:
                raise AssertionError(f"rank {rank} read the prompts")
            return prompt_groups(store)

        return from_rank0(compute, len(store), device)
    finally:
        torch.distributed.destroy_process_group()


def test_prompt_groups_are_read_on_rank_0_and_sent_to_every_rank(store_dir):
    from dflash_pipeline.train.holdout import prompt_groups

    got = spawn_ranks(groups_from_rank0, 3, (3, str(store_dir), f"tcp://127.0.0.1:{free_port()}"))
    want = prompt_groups(FeatureStore(store_dir))
    assert len(want) > 1 and all(g.dtype == np.int64 and np.array_equal(g, want) for g in got)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_ddp_gradients_equal_single_process(store_dir, tmp_path, arch):
    """Every parameter's gradient (DFlash-2's convolutions and selector included) after a 2-rank DDP
    backward equals the single process's on the same global batch, and is the same on both ranks."""
    cfg = base_config(store_dir, tmp_path / "run")
    if arch == "dflash2":
        cfg = dflash2_config(store_dir, tmp_path / "run")
    single = global_batch_grads(0, 1, cfg, None)
    ranks = spawn_ranks(global_batch_grads, 2, (2, cfg, f"tcp://127.0.0.1:{free_port()}"))
    assert set(single) == set(ranks[0]) and len(single) > 5
    for name, g in single.items():
        np.testing.assert_allclose(ranks[0][name], g, rtol=1e-4, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name])


def losses(run: Path) -> dict[int, float]:
    """Loss by step; read while the trainer appends (or after a kill), so a cut-short last line is skipped."""
    from dflash_pipeline.train.metrics import read_records

    return {r["step"]: r["loss"] for r in read_records(run / "metrics.jsonl")[0] if "loss" in r}


def train_cmd(store: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dflash_pipeline.train.cli",
        "--store",
        str(store),
        "--out",
        str(out),
        *TRAIN_ARGS,
        "--max-steps",
        "10",
        "--checkpoint-every",
        "3",
        "--eval-every",
        "5",
        *extra,
    ]


@pytest.mark.slow
def test_killed_run_resumes_with_identical_losses(store_dir, tmp_path):
    ref = tmp_path / "ref"
    subprocess.run(train_cmd(store_dir, ref), check=True, capture_output=True)
    want = losses(ref)
    assert sorted(want) == list(range(1, 11))

    run = tmp_path / "run"
    proc = subprocess.Popen(
        train_cmd(store_dir, run), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() or len(losses(run)) < 5:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "drafter").exists()
    again = subprocess.run(train_cmd(store_dir, run), capture_output=True, text=True)
    assert again.returncode == 1 and "--resume" in again.stderr  # refuses to clobber a run silently
    resumed = subprocess.run(train_cmd(store_dir, run, "--resume"), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(run) == want
    assert (run / "drafter" / "model.safetensors").exists()


def test_training_reduces_loss_and_reports_acceptance(store_dir, tmp_path):
    result = run_training(replace(base_config(store_dir, tmp_path / "run"), max_steps=25, lr=3e-3, eval_every=25))
    got = losses(tmp_path / "run")
    assert got[25] < got[1]
    assert result.eval_tau is not None and result.eval_tau >= 1.0
    evals = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"eval"' in line
    ]
    assert evals and evals[-1]["tau"] == pytest.approx(result.eval_tau)
    # a DFlash run's eval records: the acceptance over drawn anchors and along the decoding chain
    assert [list(r) for r in evals] == [["step", "type", "tau", "tau_decode", "tau_decode_head", "eval_s"]]
    assert evals[-1]["eval_s"] > 0
    assert 1.0 <= evals[-1]["tau_decode"] <= 8 and 1.0 <= evals[-1]["tau_decode_head"] <= 8
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert list(first) == ["step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "acc"]
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["compile_drafter"] is False  # CPU


def test_no_eval_decode_logs_the_drawn_anchor_tau_alone(store_dir, tmp_path):
    run_training(replace(base_config(store_dir, tmp_path / "run"), max_steps=2, eval_every=2, eval_decode=False))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [list(r) for r in rows if r.get("type") == "eval"] == [["step", "type", "tau", "eval_s"]]


def test_refuses_incomplete_store(store_dir, tmp_path):
    import shutil

    from dflash_pipeline.shared.store.manifest import StoreIncomplete, load_manifest, write_manifest

    broken = tmp_path / "broken"
    shutil.copytree(store_dir, broken)
    m = load_manifest(broken)
    m.complete = False
    write_manifest(broken, m)
    with pytest.raises(StoreIncomplete, match="broken"):
        run_training(base_config(broken, tmp_path / "run"))


def test_refuses_store_of_another_target(store_dir, tiny_llama_dir, tmp_path):
    from dflash_pipeline.shared.target.identity import TargetMismatch

    with pytest.raises(TargetMismatch, match="config hash"):
        run_training(base_config(store_dir, tmp_path / "run", target=str(tiny_llama_dir)))


def test_refuses_block_larger_than_samples(store_dir, tmp_path):
    from dflash_pipeline.train.setup import StoreUnusable

    with pytest.raises(StoreUnusable, match="block size 4096 is larger than every sample"):
        run_training(replace(base_config(store_dir, tmp_path / "run"), block_size=4096, num_blocks=1))


def test_nan_loss_stops_and_keeps_last_good_checkpoint(store_dir, tmp_path):
    """Inf activations in the store make the loss NaN: training stops with a clear message."""
    import shutil

    import zarr

    poisoned = tmp_path / "poisoned"
    shutil.copytree(store_dir, poisoned)
    arr = zarr.open_array(poisoned / "shards" / "rank-00000.zarr" / "hidden_states", mode="r+")
    bits = np.full(arr.shape, 0x7F80, dtype=np.uint16)  # bf16 +inf
    arr[...] = bits
    with pytest.raises(TrainingError, match="loss became nan at step 1"):
        run_training(base_config(poisoned, tmp_path / "run"))


def assert_same_bits(a, b, where: str = "") -> None:
    """Equal to the bit: tensors by their bytes (so -0.0 != 0.0 and NaN == NaN), floats by hex."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_bits(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_bits(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert a.hex() == b.hex(), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), where
    else:
        assert a == b, where


def global_rngs() -> tuple:
    import random

    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def logged(run: Path) -> list[dict]:
    """A run's metrics records without their timings (which differ between equal runs)."""
    return [
        {k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "eval_s")}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


def assert_same_run(run: Path, reference: Path) -> None:
    """`run` logged the same metrics (timings aside) and saved the same drafter as `reference`, bit for bit."""
    from safetensors.torch import load_file

    assert_same_bits(logged(run), logged(reference), "metrics")
    assert_same_bits(
        load_file(run / "drafter" / "model.safetensors"),
        load_file(reference / "drafter" / "model.safetensors"),
        "drafter",
    )


def crashed_copy(
    run: Path, crashed: Path, last_checkpoint: int, final_step: int, logged_through: int, evaluated: bool = True
) -> Path:
    """A copy of finished `run` as a crash after its `last_checkpoint` leaves it: no final drafter, no
    checkpoint of `final_step` (unless it is the last one), the metrics lines of steps up to
    `logged_through` only; without `evaluated`, the crash cut the evaluation of `last_checkpoint`'s step."""
    import shutil

    shutil.copytree(run, crashed)
    shutil.rmtree(crashed / "drafter")
    if final_step != last_checkpoint:
        shutil.rmtree(crashed / "checkpoints" / f"step-{final_step:08d}")
    (crashed / "checkpoints" / "latest").write_text(f"step-{last_checkpoint:08d}")
    lines = (crashed / "metrics.jsonl").read_text().splitlines()
    cut = None if evaluated else (last_checkpoint, "eval")
    kept = [
        line
        for line, r in zip(lines, map(json.loads, lines))
        if r["step"] <= logged_through and (r["step"], r.get("type")) != cut
    ]
    (crashed / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    return crashed


def test_resume_restores_the_saved_state_bit_for_bit(store_dir, tmp_path, monkeypatch, capsys):
    """A crash after the step-4 checkpoint, while step 6's metrics line was being written: the resumed
    trainer holds exactly what was saved (drafter weights, every optimizer tensor, the LR schedule,
    the step and data position), goes on with the pack that came next, and repeats steps 5-6 of the
    uninterrupted run to the bit. The global RNGs are not in a checkpoint because training never draws
    from them (every random choice has its own seeded generator): scrambling them changes nothing."""
    import copy
    import random

    from dflash_pipeline.train import checkpoint as ckpt
    from dflash_pipeline.train import loop

    cfg = replace(
        base_config(store_dir, tmp_path / "a"), max_steps=6, checkpoint_every=2, eval_every=2, keep_checkpoints=3
    )
    saved, restored, schedules, models, after_init = {}, {}, [], [], []
    real_build, real_save, real_load = loop.build_model, ckpt.save_checkpoint, ckpt.load_trainer_state
    real_batches, real_state = loop.device_batches, ckpt.load_state

    def build_model(*args):
        model, head = real_build(*args)
        models.append(model)
        if len(models) == 1:
            after_init.append(copy.deepcopy(global_rngs()))
        else:  # the resumed run: its global RNGs are not the first run's
            torch.manual_seed(12345), np.random.seed(12345), random.seed(12345)
        return model, head

    def save_checkpoint(out, model, optimizer, scheduler, state, *rest):
        saved[state.step] = copy.deepcopy(
            (model.state_dict(), optimizer.state_dict(), scheduler.state_dict(), state.to_dict(), global_rngs())
        )
        return real_save(out, model, optimizer, scheduler, state, *rest)

    def load_state(path):
        restored["state"] = real_state(path)
        return restored["state"]

    def load_trainer_state(path, optimizer, scheduler):
        real_load(path, optimizer, scheduler)  # the drafter's weights were loaded just before
        restored["all"] = copy.deepcopy(
            (models[-1].state_dict(), optimizer.state_dict(), scheduler.state_dict(), restored["state"].to_dict())
        )

    def device_batches(dataset, steps, *args, **kwargs):
        schedules.append(list(steps))
        return real_batches(dataset, steps, *args, **kwargs)

    monkeypatch.setattr(loop, "build_model", build_model)
    monkeypatch.setattr(loop, "device_batches", device_batches)
    monkeypatch.setattr(ckpt, "save_checkpoint", save_checkpoint)
    monkeypatch.setattr(ckpt, "load_state", load_state)
    monkeypatch.setattr(ckpt, "load_trainer_state", load_trainer_state)
    run_training(cfg)
    assert sorted(saved) == [2, 4, 6] and not restored
    for step, s in saved.items():  # training drew nothing from the global RNGs after the drafter's init
        assert_same_bits(s[4], after_init[0], f"global RNGs at step {step}")

    # the run as a kill -9 after the step-4 checkpoint would leave it, step 6's metrics line half-written
    crashed = crashed_copy(Path(cfg.out), tmp_path / "b", last_checkpoint=4, final_step=6, logged_through=5)
    before_crash = (crashed / "metrics.jsonl").read_text().splitlines()
    with open(crashed / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 6, "epoch": 0, "lo')
    result = run_training(replace(cfg, out=str(crashed), resume=True))

    assert_same_bits(restored["all"], saved[4][:4], "restored")
    epoch, step_in_epoch = restored["all"][3]["epoch"], restored["all"][3]["step_in_epoch"]
    assert schedules[0][3] == (epoch, step_in_epoch - 1)  # the position is that of the 4th step done...
    assert schedules[1] == schedules[0][4:6]  # ...and the resumed run goes on with the 5th
    assert f"metrics.jsonl: line {len(before_crash) + 1} is cut short" in capsys.readouterr().err

    assert_same_run(crashed, Path(cfg.out))
    assert result.steps == 6 and not result.already_complete


@pytest.mark.parametrize(
    "cut_at, evaluated, workers",
    [
        (2, False, 1),
        (4, False, 1),
        (2, True, 1),
        pytest.param(2, False, 2, marks=pytest.mark.slow, id="2-False-gloo"),
        pytest.param(2, True, 2, marks=pytest.mark.slow, id="2-True-gloo"),
    ],
)
def test_a_crash_during_an_evaluation_loses_no_step_and_the_resumed_run_evaluates_first(
    store_dir, tmp_path, cut_at, evaluated, workers
):
    """A crash while the evaluation of step 2 (or of the last step) ran: that step's checkpoint was
    written before it, so the resumed run goes on from there, runs the lost evaluation first (every
    rank, on rank 0's reading of the log), and its log and drafter end as the uninterrupted run's. A
    crash after the evaluation was logged is not evaluated again."""

    cfg = replace(base_config(store_dir, tmp_path / "a"), max_steps=4, checkpoint_every=2, eval_every=2)
    cfg = replace(cfg, workers=workers, eval_samples=4 * workers)  # a held-out pack for each rank
    run_training(cfg)
    crashed = crashed_copy(
        Path(cfg.out), tmp_path / "b", cut_at, final_step=4, logged_through=cut_at, evaluated=evaluated
    )
    assert [r["step"] for r in logged(crashed) if r.get("type") == "eval"] == [2, 4][: cut_at // 2 - 1 + evaluated]
    result = run_training(replace(cfg, out=str(crashed), resume=True))
    assert_same_run(crashed, Path(cfg.out))
    assert result.eval_tau == [r["tau"] for r in logged(Path(cfg.out)) if r.get("type") == "eval"][-1]


@pytest.mark.parametrize("arrives", ["step 3", "step 4", "evaluation 4"])
def test_sigterm_stops_after_the_step_with_its_checkpoint_and_the_resumed_run_ends_as_the_uninterrupted_one(
    store_dir, tmp_path, monkeypatch, arrives
):
    """SIGTERM (a scheduler's preemption, `timeout`) during step 3, between checkpoints, during step 4,
    whose evaluation is due, or during that evaluation: the run stops after that step with one line (the
    evaluation cut short, nothing of it logged), its checkpoint written and no final drafter; the
    resumed run (evaluating step 4 first) ends bit-identical to the uninterrupted one."""

    from dflash_pipeline.train import loop

    cfg = replace(base_config(store_dir, tmp_path / "a"), max_steps=6, checkpoint_every=5, eval_every=2)
    run_training(cfg)
    where, step = arrives.split()
    patched = "train_step" if where == "step" else "eval_context"
    original = getattr(loop.Trainer, patched)

    def with_sigterm(self, *args):
        if self.state.step + (where == "step") == int(step):
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args)

    monkeypatch.setattr(loop.Trainer, patched, with_sigterm)
    handler = signal.getsignal(signal.SIGTERM)
    stopped = tmp_path / "b"
    with pytest.raises(loop.TrainingStopped, match=f"stopped by SIGTERM after step {step} of 6; .* --resume"):
        run_training(replace(cfg, out=str(stopped)))
    assert signal.getsignal(signal.SIGTERM) == handler
    assert (stopped / "checkpoints" / "latest").read_text() == f"step-{int(step):08d}"
    assert not (stopped / "drafter").exists()
    assert [r["step"] for r in logged(stopped) if r.get("type") == "eval"] == [2]
    monkeypatch.undo()
    run_training(replace(cfg, out=str(stopped), resume=True))
    assert_same_run(stopped, Path(cfg.out))


@pytest.mark.parametrize("helper", ["compiler", "loader"])
def test_sigterm_that_fails_a_step_through_its_helpers_stops_with_the_stop_s_line(
    helper, store_dir, tmp_path, monkeypatch
):
    """SIGTERM to a process group reaches the step's helper processes too (a compile's workers: on this
    CPU a `g++` killed mid-compile failed the first compiled step with a C++ compile error; loader workers
    still starting, before they ignore it: `make demo` stopped by Ctrl-C failed the fetch): the run
    stops with the stop's line, not the helper's error, and resumes from its last checkpoint to end as
    the uninterrupted run."""

    from dflash_pipeline.train import loop

    cfg = replace(base_config(store_dir, tmp_path / "a"), max_steps=4, checkpoint_every=2, eval_every=2)
    run_training(cfg)
    one_step, feed = loop.Trainer.train_step, loop.device_batches

    def step_whose_compiler_dies(self, ddp, batch):
        if self.state.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            raise RuntimeError("C++ compile error")
        return one_step(self, ddp, batch)

    def batches_whose_loader_dies(*args):
        for n, item in enumerate(feed(*args)):
            if n == 2:
                os.kill(os.getpid(), signal.SIGTERM)
                raise RuntimeError("DataLoader worker (pid(s) 1) exited unexpectedly")
            yield item

    if helper == "compiler":
        monkeypatch.setattr(loop.Trainer, "train_step", step_whose_compiler_dies)
    else:
        monkeypatch.setattr(loop, "device_batches", batches_whose_loader_dies)
    stopped = tmp_path / "b"
    with pytest.raises(loop.TrainingStopped, match=r"SIGTERM during step 3 of 4, .*\(RuntimeError\); .*--resume"):
        run_training(replace(cfg, out=str(stopped)))
    assert (stopped / "checkpoints" / "latest").read_text() == f"step-{2:08d}"
    monkeypatch.undo()
    run_training(replace(cfg, out=str(stopped), resume=True))
    assert_same_run(stopped, Path(cfg.out))


@pytest.mark.slow
def test_sigterm_or_ctrl_c_to_the_group_the_launcher_or_a_rank_stops_every_gloo_rank_at_one_step_and_loses_none(
    store_dir, tmp_path
):
    """Two gloo ranks with a loader worker each, as `timeout` (the whole process group), `kill` of the
    launcher (which passes it on) or of one rank sends SIGTERM, or a terminal's Ctrl-C (SIGINT to the
    group): every rank stops after the same step, exit code 1 with one line naming it and no traceback,
    that step's checkpoint written; the resumed run's losses are the uninterrupted run's. The first rank
    says at once what the signal does."""
    import re

    extra = ("--workers", "2", "--loader-workers", "1", "--max-steps", "40", "--checkpoint-every", "100")
    ref = tmp_path / "ref"
    subprocess.run(train_cmd(store_dir, ref, *extra), check=True, capture_output=True)
    want = losses(ref)
    for target in ("group", "launcher", "rank 1", "ctrl-c"):
        run = tmp_path / target
        proc = subprocess.Popen(
            train_cmd(store_dir, run, *extra),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            deadline = time.time() + 300
            while not (run / "metrics.jsonl").exists() or len(losses(run)) < 4:
                assert proc.poll() is None and time.time() < deadline
                time.sleep(0.02)
            if target in ("group", "ctrl-c"):
                os.killpg(proc.pid, signal.SIGINT if target == "ctrl-c" else signal.SIGTERM)
            elif target == "launcher":
                proc.send_signal(signal.SIGTERM)
            else:  # one rank alone: the others learn it in the step's all-reduce
                os.kill(spawned_children(proc.pid)[1], signal.SIGTERM)
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:  # a failed check leaves no run behind
                os.killpg(proc.pid, signal.SIGKILL)
        cause = "Ctrl-C" if target == "ctrl-c" else "SIGTERM"
        line = re.search(rf"\ndflash-train: error: rank \d: stopped by {cause} after step (\d+) of \d+;", stderr)
        assert proc.returncode == 1 and line and "Traceback" not in stderr, stderr[-2000:]
        # said at once by the host's first rank when it got the signal (rank 1 alone: nothing until the stop)
        announced = f"\ndflash-train: {cause}: stopping after this step, with its checkpoint"
        assert stderr.count(announced) == (0 if target == "rank 1" else 1), stderr[-2000:]
        step = int(line.group(1))
        assert (run / "checkpoints" / "latest").read_text() == f"step-{step:08d}"
        assert max(losses(run)) == step and not (run / "drafter").exists()
        resumed = subprocess.run(train_cmd(store_dir, run, *extra, "--resume"), capture_output=True, text=True)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert losses(run) == want


def test_summary_says_when_the_epoch_limit_ends_a_run_and_a_rerun_of_a_finished_run_shows_its_results(
    store_dir, tmp_path
):
    """The run stops after one epoch although --max-steps asks for more, and says why; `--resume` of
    the finished run trains nothing and reports that run's loss, last tau and throughput."""
    from click.testing import CliRunner

    from dflash_pipeline.train.cli import main

    def train(out: Path, *extra: str) -> list[str]:
        result = CliRunner().invoke(
            main,
            [
                "--store",
                str(store_dir),
                "--out",
                str(out),
                *TRAIN_ARGS,
                "--eval-every",
                "1000",
                "--checkpoint-every",
                "1000",
                *extra,
            ],
        )
        assert result.exit_code == 0, result.output
        return result.output.splitlines()[result.output.splitlines().index("dflash-train summary") :]

    first = train(tmp_path / "run", "--epochs", "1", "--max-steps", "1000")
    steps = len(losses(tmp_path / "run"))
    assert 1 < steps < 1000 and f"steps      {steps}   " in first[3]
    assert first[2] == "stopped    at the epoch limit (--epochs 1) before --max-steps 1000"
    assert "n/a" not in "\n".join(first) and not any(line.startswith("status") for line in first)

    again = train(tmp_path / "run", "--epochs", "1", "--max-steps", "1000", "--resume")
    assert again[2] == f"status     already complete at step {steps}: nothing left to train (--resume)"
    assert again[4] == first[3]  # the same steps, final loss and tau
    assert again[5] == first[4].replace("(last window)", "(last window of the finished run)") != first[4]
    assert len(losses(tmp_path / "run")) == steps

    short = train(tmp_path / "short", "--epochs", "1", "--max-steps", "2")
    assert (
        not any("epoch limit" in line or line.startswith("status") for line in short) and "steps      2   " in short[2]
    )


def test_a_resume_past_the_epoch_cap_says_so_before_training_and_in_the_summary(store_dir, tmp_path):
    """`--resume` with a --max-steps that --epochs cannot reach: one line before the first step names the
    cap and how to pass it, the summary says the cap ended the run; a run within the cap says neither."""
    import math

    from click.testing import CliRunner

    from dflash_pipeline.train.cli import main

    run = tmp_path / "run"

    def train(*extra: str) -> str:
        args = ["--store", str(store_dir), "--out", str(run), *TRAIN_ARGS, "--eval-every", "1000", "--epochs", "1"]
        result = CliRunner().invoke(main, [*args, *extra])
        assert result.exit_code == 0, result.output
        return result.output

    first = train("--max-steps", "2")
    assert "caps this run" not in first and "epoch limit" not in first
    resumed = train("--max-steps", "1000", "--resume")
    steps = max(losses(run))
    assert 2 < steps < 1000 and sorted(losses(run)) == list(range(1, steps + 1))
    warning = (
        f"dflash-train: warning: --epochs 1 caps this run at {steps} steps, below --max-steps 1000; "
        f"raise --epochs (to about {math.ceil(1000 / steps)}) to train 1000 steps"
    )
    lines = resumed.splitlines()
    assert lines.count(warning) == 1
    assert resumed.index(warning) < resumed.index("\rtrain:")  # before the progress bar
    summary = lines[lines.index("dflash-train summary") :]
    assert summary[2] == "stopped    at the epoch limit (--epochs 1) before --max-steps 1000"
    assert summary[3].startswith(f"steps      {steps}   ")


# ---- DFlash-2 (`--arch dflash2`): the same stores, the convolution + selector drafter, its loss


def dflash2_config(store: Path, out: Path, **kw) -> TrainConfig:
    # a rank and top-k below the released 256/16 keep the CPU steps fast; the conv defaults fit hidden 64
    return replace(base_config(store, out), arch="dflash2", selector_rank=32, selector_top_k=8, **kw)


def test_dflash2_options_are_checked():
    from dflash_pipeline.shared.runtime.config import ConfigError

    base = TrainConfig(store="s", out="o")
    assert (base.arch, base.conv_kernel_size, base.conv_group_size, base.selector_rank, base.selector_top_k) == (
        "dflash",
        2,
        16,
        256,
        16,
    )
    assert base.selector_loss_weight == 1.0 and list(base.to_dict())[-12:] == [
        "arch",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
        "selector_loss_weight",
        "sliding_window",
        "layer_types",
        "is_causal",
        "loss",  # the draft loss (issue 19), appended after
        "kl_weight",
        "compile_drafter",  # how the step runs, appended after
    ]
    for bad, option in [
        (dict(arch="dflash3"), "--arch"),
        (dict(selector_loss_weight=-0.5), "--selector-loss-weight"),
        (dict(conv_kernel_size=0), "--conv-kernel-size"),
        (dict(selector_top_k=0), "--selector-top-k"),
    ]:
        with pytest.raises(ConfigError, match=option):
            TrainConfig(store="s", out="o", **bad)


def test_dflash2_group_size_must_divide_the_target_hidden_size(store_dir, tmp_path):
    from dflash_pipeline.shared.runtime.config import ConfigError

    store = FeatureStore(store_dir)
    with pytest.raises(ConfigError, match=r"^--conv-group-size 24 does not divide the target's hidden size 64$"):
        build_model(dflash2_config(store_dir, tmp_path / "run", conv_group_size=24), store, torch.device("cpu"))
    model, _ = build_model(base_config(store_dir, tmp_path / "run", conv_group_size=24), store, torch.device("cpu"))
    assert model.config.arch == "dflash" and model.candidate_selector is None  # ignored with --arch dflash


def test_dflash2_loss_is_ce_plus_weighted_selector_term(store_dir, tmp_path):
    """pack_loss on a DFlash-2 drafter: the CE plus --selector-loss-weight times the selector's term,
    with each block's anchor token as the predecessor of its first draft."""
    store = FeatureStore(store_dir)
    cfg = dflash2_config(store_dir, tmp_path / "run")
    model, head = build_model(cfg, store, torch.device("cpu"))
    assert model.config.arch == "dflash2" and model.config.selector_top_k == 8
    spec = PackSpec.for_drafter(model.config, cfg.pack_tokens, cfg.num_blocks, 512)
    batch = build_batch(store, plan_packs(np.arange(len(store)), np.asarray(store.lengths), 256, 0, 0)[:1], spec, 0, 0)
    with torch.no_grad():
        one = pack_loss(model, head, batch, 4.0, 1.0)
        half = pack_loss(model, head, batch, 4.0, 0.5)
    stats = one[2]
    assert stats["selector"] > 0 and torch.equal(one[1], half[1])
    torch.testing.assert_close(one[0], (stats["ce"] + stats["selector"]) * one[1])
    torch.testing.assert_close(half[0], (stats["ce"] + 0.5 * stats["selector"]) * one[1])

    from dflash_pipeline.shared.model.loss import SelectorWeights, selector_loss
    from dflash_pipeline.train.step import drafter_hidden

    B, mask = model.config.block_size, model.config.mask_token_id
    blocks, valid = batch["block_ids"].view(-1, B), batch["block_valid"].view(-1)
    assert (blocks[:, 1:] == mask).all() and (blocks[valid, 0] != mask).all()  # position 0: the anchor token

    def selector_term(anchor_ids):
        with torch.no_grad():
            hidden = drafter_hidden(model, head, batch)
            weights = SelectorWeights.of(model.candidate_selector)
            return selector_loss(weights, hidden, batch["labels"], anchor_ids, head.lm_head, B, 4.0, 8)[1]["selector"]

    assert torch.equal(selector_term(batch["block_ids"][:, ::B]), stats["selector"])
    assert not torch.equal(selector_term(torch.full_like(blocks[:, 0], mask)), stats["selector"])


def test_dflash2_training_reduces_loss_and_saves_the_reference_model(store_dir, tmp_path):
    ref = pytest.importorskip("dflash.model")
    out = tmp_path / "run"
    result = run_training(dflash2_config(store_dir, out, max_steps=25, lr=3e-3, eval_every=25))
    got = losses(out)
    assert sorted(got) == list(range(1, 26))
    assert np.mean([got[s] for s in range(21, 26)]) < np.mean([got[s] for s in range(1, 6)]) - 0.1, got
    assert result.eval_tau is not None and result.eval_tau >= 1.0
    assert json.loads((out / "train_config.json").read_text())["arch"] == "dflash2"
    model, info = ref.DFlash2DraftModel.from_pretrained(out / "drafter", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert json.loads((out / "drafter" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert model.config.dflash_config["selector_rank"] == 32


def test_dflash2_resume_continues_with_identical_losses(store_dir, tmp_path):
    """A DFlash-2 run cut after its step-2 checkpoint and resumed ends as the uninterrupted run did, to
    the bit; resuming it as --arch dflash is refused (the saved drafter is a DFlash-2 one)."""

    cfg = dflash2_config(store_dir, tmp_path / "a", max_steps=4, checkpoint_every=2, eval_every=2)
    run_training(cfg)
    crashed = crashed_copy(Path(cfg.out), tmp_path / "b", last_checkpoint=2, final_step=4, logged_through=2)
    with pytest.raises(TrainingError, match="drafter config differs"):
        run_training(replace(cfg, out=str(crashed), resume=True, arch="dflash"))
    run_training(replace(cfg, out=str(crashed), resume=True))

    assert [m["step"] for m in logged(crashed) if "loss" in m] == [1, 2, 3, 4]
    assert_same_run(crashed, Path(cfg.out))


@pytest.mark.slow
def test_dflash2_ddp_run_equals_single_process_run_and_logs_its_loss_terms(store_dir, tmp_path):
    """`--arch dflash2 --workers 2` (gloo) trains the same steps as one process with both ranks' packs
    (--packs-per-step 2): equal losses, loss terms, held-out results and weights, to float rounding.
    Its training and eval records carry the CE and (unweighted) selector terms beside the loss."""
    from safetensors.torch import load_file

    common = dict(max_steps=3, eval_every=3, checkpoint_every=3, eval_samples=8, selector_loss_weight=0.5)
    ddp = dflash2_config(store_dir, tmp_path / "ddp", workers=2, **common)
    single = dflash2_config(store_dir, tmp_path / "single", packs_per_step=2, **common)
    run_training(ddp)
    run_training(single)
    records = {}
    for cfg in (ddp, single):
        rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
        records[cfg.workers] = rows
        train = [r for r in rows if "loss" in r]
        assert [list(r) for r in train] == [
            ["step", "epoch", "loss", "ce_loss", "selector_loss", "lr", "grad_norm", "tokens_per_s", "acc"]
        ] * 3
        for r in train:
            assert r["loss"] == pytest.approx(r["ce_loss"] + 0.5 * r["selector_loss"], rel=1e-6)  # fp32 terms
            assert r["ce_loss"] > 0 and r["selector_loss"] > 0
        assert [list(r) for r in rows if r.get("type") == "eval"] == [
            ["step", "type", "tau", "tau_decode", "tau_decode_head", "ce_loss", "selector_loss", "eval_s"]
        ]
    for got, want in zip(records[2], records[1], strict=True):
        assert got.keys() == want.keys() and got.get("acc") == want.get("acc")
        for key in got.keys() & {
            "loss",
            "ce_loss",
            "selector_loss",
            "grad_norm",
            "tau",
            "tau_decode",
            "tau_decode_head",
        }:
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
    weights = [load_file(Path(cfg.out) / "drafter" / "model.safetensors") for cfg in (ddp, single)]
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        torch.testing.assert_close(tensor, weights[1][name], rtol=1e-4, atol=1e-5, msg=name)


def test_layer_types_window_and_causality_train_and_are_saved_where_the_reference_reads_them(store_dir, tmp_path):
    """`dflash-train --layer-types --sliding-window --is-causal` (either arch) trains with those masks (the
    loss differs from the default drafter's from step 1) and saves a drafter whose layers the reference
    sets up the same way; bad combinations are one-line usage errors."""
    from click.testing import CliRunner

    ref = pytest.importorskip("dflash.model")
    from dflash_pipeline.shared.model.config import LayerAttention
    from dflash_pipeline.train.cli import main

    def train(out: Path, *extra: str):
        args = ["--store", str(store_dir), "--out", str(out), *TRAIN_ARGS, "--max-steps", "2", "--num-layers", "2"]
        return CliRunner().invoke(main, [*args, "--eval-every", "1000", "--checkpoint-every", "1000", *extra])

    attention = ["--layer-types", "full_attention,sliding_attention", "--sliding-window", "5", "--is-causal"]
    for arch, model_class in (("dflash", ref.DFlashDraftModel), ("dflash2", ref.DFlash2DraftModel)):
        dflash2 = ["--arch", "dflash2", "--selector-rank", "8", "--selector-top-k", "4"] if arch == "dflash2" else []
        runs = {name: tmp_path / f"{arch}-{name}" for name in ("plain", "windowed")}
        for result in (train(runs["plain"], *dflash2), train(runs["windowed"], *dflash2, *attention)):
            assert result.exit_code == 0, result.output
        plain, windowed = losses(runs["plain"]), losses(runs["windowed"])
        assert sorted(windowed) == [1, 2] and all(np.isfinite(list(windowed.values())))
        assert windowed[1] != plain[1]
        saved = json.loads((runs["windowed"] / "drafter" / "config.json").read_text())
        assert (saved["layer_types"], saved["sliding_window"], saved["is_causal"]) == (
            ["full_attention", "sliding_attention"],
            5,
            True,
        )
        model = model_class.from_pretrained(runs["windowed"] / "drafter", dtype=torch.float32)
        got = [LayerAttention(layer.self_attn.is_causal, layer.self_attn.sliding_window) for layer in model.layers]
        assert got == [LayerAttention(True, None), LayerAttention(True, 5)], arch
        kept = json.loads((runs["windowed"] / "train_config.json").read_text())
        assert (kept["layer_types"], kept["sliding_window"], kept["is_causal"]) == (
            ["full_attention", "sliding_attention"],
            5,
            True,
        )
    for extra, message in [
        (["--layer-types", "full_attention"], "--layer-types names 1 layers, --num-layers is 2"),
        (["--layer-types", "full_attention,chunked"], "'chunked' is not one of full_attention, sliding_attention"),
        (
            ["--layer-types", "sliding_attention,full_attention"],
            "--layer-types sliding_attention needs --sliding-window",
        ),
        (["--layer-types", "full_attention,full_attention", "--sliding-window", "4"], "--sliding-window needs a"),
        (["--sliding-window", "0"], "--sliding-window"),
    ]:
        result = train(tmp_path / "refused", *extra)
        assert result.exit_code == 2 and message in result.output, result.output
        assert not (tmp_path / "refused").exists()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_compiled_drafter_trains_as_the_eager_one_with_one_graph(store_dir, tmp_path, arch):
    """`--compile-drafter`: the same losses, gradient norms and saved drafter as the eager step up to
    float reassociation, from one compiled graph of the drafter and one of the loss's chunks for every
    step (no recompile per batch or row count); held-out evaluation stays eager."""
    from dflash_pipeline.shared.model.attention import CompileCounter
    from dflash_pipeline.shared.model.drafter import DFlashDrafter

    make = dflash2_config if arch == "dflash2" else base_config
    runs = {}
    for compiled in (False, True):
        out = tmp_path / f"compiled_{compiled}"
        torch._dynamo.reset()
        with CompileCounter() as counter:
            run_training(replace(make(store_dir, out), max_steps=6, eval_every=3, compile_drafter=compiled))
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "loss" in r]
        runs[compiled] = (counter.count, steps, DFlashDrafter.from_pretrained(out / "drafter").state_dict())
    (eager_graphs, eager, eager_weights), (graphs, steps, weights) = runs[False], runs[True]
    assert eager_graphs == 0 and graphs == 2  # the drafter's graph and the loss chunk's
    assert [r["step"] for r in steps] == list(range(1, 7))
    np.testing.assert_allclose([r["loss"] for r in steps], [r["loss"] for r in eager], rtol=1e-4)
    np.testing.assert_allclose([r["grad_norm"] for r in steps], [r["grad_norm"] for r in eager], rtol=1e-3)
    assert weights.keys() == eager_weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value, eager_weights[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.slow
def test_compiled_run_cut_and_resumed_ends_as_the_uninterrupted_one(store_dir, tmp_path):
    """A `--compile-drafter` run cut after its step-2 checkpoint and resumed (compiling again in the new
    process) ends as the uninterrupted compiled run did: the same logged steps and saved drafter."""
    from safetensors.torch import load_file

    cfg = replace(base_config(store_dir, tmp_path / "a"), max_steps=4, checkpoint_every=2, eval_every=2)
    cfg = replace(cfg, compile_drafter=True)
    torch._dynamo.reset()
    run_training(cfg)
    crashed = crashed_copy(Path(cfg.out), tmp_path / "b", last_checkpoint=2, final_step=4, logged_through=2)
    torch._dynamo.reset()
    run_training(replace(cfg, out=str(crashed), resume=True))
    got, want = losses(crashed), losses(Path(cfg.out))
    assert list(got) == list(want) == [1, 2, 3, 4]
    np.testing.assert_allclose(list(got.values()), list(want.values()), rtol=1e-6)
    weights = [load_file(run / "drafter" / "model.safetensors") for run in (crashed, Path(cfg.out))]
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        torch.testing.assert_close(tensor, weights[1][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_compiled_drafter_under_ddp_trains_as_one_eager_process(store_dir, tmp_path, monkeypatch, capfd):
    """`--compile-drafter --workers 2` (gloo; DDP's compiled graph split at its gradient buckets) trains
    the steps one eager process trains with both ranks' packs: the same losses and weights up to float
    reassociation."""
    from safetensors.torch import load_file

    common = dict(max_steps=4, eval_every=4, checkpoint_every=4, eval_samples=8)
    ddp = replace(base_config(store_dir, tmp_path / "ddp"), workers=2, compile_drafter=True, **common)
    single = replace(base_config(store_dir, tmp_path / "single"), packs_per_step=2, **common)
    monkeypatch.setenv("TORCH_LOGS", "graph_code")  # read by each rank's torch at import: what it compiled
    run_training(ddp)
    compiled = capfd.readouterr().err
    run_training(single)
    assert compiled.count("TRACED GRAPH") >= 2  # each rank compiled the drafter's forward
    got, want = losses(Path(ddp.out)), losses(Path(single.out))
    assert list(got) == list(want) == [1, 2, 3, 4]
    np.testing.assert_allclose(list(got.values()), list(want.values()), rtol=1e-4)
    weights = [load_file(Path(c.out) / "drafter" / "model.safetensors") for c in (ddp, single)]
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        torch.testing.assert_close(tensor, weights[1][name], rtol=1e-3, atol=1e-5, msg=name)

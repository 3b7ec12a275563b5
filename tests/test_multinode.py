"""Two torchrun agents on localhost stand in for two nodes (`--nnodes 2 --nproc-per-node 1`, static
rendezvous): results equal the spawned runs, a killed node is resumed, a frozen node is named within
--collective-timeout, and a folder that is not shared is refused at start."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_extract_resume import SMALL_BATCHES, children_of, committed_batches, rank_progress

from dflash_pipeline.data import sample_corpus_path
from dflash_pipeline.shared.runtime.launch import free_port
from dflash_pipeline.shared.store.manifest import load_manifest
from dflash_pipeline.shared.store.reader import stores_equal

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TRAIN_ARGS = [
    "--device",
    "cpu",
    "--num-layers",
    "1",
    "--block-size",
    "8",
    "--pack-tokens",
    "128",
    "--num-blocks",
    "16",
    "--eval-samples",
    "2",
    "--loader-workers",
    "0",
    "--max-steps",
    "4",
    "--checkpoint-every",
    "2",
    "--eval-every",
    "4",
]


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_node_left_behind():
    """A failed test must not leave agents or workers running (or frozen)."""
    yield
    while STARTED:
        node = STARTED.pop()
        if node.poll() is None:
            signal_node(node, signal.SIGKILL)
            node.wait()


def start_nodes(
    module: str, logs: Path, args: list[str], cwds: tuple[Path, Path] | None = None
) -> list[subprocess.Popen]:
    """One torchrun agent per "node" (`signal_node` kills or freezes one whole);
    output goes to files under `logs` (a full pipe would block the node)."""
    port = free_port()
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = []
    for node in (0, 1):
        with open(logs / f"node{node}.log", "w") as log:
            nodes.append(
                subprocess.Popen(
                    [
                        TORCHRUN,
                        "--nnodes",
                        "2",
                        "--nproc-per-node",
                        "1",
                        "--node-rank",
                        str(node),
                        "--master-addr",
                        "127.0.0.1",
                        "--master-port",
                        str(port),
                        "-m",
                        module,
                        *args,
                    ],
                    cwd=cwds[node] if cwds else None,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    start_new_session=True,
                )
            )
        nodes[-1].log = logs / f"node{node}.log"
    STARTED.extend(nodes)
    return nodes


def finish(nodes: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    """Each node's exit code and output."""
    return [(p.wait(timeout=timeout), p.log.read_text()) for p in nodes]


def signal_node(node: subprocess.Popen, sig: int) -> None:
    """Signal a node's agent and every process under it (torchrun starts its workers in sessions of their own)."""
    pids, todo = [], [node.pid]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children_of(pid))
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def extract_args(target: Path, data: Path, out: Path | str, *extra: str) -> list[str]:
    return ["--target", str(target), "--data", str(data), "--out", str(out), *SMALL_BATCHES, *extra]


def wait_for_batches(nodes: list[subprocess.Popen], out: Path, n: int) -> None:
    deadline = time.time() + 120
    while committed_batches(out) < n:
        assert all(p.poll() is None for p in nodes), "finished before it could be interrupted"
        assert time.time() < deadline, "no progress"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def spawned_store(tiny_target_dir, small_corpus, tmp_path_factory) -> Path:
    """The store of the same extraction with two spawned CPU workers."""
    out = tmp_path_factory.mktemp("spawned") / "store"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_pipeline.extract.cli",
            *extract_args(tiny_target_dir, small_corpus, out),
            "--device",
            "cpu",
            "--workers",
            "2",
        ],
        check=True,
        capture_output=True,
    )
    return out


@pytest.mark.slow
def test_two_nodes_extract_and_train_like_spawned_runs(tiny_target_dir, small_corpus, spawned_store, tmp_path):
    store = tmp_path / "store"
    results = finish(
        start_nodes(
            "dflash_pipeline.extract.cli", tmp_path / "logs-extract", extract_args(tiny_target_dir, small_corpus, store)
        )
    )
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    assert stores_equal(store, spawned_store)

    spawned = tmp_path / "spawned-run"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_pipeline.train.cli",
            "--store",
            str(store),
            "--out",
            str(spawned),
            *TRAIN_ARGS,
            "--workers",
            "2",
        ],
        check=True,
        capture_output=True,
    )
    run = tmp_path / "run"
    results = finish(
        start_nodes(
            "dflash_pipeline.train.cli",
            tmp_path / "logs-train",
            ["--store", str(store), "--out", str(run), *TRAIN_ARGS],
        )
    )
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    assert (run / "drafter" / "model.safetensors").read_bytes() == (
        spawned / "drafter" / "model.safetensors"
    ).read_bytes()
    losses = [
        [json.loads(line).get("loss") for line in (r / "metrics.jsonl").read_text().splitlines()]
        for r in (run, spawned)
    ]
    assert losses[0] == losses[1] and len(losses[0]) >= 4


@pytest.mark.slow
def test_killed_node_then_rerun_is_identical(tiny_target_dir, small_corpus, spawned_store, tmp_path):
    store = tmp_path / "store"
    args = extract_args(tiny_target_dir, small_corpus, store, "--collective-timeout", "5")
    nodes = start_nodes("dflash_pipeline.extract.cli", tmp_path / "logs-killed", args)
    wait_for_batches(nodes, store, 4)
    signal_node(nodes[1], signal.SIGKILL)
    (rc, err), _ = finish(nodes)  # rank 0 notices within --collective-timeout
    assert rc != 0 and "rank 1 did not answer for 5 s" in err, err[-3000:]  # rank 0's own words on a failure
    assert not load_manifest(store).complete
    results = finish(start_nodes("dflash_pipeline.extract.cli", tmp_path / "logs-rerun", args))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    assert stores_equal(store, spawned_store)


@pytest.mark.slow
def test_killed_training_node_is_named_and_the_run_resumes(spawned_store, tmp_path):
    """Node 1 dies in the middle of training (kill -9): rank 0's all-reduce breaks at once, and its line
    names the rank gone instead of gloo's traceback; --resume on both nodes finishes the run."""
    run = tmp_path / "run"
    args = ["--store", str(spawned_store), "--out", str(run), *TRAIN_ARGS, "--collective-timeout", "5"]
    args += ["--epochs", "30"]  # 200 steps: seconds of training left when the first checkpoint is written
    args[args.index("--max-steps") + 1] = "200"
    args[args.index("--checkpoint-every") + 1] = "5"
    args[args.index("--eval-every") + 1] = "1000"
    nodes = start_nodes("dflash_pipeline.train.cli", tmp_path / "logs-killed", args)
    deadline = time.time() + 120
    while not (run / "checkpoints" / "latest").exists():
        assert all(p.poll() is None for p in nodes) and time.time() < deadline
        time.sleep(0.05)
    signal_node(nodes[1], signal.SIGKILL)
    (rc, err), _ = finish(nodes)
    assert rc == 1 and "dflash-train: error: rank 0: rank 1 did not answer for 5 s" in err, err[-3000:]
    assert "Connection closed by peer" not in err, err[-3000:]  # gloo's traceback (torchrun adds its own)
    results = finish(start_nodes("dflash_pipeline.train.cli", tmp_path / "logs-resumed", [*args, "--resume"]))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    assert (run / "drafter" / "model.safetensors").exists()


@pytest.mark.slow
def test_ctrl_c_on_one_node_stops_both_after_one_step_and_each_says_why(spawned_store, tmp_path):
    """torchrun passes its Ctrl-C on to its rank; the stop rides the step's all-reduce, so node 1, which
    got no signal, stops after the same step and names the Ctrl-C too; --resume on both finishes."""
    run = tmp_path / "run"
    args = ["--store", str(spawned_store), "--out", str(run), *TRAIN_ARGS, "--epochs", "30"]
    args[args.index("--max-steps") + 1] = "200"
    args[args.index("--checkpoint-every") + 1] = "500"
    args[args.index("--eval-every") + 1] = "1000"
    nodes = start_nodes("dflash_pipeline.train.cli", tmp_path / "logs-stopped", args)
    deadline = time.time() + 120
    while not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
        assert all(p.poll() is None for p in nodes) and time.time() < deadline
        time.sleep(0.05)
    nodes[0].send_signal(signal.SIGINT)  # the agent alone, as a terminal's Ctrl-C reaches it
    results = finish(nodes)
    steps = {re.search(r"dflash-train: error: stopped by Ctrl-C after step (\d+) of 200;", err) for _, err in results}
    assert [rc for rc, _ in results] == [1, 1] and None not in steps, results[0][1][-2000:] + results[1][1][-2000:]
    (step,) = {int(line.group(1)) for line in steps}
    assert (run / "checkpoints" / "latest").read_text() == f"step-{step:08d}"
    results = finish(start_nodes("dflash_pipeline.train.cli", tmp_path / "logs-resumed", [*args, "--resume"]))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")])
def test_a_stopped_extraction_node_says_so_and_the_other_names_why(
    tiny_target_dir, small_corpus, spawned_store, tmp_path, sig, name
):
    """torchrun passes the signal on to its rank, which unwinds and says it was stopped (not killed
    silently, as SIGTERM's default would); the other node names it, or the store its node kept going
    with it; the rerun completes the same store."""
    store = tmp_path / "store"
    args = extract_args(tiny_target_dir, small_corpus, store)
    nodes = start_nodes("dflash_pipeline.extract.cli", tmp_path / "logs-stopped", args)
    wait_for_batches(nodes, store, 2)
    nodes[0].send_signal(sig)  # the agent alone, as a terminal's Ctrl-C or a scheduler's SIGTERM reaches it
    (rc0, err0), (rc1, err1) = finish(nodes)
    hint = "rerun the same command to resume from the last committed batch"
    assert rc0 != 0 and f"dflash-extract: stopped by {name}; {hint}" in err0, err0[-3000:]
    assert rc1 != 0, err1[-3000:]
    assert f"rank 0 was stopped by {name}; {hint}" in err1 or "the c10d store" in err1, err1[-3000:]
    results = finish(start_nodes("dflash_pipeline.extract.cli", tmp_path / "logs-rerun", args))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    assert stores_equal(store, spawned_store)


@pytest.mark.slow
def test_a_failed_node_stops_the_others_at_once_not_after_their_share(tiny_target_dir, tmp_path):
    """Node 1 cannot read --target (a relative path that exists on node 0 only: paths must be the same
    on every node). Node 0, with minutes of its share left on a large run, stops within a few heartbeats
    and names the failed rank, instead of finding out at the end of its share. Each node's torchrun
    summary shows that node's line."""
    import shutil

    cwds = (tmp_path / "node0", tmp_path / "node1")
    for cwd in cwds:
        cwd.mkdir()
    shutil.copytree(tiny_target_dir, cwds[0] / "target")
    data = tmp_path / "large.jsonl"
    data.write_text(sample_corpus_path().read_text() * 20)
    store = tmp_path / "store"
    args = [*extract_args(Path("target"), data, store, "--collective-timeout", "5"), "--tokenize-processes", "1"]
    nodes = start_nodes("dflash_pipeline.extract.cli", tmp_path / "logs", args, cwds)
    (rc0, err0), (rc1, err1) = finish(nodes)
    assert rc1 == 1 and "dflash-extract: error: target: no such folder" in err1, err1[-3000:]
    assert rc0 == 1, err0[-3000:]
    assert "dflash-extract: error: rank 1 stopped with an error (see its output); rerun the same command" in err0
    assert not rank_progress(store).get(0, {}).get("done"), "node 0 did all of its share first"
    # torchrun's failure summary shows each node's own line, not "error_file: <N/A>"
    assert "traceback : dflash-extract: error: target: no such folder" in err1, err1[-3000:]
    assert "traceback : dflash-extract: error: rank 1 stopped with an error" in err0, err0[-3000:]


@pytest.mark.slow
def test_frozen_node_is_named_within_the_timeout(tiny_target_dir, tmp_path):
    store = tmp_path / "store"  # the whole sample small_corpus: node 1 is frozen long before its share is done
    nodes = start_nodes(
        "dflash_pipeline.extract.cli",
        tmp_path / "logs",
        extract_args(tiny_target_dir, sample_corpus_path(), store, "--collective-timeout", "4"),
    )
    deadline = time.time() + 120
    while not (store / "manifest.json").exists():  # rank 0 has prepared the store; rank 1 is about to start
        assert nodes[0].poll() is None and time.time() < deadline
        time.sleep(0.01)
    signal_node(nodes[1], signal.SIGSTOP)
    frozen = time.monotonic()
    rc = nodes[0].wait(timeout=60)
    waited = time.monotonic() - frozen
    err = nodes[0].log.read_text()
    assert rc != 0
    assert "dflash-extract: error: rank 0: rank 1 did not answer for 4 s" in err, err[-3000:]
    assert "rerun the same command" in err
    assert waited < 4 + 20


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["extract", "train"])
def test_an_output_folder_in_use_is_refused_on_every_node(
    stage, tiny_target_dir, small_corpus, spawned_store, lock_holder, tmp_path
):
    """Rank 0 alone takes the run lock (no launcher of ours holds it under torchrun); every node
    stops with its refusal, and nothing is written into the folder in use."""
    out = tmp_path / "out"
    holder = lock_holder(out)
    args = (
        extract_args(tiny_target_dir, small_corpus, out)
        if stage == "extract"
        else ["--store", str(spawned_store), "--out", str(out), *TRAIN_ARGS]
    )
    results = finish(start_nodes(f"dflash_pipeline.{stage}.cli", tmp_path / "logs", args), timeout=120)
    assert [rc for rc, _ in results] == [1, 1], results[0][1][-2000:] + results[1][1][-2000:]
    refusal = f"dflash-{stage}: error: {out}: another run is using this folder (pid {holder.pid} on "
    assert refusal in results[0][1], results[0][1][-3000:]
    assert refusal in results[1][1], results[1][1][-3000:]
    assert [p.name for p in out.iterdir()] == [".lock"] and holder.poll() is None


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["extract", "train"])
def test_output_folder_not_shared_is_refused_at_start(stage, tiny_target_dir, small_corpus, spawned_store, tmp_path):
    """Each "node" runs in its own working folder and gets a relative --out: two private folders."""
    cwds = (tmp_path / "node0", tmp_path / "node1")
    for cwd in cwds:
        cwd.mkdir()
    if stage == "extract":
        nodes = start_nodes(
            "dflash_pipeline.extract.cli", tmp_path / "logs", extract_args(tiny_target_dir, small_corpus, "out"), cwds
        )
    else:
        nodes = start_nodes(
            "dflash_pipeline.train.cli",
            tmp_path / "logs",
            ["--store", str(spawned_store), "--out", "out", *TRAIN_ARGS],
            cwds,
        )
    results = finish(nodes, timeout=120)
    assert [rc for rc, _ in results] == [1, 1]
    for _, err in results:
        assert (
            f"dflash-{stage}: error: --out out: rank 1 cannot see the files rank 0 writes there; "
            "--out must be one folder shared by every node" in err
        ), err[-3000:]
    assert list((cwds[0] / "out").iterdir()) == [] and not (cwds[1] / "out").exists()


@pytest.mark.parametrize("stage,option", [("extract", ["--workers", "2"]), ("train", ["--gpus", "0"])])
def test_torchrun_refuses_process_options(stage, option, monkeypatch, tmp_path):
    """torchrun starts the processes; --gpus/--workers would be silently ignored, so they are refused."""
    from dflash_pipeline.extract.cli import main as extract_main
    from dflash_pipeline.train.cli import main as train_main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = ["--target", "t", "--data", "d"] if stage == "extract" else ["--store", str(tmp_path / "s")]
    result = CliRunner().invoke(
        extract_main if stage == "extract" else train_main,
        [*args, "--out", str(tmp_path / "out"), "--device", "cpu", *option],
    )
    assert result.exit_code == 1, result.output
    assert f"{option[0]} cannot be used under torchrun: torchrun owns the processes" in result.output
    assert not (tmp_path / "out").exists()


def test_torchrun_extraction_follows_the_device_rule(tiny_target_dir, small_corpus, monkeypatch, tmp_path):
    """--device auto (the config's default) is the CPU without CUDA under torchrun too."""
    import torch

    from dflash_pipeline.extract.config import ExtractConfig
    from dflash_pipeline.extract.run import run_extraction

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    summary = run_extraction(
        ExtractConfig(
            target=str(tiny_target_dir), data=(str(small_corpus),), out=str(tmp_path / "store"), max_length=64, limit=4
        )
    )
    assert summary.samples == 4 and load_manifest(tmp_path / "store").complete


def meet_after(rank: int, world: int, port: int, fail_rank: int) -> str:
    """Spawned rank body: `fail_rank` stops with an error before the meeting; the others meet."""
    from datetime import timedelta

    import torch.distributed as dist

    from dflash_pipeline.shared.runtime.cluster import Cluster, ClusterError
    from dflash_pipeline.shared.runtime.errors import UserError

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        with Cluster("test", 30, "hint") as cluster:
            if rank == fail_rank:
                raise UserError("bad input")
            cluster.meet("work-done")
    except ClusterError as exc:
        return str(exc)
    except UserError:
        return "failed"
    finally:
        dist.destroy_process_group()
    return "met"


@pytest.mark.slow
def test_a_rank_that_stopped_with_an_error_ends_the_meeting_at_once():
    """The others learn of it from the store instead of waiting for --collective-timeout. The store is
    kept here, as torchrun's agent keeps it, so that it outlives every rank."""
    from datetime import timedelta

    import torch.distributed as dist

    from dflash_pipeline.shared.runtime.launch import spawn_ranks

    for world, fail_rank, want in [
        (3, 2, ["rank 2 stopped with an error (see its output); hint"] * 2 + ["failed"]),
        (2, -1, ["met", "met"]),
    ]:
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        started = time.monotonic()
        assert spawn_ranks(meet_after, world, (world, store.port, fail_rank)) == want
        assert time.monotonic() - started < 25


def break_a_collective(rank: int, world: int, port: int, log: str, how: str, timeout_s: float) -> None:
    """Both ranks meet; then rank 1 is killed (as when a node dies while waiting for a slower one) and
    rank 0's next collective breaks at once, or rank 0 fails by itself while rank 1 lives on."""
    from datetime import timedelta

    import torch.distributed as dist

    from dflash_pipeline.shared.runtime.cluster import Cluster

    sys.stderr = open(log, "w", buffering=1)  # noqa: SIM115 - the process ends with it open
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    with Cluster("test", timeout_s, "hint") as cluster:
        cluster.meet("work-done")
        if rank == 1:
            if how == "vanish":
                os.kill(os.getpid(), signal.SIGKILL)
            cluster.meet("never")  # learns there that rank 0 failed
        time.sleep(1)
        if how == "own error":
            raise RuntimeError("rank 0's own error")
        dist.all_gather_object([None] * world, rank)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["vanish", "own error"])
def test_a_broken_collective_names_a_vanished_peer_without_holding_up_an_own_error(how, tmp_path):
    """The broken collective's traceback would not say which rank went: the watcher's line does. An
    error of the rank's own is not held up for the timeout while the other rank still beats."""
    import multiprocessing
    from datetime import timedelta

    import torch.distributed as dist

    timeout_s = 2 if how == "vanish" else 60
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    spawn = multiprocessing.get_context("spawn")
    logs = [tmp_path / f"{rank}.log" for rank in (0, 1)]
    ranks = [
        spawn.Process(target=break_a_collective, args=(rank, 2, store.port, str(logs[rank]), how, timeout_s))
        for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    started = time.monotonic()
    for process in ranks:
        process.join(timeout=90)
    log = logs[0].read_text()
    if how == "vanish":
        assert [p.exitcode for p in ranks] == [1, -signal.SIGKILL], log
        assert (
            log
            == "test: error: rank 0: rank 1 did not answer for 2 s (node frozen, killed or cut off from this one); hint\n"
        )
    else:
        assert [p.exitcode for p in ranks] == [1, 1], log
        assert log.endswith("RuntimeError: rank 0's own error\n"), log
        assert "rank 0 stopped with an error (see its output); hint" in logs[1].read_text()
        assert time.monotonic() - started < timeout_s / 2

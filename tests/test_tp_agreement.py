"""Vocab-parallel calls on gloo worlds of 2 and 3 ranks (one process per rank, CPU, chunked engine).

Every argument that must match across the TP ranks is changed on one rank in turn; every rank must raise
the same ValueError naming it, within the collective timeout (a hang fails the test), and ranks that
agree must get TP=1's bits for logp, entropy and their gradients at any vocabulary split. Both agreement
modes run: `every_call`, and `first_call` after a call that agreed on the layout (on a CPU group it reads
the same table, so the same errors). On a GPU, `first_call` runs a TP step with no host sync and captured
in a CUDA graph (an NCCL group of one rank: one GPU), and a disagreement found on the device turns the
outputs into NaN and raises at the next call.
"""

import json
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
from helpers import mismatches, model_like_logits, random_cuts, random_labels

import rl_logp

VOCAB, ROWS = 1031, 12
CASES = {
    "temperature": lambda r: {"temperature": 0.7 if r == 0 else 1.0},
    "temperature values": lambda r: {"temperature": torch.full((ROWS,), 0.7 + 0.1 * (r == 1))},
    "labels": lambda r: {"labels_shift": int(r == 1)},
    "fixed_point_bits": lambda r: {"fixed_point_bits": 40 + (r == 1)},
    "backend": lambda r: {"backend": "torch" if r == 1 else "chunked"},
    "dtype": lambda r: {"dtype": torch.float32 if r == 1 else torch.bfloat16},
    "rows": lambda r: {"rows": ROWS + (r == 1)},
    "validation": lambda r: {"float_labels": r == 1},
}
EXPECTED = {
    "temperature": "temperature differs in kind",
    "temperature values": "temperature values differ",
    "labels": "labels differ",
    "fixed_point_bits": "fixed_point_bits differs",
    "backend": "backend differs",
    "dtype": "dtype differs",
    "rows": "different numbers of rows",
    "validation": "labels have dtype torch.float32",
}


def _rank_main(rank: int, world: int, mode: str, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import datetime

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    cuts = random_cuts(VOCAB, world, seed=world)
    results = {}
    for case, make in CASES.items():
        if mode == "first_call":  # the base layout agreed first, so a rank that keeps it takes the cached path
            base = model_like_logits(ROWS, VOCAB, torch.bfloat16, "cpu", seed=1)[:, cuts[rank] : cuts[rank + 1]]
            with torch.no_grad():
                rl_logp.logprobs(base, random_labels(ROWS, VOCAB, "cpu", seed=1), backend="chunked",
                                 tp_group=dist.group.WORLD, config={"tp_agreement": mode})
        opts = make(rank)
        rows = opts.pop("rows", ROWS)
        x = model_like_logits(rows, VOCAB, opts.pop("dtype", torch.bfloat16), "cpu", seed=1)
        y = random_labels(rows, VOCAB, "cpu", seed=1)
        y[0] += opts.pop("labels_shift", 0)
        if opts.pop("float_labels", False):
            y = y.float()
        shard = x[:, cuts[rank] : cuts[rank + 1]]
        start = time.time()
        try:
            with torch.no_grad():
                rl_logp.logprobs(shard, y, backend=opts.pop("backend", "chunked"), tp_group=dist.group.WORLD,
                                 config={"tp_agreement": mode}, **opts)
            results[case] = {"error": None}
        except Exception as err:  # recorded for the parent to assert on
            results[case] = {"error": type(err).__name__, "message": str(err)}
        results[case]["seconds"] = time.time() - start
    # Ranks that agree: logp and entropy (and their gradients) equal TP=1's bits.
    x = model_like_logits(ROWS, VOCAB, torch.bfloat16, "cpu", seed=2)
    y = random_labels(ROWS, VOCAB, "cpu", seed=2)
    y[1] = -100
    leaf = x[:, cuts[rank] : cuts[rank + 1]].clone().requires_grad_(True)
    logp, h = rl_logp.logprobs_and_entropy(leaf * 1.0, y, backend="chunked", tp_group=dist.group.WORLD,
                                           temperature=0.7, config={"tp_agreement": mode})
    (logp.sum() + h.sum()).backward()
    torch.save({"logp": logp.detach(), "entropy": h.detach(), "grad": leaf.grad, "cuts": cuts},
               os.path.join(out_dir, f"tensors.{rank}"))
    with open(os.path.join(out_dir, f"errors.{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[(2, "every_call"), (3, "every_call"), (2, "first_call"), (3, "first_call")],
                ids=["world2", "world3", "world2-first_call", "world3-first_call"])
def world_results(request, tmp_path_factory):
    world, mode = request.param
    out = tmp_path_factory.mktemp(f"tp{world}")
    torch.multiprocessing.spawn(_rank_main, args=(world, mode, _free_port(), str(out)), nprocs=world, join=True)
    errors = [json.loads((out / f"errors.{r}.json").read_text()) for r in range(world)]
    tensors = [torch.load(out / f"tensors.{r}") for r in range(world)]
    return world, errors, tensors


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_raises_the_same_error_naming_the_argument(world_results, case):
    world, errors, _ = world_results
    seen = [errors[r][case] for r in range(world)]
    assert all(s["error"] == "ValueError" for s in seen), seen
    assert all(EXPECTED[case] in s["message"] for s in seen), seen
    assert len({s["message"] for s in seen}) == 1, seen  # the same message on every rank
    assert all(s["seconds"] < 30 for s in seen), seen  # no rank waited for a collective timeout


def test_agreeing_ranks_get_tp1_bits_for_logp_entropy_and_gradients(world_results):
    world, _, tensors = world_results
    x = model_like_logits(ROWS, VOCAB, torch.bfloat16, "cpu", seed=2).requires_grad_(True)
    y = random_labels(ROWS, VOCAB, "cpu", seed=2)
    y[1] = -100
    logp, h = rl_logp.logprobs_and_entropy(x * 1.0, y, backend="chunked", temperature=0.7)
    (logp.sum() + h.sum()).backward()
    for r in range(world):
        assert mismatches(tensors[r]["logp"], logp.detach()) == 0
        assert mismatches(tensors[r]["entropy"], h.detach()) == 0
    grad = torch.cat([tensors[r]["grad"] for r in range(world)], dim=1)
    assert mismatches(grad, x.grad) == 0


def test_torch_backend_with_tp_group_needs_no_grad(tmp_path):
    """The Megatron-style float-sum baseline is forward-only: asking for its gradient is refused."""
    port = _free_port()
    torch.multiprocessing.spawn(_torch_backend_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    messages = [(tmp_path / f"m.{r}").read_text() for r in range(2)]
    assert all("forward-only diagnostic" in m for m in messages), messages


def test_first_call_layouts_do_not_keep_a_destroyed_group_alive(tmp_path):
    """"first_call" mode keeps each group's agreed layouts, the group held weakly: after its owner destroys
    it the group is collected (held, it lived on with its gloo threads until the interpreter's teardown,
    where a rank could abort: SIGABRT, 'terminate called without an active exception')."""
    torch.multiprocessing.spawn(_layouts_rank, args=(str(tmp_path),), nprocs=1, join=True)
    assert json.loads((tmp_path / "layouts.json").read_text()) == {"agreed_groups": 1, "alive_after_destroy": False,
                                                                   "agreed_groups_after": 0}


def _layouts_rank(rank: int, out_dir: str) -> None:
    import gc
    import weakref

    from rl_logp import shard_layout

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    x, y = model_like_logits(4, 100, torch.float32, "cpu"), random_labels(4, 100, "cpu")
    for _ in range(2):  # the second call takes the agreed layout
        rl_logp.logprobs(x, y, backend="chunked", tp_group=group, config={"tp_agreement": "first_call"})
    agreed, alive = len(shard_layout._agreed), weakref.ref(group)
    del group
    dist.destroy_process_group()
    gc.collect()
    with open(os.path.join(out_dir, "layouts.json"), "w") as f:
        json.dump({"agreed_groups": agreed, "alive_after_destroy": alive() is not None,
                   "agreed_groups_after": len(shard_layout._agreed)}, f)


def _torch_backend_rank(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = model_like_logits(4, 100, torch.float32, "cpu")[:, rank * 50 : (rank + 1) * 50].requires_grad_(True)
    try:
        rl_logp.logprobs(x, torch.zeros(4, dtype=torch.long), backend="torch", tp_group=dist.group.WORLD)
        message = "no error"
    except ValueError as err:
        message = str(err)
    with open(os.path.join(out_dir, f"m.{rank}"), "w") as f:
        f.write(message)
    dist.destroy_process_group()


def _nccl_rank(rank: int, port: int, out_dir: str) -> None:
    """One rank on one GPU: a TP step in "first_call" mode without host syncs, captured in a CUDA graph, and
    a disagreement found on the device (a peer's row of the table, faked: one rank cannot disagree)."""
    from rl_logp import shard_layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    group, cfg = dist.group.WORLD, {"tp_agreement": "first_call"}
    x = model_like_logits(64, 151936, torch.bfloat16, "cuda", seed=4)
    y = random_labels(64, 151936, "cuda", seed=4)
    report = {}
    with torch.no_grad():
        eager = rl_logp.logprobs(x, y, tp_group=group, config=cfg, temperature=0.7)  # agreed on the host
        report["tp1_bits"] = mismatches(eager, rl_logp.logprobs(x, y, temperature=0.7))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            rl_logp.logprobs(x, y, tp_group=group, config=cfg, temperature=0.7)
            report["sync_free"] = True
        except RuntimeError as err:
            report["sync_free"] = str(err)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                rl_logp.logprobs(x, y, tp_group=group, config=cfg, temperature=0.7)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = rl_logp.logprobs(x, y, tp_group=group, config=cfg, temperature=0.7)
            x.copy_(model_like_logits(64, 151936, torch.bfloat16, "cuda", seed=5))
            graph.replay()
            torch.cuda.synchronize()
            report["graph_replay_mismatches"] = mismatches(captured, rl_logp.logprobs(x, y, temperature=0.7))
        except Exception as err:
            report["graph_replay_mismatches"] = f"{type(err).__name__}: {err}"
        real_gather = shard_layout._gather

        def peer_disagrees(group, meta):
            table = real_gather(group, meta)
            other = table.clone()
            other[0, len(shard_layout.FIELDS) - 3] += 1  # the peer's labels checksum
            return torch.cat([table, other])

        shard_layout._gather = peer_disagrees  # the same layout as agreed above: the cached, on-device path
        poisoned = rl_logp.logprobs(x, y, tp_group=group, config=cfg, temperature=0.7)
        shard_layout._gather = real_gather
        report["poisoned_all_nan"] = bool(torch.isnan(poisoned).all())
        torch.cuda.synchronize()
        try:
            rl_logp.logprobs(x, y, tp_group=group, config=cfg, temperature=0.7)
            report["later_call"] = "no error"
        except ValueError as err:
            report["later_call"] = str(err)
    with open(os.path.join(out_dir, "nccl.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_first_call_mode_is_sync_free_capturable_and_fails_closed_on_the_device(tmp_path):
    torch.multiprocessing.spawn(_nccl_rank, args=(_free_port(), str(tmp_path)), nprocs=1, join=True)
    report = json.loads((tmp_path / "nccl.json").read_text())
    assert report["tp1_bits"] == 0, report
    assert report["sync_free"] is True, report
    assert report["graph_replay_mismatches"] == 0, report
    assert report["poisoned_all_nan"] is True, report
    assert "disagreed on an earlier vocab-parallel call" in report["later_call"], report

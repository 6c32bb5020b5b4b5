"""Scores every case through the training provider at TP=1 and at the world's TP degree, and through
the rollout provider; runs identically under torchrun and in the processes `__main__` spawns."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from rl_logp import INVARIANT_BACKENDS, logprobs
from rl_logp.check.cases import Case, build_cases, frozen_batch, load_batch
from rl_logp.check.report import Comparison, compare, render, write_json


def vocab_cuts(vocab: int, world: int, seed: int) -> list[int]:
    """Uneven, seeded cut points of the vocabulary for `world` ranks (each rank at least one column)."""
    if world == 1:
        return [0, vocab]
    gen = torch.Generator().manual_seed(seed + 17)
    inner = sorted(int(c) for c in (torch.randperm(vocab - 1, generator=gen)[: world - 1] + 1))
    return [0, *inner, vocab]


def rollout_provider():
    """The vLLM sampler when the adapter can run it, else the training function on full-vocab logits."""
    try:
        from rl_logp.integrations.vllm import VllmRolloutProvider

        return VllmRolloutProvider()
    except ImportError as err:
        return _SameFunctionRollout(str(err))


class _SameFunctionRollout:
    def __init__(self, why: str) -> None:
        self.description = f"rl_logp.logprobs on full-vocab logits (vLLM sampler not available: {why})"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, temperature: float | None) -> torch.Tensor:
        return logprobs(logits, labels, backend="auto", temperature=temperature)


def _score_tp(case: Case, backend: str, group, cuts: list[int], rank: int, device) -> torch.Tensor:
    shard = case.logits[:, cuts[rank] : cuts[rank + 1]].to(device)
    return logprobs(shard, case.labels.to(device), backend=backend, tp_group=group, **case.options).cpu()


def run(args, rank: int, world: int, device: torch.device) -> list[Comparison] | None:
    """Every rank calls this; rank 0 returns the comparisons, the others None."""
    group = dist.group.WORLD if world > 1 else None
    if args.logits:
        base_logits, base_labels = load_batch(args.logits)
    else:
        base_logits, base_labels = frozen_batch(args.rows, args.vocab, getattr(torch, args.dtype), args.seed)
    vocab = base_logits.shape[1]
    cuts = vocab_cuts(vocab, world, args.seed)
    cases = build_cases(base_logits, base_labels, args.seed)
    rollout = rollout_provider() if rank == 0 else None
    reference_backend = next(b for b in args.backends if b in INVARIANT_BACKENDS)
    results: list[Comparison] = []
    for case in cases:
        full_labels = base_labels.clone()
        full_labels[case.source_rows] = case.labels
        options = dict(case.options)
        if rank == 0:
            ref_in = base_logits.to(case.logits.dtype).to(device)
            reference = logprobs(ref_in, full_labels.to(device), backend=reference_backend, **options).cpu()
            reference = reference[case.source_rows]
        for backend in args.backends:
            tp_out = None
            if world > 1 and backend in ("fused", "chunked", "auto", "torch"):
                tp_out = _score_tp(case, backend, group, cuts, rank, device)
            if rank != 0:
                continue
            invariant = backend in INVARIANT_BACKENDS
            try:
                tp1 = logprobs(case.logits.to(device), case.labels.to(device), backend=backend, **options).cpu()
                results.append(compare(case.name, f"train TP=1 [{backend}]", tp1, reference, invariant))
            except (ImportError, ValueError) as err:
                results.append(Comparison.skipped(case.name, f"train TP=1 [{backend}]", str(err)))
            if tp_out is not None:
                results.append(compare(case.name, f"train TP={world} [{backend}]", tp_out, reference, invariant))
        if rank == 0 and "temperature" in options and case.logits.dtype != torch.float32:
            # What unpatched verl 0.9.1 does (FSDP engine's _scale_logits_by_temperature): divide the
            # low-precision logits by the temperature cast to their dtype, then score them.
            x = case.logits.to(device)
            divided = x / torch.tensor(options["temperature"], device=device).clamp(min=1e-8).to(x.dtype)
            verl_way = logprobs(divided, case.labels.to(device), backend=reference_backend).cpu()
            results.append(compare(case.name, "unpatched verl: bf16 x / bf16(T)", verl_way, reference, False))
        if rank == 0:
            out = rollout(case.logits.to(device), case.labels.to(device), options.get("temperature")).cpu()
            results.append(compare(case.name, "rollout", out, reference, True))
    if rank == 0:
        args.rollout_description = rollout.description
        args.cuts = cuts
    return results if rank == 0 else None


def init_world(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int, torch.device]:
    """Join the process group torchrun (or `__main__`'s spawner) describes.

    Tensors live on GPU `LOCAL_RANK % device_count` when CUDA is there (several ranks may share one GPU),
    else on the CPU; the group is NCCL on GPUs unless `backend` says otherwise (gloo stages through the CPU).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cpu")
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if world > 1 and not dist.is_initialized():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group(
            backend=backend or ("nccl" if device.type == "cuda" else "gloo"),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return rank, world, device


def spawned_rank(rank: int, world: int, args, port: int) -> None:
    """Entry of a rank spawned by `python -m rl_logp.check` (gloo on this machine)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if run_rank(args):
        raise SystemExit(1)


def run_rank(args) -> int:
    """One rank of the check: join the world, score, and on rank 0 print and write the report."""
    rank, world, device = init_world(args.dist_backend or ("gloo" if "RL_LOGP_CHECK_SPAWNED" in os.environ else None),
                                     args.timeout)
    results = run(args, rank, world, device)
    status = 0
    if rank == 0:
        header = [
            f"rl_logp.check: {'file ' + args.logits if args.logits else f'seeded batch {args.rows} x {args.vocab} {args.dtype}'}"
            f", TP world {world} (vocab cuts {args.cuts}), device {device}",
            f"reference: train TP=1 [{next(b for b in args.backends if b in ('auto', 'fused', 'chunked'))}]",
            f"rollout provider: {args.rollout_description}",
        ]
        print(render(results, header), flush=True)
        meta = {"world": world, "cuts": args.cuts, "device": str(device), "rollout": args.rollout_description,
                "args": {k: v for k, v in vars(args).items() if k not in ("cuts", "rollout_description")}}
        write_json(args.json, results, meta)
        status = 1 if any(r.failed for r in results) else 0
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return status

"""Scores every case through the training provider at TP=1 and at the world's TP degree, and through
the rollout provider; runs identically under torchrun and in the processes `__main__` spawns.

A provider that raises becomes a row holding its traceback (a failure when the provider is invariant),
and a rank whose whole run raises still ends with a report: the check never loses its JSON.
"""

from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist

from rl_logp import INVARIANT_BACKENDS, logprobs
from rl_logp.check.cases import Case, build_cases, frozen_batch, load_batch
from rl_logp.check.report import Comparison, compare, render, write_json
from rl_logp.check.rollout import rollout_provider
from rl_logp.sampling_mask import apply_top_k_top_p

TP_BACKENDS = ("fused", "chunked", "auto", "torch")


def reference_backend(backends: list[str]) -> str:
    """The backend every comparison is made against: the first invariant one listed, else `auto`."""
    return next((b for b in backends if b in INVARIANT_BACKENDS), "auto")


def unavailable(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot score logits on `device` (not installed, no kernel there), or None if it can."""
    try:
        logprobs(torch.zeros(2, 3, device=device), torch.zeros(2, dtype=torch.long, device=device), backend=backend)
    except (ImportError, ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def vocab_cuts(vocab: int, world: int, seed: int) -> list[int]:
    """Uneven, seeded cut points of the vocabulary for `world` ranks (each rank at least one column)."""
    if world == 1:
        return [0, vocab]
    gen = torch.Generator().manual_seed(seed + 17)
    inner = sorted(int(c) for c in (torch.randperm(vocab - 1, generator=gen)[: world - 1] + 1))
    return [0, *inner, vocab]


def train_input(case: Case, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """What the trainer scores for this case, and the options of its `rl_logp.logprobs` call: the logits
    with the temperature passed in, or under top-k / top-p the contract's masked `fp32(x) / T`."""
    s = case.sampling
    if s.masks:
        return apply_top_k_top_p(logits, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p), dict(case.options)
    return logits, {**case.options, **({"temperature": s.temperature} if s.temperature is not None else {})}


def _attempt(fn, *args, **kwargs) -> tuple[torch.Tensor | None, Exception | None]:
    """(`fn(*args, **kwargs)` on the CPU, None), or (None, the exception) when it raised."""
    try:
        return fn(*args, **kwargs).cpu(), None
    except Exception as err:
        return None, err


def _score_tp(x: torch.Tensor, labels: torch.Tensor, options: dict, backend: str, group, cuts: list[int],
              rank: int) -> torch.Tensor:
    return logprobs(x[:, cuts[rank] : cuts[rank + 1]], labels, backend=backend, tp_group=group, **options)


def run(args, rank: int, world: int, device: torch.device) -> list[Comparison] | None:
    """Every rank calls this; rank 0 returns the comparisons, the others None."""
    group = dist.group.WORLD if world > 1 else None
    if args.logits:
        base_logits, base_labels = load_batch(args.logits)
    else:
        base_logits, base_labels = frozen_batch(args.rows, args.vocab, getattr(torch, args.dtype), args.seed)
    cuts = vocab_cuts(base_logits.shape[1], world, args.seed)
    reference = args.reference
    missing = {b: why for b in args.backends if b != reference and (why := unavailable(b, device))}
    rollout = rollout_provider() if rank == 0 else None
    results: list[Comparison] = []
    rank_errors: list[Comparison] = []
    for case in build_cases(base_logits, base_labels, args.seed):
        labels = case.labels.to(device)
        x, options = train_input(case, case.logits.to(device))
        ref_out = None
        if rank == 0:
            full_labels = base_labels.clone()
            full_labels[case.source_rows] = case.labels
            ref_in, _ = train_input(case, base_logits.to(case.logits.dtype).to(device))
            ref_out, err = _attempt(logprobs, ref_in, full_labels.to(device), backend=reference, **options)
            if err is not None:
                results.append(Comparison.raised(case.name, f"reference train TP=1 [{reference}]", True, err))
            else:
                ref_out = ref_out[case.source_rows]
        for backend in args.backends:
            invariant = backend in INVARIANT_BACKENDS
            if backend in missing:
                if rank == 0:
                    results.append(Comparison.skipped(case.name, f"train TP=1 [{backend}]", missing[backend]))
                continue
            tp_out, tp_err = None, None
            if world > 1 and backend in TP_BACKENDS:
                tp_out, tp_err = _attempt(_score_tp, x, labels, options, backend, group, cuts, rank)
                if tp_err is not None and rank != 0:
                    rank_errors.append(Comparison.raised(case.name, f"train TP={world} [{backend}] rank {rank}",
                                                         invariant, tp_err))
            if rank != 0:
                continue
            out, err = _attempt(logprobs, x, labels, backend=backend, **options)
            results.append(_row(case.name, f"train TP=1 [{backend}]", out, err, ref_out, invariant))
            if world > 1 and backend in TP_BACKENDS:
                results.append(_row(case.name, f"train TP={world} [{backend}]", tp_out, tp_err, ref_out, invariant))
        if rank != 0:
            continue
        temperature = case.sampling.temperature
        if temperature is not None and not case.sampling.masks and case.logits.dtype != torch.float32:
            # What unpatched verl 0.9.1 does (FSDP engine's _scale_logits_by_temperature): divide the
            # low-precision logits by the temperature cast to their dtype, then score them.
            low = case.logits.to(device)
            divided = low / torch.tensor(temperature, device=device).clamp(min=1e-8).to(low.dtype)
            out, err = _attempt(logprobs, divided, labels, backend=reference)
            results.append(_row(case.name, "unpatched verl: bf16 x / bf16(T)", out, err, ref_out, False))
        out, err = _attempt(rollout, case.logits.to(device), labels, case.sampling)
        results.append(_row(case.name, "rollout", out, err, ref_out, True))
    if world > 1:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(rank_errors, gathered, dst=0)
        if rank == 0:
            results += [row for rows in gathered[1:] for row in rows]
    if rank == 0:
        args.rollout_description = rollout.description
        args.cuts = cuts
    return results if rank == 0 else None


def _row(case: str, provider: str, out: torch.Tensor | None, err: Exception | None, reference: torch.Tensor | None,
         invariant: bool) -> Comparison:
    if err is not None:
        return Comparison.raised(case, provider, invariant, err)
    if reference is None:
        return Comparison.skipped(case, provider, "the reference raised")
    return compare(case, provider, out, reference, invariant)


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
    """Entry of a rank spawned by `python -m rl_logp.check` (gloo on this machine). It returns normally
    whatever happens: the verdict and any error are in the report rank 0 writes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    run_rank(args)


def run_rank(args) -> int:
    """One rank of the check: join the world, score, and on rank 0 print and write the report.

    Returns 0 when every invariant comparison is bit-identical, else 1 (on every rank the same status is
    not guaranteed: ranks other than 0 return 1 only when their own run raised).
    """
    rank, world, device = init_world(args.dist_backend or ("gloo" if "RL_LOGP_CHECK_SPAWNED" in os.environ else None),
                                     args.timeout)
    error = ""
    try:
        results = run(args, rank, world, device)
    except Exception:
        results, error = [], traceback.format_exc()
        print(f"rl_logp.check: rank {rank} raised:\n{error}", flush=True)
    status = 1 if error else 0
    if rank == 0:
        source = f"file {args.logits}" if args.logits else f"seeded batch {args.rows} x {args.vocab} {args.dtype}"
        header = [
            f"rl_logp.check: {source}, TP world {world} (vocab cuts {getattr(args, 'cuts', '?')}), device {device}",
            f"reference: train TP=1 [{args.reference}]"
            + ("" if args.reference in args.backends else " (--backends lists no invariant backend)"),
            f"rollout provider: {getattr(args, 'rollout_description', 'not reached')}",
        ]
        print(render(results, header, error), flush=True)
        meta = {"world": world, "cuts": getattr(args, "cuts", None), "device": str(device),
                "rollout": getattr(args, "rollout_description", None), "reference": args.reference,
                "args": {k: v for k, v in vars(args).items() if k not in ("cuts", "rollout_description")}}
        write_json(args.json, results, meta, error)
        status = 1 if error or any(r.failed for r in results) else 0
    if dist.is_initialized():
        if not error:
            dist.barrier()
        dist.destroy_process_group()
    return status

"""verl's Megatron logits path, patched, on gloo with uneven vocabulary splits (2 and 3 ranks): the
vocab-parallel logp and entropy drop-ins and the engine's logits step (`_lm_head_logits_processor`,
temperature handed to rl-logp) give the TP=1 bits, forward and backward. Megatron-LM is not installed in
CI: the drop-ins get the world group as their TP group, and the step runs on a stand-in engine object
(verl 0.9.1's method reads nothing from it)."""

import os
import socket

import pytest
import torch
import verl  # noqa: F401  (plain import: a broken verl install fails here instead of skipping)
from helpers import mismatches

import rl_logp
from rl_logp.integrations import verl_functions
from rl_logp.integrations.verl_megatron import wrap_lm_head_logits_processor
from rl_logp.integrations.verl_step import Auditor

VOCAB = 1000


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 24, VOCAB, generator=gen) * 3).to(torch.bfloat16)
    y = torch.randint(0, VOCAB, (1, 24), generator=gen)
    t = torch.full((1, 24), 0.7)
    t[0, 5:9] = 1.0
    t[0, 20] = 0.0  # verl maps T <= 0 to 1e-8
    return x, y, t


def _not_called(*args, **kwargs):
    raise AssertionError("verl's own method must not run without distillation or sum_pi_squared")


def _rank(rank, world, port, path, cuts):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = rl_logp.resolve_config(backend="chunked")
    group = lambda: dist.group.WORLD  # noqa: E731  (Megatron's TP group in verl; the whole world here)
    logp_fn = verl_functions.make_vocab_parallel_log_probs_from_logits(cfg, group_getter=group)
    entropy_fn = verl_functions.make_vocab_parallel_entropy(cfg, group_getter=group)
    step = wrap_lm_head_logits_processor(_not_called, cfg, Auditor(strict=True), group_getter=group)
    x, y, t = _inputs()
    part = x[..., cuts[rank]:cuts[rank + 1]]
    out = {}
    leaf = part.clone().requires_grad_(True)
    logp = logp_fn(leaf, y)
    logp.sum().backward()
    out["logp"], out["logp_grad"] = logp.detach(), leaf.grad
    leaf = part.clone().requires_grad_(True)
    h = entropy_fn(leaf, chunk_size=2)  # as verl's vocab_parallel_entropy_with_chunking is called
    h.sum().backward()
    out["entropy"], out["entropy_grad"] = h.detach(), leaf.grad
    for entropy in (True, False):
        leaf = part.clone().requires_grad_(True)
        got = step(None, leaf * 1.0, y, t.clone(), calculate_sum_pi_squared=False, calculate_entropy=entropy,
                   distillation_use_topk=False, distillation_only=False, logits_processor_func=None,
                   batch=None, data_format="thd")
        loss = got["log_probs"].sum() + (0.3 * got["entropy"].sum() if entropy else 0)
        loss.backward()
        out[f"step{entropy}"] = {k: v.detach() for k, v in got.items()}
        out[f"step{entropy}_grad"] = leaf.grad
    torch.save(out, f"{path}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize("cuts", [[0, 437, VOCAB], [0, 1, 998, VOCAB]], ids=["tp2-uneven", "tp3-uneven"])
def test_megatron_vocab_parallel_functions_and_logits_step_give_tp1_bits(tmp_path, cuts):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = len(cuts) - 1
    path = str(tmp_path / "r")
    torch.multiprocessing.spawn(_rank, args=(world, port, path, cuts), nprocs=world, join=True)
    ranks = [torch.load(f"{path}.{r}") for r in range(world)]
    x, y, t = _inputs()
    t_contract = torch.where(t <= 0, torch.full_like(t, 1e-8), t)

    def tp1(fn):
        leaf = x.clone().requires_grad_(True)
        value = fn(leaf)
        loss = value.sum() if torch.is_tensor(value) else value[0].sum() + 0.3 * value[1].sum()
        loss.backward()
        return value, leaf.grad

    def cat(key):
        return torch.cat([r[key] for r in ranks], dim=-1)

    logp, grad = tp1(lambda v: rl_logp.logprobs(v, y))
    h, h_grad = tp1(lambda v: rl_logp.entropy(v))
    (step_logp, step_h), step_grad = tp1(lambda v: rl_logp.logprobs_and_entropy(v, y, temperature=t_contract))
    alone, alone_grad = tp1(lambda v: rl_logp.logprobs(v, y, temperature=t_contract))
    for r in ranks:
        assert mismatches(r["logp"], logp.detach()) == 0
        assert mismatches(r["entropy"], h.detach()) == 0
        assert mismatches(r["stepTrue"]["log_probs"], step_logp.detach()) == 0
        assert mismatches(r["stepTrue"]["entropy"], step_h.detach()) == 0
        assert mismatches(r["stepFalse"]["log_probs"], alone.detach()) == 0
    assert mismatches(cat("logp_grad"), grad) == 0
    assert mismatches(cat("entropy_grad"), h_grad) == 0
    assert mismatches(cat("stepTrue_grad"), step_grad) == 0
    assert mismatches(cat("stepFalse_grad"), alone_grad) == 0
    stock = x.clone().div_(t_contract.unsqueeze(-1).to(x.dtype))  # what verl 0.9.1's step scores
    assert mismatches(rl_logp.logprobs(stock, y), alone.detach()) > 12

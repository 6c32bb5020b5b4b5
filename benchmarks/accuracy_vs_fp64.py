"""Max abs error of logp and dlogits against an fp64 log_softmax reference, per backend, dtype and V.

    python benchmarks/accuracy_vs_fp64.py --out benchmarks/results/accuracy_cpu.json
"""

from __future__ import annotations

import argparse
import json

import torch

import rl_logp


def errors(backend: str, device: str, n: int, vocab: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(vocab)
    x = (torch.randn(n, vocab, generator=gen) * 2.5 - 3).to(dtype).to(device)
    y = torch.randint(0, vocab, (n,), generator=gen).to(device)
    leaf = x.clone().requires_grad_(True)
    rl_logp.logprobs(leaf, y, backend=backend).sum().backward()
    ref_x = x.double().requires_grad_(True)
    ref = torch.log_softmax(ref_x, -1).gather(1, y[:, None]).squeeze(1)
    ref.sum().backward()
    with torch.no_grad():
        logp = rl_logp.logprobs(x, y, backend=backend)
    return {
        "backend": backend, "device": device, "rows": n, "vocab": vocab, "dtype": str(dtype).split(".")[-1],
        "logp_max_abs_err": float((logp.double() - ref).abs().max()),
        "dlogits_max_abs_err": float((leaf.grad.double() - ref_x.grad).abs().max()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", default="chunked")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="benchmarks/results/accuracy_cpu.json")
    a = p.parse_args()
    rows = [errors(a.backend, a.device, 4 if v == 151936 else 16, v, d)
            for v in (1, 255, 1031, 151936) for d in (torch.float32, torch.bfloat16, torch.float16)]
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{'backend':8s} {'V':>7s} {'dtype':9s} {'logp err':>10s} {'dlogits err':>12s}")
    for r in rows:
        print(f"{r['backend']:8s} {r['vocab']:7d} {r['dtype']:9s} {r['logp_max_abs_err']:10.2e} {r['dlogits_max_abs_err']:12.2e}")


if __name__ == "__main__":
    main()

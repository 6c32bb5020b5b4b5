"""Unpack an official vLLM wheel's Python sources and its dist-info (no compiled libraries) into a folder
that can go first on PYTHONPATH. vLLM reads its own version from the dist-info to pick its platform.

    python scripts/unpack_vllm_sources.py WHEEL DEST [--for-cuda]

--for-cuda (the device bundle) leaves out the model definitions and writes a stand-in for the compiled
`vllm._C_stable_libtorch`, which `vllm.platforms.cuda` imports at its top and the sampler never calls.
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("wheel", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--for-cuda", action="store_true")
    args = p.parse_args()
    with zipfile.ZipFile(args.wheel) as z:
        dist_info = next(n.split("/")[0] for n in z.namelist() if n.split("/")[0].endswith(".dist-info"))

        def wanted(name: str) -> bool:
            if name.startswith(f"{dist_info}/"):
                return True
            if args.for_cuda and name.startswith("vllm/model_executor/models/"):
                return False
            return name.startswith("vllm/") and name.endswith(".py")

        z.extractall(args.dest, [n for n in z.namelist() if wanted(n)])
    if args.for_cuda:
        (args.dest / "vllm" / "_C_stable_libtorch.py").write_text(
            '"""Stand-in for the compiled vllm._C_stable_libtorch (not carried to the device)."""\n')


if __name__ == "__main__":
    main()

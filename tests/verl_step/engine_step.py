"""verl 0.9.1's FSDP engine step on the CPU, without FSDP: `FSDPEngineWithLMHead.prepare_model_inputs`, a
tiny Qwen2's forward and `prepare_model_outputs`, in the order `forward_step` calls them (`forward_step`
also moves the batch to the accelerator and enters autocast, which this CPU set-up has no use for).

The engine is `object.__new__(FSDPEngineWithLMHead)` (or a subclass) with the attributes those methods read,
set with `object.__setattr__` so an engine that refuses attribute writes can be built too; its
`compute_entropy_from_logits` is verl's `entropy_from_logits`, as `FSDPEngine.__init__` binds it with
`use_torch_compile=False`. With `fused_backend` the model's class gets verl's own fused-kernel forward
(`patch_forward_with_backends`, which `apply_monkey_patch` calls for `use_fused_kernels=True`); each model
has a class of its own, so that patch stays with it. The lm_head's output is captured, so a test can score
the very logits verl scored.
"""

from __future__ import annotations

import types

import torch
import verl.utils.torch_functional as tf
import verl.workers.engine.fsdp.transformer_impl as fsdp_engine
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl.models.transformers.monkey_patch import patch_forward_with_backends
from verl.utils import tensordict_utils as tu

VOCAB = 1031
LENGTHS = [9, 5, 12, 7]


def make_model(fused_backend: str | None = None, device: str = "cpu") -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = type("TinyQwen2ForCausalLM", (Qwen2ForCausalLM,), {})(config).to(device=device, dtype=torch.bfloat16)
    if fused_backend is not None:
        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=fused_backend)
    return model


def make_engine(model: torch.nn.Module, *, fused: bool = False, checkpointing: bool = False,
                engine_cls: type = fsdp_engine.FSDPEngineWithLMHead, entropy=None):
    """`entropy`: the engine's `compute_entropy_from_logits`; None: `verl_F.entropy_from_logits` as bound
    now (rl-logp's while verl is patched, as for an engine verl builds then)."""
    engine = object.__new__(engine_cls)
    attributes = {
        "module": model,
        "engine_config": types.SimpleNamespace(entropy_checkpointing=checkpointing,
                                               entropy_from_logits_with_chunking=False,
                                               entropy_from_logits_chunk_size=2048),
        "model_config": types.SimpleNamespace(use_fused_kernels=fused),
        "compute_entropy_from_logits": tf.entropy_from_logits if entropy is None else entropy,
        "use_ulysses_sp": False,
        "pad_to_length": False,
        "pad_to_length_bucket": 1,
    }
    for name, value in attributes.items():
        object.__setattr__(engine, name, value)
    return engine


def input_ids(device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]
    return torch.nested.nested_tensor(rows, layout=torch.jagged).to(device)


def labels(device: str = "cpu") -> torch.Tensor:
    """What verl scores each packed row against: the next token (`input_ids_rmpad_rolled`)."""
    return torch.roll(input_ids(device).values(), shifts=-1, dims=0)


def micro_batch(temperature: float, device: str = "cpu", **flags):
    """A micro-batch as the actor's `compute_log_prob` / `update_policy` hands it to the engine."""
    ids = input_ids(device)
    positions = torch.nested.nested_tensor([torch.arange(n) for n in LENGTHS], layout=torch.jagged).to(device)
    return tu.get_tensordict(tensor_dict={"input_ids": ids, "position_ids": positions},
                             non_tensor_dict={"temperature": temperature, "use_remove_padding": True, **flags})


def run(engine, batch) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(verl's outputs as packed rows, the lm_head's logits as packed rows [N, V], or None when the fused
    forward never ran the lm_head)."""
    captured = []
    hook = engine.module.lm_head.register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        model_inputs, output_args = engine.prepare_model_inputs(batch)
        output = engine.module(**model_inputs, use_cache=False)
        outputs = engine.prepare_model_outputs(output, output_args, batch, None)
    finally:
        hook.remove()
    logits = None
    if captured:
        (x,) = captured
        logits = x[0] if x.shape[0] == 1 else torch.cat([row[:n] for row, n in zip(x, LENGTHS, strict=True)])
    return {key: value.values() for key, value in outputs.items()}, logits

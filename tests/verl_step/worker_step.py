"""verl 0.9.1's training step on the CPU: `ActorRolloutRefWorker` (actor + ref, FSDP2 on gloo, world size 1)
driven by `RayPPOTrainer`'s own `_compute_old_log_prob`, `_compute_ref_log_prob` and `_update_actor`.

Run by tests/test_verl_worker_step.py in a fresh process (the parent sets or clears `RL_LOGP_BACKEND`; the
config carries `actor_rollout_ref.model.external_lib=rl_logp.integrations.verl_hook`, as the recipe overlay
does). For each remove-padding setting and temperature it records the logits the actor and the ref model
produced (a forward hook on `lm_head`), the tokens, and what the trainer got back (old log-probs,
entropies, ref log-probs, the actor-update metrics), and writes them to `--out` (torch.save).

With `--fused-model` it then runs the trainer's three steps (not the rollout side) again with
`actor_rollout_ref.model.use_fused_kernels=True` (verl's torch backend: the model's forward becomes
`forward_with_torch_backend`, which hands the final hidden states and `lm_head.weight` to
`FusedLinearForPPO` and never materialises logits) and records what that head received: the final norm's
output (a forward hook) and the `lm_head.weight` read at that moment. These cases run last, because verl's
fused patch replaces the model class's `forward` for the whole process, and on a second model with tied
embeddings: verl 0.9.1's FSDP2 wraps an untied `lm_head` as its own FSDP unit, which the fused forward never
calls, so its weight is still the sharded DTensor and the fused matmul fails ("aten.mm.default got mixed
torch.Tensor and DTensor"; a verl limitation, not a CPU one). A tied `lm_head` belongs to the root unit,
unsharded for the forward.

CPU shims (verl 0.9.1 supports CUDA and NPU only; nothing here changes how a logit is scored):
1. platform: a `PlatformCUDA` subclass whose device is `cpu` (module `torch.cpu`, given zero memory
   statistics and no-op cache/seed functions where it has none) and whose collective backend is gloo, installed with verl's `set_platform`; the FSDP engine
   module's import-time `device_name` global is set to "cpu" too. The process group is created here with
   plain "gloo" (verl's "cpu:gloo,<device>:<backend>" string names the CPU twice). The ref model's FSDP2
   `CPUOffloadPolicy(pin_memory=True)` becomes `pin_memory=False` (pinning needs an accelerator).
2. engine lookup: `VERL_ENGINE_DEVICE=cuda` (a verl knob) so `EngineRegistry` returns the FSDP engine,
   which verl registers for cuda/npu only.
3. attention: `override_config.attn_implementation=sdpa` (verl's default flash_attention_2 needs CUDA).
4. trainer: `RayPPOTrainer` is built with `object.__new__` and given this process's worker as its worker
   group (`actor_rollout_wg`, `ref_policy_wg`): its methods run unchanged, without Ray.
5. `uvicorn` and `fastapi`, imported by `ray_trainer` for the rollout HTTP server (vLLM brings them; the
   pinned venv installs vLLM without dependencies): stub modules, only where they are not installed. The
   step never starts a server.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType

import torch

RESPONSE = 7
PROMPT = 5
BATCH = 4


def install_cpu_platform() -> None:
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    cpu_module = torch.cpu  # verl's flops counter recognises it as the CPU
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        if not hasattr(cpu_module, name):
            setattr(cpu_module, name, lambda *a, **k: 0)
    for name in ("empty_cache", "reset_peak_memory_stats", "set_device", "manual_seed", "manual_seed_all",
                 "ipc_collect"):
        if not hasattr(cpu_module, name):
            setattr(cpu_module, name, lambda *a, **k: None)
    if not hasattr(cpu_module, "mem_get_info"):
        cpu_module.mem_get_info = lambda *a, **k: (1 << 34, 1 << 35)

    class PlatformCPU(PlatformCUDA):
        device_name = "cpu"
        device_module = cpu_module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def communication_backend_name(self) -> str:
            return "gloo"

    platform_manager.set_platform(PlatformCPU())
    engine_module = sys.modules["verl.workers.engine.fsdp.transformer_impl"]
    engine_module.device_name = "cpu"
    pinned_policy = engine_module.CPUOffloadPolicy

    class UnpinnedOffloadPolicy(pinned_policy):
        def __init__(self, pin_memory: bool = False) -> None:
            super().__init__(pin_memory=False)

    engine_module.CPUOffloadPolicy = UnpinnedOffloadPolicy


def stub_missing_server_modules() -> None:
    class Stub(ModuleType):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {"__init__": lambda self, *a, **k: None})

    for name in ("uvicorn", "fastapi"):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = Stub(name)


def make_model(path: str, vocab: int, tie_word_embeddings: bool = False) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tie_word_embeddings,
        architectures=["Qwen2ForCausalLM"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)


def compose(model_path: str, remove_padding: bool, fused: bool = False):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    overrides = [
        f"actor_rollout_ref.model.path={model_path}",
        "+actor_rollout_ref.model.load_tokenizer=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.external_lib=rl_logp.integrations.verl_hook",
        f"actor_rollout_ref.model.use_remove_padding={remove_padding}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "algorithm.adv_estimator=grpo",
    ]
    if fused:
        overrides += ["actor_rollout_ref.model.use_fused_kernels=True",
                      "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch"]
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


def make_batch(vocab: int, temperature: float):
    from verl import DataProto

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, vocab, (BATCH, PROMPT), generator=gen)
    responses = torch.randint(3, vocab, (BATCH, RESPONSE), generator=gen)
    prompt_mask = torch.ones(BATCH, PROMPT, dtype=torch.int64)
    prompt_mask[0, :2] = 0  # left padding
    prompt_mask[2, :1] = 0
    response_mask = torch.ones(BATCH, RESPONSE, dtype=torch.int64)
    response_mask[1, 4:] = 0  # right padding
    response_mask[3, 6:] = 0
    prompts = prompts.masked_fill(prompt_mask == 0, 0)
    responses = responses.masked_fill(response_mask == 0, 0)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    batch = DataProto.from_single_dict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask, "position_ids": position_ids, "response_mask": response_mask,
        "advantages": torch.randn(BATCH, RESPONSE, generator=gen),
    })
    batch.meta_info["temperature"] = temperature
    batch.meta_info["global_token_num"] = attention_mask.sum(dim=-1).tolist()  # as RayPPOTrainer.fit sets it
    return batch


class HeadInputsRecorder:
    """What verl's fused head (`FusedLinearForPPO.forward`, called by the model's patched
    `forward_with_torch_backend`) receives: a forward hook on the model's final norm, whose output is the
    hidden states that forward passes on (`outputs[0]`), and the `lm_head.weight` it passes, read at the
    same moment. Detached copies; scoring is untouched."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, module, inputs, output) -> None:
        weight = self.model.lm_head.weight
        self.outputs.append((output.detach().clone(), weight.detach().clone()))

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        taken, self.outputs = self.outputs, []
        return taken


class LogitsRecorder:
    """Forward hook on an `lm_head`: keeps a detached copy of every output (the logits verl scores)."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def __call__(self, module, inputs, output) -> None:
        self.outputs.append(output.detach().clone())

    def take(self) -> list[torch.Tensor]:
        taken, self.outputs = self.outputs, []
        return taken


def model_of(training_worker) -> torch.nn.Module:
    module = training_worker.engine.module
    return getattr(module, "module", module)


def lm_head_of(training_worker) -> torch.nn.Module:
    return model_of(training_worker).lm_head


def head_recorder(training_worker) -> HeadInputsRecorder:
    """A `HeadInputsRecorder` hooked on the final norm of the worker's model."""
    model = model_of(training_worker)
    recorder = HeadInputsRecorder(model)
    model.model.norm.register_forward_hook(recorder)
    return recorder


def fused_rows(inputs: list[tuple[torch.Tensor, torch.Tensor]], batch, remove_padding: bool):
    """`response_rows` of the captured hidden states, and the lm_head weight (the same in every forward of
    one step)."""
    weights = [w for _, w in inputs]
    assert all(torch.equal(w, weights[0]) for w in weights)
    return [x for x, _ in response_rows([h for h, _ in inputs], batch, remove_padding)], weights[0]


class VllmSampler:
    """The rollout side: vLLM 0.24.0's V1 `Sampler` code in processed_logprobs mode on given logits: its
    in-place fp32 temperature division (`apply_temperature`), `compute_logprobs`, `gather_logprobs`.
    `compute_logprobs` is rl-logp's (the vLLM adapter's `apply`) only when RL_LOGP_BACKEND is set."""

    def __init__(self) -> None:
        from vllm.v1.sample.sampler import Sampler

        backend = os.environ.get("RL_LOGP_BACKEND")
        if backend:
            from rl_logp.integrations import vllm as vllm_adapter

            vllm_adapter.apply(backend=backend)
        self.sampler = Sampler

    def __call__(self, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        x = logits.to(torch.float32)
        x = self.sampler.apply_temperature(x, torch.full((x.shape[0],), temperature), True)
        logprobs = self.sampler.compute_logprobs(x)
        return self.sampler.gather_logprobs(logprobs, 1, token_ids=tokens).logprobs[:, 0]


def rollout_log_probs(sampler, rows: list[tuple[torch.Tensor, int]], batch, temperature: float) -> torch.Tensor:
    """The sampler's logp of each response token from the actor's logits, [batch, response], 0 at padding."""
    out = torch.zeros(batch.batch["responses"].shape, dtype=torch.float32)
    for i, (x, length) in enumerate(rows):
        out[i, :length] = sampler(x, batch.batch["responses"][i, :length], temperature)
    return out


def response_rows(logits: list[torch.Tensor], batch, remove_padding: bool) -> list[tuple[torch.Tensor, int]]:
    """For each sequence, the logits rows that predict its response tokens, and the response length.
    Micro-batches hold consecutive sequences; with remove-padding each is one packed row
    [1, sum of lengths, V], without it [sequences, longest, V] (left-aligned)."""
    prompt_lens = batch.batch["attention_mask"][:, :PROMPT].sum(dim=1).tolist()
    response_lens = batch.batch["response_mask"].sum(dim=1).tolist()
    rows, seq = [], 0
    for micro in logits:
        if remove_padding:
            start = 0
            while start < micro.shape[1]:
                p, r = prompt_lens[seq], response_lens[seq]
                rows.append((micro[0, start + p - 1 : start + p - 1 + r].clone(), r))
                start += p + r
                seq += 1
        else:
            for local in range(micro.shape[0]):
                p, r = prompt_lens[seq], response_lens[seq]
                rows.append((micro[local, p - 1 : p - 1 + r].clone(), r))
                seq += 1
    assert seq == len(prompt_lens)
    return rows


def make_trainer(model_path: str, remove_padding: bool, fused: bool = False):
    """(config, actor worker, ref worker, trainer): initialised workers and a `RayPPOTrainer` without Ray
    whose worker groups are this process's workers (shim 4)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.workers.engine_workers import ActorRolloutRefWorker

    config = compose(model_path, remove_padding, fused=fused)
    actor = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
    actor.init_model()
    ref = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="ref")
    ref.init_model()
    trainer = object.__new__(RayPPOTrainer)
    trainer.config, trainer.actor_rollout_wg, trainer.ref_policy_wg = config, actor, ref
    trainer.ref_in_actor = False
    return config, actor, ref, trainer


def run_fused(model_path: str, vocab: int, results: dict) -> None:
    """`use_fused_kernels=True` (verl's torch backend, `FusedLinearForPPO`): for each remove-padding
    setting and temperature, the hidden states and lm_head weight the fused head received (actor and ref),
    and what the trainer got back. Keys ("fused", remove_padding, temperature). `model_path`: a model
    with tied embeddings (see the module docstring)."""
    for remove_padding in (True, False):
        config, actor, ref, trainer = make_trainer(model_path, remove_padding, fused=True)
        actor_inputs, ref_inputs = head_recorder(actor.actor), head_recorder(ref.ref)
        lm_head_calls = LogitsRecorder()  # the fused forward never calls lm_head
        lm_head_of(actor.actor).register_forward_hook(lm_head_calls)
        lm_head_of(ref.ref).register_forward_hook(lm_head_calls)
        for temperature in (0.7, 1.0):
            config.actor_rollout_ref.rollout.temperature = temperature
            batch = make_batch(vocab, temperature)
            old, _ = trainer._compute_old_log_prob(batch)
            old_hidden, old_weight = fused_rows(actor_inputs.take(), batch, remove_padding)
            ref_out = trainer._compute_ref_log_prob(batch)
            ref_hidden, ref_weight = fused_rows(ref_inputs.take(), batch, remove_padding)
            batch = batch.union(old).union(ref_out)
            update = trainer._update_actor(batch)
            results[("fused", remove_padding, temperature)] = {
                "batch": {k: v.clone() for k, v in batch.batch.items()},
                "old_hidden": old_hidden, "old_weight": old_weight,
                "ref_hidden": ref_hidden, "ref_weight": ref_weight,
                "update_forwards": len(actor_inputs.take()),
                "lm_head_calls": len(lm_head_calls.take()),
                "update_metrics": update.meta_info["metrics"],
            }


def run(model_path: str, vocab: int) -> dict:
    results = {"patched_module": sys.modules["verl.utils.torch_functional"].logprobs_from_logits.__module__}
    sampler = VllmSampler()
    for remove_padding in (True, False):
        config, actor, ref, trainer = make_trainer(model_path, remove_padding)
        actor_logits, ref_logits = LogitsRecorder(), LogitsRecorder()
        lm_head_of(actor.actor).register_forward_hook(actor_logits)
        lm_head_of(ref.ref).register_forward_hook(ref_logits)
        for temperature in (0.7, 1.0):
            config.actor_rollout_ref.rollout.temperature = temperature  # what _update_actor reads
            batch = make_batch(vocab, temperature)
            old, _ = trainer._compute_old_log_prob(batch)
            old_rows = response_rows(actor_logits.take(), batch, remove_padding)
            ref_out = trainer._compute_ref_log_prob(batch)
            batch = batch.union(old).union(ref_out)
            batch.batch["rollout_log_probs"] = rollout_log_probs(sampler, old_rows, batch, temperature)
            from verl.utils.debug.metrics import calculate_debug_metrics  # imported as RayPPOTrainer.fit does

            debug_metrics = calculate_debug_metrics(batch)
            update = trainer._update_actor(batch)
            results[(remove_padding, temperature)] = {
                "batch": {k: v.clone() for k, v in batch.batch.items()},
                "old_logits": [x for x, _ in old_rows],
                "ref_logits": [x for x, _ in response_rows(ref_logits.take(), batch, remove_padding)],
                "update_logits": len(actor_logits.take()),
                "update_metrics": update.meta_info["metrics"],
                "debug_metrics": debug_metrics,
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="directory of the tiny model (created if absent)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fused-model",
                        help="also run the use_fused_kernels=True cases, on this model (tied embeddings; created "
                             "if absent), after the others: verl's fused patch replaces the model class's forward "
                             "for the rest of the process")
    args = parser.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      VERL_ENGINE_DEVICE="cuda")
    os.environ.setdefault("MASTER_PORT", "29533")
    # `import verl` loads the verl.plugins entry point: rl-logp's hook when RL_LOGP_BACKEND is set.
    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401

    install_cpu_platform()
    stub_missing_server_modules()
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not os.path.isdir(args.model):
        make_model(args.model, args.vocab)
    if args.fused_model and not os.path.isdir(args.fused_model):
        make_model(args.fused_model, args.vocab, tie_word_embeddings=True)
    results = run(args.model, args.vocab)
    if args.fused_model:
        run_fused(args.fused_model, args.vocab, results)
    torch.save(results, args.out)


if __name__ == "__main__":
    main()

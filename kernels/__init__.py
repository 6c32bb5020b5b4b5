"""GPU kernels of rl-logp, installed as `rl_logp.kernels`. They take tensors and integers and import
nothing from the package above them.

`fixed_point`: the contract's arithmetic in Triton (exact exp/log, the temperature division, the exact
fixed-point sums), shared by the kernels; `row_stats`: the forward kernel (row max, sums, the finished
logp / lse / entropy), whole rows per program; `row_stats_ranges`: its split plan for a few rows (a row's
column ranges on programs of their own); `arrival`: the split plans' arrival counting; `grad`: the
backward kernel (the row-local gradient of logp and/or entropy); `launch`: their launches and launch
parameters (`LaunchConfig`); `launcher`: Triton's launch with less host time per call; `kept_set`: the
rollout's top-k/top-p kept set without a sort, and a draw from it given exponential noise (its launches and
`KeptSetLaunch`), `kept_set_select`: that kernel's per-row selection and last pass;
`temperature`: the rollout's per-row division by T through an index (vLLM V2); `sampled_rank`: the
sampled token's logprob and rank beside the top-n (vLLM V1's gather).
`cluster_row_stats.cu`: the forward in CUDA C++ with one HBM read per row (a row in the shared memory of a
cluster of blocks; same bits), launched by `cluster_launch` where `LaunchConfig.cluster_rows` asks for
it; `cuda_source`: NVRTC compilation and driver launches of CUDA C++ kernels through ctypes.
Importing this package never needs a GPU; importing its modules needs Triton (`cuda_source` and
`cluster_launch`: torch alone).
"""

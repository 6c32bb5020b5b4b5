"""GPU kernels of rl-logp, installed as `rl_logp.kernels`.

`fused_forward`: the Triton kernels of the forward (row statistics: max, the int64 fixed-point sums, and
the finished logp / lse / entropy); `fused_backward`: the row-local gradient of logp and/or entropy;
`fused_engine`: `FusedEngine`, which launches them, and its launch parameters `FusedConfig`. Importing this
package never needs a GPU; importing its modules needs Triton.
"""

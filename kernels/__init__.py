"""GPU kernels of rl-logp, installed as `rl_logp.kernels`.

`fused_logp`: the Triton kernels of the `fused` backend (row statistics and the row-local backward)
and `FusedEngine`, which launches them. Importing this package never needs a GPU; importing
`fused_logp` needs Triton.
"""

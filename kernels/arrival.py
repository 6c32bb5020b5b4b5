"""Arrival counting of the split plans: several programs share a row, the last one to finish finishes it.

A split plan runs a row's column ranges on programs of their own; each stores its range's partial result,
then counts its arrival on the row's counter (`last_to_arrive`), and the program that counts last reads
the others' partials (`published`) and reduces them. Only exact reductions are done this way (max, min,
integer sums), so which program comes last changes no bit; no program ever waits on another (no hang).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(ARRIVALS, last):
    """Count this program's arrival on the row's counter; whether it is the last one (`last` counted before
    it). The barrier orders the stores of every thread of the program before the atomic (issued by one
    thread), whose release (acq_rel, gpu scope) publishes them to the program that acquires a later count;
    Triton broadcasts the atomic's result through shared memory behind a barrier (as the sm_90 PTX shows), so
    that program's threads read after its acquire."""
    tl.debug_barrier()
    return tl.atomic_add(ARRIVALS, 1, sem="acq_rel", scope="gpu") == last


@triton.jit
def published(ptrs, mask, other):
    """A load of values that the row's other programs stored in this launch, after `last_to_arrive`. `.cg`
    reads them from L2 (the point of coherence), never from this SM's L1, which is not coherent with other
    SMs' stores: correct without relying on the acquire invalidating L1, at no cost for these few values."""
    return tl.load(ptrs, mask=mask, other=other, cache_modifier=".cg")

"""Run 30: `decode_step` with matmul 'persistent' = kernels/persistent_mlp.py's phases 1-2 in one
kernel (SiLU*up, then w_down's split-K partials, counters Ref from Ops.mlp_scratch) and then the
same norms kernel 'auto' runs after its w_down partials (kernels.norm_add_norm), instead of the
kernel's phase 3. Patches matmul_ops._persistent_mlp_or for this process, then runs
loopjax.bench.decode_step's main with the given arguments."""
import functools
import sys

from loopjax import kernels
from loopjax import matmul_ops as mo
from loopjax.kernels import persistent_mlp as pm
from loopjax.kernels._common import mosaic_gpu_problem


def phases12_then_norms(ops, interpret=False):
    def fused_mlp(x, w_gate_up, w_down, residual, norm_weight, next_norm_weight, eps, counters):
        if mosaic_gpu_problem() or pm.shape_problem(x, w_gate_up, w_down) is not None:
            return ops.mlp_norm_add_norm(x, w_gate_up, w_down, residual, norm_weight, next_norm_weight,
                                         eps, counters)
        _, partials, _ = pm._run(x, w_gate_up, w_down, None, None, None, 6, None, interpret, counters)
        return kernels.norm_add_norm(partials[:, : x.shape[0]], residual, norm_weight, next_norm_weight, eps,
                                     interpret=interpret)
    return fused_mlp


if __name__ == "__main__":
    mo._persistent_mlp_or = functools.cache(phases12_then_norms)
    from loopjax.bench import decode_step
    sys.exit(decode_step.main(sys.argv[1:]))

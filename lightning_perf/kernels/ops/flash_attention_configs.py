"""Flash attention's launch configurations: the candidates the tuner times per kernel and head dim.

One table, ``_CONFIGS``, lists (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel ("fwd", "dq",
"dkdv", "fused"; see ``flash_attention_forward`` and ``flash_attention_backward``) and per tier: "cpu"
for Triton's interpreter, then by head dim D on the GPU. :func:`_configs` turns a row into the launch
dicts the launchers (``flash_attention_launch``) hand to the tuner, without the configs a causal
kernel's loops cannot walk (:func:`usable_configs`). The query-block kernels (fwd, dq) hold BLOCK_M
queries per program, the key-block kernels (dkdv, fused) BLOCK_N keys.
"""

from __future__ import annotations

__all__ = ["usable_configs"]

# "deep": deeper software pipelines for the head dims of real models (Hopper has the shared memory for
# them), timed beside the tier's list for 64 <= D <= 128
_CONFIGS: dict[str, dict[str, list[tuple[int, int, int, int]]]] = {
    "fwd": {
        "cpu": [(16, 16, 4, 1)],
        "D<=64": [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4), (128, 128, 4, 3), (64, 64, 4, 3),
                  (128, 32, 4, 4)],
        "D<=128": [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3),
                   (128, 32, 4, 3), (64, 32, 4, 4), (128, 64, 8, 4), (64, 64, 4, 4), (64, 128, 4, 3)],
        "D>128": [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (32, 32, 4, 2)],
        "deep": [(64, 64, 4, 5), (128, 64, 8, 4), (64, 64, 8, 4), (128, 64, 8, 5)],
    },
    "dq": {
        "cpu": [(16, 16, 4, 1)],
        "D<=64": [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 4), (64, 32, 4, 4)],
        "D<=128": [(128, 64, 8, 2), (128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3),
                   (64, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2), (128, 128, 8, 2)],
        "D>128": [(64, 32, 8, 2), (64, 16, 4, 2), (32, 32, 4, 2), (32, 16, 4, 2)],
        "deep": [(128, 32, 4, 5), (64, 32, 4, 5), (128, 64, 8, 4)],
    },
    "dkdv": {
        "cpu": [(16, 16, 4, 1)],
        "D<=64": [(32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 4)],
        "D<=128": [(64, 128, 8, 2), (32, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 2),
                   (32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 8, 2), (32, 128, 8, 3), (16, 128, 4, 3)],
        "D>128": [(32, 64, 8, 2), (16, 64, 4, 2), (32, 32, 4, 2), (16, 32, 4, 2)],
        "deep": [(32, 128, 4, 4), (32, 128, 4, 5), (32, 64, 4, 5), (64, 128, 8, 4)],
    },
    "fused": {
        "cpu": [(16, 32, 4, 1)],  # key blocks twice the query blocks, as on the GPU
        "D<=64": [(32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3)],
        "D<=128": [(64, 128, 8, 2), (32, 128, 8, 2), (32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3),
                   (32, 64, 4, 3)],
        "D>128": [(32, 64, 8, 2), (16, 64, 4, 2), (16, 32, 4, 2)],
        "deep": [(32, 128, 4, 4), (32, 128, 4, 5), (64, 128, 8, 4)],
    },
}


def _cfg(bm, bn, w, s):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)


def _base_configs(kernel: str, D: int, cuda: bool) -> list[dict]:
    """The table's list for ``kernel`` at head dim ``D`` on the GPU (``cuda``) or in the interpreter."""
    tier = "cpu" if not cuda else "D<=64" if D <= 64 else "D<=128" if D <= 128 else "D>128"
    return [_cfg(*c) for c in _CONFIGS[kernel][tier]]


def usable_configs(kernel: str, configs, causal: bool) -> list[dict]:
    """The configs whose block sizes the kernel's loops can walk.

    With causal masking the query-block kernels (forward, dQ) run unmasked up to the diagonal
    block in steps of BLOCK_N, so BLOCK_N must divide BLOCK_M; the dK/dV kernel steps over
    query blocks from its key block's start, so BLOCK_M must divide BLOCK_N. A config breaking
    this would skip or double-count keys next to the diagonal (silently wrong, not slower).
    """
    if not causal:
        return list(configs)
    if kernel in ("dkdv", "fused"):
        return [c for c in configs if c["BLOCK_N"] % c["BLOCK_M"] == 0]
    return [c for c in configs if c["BLOCK_M"] % c["BLOCK_N"] == 0]


_config_cache: dict[tuple, list[dict]] = {}


def _configs(kernel: str, D: int, cuda: bool, causal: bool) -> list[dict]:
    """Candidate configs per (kernel, head dim, device kind, causal), built once."""
    key = (kernel, D, cuda, causal)
    if key not in _config_cache:
        configs = _base_configs(kernel, D, cuda)
        if cuda and 64 <= D <= 128:
            configs += [c for c in (_cfg(*d) for d in _CONFIGS[kernel]["deep"]) if c not in configs]
        _config_cache[key] = usable_configs(kernel, configs, causal)
    return _config_cache[key]


def _bwd_impls(cuda: bool) -> list[dict]:
    """Backward strategies the launcher chooses between: the GPU times both."""
    return [dict(impl="split"), dict(impl="fused")] if cuda else [dict(impl="split")]

"""Which category a profiled op's time belongs to: one table from op names to categories.

A step's time is split into the categories below. Ops are matched by their base name (``aten::addmm``
-> ``addmm``; an autograd node ``AddmmBackward0`` -> ``addmm``; a trailing ``_`` of an in-place op is
dropped); the first row of ``_TABLE`` whose pattern matches wins, so attention is listed before
matmul (SDPA calls ``bmm`` inside) and anything unmatched is ``other``.

``cpu_overhead`` is the ops that launch no compute (views, allocations); ``unattributed`` is the
step time outside every recorded op (Python, dispatch and autograd bookkeeping between ops, waiting),
so the categories add up to the step on the CPU clock; ``device_idle`` is only reported on a GPU:
step time in which no kernel ran.
"""

from __future__ import annotations

import functools
import re

__all__ = ["CATEGORIES", "DESCRIPTIONS", "category_of", "base_name"]

# category -> what it holds (the summary and the HTML report print these)
DESCRIPTIONS: dict[str, str] = {
    "matmul": "matrix multiplies and convolutions (mm, addmm, bmm, linear, conv)",
    "attention": "fused attention (scaled_dot_product_attention, flash / memory-efficient kernels)",
    "norm": "normalisation (layer_norm, rms_norm, batch_norm, group_norm)",
    "pointwise": "elementwise ops, activations, softmax, reductions, optimizer updates",
    "copy": "copies and transfers (copy_, to, clone, contiguous, cat, memcpy)",
    "communication": "collectives and point-to-point (c10d, NCCL, gloo)",
    "other": "ops no row of the table matches (embedding, indexing, sorting, ...)",
    "cpu_overhead": "ops that launch no compute (views, allocations, .item())",
    "unattributed": "step time outside any recorded op (Python, dispatch between ops, waiting)",
    "device_idle": "step time in which the GPU ran no kernel (launch-bound or waiting on the host)",
}
CATEGORIES: tuple[str, ...] = tuple(DESCRIPTIONS)

# (category, regex on the base name); first match wins, so the order matters
_TABLE: tuple[tuple[str, str], ...] = (
    ("communication", r"^(c10d|nccl|gloo)|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|"
                      r"^(send|recv|isend|irecv)$|record_param_comms|^barrier$"),
    ("attention", r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|^sdpa|"
                  r"_scaled_dot_product|flex_attention|^attention$"),
    ("matmul", r"^(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|einsum|addmv|mv|dot|vdot|tensordot|_mm_.*|"
               r"_addmm_activation|_int_mm|_scaled_mm|_weight_int\d.*mm.*|fbgemm_linear.*|mkldnn_linear|"
               r"convolution|_convolution|conv\w*|mkldnn_convolution|cudnn_convolution\w*|"
               r"slow_conv\w*|thnn_conv\w*|miopen_convolution\w*|_nnpack_spatial_convolution|gemm|sgemm|hgemm)$"),
    ("norm", r"(layer_norm|rms_norm|batch_norm|group_norm|instance_norm|_norm_|^norm$|renorm)"),
    ("copy", r"^(copy|to_copy|_copy_from|_copy_from_and_resize|to|_to_copy|clone|contiguous|cat|_cat|stack|pin_memory|"
             r"_pin_memory|memcpy\w*|memset|copy_to|index_copy|_to_dense|to_dense)$|^memcpy|^memset"),
    ("cpu_overhead", r"^(view|_unsafe_view|unsafe_view|reshape|_reshape_alias|t|transpose|permute|expand|expand_as|as_strided|"
                     r"detach|alias|slice|select|unsqueeze|squeeze|split|split_with_sizes|chunk|unbind|narrow|"
                     r"empty|empty_like|empty_strided|zeros|zeros_like|ones|ones_like|full|full_like|arange|"
                     r"resize|resolve_conj|resolve_neg|lift_fresh|_reshape_copy|flatten|unflatten|view_as|"
                     r"_local_scalar_dense|item|is_nonzero|result_type|numpy_t|_has_compatible_shallow_copy_type)$"),
    ("pointwise", r"^(add|sub|rsub|mul|div|neg|abs|exp|exp2|expm1|log|log1p|log2|log_softmax|_log_softmax|softmax|"
                  r"_softmax|pow|sqrt|rsqrt|reciprocal|sin|cos|tanh|sigmoid|relu|relu6|gelu|silu|mish|elu|selu|"
                  r"leaky_relu|hardswish|hardsigmoid|hardtanh|threshold|erf|erfc|clamp|clamp_min|clamp_max|"
                  r"clip|where|masked_fill|fill|zero|dropout|native_dropout|bernoulli|sign|floor|ceil|round|"
                  r"trunc|frac|maximum|minimum|max|min|sum|mean|var|std|var_mean|prod|amax|amin|argmax|argmin|"
                  r"eq|ne|lt|le|gt|ge|logical_\w+|bitwise_\w+|lerp|addcmul|addcdiv|square|norm_except_dim|"
                  r"cumsum|cumprod|any|all|isnan|isinf|nan_to_num|_foreach_\w+|_fused_adam\w*|_fused_sgd\w*|"
                  r"accumulate_grad|accumulategrad)$"),
)
_COMPILED = tuple((cat, re.compile(pat)) for cat, pat in _TABLE)
_NODE = re.compile(r"Backward\d*$")  # autograd node class names end so
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_GRAD_OP = re.compile(r"_backward(_data|_input|_weight)?$")


def base_name(name: str) -> str:
    """``aten::addmm`` -> ``addmm``; ``autograd::engine::evaluate_function: AddmmBackward0`` -> ``addmm``."""
    n = name.rsplit(": ", 1)[-1]  # autograd::engine::evaluate_function: XBackward0
    n = n.rsplit("::", 1)[-1].strip()  # aten::, c10d::, torch::autograd::
    if _NODE.search(n):  # an autograd node: NativeLayerNormBackward0 -> native_layer_norm
        n = _CAMEL.sub("_", _NODE.sub("", n))
    low = _GRAD_OP.sub("", n.lower())  # gelu_backward -> gelu: a gradient costs like its op
    if low.endswith("_") and not low.endswith("__"):
        low = low[:-1]  # in-place: add_ -> add
    return low


@functools.lru_cache(maxsize=4096)
def category_of(name: str) -> str:
    """The category of an op or kernel name (see the module doc); ``other`` when nothing matches."""
    b = base_name(name)
    for cat, rx in _COMPILED:
        if rx.search(b):
            return cat
    low = name.lower()  # GPU kernel names: "ampere_sgemm_128x64_tn", "Memcpy HtoD", "ncclKernel_AllReduce"
    if "nccl" in low:
        return "communication"
    if "memcpy" in low or "memset" in low:
        return "copy"
    if "flash" in low or "fmha" in low or "attention" in low:
        return "attention"
    if "gemm" in low or "conv" in low:
        return "matmul"
    if "norm" in low:
        return "norm"
    return "other"

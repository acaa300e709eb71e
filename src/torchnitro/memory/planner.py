"""Analytic memory estimate of one training step of the reference ``TransformerLM``.

The estimate adds up what the step keeps alive, term by term, and takes the worst moment of the
step. Notation: B batch, T sequence, D width, H heads, Hkv K/V heads, Dh head dim, F SwiGLU
hidden size, V vocab, L layers, e bytes per element of the model dtype, c bytes of what the
matmuls produce (e, or the autocast dtype).

Saved for backward, per layer (each line is what autograd holds, read from the ops that run):

- 2 RMSNorms: on CPU the decomposed norm keeps the fp32 input (the residual stream itself when
  e = 4), rsqrt (4BT), the fp32 normalised x and the e-byte output: ``(8 + e)BTD + 4BT`` each; on
  CUDA the fused kernel keeps only its input and rstd, plus the output the next matmul saves:
  ``2eBTD + 4BT``; a third norm after the last block;
- attention, by the SDPA backend that runs (``attention=``; "auto" asks PyTorch what it would
  pick for this device, dtype, head dim and GQA): see ``memory/attention.py``;
- SwiGLU: w1 and w3 outputs, silu(w1) and their product: ``4c*BTF``;
- loss: the fp32 log-softmax of the logits ``4BTV``.

With ``checkpointing="selective"`` a block keeps its input, the q/k/v and w1/w3 matmul outputs
and the attention kernel's outputs (``checkpoint_``'s default policy recomputes wo and w2).

Peaks checked (steady state: optimizer state exists, gradients were set to None):

- forward end: params + state + activations + the logits being turned into the loss;
- backward start: + two fp32 ``BTV`` buffers (NLL grad and log-softmax grad);
- backward with checkpointing: the checkpointed inputs + one recomputed group + grads so far;
- optimizer: params + grads + state + the update's temporaries (2x the largest tensor for the
  per-tensor loop, 1x all params for ``foreach``).

``plan(...).table()`` prints every term with its formula; tests hold it within 10% of the
``tracker``'s exact measurement over a grid of configs (on CPU; the CUDA terms were read from the
saved tensors of torch 2.11 on an H100/H200 and are checked there by ``benchmarks/memory.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torchnitro.errors import InputError
from torchnitro.memory.attention import ATTENTION_KINDS, attention_bytes, sdpa_backend, selective_attention_bytes

__all__ = ["Budget", "checkpoint_indices", "MemoryPlan", "PlanTerm", "plan", "parse_dtype", "DTYPE_BYTES",
           "CHECKPOINT_POLICIES", "StepShape", "step_shape",
           "parameter_terms", "gradient_term", "optimizer_state_term", "layer_terms", "selective_layer_bytes",
           "head_bytes", "Checkpointed", "checkpointed_activations", "optimizer_temporaries_term"]

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
_OPTIMIZER_STATE = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0, "none": 0}
CHECKPOINT_POLICIES = ("none", "blocks", "every_n", "selective", "budget")


@dataclass(frozen=True)
class Budget:
    """Checkpointing policy: keep activation memory at or below ``fraction`` of the unchecked model."""

    fraction: float  # 0 < fraction <= 1: share of the unchecked activation memory allowed

    def __post_init__(self) -> None:
        if not (isinstance(self.fraction, (int, float)) and 0 < self.fraction <= 1):
            raise InputError(f"Budget: received fraction={self.fraction!r}, expected a number in (0, 1]")


def parse_dtype(dtype: Any) -> int:
    """Bytes per element for 'fp32' / 'bf16' / 'fp16' or a torch dtype."""
    name = str(dtype).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise InputError(f"dtype: received {dtype!r}, expected one of {sorted(set(DTYPE_BYTES))}")
    return DTYPE_BYTES[name]


@dataclass
class PlanTerm:
    name: str  # what the bytes are
    bytes: int
    formula: str  # how they were counted
    group: str  # parameters / gradients / optimizer_state / activations / temporaries / per-layer


@dataclass
class MemoryPlan:
    """The estimate: terms, peaks per phase, and the overall peak."""

    terms: list[PlanTerm]
    phases: dict[str, int]  # phase -> estimated peak bytes
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    def term(self, name: str) -> int:
        for t in self.terms:
            if t.name == name:
                return t.bytes
        raise KeyError(f"no term {name!r}; terms are {[t.name for t in self.terms]}")

    @property
    def activation_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.group == "activations")

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase,
                "phases": dict(self.phases),
                "terms": [{"name": t.name, "bytes": t.bytes, "formula": t.formula, "group": t.group}
                          for t in self.terms]}

    def table(self) -> str:
        w = max(len(t.name) for t in self.terms)
        lines = [f"{'term'.ljust(w)}  {'MiB':>10}  formula"]
        for t in self.terms:
            lines.append(f"{t.name.ljust(w)}  {t.bytes / 2**20:10.2f}  {t.formula}")
        for ph, b in self.phases.items():
            lines.append(f"{('peak ' + ph).ljust(w)}  {b / 2**20:10.2f}")
        lines.append(f"{'peak'.ljust(w)}  {self.peak_bytes / 2**20:10.2f}  ({self.peak_phase})")
        return "\n".join(lines)

    __str__ = table


def _shape(cfg: Any) -> dict[str, int]:
    from torchnitro.nn.models import TransformerConfig

    if isinstance(cfg, dict):
        try:
            cfg = TransformerConfig(**cfg)
        except (TypeError, ValueError) as exc:
            raise InputError(f"model config: {exc}; expected TransformerConfig fields") from exc
    if not isinstance(cfg, TransformerConfig):
        raise InputError(f"model config: received {type(cfg).__name__}, expected TransformerConfig or a dict of its fields")
    return dict(V=cfg.vocab_size, D=cfg.dim, L=cfg.n_layers, H=cfg.n_heads, Hkv=cfg.kv_heads, Dh=cfg.head_dim,
                F=cfg.hidden_dim, S=cfg.max_seq_len, tied=int(cfg.tie_embeddings))


def _groups(policy: Any) -> tuple[str, int]:
    """Normalise a policy to (kind, n) where n is the every_<n> period."""
    if policy in (None, "none"):
        return "none", 0
    if policy in ("blocks", "selective"):
        return policy, 1
    if isinstance(policy, str) and policy.startswith("every_"):
        tail = policy[len("every_"):]
        if not tail.isdigit() or int(tail) < 1:
            raise InputError(f"checkpointing: received {policy!r}, expected every_<n> with an integer n >= 1")
        return "every_n", int(tail)
    if isinstance(policy, Budget):
        return "budget", 1
    raise InputError(f"checkpointing: received {policy!r}, expected one of 'none', 'blocks', 'every_<n>', "
                     "'selective' or memory.Budget(fraction)")


def checkpoint_indices(kind: str, n_layers: int, every: int = 1, count: int = 0) -> list[int]:
    """Which block indices a policy checkpoints (shared by the planner and ``checkpoint_``).

    blocks/selective: all; every_<n>: n-1, 2n-1, ... (torchtitan's layer-selective scheme);
    budget: ``count`` blocks spread evenly from the first.
    """
    L = n_layers
    if kind in ("blocks", "selective"):
        return list(range(L))
    if kind == "every_n":
        return [i for i in range(L) if (i + 1) % every == 0]
    if kind == "budget" and count > 0:
        return sorted({min(L - 1, int(round(j * L / count))) for j in range(count)})
    return []


def _device(device: Any) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise InputError(f"device: received {device!r}, expected 'cpu' or 'cuda' (or None for the current default)")
    return kind


@dataclass(frozen=True)
class StepShape:
    """One training step's sizes and byte widths: what every estimator below reads.

    The estimators count one model replica; a distributed planner calls them per rank with that
    rank's shard of the sizes (e.g. ``L`` layers of a pipeline stage, ``H`` heads of a TP shard).
    """

    B: int  # micro-batch size
    T: int  # sequence length
    V: int  # vocabulary size: embedding, lm_head and the logits
    D: int  # model width
    L: int  # transformer blocks
    H: int  # query heads
    Hkv: int  # key/value heads (fewer than H with GQA)
    Dh: int  # head dimension
    F: int  # SwiGLU hidden size
    S: int  # max_seq_len: the RoPE cos/sin buffers are allocated for it
    tied: int  # 1 when the embedding and lm_head share one weight
    e: int  # bytes per element of the model dtype
    c: int  # bytes of what the matmuls produce: e, or the autocast dtype's
    amp: bool  # torch.autocast over fp32 parameters (TrainStep's mixed precision)
    device: str  # "cpu" or "cuda": picks the norm and attention kernels
    attention: str  # SDPA backend that runs: flash, efficient, cudnn or math

    @property
    def BT(self) -> int:
        return self.B * self.T

    @property
    def layer_params(self) -> int:
        """Parameters of one block: q, k, v, o projections, the three SwiGLU matrices, two norms."""
        D, H, Hkv, Dh = self.D, self.H, self.Hkv, self.Dh
        return D * H * Dh + 2 * D * Hkv * Dh + H * Dh * D + 3 * D * self.F + 2 * D

    @property
    def n_params(self) -> int:
        return self.V * self.D * (2 - self.tied) + self.L * self.layer_params + self.D


def step_shape(model_config: Any, *, batch: int, seq: int, dtype: Any = "fp32", amp: str | None = None,
               attention: str = "auto", device: Any = None) -> StepShape:
    """Check the step's inputs and resolve them (the byte widths, the device, the SDPA backend)."""
    s = _shape(model_config)
    for name, v in (("batch", batch), ("seq", seq)):
        if not isinstance(v, int) or v < 1:
            raise InputError(f"{name}: received {v!r}, expected a positive integer")
    if seq > s["S"]:
        raise InputError(f"seq: received {seq}, expected <= max_seq_len={s['S']}; raise max_seq_len in the config")
    if attention not in ATTENTION_KINDS:
        raise InputError(f"attention: received {attention!r}, expected one of {ATTENTION_KINDS}")
    dev = _device(device)
    e = parse_dtype(dtype)
    c = parse_dtype(amp) if amp is not None else e
    if amp is not None and (e != 4 or c == 4):
        raise InputError(f"amp={amp!r} with dtype={dtype!r}: expected fp32 parameters (dtype='fp32') and a "
                         "16-bit autocast dtype ('bf16' or 'fp16')")
    if attention == "auto":
        attention = sdpa_backend(dev, c, n_heads=s["H"], kv_heads=s["Hkv"], head_dim=s["Dh"], seq=seq)
    return StepShape(B=batch, T=seq, **s, e=e, c=c, amp=amp is not None, device=dev, attention=attention)


# --- parameters, gradients, optimizer state -------------------------------------------------------


def parameter_terms(s: StepShape) -> list[PlanTerm]:
    """The weights and the RoPE buffers."""
    return [PlanTerm("parameters", s.n_params * s.e, f"{s.n_params:,} params x {s.e} B", "parameters"),
            PlanTerm("buffers", 2 * s.S * (s.Dh // 2) * s.e, "RoPE cos/sin: 2 x max_seq x Dh/2 x e", "parameters")]


def gradient_term(s: StepShape) -> PlanTerm:
    return PlanTerm("gradients", s.n_params * s.e, "one per parameter, model dtype", "gradients")


def optimizer_state_term(s: StepShape, optimizer: str) -> PlanTerm:
    """State tensors per parameter (Adam: two moments, plus a 4-byte step per tensor)."""
    k = _OPTIMIZER_STATE[optimizer]
    n_tensors = (2 - s.tied) + s.L * 9 + 1
    state = k * s.n_params * s.e + (4 * n_tensors if optimizer in ("adam", "adamw") else 0)
    return PlanTerm("optimizer_state", state, f"{optimizer}: {k} x params", "optimizer_state")


# --- activations ----------------------------------------------------------------------------------


def _norm_bytes(s: StepShape) -> int:
    """One RMSNorm: CUDA's fused kernel keeps its input and rstd, the decomposed one (CPU, autocast)
    the fp32 input, rsqrt, the normalised x and the output."""
    fused = s.device == "cuda" and not s.amp
    return (2 * s.e if fused else 8 + s.e) * s.BT * s.D + 4 * s.BT


def layer_terms(s: StepShape) -> list[PlanTerm]:
    """What one full (not checkpointed) block saves for backward, and its attention's share."""
    BT, c = s.BT, s.c
    attn, attn_formula = attention_bytes(s.attention, s.device, B=s.B, T=s.T, H=s.H, Hkv=s.Hkv, Dh=s.Dh, c=c)
    mlp = 4 * c * BT * s.F
    if not s.amp:
        layer = 2 * _norm_bytes(s) + attn + mlp
    else:  # fp32 x and x*rsqrt per norm; one input cast per Linear (3 attn + 2 mlp); weight casts
        amp_norms = 2 * (8 * BT * s.D + 4 * BT) + 5 * c * BT * s.D
        layer = amp_norms + attn + mlp + c * (s.layer_params - 2 * s.D) + 4 * s.T * (s.Dh // 2) * c
    fused = s.device == "cuda" and not s.amp
    return [PlanTerm("activations/layer", layer, f"2[{'2e' if fused else '(8+e)'}BTD+4BT] + attn + 4cBTF", "per-layer"),
            PlanTerm("activations/attention", attn, attn_formula, "per-layer")]


def selective_layer_bytes(s: StepShape) -> int:
    """A block under selective checkpointing: its input, the q/k/v and w1/w3 matmul outputs and the
    attention kernel's outputs (``checkpoint_``'s default policy recomputes wo and w2)."""
    BT, c, HD = s.BT, s.c, s.H * s.Dh  # q and the attention output are H x Dh wide (D unless heads are TP-split)
    sel_attn = selective_attention_bytes(s.attention, s.device, B=s.B, T=s.T, H=s.H, D=HD, c=c)
    return s.e * BT * s.D + c * (BT * HD + 2 * BT * s.Hkv * s.Dh + 2 * BT * s.F) + sel_attn


def head_bytes(s: StepShape) -> int:
    """Final norm and the fp32 log-softmax cross-entropy keeps (with autocast: fp32 norm + lm_head
    input and weight casts)."""
    BT = s.BT
    if s.amp:
        return 8 * BT * s.D + 4 * BT + s.c * BT * s.D + s.c * s.V * s.D + 4 * BT * s.V
    return _norm_bytes(s) + 4 * BT * s.V


@dataclass(frozen=True)
class Checkpointed:
    """Activation memory of the blocks under a checkpointing policy."""

    kind: str  # the policy's kind: none, blocks, every_n, selective, budget
    indices: tuple[int, ...]  # blocks that are checkpointed
    stored: int  # what all blocks hold between their forward and their backward
    recompute: int  # one checkpointed group re-run in backward
    peak: int  # worst moment of a backward that recomputes (0 without checkpointing)


def checkpointed_activations(s: StepShape, policy: Any, layer: int, head: int) -> Checkpointed:
    """Blocks kept whole, checkpointed (their input only) or selective, for a block of ``layer`` bytes."""
    kind, every = _groups(policy)
    L, boundary = s.L, s.e * s.BT * s.D  # a checkpointed block keeps its input
    count = 0
    if kind == "budget":
        allowed = policy.fraction * (L * layer + head)
        saving = layer - boundary
        count = min(L, max(0, math.ceil((L * layer + head - allowed) / saving - 1e-9))) if saving > 0 else 0
    idx = checkpoint_indices(kind, L, every, count)
    ck = set(idx)
    sel_layer = selective_layer_bytes(s)

    def kept(j: int) -> int:  # what block j holds between forward and its backward
        if kind == "selective":
            return sel_layer
        return boundary if j in ck else layer

    recompute = (layer - sel_layer if kind == "selective" else layer) if idx else 0
    # recomputing block i: blocks <= i still hold theirs, blocks > i have made their weight grads;
    # plus the head's weight grad, dx of the block output and two BTF grads in its MLP backward
    layer_grads = s.e * s.layer_params
    peak = max((sum(kept(j) for j in range(i + 1)) + recompute + layer_grads * (L - 1 - i)
                + s.e * s.V * s.D + boundary + 2 * s.c * s.BT * s.F for i in idx), default=0)
    return Checkpointed(kind, tuple(idx), sum(kept(j) for j in range(L)), recompute, peak)


# --- temporaries and peaks ------------------------------------------------------------------------


def optimizer_temporaries_term(s: StepShape, foreach: bool) -> PlanTerm:
    """The update's temporaries: 2x the largest tensor for the per-tensor loop, 1x all params for foreach."""
    largest = max(s.V * s.D, s.D * s.F, s.D * s.H * s.Dh) * s.e
    return PlanTerm("optimizer temporaries", s.n_params * s.e if foreach else 2 * largest,
                    "foreach: 1x params" if foreach else "per-tensor: 2x largest tensor", "temporaries")


def _phases(s: StepShape, terms: dict[str, PlanTerm], ckpt: Checkpointed, optimizer: str) -> dict[str, int]:
    P, logits = terms["parameters"].bytes, 4 * s.BT * s.V
    base = P + terms["buffers"].bytes + terms["optimizer_state"].bytes
    acts = ckpt.stored + terms["activations/head"].bytes
    # autocast caches weight casts until it exits: checkpointed blocks hold theirs there too
    casts = s.c * (s.layer_params - 2 * s.D) * len(ckpt.indices) if s.amp else 0
    phases = {
        "forward": base + acts + logits + casts,
        "backward": base + max(acts + 2 * logits, ckpt.peak,
                               P + (1 + s.tied) * s.e * s.V * s.D),  # end: grads + tied-embedding sum
    }
    if optimizer != "none":
        stepping = _OPTIMIZER_STATE[optimizer] or optimizer == "sgd"
        phases["optimizer"] = base + P + terms["optimizer temporaries"].bytes if stepping else base
    return phases


def plan(model_config: Any, *, batch: int, seq: int, dtype: Any = "fp32", optimizer: str = "adamw",
         checkpointing: Any = "none", attention: str = "auto", foreach: bool = False,
         amp: str | None = None, device: Any = None) -> MemoryPlan:
    """Estimate a training step's memory for a ``TransformerConfig`` (or a dict of its fields).

    ``amp="bf16"``/``"fp16"`` models ``torch.autocast`` over fp32 parameters (what ``TrainStep``
    does): matmuls in the low dtype, each Linear keeps its own cast of its input and of its weight,
    norms and the residual stream stay fp32; autocast's weight-cast cache lives until it exits.

    ``foreach`` selects the optimizer's multi-tensor path (CUDA's default); the CPU default is the
    per-tensor loop. ``device`` ('cpu', 'cuda'; None: CUDA when present) picks the norm and
    attention kernels. ``attention`` names the SDPA backend ('flash', 'efficient', 'cudnn',
    'math'); 'auto' is the one PyTorch would run (``sdpa_backend``).
    """
    if optimizer not in _OPTIMIZER_STATE:
        raise InputError(f"optimizer: received {optimizer!r}, expected one of {sorted(_OPTIMIZER_STATE)}")
    s = step_shape(model_config, batch=batch, seq=seq, dtype=dtype, amp=amp, attention=attention, device=device)
    layer, attn = layer_terms(s)
    head = PlanTerm("activations/head", head_bytes(s), "final norm + 4BTV log-softmax", "activations")
    ckpt = checkpointed_activations(s, checkpointing, layer.bytes, head.bytes)
    n_ck = len(ckpt.indices)
    terms = [
        *parameter_terms(s), gradient_term(s), optimizer_state_term(s, optimizer), layer, attn,
        PlanTerm("activations/layers", ckpt.stored, f"{s.L - n_ck} full + {n_ck} checkpointed ({ckpt.kind})",
                 "activations"),
        head,
        PlanTerm("recompute", ckpt.recompute, "one checkpointed group re-run in backward", "temporaries"),
        PlanTerm("loss temporaries", 8 * s.BT * s.V, "NLL grad + log-softmax grad: 2 x 4BTV", "temporaries"),
        optimizer_temporaries_term(s, foreach),
    ]
    phases = _phases(s, {t.name: t for t in terms}, ckpt, optimizer)
    inputs = dict(batch=s.B, seq=s.T, dtype=str(dtype), amp=amp, optimizer=optimizer, checkpointing=ckpt.kind,
                  checkpointed_layers=n_ck, attention=s.attention, foreach=foreach, device=s.device)
    return MemoryPlan(terms, phases, inputs)

"""Put gdn_fused's GatedDeltaNet into loaded Qwen3-Next / Qwen3.5 Hugging Face models.

Stock transformers runs these layers through a token-loop / chunked torch fallback when
flash-linear-attention is not installed; after :func:`swap_gated_deltanet` every
``linear_attn`` module is a :class:`gdn_fused.GatedDeltaNet` holding the same weights, called by
Hugging Face's decoder layers with Hugging Face's own cache (``cache_params=`` in transformers
5.17, ``cache=`` in newer 5.x), so ``model(...)`` and ``generate()`` run on gdn_fused's ops.

Weight layouts (transformers ``modeling_qwen3_next.py`` / ``modeling_qwen3_5.py``):

- Qwen3-Next ``in_proj_qkvz [H·(2K + 2G·V), d]`` is grouped per q/k head h: rows
  ``q_h [K], k_h [K], v_h [G·V], z_h [G·V]``; ``in_proj_ba [H·2G, d]`` per h:
  ``b_h [G], a_h [G]`` (``fix_query_key_value_ordering``), G = HV // H. Value head ``h·G + i``
  is block i of v_h.
- Qwen3.5 ``in_proj_qkv [2HK + HV·V, d]`` = [q | k | v], ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a`` separately.

Both become our fused ``in_proj`` (rows q, k, v, z, b, a; a new tensor). ``conv1d.weight``
(channels [q | k | v] in both), ``A_log``, ``dt_bias``, ``norm.weight`` and ``out_proj.weight``
are re-used as the same Parameter objects. A swapped model's own state dict names our fused
``in_proj`` (what training tools, optimizers, EMA and distributed checkpoints see);
:func:`hf_state_dict` gives the one in Hugging Face's layout, for
``model.save_pretrained(path, state_dict=hf_state_dict(model))``.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os

import torch
from torch import nn

from gdn_fused.layer import GatedDeltaNet

logger = logging.getLogger("gdn_fused")

# transformers class names of the layers we replace, by input-projection layout
QWEN3_NEXT_CLASSES = ("Qwen3NextGatedDeltaNet",)
QWEN3_5_CLASSES = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")


def _dims(module) -> tuple[int, int, int, int]:
    """(H, HV, K, V) of a Hugging Face GatedDeltaNet module or of ours."""
    if isinstance(module, GatedDeltaNet):
        return module.num_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    return module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim


# Each layout: the names of its input projections' weights, and the two directions between
# them and our fused in_proj weight (rows q, k, v, z, b, a).
def _qwen3_next_to_ours(dims, qkvz, ba) -> torch.Tensor:
    """De-interleave ``in_proj_qkvz`` / ``in_proj_ba`` into our row layout q, k, v, z, b, a."""
    H, HV, K, V = dims
    G, d = HV // H, qkvz.shape[1]
    q, k, v, z = qkvz.view(H, 2 * K + 2 * G * V, d).split([K, K, G * V, G * V], dim=1)
    b, a = ba.view(H, 2 * G, d).split([G, G], dim=1)
    return torch.cat([t.reshape(-1, d) for t in (q, k, v, z, b, a)], dim=0)


def _qwen3_next_to_hf(dims, weight) -> tuple[torch.Tensor, torch.Tensor]:
    H, HV, K, V = dims
    G, d = HV // H, weight.shape[1]
    q, k, v, z, b, a = weight.split([H * K, H * K, HV * V, HV * V, HV, HV], dim=0)
    qkvz = torch.cat([q.view(H, K, d), k.view(H, K, d), v.view(H, G * V, d),
                      z.view(H, G * V, d)], dim=1)
    return qkvz.reshape(-1, d), torch.cat([b.view(H, G, d), a.view(H, G, d)], dim=1).reshape(-1, d)


def _qwen3_5_to_ours(dims, qkv, z, b, a) -> torch.Tensor:
    return torch.cat([qkv, z, b, a], dim=0)


def _qwen3_5_to_hf(dims, weight) -> tuple[torch.Tensor, ...]:
    H, HV, K, V = dims
    return weight.split([2 * H * K + HV * V, HV * V, HV, HV], dim=0)


LAYOUTS = {  # class names → (projection names, to ours, to HF)
    QWEN3_NEXT_CLASSES: (("in_proj_qkvz", "in_proj_ba"), _qwen3_next_to_ours, _qwen3_next_to_hf),
    QWEN3_5_CLASSES: (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), _qwen3_5_to_ours,
                      _qwen3_5_to_hf),
}


def _layout(module) -> tuple:
    name = type(module).__name__
    for classes, layout in LAYOUTS.items():
        if name in classes:
            return layout
    raise TypeError(f"module must be one of {QWEN3_NEXT_CLASSES + QWEN3_5_CLASSES}, got {name}")


def gated_deltanet_from_hf(module: nn.Module, backend: str = "auto", chunk_size: int = 64,
                           solve_method: str = "blocked",
                           solve_iters: int | None = None) -> GatedDeltaNet:
    """Our :class:`GatedDeltaNet` with the weights of one Hugging Face GatedDeltaNet module.

    Args:
        module: a transformers ``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet`` or
            ``Qwen3_5MoeGatedDeltaNet`` with materialised (not offloaded) weights.
        backend, chunk_size, solve_method, solve_iters: as in :class:`GatedDeltaNet`.

    Returns:
        A module on the same device, in the same dtype and train/eval mode, sharing the conv,
        decay, norm and output weights with ``module`` (the fused input projection is a copy).

    Raises:
        TypeError for another class; ValueError for weights on the meta device (offloaded),
        projection biases, or an activation other than SiLU.
    """
    names, to_ours, to_hf = _check_hf_module(module)
    with torch.device("meta"):  # no throw-away allocation and init of the new weights
        ours = GatedDeltaNet(
            module.hidden_size, module.num_k_heads, module.num_v_heads,
            head_k_dim=module.head_k_dim, head_v_dim=module.head_v_dim,
            conv_size=module.conv_kernel_size, norm_eps=module.layer_norm_epsilon,
            layer_idx=module.layer_idx, backend=backend, chunk_size=chunk_size,
            solve_method=solve_method, solve_iters=solve_iters)
    ref = module.out_proj.weight
    projections = (getattr(module, name).weight for name in names)
    ours.in_proj.weight = nn.Parameter(to_ours(_dims(module), *projections).detach(),
                                       requires_grad=ref.requires_grad)
    ours.conv1d.weight = module.conv1d.weight
    ours.A_log = module.A_log
    ours.dt_bias = module.dt_bias
    ours.norm.weight = module.norm.weight
    ours.out_proj.weight = module.out_proj.weight
    ours.train(module.training)
    ours.hf_layout = names, to_hf  # hf_state_dict's way back to the projections it came from
    return ours


def _check_hf_module(module: nn.Module) -> tuple:
    """Raise what :func:`gated_deltanet_from_hf` raises for ``module`` without building
    anything; return its layout (projection names, to ours, to HF)."""
    names, to_ours, to_hf = _layout(module)
    name = type(module).__name__
    projections = tuple(getattr(module, n) for n in names)
    if any(p.is_meta for p in module.parameters()):
        raise ValueError(f"{name} (layer {module.layer_idx}) has weights on the meta device "
                         "(offloaded?); load the model onto real devices before swapping")
    if any(lin.bias is not None for lin in projections + (module.out_proj,)) \
            or module.conv1d.bias is not None:
        raise ValueError(f"{name} (layer {module.layer_idx}) has projection or conv biases, "
                         "which GatedDeltaNet does not model")
    if module.activation not in ("silu", "swish"):
        raise ValueError(f"{name} (layer {module.layer_idx}) uses activation "
                         f"{module.activation!r}; GatedDeltaNet implements SiLU only")
    return names, to_ours, to_hf


def swap_gated_deltanet(model: nn.Module, backend: str = "auto", chunk_size: int = 64,
                        solve_method: str = "blocked", solve_iters: int | None = None) -> int:
    """Replace every Qwen3-Next / Qwen3.5 GatedDeltaNet module of ``model`` by ours, in place.

    Args:
        model: any ``nn.Module`` (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``,
            ``Qwen3_5ForConditionalGeneration``, …) loaded on real devices.
        backend: chunk op backend for prefill, "auto" | "torch" | "materialized" | "fused".
        chunk_size: 16, 32 or 64.
        solve_method, solve_iters: kkt_solve inverse method and iterations for the chunk op.

    Returns:
        The number of modules replaced (0 when there are none, e.g. on a second call).

    Raises:
        ValueError from :func:`gated_deltanet_from_hf` (offloaded weights, biases, activation)
        or from :class:`GatedDeltaNet` (bad backend, chunk_size, …), before anything is replaced.
    """
    targets = [(parent, child_name)
               for parent in model.modules()
               for child_name, child in parent.named_children()
               if type(child).__name__ in QWEN3_NEXT_CLASSES + QWEN3_5_CLASSES]
    # Everything that can raise runs before the first replacement: each module's checks, and
    # one build (the options are the same for every module). Then one module at a time, so the
    # fused input projection is copied once per layer and the original is freed as it is
    # replaced: building all first held every layer's copy at once (~1.8 GB for the 80B).
    for parent, child_name in targets:
        _check_hf_module(getattr(parent, child_name))
    pending = None
    if targets:
        parent, child_name = targets[0]
        pending = gated_deltanet_from_hf(getattr(parent, child_name), backend, chunk_size,
                                         solve_method, solve_iters)
    for i, (parent, child_name) in enumerate(targets):
        ours = pending if i == 0 else gated_deltanet_from_hf(
            getattr(parent, child_name), backend, chunk_size, solve_method, solve_iters)
        pending = None
        setattr(parent, child_name, ours)
    logger.debug("gdn_fused: swapped %d GatedDeltaNet modules (backend=%s, chunk_size=%d, "
                 "solve_method=%s)", len(targets), backend, chunk_size, solve_method)
    return len(targets)


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each swapped layer's fused ``in_proj.weight`` given back as the
    Hugging Face projections it came from (``in_proj_qkvz`` / ``in_proj_ba``, or
    ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; new tensors), so that

        model.save_pretrained(path, state_dict=hf_state_dict(model))

    writes a checkpoint transformers (and :func:`load_swapped`) loads as its own. A plain
    ``save_pretrained`` of a swapped model saves ``in_proj.weight``, which transformers drops,
    initialising the projections at random. The model's own ``state_dict()`` keeps our layout
    on purpose: optimizers, EMA copies, wrappers of ``in_proj`` and distributed checkpoints
    work on its parameters as they are."""
    state = model.state_dict()
    for prefix, module in model.named_modules():
        layout = getattr(module, "hf_layout", None)
        base = f"{prefix}." if prefix else ""
        if layout is None or base + "in_proj.weight" not in state:
            continue
        names, to_hf = layout
        for name, part in zip(names, to_hf(_dims(module), state.pop(base + "in_proj.weight"))):
            state[base + name + ".weight"] = part.contiguous()
    return state


def _saved_in_our_layout(path: str | os.PathLike) -> bool:
    """Whether the safetensors checkpoint at ``path`` holds a swapped layer's fused
    ``in_proj.weight`` (saved by ``save_pretrained`` without :func:`hf_state_dict`)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            keys = json.load(f).get("weight_map", {})
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        from safetensors import safe_open
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            keys = list(f.keys())
    else:
        return False
    return any(k.endswith("linear_attn.in_proj.weight") for k in keys)


def load_swapped(path: str | os.PathLike, backend: str = "auto", dtype=torch.bfloat16,
                 device=None, chunk_size: int = 64, solve_method: str = "blocked",
                 solve_iters: int | None = None, **from_pretrained_kwargs) -> nn.Module:
    """Load a local Qwen3-Next / Qwen3.5 checkpoint with ``AutoModelForCausalLM`` and swap.

    Args:
        path: a local checkpoint directory (config.json + safetensors); nothing is downloaded.
        backend, chunk_size, solve_method, solve_iters: as in :func:`swap_gated_deltanet`.
        dtype: parameter dtype, default bf16.
        device: passed as ``device_map`` (e.g. "cuda", "cuda:1", "auto" to spread over GPUs,
            "cpu"; without accelerate installed a single device is reached by loading on CPU
            and moving); None loads on CPU.
        **from_pretrained_kwargs: passed on to ``from_pretrained``.

    Returns:
        The model in eval mode with its GatedDeltaNet modules swapped.

    Raises:
        ValueError when ``path`` is not a directory, holds a checkpoint saved from a swapped
        model without :func:`hf_state_dict`, or the model has no GatedDeltaNet module.
    """
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise ValueError(f"path must be a local checkpoint directory, got {str(path)!r}")
    if _saved_in_our_layout(path):
        raise ValueError(f"{str(path)!r} was saved from a swapped model in gdn_fused's layout "
                         "(linear_attn.in_proj.weight), which transformers cannot load: save "
                         "with model.save_pretrained(path, state_dict=gdn_fused.models."
                         "hf_state_dict(model))")
    move_to = None
    if device is not None:
        if importlib.util.find_spec("accelerate") is not None or device == "auto" \
                or isinstance(device, dict):
            from_pretrained_kwargs["device_map"] = device
        else:
            # device_map needs accelerate; one device can be reached by loading then moving
            move_to = device
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                 **from_pretrained_kwargs)
    if move_to is not None:
        model.to(move_to)
    swapped = swap_gated_deltanet(model, backend=backend, chunk_size=chunk_size,
                                  solve_method=solve_method, solve_iters=solve_iters)
    if swapped == 0:
        raise ValueError(f"{str(path)!r} loads as {type(model).__name__}, which has no "
                         "Qwen3-Next / Qwen3.5 GatedDeltaNet module to swap")
    return model.eval()

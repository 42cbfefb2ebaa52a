"""Prefill and decode speed of a Qwen3-Next-80B-A3B-shaped stack: our swapped GatedDeltaNet
layers vs transformers' torch fallback (what stock transformers runs without fla).

    python -m eval.bench_layer [--prefill 8192] [--decode-steps 64] [--layers 3]
                               [--backend auto] [--dtype bf16] [--device cuda]

The model is a ``Qwen3NextForCausalLM`` of ``--layers`` Gated DeltaNet decoder layers with
Qwen3-Next-80B-A3B's shapes (hidden 2048, 16 q/k heads, 32 value heads, head dims 128, conv 4,
vocabulary 151936) followed by one of its gated full-attention layers (16 heads, 2 KV heads, head
dim 256: the 80B's repeating block is 3 + 1, and transformers' cache needs an attention layer to
count positions), a dense MLP (intermediate 5120) in place of the MoE block (not what is timed,
and the same in both paths), and random weights at trained-model scale (:func:`randomize_stack`).
Both paths run the same weights: the fallback first, then the same model after
:func:`gdn_fused.models.swap_gated_deltanet`.

Timing (CUDA-synchronised wall clock, median over ``--reps`` after one warm-up):

- prefill: one forward of B=1 × ``--prefill`` tokens with a fresh cache, ``logits_to_keep=1``;
- decode: per-token time of ``--decode-steps`` single-token forwards of fixed random tokens
  continuing from that prefill's cache (HF's ``DynamicCache``, as ``generate()`` uses it).

- one GDN layer: the first Gated DeltaNet layer alone on a random ``[1, --prefill, 2048]`` input.

Prints a table (ms, tokens/s, speed-up) and the relative logit difference of the two paths on the
last prefill position and the last decode step, as a sanity check of what was timed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gdn_fused.layer import A_INIT_RANGE, DT_INIT_FLOOR, DT_INIT_RANGE
from gdn_fused.models.hf_calls import cache_kwarg, output_cache

from .bench import rel_diff
from .cli import positive_int

# Qwen3-Next-80B-A3B (config.json of Qwen/Qwen3-Next-80B-A3B-Instruct)
HIDDEN, QK_HEADS, V_HEADS, HEAD_DIM, CONV, VOCAB = 2048, 16, 32, 128, 4, 151936
ATTN_HEADS, KV_HEADS, ATTN_HEAD_DIM = 16, 2, 256
DENSE_MLP = 5120
# Pre-norm blocks add updates smaller than the residual stream they read; with unit-scale
# updates one random layer would replace the stream, and each layer's bf16 noise (~7e-3
# relative, in HF's fallback and ours alike) would reach the logits undamped.
RESIDUAL_UPDATE_SCALE = 0.3


def qwen3_next_stack(num_layers: int = 3, vocab_size: int = VOCAB, dtype=torch.bfloat16,
                     device="cuda", seed: int = 0):
    """A random-weight ``Qwen3NextForCausalLM``: ``num_layers`` Gated DeltaNet layers of
    Qwen3-Next-80B-A3B's shapes, then one full-attention layer; eval mode, on ``device`` in
    ``dtype``.

    Built and drawn on ``device`` itself from ``torch.manual_seed(seed)``: the same seed gives
    the same weights on the same kind of device (CPU and CUDA generators differ). Drawn on the
    CPU and moved, its 780 M parameters took ~30 s per build (three single-threaded fills: the
    torch and HF inits at construction, then :func:`randomize_stack`); on a GPU it takes
    milliseconds."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=num_layers + 1,
        layer_types=["linear_attention"] * num_layers + ["full_attention"],
        linear_num_key_heads=QK_HEADS,
        linear_num_value_heads=V_HEADS, linear_key_head_dim=HEAD_DIM,
        linear_value_head_dim=HEAD_DIM, linear_conv_kernel_dim=CONV, num_experts=0,
        intermediate_size=DENSE_MLP, num_attention_heads=ATTN_HEADS,
        num_key_value_heads=KV_HEADS, head_dim=ATTN_HEAD_DIM)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3NextForCausalLM(config)
    randomize_stack(model)
    return model.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def randomize_stack(model) -> None:
    """Weights at the scale of a trained model rather than HF's N(0, 0.02) init (whose tiny
    embeddings let the first layer replace the residual stream):

    embeddings N(0, 1); matrices (projections, lm_head, conv kernels) N(0, 1/fan_in), so every
    activation is O(1); the residual-writing projections (GDN ``out_proj``, attention
    ``o_proj``, MLP ``down_proj``) further scaled by RESIDUAL_UPDATE_SCALE; RMSNorm weights
    N(0, 0.1) (Qwen3-Next norms scale by 1 + w), gated-norm weights N(1, 0.1);
    A = exp(A_log) ~ U[A_INIT_RANGE], dt_bias = softplus⁻¹(dt), dt ~ logU[DT_INIT_RANGE]
    (our layer's Mamba-2 initialisation: long memories, the demanding case for the state)."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p).uniform_(*A_INIT_RANGE).log())
        elif name.endswith("dt_bias"):
            lo, hi = torch.tensor(DT_INIT_RANGE).log().tolist()
            dt = torch.empty_like(p).uniform_(lo, hi).exp().clamp(min=DT_INIT_FLOOR)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0)
        elif p.dim() >= 2:
            residual_write = name.endswith(("out_proj.weight", "o_proj.weight",
                                            "down_proj.weight"))
            std = p.shape[-1] ** -0.5 * (RESIDUAL_UPDATE_SCALE if residual_write else 1.0)
            p.normal_(0.0, std)
        elif name.endswith("linear_attn.norm.weight"):
            p.normal_(1.0, 0.1)
        else:
            p.normal_(0.0, 0.1)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device, fn, *args, **kwargs):
    """(seconds, fn(*args, **kwargs)), synchronised with the device before and after."""
    _sync(device)
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    _sync(device)
    return time.perf_counter() - start, out


@torch.no_grad()
def measure(model, ids, decode_ids, reps: int, device) -> dict:
    """Time a prefill of ``ids [1, T]``, single-token steps over ``decode_ids [1, S]``, and the
    first Gated DeltaNet layer alone on a ``[1, T, hidden]`` input (no cache).

    Returns seconds ("prefill", "decode" per token, "layer") and the last prefill and decode
    logits ("prefill_logits", "decode_logits"); the decode tokens are fixed (not sampled) so
    both paths see the same inputs."""
    def prefill():
        return model(ids, use_cache=True, logits_to_keep=1)

    prefill()  # warm-up: kernel compilation, allocator
    runs = [_timed(device, prefill) for _ in range(reps)]
    step_times = []
    for _ in range(reps):
        cache = output_cache(prefill())
        for s in range(decode_ids.shape[1]):
            dt, out = _timed(device, model, decode_ids[:, s:s + 1], use_cache=True,
                             **{cache_kwarg(model): cache})
            step_times.append(dt)
    layer = model.model.layers[0].linear_attn
    x = torch.randn(1, ids.shape[1], model.config.hidden_size, device=device,
                    dtype=model.dtype)
    layer(x)
    layer_times = [_timed(device, layer, x)[0] for _ in range(reps)]
    return {"prefill": statistics.median(t for t, _ in runs),
            "decode": statistics.median(step_times),
            "layer": statistics.median(layer_times),
            "prefill_logits": runs[-1][1].logits[:, -1], "decode_logits": out.logits[:, -1]}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m eval.bench_layer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=positive_int, default=8192, help="prompt tokens (B = 1)")
    parser.add_argument("--decode-steps", type=positive_int, default=64)
    parser.add_argument("--layers", type=positive_int, default=3)
    parser.add_argument("--reps", type=positive_int, default=3)
    parser.add_argument("--backend", default="auto",
                        choices=["auto", "torch", "materialized", "fused"])
    parser.add_argument("--chunk-size", type=int, default=64, choices=(16, 32, 64))
    parser.add_argument("--solve-method", default="blocked",
                        help="the swapped layers' inverse method (as --solve-method of "
                             "python -m eval.mmlu, one value)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--device", default="cuda",
                        help="default cuda; cpu runs the ~780 M-parameter stack on the CPU")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        parser.error(f"--device: {e}")
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --device cpu)")
    from gdn_fused.layer import check_chunk_options

    from .mmlu_models import parse_solve_method
    try:
        solve_method, solve_iters = parse_solve_method(args.solve_method)
        check_chunk_options(args.backend, args.chunk_size, solve_method, solve_iters)
    except ValueError as e:
        parser.error(f"--solve-method: {e}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    from gdn_fused.validation import check_device_for_backend
    try:
        # before the HF fallback's minutes of timing, not after them
        check_device_for_backend(args.backend, device, dtype)
    except (ValueError, TypeError) as e:
        parser.error(f"--backend {args.backend} on {args.device} in {args.dtype}: {e}")

    from gdn_fused.models import swap_gated_deltanet

    model = qwen3_next_stack(args.layers, dtype=dtype, device=args.device)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, args.prefill + args.decode_steps), device=args.device)
    ids, decode_ids = ids[:, :args.prefill], ids[:, args.prefill:]
    results = {"HF torch fallback": measure(model, ids, decode_ids, args.reps, args.device)}
    swap_gated_deltanet(model, backend=args.backend, chunk_size=args.chunk_size,
                        solve_method=solve_method, solve_iters=solve_iters)
    results[f"gdn_fused ({args.backend})"] = measure(model, ids, decode_ids, args.reps,
                                                     args.device)

    name = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "CPU"
    print(f"\n{args.layers} Gated DeltaNet layers + 1 attention layer of Qwen3-Next-80B-A3B "
          f"shape, {args.dtype}, "
          f"{name}; prefill B=1 T={args.prefill}, decode {args.decode_steps} steps after it\n")
    print("| path | prefill ms | prefill tok/s | decode ms/token | decode tok/s | "
          "one GDN layer, prefill ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for path, r in results.items():
        print(f"| {path} | {r['prefill'] * 1e3:.2f} | {args.prefill / r['prefill']:,.0f} | "
              f"{r['decode'] * 1e3:.3f} | {1 / r['decode']:,.0f} | {r['layer'] * 1e3:.2f} |")
    hf, ours = results.values()
    print(f"| speed-up | {hf['prefill'] / ours['prefill']:.2f}x | | "
          f"{hf['decode'] / ours['decode']:.2f}x | | {hf['layer'] / ours['layer']:.2f}x |")
    print("\nrelative logit difference ours vs fallback: last prefill position "
          f"{rel_diff(ours['prefill_logits'], hf['prefill_logits']):.2e}, last decode step "
          f"{rel_diff(ours['decode_logits'], hf['decode_logits']):.2e}")

if __name__ == "__main__":
    main()

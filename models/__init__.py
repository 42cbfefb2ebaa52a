"""Hugging Face integration (installed as ``gdn_fused.models``): the Qwen3-Next / Qwen3.5 swap.

    from gdn_fused.models import swap_gated_deltanet, load_swapped, hf_state_dict
"""
from gdn_fused.models.swap import (gated_deltanet_from_hf, hf_state_dict, load_swapped,
                                   swap_gated_deltanet)

__all__ = ["gated_deltanet_from_hf", "hf_state_dict", "load_swapped", "swap_gated_deltanet"]

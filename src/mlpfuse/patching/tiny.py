"""Small copies of transformers configs: the same model type and layer pattern at a width a CPU builds in moments.

`mlpfuse patch --dry-run` verifies a model's MLP blocks on such a copy (the real widths only decide shapes, which
the meta-device model gives), and the family sweep in the tests builds every installed model type from its config
class's defaults shrunk so. Works on the config's dict form, sub-configs included (text_config, vision_config, ...),
by key name: a config this cannot shrink into one that builds is reported by whoever builds it.
"""

from __future__ import annotations

WIDTH, FFN, HEADS, HEAD_DIM, VOCAB, POSITIONS, EXPERTS = 32, 64, 4, 8, 256, 128, 4

_WIDTHS = ("hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "word_embed_proj_dim", "embedding_size",
           "text_hidden_size", "encoder_hidden_size", "decoder_hidden_size", "projection_dim", "out_hidden_size",
           "projector_hidden_size", "output_hidden_size")
_FFNS = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner", "mlp_dim",
         "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_intermediate_size", "ffn_hidden_size")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
          "swa_num_attention_heads", "linear_num_value_heads")
_SMALL = {"head_dim": HEAD_DIM, "d_kv": HEAD_DIM, "v_head_dim": HEAD_DIM, "qk_nope_head_dim": HEAD_DIM,
          "qk_rope_head_dim": HEAD_DIM, "qk_head_dim": 2 * HEAD_DIM, "kv_lora_rank": 16, "q_lora_rank": 16,
          "index_head_dim": HEAD_DIM, "index_n_heads": 2, "n_groups": 1, "rotary_dim": HEAD_DIM, "vocab_size_per_layer_input": VOCAB,
          "hidden_size_per_layer_input": HEAD_DIM, "swa_head_dim": HEAD_DIM, "linear_key_head_dim": HEAD_DIM,
          "linear_value_head_dim": HEAD_DIM, "linear_num_key_heads": 2, "vocab_size": VOCAB,
          "max_position_embeddings": POSITIONS, "n_positions": POSITIONS, "max_source_positions": POSITIONS,
          "max_target_positions": POSITIONS, "num_experts": EXPERTS, "num_local_experts": EXPERTS,
          "n_routed_experts": EXPERTS, "image_size": 32, "patch_size": 8, "n_group": 1, "topk_group": 1,
          # state-space layers: heads × head size = the (expanded) width, a short chunk and state
          "mamba_d_ssm": 2 * WIDTH, "mamba_n_heads": 2 * WIDTH // HEAD_DIM, "mamba_d_head": HEAD_DIM,
          "mamba_num_heads": 2 * WIDTH // HEAD_DIM, "mamba_head_dim": HEAD_DIM, "mamba_d_state": 8,
          "ssm_state_size": 8, "state_size": 8, "mamba_chunk_size": 8, "chunk_size": 8}
_TOP_K = ("num_experts_per_tok", "top_k", "moe_topk", "num_selected_experts")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "num_decoder_layers")


def _size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def shrink(config: dict, *, layers: int | None = None) -> dict:
    """A copy of a config dict at small widths: hidden 32, feed-forward 64, 4 heads of 8, vocab 256, 4 experts.
    `layers` sets every layer count (and cuts per-layer lists to it); None keeps the model's layer pattern."""
    out = dict(config)
    depth = next((out[k] for k in _LAYERS if _size(out.get(k))), None)
    heads = next((out[k] for k in _HEADS if _size(out.get(k))), None)
    for key, value in config.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = shrink(value, layers=layers)
        elif key in _WIDTHS and _size(value):
            out[key] = WIDTH
        elif key in _FFNS and isinstance(value, list) and value and all(map(_size, value)):
            out[key] = [FFN] * (min(len(value), layers) if layers is not None and len(value) == depth else len(value))
        elif key in _FFNS and _size(value):
            out[key] = FFN
        elif key in _HEADS and _size(value):
            out[key] = HEADS
        elif key == "num_key_value_heads" and (_size(value) or value is None and heads):
            out[key] = HEADS if heads is None or value is None or value >= heads else 2  # keep GQA grouped
        elif key in ("image_size", "attention_window") and isinstance(value, list) and all(map(_size, value)):
            out[key] = [32 if key == "image_size" else 8] * len(value)  # [height, width]; Longformer's per layer
        elif key == "attention_window" and _size(value):
            out[key] = 8
        elif key in _SMALL and _size(value):
            out[key] = min(value, _SMALL[key]) if key in ("n_group", "topk_group", "n_groups") else _SMALL[key]
        elif key in _TOP_K and _size(value):
            out[key] = min(value, 2)
        elif layers is not None and key == "num_kv_shared_layers" and _size(value):
            out[key] = 0  # Gemma-3n's last layers reuse earlier layers' caches: none to reuse in a short stack
        elif layers is not None and key in _LAYERS and _size(value):
            out[key] = layers
        elif layers is not None and isinstance(value, list) and depth and len(value) == depth > layers:
            out[key] = value[:layers]  # per-layer settings (layer_types, per-layer sizes)
    _token_ids_in_vocab(out)
    return out


def _token_ids_in_vocab(config: dict) -> None:
    """Special token ids past the small vocab move to its top (distinct ids stay distinct): transformers warns about
    ids outside the vocabulary, and embedding lookups of them would fail."""
    vocab = config.get("vocab_size")
    if not _size(vocab) or vocab != VOCAB:
        return
    moved: dict[int, int] = {}

    def inside(v):
        if _size(v) and v >= vocab:
            moved.setdefault(v, vocab - 1 - len(moved) % (vocab // 2))
            return moved[v]
        return v

    for key, value in list(config.items()):
        if key.endswith(("token_id", "token_index", "token_ids")):
            config[key] = [inside(v) for v in value] if isinstance(value, list) else inside(value)

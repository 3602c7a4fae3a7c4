"""Tiny transformers models of every family mlpfuse.patch knows, built from configs in code (random init, nothing
downloaded). Each entry: a builder, the MLP class it holds, how many, and how to feed it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

VOCAB = 96


@dataclass(frozen=True)
class Tiny:
    name: str
    build: Callable[[], torch.nn.Module]
    mlp_class: str
    mlps: int
    kind: str = "causal"  # causal | masked | seq2seq
    layer: tuple[str, ...] = ()  # the classes patch swaps in each layer, in module order, where more than the MLP

    @property
    def swaps(self) -> list[str]:
        """The source classes of every block patch swaps (eval mode), in report order."""
        return list(self.layer or (self.mlp_class,)) * self.mlps


def _llama_like(config_cls, model_cls, **extra):
    def build():
        cfg = config_cls(hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, **extra)
        return model_cls(cfg)
    return build


def _t5(gated: bool):
    def build():
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=72, num_layers=2, num_decoder_layers=2,
                       num_heads=4, feed_forward_proj="gated-gelu" if gated else "relu", decoder_start_token_id=0)
        return T5ForConditionalGeneration(cfg)
    return build


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _bert(roberta: bool):
    def build():
        import transformers as tf

        cfg_cls, model_cls = (tf.RobertaConfig, tf.RobertaForMaskedLM) if roberta else (tf.BertConfig,
                                                                                          tf.BertForMaskedLM)
        cfg = cfg_cls(hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=VOCAB, max_position_embeddings=80, pad_token_id=1)
        return model_cls(cfg)
    return build


def _falcon_h1():
    from transformers import FalconH1Config, FalconH1ForCausalLM

    cfg = FalconH1Config(hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
                         mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8,
                         mlp_multipliers=[0.75, 1.5])
    return FalconH1ForCausalLM(cfg)


def _tf(name):
    import transformers

    return getattr(transformers, name)


FAMILIES = {
    "llama": Tiny("llama", lambda: _llama_like(_tf("LlamaConfig"), _tf("LlamaForCausalLM"))(), "LlamaMLP", 2),
    "mistral": Tiny("mistral", lambda: _llama_like(_tf("MistralConfig"), _tf("MistralForCausalLM"))(),
                    "MistralMLP", 2),
    "qwen2": Tiny("qwen2", lambda: _llama_like(_tf("Qwen2Config"), _tf("Qwen2ForCausalLM"))(), "Qwen2MLP", 2),
    "qwen3": Tiny("qwen3", lambda: _llama_like(_tf("Qwen3Config"), _tf("Qwen3ForCausalLM"), head_dim=8)(),
                  "Qwen3MLP", 2),
    "gemma": Tiny("gemma", lambda: _llama_like(_tf("GemmaConfig"), _tf("GemmaForCausalLM"), head_dim=8)(),
                  "GemmaMLP", 2),
    "gemma2": Tiny("gemma2", lambda: _llama_like(_tf("Gemma2Config"), _tf("Gemma2ForCausalLM"), head_dim=8,
                                                 sliding_window=16)(), "Gemma2MLP", 2),
    "gemma3": Tiny("gemma3", lambda: _llama_like(_tf("Gemma3TextConfig"), _tf("Gemma3ForCausalLM"), head_dim=8,
                                                 sliding_window=16)(), "Gemma3MLP", 2),
    "phi3": Tiny("phi3", lambda: _llama_like(_tf("Phi3Config"), _tf("Phi3ForCausalLM"), pad_token_id=0)(),
                 "Phi3MLP", 2),
    "falcon_h1": Tiny("falcon_h1", _falcon_h1, "FalconH1MLP", 2),
    "gpt2": Tiny("gpt2", _gpt2, "GPT2MLP", 2),
    "bert": Tiny("bert", lambda: _bert(False)(), "BertIntermediate", 2, "masked",
                 ("BertSelfOutput", "BertIntermediate", "BertOutput")),
    "roberta": Tiny("roberta", lambda: _bert(True)(), "RobertaIntermediate", 2, "masked",
                    ("RobertaSelfOutput", "RobertaIntermediate", "RobertaOutput")),
    "t5_gated": Tiny("t5_gated", lambda: _t5(True)(), "T5DenseGatedActDense", 4, "seq2seq"),
    "t5": Tiny("t5", lambda: _t5(False)(), "T5DenseActDense", 4, "seq2seq"),
}


def build(name: str, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = FAMILIES[name].build().to(dtype)
    return model


def inputs(name: str, batch: int = 2, seq: int = 7, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, seq), generator=g)
    if FAMILIES[name].kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(2, VOCAB, (batch, 5), generator=g)}
    return {"input_ids": ids}


def labels_for(name: str, batch_inputs: dict) -> torch.Tensor:
    if FAMILIES[name].kind == "seq2seq":
        return batch_inputs["decoder_input_ids"]
    return batch_inputs["input_ids"]


def tiny_decoder(family: str, device, perturb_norms: bool = False) -> torch.nn.Module:
    """A 2-layer causal LM of `family` (32 wide, 72 hidden units, 4 heads, 2 KV heads), eval mode, on `device`;
    `perturb_norms`: every 1-D parameter drawn away from its init (ones, or zeros for Gemma), so that a norm a patch
    skipped or applied twice shows in the logits."""
    import transformers as T

    cfgs = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 8}),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, {}),
        "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {"pad_token_id": 0}),
        "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, {"head_dim": 8}),
        "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}),
    }
    config_cls, model_cls, extra = cfgs[family]
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=64, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, **extra)
    model = model_cls(cfg).eval()
    if perturb_norms:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.normal_(0.0 if family == "gemma2" else 1.0, 0.3)
    return model.to(device)


def prefill_and_step(model, ids):
    """(logits of a prefill over ids, logits of one decode step for the last id from a cache of the others)."""
    with torch.no_grad():
        prefill = model(ids).logits
        cache = model(ids[:, :-1], use_cache=True).past_key_values
        step = model(ids[:, -1:], past_key_values=cache).logits
    return prefill, step

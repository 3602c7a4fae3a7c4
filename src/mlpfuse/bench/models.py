"""The model lab's models: built-in transformers configs at the published sizes (random init, nothing downloaded), a
`tiny` form of each for CPU runs and tests, or a local model folder (its config.json, and its weights when present).

Dropout is switched off in every config the lab builds: each variant then computes one deterministic function of the
weights, which the logits check against an fp32 run of the same model needs, and dropout costs every variant the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
import torch

from mlpfuse.errors import InputError
from mlpfuse.patching import folder as model_folder
from mlpfuse.patching.verify import one_line

CAUSAL, MASKED = "causal", "masked"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    about: str
    config: str  # transformers config class
    model: str  # transformers model class
    kind: str  # CAUSAL | MASKED
    full: dict  # the published sizes
    tiny: dict  # overrides for CPU runs and tests
    tokens: tuple[str, ...] = ("1x128",)  # default batch x sequence shapes
    layers_key: str = "num_hidden_layers"
    extra: dict = field(default_factory=dict)


_TINY_DECODER = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 512, "num_hidden_layers": 2}

MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            "llama3-8b", "Llama-3-8B shape: 4096 x 14336 SwiGLU, 32 layers, GQA 32/8, vocab 128256",
            "LlamaConfig", "LlamaForCausalLM", CAUSAL,
            {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
             "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
             "bos_token_id": 128000, "eos_token_id": 128001},
            _TINY_DECODER | {"bos_token_id": 1, "eos_token_id": 2},
            tokens=("1x8192",),
        ),
        ModelSpec(
            "gemma2-2b", "Gemma-2-2B shape: 2304 x 9216 GeGLU (tanh), 26 layers, head_dim 256, vocab 256000",
            "Gemma2Config", "Gemma2ForCausalLM", CAUSAL,
            {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "sliding_window": 4096,
             "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
            _TINY_DECODER | {"sliding_window": 64, "query_pre_attn_scalar": 16},
            tokens=("1x128", "8x128"),
        ),
        ModelSpec(
            "qwen3-4b", "Qwen3-4B shape: 2560 x 9728 SwiGLU, 36 layers, GQA 32/8, head_dim 128, vocab 151936",
            "Qwen3Config", "Qwen3ForCausalLM", CAUSAL,
            {"vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
            _TINY_DECODER,
            tokens=("1x2048",),
        ),
        ModelSpec(
            "olmo2-7b", "OLMo-2-7B shape: 4096 x 11008 SwiGLU, 32 layers, 32 heads, QK-norm, vocab 100352; "
            "no row of mlpfuse's family table: patched by structure",
            "Olmo2Config", "Olmo2ForCausalLM", CAUSAL,
            {"vocab_size": 100352, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
             "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
             "pad_token_id": 100277, "eos_token_id": 100257},
            _TINY_DECODER | {"pad_token_id": 0, "eos_token_id": 2},
            tokens=("1x4096",),
        ),
        ModelSpec(
            "gpt2", "GPT-2 small: 768 x 3072 gelu_new MLP in Conv1D layers, 12 layers, vocab 50257",
            "GPT2Config", "GPT2LMHeadModel", CAUSAL,
            {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257},
            {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512, "vocab_size": 512, "bos_token_id": 1,
             "eos_token_id": 2},
            tokens=("1x128", "8x128"), layers_key="n_layer",
        ),
        ModelSpec(
            "bert-base", "BERT-base (masked LM): 768 x 3072 GELU intermediate, 12 layers, vocab 30522",
            "BertConfig", "BertForMaskedLM", MASKED,
            {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
             "vocab_size": 30522, "max_position_embeddings": 512},
            {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 512, "max_position_embeddings": 512},
            tokens=("1x128", "8x128"),
        ),
    )
}


@dataclass
class Built:
    """A model the lab measures: the module (eval mode, on its device), its kind and a label for the tables."""

    model: torch.nn.Module
    kind: str
    label: str
    model_type: str
    weights: str  # "random init" or the folder the weights came from

    @property
    def vocab(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_positions(self) -> int | None:
        cfg = self.model.config
        for key in ("max_position_embeddings", "n_positions"):
            value = getattr(cfg, key, None)
            if isinstance(value, int):
                return value
        return None


def transformers_or_error():
    try:
        import transformers
    except ImportError:
        raise InputError("--model: the model lab needs transformers (pip install 'mlpfuse[models]')") from None
    return transformers


def resolve(name: str) -> ModelSpec | str:
    """A built-in spec, or the path of a local model folder (one with a config.json)."""
    if name in MODELS:
        return MODELS[name]
    if os.path.isdir(name):
        model_folder.config_path(name, "--model")
        return name
    raise InputError(f"--model: expected one of {', '.join(MODELS)} or a local model folder, got {name!r}")


def _no_dropout(config) -> None:
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)


def _kind_of(config) -> tuple[str, str]:
    """(model class name, kind) from a local config's architectures, else from its model_type: a config written by
    `LlamaConfig(...).save_pretrained(folder)` names no architectures, and `patch --dry-run` takes such a folder."""
    transformers = transformers_or_error()
    for arch in getattr(config, "architectures", None) or []:
        if not hasattr(transformers, arch):
            continue
        if arch.endswith("ForMaskedLM"):
            return arch, MASKED
        if arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel"):
            return arch, CAUSAL
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    model_type = getattr(config, "model_type", None)
    # Masked first: the types in both tables are encoders (BERT, RoBERTa, ...) whose causal class is a decoder variant
    # of a model trained as a masked LM. Bart's "masked" entry is its seq2seq class, which the lab does not run.
    masked = MODEL_FOR_MASKED_LM_MAPPING_NAMES.get(model_type)
    if isinstance(masked, str) and masked.endswith("ForMaskedLM") and hasattr(transformers, masked):
        return masked, MASKED
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if isinstance(causal, str) and hasattr(transformers, causal):
        return causal, CAUSAL
    raise InputError(f"--model: neither architectures {getattr(config, 'architectures', None)} nor model_type "
                     f"{model_type!r} names a causal or masked LM class transformers {transformers.__version__} knows")


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model's floating-point parameters in `dtype`, in place; buffers stay as the model built them, as
    `from_pretrained(dtype=...)` leaves them. `model.to(bf16)` would also round the rotary embedding's fp32
    inverse frequencies, and at position p the angle is off by p times that rounding: at 1024 tokens through one
    Llama-3-8B-sized layer the bf16 logits were 46 % off the fp32 run's (1.7 % with the frequencies kept), for
    every variant alike, so the logits' error no longer told the variants apart."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def _recipe(spec: ModelSpec | str, layers: int | None, tiny: bool):
    """(config, model class, kind) the lab builds `spec` from: the config as given, dropout off."""
    transformers = transformers_or_error()
    model_folder.check_layers(layers)  # before a config with that many layers is built, built-in ones too
    if isinstance(spec, ModelSpec):
        values = dict(spec.full) | (spec.tiny if tiny else {}) | spec.extra
        if layers is not None:
            values[spec.layers_key] = layers
        config = getattr(transformers, spec.config)(**values)
        _no_dropout(config)
        return config, getattr(transformers, spec.model), spec.kind
    if tiny:
        raise InputError("--tiny: applies to the built-in models, not to a local folder")
    config = model_folder.load_config(spec, "--model", transformers)
    if layers is not None:
        key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers") if hasattr(config, k)), None)
        if key is None:
            raise InputError(f"--layers: the config in {spec} names no layer count")
        setattr(config, key, layers)
    _no_dropout(config)
    cls_name, kind = _kind_of(config)
    return config, getattr(transformers, cls_name), kind


def shape_only(name: str, *, layers: int | None, tiny: bool) -> torch.nn.Module:
    """The model as `build` would make it, on the meta device: its exact parameters and config at no memory cost,
    for deciding before building whether it fits."""
    spec = resolve(name)
    config, cls, _ = _recipe(spec, layers, tiny)
    with torch.device("meta"):
        return _construct(spec, cls, config)


def build(name: str, *, layers: int | None, tiny: bool, device: torch.device, seed: int = 0,
          dtype: torch.dtype = torch.float32) -> Built:
    """The model in `dtype` on `device`, eval mode, dropout off. Random init is seeded: the same call gives the same
    weights."""
    spec = resolve(name)
    config, cls, kind = _recipe(spec, layers, tiny)
    torch.manual_seed(seed)
    if isinstance(spec, ModelSpec):
        with torch.device(device):
            model = cast_parameters(cls(config), dtype)
        label = spec.name + (" (tiny)" if tiny else "")
        weights = "random init"
    else:
        if model_folder.weights(spec, "--model"):
            model = model_folder.load_model(cls, spec, config, "--model", dtype=dtype).to(device)
            weights = spec
        else:
            with torch.device(device):
                model = cast_parameters(_construct(spec, cls, config), dtype)
            weights = "random init"
        label = os.path.basename(os.path.normpath(spec))
    if layers is not None:
        label += f", {layers} layer{'s' if layers > 1 else ''}"
    return Built(model.eval(), kind, label, getattr(model.config, "model_type", ""), weights)


def _construct(spec: ModelSpec | str, cls, config) -> torch.nn.Module:
    """`cls(config)`; what transformers refuses in a folder's config is bad input, one line."""
    if isinstance(spec, ModelSpec):
        return cls(config)
    try:
        return cls(config)
    except Exception as exc:  # noqa: BLE001 - the folder's config, checked for bounds, may still not build
        raise InputError(f"--model: transformers cannot build {cls.__name__} from {spec}/config.json: "
                         f"{one_line(exc)}") from None


def describe() -> list[tuple[str, str]]:
    return [(s.name, s.about) for s in MODELS.values()]


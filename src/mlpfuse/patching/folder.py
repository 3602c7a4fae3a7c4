"""A local model folder read as untrusted input: `patch --dry-run MODEL_DIR`, `bench --model DIR` and
`profile --model DIR` all come through here.

A folder may hold a config.json (a JSON object of at most CONFIG_CAP bytes, without `auto_map`, its layer counts
and sizes within BOUNDS) and weights as model.safetensors (or its sharded index) or a pytorch_model.bin that
`torch.load(weights_only=True)` reads. Nothing in the folder runs: the config is built from the dict checked here
by transformers' own class for its model_type, and every other transformers call says `trust_remote_code=False`.
Every refusal is one InputError line naming the file, so a hostile folder costs a read of a few MB and a few dict
lookups, not a model built layer by layer.
"""

from __future__ import annotations

import json
import os
import pickle
import stat

from mlpfuse.errors import InputError
from mlpfuse.patching.verify import one_line

CONFIG_CAP = 4 << 20  # real configs are a few kB; sub-configs and per-layer lists stay far below this
INDEX_CAP = 64 << 20  # a sharded checkpoint's index lists every tensor: ~10 MB for the largest open models

MAX_LAYERS = 1024  # the deepest open models have ~130; `patch --dry-run` of 1024 Llama layers: ~7 s, 0.5 GB
MAX_WIDTH = 1 << 20
MAX_HEADS = 1 << 16
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 24  # 10.5 M positions are published (Llama-4 Scout)
MAX_EXPERTS = 1 << 12  # Switch-C has 2048
# Some models keep one module per expert and layer: building 64 layers of 2048 experts on the meta device took
# 5 s and 0.5 GB, so the product is bounded too.
MAX_EXPERT_LAYERS = 1 << 17

LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
              "num_encoder_layers", "num_decoder_layers")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
BOUNDS = {key: bound for bound, keys in (
    (MAX_LAYERS, LAYER_KEYS),
    (MAX_WIDTH, ("hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "word_embed_proj_dim",
                 "embedding_size", "intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
                 "n_inner", "mlp_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "ffn_hidden_size", "head_dim", "d_kv", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "projection_dim")),
    (MAX_HEADS, ("num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "encoder_attention_heads",
                 "decoder_attention_heads")),
    (MAX_VOCAB, ("vocab_size",)),
    (MAX_POSITIONS, ("max_position_embeddings", "n_positions", "max_source_positions", "max_target_positions")),
    (MAX_EXPERTS, EXPERT_KEYS),
) for key in keys}


def config_path(folder: str, arg: str) -> str:
    """`folder`/config.json, refused in one line when `folder` is no folder or has none."""
    if not os.path.isdir(folder):
        raise InputError(f"{arg}: {folder} is not a folder")
    path = os.path.join(folder, "config.json")
    if not os.path.lexists(path):  # one that is no regular file (a FIFO, a device) is refused when read
        raise InputError(f"{arg}: {folder} is a folder without a config.json")
    return path


def read_config(folder: str, arg: str) -> dict:
    """The folder's config.json as a dict, every check below passed; nothing built, no code of the folder run."""
    path = config_path(folder, arg)
    try:
        raw = json.loads(_read(path, CONFIG_CAP).decode("utf-8"), parse_int=_int)
    except InputError as exc:
        raise InputError(f"{arg}: {path}: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and Python's own limit on an integer's digits.
        raise InputError(f"{arg}: {path}: not a JSON file ({one_line(exc)})") from None
    if not isinstance(raw, dict):
        raise InputError(f"{arg}: {path}: expected a JSON object, got {type(raw).__name__}")
    if "auto_map" in raw:
        raise InputError(f"{arg}: {path}: auto_map names code in the model folder, and mlpfuse does not run a "
                         "model folder's code (without auto_map, transformers' own classes for its model_type serve)")
    architectures = raw.get("architectures")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(a, str) for a in architectures)):
        raise InputError(f"{arg}: {path}: architectures: expected a list of class names, got {architectures!r:.80}")
    problem = _out_of_bounds(raw)
    if problem:
        raise InputError(f"{arg}: {path}: {problem}")
    return raw


def load_config(folder: str, arg: str, transformers):
    """The transformers config of the folder, built from the checked dict by the class its model_type names."""
    raw = read_config(folder, arg)
    path = os.path.join(folder, "config.json")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        raise InputError(f"{arg}: {path}: unknown model type {model_type!r:.80} (transformers "
                         f"{transformers.__version__} knows {len(CONFIG_MAPPING_NAMES)}, e.g. llama, gpt2, qwen3)")
    try:
        return CONFIG_MAPPING[model_type].from_dict(raw)
    except Exception as exc:  # noqa: BLE001 - whatever transformers refuses in this dict is bad input here
        raise InputError(f"{arg}: {path}: transformers cannot build a {model_type} config from it: "
                         f"{one_line(exc)}") from None


def check_layers(value: int | None, arg: str = "--layers") -> None:
    """A layer count given on the command line, within the bound a config's own count has."""
    if value is not None and not 1 <= value <= MAX_LAYERS:
        raise InputError(f"{arg}: expected an integer from 1 to {MAX_LAYERS}, got {value}")


def weights(folder: str, arg: str) -> str | None:
    """"safetensors", "bin" (a pickle, read weights-only) or None: what `load_model` would read from `folder`.
    The JSON files transformers reads beside the weights are size-checked here first."""
    names = set(os.listdir(folder))
    for name, cap in (("generation_config.json", CONFIG_CAP), ("model.safetensors.index.json", INDEX_CAP),
                      ("pytorch_model.bin.index.json", INDEX_CAP)):
        if name in names:
            try:
                _read(os.path.join(folder, name), cap, read=False)
            except InputError as exc:
                raise InputError(f"{arg}: {os.path.join(folder, name)}: {exc}") from None
    # The names transformers loads from a folder: other files are not weights it would read.
    if names & {"model.safetensors", "model.safetensors.index.json"}:
        return "safetensors"
    if "pytorch_model.bin" in names or "pytorch_model.bin.index.json" in names:
        return "bin"
    return None


def load_model(cls, folder: str, config, arg: str, **kwargs):
    """`cls.from_pretrained` of the folder's weights: safetensors when there are any, else a pickle that
    `torch.load(weights_only=True)` reads (anything else in it is refused, as one line). No code of the folder
    runs: not a custom model class, nor a custom generate function."""
    kind = weights(folder, arg)
    try:
        return cls.from_pretrained(folder, config=config, local_files_only=True, trust_remote_code=False,
                                   use_safetensors=kind == "safetensors", weights_only=True, **kwargs)
    except pickle.UnpicklingError:
        # torch's own message ends by suggesting weights_only=False, the one thing not to do with such a file.
        raise InputError(f"{arg}: the weights in {folder} did not load: a pickle holding more than tensors, which "
                         "torch.load(weights_only=True) refuses (loading it could run code); give the weights as "
                         "safetensors") from None
    except Exception as exc:  # noqa: BLE001 - a truncated file, shapes that disagree, ...
        raise InputError(f"{arg}: the weights in {folder} did not load: {one_line(exc)}") from None


def _read(path: str, cap: int, read: bool = True) -> bytes:
    """The file's bytes, refused before reading when it is no regular file or larger than `cap` (a sparse file can
    claim gigabytes at no cost to whoever made it). Reads at most cap + 1 bytes, in case it grew meanwhile."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise InputError("not a regular file")
        if info.st_size > cap:
            raise InputError(f"{info.st_size} bytes, more than the {cap >> 20} MiB mlpfuse reads")
        if not read:
            return b""
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError as exc:
        raise InputError(f"cannot be read ({one_line(exc)})") from None
    if len(data) > cap:
        raise InputError(f"more than the {cap >> 20} MiB mlpfuse reads")
    return data


def _int(text: str) -> int:
    # No size in a model's config needs more than 64 bits; refusing longer digit strings here also spares int()
    # its quadratic conversion of thousands of digits.
    digits = len(text.lstrip("-"))
    if digits > 19 or abs(value := int(text)) >= 1 << 63:
        raise InputError(f"an integer of {digits} digits, past the 64 bits any model setting needs")
    return value


def _out_of_bounds(raw: dict) -> str | None:
    """Why the config (or a sub-config in it) asks for more layers, width, heads, vocabulary, positions or
    experts than BOUNDS allow, or puts something other than an integer there; None when it does not."""
    stack = [("", raw)]
    while stack:  # a loop, not recursion: the JSON may nest as deep as the parser allows
        prefix, config = stack.pop()
        for key, value in config.items():
            if isinstance(value, dict):
                stack.append((f"{prefix}{key}.", value))
            elif key in BOUNDS:
                problem = _size_problem(value, BOUNDS[key], per_layer=key not in LAYER_KEYS)
                if problem:
                    return f"{prefix}{key}: {problem}"
        layers = sum(v for k in LAYER_KEYS if isinstance(v := config.get(k), int))
        experts = max((v for k in EXPERT_KEYS if isinstance(v := config.get(k), int)), default=0)
        if layers * experts > MAX_EXPERT_LAYERS:
            where = f"{prefix.rstrip('.')}: " if prefix else ""
            return f"{where}{layers} layers x {experts} experts, more than the {MAX_EXPERT_LAYERS} mlpfuse builds"
    return None


def _size_problem(value, bound: int, per_layer: bool) -> str | None:
    if value is None:  # "not set": the config class picks its default
        return None
    if per_layer and isinstance(value, list) and len(value) <= MAX_LAYERS:
        return next((p for p in (_size_problem(v, bound, False) for v in value) if p), None)
    if isinstance(value, bool) or not isinstance(value, int):
        return f"expected an integer from 0 to {bound}, got {repr(value)[:80]}"
    if not 0 <= value <= bound:
        return f"{value}, outside the 0 to {bound} mlpfuse builds"
    return None


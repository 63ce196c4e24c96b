"""Model configs: frozen dataclasses built from a Hugging Face `config.json`.

One dataclass per family. `from_hf(dict)` reads the checkpoint's own field names;
everything the code needs is a field or a derived property. `config_from_hf` picks the
family by `model_type` and refuses anything else with one line naming what is supported.
Presets give the real sizes (seeded random weights, for benchmarks) and the golden
tiny shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A config that loopjax cannot run; the message is one line naming the cause."""


@dataclass(frozen=True)
class OuroConfig:
    """Ouro (ByteDance looped LM): one stack of layers applied `total_ut_steps` times."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 65536
    total_ut_steps: int = 4
    # Threshold on the cumulative exit probability; None means "no threshold rule". A set
    # early_exit_step comes first (the reference's exit_at_step), where a request runs past it.
    early_exit_threshold: float | None = 1.0
    early_exit_step: int | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = 0

    family = "ouro"

    def __post_init__(self):
        _check_positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                        "num_heads", "num_kv_heads", "head_dim", "total_ut_steps", "max_position_embeddings")
        _check_kinds(self, numbers=("rope_theta", "rms_norm_eps"), bools=("tie_word_embeddings",))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"ouro config: num_attention_heads {self.num_heads} is not a "
                              f"multiple of num_key_value_heads {self.num_kv_heads}")
        threshold = self.early_exit_threshold  # a cumulative exit probability (null: early_exit_step)
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)
                                      or not 0 <= threshold <= 1):
            raise ConfigError(f"ouro config: early_exit_threshold must be null or a number in [0, 1], "
                              f"got {threshold!r}")
        step = self.early_exit_step
        if step is not None and not (_is_int(step) and 0 <= step < self.total_ut_steps):
            raise ConfigError(f"ouro config: early_exit_step {step!r} is outside "
                              f"0..{self.total_ut_steps - 1}")
        _check_token_ids(self)

    @property
    def default_loops(self) -> int:
        return self.total_ut_steps

    @property
    def num_distinct_layers(self) -> int:
        """The layers with weights of their own (every loop runs the same ones)."""
        return self.num_layers

    @property
    def max_context_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> OuroConfig:
        hidden, num_heads = hf["hidden_size"], hf["num_attention_heads"]
        if not hf.get("head_dim") and not (_is_positive(hidden) and _is_positive(num_heads)):
            raise ConfigError(f"ouro config: hidden_size {hidden!r} and num_attention_heads "
                              f"{num_heads!r} must be positive integers")
        rope = _ouro_rope_fields(hf)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=_float(rope, "rope_theta", 1e6, "ouro"),
            rms_norm_eps=_float(hf, "rms_norm_eps", 1e-6, "ouro"),
            max_position_embeddings=hf.get("max_position_embeddings", 65536),
            total_ut_steps=hf.get("total_ut_steps", 4),
            early_exit_threshold=hf.get("early_exit_threshold", 1.0),
            early_exit_step=hf.get("early_exit_step"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=_eos(hf.get("eos_token_id")),
            pad_token_id=hf.get("pad_token_id"),
        )


@dataclass(frozen=True)
class HuginnConfig:
    """Huginn-0125 / Raven: prelude, a recurrent block looped `mean_recurrence` times, coda."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    num_prelude_layers: int
    num_core_layers: int
    num_coda_layers: int
    rope_base: float = 50000.0
    norm_eps: float = 1e-6
    max_position_embeddings: int = 4096  # the checkpoint's block_size
    mean_recurrence: int = 32
    qk_bias: bool = True
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    family = "huginn"

    def __post_init__(self):
        _check_positive(self, "vocab_size", "hidden_size", "num_heads", "intermediate_size",
                        "num_core_layers", "max_position_embeddings", "mean_recurrence")
        _check_kinds(self, numbers=("rope_base", "norm_eps"), bools=("qk_bias", "tie_word_embeddings"))
        for name in ("num_prelude_layers", "num_coda_layers"):  # 0 is a valid (empty) stack
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 0):
                raise ConfigError(f"huginn config: {name} must be a non-negative integer, "
                                  f"got {getattr(self, name)!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"huginn config: n_embd {self.hidden_size} is not a multiple of "
                              f"n_heads {self.num_heads}")
        if not self.tie_word_embeddings:
            raise ConfigError("huginn config: untied embeddings are not supported "
                              "(every released Huginn checkpoint ties them)")
        _check_token_ids(self)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads  # Huginn has no GQA

    @property
    def embed_scale(self) -> float:
        return self.hidden_size ** 0.5

    @property
    def init_state_std(self) -> float:
        """Std of the truncated normal the reference draws s_0 from, before it scales by sqrt(h)."""
        return (2.0 / (5.0 * self.hidden_size)) ** 0.5

    @property
    def default_loops(self) -> int:
        return self.mean_recurrence

    @property
    def num_distinct_layers(self) -> int:
        """The layers with weights of their own (every loop runs the same core block)."""
        return self.num_prelude_layers + self.num_core_layers + self.num_coda_layers

    @property
    def max_context_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> HuginnConfig:
        _check_huginn_fields(hf)
        return cls(
            vocab_size=hf.get("padded_vocab_size") or hf["vocab_size"],
            hidden_size=hf["n_embd"],
            num_heads=hf["n_heads"],
            intermediate_size=hf["intermediate_size"],
            num_prelude_layers=hf["n_layers_in_prelude"],
            num_core_layers=hf["n_layers_in_recurrent_block"],
            num_coda_layers=hf["n_layers_in_coda"],
            rope_base=_float(hf, "rope_base", 50000.0, "huginn"),
            norm_eps=_float(hf, "norm_eps", 1e-6, "huginn"),
            max_position_embeddings=hf.get("block_size", 4096),
            mean_recurrence=hf.get("mean_recurrence", 32),
            qk_bias=bool(hf.get("qk_bias", True)),
            tie_word_embeddings=bool(hf.get("tie_embeddings", hf.get("tie_word_embeddings", True))),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=_eos(hf.get("eos_token_id")),
            pad_token_id=hf.get("pad_token_id"),
        )


def _ouro_rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The dict holding Ouro's `rope_theta`: the config itself (transformers 4.x, Ouro's own
    code) or `rope_parameters` (transformers 5 moves it there). What the HF reference honours
    and loopjax does not implement is refused, naming the key, rather than run with other
    logits: a RoPE scaling type other than "default", sliding-window layers (`layer_types`;
    the reference makes every layer full attention when it is absent) and an MLP activation
    (`hidden_act`) other than SiLU."""
    params = hf.get("rope_parameters")
    rope = params if isinstance(params, dict) and "rope_theta" not in hf else hf
    for key in ("rope_scaling", "rope_parameters"):
        spec = hf.get(key)
        kind = spec.get("rope_type", spec.get("type", "default")) if isinstance(spec, dict) else spec
        if kind not in (None, "default"):
            raise ConfigError(f"ouro config: {key} of type {kind!r} is not supported (loopjax runs "
                              "the default RoPE)")
    act = hf.get("hidden_act", "silu")  # the reference's ACT2FN[hidden_act]; swish is SiLU too
    if act not in ("silu", "swish"):
        raise ConfigError(f"ouro config: hidden_act {act!r} is not supported (loopjax runs SiLU)")
    layer_types = hf.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise ConfigError(f"ouro config: layer_types must be a list of layer types, got {layer_types!r}")
    other = next((t for t in layer_types if t != "full_attention"), None)
    if other is not None:
        raise ConfigError(f"ouro config: layer_types {other!r} is not supported (loopjax runs "
                          "full attention in every layer)")
    return rope


def _check_huginn_fields(hf: dict[str, Any]) -> None:
    """What the reference (raven_modeling_minimal.py) honours and loopjax does not implement is
    refused, naming the key, rather than run with other logits: test-time noise injected into
    the state every loop (`test_time_noise` > 0), an adapter bias (`bias`), grouped kv heads
    (`num_key_value_heads` other than `n_heads`)."""
    noise = hf.get("test_time_noise") or 0
    if noise != 0:
        raise ConfigError(f"huginn config: test_time_noise {noise!r} is not supported (loopjax runs "
                          "the recurrence without injected noise: 0)")
    if hf.get("bias"):
        raise ConfigError("huginn config: bias true (an adapter bias) is not supported (every released "
                          "Huginn checkpoint has none)")
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != hf.get("n_heads"):
        raise ConfigError(f"huginn config: num_key_value_heads {kv_heads!r} other than n_heads "
                          f"{hf.get('n_heads')!r} is not supported (loopjax's Huginn has no grouped "
                          "kv heads)")


ModelConfig = OuroConfig | HuginnConfig

FAMILIES: dict[str, type] = {"ouro": OuroConfig, "huginn_raven": HuginnConfig}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The family's config for an HF config dict; unknown model types get one clear line."""
    if not isinstance(hf, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:  # a list is unhashable
        raise ConfigError(f"unsupported model_type {model_type!r}; loopjax supports: "
                          + ", ".join(sorted(FAMILIES)))
    try:
        return FAMILIES[model_type].from_hf(hf)
    except KeyError as e:
        raise ConfigError(f"{model_type} config.json lacks the field {e.args[0]!r}") from None


def read_hf_config(path: str) -> ModelConfig:
    """Config from a folder holding config.json (or the file itself)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise ConfigError(f"no config.json at {path}")
    try:
        with open(file, encoding="utf-8") as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # e.g. saved as UTF-16
        raise ConfigError(f"{file} is not valid JSON: {e}") from None
    return config_from_hf(hf)


def to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The loopjax config as JSON-ready data (`model_type` names the family)."""
    data = dataclasses.asdict(cfg)
    data["model_type"] = "ouro" if cfg.family == "ouro" else "huginn_raven"
    return data


def from_dict(data: dict[str, Any]) -> ModelConfig:
    """Inverse of `to_dict`."""
    data = dict(data)
    model_type = data.pop("model_type", None)
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ConfigError(f"unsupported model_type {model_type!r}; loopjax supports: "
                          + ", ".join(sorted(FAMILIES)))
    if isinstance(data.get("eos_token_id"), list):
        data["eos_token_id"] = tuple(data["eos_token_id"])
    return FAMILIES[model_type](**data)


def _eos(value):
    return tuple(value) if isinstance(value, list) else value


def eos_token_ids(cfg, generation_config: dict | None = None,
                  tokenizer_eos: int | None = None) -> tuple[int, ...]:
    """The EOS ids a request stops at (unless ignore_eos), as vLLM's: the tokenizer's eos_token
    (`tokenizer_eos`: vLLM's primary EOS), then generation_config.json's eos_token_id, which is
    what HF generate stops at; config.json's only where there is no generation_config.json
    (None; HF derives one from config.json then). Ouro's Hub config.json names 0 where chat
    ends at <|im_end|> = 2. Empty when none names one."""
    if generation_config is None:
        ids = _token_ids(cfg.eos_token_id, "config.json")
    else:
        ids = _token_ids(generation_config.get("eos_token_id"), "generation_config.json")
    return tuple(dict.fromkeys((() if tokenizer_eos is None else (tokenizer_eos,)) + ids))


def _token_ids(value, source: str) -> tuple[int, ...]:
    values = () if value is None else tuple(value) if isinstance(value, tuple | list) else (value,)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{source}: eos_token_id must be a token id or a list of them, got {value!r}")
    return values


def _check_token_ids(cfg) -> None:
    """bos / pad: a token id (any integer, as HF configs' -1) or null; eos: `_token_ids`. A list
    or an object would make the config unhashable, and every jitted forward refuses it."""
    for name in ("bos_token_id", "pad_token_id"):
        value = getattr(cfg, name)
        if value is not None and not _is_int(value):
            raise ConfigError(f"{cfg.family} config: {name} must be a token id or null, got {value!r}")
    _token_ids(cfg.eos_token_id, f"{cfg.family} config")  # config.json's, or loopjax_config.json's


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive(value) -> bool:
    return isinstance(value, int) and value > 0


def _float(hf: dict[str, Any], key: str, default: float, family: str) -> float:
    """`hf[key]` as a float (`default` when absent). An explicit null or a string is refused
    with one line naming the key: `float()` would raise a bare TypeError, and the HF reference
    code cannot run with it either."""
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{family} config: {key} must be a number, got {value!r}")
    return float(value)


def _check_kinds(cfg, numbers=(), bools=()) -> None:
    """Float and bool fields (from_hf converts them; a hand-edited loopjax_config.json may not):
    a list would make the config unhashable, a string fail deep in the model."""
    for name in numbers:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{cfg.family} config: {name} must be a number, got {value!r}")
    for name in bools:
        value = getattr(cfg, name)
        if not isinstance(value, bool):
            raise ConfigError(f"{cfg.family} config: {name} must be true or false, got {value!r}")


def _check_positive(cfg, *names):
    for name in names:
        value = getattr(cfg, name)
        if not _is_positive(value):
            raise ConfigError(f"{cfg.family} config: {name} must be a positive integer, got {value!r}")


PRESETS: dict[str, ModelConfig] = {
    "ouro-1.4b": OuroConfig(vocab_size=49152, hidden_size=2048, intermediate_size=5632,
                            num_layers=24, num_heads=16, num_kv_heads=16, head_dim=128,
                            rope_theta=1e6, max_position_embeddings=65536, eos_token_id=(0, 2)),
    "ouro-2.6b": OuroConfig(vocab_size=49152, hidden_size=2048, intermediate_size=5632,
                            num_layers=48, num_heads=16, num_kv_heads=16, head_dim=128,
                            rope_theta=1e6, max_position_embeddings=65536, eos_token_id=(0, 2)),
    "huginn-0125": HuginnConfig(vocab_size=65536, hidden_size=5280, num_heads=55,
                                intermediate_size=17920, num_prelude_layers=2, num_core_layers=4,
                                num_coda_layers=2, rope_base=50000.0, max_position_embeddings=4096,
                                mean_recurrence=32),
    # The golden tiny shapes (tests/data/ouro, tests/data/huginn/huginn_shape_242).
    "ouro-tiny": OuroConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=4, head_dim=16, rope_theta=10000.0,
                            max_position_embeddings=512),
    "huginn-tiny": HuginnConfig(vocab_size=256, hidden_size=64, num_heads=4, intermediate_size=128,
                                num_prelude_layers=2, num_core_layers=4, num_coda_layers=2,
                                max_position_embeddings=128, mean_recurrence=8),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets: " + ", ".join(sorted(PRESETS)))
    return PRESETS[name]

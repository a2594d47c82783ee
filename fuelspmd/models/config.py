"""Model configurations read from (and written back to) a Hugging Face ``config.json``.

Each config keeps the Hugging Face field names, so a user reading ``config.json`` reads
the dataclass, and :meth:`to_hf` writes the same dict back (with the fields it did not
use kept as they came). :class:`Arch` is what both models share: the decoder is one
structure (pre-norm blocks, attention then MLP, a final norm and an LM head) whose parts
the two families choose differently (learned positions or rotary, LayerNorm or RMSNorm,
GELU or SwiGLU, biases or none).

A field value this code does not implement is refused by name (a ConfigError), never
approximated: a rope_scaling, another activation, attention biases in a Llama. A
``config.json`` is untrusted input: every field is checked for its JSON type and range
before it is used (:data:`GPT2_FIELDS`, :data:`LLAMA_FIELDS`: an int that is not a bool,
sizes >= 1, epsilons > 0, probabilities in [0, 1]), and a config whose sizes do not make a
model is refused when it is made (heads x head_dim = hidden where head_dim follows from
them, key/value heads dividing the heads, an even rotary head_dim).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fuelspmd.errors import ConfigError

__all__ = ["GPT2_FIELDS", "LLAMA_FIELDS", "Arch", "GPT2Config", "LlamaConfig", "check_fields",
           "check_layout"]

# GPT-2 activation names -> the gelu's ``approximate`` (gelu_new is the tanh form)
GPT2_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
# GPT-2's dropout fields, and transformers' value for one a config.json leaves out
GPT2_DROPOUTS = ("embd_pdrop", "attn_pdrop", "resid_pdrop")
HF_GPT2_DROPOUT = 0.1


@dataclass(frozen=True)
class Arch:
    """The decoder's shape and parts, whichever family it came from."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    max_positions: int
    eps: float
    norm: str            # "layer" (with bias) or "rms"
    bias: bool           # biases in attention and MLP
    gated: bool          # SwiGLU: down(silu(gate x) * up x)
    activation: str      # "gelu_tanh", "gelu" or "silu"
    rope_theta: float | None  # rotary positions; None: learned position embeddings
    tie: bool            # the LM head is the embedding table
    # dropout probabilities, active in training mode on the plain forward: after the
    # embeddings, on the attention probabilities, on each block's two residual branches
    embed_dropout: float = 0.0
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0


# field -> its kind: "size" an int >= 1, "size?" that or null, "pos" a finite number > 0,
# "prob" a number in [0, 1], "bool", "str", "map?" an object or null
GPT2_FIELDS = {"vocab_size": "size", "n_embd": "size", "n_layer": "size", "n_head": "size",
               "n_positions": "size", "n_inner": "size?", "layer_norm_epsilon": "pos",
               "activation_function": "str", "tie_word_embeddings": "bool",
               "embd_pdrop": "prob", "attn_pdrop": "prob", "resid_pdrop": "prob"}
LLAMA_FIELDS = {"vocab_size": "size", "hidden_size": "size", "intermediate_size": "size",
                "num_hidden_layers": "size", "num_attention_heads": "size",
                "num_key_value_heads": "size?", "head_dim": "size?", "rms_norm_eps": "pos",
                "rope_theta": "pos", "max_position_embeddings": "size",
                "tie_word_embeddings": "bool", "attention_dropout": "prob", "hidden_act": "str",
                "rope_parameters": "map?", "rope_scaling": "map?"}
_KINDS = {"size": "an int >= 1", "size?": "an int >= 1 or null", "pos": "a number > 0",
          "prob": "a number in [0, 1]", "bool": "true or false", "str": "a string",
          "map?": "an object or null"}


def _fits(kind: str, v: Any) -> bool:
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    return {"size": lambda: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
            "size?": lambda: v is None or _fits("size", v),
            "pos": lambda: number and math.isfinite(v) and v > 0,
            "prob": lambda: number and 0 <= v <= 1,
            "bool": lambda: isinstance(v, bool), "str": lambda: isinstance(v, str),
            "map?": lambda: v is None or isinstance(v, dict)}[kind]()


def check_fields(owner: str, values: dict[str, Any], kinds: dict[str, str]) -> None:
    """Raise one ConfigError naming every field of ``values`` that is not of its kind."""
    bad = [f"{k}={values[k]!r} (give {_KINDS[kind]})" for k, kind in kinds.items()
           if k in values and not _fits(kind, values[k])]
    if bad:
        raise ConfigError(f"{owner}: config.json has {', '.join(bad)}; give each field a "
                          "value of its kind")


def _heads(owner: str, hidden: int, heads: int, kv: int, head_dim: int | None,
           rotary: bool) -> None:
    """The attention sizes make a model: head_dim x heads = hidden where head_dim follows
    from them, kv heads divide the heads, a rotary head_dim is even."""
    if head_dim is None and hidden % heads:
        ok = [h for h in range(1, hidden + 1) if hidden % h == 0][:12]
        raise ConfigError(f"{owner}: {heads} heads do not divide the width {hidden} (heads "
                          f"x head_dim must be the width); give a head count among {ok}")
    if heads % kv:
        raise ConfigError(f"{owner}: {heads} heads are not a multiple of {kv} key/value "
                          "heads; give num_key_value_heads dividing the heads")
    if rotary and (head_dim or hidden // heads) % 2:
        raise ConfigError(f"{owner}: rotary positions need an even head_dim, this one is "
                          f"{head_dim or hidden // heads}")


def _need(d: dict[str, Any], key: str, owner: str) -> Any:
    if key not in d:
        raise ConfigError(f"{owner}: config.json has no {key!r}; a {owner} config needs it")
    return d[key]


def _refuse(owner: str, key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"{owner}: {key}={value!r} is not supported; {fix}")


@dataclass(frozen=True)
class GPT2Config:
    """GPT-2 (``model_type`` "gpt2"): learned positions, LayerNorm, fused QKV, GELU MLP.

    The dropout probabilities are 0 in a config built in code unless given; read from a
    ``config.json`` that leaves one out, it is transformers' default, 0.1."""

    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_positions: int = 1024
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    tie_word_embeddings: bool = True
    embd_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    model_type = "gpt2"
    architecture = "GPT2LMHeadModel"

    def __post_init__(self) -> None:
        check_fields("GPT2Config", {k: getattr(self, k) for k in GPT2_FIELDS
                                    if hasattr(self, k)}, GPT2_FIELDS)
        _heads("GPT2Config", self.n_embd, self.n_head, self.n_head, None, False)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> GPT2Config:
        """The config of a ``config.json`` dict; a value not implemented is a ConfigError."""
        o = "GPT2Config"
        check_fields(o, d, GPT2_FIELDS)
        act = d.get("activation_function", "gelu_new")
        if act not in GPT2_ACTIVATIONS:
            raise _refuse(o, "activation_function", act, f"use one of {sorted(GPT2_ACTIVATIONS)}")
        for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            if d.get(key):
                raise _refuse(o, key, d[key], "set it to false (not implemented)")
        if not d.get("scale_attn_weights", True):
            raise _refuse(o, "scale_attn_weights", False, "attention scores are scaled by "
                          "1/sqrt(head_dim): set it to true")
        return cls(vocab_size=int(_need(d, "vocab_size", o)), n_embd=int(_need(d, "n_embd", o)),
                   n_layer=int(_need(d, "n_layer", o)), n_head=int(_need(d, "n_head", o)),
                   n_positions=int(d.get("n_positions", 1024)),
                   n_inner=None if d.get("n_inner") is None else int(d["n_inner"]),
                   layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
                   activation_function=act,
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
                   **{k: float(d.get(k, HF_GPT2_DROPOUT)) for k in GPT2_DROPOUTS},
                   extra=dict(d))

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict: the fields it came with, these values over them."""
        return {**self.extra, "model_type": self.model_type,
                "architectures": [self.architecture], "vocab_size": self.vocab_size,
                "n_embd": self.n_embd, "n_layer": self.n_layer, "n_head": self.n_head,
                "n_positions": self.n_positions, "n_inner": self.n_inner,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "activation_function": self.activation_function,
                "tie_word_embeddings": self.tie_word_embeddings,
                **{k: getattr(self, k) for k in GPT2_DROPOUTS}}

    @property
    def arch(self) -> Arch:
        return Arch(vocab=self.vocab_size, hidden=self.n_embd, layers=self.n_layer,
                    heads=self.n_head, kv_heads=self.n_head, head_dim=self.n_embd // self.n_head,
                    ffn=self.n_inner or 4 * self.n_embd, max_positions=self.n_positions,
                    eps=self.layer_norm_epsilon, norm="layer", bias=True, gated=False,
                    activation="gelu_tanh" if GPT2_ACTIVATIONS[self.activation_function]
                    == "tanh" else "gelu", rope_theta=None, tie=self.tie_word_embeddings,
                    embed_dropout=self.embd_pdrop, attn_dropout=self.attn_pdrop,
                    resid_dropout=self.resid_pdrop)


@dataclass(frozen=True)
class LlamaConfig:
    """Llama (``model_type`` "llama"): RMSNorm, rotary positions, grouped-query attention,
    SwiGLU, no biases; the head tied to the embedding or not."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    model_type = "llama"
    architecture = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        check_fields("LlamaConfig", {k: getattr(self, k) for k in LLAMA_FIELDS
                                     if hasattr(self, k)}, LLAMA_FIELDS)
        _heads("LlamaConfig", self.hidden_size, self.num_attention_heads,
               self.num_key_value_heads or self.num_attention_heads, self.head_dim, True)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> LlamaConfig:
        """The config of a ``config.json`` dict; a value not implemented is a ConfigError."""
        o = "LlamaConfig"
        check_fields(o, d, LLAMA_FIELDS)
        check_fields(f"{o} (rope_parameters)", d.get("rope_parameters") or {},
                     {"rope_theta": "pos", "rope_type": "str"})
        if d.get("hidden_act", "silu") != "silu":
            raise _refuse(o, "hidden_act", d["hidden_act"], "Llama's MLP is SwiGLU: use 'silu'")
        if d.get("rope_scaling") is not None:
            raise _refuse(o, "rope_scaling", d["rope_scaling"], "only unscaled rotary "
                          "positions are implemented: set it to null")
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise _refuse(o, "rope_parameters.rope_type", rope["rope_type"],
                          "only 'default' rotary positions are implemented")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise _refuse(o, key, d[key], "Llama's projections have no bias: set it "
                              "to false")
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        return cls(vocab_size=int(_need(d, "vocab_size", o)),
                   hidden_size=int(_need(d, "hidden_size", o)),
                   intermediate_size=int(_need(d, "intermediate_size", o)),
                   num_hidden_layers=int(_need(d, "num_hidden_layers", o)),
                   num_attention_heads=int(_need(d, "num_attention_heads", o)),
                   num_key_value_heads=None if d.get("num_key_value_heads") is None
                   else int(d["num_key_value_heads"]),
                   head_dim=None if d.get("head_dim") is None else int(d["head_dim"]),
                   rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                   max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                   attention_dropout=float(d.get("attention_dropout", 0.0)), extra=dict(d))

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict: the fields it came with, these values over them."""
        a = self.arch
        out = {**self.extra, "model_type": self.model_type,
               "architectures": [self.architecture], "vocab_size": self.vocab_size,
               "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
               "num_hidden_layers": self.num_hidden_layers,
               "num_attention_heads": self.num_attention_heads,
               "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
               "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
               "max_position_embeddings": self.max_position_embeddings,
               "attention_bias": False, "mlp_bias": False,
               "tie_word_embeddings": self.tie_word_embeddings,
               "attention_dropout": self.attention_dropout,
               "rope_theta": self.rope_theta,
               "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"}}
        out.pop("rope_scaling", None)
        return out

    @property
    def arch(self) -> Arch:
        heads = self.num_attention_heads
        return Arch(vocab=self.vocab_size, hidden=self.hidden_size,
                    layers=self.num_hidden_layers, heads=heads,
                    kv_heads=self.num_key_value_heads or heads,
                    head_dim=self.head_dim or self.hidden_size // heads,
                    ffn=self.intermediate_size, max_positions=self.max_position_embeddings,
                    eps=self.rms_norm_eps, norm="rms", bias=False, gated=True,
                    activation="silu", rope_theta=self.rope_theta,
                    tie=self.tie_word_embeddings, attn_dropout=self.attention_dropout)


def check_layout(owner: str, a: Arch, tp: int, pp: int) -> None:
    """Raise one ConfigError naming every size ``tp`` fails to divide (heads, key/value
    heads, vocabulary, MLP width), with the TP sizes that work, and a ``pp`` above the
    layer count; the same on every rank, before anything is built."""
    def fits(n: int) -> list[str]:
        bad = [f"heads={a.heads}"] if a.heads % n else []
        if a.kv_heads % n and n % a.kv_heads:
            bad.append(f"kv_heads={a.kv_heads} (neither divides the other)")
        bad += [f"{w}={v}" for w, v in (("vocab", a.vocab), ("ffn", a.ffn)) if v % n]
        return bad

    problems = fits(tp)
    if problems:
        ok = [n for n in range(1, a.heads + 1) if not fits(n)]
        raise ConfigError(f"{owner}: the TP size {tp} does not divide {', '.join(problems)}; "
                          f"TP sizes that fit this model: {ok}")
    if not 1 <= pp <= a.layers:
        raise ConfigError(f"{owner}: pp={pp} pipeline stages for {a.layers} layers; give pp "
                          f"in 1..{a.layers}")
    if a.heads % a.kv_heads:
        raise ConfigError(f"{owner}: {a.heads} heads are not a multiple of kv_heads="
                          f"{a.kv_heads}; give num_key_value_heads dividing the heads")

"""What the loop needs from a target (features, a verify pass, LM-head logits, its special tokens) and the checks
that refuse, up front and by name, a target, draft or input the loop cannot use.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import inspect
import time
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:  # pragma: no cover
    from .modeling_dflash import DFlashDraftModel


def target_text_config(target: torch.nn.Module) -> Any:
    """The decoder config of a target (the text config of multimodal wrappers)."""
    config = target.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def select_features(hidden_states: tuple[torch.Tensor, ...], target_layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the outputs of the chosen target layers: [B, T, len(ids) * H]."""
    return torch.cat([hidden_states[layer_id + 1] for layer_id in target_layer_ids], dim=-1)


# --- Devices: where a (possibly Accelerate-dispatched or offloaded) target computes --------------------------------


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where `module` computes: its Accelerate hook's execution device (dispatched or offloaded), else its weights'."""
    hook = getattr(module, "_hf_hook", None)
    for item in getattr(hook, "hooks", None) or ([] if hook is None else [hook]):  # a SequentialHook holds several
        device = getattr(item, "execution_device", None)
        if device is not None:
            return torch.device(device)
    parameter = next((p for p in module.parameters() if p.device.type != "meta"), None)
    return torch.device("cpu") if parameter is None else parameter.device


def target_device(target: torch.nn.Module) -> torch.device:
    """The loop's device: where the target's input embedding computes (its input ids go there)."""
    return execution_device(target.get_input_embeddings())


@contextmanager
def materialized_weight(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The module's weight, on its execution device for the `with` block (an offloaded weight is loaded meanwhile)."""
    if module.weight.device.type != "meta":
        yield module.weight
        return
    from accelerate.utils import align_module_device  # only offloaded (Accelerate-hooked) models get here

    with align_module_device(module, execution_device(module)):
        yield module.weight


# --- Features: the chosen layers' outputs, and nothing else ---------------------------------------------------------


def decoder_layers(target: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The target's list of decoder layers (the ModuleList of `num_hidden_layers` modules in its decoder), or None."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    num_layers = getattr(target_text_config(target), "num_hidden_layers", None)
    for module in (decoder.children() if isinstance(decoder, torch.nn.Module) else ()):
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    return None


class FeatureCapture:
    """The target's features during one forward: the outputs of `target_layer_ids`, copied by forward hooks into one
    buffer [N, T, L*H] on `device`, so the forward keeps no other layer's hidden states (`output_hidden_states`).

    Layer i's feature is `hidden_states[i + 1]` of Transformers' outputs: layer i's output, and for the last layer
    the decoder's normalised output. A target whose layers cannot be found falls back to `output_hidden_states`.
    """

    def __init__(self, target: torch.nn.Module, target_layer_ids: list[int] | None, device: torch.device) -> None:
        self.target, self.target_layer_ids, self.device = target, target_layer_ids, device
        self.features: torch.Tensor | None = None  # [N, T, L*H] once the forward ran
        layers = decoder_layers(target) if target_layer_ids else None
        self.fallback = bool(target_layer_ids) and layers is None
        self.modules = [] if layers is None else [
            target.get_decoder() if layer_id == len(layers) - 1 else layers[layer_id] for layer_id in target_layer_ids]
        self.handles: list[Any] = []

    def forward_arguments(self) -> dict[str, Any]:
        """What the forward must be asked for: hidden states only where no hook can capture the features."""
        return {"output_hidden_states": True} if self.fallback else {}

    def result(self, outputs: Any) -> torch.Tensor | None:
        """The captured features [N, T, L*H] (None when no layer was asked for)."""
        if not self.fallback:
            return self.features
        num_layers = target_text_config(self.target).num_hidden_layers
        if len(outputs.hidden_states) != num_layers + 1:
            raise ValueError(f"Target returned {len(outputs.hidden_states)} hidden states for {num_layers} layers; "
                             "expected the embedding output plus one per layer.")
        return select_features(outputs.hidden_states, self.target_layer_ids).to(self.device)

    def _hook(self, slot: int) -> Any:
        """A forward hook that copies its module's output into columns `slot` of the features (once per forward)."""
        written = []

        def copy_output(module: torch.nn.Module, args: Any, output: Any) -> None:
            if written and written[0] is self.features:
                raise ValueError(f"Target layer {self.target_layer_ids[slot]} ran twice in one forward (shared or "
                                 "looped layers): its features are ambiguous; DFlash needs one output per layer.")
            hidden = getattr(output, "last_hidden_state", None)
            hidden = hidden if hidden is not None else output[0] if isinstance(output, (tuple, list)) else output
            if self.features is None:
                shape = (*hidden.shape[:-1], len(self.modules) * hidden.shape[-1])
                self.features = torch.empty(shape, dtype=hidden.dtype, device=self.device)
            width = hidden.shape[-1]
            self.features[..., slot * width:(slot + 1) * width].copy_(hidden)
            written[:] = [self.features]
        return copy_output

    def __enter__(self) -> FeatureCapture:
        self.features = None
        self.handles = [module.register_forward_hook(self._hook(slot)) for slot, module in enumerate(self.modules)]
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


# --- LM head and verify pass ---------------------------------------------------------------------------------------


def is_plain_linear(module: torch.nn.Module) -> bool:
    """A bare `nn.Linear` whose weight is materialised and whose forward no hook wraps (Accelerate, torch hooks)."""
    return (
        type(module) is torch.nn.Linear
        and module.weight.device.type != "meta"
        and not (module._forward_hooks or module._forward_pre_hooks)
        and "forward" not in vars(module)  # Accelerate's hooks replace the instance's forward
    )


# --- Few-row products on a CPU: the fastest kernel for each shape, timed on this machine ---------------------------

# (dtype, weight shape, rows, threads) -> the kernel `few_row_product` timed fastest for that shape in this process.
# Which wins depends on the BLAS, the CPU and the row count: on one AVX2 machine the transposed product won at 2-16
# rows; on an AVX-512 Xeon F.linear won up to 6 rows; on an AVX-512 EPYC oneDNN's packed weights ran 2-4x faster than
# F.linear from 3 rows (MKL's kernels there read the weights more than once).
FEW_ROW_KERNEL_CHOICE: dict[tuple[torch.dtype, tuple[int, ...], int, int], str] = {}  # ..., rows, threads
KERNEL_TIMING_REPEATS = 3
MAX_FEW_ROWS = 64  # more rows than this: F.linear, a product BLAS handles well
_ONEDNN_PACKED: Any = WeakIdKeyDictionary()  # weight -> (version, data pointer, sample of its values, packed copy)
FINGERPRINT_VALUES = 256  # values of a weight compared at each generation call (changes made through `.data`)
_HAS_ONEDNN_LINEAR = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                      and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def weight_fingerprint(weight: torch.Tensor) -> torch.Tensor:
    """A copy of `FINGERPRINT_VALUES` values spread over the weight: what `drop_changed_packed_weights` compares."""
    values = weight.detach().reshape(-1)
    return values[:: max(1, values.numel() // FINGERPRINT_VALUES)].clone()


def onednn_packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of a CPU weight [V, H], made once and again whenever the weight changes in place (its
    version) or gets new storage; changes made through `.data` are caught by `drop_changed_packed_weights`."""
    version, pointer, _, packed = _ONEDNN_PACKED.get(weight, (None, None, None, None))
    if version != weight._version or pointer != weight.data_ptr():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        _ONEDNN_PACKED[weight] = (weight._version, weight.data_ptr(), weight_fingerprint(weight), packed)
    return packed


def drop_changed_packed_weights() -> int:
    """Drop the packed copies of weights whose values changed unseen (`weight.data += delta`, e.g. an adapter merged
    in place): a sample of their values differs. Run once per generation call; how many were dropped."""
    changed = [weight for weight, (_, _, fingerprint, _) in list(_ONEDNN_PACKED.items())
               if not torch.equal(weight_fingerprint(weight), fingerprint)]
    for weight in changed:
        _ONEDNN_PACKED.pop(weight, None)
    return len(changed)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(states, weight, bias)


def _transposed(weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor) -> torch.Tensor:
    logits = (weight @ states.T).T  # [N, V]: a GEMM with a few columns
    return logits if bias is None else logits + bias


def _onednn(weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor) -> torch.Tensor:
    if weight.is_inference():  # no version counter to notice a change by: no packed copy
        return torch.nn.functional.linear(states, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(states, onednn_packed_weight(weight), bias, "none", [], "")


FEW_ROW_KERNELS = {"linear": _linear, "transposed": _transposed, "onednn": _onednn}


def few_row_product(weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor) -> torch.Tensor:
    """states [N, H] times weight^T [H, V] (+ bias): [N, V].

    On CPU, for up to `MAX_FEW_ROWS` rows, the fastest of `F.linear`, (W @ states^T)^T and oneDNN's packed weights for
    this shape, timed once per process (`FEW_ROW_KERNEL_CHOICE`; a packed copy is kept only for weights it speeds up).
    Elsewhere, `F.linear`: the product `generate` computes.
    """
    if states.device.type != "cpu" or not 0 < states.shape[0] <= MAX_FEW_ROWS:
        return torch.nn.functional.linear(states, weight, bias)
    key = (states.dtype, tuple(weight.shape), states.shape[0], torch.get_num_threads())
    if key not in FEW_ROW_KERNEL_CHOICE:
        FEW_ROW_KERNEL_CHOICE[key] = fastest_kernel(weight, bias, states)
    return FEW_ROW_KERNELS[FEW_ROW_KERNEL_CHOICE[key]](weight, bias, states)


def fastest_kernel(weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor) -> str:
    """The name of the `FEW_ROW_KERNELS` entry that ran this product fastest here (best of a few runs, after one)."""
    def best_seconds(kernel) -> float:
        kernel(weight, bias, states)
        times = []
        for _ in range(KERNEL_TIMING_REPEATS):
            started = time.perf_counter()
            kernel(weight, bias, states)
            times.append(time.perf_counter() - started)
        return min(times)

    seconds = {"linear": best_seconds(_linear), "transposed": best_seconds(_transposed)}
    if _HAS_ONEDNN_LINEAR and states.dtype in (torch.float32, torch.bfloat16):
        try:
            seconds["onednn"] = best_seconds(_onednn)
        except (RuntimeError, TypeError):  # a dtype or CPU oneDNN has no kernel for, or another torch's signature
            pass
    fastest = min(seconds, key=seconds.get)
    shape_uses_onednn = any(kernel == "onednn" for (dtype, shape, *_), kernel in FEW_ROW_KERNEL_CHOICE.items()
                            if dtype == states.dtype and shape == tuple(weight.shape))
    if fastest != "onednn" and not shape_uses_onednn:
        _ONEDNN_PACKED.pop(weight, None)  # no copy of a weight whose products do not use it
    return fastest


class FewRowLinear(TorchFunctionMode):
    """While active, every `F.linear` of a few rows without autograd on a CPU, by a model's own weight (a Parameter),
    runs `few_row_product` (the fastest kernel for its shape on this machine); everything else runs as called (weights
    made per call, such as experts sliced from a stacked Parameter or dequantised weights, would be packed per call).
    Models stay untouched."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and not torch.is_grad_enabled() and len(args) >= 2:
            states, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (type(weight) is torch.nn.Parameter and type(states) is torch.Tensor and weight.dim() == 2
                    and not weight.is_inference() and states.dtype == weight.dtype and states.dim() >= 1
                    and states.shape[-1] > 0
                    and (bias is None or (type(bias) in (torch.Tensor, torch.nn.Parameter) and bias.dtype == weight.dtype))):
                rows = states.reshape(-1, states.shape[-1])  # [N, H]; few_row_product decides device and row count
                return few_row_product(weight, bias, rows).view(*states.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


@contextmanager
def few_row_kernels(model: torch.nn.Module) -> Iterator[bool]:
    """While the block runs, a model that computes on the CPU (not dispatched by Accelerate) has its few-row Linear
    products run by `FewRowLinear`. Yields whether they do."""
    switch = execution_device(model).type == "cpu" and getattr(model, "hf_device_map", None) is None
    if not switch:
        yield False
        return
    with FewRowLinear():
        yield True


def few_row_logits(lm_head: torch.nn.Module, states: torch.Tensor) -> torch.Tensor:
    """LM-head logits [N, V] of a few rows [N, H]: `few_row_product` for a plain Linear head; any other head (hooked,
    offloaded) is called."""
    if not is_plain_linear(lm_head):
        return lm_head(states)
    return few_row_product(lm_head.weight, lm_head.bias, states)


# Targets already probed by `plain_head_parts`: their logits are (or are not) exactly lm_head(base(...)).
_PLAIN_HEAD_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Config settings with which a target's forward post-processes the head's logits (Gemma's soft-capping, Cohere's and
# Granite's scales, muP multipliers): soft caps act when set and non-zero, scales when set and not 1.
LOGIT_SOFT_CAPS = ("final_logit_softcapping", "output_logit_soft_cap", "logits_soft_cap")
LOGIT_SCALES = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier",
                "logits_mup_width_multiplier")


def logit_processing(config: Any) -> dict[str, Any]:
    """The settings of a target config that make its logits differ from the bare LM head's (empty: none)."""
    caps = {name: getattr(config, name, None) for name in LOGIT_SOFT_CAPS}
    scales = {name: getattr(config, name, None) for name in LOGIT_SCALES}
    return {**{name: value for name, value in caps.items() if value},
            **{name: value for name, value in scales.items() if value is not None and value != 1}}


@torch.no_grad()
def plain_head_parts(target: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(base model, LM head) when the target's logits are exactly `lm_head(base(...).last_hidden_state)`, else None.

    Decided by what the target exposes (a base model under `base_model_prefix`, a plain Linear head), by its config
    (no setting that soft-caps or scales the logits) and, once per target, by a two-token probe: logits that a target
    processes otherwise differ from the bare head's.
    """
    base = getattr(target, getattr(target, "base_model_prefix", "") or "model", None)
    head = target.get_output_embeddings()
    if not isinstance(base, torch.nn.Module) or base is target or head is None or not is_plain_linear(head):
        return None
    if logit_processing(target.config) or logit_processing(target_text_config(target)):
        return None  # even where the probe's logits are too small to show it (tanh(x / cap) * cap == x in float)
    if target not in _PLAIN_HEAD_PROBED:
        probe = torch.arange(2, device=target_device(target))[None]  # [1, 2]
        try:
            own = target(input_ids=probe, use_cache=False).logits
            bare = head(base(input_ids=probe, use_cache=False).last_hidden_state)
            _PLAIN_HEAD_PROBED[target] = own.shape == bare.shape and torch.equal(own, bare)
        except Exception:  # a target the probe cannot run this way: its own forward does every verify
            _PLAIN_HEAD_PROBED[target] = False
    return (base, head) if _PLAIN_HEAD_PROBED[target] else None


def last_logits_only(target: torch.nn.Module) -> dict[str, int]:
    """`logits_to_keep=1` where the target's forward takes it (the LM head over the last position only), else {}."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}


def verify_forward(target: torch.nn.Module, capture: FeatureCapture | None = None, **inputs: Any
                   ) -> tuple[torch.Tensor, Any]:
    """A verify pass: (logits [n, b, V], the forward's outputs with its cache); `capture` collects the features."""
    capture = capture or FeatureCapture(target, None, torch.device("cpu"))
    parts = plain_head_parts(target)
    with capture, few_row_kernels(target):
        if parts is None:
            outputs = target(**inputs, **capture.forward_arguments())
            return outputs.logits, outputs
        base, head = parts
        outputs = base(**inputs, **capture.forward_arguments())
    hidden = outputs.last_hidden_state  # [n, b, H]
    logits = few_row_logits(head, hidden.reshape(-1, hidden.shape[-1]))
    return logits.view(hidden.shape[0], hidden.shape[1], -1), outputs


# --- Attention of a multi-token verify: grouped key/value heads without copies -----------------------------------

GROUPED_QUERY_SDPA = "grouped_query_sdpa"  # its name in Transformers' attention table (a name with "flash" in it
# would be read as a flash-attention kernel)
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
_SDPA_EXTRAS = ("position_bias", "softcap", "s_aux", "sinks")  # attention variants the plain path does not cover


def grouped_query_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Transformers' "sdpa" attention, except for a masked multi-token query over grouped key/value heads (a verify):
    SDPA's own grouped-query mode instead of first copying every key/value head for each query head. The same
    numbers; on a CPU the copies cost a 3-token verify of SmolLM2 4-12 ms at 150-1000 tokens of context."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu"
            or any(kwargs.get(name) is not None for name in _SDPA_EXTRAS)):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, is_causal=is_causal, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(  # [n, heads, q, d]
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


@contextmanager
def grouped_query_attention(target: torch.nn.Module) -> Iterator[bool]:
    """While the block runs, a CPU target with grouped key/value heads and "sdpa" attention uses `grouped_query_sdpa`
    (registered in Transformers' public attention table); its own implementation is set back after. Yields whether it
    switched."""
    config = target.config
    text_config = target_text_config(target)
    switch = (_SDPA_HAS_GQA and text_config is config and getattr(config, "_attn_implementation", None) == "sdpa"
              and execution_device(target).type == "cpu" and hasattr(target, "set_attn_implementation")
              and getattr(config, "num_key_value_heads", None) not in (None, getattr(config, "num_attention_heads", None)))
    if switch:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(GROUPED_QUERY_SDPA, grouped_query_sdpa)
        AttentionMaskInterface.register(GROUPED_QUERY_SDPA, sdpa_mask)  # its masks are sdpa's
        try:
            target.set_attn_implementation(GROUPED_QUERY_SDPA)
        except (ValueError, ImportError):
            switch = False  # a model that cannot switch keeps its own attention
        switch = switch and config._attn_implementation == GROUPED_QUERY_SDPA
    try:
        yield switch
    finally:
        if switch:
            target.set_attn_implementation("sdpa")


# --- Special tokens: one resolver for every caller ------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationTokens:
    """The ids a generation needs besides the prompt."""

    stop_token_ids: list[int]  # every EOS id of the target's generation config and of the tokenizer
    pad_token_id: int  # fills rows that ended early
    mask_token_id: int | None  # the draft's mask id (None without a draft)


def stop_token_ids_of(target: torch.nn.Module, tokenizer: Any = None) -> list[int]:
    """Every id that ends a response: the target generation config's EOS ids and the tokenizer's EOS, sorted."""
    ids: set[int] = set()
    for source in (getattr(target, "generation_config", None), tokenizer):
        configured = getattr(source, "eos_token_id", None)
        ids.update([configured] if isinstance(configured, int) else (configured or []))
    return sorted(ids)


def default_pad_token_id(target: torch.nn.Module, stop_token_ids: list[int] | None, tokenizer: Any = None) -> int:
    """Padding for rows that end early: the target's pad id, else the tokenizer's, else the first stop token, else 0."""
    for source in (getattr(target, "generation_config", None), tokenizer):
        configured = getattr(source, "pad_token_id", None)
        if isinstance(configured, int):
            return configured
    return stop_token_ids[0] if stop_token_ids else 0


def resolve_mask_token_id(draft: DFlashDraftModel, tokenizer: Any = None) -> int | None:
    """The draft's mask id; looked up in the tokenizer when the config names the mask token only as a string."""
    if draft.mask_token_id is not None or tokenizer is None:
        return draft.mask_token_id
    name = draft.config.dflash_config.get("mask_token")
    mask_token_id = tokenizer.convert_tokens_to_ids(name) if name is not None else None
    if mask_token_id is None or mask_token_id == tokenizer.unk_token_id:
        raise ValueError(f"The draft's mask token {name!r} is not in the target tokenizer's vocabulary.")
    return int(mask_token_id)


def generation_tokens(target: torch.nn.Module, tokenizer: Any = None, draft: DFlashDraftModel | None = None
                      ) -> GenerationTokens:
    """Stop, pad and mask ids for generating with `target` (and `draft`): bench, train, demo and users share it."""
    stop_token_ids = stop_token_ids_of(target, tokenizer)
    return GenerationTokens(
        stop_token_ids=stop_token_ids,
        pad_token_id=default_pad_token_id(target, stop_token_ids, tokenizer),
        mask_token_id=None if draft is None else resolve_mask_token_id(draft, tokenizer),
    )


# --- generate()'s conventions: settings from the target's generation config ------------------------------------------

DEFAULT_MAX_NEW_TOKENS = 256  # where neither the call nor the generation config sets a length (generate: max_length 20)
GENERATE_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}  # generate's, for unset fields
# Generation settings the loop cannot honour, with the values at which they change nothing.
NEUTRAL_GENERATION_SETTINGS = {
    "num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": 0,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "diversity_penalty": 0.0,
    "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "sequence_bias": None, "exponential_decay_length_penalty": None,
    "guidance_scale": 1.0, "stop_strings": None, "max_time": None, "penalty_alpha": None, "dola_layers": None,
    "watermarking_config": None, "output_scores": False, "output_logits": False, "return_dict_in_generate": False,
    "renormalize_logits": False, "remove_invalid_values": False, "prompt_lookup_num_tokens": None,
}


@dataclass(frozen=True)
class GenerationChoices:
    """What a `spec_generate` call does once its arguments and the generation config are merged."""

    max_new_tokens: int
    temperature: float  # 0.0: greedy
    top_k: int | None  # None: no top-k filter
    top_p: float | None  # None: no top-p filter
    stop_token_ids: list[int]
    pad_token_id: int


CALL_SETTINGS = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "stop_token_ids",
                 "eos_token_id", "pad_token_id", "use_cache"}  # what a call may pass besides the neutral settings


def unhonourable_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings among `settings` that the loop cannot honour: set, and not at their neutral value."""
    return {name: settings[name] for name, neutral in NEUTRAL_GENERATION_SETTINGS.items()
            if settings.get(name) is not None and settings[name] != neutral
            and not (name == "guidance_scale" and settings[name] == 1)}


def _check_honourable(settings: dict[str, Any], from_call: set[str], config_source: str) -> None:
    for name, value in unhonourable_settings(settings).items():
        source = "the call" if name in from_call else config_source
        raise ValueError(f"{source} sets {name}={value!r}, which DFlash speculative decoding cannot apply (the output "
                         f"would not be the target's own); pass {name}={NEUTRAL_GENERATION_SETTINGS[name]!r} to override it.")


def resolve_generation_choices(target: torch.nn.Module, prompt_length: int, generation_config: Any = None,
                               **arguments: Any) -> GenerationChoices:
    """Merge a call's arguments over `generation_config` (default: the target's), the way `generate` does.

    `arguments`: max_new_tokens (or max_length), do_sample, temperature, top_k, top_p, stop_token_ids (or eos_token_id),
    pad_token_id (None: not given), and settings the loop cannot honour, accepted only at their neutral values.
    """
    config = generation_config if generation_config is not None else getattr(target, "generation_config", None)
    unknown = sorted(key for key in arguments if key not in CALL_SETTINGS and key not in NEUTRAL_GENERATION_SETTINGS)
    if unknown:
        raise TypeError(f"spec_generate got unexpected keyword argument(s) {', '.join(unknown)}.")
    given = {key: value for key, value in arguments.items() if value is not None}
    settings = {k: v for k, v in (config.to_dict() if config is not None else {}).items() if v is not None}
    merged = {**GENERATE_DEFAULTS, **settings, **given}
    config_source = "the generation config" if generation_config is not None else "target.generation_config"
    _check_honourable(merged, set(given), config_source)
    if given.get("temperature", 0.0) < 0:
        raise ValueError(f"temperature must be >= 0, got {given['temperature']}.")
    if "temperature" in given and "do_sample" not in given:  # dflash-hf's own shorthand: temperature 0 is greedy
        merged["do_sample"] = given["temperature"] > 0
    max_new_tokens = given.get("max_new_tokens", settings.get("max_new_tokens"))
    max_length = given.get("max_length", settings.get("max_length"))
    if "max_new_tokens" not in given and ("max_length" in given or max_new_tokens is None and max_length not in (None, 20)):
        max_new_tokens = max_length - prompt_length  # generate's max_length counts the prompt
        if max_new_tokens < 1:
            source = "the call" if "max_length" in given else config_source
            raise ValueError(f"{source} sets max_length={max_length}, which leaves no room after the prompt of "
                             f"{prompt_length} tokens; pass max_new_tokens instead.")
    stop = given.get("stop_token_ids", given.get("eos_token_id", merged.get("eos_token_id")))
    stop_token_ids = [] if stop is None else [stop] if isinstance(stop, int) else list(stop)
    top_k, top_p = merged.get("top_k"), merged.get("top_p")
    return GenerationChoices(
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
        temperature=float(merged["temperature"]) if merged["do_sample"] else 0.0,
        top_k=None if top_k == 0 else top_k,
        top_p=None if top_p in (None, 1.0) else top_p,
        stop_token_ids=stop_token_ids,
        pad_token_id=merged["pad_token_id"] if merged.get("pad_token_id") is not None else default_pad_token_id(
            target, stop_token_ids),
    )


def neutral_overrides(generation_config: Any) -> dict[str, Any]:
    """The neutral value of every setting in `generation_config` that the loop cannot honour (to compare like with like)."""
    settings = generation_config.to_dict() if generation_config is not None else {}
    return {name: NEUTRAL_GENERATION_SETTINGS[name] for name in unhonourable_settings(settings)}


# --- Checks ----------------------------------------------------------------------------------------------------------


def check_left_padding(attention_mask: torch.Tensor, shape: torch.Size) -> None:
    """Raise a ValueError unless attention_mask is a 0/1 mask of `shape` padding each row on the left only."""
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has shape {tuple(shape)}.")
    values = attention_mask.long()
    if bool(((values != 0) & (values != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (prompt token).")
    empty = (values.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"The prompt of row {empty[0]} is empty: its attention_mask is all zeros.")
    right_padded = (values[:, 1:] < values[:, :-1]).any(dim=1).nonzero().flatten().tolist()
    if right_padded:
        raise ValueError(
            f"attention_mask pads row {right_padded[0]} on the right (or in the middle); spec_generate needs "
            "left padding: set tokenizer.padding_side = 'left'."
        )


def check_generation_inputs(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    attention_mask: torch.Tensor | None,
) -> None:
    """Raise a ValueError/TypeError naming the problem with the prompt or the generation settings."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.long, torch.int):
        raise TypeError("input_ids must be an integer torch.Tensor of shape [batch, prompt_length].")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [batch, prompt_length], got {tuple(input_ids.shape)}.")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids has no rows: the batch is empty.")
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: input_ids needs at least one token.")
    if attention_mask is not None:
        check_left_padding(attention_mask, input_ids.shape)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 0 (0: no top-k filter), got {top_k}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    config = target_text_config(target)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"Target {type(target).__name__} is an encoder-decoder model; DFlash needs a decoder-only target.")
    limit = getattr(config, "max_position_embeddings", None)
    total = input_ids.shape[1] + max_new_tokens
    if limit is not None and total > limit:
        raise ValueError(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} = {total} exceeds the "
            f"target's position limit max_position_embeddings={limit}."
        )


def check_draft_target(
    draft: DFlashDraftModel, target: torch.nn.Module, mask_token_id: int | None, total_length: int
) -> int:
    """Raise a ValueError naming any mismatch between draft and target; return the mask token id."""
    embeddings, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    if embeddings is None or lm_head is None or not hasattr(lm_head, "weight"):
        raise ValueError(
            f"Target {type(target).__name__} exposes no input embedding or LM head "
            "(get_input_embeddings()/get_output_embeddings()); pass a *ForCausalLM model."
        )
    config = target_text_config(target)
    target_hidden_size = embeddings.weight.shape[1]
    if draft.config.hidden_size != target_hidden_size:
        raise ValueError(
            f"Draft hidden_size {draft.config.hidden_size} does not match the target's hidden size {target_hidden_size}."
        )
    target_vocab = lm_head.weight.shape[0]
    if draft.config.vocab_size != target_vocab and not draft.config.dflash_config.get("vocab_size_unknown"):
        raise ValueError(f"Draft vocab_size {draft.config.vocab_size} does not match the target's vocabulary {target_vocab}.")
    num_layers = getattr(config, "num_hidden_layers", None)
    if num_layers is None:
        raise ValueError(f"Target config {type(config).__name__} has no num_hidden_layers; unknown target architecture.")
    if draft.config.num_target_layers is not None and draft.config.num_target_layers != num_layers:
        raise ValueError(
            f"Draft was trained for a target with {draft.config.num_target_layers} layers (num_target_layers); "
            f"this target has {num_layers}."
        )
    bad_layers = [i for i in draft.target_layer_ids if not 0 <= i < num_layers]
    if bad_layers:
        raise ValueError(f"target_layer_ids {bad_layers} are outside the target's {num_layers} layers.")
    return _check_mask_device_length(draft, embeddings, mask_token_id, total_length)


def _check_mask_device_length(draft: DFlashDraftModel, embeddings: torch.nn.Module, mask_token_id: int | None,
                              total_length: int) -> int:
    """The rest of `check_draft_target`: mask id, device, dtype, the draft's position limit."""
    if mask_token_id is None:
        mask_token_id = draft.mask_token_id
    if mask_token_id is None:
        name = draft.config.dflash_config.get("mask_token")
        raise ValueError(
            f"The draft config names its mask token only as {name!r}; pass "
            "mask_token_id=tokenizer.convert_tokens_to_ids(...) to spec_generate."
        )
    embedding_weight, device = embeddings.weight, execution_device(embeddings)
    if not 0 <= mask_token_id < embedding_weight.shape[0]:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the target vocabulary (size {embedding_weight.shape[0]}).")
    draft_parameter = next(draft.parameters())
    if draft_parameter.device != device:
        raise ValueError(
            f"Draft is on {draft_parameter.device} but the target's embedding computes on {device}; "
            f"move the draft there: draft.to({str(device)!r})."
        )
    if not (draft_parameter.is_floating_point() and embedding_weight.is_floating_point()):
        raise ValueError(
            f"Draft dtype {draft_parameter.dtype} and target dtype {embedding_weight.dtype} cannot be mixed: "
            "both must be floating point (float32, bfloat16 or float16)."
        )
    if draft_parameter.dtype != embedding_weight.dtype:
        warnings.warn(
            f"The draft is {draft_parameter.dtype} but the target is {embedding_weight.dtype}: every step runs the "
            f"draft in {draft_parameter.dtype} and casts its inputs and outputs (slower; the output is the target's "
            f"either way). Load the draft with dtype={embedding_weight.dtype} or call draft.to({embedding_weight.dtype}).",
            stacklevel=3,
        )
    draft_limit = getattr(draft.config, "max_position_embeddings", None)
    if draft_limit is not None and total_length > draft_limit:
        raise ValueError(f"prompt + max_new_tokens = {total_length} exceeds the draft's max_position_embeddings={draft_limit}.")
    return int(mask_token_id)

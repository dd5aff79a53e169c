"""The target pass: the chosen layers' features (forward hooks), a verify forward, and its LM-head fast path.

See docs/architecture.md, "The target pass". Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from .devices_dflash import target_device, target_text_config
from .families_dflash import LOGIT_SCALES, LOGIT_SOFT_CAPS
from .kernels_dflash import few_row_kernels, few_row_logits, is_plain_linear


def select_features(hidden_states: tuple[torch.Tensor, ...], target_layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the outputs of the chosen target layers: [B, T, len(ids) * H]."""
    return torch.cat([hidden_states[layer_id + 1] for layer_id in target_layer_ids], dim=-1)


# --- Features: the chosen layers' outputs, and nothing else ---------------------------------------------------------


def decoder_layers(target: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The target's list of decoder layers (the ModuleList of `num_hidden_layers` modules in its decoder), or None."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    num_layers = getattr(target_text_config(target), "num_hidden_layers", None)
    for module in (decoder.children() if isinstance(decoder, torch.nn.Module) else ()):
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    return None


def feature_modules(target: torch.nn.Module, target_layer_ids: list[int]) -> list[torch.nn.Module] | None:
    """The modules whose outputs are the features of `target_layer_ids`: each layer, and for the last layer the
    decoder (whose output is normalised, as `hidden_states[-1]`); None when the layers cannot be found."""
    layers = decoder_layers(target)
    if layers is None:
        return None
    return [target.get_decoder() if layer_id == len(layers) - 1 else layers[layer_id] for layer_id in target_layer_ids]


def module_hidden_states(output: Any) -> torch.Tensor:
    """The hidden states [N, T, H] in a feature module's output: a decoder's `last_hidden_state`, a layer's first
    output, or the tensor itself."""
    hidden = getattr(output, "last_hidden_state", None)
    return hidden if hidden is not None else output[0] if isinstance(output, (tuple, list)) else output


class FeatureCapture:
    """The target's features during one forward: the outputs of `target_layer_ids`, copied by forward hooks into one
    buffer [N, T, L*H] on `device`, so the forward keeps no other layer's hidden states (`output_hidden_states`).

    Layer i's feature is `hidden_states[i + 1]` of Transformers' outputs: layer i's output, and for the last layer
    the decoder's normalised output. A target whose layers cannot be found falls back to `output_hidden_states`.
    """

    def __init__(self, target: torch.nn.Module, target_layer_ids: list[int] | None, device: torch.device) -> None:
        self.target, self.target_layer_ids, self.device = target, target_layer_ids, device
        self.features: torch.Tensor | None = None  # [N, T, L*H] once the forward ran
        modules = feature_modules(target, target_layer_ids) if target_layer_ids else []
        self.fallback = modules is None
        self.modules = modules or []
        self.handles: list[Any] = []
        self.thread: int | None = None  # the thread whose forward is captured (another thread's is not)

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
            if threading.get_ident() != self.thread:
                return  # a forward of the same model in another thread: not this capture's
            if written and written[0] is self.features:
                raise ValueError(f"Target layer {self.target_layer_ids[slot]} ran twice in one forward (shared or "
                                 "looped layers): its features are ambiguous; DFlash needs one output per layer.")
            hidden = module_hidden_states(output)
            if self.features is None:
                shape = (*hidden.shape[:-1], len(self.modules) * hidden.shape[-1])
                self.features = torch.empty(shape, dtype=hidden.dtype, device=self.device)
            width = hidden.shape[-1]
            self.features[..., slot * width:(slot + 1) * width].copy_(hidden)
            written[:] = [self.features]
        return copy_output

    def __enter__(self) -> FeatureCapture:
        self.features = None
        self.thread = threading.get_ident()
        self.handles = [module.register_forward_hook(self._hook(slot)) for slot, module in enumerate(self.modules)]
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


# --- LM head and verify pass ---------------------------------------------------------------------------------------


NO_HOOK = nullcontext()  # a verify's `around` where no wrapper hooks it

# Targets already probed by `plain_head_parts`: target -> (its class's forward when probed, whether its logits were
# exactly lm_head(base(...))).
_PLAIN_HEAD_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROBE_LOCK = threading.Lock()


def logit_processing(config: Any) -> dict[str, Any]:
    """The settings of a target config that make its logits differ from the bare LM head's (empty: none)."""
    caps = {name: getattr(config, name, None) for name in LOGIT_SOFT_CAPS}
    scales = {name: getattr(config, name, None) for name in LOGIT_SCALES}
    return {**{name: value for name, value in caps.items() if value},
            **{name: value for name, value in scales.items() if value is not None and value != 1}}


def forward_is_intercepted(module: torch.nn.Module) -> bool:
    """Whether something besides the module's class code runs when it is called: its own hooks, an instance forward
    (a patch, Accelerate), or torch's global module hooks."""
    global_hooks = [getattr(torch.nn.modules.module, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called")]
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module)
                or any(global_hooks) or type(module).__call__ is not torch.nn.Module.__call__)


@torch.no_grad()
def plain_head_parts(target: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(base model, LM head) when calling them gives exactly the target's logits, else None. Checked on every call.

    Decided by what the target exposes (a base model under `base_model_prefix`, a plain Linear head), by what could
    intervene in its forward now (hooks, a patched forward: then never), by its config (no setting that soft-caps or
    scales the logits) and, once per class forward, by a two-token probe: logits that a target processes otherwise
    differ from the bare head's. The probe runs the target, so call this before any hook of one verify is on it
    (`verify_forward` does).
    """
    base = getattr(target, getattr(target, "base_model_prefix", "") or "model", None)
    head = target.get_output_embeddings()
    if not isinstance(base, torch.nn.Module) or base is target or head is None or not is_plain_linear(head):
        return None
    if forward_is_intercepted(target):
        return None
    if logit_processing(target.config) or logit_processing(target_text_config(target)):
        return None  # even where the probe's logits are too small to show it (tanh(x / cap) * cap == x in float)
    forward = type(target).forward
    with _PROBE_LOCK:
        probed = _PLAIN_HEAD_PROBED.get(target)
    if probed is None or probed[0] is not forward:
        probe = torch.arange(2, device=target_device(target))[None]  # [1, 2]: tokens 0, 1 at positions 0, 1
        try:
            own = target(input_ids=probe, position_ids=probe, use_cache=False).logits
            bare = head(base(input_ids=probe, position_ids=probe, use_cache=False).last_hidden_state)
            probed = (forward, own.shape == bare.shape and torch.equal(own, bare))
        # a target the probe cannot run this way (other arguments, other outputs): its own forward does every verify
        except (TypeError, ValueError, AttributeError):
            probed = (forward, False)
        with _PROBE_LOCK:
            _PLAIN_HEAD_PROBED[target] = probed
    return (base, head) if probed[1] else None


def last_logits_only(target: torch.nn.Module) -> dict[str, int]:
    """`logits_to_keep=1` where the target's forward takes it (the LM head over the last position only), else {}."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}


def prefill_forward(target: torch.nn.Module, input_ids: torch.Tensor, attention: dict[str, torch.Tensor],
                    capture: FeatureCapture, cache_arguments: dict[str, Any]) -> Any:
    """The prompts' forward [N, T] into the cache `cache_arguments` give: features captured by `capture`, the LM head
    over the last column only."""
    with capture:
        return target(input_ids=input_ids, use_cache=True, **attention, **last_logits_only(target),
                      **capture.forward_arguments(), **cache_arguments)


def verify_forward(target: torch.nn.Module, capture: FeatureCapture | None = None,
                   around: AbstractContextManager[None] = NO_HOOK, **inputs: Any) -> tuple[torch.Tensor, Any]:
    """A verify pass: (logits [n, b, V], the forward's outputs with its cache); `capture` collects the features;
    `around` (a rollback's recording hooks) is entered around the forward only, after the LM head's probe."""
    capture = capture or FeatureCapture(target, None, torch.device("cpu"))
    parts = plain_head_parts(target)  # its probe (the first time) runs the target: before `around`'s hooks
    tokens_per_row = (inputs["input_ids"] if "input_ids" in inputs else inputs["inputs_embeds"]).shape[1]
    with capture, few_row_kernels(target, tokens_per_row), around:
        if parts is None:
            outputs = target(**inputs, **capture.forward_arguments())
            return outputs.logits, outputs
        base, head = parts
        outputs = base(**inputs, **capture.forward_arguments())
    hidden = outputs.last_hidden_state  # [n, b, H]
    logits = few_row_logits(head, hidden.reshape(-1, hidden.shape[-1]))
    return logits.view(hidden.shape[0], hidden.shape[1], -1), outputs



"""The layer registry: which module types the AP preconditions, and why others are skipped.

``register_layer(ModuleType, factory)`` adds a layer type: ``factory(module, name, options)`` returns a
:class:`LayerHelper`, or a string saying why this instance is skipped (its parameters go to the GP unchanged,
named with the reason in the coverage report, :class:`CoverageEntry`). A type from a package dopr does not import
is registered by its qualified name, ``"package.module.ClassName"``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Union

from torch import Tensor, nn

from .. import sharding
from .base import LayerHelper
from .conv import Conv2dSUAHelper, ConvHelper, ConvTranspose1dHelper
from .embedding import EmbeddingHelper
from .hf_conv1d import HFConv1DHelper
from .linear import LinearHelper
from .lora import LoraInputHelper, lora_inputs

Factory = Callable[[nn.Module, str, dict], Union[LayerHelper, str]]
_REGISTRY: dict = {}

#: modules that use their weights functionally instead of through child modules' forward
FUNCTIONAL_WEIGHTS = {
    nn.MultiheadAttention: "nn.MultiheadAttention calls F.multi_head_attention_forward with its "
    "packed in_proj_weight and out_proj weights directly, so no forward hook sees the projection "
    "inputs; build attention from nn.Linear q/k/v/out projections to precondition it",
}


def register_layer(module_type: Union[type, str], factory: Factory) -> None:
    """Register `factory` for a module class, or for a class named ``"module.QualName"`` (so that
    dopr need not import the package defining it)."""
    _REGISTRY[module_type] = factory


def _factory_for(module: nn.Module) -> Optional[Factory]:
    for cls in type(module).__mro__:  # the most derived registered class wins
        for key in (cls, f"{cls.__module__}.{cls.__qualname__}"):
            if key in _REGISTRY:
                return _REGISTRY[key]
    return None


def _weight_trainable(module) -> Optional[str]:
    w = getattr(module, "weight", None)
    if w is None or not w.requires_grad:
        return "weight frozen (only other parameters are trainable)"
    return None


def _linear(module, name, opts):
    return _weight_trainable(module) or LinearHelper(module, name, opts["homogeneous"])


def _lora_input(module, name, opts, found):
    """lora_A of a peft LoRA layer (its LoRA layer and adapter are ``found``): dopr/layers/lora.py."""
    return _weight_trainable(module) or LoraInputHelper(module, name, opts["homogeneous"], *found)


def _conv(module, name, opts):
    if module.groups != 1:
        return f"grouped convolution (groups={module.groups}) is not supported"
    if isinstance(module, nn.Conv2d) and opts["conv2d"] == "sua":
        return _weight_trainable(module) or Conv2dSUAHelper(module, name)
    return _weight_trainable(module) or ConvHelper(module, name, opts["homogeneous"])


def _input_sharded(module, what: str, inputs: str) -> Optional[str]:
    """FSDP2 shards dim 0, which for ConvTranspose1d's (C_in, C_out, k) and Conv1D's (in, out) weight is the
    input: the columns of G that Sigma mixes, so no rank holds whole rows of G."""
    if sharding.is_sharded(module.weight):
        return (f"sharded {what}: FSDP2 splits its weight's dim 0, the {inputs}, which are the "
                "columns the AP mixes; leave it out of fully_shard (ignored_params) to precondition it")
    return None


def _conv_transpose(module, name, opts):
    if module.groups != 1:
        return f"grouped convolution (groups={module.groups}) is not supported"
    return (_input_sharded(module, "ConvTranspose1d", "input channels") or _weight_trainable(module)
            or ConvTranspose1dHelper(module, name, opts["homogeneous"]))


def _hf_conv1d(module, name, opts):
    return (_input_sharded(module, "Conv1D", "input features") or _weight_trainable(module)
            or HFConv1DHelper(module, name, opts["homogeneous"]))


def _embedding(module, name, opts):
    if module.sparse:
        return "sparse embedding gradients are not supported"
    return _weight_trainable(module) or EmbeddingHelper(module, name)


register_layer(nn.Linear, _linear)
register_layer(nn.Conv1d, _conv)
register_layer(nn.Conv2d, _conv)
register_layer(nn.ConvTranspose1d, _conv_transpose)
register_layer(nn.Embedding, _embedding)
register_layer("transformers.pytorch_utils.Conv1D", _hf_conv1d)


@dataclass
class CoverageEntry:
    name: str
    type: str
    status: str  # "preconditioned" or "skipped"
    mode: Optional[str] = None
    dim: Optional[int] = None
    reason: Optional[str] = None

    def __str__(self) -> str:
        what = f"{self.mode} d={self.dim}" if self.status == "preconditioned" else self.reason
        return f"{self.name or '<root>'} ({self.type}): {self.status}: {what}"


class _ModelMap:
    """What :func:`find_layers` reads of ``model`` once: who owns each parameter, every name a module is held under
    (one module under several names is one layer, one Sigma over all its uses; only a parameter held by two
    different modules is tied), the modules with a functional weight and the parametrized ones."""

    def __init__(self, model: nn.Module) -> None:
        self.owners: dict = {}    # id(parameter) -> {id(module): its first name}
        self.aliases: dict = {}   # id(module) -> every name it is held under
        for mname, module in model.named_modules(remove_duplicate=False):
            self.aliases.setdefault(id(module), []).append(mname)
            for p in module.parameters(recurse=False):
                self.owners.setdefault(id(p), {}).setdefault(id(module), mname)
        self.functional = {}
        for mname, module in model.named_modules():
            for cls, why in FUNCTIONAL_WEIGHTS.items():
                if isinstance(module, cls):
                    self.functional[mname] = why
        # weight_norm / spectral_norm (torch.nn.utils.parametrizations, or the legacy hook): the weight is computed
        # from other parameters, whose gradients are not the linear map's G that the AP acts on
        self.parametrized = {name for name, m in model.named_modules()
                             if isinstance(getattr(m, "weight", None), Tensor) and not isinstance(m.weight, nn.Parameter)
                             and any(p.requires_grad for p in m.parameters())}
        self.loras = lora_inputs(model)

    def skip_reason(self, name: str, module: nn.Module, own: list, options: dict) -> Optional[str]:
        """Why a module owning trainable parameters ``own`` is not preconditioned, before any helper; else None."""
        if not any(p.requires_grad for p in own):
            return "frozen (no parameter requires grad)"
        skip = next((k for k in options.get("skip_layers", ()) for a in self.aliases[id(module)]
                     if a == k or a.startswith(k + ".") or type(module).__name__ == k), None)
        if skip is not None:
            return f"named in skip_layers ({skip!r}); its parameters go to the GP unchanged"
        parent = next((f for f in self.functional if name == f or name.startswith(f + ".")), None)
        if parent is not None:
            return self.functional[parent]
        owner = next((p for p in self.parametrized
                      if name.startswith(f"{p}.parametrizations." if p else "parametrizations.")), None)
        if owner is not None:
            return (f"the parametrization of {owner or '<root>'}'s weight (its original parameters): to the GP "
                    "unchanged")
        complex_ = next((p.dtype for p in own if p.is_complex()), None)
        if complex_ is not None:
            return (f"complex parameters ({complex_}): the AP is for real weights (a complex input's Sigma "
                    "is the Hermitian E[z z^H], which no solver factors); its parameters go to the GP unchanged")
        return None

    def helper(self, name: str, module: nn.Module, optimized: set, options: dict) -> Union[LayerHelper, str]:
        """The module's helper, or why it has none."""
        found = self.loras.get(id(module))
        factory = _factory_for(module) if found is None else partial(_lora_input, found=found)
        if factory is None:
            return f"no activation preconditioner for {type(module).__name__}; its parameters go to the GP unchanged"
        helper = factory(module, name, options)
        if isinstance(helper, str):
            return helper
        tied = [o for p in helper.parameters() for m, o in self.owners[id(p)].items() if m != id(module)]
        if tied:
            return (f"weight shared with {tied[0]} (tied): two different layers use it, with inputs of "
                    "their own, and no one Sigma is theirs; its parameters go to the GP unchanged")
        if any(id(p) not in optimized for p in helper.parameters()):
            return "its weight is not in the base optimizer"
        return helper


def find_layers(model: nn.Module, optimized: set, options: dict):
    """Walk ``model``: (helpers, coverage) for every module owning trainable parameters."""
    model_map = _ModelMap(model)
    helpers, coverage = [], []
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if name in model_map.parametrized:
            coverage.append(CoverageEntry(name, type(module).__name__, "skipped", reason=(
                "its weight is computed from other parameters (a parametrization such as weight_norm or "
                "spectral_norm): their gradients are not the linear map's G the AP acts on, so they go to the GP "
                "unchanged")))
            continue
        if not own:
            continue
        entry = CoverageEntry(name, type(module).__name__, "skipped")
        coverage.append(entry)
        found = model_map.skip_reason(name, module, own, options) or model_map.helper(name, module, optimized, options)
        if isinstance(found, str):
            entry.reason = found
            continue
        entry.status, entry.mode, entry.dim = "preconditioned", found.mode, found.dim
        helpers.append(found)
    return helpers, coverage


__all__ = ["LayerHelper", "CoverageEntry", "register_layer", "find_layers", "FUNCTIONAL_WEIGHTS"]

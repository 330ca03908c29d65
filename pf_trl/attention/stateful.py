"""Stateful sequence layers (SSM scans, causal convolutions, delta rules, RG-LRU, lightning attention) restart their
state at every example of a packed row.

Attention sees the packed examples apart through ``cu_seq_lens`` / ``position_ids``. A recurrent or convolutional
*mixer* (Mamba's selective scan, Mamba2's chunked scan, a gated delta net, a short causal convolution, Griffin's
RG-LRU, MiniMax's lightning attention) carries state along the row instead, so without help the first tokens of an
example read the last tokens of the one before it. :func:`prepare_stateful_layers` wraps every mixer transformers
ships for these families (:data:`MIXERS`) so that, on a packed row, it runs one of two ways:

- ``segments`` (everywhere; the only path on CPU): the row is cut at the example boundaries and the segments are
  stacked into a small right-padded batch, the mixer's own forward runs on it with no cache and no mask, and the
  outputs are put back in row order. Exact by construction: every mixer here is causal (the output at a position
  depends on that position and earlier ones only), each segment starts from the mixer's zero state as the example
  alone does, and the pad slots after a segment's end (copies of its last token: finite values, no degenerate math)
  reach nothing that is kept, so their outputs and gradients are dropped. Segments of similar length share a batch
  (:func:`plan_groups`), so the padding stays small; the attention and MLP layers still run on the packed row.
- ``kernels`` (CUDA, when the kernel packages are importable): the mixer's own forward on the packed row, with the
  example boundaries in the form the kernels transformers calls expect: ``seq_idx`` (one segment id per token) for
  causal-conv1d and mamba-ssm, ``cu_seqlens`` for flash-linear-attention (the gated delta net layers map
  ``cu_seq_lens_q`` themselves). Families whose kernels take no boundaries (Mamba-1's selective scan, the RG-LRU,
  lightning attention) always use ``segments``, with their CUDA kernels inside when installed. A kernel that rejects
  the packed row (a layout or dtype it does not take) sends its layer to ``segments`` for good, with a warning.

The boundaries reach each mixer as its own call arguments, never as state read from elsewhere, so a gradient
checkpointing recompute replays exactly the forward it recomputes: most hybrid decoder layers already hand the
collator's ``cu_seq_lens_q`` to their mixer; the four block types that call their mixer without keyword arguments
(:data:`CARRIER_BLOCKS`: Mamba, Mamba2, FalconMamba, Jamba's Mamba layer) get the :class:`PackedLayout` as their
mixer's ``attention_mask`` from a pre-hook on the block (the mixer wrapper takes it off before the mixer sees it).
A mixer that is reached on a packed row without its boundaries raises :class:`PaddingFreeError`: never a silent leak.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from pf_trl.attention.errors import PaddingFreeError
from pf_trl.batching import packing

logger = logging.getLogger("pf_trl.attention")

# transformers mixer class -> the kind of state it carries along the row
MIXERS: dict[str, str] = {
    # gated delta net (delta-rule state + a short causal conv in front)
    "Qwen3_5GatedDeltaNet": "gated_delta_net",
    "Qwen3_5MoeGatedDeltaNet": "gated_delta_net",
    "Qwen3NextGatedDeltaNet": "gated_delta_net",
    "OlmoHybridGatedDeltaNet": "gated_delta_net",
    "LaraMiniGatedDeltaNet": "gated_delta_net",
    "KimiLinearDeltaAttention": "kimi_delta_attention",
    "BailingHybridDeltaAttention": "kimi_delta_attention",
    # Mamba2 (chunked SSM scan + causal conv)
    "GraniteMoeHybridMambaLayer": "mamba2",
    "NemotronHMamba2Mixer": "mamba2",
    "FalconH1Mixer": "mamba2",
    "BambaMixer": "mamba2",
    "Mamba2Mixer": "mamba2",
    # Mamba-1 (selective scan + causal conv)
    "MambaMixer": "mamba",
    "FalconMambaMixer": "mamba",
    "JambaMambaMixer": "mamba",
    # short causal convolution (LFM2)
    "Lfm2ShortConv": "short_conv",
    "Lfm2MoeShortConv": "short_conv",
    "Lfm3ShortConv": "short_conv",
    # lightning attention (decayed linear attention, MiniMax)
    "MiniMaxLightningAttention": "lightning_attention",
    # Griffin's recurrent block: causal conv + RG-LRU (RecurrentGemma)
    "RecurrentGemmaRecurrentBlock": "rg_lru",
}


@dataclass(frozen=True)
class KernelRoute:
    """How a mixer kind keeps packed examples apart inside the CUDA kernels transformers calls."""

    packages: tuple[str, ...]  # all importable, or the segments path runs
    seq_idx: bool = True  # causal-conv1d / mamba-ssm: a segment id per token
    cu_seqlens: bool = False  # flash-linear-attention calls that do not map cu_seq_lens_q themselves


# kind -> its kernel route; a kind missing here has no kernel that takes boundaries (segments on every device)
KERNEL_ROUTES: dict[str, KernelRoute] = {
    # transformers hands cu_seq_lens_q to fla's chunk_gated_delta_rule as cu_seqlens; the conv before it needs seq_idx
    "gated_delta_net": KernelRoute(("fla", "causal_conv1d")),
    # KimiLinearDeltaAttention passes **kwargs to fla's chunk_kda, which reads cu_seqlens
    "kimi_delta_attention": KernelRoute(("fla", "causal_conv1d"), cu_seqlens=True),
    # mamba_split_conv1d_scan_combined, mamba_chunk_scan_combined and causal_conv1d_fn all take seq_idx
    "mamba2": KernelRoute(("mamba_ssm", "causal_conv1d")),
    "short_conv": KernelRoute(("causal_conv1d",)),
}

# blocks that call their mixer with (hidden_states, cache, attention_mask) only: the layout rides in attention_mask
CARRIER_BLOCKS = ("MambaBlock", "FalconMambaBlock", "Mamba2Block", "JambaMambaDecoderLayer")

PATHS = ("auto", "kernels", "segments")
BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens")
CACHE_KWARGS = ("cache", "cache_params", "past_key_values", "past_key_value", "layer_past")
# a group of segments is padded to its longest; one more group costs one more mixer call. A segment joins the group
# while the group's padded size stays within (1 + GROUP_SLACK) x its real tokens.
GROUP_SLACK = 0.5

_STATE_ATTR = "_pf_stateful"


# ------------------------------------------------------------------------------------------------ layout


@dataclass(eq=False)
class PackedLayout:
    """Example boundaries of a packed batch: segment lengths over the flattened ``(rows, row_len)`` token grid.

    Passed as a mixer's ``attention_mask`` by the carrier blocks (it is not a tensor: code that is not pf-trl's
    wrapper would fail on it loudly rather than misuse it).
    """

    lengths: tuple[int, ...]
    rows: int
    row_len: int
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def packed(self) -> bool:
        """More than one segment in some row (else each row is one sequence and nothing needs restarting)."""
        return len(self.lengths) > self.rows

    @staticmethod
    def from_cu_seqlens(cu: torch.Tensor, rows: int, row_len: int) -> PackedLayout:
        spans = packing.segment_spans(cu)  # one host read per batch (cached by the caller)
        bounds = [spans[0][0], *(end for _, end in spans)] if spans else cu.reshape(-1).tolist()
        if not spans or bounds[0] != 0 or bounds[-1] != rows * row_len or any(a >= b for a, b in spans):
            raise PaddingFreeError(
                f"cu_seq_lens_q {bounds[:8]}{'...' if len(bounds) > 8 else ''} does not partition the {rows} x "
                f"{row_len} tokens a stateful layer sees; pass the collator's cu_seq_lens_q unchanged"
            )
        lengths = [b - a for a, b in spans]
        row_starts = {r * row_len for r in range(rows)}
        if not row_starts <= set(bounds):
            raise PaddingFreeError("cu_seq_lens_q has a segment that crosses a row boundary of the batch")
        return PackedLayout(tuple(lengths), rows, row_len)

    @staticmethod
    def from_positions(position_ids: torch.Tensor) -> PackedLayout:
        """A segment starts at every row start and wherever a position is not the previous one + 1."""
        return PackedLayout.from_starts(packing.segment_starts(position_ids))

    @staticmethod
    def from_seq_idx(seq_idx: torch.Tensor) -> PackedLayout:
        """A segment starts at every row start and wherever the segment number changes."""
        return PackedLayout.from_starts(packing.segment_starts_from_seq_idx(seq_idx))

    @staticmethod
    def from_starts(starts: torch.Tensor) -> PackedLayout:
        """The layout of a bool ``(rows, row_len)`` segment-start mask (one host read)."""
        rows, row_len = starts.shape
        lengths = packing.lengths_from_cu_seqlens(packing.cu_seqlens_from_starts(starts))
        return PackedLayout(tuple(lengths), rows, row_len)

    def seq_idx(self, device: torch.device) -> torch.Tensor:
        """int32 ``(rows, row_len)``: the segment number of each token (what causal-conv1d / mamba-ssm read)."""
        key = ("seq_idx", str(device))
        if key not in self._plans:
            ids = packing.seq_idx_from_lengths(self.lengths)
            self._plans[key] = ids.reshape(self.rows, self.row_len).to(device)
        return self._plans[key]

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        key = ("cu", str(device))
        if key not in self._plans:
            self._plans[key] = packing.cu_seqlens_from_lengths(self.lengths).to(device)
        return self._plans[key]

    def plan(self, device: torch.device) -> SegmentPlan:
        key = ("plan", str(device))
        if key not in self._plans:
            self._plans[key] = SegmentPlan.build(self.lengths, device)
        return self._plans[key]


def plan_groups(lengths: tuple[int, ...], slack: float | None = None) -> list[list[int]]:
    """Segment indices grouped for padded mixer calls: longest first; a segment joins the current group while the
    group padded to its longest stays within ``(1 + slack)`` x its real tokens."""
    slack = GROUP_SLACK if slack is None else slack
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            width = lengths[g[0]]
            if (len(g) + 1) * width <= (1 + slack) * (sum(lengths[j] for j in g) + lengths[i]):
                g.append(i)
                continue
        groups.append([i])
    return groups


@dataclass
class SegmentGroup:
    count: int
    width: int
    gather: torch.Tensor  # (count * width,) indices into the flattened row; pad slots repeat the segment's last token


@dataclass
class SegmentPlan:
    """Index maps between the packed row and the padded segment batches (built once per layout and device)."""

    groups: list[SegmentGroup]
    inverse: torch.Tensor  # (tokens,) position of every row token in the concatenated group outputs

    @staticmethod
    def build(lengths: tuple[int, ...], device: torch.device) -> SegmentPlan:
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        inverse = torch.empty(sum(lengths), dtype=torch.long)
        groups = []
        offset = 0
        for members in plan_groups(lengths):
            width = lengths[members[0]]
            steps = torch.arange(width)
            rows = []
            for slot, i in enumerate(members):
                rows.append(starts[i] + torch.clamp(steps, max=lengths[i] - 1))
                base = offset + slot * width
                inverse[starts[i] : starts[i] + lengths[i]] = torch.arange(base, base + lengths[i])
            groups.append(SegmentGroup(len(members), width, torch.cat(rows).to(device)))
            offset += len(members) * width
        return SegmentPlan(groups, inverse.to(device))


# one host read of cu_seqlens per batch: the layout of the last boundary tensor seen, reused by every layer
_layout_cache = threading.local()


def _cached(source: torch.Tensor, make) -> PackedLayout:
    last = getattr(_layout_cache, "last", None)
    # the same tensor object, not written to since (a reused static buffer bumps its version counter)
    if last is not None and last[0] is source and last[1] == source._version:
        return last[2]
    layout = make()
    _layout_cache.last = (source, source._version, layout)
    return layout


def layout_from_arguments(arguments: dict[str, Any], rows: int, row_len: int) -> PackedLayout | None:
    """The layout a call's own arguments carry: a :class:`PackedLayout` mask, ``cu_seq_lens_q``, ``seq_idx`` or
    2-D ``position_ids`` (not next to a padding mask: left-padded positions are not consecutive); None when they
    carry none."""
    mask = arguments.get("attention_mask")
    if isinstance(mask, PackedLayout):
        return mask
    padded = isinstance(mask, torch.Tensor) and mask.dim() == 2
    cu = arguments.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor):
        return _cached(cu, lambda: PackedLayout.from_cu_seqlens(cu, rows, row_len))
    seq_idx = arguments.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor) and seq_idx.dim() == 2:
        return _cached(seq_idx, lambda: PackedLayout.from_seq_idx(seq_idx))
    position_ids = arguments.get("position_ids")
    if not padded and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 \
            and position_ids.shape[-1] == row_len:
        if position_ids.shape[0] != rows:
            position_ids = position_ids.expand(rows, -1)
        return _cached(position_ids, lambda: PackedLayout.from_positions(position_ids))
    return None


# ------------------------------------------------------------------------------- the model-level context

_context = threading.local()


def _stack() -> list:
    if not hasattr(_context, "stack"):
        _context.stack = []
    return _context.stack


def current_layout() -> PackedLayout | None:
    """The packed layout of the model forward in progress on this thread (None outside one, or unpacked)."""
    stack = _stack()
    return stack[-1] if stack else None


def _rows_and_len(kwargs: dict) -> tuple[int, int] | None:
    for name in ("input_ids", "inputs_embeds", "position_ids"):
        t = kwargs.get(name)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0]), int(t.shape[1])
    return None


def _model_pre_hook(module, args, kwargs):
    """Record the forward's layout; hand position-only packed batches the ``cu_seq_lens`` every layer reads."""
    shape = _rows_and_len(kwargs)
    layout = None
    if shape is not None:
        position_ids = kwargs.get("position_ids")
        if not isinstance(kwargs.get("cu_seq_lens_q"), torch.Tensor) and isinstance(position_ids, torch.Tensor) \
                and position_ids.dim() == 2 and kwargs.get("attention_mask") is None:
            layout = layout_from_arguments({"position_ids": position_ids}, *shape)
            if layout.packed:  # the decoder layers hand kwargs to their mixers, position_ids often not
                cu = layout.cu_seqlens(position_ids.device)
                kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(layout.lengths),
                              max_length_k=max(layout.lengths))
        else:
            layout = layout_from_arguments(kwargs, *shape)
    if layout is None:  # a call that says nothing (MambaForCausalLM -> its backbone): the enclosing forward's layout
        layout = current_layout()
    _stack().append(layout if layout is not None and layout.packed else None)
    return args, kwargs


def _model_post_hook(module, args, kwargs, output):
    stack = _stack()
    if stack:
        stack.pop()
    return output


def _carrier_pre_hook(block, args, kwargs):
    """Hand the mixer of a block that passes it no boundaries the layout, as its ``attention_mask`` (captured with
    the block's arguments, so a checkpointing recompute gets it again)."""
    if kwargs.get("attention_mask") is not None:
        return args, kwargs
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        return args, kwargs
    layout = layout_from_arguments(kwargs, hidden.shape[0], hidden.shape[1]) or current_layout()
    if layout is not None and layout.packed:
        kwargs["attention_mask"] = layout
    return args, kwargs


# --------------------------------------------------------------------------------------- mixer wrapper


@dataclass
class MixerState:
    kind: str
    inner: Any  # the mixer's forward before wrapping (a bound method)
    signature: inspect.Signature
    hidden_name: str
    path: str = "auto"


def _bind(state: MixerState, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = state.signature.bind_partial(*args, **kwargs)
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if state.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


_importable: dict[str, bool] = {}


def _package_usable(name: str) -> bool:
    if name not in _importable:
        try:
            importlib.import_module(name)
            _importable[name] = True
        except Exception:
            _importable[name] = False
    return _importable[name]


def choose_path(kind: str, path: str, device: torch.device, rows: int) -> str:
    """``kernels`` or ``segments`` for one call (``auto``: kernels on CUDA when the kind's packages import)."""
    route = KERNEL_ROUTES.get(kind)
    usable = route is not None and device.type == "cuda" and rows == 1 and all(
        _package_usable(p) for p in route.packages)
    if path == "kernels":
        if not usable:
            need = ("none: this layer's kernels take no example boundaries" if route is None
                    else ", ".join(route.packages))
            raise PaddingFreeError(
                f"stateful path 'kernels' asked for a {kind} layer, but it cannot run here (device {device.type}, "
                f"{rows} rows; kernel packages: {need}). Use path 'auto' or 'segments'."
            )
        return "kernels"
    if path == "segments":
        return "segments"
    return "kernels" if usable else "segments"


def _relayout(name: str, value: Any, rows: int, row_len: int, group: SegmentGroup, flat_pad) -> Any:
    """One keyword argument of the mixer, for a padded batch of ``group``'s segments."""
    if name in ("position_ids",) and isinstance(value, torch.Tensor) and value.shape[-1] == row_len:
        steps = torch.arange(group.width, device=value.device, dtype=value.dtype)
        lead = list(value.shape[:-2]) + [group.count]
        return steps.expand(*lead, group.width)  # every example alone is numbered from 0
    if name == "cache_position" and isinstance(value, torch.Tensor) and value.dim() == 1:
        return torch.arange(group.width, device=value.device, dtype=value.dtype)
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == rows and value.shape[1] == row_len:
        return flat_pad(value, group)  # a per-token tensor (e.g. rotary cos/sin)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_relayout("", v, rows, row_len, group, flat_pad) for v in value)
    return value


def _gather(value: torch.Tensor, group: SegmentGroup) -> torch.Tensor:
    flat = value.reshape(value.shape[0] * value.shape[1], *value.shape[2:])
    picked = flat.index_select(0, group.gather.to(flat.device))
    return picked.reshape(group.count, group.width, *value.shape[2:])


@torch.compiler.disable(reason="data-dependent segment batches; the mixer runs eagerly on each")
def _run_segments(state: MixerState, arguments: dict[str, Any], layout: PackedLayout) -> Any:
    hidden = arguments[state.hidden_name]
    rows, row_len = hidden.shape[0], hidden.shape[1]
    plan = layout.plan(hidden.device)
    outputs, extras = [], None
    for group in plan.groups:
        call: dict[str, Any] = {}
        for name, value in arguments.items():
            if name in BOUNDARY_KWARGS:
                continue
            if name == state.hidden_name:
                call[name] = _gather(value, group)
            elif name == "attention_mask" or name in CACHE_KWARGS:
                call[name] = None
            elif name == "use_cache":
                call[name] = False
            else:
                call[name] = _relayout(name, value, rows, row_len, group, _gather)
        if "use_cache" in state.signature.parameters and "use_cache" not in call:
            call["use_cache"] = False  # RecurrentGemma's block defaults to True (state kept on the module)
        result = state.inner(**call)
        out = result[0] if isinstance(result, tuple) else result
        if isinstance(result, tuple):
            extras = len(result) - 1
        outputs.append(out.reshape(group.count * group.width, *out.shape[2:]))
    packed = torch.cat(outputs).index_select(0, plan.inverse).reshape(rows, row_len, *outputs[0].shape[1:])
    return packed if extras is None else (packed, *([None] * extras))


def _run_kernels(state: MixerState, arguments: dict[str, Any], layout: PackedLayout) -> Any:
    hidden = arguments[state.hidden_name]
    route = KERNEL_ROUTES[state.kind]
    call = dict(arguments)
    if isinstance(call.get("attention_mask"), PackedLayout):
        call["attention_mask"] = None
    if route.seq_idx:
        call["seq_idx"] = layout.seq_idx(hidden.device)
    if route.cu_seqlens:
        call["cu_seqlens"] = layout.cu_seqlens(hidden.device).to(torch.long)
    return state.inner(**call)


def stateful_forward(module: torch.nn.Module, *args, **kwargs):
    """The wrapped forward of a stateful mixer (see the module docstring)."""
    state: MixerState = module.__dict__[_STATE_ATTR]
    arguments = _bind(state, args, kwargs)
    hidden = arguments.get(state.hidden_name)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 3:
        return state.inner(*args, **kwargs)
    rows, row_len = hidden.shape[0], hidden.shape[1]
    layout = layout_from_arguments(arguments, rows, row_len)
    if layout is None or not layout.packed:
        if layout is None and current_layout() is not None:
            raise PaddingFreeError(
                f"{type(module).__name__} (a {state.kind} layer) was called on a packed row without its example "
                "boundaries (no cu_seq_lens_q / position_ids reached it): pf-trl cannot restart its state per "
                "example. Train this model padded (padding_free='none')."
            )
        if layout is not None:  # one sequence per row: the boundaries say nothing; the torch paths refuse them
            arguments = {k: v for k, v in arguments.items() if k not in BOUNDARY_KWARGS}
            if isinstance(arguments.get("attention_mask"), PackedLayout):
                arguments["attention_mask"] = None
            return state.inner(**arguments)
        return state.inner(*args, **kwargs)
    mask = arguments.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        raise PaddingFreeError(
            f"{type(module).__name__} got an attention_mask together with a packed row (several examples in one "
            "row); padding-free batches carry no attention_mask (PaddingFreeCollator emits none)."
        )
    for name in CACHE_KWARGS:
        if arguments.get(name) is not None:
            raise PaddingFreeError(
                f"{type(module).__name__} got a cache ({name}) with a packed row: a recurrent state cannot track "
                "packed examples. Use use_cache=False."
            )
    if sum(layout.lengths) != rows * row_len:
        raise PaddingFreeError(
            f"{type(module).__name__}: the example boundaries cover {sum(layout.lengths)} tokens but the layer sees "
            f"{rows} x {row_len}"
        )
    if choose_path(state.kind, state.path, hidden.device, rows) == "kernels":
        if state.path == "kernels":
            return _run_kernels(state, arguments, layout)
        try:
            return _run_kernels(state, arguments, layout)
        except PaddingFreeError:
            raise
        except Exception as exc:
            logger.warning("pf-trl: %s kernels refused the packed row (%s: %s); this layer uses pf-trl's segments "
                           "path from now on", type(module).__name__, type(exc).__name__,
                           str(exc).splitlines()[0][:200])
            state.path = "segments"
    return _run_segments(state, arguments, layout)


# ----------------------------------------------------------------------------------------------- install


def stateful_mixers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every stateful mixer pf-trl knows in ``model``."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in MIXERS]


def _wrap(module: torch.nn.Module, path: str) -> None:
    state = module.__dict__.get(_STATE_ATTR)
    if state is not None:
        state.path = path
        return
    inner = module.forward
    signature = inspect.signature(inner)
    first = next(iter(signature.parameters))
    module.__dict__[_STATE_ATTR] = MixerState(MIXERS[type(module).__name__], inner, signature, first, path)
    module.forward = types.MethodType(stateful_forward, module)


def prepare_stateful_layers(model: torch.nn.Module, hook_targets: list[torch.nn.Module] | None = None,
                            path: str = "auto") -> int:
    """Make every stateful mixer of ``model`` restart at each packed example; returns how many were wrapped.

    ``hook_targets`` are the modules a user calls (the model, PEFT's base model): a forward pre-hook there records
    the forward's layout and, for a batch packed by ``position_ids`` alone, adds the ``cu_seq_lens_*`` that most
    hybrid layers hand on to their mixers. Idempotent (a second call only updates ``path``).
    """
    if path not in PATHS:
        raise ValueError(f"stateful path must be one of {PATHS}, got {path!r}")
    mixers = stateful_mixers(model)
    if not mixers:
        return 0
    for _, module in mixers:
        _wrap(module, path)
    for handle in getattr(model, "_pf_stateful_handles", ()):
        handle.remove()  # re-registered so that they run after the hooks enable_padding_free just installed
    handles = []
    for target in hook_targets or [model]:
        handles.append(target.register_forward_pre_hook(_model_pre_hook, with_kwargs=True))
        handles.append(target.register_forward_hook(_model_post_hook, with_kwargs=True, always_call=True))
    for module in model.modules():
        if type(module).__name__ in CARRIER_BLOCKS:
            handles.append(module.register_forward_pre_hook(_carrier_pre_hook, with_kwargs=True))
    model._pf_stateful_handles = handles
    return len(mixers)


def set_stateful_path(model: torch.nn.Module, path: str) -> None:
    """Choose ``auto`` / ``kernels`` / ``segments`` for every wrapped mixer (the GPU check compares the two)."""
    if path not in PATHS:
        raise ValueError(f"stateful path must be one of {PATHS}, got {path!r}")
    for _, module in stateful_mixers(model):
        state = module.__dict__.get(_STATE_ATTR)
        if state is None:
            raise PaddingFreeError(f"{type(module).__name__} is not prepared; call enable_padding_free first")
        state.path = path


def describe(model: torch.nn.Module) -> dict[str, int]:
    """Stateful mixer kinds of ``model`` and how many of each (empty for a pure-attention model)."""
    out: dict[str, int] = {}
    for _, module in stateful_mixers(model):
        kind = MIXERS[type(module).__name__]
        out[kind] = out.get(kind, 0) + 1
    return out

"""Run a transformers MoE model one decoder layer at a time, weights read from safetensors.

Only one decoder layer's weights are ever materialised: the model is built on the `meta`
device, its embedding / final norm / rotary embedding are made real, and each decoder layer
is filled from disk when its turn comes and emptied afterwards. The per-layer keyword
arguments (attention masks per layer type, position embeddings) are captured by running the
model once with every decoder layer replaced by a pass-through, so each architecture's own
forward code is used unchanged — no per-architecture re-implementation of attention.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging

import torch
from torch import nn

from moequant.arch import Adapter
from moequant.errors import UserError


class _PassThrough(nn.Module):
    """Stands in for decoder layer `index`: records its inputs, returns hidden states unchanged (with
    `with_state`, also a marker where a layer returns more: the model's loop hands it to the next layer)."""

    def __init__(self, index: int, record: dict, original: nn.Module, with_state: bool = False):
        super().__init__()
        self.index = index
        self.record = record
        self.with_state = with_state
        self.output = None  # what it returns instead of its input (LayerRunner.finish)
        for name in ("attention_type", "block_type", "layer_type"):  # what the model's forward reads of a layer
            if isinstance(getattr(original, name, None), str):
                setattr(self, name, getattr(original, name))

    def forward(self, hidden_states, *args, **kwargs):
        if self.index == 0:
            self.record["hidden"] = hidden_states
        self.record[self.index] = (args, kwargs)
        out = hidden_states if self.output is None else self.output
        return (out, _State(self.index)) if self.with_state else out


class _State:
    """Marks what decoder layer `index` returned beside its hidden states (GLM-5's attention indexer
    top-k): the argument of a later layer that receives it is the one the model's loop hands it to."""

    def __init__(self, index: int):
        self.index = index


def _digest(hidden: torch.Tensor) -> tuple:
    """Which stream of hidden states this is: its shape and a fixed sample of its values, exactly (the same
    on any device; streams that differ anywhere differ in the sample in practice)."""
    flat = hidden.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // 256)][:256]
    return (tuple(hidden.shape), sample.float().cpu().numpy().tobytes())


def experts_implementation_for(device, dtype) -> str | None:
    """transformers' experts implementation for a layer forward: `grouped_mm` (torch's grouped
    GEMM, one kernel for all experts) for bf16 on CUDA; otherwise transformers' own default."""
    device = torch.device(device)
    return "grouped_mm" if device.type == "cuda" and dtype == torch.bfloat16 else None


def compute_dtype(name: str, device, checkpoint=None) -> torch.dtype:
    """`auto`: the checkpoint's own dtype (bf16) on CUDA, float32 on the CPU (exact tests);
    `float32` / `bfloat16` force it."""
    if name == "float32":
        return torch.float32
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    if name != "auto":
        raise UserError(f"compute_dtype {name!r} is not one moequant runs; accepted: auto, float32, bfloat16.")
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def build_skeleton(checkpoint, dtype=torch.float32, experts_implementation: str | None = None):
    """The model on the meta device with everything outside its decoder layers and its head made real
    (embedding, final norm, rotary embedding, and whatever else the family keeps there), each tensor read
    under its on-disk name."""
    from transformers import AutoConfig

    from moequant.arch import adapter_for
    from moequant.arch.generic import model_class
    from moequant.layouts.compressed_tensors import clear_stops

    adapter = getattr(checkpoint, "adapter", None) or adapter_for(checkpoint.config)  # the checkpoint's own
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        config = AutoConfig.from_pretrained(checkpoint.directory, trust_remote_code=False)
        clear_stops(config)  # our export's stops for plain transformers
        with torch.device("meta"):
            extra = {"experts_implementation": experts_implementation} if experts_implementation else {}
            model = model_class(checkpoint.config).from_config(config, dtype=dtype, **extra)
    finally:
        quiet.setLevel(level)
    base, layers = adapter.decoder(model)
    skip = {id(m) for m in layers.modules()} | {id(m) for m in model.get_output_embeddings().modules()}
    for name, module in model.named_modules():
        if id(module) in skip:
            continue
        fill_computed_buffers(model, module, "cpu", recurse=False)
        for key, p in list(module.named_parameters(recurse=False)):
            t = adapter.read_tensor(checkpoint, f"{name}.{key}" if name else key)
            module._parameters[key] = nn.Parameter(t.to(dtype) if t.is_floating_point() else t, requires_grad=False)
        for key in [k for k in module._buffers if k not in module._non_persistent_buffers_set]:
            if module._buffers[key] is not None:
                t = adapter.read_tensor(checkpoint, f"{name}.{key}" if name else key)
                module._buffers[key] = t.to(dtype) if t.is_floating_point() else t
    model.eval()
    return model


def fill_computed_buffers(model, root, device, recurse: bool = True) -> None:
    """Make real the buffers a checkpoint does not hold (rotary frequencies, embedding scales: non-persistent)
    under `root`, computed by transformers' own initialisation of the module, as from_pretrained does. Call it
    before the module's weights are loaded: the initialisation may also touch them."""
    for module in root.modules() if recurse else (root,):
        keys = [k for k in module._non_persistent_buffers_set if module._buffers.get(k) is not None]
        if not keys:
            continue
        for k in keys:
            module._buffers[k] = torch.empty_like(module._buffers[k], device=device)
        with torch.no_grad():
            model._init_weights(module)


def make_head_real(model, checkpoint, adapter, device, dtype, copy_tied: bool = False):
    """The model's lm_head with its weights from disk (build_skeleton leaves it on the meta device); a tied head
    shares the embedding, or holds a copy of it on `device` with `copy_tied`."""
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    if adapter.tie_embeddings and not copy_tied:
        head.weight = embedding.weight
        return head
    names = {id(m): n for n, m in model.named_modules()}
    source = names[id(embedding if adapter.tie_embeddings else head)]
    keys = [k for k, _ in head.named_parameters()]
    head.to_empty(device=device)
    head.load_state_dict({k: checkpoint.get(adapter.disk_name(f"{source}.{k}")).to(dtype) for k in keys})
    return head


class LayerRunner:
    """Carries calibration hidden states through the decoder layers, one layer in memory at a time."""

    def __init__(
        self,
        checkpoint,
        adapter: Adapter,
        input_ids: torch.Tensor,
        batch_size: int = 8,
        device: str | torch.device = "cpu",
        dtype=torch.float32,
        experts_implementation: str | None = None,
    ):
        self.checkpoint = checkpoint
        self.adapter = adapter
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = build_skeleton(
            checkpoint, dtype, experts_implementation or experts_implementation_for(self.device, dtype)
        )
        self.layers = list(adapter.decoder(self.model)[1])
        self.batches = list(torch.split(input_ids, batch_size))
        self.layer_kwargs: list[dict] = []  # per batch: layer index → (args, kwargs)
        self.embedded: list[torch.Tensor] = []
        self._capture()

    def _capture(self) -> None:
        base, layers = self.adapter.decoder(self.model)
        # where a layer hands the next one a second output (GLM-5's indexer top-k): layer -> (its argument, from)
        self.state_from: dict[int, tuple[str, int]] = {}
        self._states: dict[tuple, object] = {}  # (layer, batch, digest of its output) -> the state it returned
        with_state = self._with_state = False
        self.shared_between_layers = False
        for batch in self.batches:
            while True:
                record: dict = {}
                try:
                    with _passed_through(layers, record, with_state), torch.no_grad():
                        base(input_ids=batch, use_cache=False)
                    break
                except (ValueError, TypeError) as e:  # the model's loop unpacks more than hidden states
                    if with_state:
                        raise UserError(
                            f"moequant cannot run this {self.adapter.model_type} model layer by layer: transformers' "
                            f"{type(base).__name__} hands more than the hidden states from one decoder layer to the "
                            f"next ({type(e).__name__}: {str(e)[:80]})."
                        ) from None
                    with_state = self._with_state = True
            layer_inputs = [(i, v) for i, v in record.items() if isinstance(i, int)]
            for i, (args, kwargs) in layer_inputs if with_state else []:
                handed = [k for k, v in kwargs.items() if isinstance(v, _State)]
                if len(handed) > 1 or any(isinstance(v, _State) for v in args):
                    raise UserError(
                        f"moequant cannot run this {self.adapter.model_type} model layer by layer: its decoder "
                        "layers take more than one state from the layers before them."
                    )
                if handed:
                    self.state_from[i] = (handed[0], kwargs[handed[0]].index)
                    record[i] = (args, {k: v for k, v in kwargs.items() if k != handed[0]})
            # a container the model's loop gives every layer to write into and read from (Kolibri-1.1's shared
            # keys and values): one per batch, so a runner carries one stream of hidden states at a time
            self.shared_between_layers = self.shared_between_layers or any(
                isinstance(v, collections.UserDict) for _, (_, kwargs) in layer_inputs for v in kwargs.values()
            )
            self.embedded.append(record.pop("hidden").detach())
            self.layer_kwargs.append({i: _to_device(v, self.device) for i, v in record.items()})

    def finish(self, b: int, hidden: torch.Tensor) -> torch.Tensor:
        """What transformers' decoder makes of batch b's last-layer output before the head: its final norm (on
        the norm's device), or, where the decoder does more after its layers (DeepSeek-V4's hyper-connection
        head), the decoder's own forward with the last layer's output put in its place (on the host)."""
        base, layers = self.adapter.decoder(self.model)
        if self.final_norm is not None:
            return self.final_norm(hidden.to(self.final_norm.weight.device))
        output = hidden.to(base.get_input_embeddings().weight.device)
        with _passed_through(layers, {}, self._with_state, output), torch.no_grad():
            return base(input_ids=self.batches[b], use_cache=False).last_hidden_state

    @functools.cached_property
    def final_norm(self) -> nn.Module | None:
        """The decoder's final norm where it is all the decoder holds after its layers, else None."""
        base, layers = self.adapter.decoder(self.model)
        skip = {id(layers), id(base.get_input_embeddings())}
        held = [m for m in base.children() if id(m) not in skip and any(True for _ in m.parameters())]
        return held[0] if len(held) == 1 and "norm" in type(held[0]).__name__.lower() else None

    def read_layer(self, layer: int, experts: dict | None = None, tensors: dict | None = None) -> dict:
        """Decoder layer `layer`'s state dict from disk (or the given replacements); on a GPU the checkpoint's
        stored bytes go there and are decoded there (no host float32 copy). Safe on a reader thread."""
        return self.adapter.layer_state_dict(
            self.checkpoint,
            layer,
            list(self.layers[layer].state_dict().keys()),
            self.dtype,
            experts=experts,
            tensors=tensors,
            device=self.device if torch.device(self.device).type == "cuda" else None,
        )

    @contextlib.contextmanager
    def materialized(
        self, layer: int, experts: dict | None = None, tensors: dict | None = None, state: dict | None = None
    ):
        """Decoder layer `layer` with its weights from disk (or the given replacements, or `state` read ahead
        by `read_layer`), on the device."""
        module = self.layers[layer]
        state = self.read_layer(layer, experts, tensors) if state is None else state
        fill_computed_buffers(self.model, module, self.device)
        computed = {f"{n}.{k}" if n else k for n, m in module.named_modules() for k in m._non_persistent_buffers_set}
        missing = set(dict(module.named_buffers())) - set(state) - computed
        if missing:
            raise RuntimeError(f"layer {layer} has buffers that are not in its state dict: {sorted(missing)}")
        # assign: the module takes the read tensors themselves (no second, empty copy of the layer to fill)
        module.load_state_dict({k: v.to(self.device) for k, v in state.items()}, strict=True, assign=True)
        del state
        module.eval()
        try:
            yield module
        finally:
            module.to("meta")
            release_freed_memory()

    def run(self, module: nn.Module, layer: int, b: int, h: torch.Tensor) -> torch.Tensor:
        """One materialised layer on batch b's hidden states (its own attention masks and positions, and
        the state the layer before it returned for these hidden states, where the model hands one on)."""
        args, kwargs = self.layer_kwargs[b][layer]
        if layer in self.state_from:
            name, source = self.state_from[layer]
            key = (source, b, _digest(h))
            if key not in self._states:
                raise UserError(
                    f"moequant cannot resume this {self.adapter.model_type} run mid-way: decoder layer {layer} needs "
                    f"what layer {source} handed on, which is not kept between runs; rerun with --overwrite."
                )
            kwargs = {**kwargs, name: self._states[key]}
        y = module(h.to(self.device), *args, **kwargs)
        if not isinstance(y, tuple):
            return y
        if self.state_from and len(y) > 1:
            # keep only the states of this layer and the one before it (every stream moves layer by layer)
            self._states = {k: v for k, v in self._states.items() if k[0] in (layer - 1, layer)}
            self._states[(layer, b, _digest(y[0]))] = y[1]
        return y[0]

    def forward(
        self, module: nn.Module, layer: int, hidden: list[torch.Tensor], before_batch=None
    ) -> list[torch.Tensor]:
        """Run one materialised layer over every batch; `before_batch(b)` is called before batch b."""
        out = []
        with torch.no_grad():
            for b, h in enumerate(hidden):
                if before_batch is not None:
                    before_batch(b)
                y = self.run(module, layer, b, h)
                if not torch.isfinite(y).all():
                    raise UserError(
                        f"layer {layer} produced NaN or Inf activations on calibration batch {b}; "
                        "the checkpoint's weights or the data are broken."
                    )
                out.append(y.detach())  # stays on the device: the next layer reads it there
        return out


@contextlib.contextmanager
def _passed_through(layers, record: dict, with_state: bool, output: torch.Tensor | None = None):
    """The decoder's layers replaced by pass-throughs recording into `record` (the last one returning `output`
    where given), restored afterwards."""
    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = _PassThrough(i, record, layer, with_state)
    layers[-1].output = output
    try:
        yield
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def release_freed_memory() -> None:
    """Give the memory freed with a finished layer back to the OS. glibc keeps freed chunks below its
    (self-raising, up to 32 MiB) mmap threshold in its per-thread arenas, so without this a process's
    resident size creeps up layer by layer with torch's worker threads; malloc_trim(0) returns them."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None

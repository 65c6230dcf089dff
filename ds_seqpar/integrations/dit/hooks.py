"""``DitParallel``: a diffusers transformer whose token streams run split over the SP group (docs/dit.md).

Installed in place (the pipeline keeps calling ``pipe.transformer(...)``): forward hooks from the model's
``TokenPlan`` split its streams (no communication) and gather the output (one all-gather per call); every
attention processor is wrapped (``SeqParAttnProcessor``) so that self- and joint attention run through
``attend`` — by default ``ds_seqpar.attention(causal=False)`` over the mesh (exact Ulysses x ring), or with ``sparse`` settings
``ds_seqpar.block_sparse_attention`` (db-SP, docs/dit_sparse.md); another
backend (PipeFusion's stale K/V) can be given. ``remove()`` restores the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ds_seqpar.comm.team import TeamComm
from ds_seqpar.config import SECTION, SeqParConfigError
from ds_seqpar.integrations.dit.attention import ATTENTION_RULES, AttentionCall, SeqParAttnProcessor
from ds_seqpar.integrations.dit.plans import GatherOutput, SplitInput, plan_of
from ds_seqpar.integrations.dit.tokens import StreamCuts, gather_pieces, take_piece
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.parallel.dit_settings import DitSparseSettings
from ds_seqpar.parallel.dit_sparse import block_sparse_attention
from ds_seqpar.parallel.usp import attention as sp_attention
from ds_seqpar.settings import SeqParSettings

__all__ = [
    "DitParallel",
    "check_dit_settings",
    "check_no_dit_settings",
    "dit_section",
    "is_dit",
    "sparse_settings",
]

Backend = Callable[[AttentionCall, "DitParallel"], torch.Tensor]


def is_dit(model: torch.nn.Module) -> bool:
    """A diffusers model (``ModelMixin``) with attention processors: a diffusion transformer."""
    return any(c.__module__.startswith("diffusers.") for c in type(model).__mro__) and any(
        hasattr(m, "processor") for m in model.modules()
    )


def dit_section(section: Any) -> Any:
    """The section with ``ring.layout = "contiguous"`` unless the user chose one (bidirectional attention gains
    nothing from a causal balance, and the contiguous layout takes any piece length)."""
    if "layout" in section.ring.model_fields_set:
        return section
    return section.model_copy(update={"ring": section.ring.model_copy(update={"layout": "contiguous"})})


DIT_ATTENTIONS = ("usp", "ulysses", "ring")  # sequence_parallel.attention values a DiT honours


def sparse_settings(settings: SeqParSettings) -> DitSparseSettings | None:
    """``DitSparseSettings`` of ``sequence_parallel.dit.sparse`` when ``dit.attention`` is ``block_sparse``, else
    None (its own checks name a bad value)."""
    dit = settings.dit
    if dit is None or dit.attention != "block_sparse":
        return None
    cfg = dit.sparse
    degrees = tuple(cfg.degrees) if isinstance(cfg.degrees, list) else cfg.degrees
    try:
        return DitSparseSettings(cfg.block_size, cfg.keep, cfg.threshold, cfg.balancing, degrees)
    except ValueError as exc:
        raise SeqParConfigError(f"{SECTION}.dit.sparse: {exc}") from exc


def check_dit_settings(settings: SeqParSettings, model_name: str, training: bool) -> None:
    """Refuse, by name, what a diffusion transformer's run would not honour: the language-model features of the
    section (sparse_ring, a dynamic degree, the memory savings, an approximate prefill) and, in training, CFG
    parallelism and PipeFusion (inference only)."""
    bad = []
    if settings.attention not in DIT_ATTENTIONS:
        bad.append(f"attention={settings.attention!r} (valid: {', '.join(DIT_ATTENTIONS)}; block-sparse DiT "
                   "attention is dit.attention='block_sparse')")  # fmt: skip
    if settings.dynamic_degree:
        bad.append("dynamic_degree=true")
    memory = settings.memory
    for key in ("activation_checkpointing", "offload", "tiled_mlp", "tiled_norms"):
        if getattr(memory, key):
            bad.append(f"memory.{key}=true")
    if settings.inference is not None and settings.inference.prefill != "exact":
        bad.append(f"inference.prefill={settings.inference.prefill!r}")
    dit = settings.dit
    if training and dit is not None and (dit.cfg_parallel > 1 or dit.pipefusion.degree > 1):
        bad.append(f"dit.cfg_parallel={dit.cfg_parallel} / dit.pipefusion.degree={dit.pipefusion.degree} in "
                   "training (inference only: set both to 1)")  # fmt: skip
    if bad:
        raise SeqParConfigError(
            f"{SECTION}: {model_name} is a diffusion transformer, and ds_seqpar does not apply "
            f"{'; '.join(bad)} to it; remove them (docs/dit.md)"
        )


def check_no_dit_settings(settings: SeqParSettings, model_name: str) -> None:
    """Refuse ``sequence_parallel.dit`` keys for a model that is not a diffusion transformer (they would be
    ignored)."""
    dit = settings.dit
    if dit is not None and dit.model_fields_set:
        raise SeqParConfigError(
            f"{SECTION}.dit sets {sorted(dit.model_fields_set)}, but {model_name} is not a diffusers transformer: "
            "those keys apply to diffusion transformers only; remove the dit part"
        )


def _check_ndim(owner: str, key: str | int, x: Any, ndim: int | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise UnsupportedModelError(
            f"{owner}: the token plan splits {key!r}, which is {type(x).__name__}, not a tensor"
        )
    if ndim is not None and x.dim() != ndim:
        raise UnsupportedModelError(
            f"{owner}: the token plan splits {key!r} as a {ndim}-d tensor but it has shape {tuple(x.shape)}"
        )


class DitParallel:
    """See the module docstring. ``mesh``: the SP group (its ``settings`` pick Ulysses x ring, kernel)."""

    def __init__(
        self,
        model: torch.nn.Module,
        mesh: SeqParMesh,
        backend: Backend | None = None,
        sparse: DitSparseSettings | None = None,
    ) -> None:
        self.model, self.mesh, self.plan, self.sparse = model, mesh, plan_of(model), sparse
        self.team = TeamComm(mesh.group("sp"), mesh.members["sp"], mesh.coords.sp_rank, mesh.comm_stats)
        self.backend = backend or (_sp_backend if sparse is None else _block_sparse_backend)
        self.cuts = StreamCuts(mesh.sp_size)
        self._handles: list[Any] = []
        self._processors: dict[str, Any] = {}
        self._doc_cache: dict[tuple[Any, ...], torch.Tensor | None] = {}
        self._install()

    # -- installation -------------------------------------------------------------------------------------
    def _install(self) -> None:
        plan, model = self.plan, self.model
        wrapped = {}
        for name, module in model.named_modules():
            processor = getattr(module, "processor", None)
            if processor is None or not hasattr(module, "set_processor"):
                continue
            site = ATTENTION_RULES.get(type(processor).__name__)
            if site is None:
                if getattr(module, "is_cross_attention", False):
                    continue  # cross-attention to a whole stream stays the model's own
                raise UnsupportedModelError(
                    f"{type(model).__name__}.{name}: attention processor {type(processor).__name__} has no "
                    f"ds_seqpar rule (known: {', '.join(sorted(ATTENTION_RULES))}); register one with "
                    "ds_seqpar.register_dit_attention"
                )
            wrapped[name] = (module, processor, site)
        root = model.register_forward_pre_hook(self._begin, with_kwargs=True, prepend=True)
        self._handles.append(root)
        for pattern, inputs in plan.splits.items():
            for name, module in plan.modules(model, pattern):
                self._hook_splits(name, module, inputs)
        for pattern, spec in plan.gathers.items():
            for name, module in plan.modules(model, pattern):
                self._handles.append(module.register_forward_hook(self._gather_hook(name, spec)))
        for name, (module, processor, site) in wrapped.items():
            self._processors[name] = processor
            module.set_processor(SeqParAttnProcessor(processor, site, self, name))

    def _hook_splits(self, name: str, module: torch.nn.Module, inputs: dict[str | int, SplitInput]) -> None:
        by_name = {k: v for k, v in inputs.items() if not v.output}
        by_output = {k: v for k, v in inputs.items() if v.output}
        if by_name:
            signature = inspect.signature(module.forward)

            def split_inputs(mod, args, kwargs):
                bound = signature.bind_partial(*args, **kwargs)
                for key, spec in by_name.items():
                    if bound.arguments.get(key) is not None:
                        bound.arguments[key] = self._split(
                            f"{name or type(mod).__name__}", key, bound.arguments[key], spec
                        )
                return bound.args, bound.kwargs

            self._handles.append(module.register_forward_pre_hook(split_inputs, with_kwargs=True))
        if by_output:

            def split_outputs(mod, args, output):
                items = list(output)
                for index, spec in by_output.items():
                    items[index] = self._split(name, f"output {index}", items[index], spec)
                return type(output)(items) if isinstance(output, tuple) else items

            self._handles.append(module.register_forward_hook(split_outputs))

    def remove(self) -> None:
        """Restore the model: the hooks removed and the original processors back."""
        for handle in self._handles:
            handle.remove()
        modules = dict(self.model.named_modules())
        for name, processor in self._processors.items():
            modules[name].set_processor(processor)
        self._handles, self._processors = [], {}

    # -- one forward ----------------------------------------------------------------------------------------
    def _begin(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.cuts = StreamCuts(self.mesh.sp_size)

    def _split(self, owner: str, key: str | int, x: Any, spec: SplitInput) -> torch.Tensor:
        _check_ndim(owner, key, x, spec.ndim)
        if isinstance(key, str):
            self.cuts.add(key, x.shape[spec.dim])
        return take_piece(x, spec.dim, self.mesh.coords.sp_rank, self.mesh.sp_size)

    def _gather_hook(self, name: str, spec: GatherOutput) -> Callable[..., Any]:
        def gather(mod, args, output):
            first = output[0] if isinstance(output, tuple) else output
            _check_ndim(name, "output", first, spec.ndim)
            length = self.cuts.whole_length(first.shape[spec.dim] * self.mesh.sp_size)
            whole = gather_pieces(first, spec.dim, self.team, length)
            return (whole, *output[1:]) if isinstance(output, tuple) else whole

        return gather

    def token_order(self, name: str, length: int, joint_call: bool) -> tuple[str, ...]:
        """The streams that make up an attention's ``length`` local tokens, in the model's order."""
        cuts, order = self.cuts, self.plan.joint_order
        if not joint_call and "hidden_states" in cuts.lengths and length == cuts.local("hidden_states"):
            return ("hidden_states",)
        if order is None:
            order = tuple(cuts.lengths)  # order only matters when a stream is padded (checked in attend)
            if not cuts.padded():
                return order
            raise UnsupportedModelError(
                f"{name}: a split stream does not divide the SP size {self.mesh.sp_size} ({cuts.lengths}) and "
                f"{type(self.model).__name__}'s plan ({self.plan.source}) does not say in which order its joint "
                "attention concatenates the streams; choose lengths that divide the SP size or register a plan"
            )
        if length != sum(cuts.local(s) for s in order if s in cuts.lengths):
            raise UnsupportedModelError(
                f"{name}: {length} local tokens reach the attention, but the split streams {cuts.lengths} give "
                f"{[cuts.local(s) for s in order if s in cuts.lengths]} per rank; is a stream split elsewhere?"
            )
        return tuple(s for s in order if s in cuts.lengths)

    def doc_ids(self, order: tuple[str, ...], device: torch.device) -> torch.Tensor | None:
        """Document ids ``[S]`` on ``device`` in global order (``-1`` = a stream's padding), or None without
        padding; built once per (streams, lengths, device)."""
        cuts = self.cuts
        key = (order, tuple(sorted(cuts.lengths.items())), device)
        if key not in self._doc_cache:
            ids = None
            if any(cuts.lengths[s] % cuts.parts for s in order):
                layout = self.mesh.settings.input_layout()
                n = sum(cuts.local(s) for s in order)
                ids = torch.full((n * cuts.parts,), -1, dtype=torch.long)
                for rank in range(cuts.parts):
                    real = cuts.real_mask(order, rank)
                    ids[layout.local_positions(n * cuts.parts, rank)] = torch.where(real, 0, -1)
                ids = ids.to(device)
            self._doc_cache[key] = ids
        return self._doc_cache[key]

    def attend(self, call: AttentionCall) -> torch.Tensor:
        return self.backend(call, self)


def _block_sparse_backend(call: AttentionCall, runtime: DitParallel) -> torch.Tensor:
    """Exact attention under a block pattern estimated from this call's q / k, balanced by db-SP
    (``ds_seqpar.block_sparse_attention``, docs/dit_sparse.md); per-layer statistics under the module's name."""
    doc_ids = runtime.doc_ids(call.order, call.q.device)
    return block_sparse_attention(
        call.q, call.k, call.v, mesh=runtime.mesh, budget=runtime.sparse, doc_ids=doc_ids,
        softmax_scale=call.scale, layer=call.name,
    )  # fmt: skip


def _sp_backend(call: AttentionCall, runtime: DitParallel) -> torch.Tensor:
    """Exact bidirectional attention over the SP group (``ds_seqpar.attention``, the mesh's algorithm)."""
    doc_ids = runtime.doc_ids(call.order, call.q.device)
    return sp_attention(
        call.q, call.k, call.v, mesh=runtime.mesh, causal=False, softmax_scale=call.scale, doc_ids=doc_ids
    )

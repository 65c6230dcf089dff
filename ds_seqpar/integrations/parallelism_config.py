"""accelerate's ``ParallelismConfig`` as another way to state the SP size (docs/integration.md, "HF's own SP switch").

HF's Ulysses guide turns sequence parallelism on with ``ParallelismConfig(sp_backend="deepspeed", sp_size=N,
...)`` given to ``TrainingArguments(parallelism_config=...)`` or ``Accelerator(parallelism_config=...)``, or
with accelerate's ``parallelism_config_*`` launch settings (``PARALLELISM_CONFIG_*`` variables, read when
``ACCELERATE_USE_PARALLELISM_CONFIG=true``). ds_seqpar takes only the SP size N from it; the
``"sequence_parallel"`` section still chooses the algorithm (:func:`section_with_parallelism` is the rule).

Then accelerate and the Trainer must not also run DeepSpeed's ALST Ulysses (with ``sp_size > 1`` they
would register its attention and wrap the data loader): :func:`trainer_parallelism` hides the config from
the base ``Trainer.__init__`` (so its ``Accelerator`` has none) and gives ``args.parallelism_config`` back
afterwards; :func:`accelerate_parallelism` hides it from accelerate during ``accelerator.prepare``.
Nothing here communicates.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from ds_seqpar.config import SECTION, SeqParConfigError, SequenceParallelConfig, load_config
from ds_seqpar.config.load import current_world_size, parse_section

ENV_SWITCH = (
    "ACCELERATE_USE_PARALLELISM_CONFIG"  # accelerate launch sets it with parallelism_config_* settings
)
# sp_attn_implementation (ALST's attention after its all-to-all) -> the section's kernel that computes it
ATTN_TO_KERNEL = {"flash_attention_2": "flash_attn", "sdpa": "sdpa"}
_FIX = "valid: leave it unset and choose in the '" + SECTION + "' section"


def launch_parallelism_config() -> Any:
    """The ``ParallelismConfig`` accelerate builds from its launch environment, or None when it builds none."""
    if os.environ.get(ENV_SWITCH, "false").lower() != "true":
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig()  # its fields default to the PARALLELISM_CONFIG_* variables


def _refuse_other_dimensions(pc: Any) -> None:
    """Backend, context parallel and tensor parallel: what ds_seqpar does not run."""
    backend = getattr(pc, "sp_backend", "deepspeed")
    if (getattr(pc, "sp_size", 1) or 1) > 1 and backend != "deepspeed":
        raise SeqParConfigError(
            f"ParallelismConfig(sp_backend={backend!r}): ds_seqpar takes the SP size only from "
            "sp_backend='deepspeed'; valid: sp_backend='deepspeed'"
        )
    for name, what in (
        ("cp_size", "torch context parallel, a second split of the sequence next to the section's"),
        ("tp_size", "tensor parallelism, which ds_seqpar does not run"),
    ):
        size = getattr(pc, name, 1) or 1
        if size > 1:
            raise SeqParConfigError(
                f"ParallelismConfig({name}={size}): {what}; valid: {name}=1 (sequence parallelism is "
                f"sp_size or the '{SECTION}' section)"
            )


def _handler_kernel(handler: Any) -> str | None:
    """The section kernel that ``sp_handler`` asks for (None: no choice); refuses what ds_seqpar would not honour.

    ``sp_disable_in_eval`` and ``sp_allow_recurrent_layers`` change no number under ds_seqpar (evaluation
    gives the same loss either way; recurrent layers are split exactly or refused by name whatever it says).
    """
    if handler is None:
        return None
    if getattr(handler, "sp_seq_length_is_variable", True) is False:
        length = getattr(handler, "sp_seq_length", None)
        raise SeqParConfigError(
            f"ParallelismConfig sp_handler has sp_seq_length_is_variable=False (sp_seq_length={length!r}), a "
            "promise that every batch has that length, which ds_seqpar does not check (it pads each batch to "
            "the layout's multiple); valid: sp_seq_length_is_variable=True"
        )
    attn = getattr(handler, "sp_attn_implementation", None)
    if attn is None:
        return None
    if attn not in ATTN_TO_KERNEL:
        raise SeqParConfigError(
            f"ParallelismConfig sp_handler has sp_attn_implementation={attn!r}, which ds_seqpar has no kernel "
            f"for; valid: one of {sorted(ATTN_TO_KERNEL)}, or {_FIX} ('kernel')"
        )
    kernel = ATTN_TO_KERNEL[attn]
    return "cuda_sdpa" if kernel == "sdpa" and torch.cuda.is_available() else kernel


def _check_dp(pc: Any, world: int, size: int, stated: bool) -> None:
    """``dp_replicate_size x dp_shard_size`` must be world / SP size (1 x 1 is fine when SP is not stated)."""
    dp = (getattr(pc, "dp_replicate_size", 1) or 1) * (getattr(pc, "dp_shard_size", 1) or 1)
    if world % size:
        raise SeqParConfigError(
            f"ParallelismConfig(sp_size={size}) does not divide the world size {world}; valid: a divisor of {world}"
        )
    if dp != world // size and (stated or dp > 1):
        raise SeqParConfigError(
            f"ParallelismConfig has dp_replicate_size x dp_shard_size = {dp}, but world {world} / SP size {size} "
            f"= {world // size} samples are read per step; valid: dp_replicate_size={world // size}, "
            "dp_shard_size=1"
        )


def section_with_parallelism(
    section: dict[str, Any], pc: Any, world_size: int | None = None
) -> dict[str, Any]:
    """The ``"sequence_parallel"`` section (a raw dict) to use, given HF's ``ParallelismConfig`` ``pc``.

    ``sp_size=N > 1`` states the SP size: a section ``size`` that is absent or ``"auto"`` takes N, an
    equal one is kept, another one raises :class:`SeqParConfigError` naming both. ``sp_size=1`` (accelerate's
    default) states nothing and the section decides. ``sp_handler.sp_attn_implementation`` picks the
    section's ``kernel`` (``"auto"`` there takes it; another kernel is a conflict). Refused by name: another
    ``sp_backend``, ``cp_size > 1``, ``tp_size > 1``, dp sizes other than world / N, and handler options
    ds_seqpar would not honour. Nothing is communicated.
    """
    if pc is None:
        return section
    world = current_world_size() if world_size is None else world_size
    _refuse_other_dimensions(pc)
    kernel = _handler_kernel(getattr(pc, "sp_handler", None))
    n = getattr(pc, "sp_size", 1) or 1
    out = dict(section)
    if n > 1:
        if out.get("enabled", True) is False:
            raise SeqParConfigError(
                f"ParallelismConfig(sp_size={n}) asks for sequence parallelism but {SECTION}.enabled is false; "
                f"valid: {SECTION}.enabled=true, or sp_size=1"
            )
        size = out.get("size", "auto")
        if size != "auto" and size != n:
            raise SeqParConfigError(
                f"ParallelismConfig(sp_size={n}) and {SECTION}.size={size!r} disagree; valid: the same value on "
                f'both sides, or {SECTION}.size="auto" (or no size) to take sp_size'
            )
        out["size"] = n
    resolved = parse_section(out, world)
    _check_dp(pc, world, resolved.size, stated=n > 1)
    if kernel is not None:
        chosen = out.get("kernel", "auto")
        if chosen not in ("auto", kernel):
            raise SeqParConfigError(
                f"ParallelismConfig sp_handler.sp_attn_implementation={pc.sp_handler.sp_attn_implementation!r} "
                f"(kernel {kernel!r}) and {SECTION}.kernel={chosen!r} disagree; valid: the same kernel, or "
                f'{SECTION}.kernel="auto"'
            )
        out["kernel"] = kernel
    return out


@contextlib.contextmanager
def _env_switch_off() -> Iterator[None]:
    """Inside: accelerate builds no ``ParallelismConfig`` from its launch environment."""
    saved = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV_SWITCH, None)
        else:
            os.environ[ENV_SWITCH] = saved


def _user_config(deepspeed: Any) -> dict[str, Any]:
    """``TrainingArguments.deepspeed`` as the user gave it (a dict, or the JSON file's contents)."""
    if isinstance(deepspeed, dict):
        return deepspeed
    with open(deepspeed, encoding="utf-8") as fh:
        return json.load(fh)


@contextlib.contextmanager
def trainer_parallelism(args: Any) -> Iterator[SequenceParallelConfig]:
    """Around the base ``Trainer.__init__``: yields the section to train with (parsed, before any collective).

    With ``args.parallelism_config`` (or accelerate's launch settings) the section in
    ``args.hf_deepspeed_config.config`` is replaced by :func:`section_with_parallelism`'s; inside the block
    ``args.parallelism_config`` is None and accelerate's launch switch off, so the Trainer's ``Accelerator``
    gets no SP of its own; afterwards ``args.parallelism_config`` is the user's object again.
    """
    config = args.hf_deepspeed_config.config
    source = (
        config if SECTION in config else _user_config(args.deepspeed)
    )  # taken by an earlier ds_seqpar trainer
    pc = args.parallelism_config if args.parallelism_config is not None else launch_parallelism_config()
    if SECTION in source:
        resolved = section_with_parallelism(source[SECTION], pc)
        source = {**source, SECTION: resolved}
        if SECTION in config:
            config[SECTION] = resolved
    section = load_config(source)[0]  # also checks every DeepSpeed key, before any process group
    saved = args.parallelism_config
    args.parallelism_config = None
    try:
        with _env_switch_off():
            yield section
    finally:
        args.parallelism_config = saved


@contextlib.contextmanager
def accelerate_parallelism(accelerator: Any) -> Iterator[None]:
    """Around ``accelerator.prepare``: accelerate sees no ``ParallelismConfig`` (no ALST); restored after."""
    state = accelerator.state
    saved = getattr(state, "parallelism_config", None)
    state.parallelism_config = None
    try:
        yield
    finally:
        state.parallelism_config = saved


class TrainerSizes:
    """The Trainer's size arithmetic under ds_seqpar (a base of ``SeqParTrainerMixin``): SP = the mesh's.

    ``get_sp_size()`` is the mesh's SP size, so transformers' dp = world / (tp x cp x sp) is ds_seqpar's
    (``get_total_train_batch_size`` counts micro x accumulation x dp). transformers also multiplies
    ``len(dataloader)`` by ``get_sp_size()`` when it counts steps, for ALST's loader, which yields every
    batch once per SP rank; ds_seqpar's loader yields each dp batch once, so that count uses 1.
    """

    _seqpar_counting_steps = False

    def get_sp_size(self) -> int:
        mesh = getattr(self, "seqpar_mesh", None)
        if mesh is None or self._seqpar_counting_steps:
            return 1
        return mesh.sp_size

    def set_initial_training_values(self, args: Any, dataloader: Any) -> Any:
        self._seqpar_counting_steps = True
        try:
            return super().set_initial_training_values(args, dataloader)  # type: ignore[misc]
        finally:
            self._seqpar_counting_steps = False


def _refusing_section(finalize: Any) -> Any:
    def trainer_config_finalize(self: Any, *args: Any, **kwargs: Any) -> Any:
        if SECTION in self.config:
            raise SeqParConfigError(
                f"transformers.Trainer is starting DeepSpeed with a config that has a '{SECTION}' section, which "
                "it ignores (it would train without ds_seqpar, or with DeepSpeed's ALST Ulysses when "
                "ParallelismConfig(sp_size > 1) is given); valid: ds_seqpar.SeqParTrainer instead of Trainer (the one "
                "change; it takes the SP size from TrainingArguments.parallelism_config), or "
                "ds_seqpar.with_sequence_parallel(YourTrainer) for a Trainer subclass"
            )
        return finalize(self, *args, **kwargs)

    trainer_config_finalize._ds_seqpar_guard = True  # type: ignore[attr-defined]
    return trainer_config_finalize


def install_trainer_guard() -> None:
    """Make a plain ``transformers.Trainer`` refuse a DeepSpeed config with the section (idempotent).

    Every Trainer with DeepSpeed finalises its config when ``train()`` (or a DeepSpeed evaluation) starts,
    before any collective; a ds_seqpar trainer has removed the section by then (``SeqParTrainerMixin``).
    """
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    finalize = HfTrainerDeepSpeedConfig.trainer_config_finalize
    if not getattr(finalize, "_ds_seqpar_guard", False):
        HfTrainerDeepSpeedConfig.trainer_config_finalize = _refusing_section(finalize)

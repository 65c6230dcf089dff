"""What ``ds_seqpar.verify`` prints (rank 0): the header, a progress line per step, the loss table, the
gradient table per module, and the verdict (``verify: PASS ...`` / ``verify: FAIL worst <module> ...``)."""

from __future__ import annotations

import argparse
import math

from ds_seqpar.verify.compare import ModuleDiff, StepLoss, VerifyResult

__all__ = ["Verdict", "header", "loss_table", "module_table", "progress_line", "verdict"]


def _over(value: float, tolerance: float) -> bool:
    """Above the tolerance, or not a number."""
    return not value <= tolerance


def header(args: argparse.Namespace, device: str) -> list[str]:
    """What is compared: the model, the mesh, ZeRO, the world, the data and the steps, and the notes."""
    s, cfg = args.settings, args.model_config
    stage = int(args.ds_config_dict.get("zero_optimization", {}).get("stage", 0))
    dp = args.world // s.size
    clip = args.ds_config_dict.get("gradient_clipping", 0.0) or 0.0
    init = "random init" if args.random_init else "loaded weights"
    lines = [
        f"verify: {args.model} ({getattr(cfg, 'model_type', '?')}, {args.objective} LM, {init}) vs the plain HF "
        "forward on the full sequence",
        f"verify: sequence_parallel size {s.size} = ulysses {s.ulysses_degree} x ring {s.ring_degree} "
        f"({s.attention}, {s.ring.schedule} / {s.ring.layout}, kernel {s.kernel}); ZeRO-{stage}; world {args.world} "
        f"(dp {dp}); {device}, float32",
        f"verify: {args.steps} SGD step(s) at lr {args.lr:g}{f', gradient clipping {clip:g}' if clip else ''}; "
        f"S={args.seq_len} random tokens (seed {args.seed}); tolerance {args.tolerance:.0e} (relative)",
    ]
    return lines + [f"note: {note}" for note in args.notes]


def progress_line(loss: StepLoss, steps: int) -> str:
    return (
        f"verify: step {loss.step}/{steps} done: SP {loss.sp_seconds:.2f} s, reference {loss.reference_seconds:.2f} s, "
        f"loss rel diff {loss.rel_diff:.1e}"
    )


def loss_table(losses: list[StepLoss], tolerance: float) -> list[str]:
    lines = [f"{'step':>4}  {'loss (SP)':>14}  {'loss (reference)':>16}  {'abs diff':>9}  {'rel diff':>9}"]
    for loss in losses:
        flag = "  > tolerance" if _over(loss.rel_diff, tolerance) else ""
        lines.append(
            f"{loss.step:>4}  {loss.sp:>14.8f}  {loss.reference:>16.8f}  {loss.abs_diff:>9.2e}  "
            f"{loss.rel_diff:>9.2e}{flag}"
        )
    return lines


def module_table(modules: dict[str, ModuleDiff], tolerance: float) -> list[str]:
    """One row per module, in the model's order: worst relative and absolute gradient difference over the
    steps, and the step of the relative one."""
    width = max([len("module"), *(len(name) for name in modules)])
    lines = [
        "gradients after the SP reduction vs the reference, worst over the steps:",
        f"{'module':<{width}}  {'params':>10}  {'rel diff':>9}  {'abs diff':>9}  step",
    ]
    for name, diff in modules.items():
        flag = "  > tolerance" if _over(diff.rel, tolerance) else ""
        lines.append(
            f"{name:<{width}}  {diff.params:>10,}  {diff.rel:>9.2e}  {diff.abs:>9.2e}  {diff.step:>4}{flag}"
        )
    return lines


class Verdict:
    """Whether every difference is within the tolerance, the worst module, and the summary line."""

    def __init__(self, result: VerifyResult, tolerance: float) -> None:
        self.worst_name, self.worst = max(
            result.modules.items(), key=lambda kv: math.inf if math.isnan(kv[1].rel) else kv[1].rel
        )
        self.worst_loss = max(result.losses, key=lambda s: math.inf if math.isnan(s.rel_diff) else s.rel_diff)
        loss_bad = _over(self.worst_loss.rel_diff, tolerance)
        self.passed = not loss_bad and not _over(self.worst.rel, tolerance)
        grad = f"gradient rel diff {self.worst.rel:.2e} (abs {self.worst.abs:.2e}, step {self.worst.step})"
        loss = f"loss rel diff {self.worst_loss.rel_diff:.2e} (step {self.worst_loss.step})"
        if self.passed:
            self.line = f"verify: PASS worst {self.worst_name} {grad}, worst {loss}; all <= {tolerance:.0e}"
        else:
            self.line = (
                f"verify: FAIL worst {self.worst_name} {grad}, worst {loss}; tolerance {tolerance:.0e}"
            )


def verdict(result: VerifyResult, tolerance: float) -> Verdict:
    return Verdict(result, tolerance)

"""Cases of tests/test_dit.py, run on every rank of a pool: tiny diffusers transformers and pipelines built from
assets/tiny-{pixart,sd3,flux} (seeded random weights), each compared with the same model in one process."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar.dit import load_pipeline, losses, parallelize
from ds_seqpar.integrations.dit import DitParallel
from tests.helpers.meshes import mesh_for

ASSETS = Path(__file__).resolve().parents[2] / "assets"
FAMILIES = ("pixart", "sd3", "flux")


def tiny_transformer(family: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    if family == "dit":  # class-conditional DiT: no asset, built here
        from diffusers import DiTTransformer2DModel

        torch.manual_seed(0)
        model = DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=8, in_channels=4, num_layers=2,
                                      sample_size=16, patch_size=2, num_embeds_ada_norm=10)  # fmt: skip
        return model.to(dtype).eval()  # its label dropout draws random numbers in training mode
    pipe = load_pipeline(ASSETS / f"tiny-{family}", random_init=True, dtype=dtype)
    return pipe.transformer


def transformer_inputs(family: str, text: int, dtype: torch.dtype, seed: int = 1, side: int = 16) -> dict:
    """One call's keyword inputs, batch 2: latents ``[2, 4, side, side]`` (Flux: packed ``[2, (side/2)^2, 16]``)
    and ``text`` prompt tokens."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    if family == "flux":
        n, grid = (side // 2) ** 2, side // 2
        ids = torch.zeros(n, 3, dtype=dtype)
        ids[:, 1], ids[:, 2] = torch.arange(n) // grid, torch.arange(n) % grid
        return dict(hidden_states=rand(2, n, 16), encoder_hidden_states=rand(2, text, 32),
                    pooled_projections=rand(2, 32), timestep=torch.tensor([0.5, 0.7], dtype=dtype),
                    img_ids=ids, txt_ids=torch.zeros(text, 3, dtype=dtype), guidance=None)  # fmt: skip
    if family == "dit":
        return dict(hidden_states=rand(2, 4, side, side), timestep=torch.tensor([500, 700]),
                    class_labels=torch.tensor([1, 7]))  # fmt: skip
    inputs = dict(hidden_states=rand(2, 4, side, side), encoder_hidden_states=rand(2, text, 32),
                  timestep=torch.tensor([500, 700]))  # fmt: skip
    if family == "pixart":
        inputs["added_cond_kwargs"] = {"resolution": None, "aspect_ratio": None}
    else:
        inputs["pooled_projections"] = rand(2, 32)
    return inputs


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def transformer_vs_reference(family: str, u: int, text: int) -> dict[str, float]:
    """Output and every parameter gradient (summed over the group) of one fp64 forward + backward under SP
    (U = ``u``, ring = world / u) vs one process; errors relative to the largest reference value."""
    ref = tiny_transformer(family)
    model = copy.deepcopy(ref)
    inputs = transformer_inputs(family, text, torch.float64)
    expected = ref(**inputs, return_dict=False)[0]
    expected.square().sum().backward()
    mesh = mesh_for(
        {"size": dist.get_world_size(), "ulysses_degree": u, "ring": {"layout": "contiguous"}}, ref.config
    )
    parallel = DitParallel(model, mesh)
    out = model(**inputs, return_dict=False)[0]
    out.square().sum().backward()
    parallel.remove()
    worst = 0.0
    scale = max(p.grad.abs().max() for p in ref.parameters() if p.grad is not None)
    for p, p_ref in zip(model.parameters(), ref.parameters(), strict=True):
        if p_ref.grad is None:
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, float((grad - p_ref.grad).abs().max() / scale))
    return {"out": _max_rel(out, expected), "grad": worst}


def pipeline_inputs(family: str, dtype: torch.dtype, text: int = 7) -> dict:
    """A whole pipeline call: 8 steps, 32x32 px (16x16 latents), prompt embeddings of ``text`` tokens (random,
    seeded), CFG where the pipeline batches it (PixArt, SD3; Flux is guidance-distilled)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    call = dict(num_inference_steps=8, height=32, width=32, output_type="latent")
    if family == "pixart":
        call.update(prompt_embeds=rand(1, text, 32), prompt_attention_mask=torch.ones(1, text),
                    negative_prompt_embeds=rand(1, text, 32), negative_prompt_attention_mask=torch.ones(1, text),
                    negative_prompt=None, guidance_scale=4.5, use_resolution_binning=False)  # fmt: skip
    elif family == "sd3":
        call.update(prompt_embeds=rand(1, text, 32), pooled_prompt_embeds=rand(1, 32),
                    negative_prompt_embeds=rand(1, text, 32), negative_pooled_prompt_embeds=rand(1, 32),
                    guidance_scale=5.0)  # fmt: skip
    else:
        call.update(prompt_embeds=rand(1, text, 32), pooled_prompt_embeds=rand(1, 32), guidance_scale=3.5)
    return call


def denoise(pipe, family: str, dtype: torch.dtype) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    return pipe(**pipeline_inputs(family, dtype), generator=torch.Generator().manual_seed(0)).images


def pipeline_vs_reference(family: str, section: dict, dtype_name: str) -> dict[str, float]:
    """Final latents of an 8-step run under ``parallelize(pipe, {"sequence_parallel": section})`` vs the same
    pipeline in one process; max |difference| relative to max |reference|; bytes sent by this rank."""
    dtype = getattr(torch, dtype_name)
    pipe = load_pipeline(ASSETS / f"tiny-{family}", random_init=True, dtype=dtype)
    expected = denoise(pipe, family, dtype)
    run = parallelize(pipe, {"sequence_parallel": section})
    got = denoise(pipe, family, dtype)
    sent = run.mesh.comm_stats.total_bytes
    run.remove()
    return {"latents": _max_rel(got, expected), "bytes": float(sent)}


def training_vs_reference(family: str, stage: int, u: int) -> dict[str, float]:
    """Two SGD steps of the denoising loss through ``ds_seqpar.initialize`` (ZeRO ``stage``, fp32) vs one
    process: the loss of each step and the first step's gradients (relative to the largest)."""
    import deepspeed

    ref = tiny_transformer(family, torch.float32)
    model = copy.deepcopy(ref)
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
        "sequence_parallel": {"size": dist.get_world_size(), "ulysses_degree": u},
    }  # fmt: skip
    engine, _, _, _ = ds_seqpar.initialize(
        model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.05)
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    names = [n for n, _ in ref.named_parameters()]
    loss_err, grad_err = 0.0, 0.0
    for step in range(2):
        inputs = transformer_inputs(family, 7, torch.float32, seed=10 + step)
        noise = torch.randn(inputs["hidden_states"].shape, generator=torch.Generator().manual_seed(step))
        noisy, target = losses.flow_matching(inputs["hidden_states"], noise, torch.tensor([0.3, 0.8]))
        inputs["hidden_states"] = noisy
        ref_opt.zero_grad()
        out = ref(**inputs, return_dict=False)[0]
        out = (
            out.narrow(1, 0, target.shape[1])
            if out.shape[1] == 2 * target.shape[1] and family == "pixart"
            else out
        )
        ref_loss = torch.nn.functional.mse_loss(out, target)
        ref_loss.backward()
        loss = engine(target=target, **inputs)
        engine.backward(loss)
        if step == 0:
            scale = max(p.grad.abs().max() for p in ref.parameters() if p.grad is not None)
            for name, p, p_ref in zip(names, engine.module.model.parameters(), ref.parameters(), strict=True):
                grad = deepspeed.utils.safe_get_full_grad(p)
                if p_ref.grad is not None:
                    grad_err = max(grad_err, float((grad - p_ref.grad).abs().max() / scale))
                elif grad is not None and grad.any():
                    raise AssertionError(f"{name}: a gradient where one process has none")
        engine.step()
        ref_opt.step()
        loss_err = max(loss_err, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    engine.destroy()
    return {"loss": loss_err, "grad": grad_err}


def flux_through_its_cp_plan() -> dict:
    """Flux read from diffusers' own ``_cp_plan`` (its DIT_PLANS entry taken away): exact when the prompt
    divides P; a prompt that needs padding is refused (the _cp_plan has no joint order)."""
    from ds_seqpar.integrations.dit import DIT_PLANS

    saved = DIT_PLANS.pop("FluxTransformer2DModel")
    try:
        exact = transformer_vs_reference("flux", 1, 8)
        try:
            transformer_vs_reference("flux", 1, 7)
            refused = ""
        except ds_seqpar.UnsupportedModelError as exc:
            refused = str(exc)
    finally:
        DIT_PLANS["FluxTransformer2DModel"] = saved
    return exact | {"refused": refused}


def block_sparse_pipeline(family: str, keep: float) -> dict[str, float]:
    """An 8-step fp64 run with ``dit.attention = "block_sparse"`` (db-SP, degrees re-chosen per call) vs one
    process with dense attention; the worst ρ_s and the mean density over the layers of the last call."""
    from ds_seqpar.parallel.dit_sparse import dit_sparse_stats

    pipe = load_pipeline(ASSETS / f"tiny-{family}", random_init=True, dtype=torch.float64)
    expected = denoise(pipe, family, torch.float64)
    section = {"size": dist.get_world_size(), "ulysses_degree": 2,
               "dit": {"attention": "block_sparse", "sparse": {"block_size": 4, "keep": keep, "degrees": "auto"}}}  # fmt: skip
    run = parallelize(pipe, {"sequence_parallel": section})
    got = denoise(pipe, family, torch.float64)
    stats = list(dit_sparse_stats(run.mesh).values())
    run.remove()
    return {"latents": _max_rel(got, expected), "rho": max(s.rho_s for s in stats),
            "density": sum(s.density for s in stats) / len(stats), "layers": len(stats)}  # fmt: skip

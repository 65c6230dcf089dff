"""PipeFusion on gloo ranks vs one process: a short DDIM loop of a tiny PixArt (fp64), bytes = the formula.

Every rank runs the single-process loop itself (the reference), then the same loop with its stage of the
blocks under ``PipeFusion``; the final latents are compared on every rank (the output is shared, so all
ranks step the scheduler alike).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_seqpar.comm.stats import CommStats
from ds_seqpar.comm.team import TeamComm
from ds_seqpar.integrations.dit.pipefusion import PipeFusion, patch_bounds, stage_blocks, step_bytes
from ds_seqpar.integrations.hf_model import UnsupportedModelError

B, TEXT, SIDE = 2, 10, 16  # 16x16 latent, patch 2: N = 64 image tokens
HIDDEN, OUT_FEATURES = 64, 2 * 2 * 8  # the tiny PixArt's width C; proj_out's features F = p·p·out_channels


def _pixart(layers: int) -> torch.nn.Module:
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    config = dict(PixArtTransformer2DModel.load_config("assets/tiny-pixart/transformer"), num_layers=layers)
    return PixArtTransformer2DModel.from_config(config).double().eval()


def _denoise(model: torch.nn.Module, steps: int) -> torch.Tensor:
    """``steps`` DDIM steps from a seeded latent ``[B, 4, SIDE, SIDE]``; the final latents."""
    from diffusers import DDIMScheduler

    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, 4, SIDE, SIDE, generator=g, dtype=torch.float64)
    prompt = torch.randn(B, TEXT, 32, generator=g, dtype=torch.float64)
    scheduler = DDIMScheduler.from_pretrained("assets/tiny-pixart/scheduler", clip_sample=False)
    scheduler.set_timesteps(steps)
    cond = {"resolution": None, "aspect_ratio": None}
    with torch.no_grad():
        for t in scheduler.timesteps:
            out = model(x, encoder_hidden_states=prompt, timestep=t.expand(B), added_cond_kwargs=cond)[0]
            x = scheduler.step(out[:, :4], t, x).prev_sample
    return x


def _team(stats: CommStats | None = None) -> TeamComm:
    world = dist.get_world_size()
    return TeamComm(dist.new_group(list(range(world))), list(range(world)), dist.get_rank(), stats)


class _Wire:
    """Counts the bytes this rank hands to ``dist.isend`` and sends by ``dist.broadcast`` (as the source, once to
    each other member), independently of ``CommStats``; both patched while in use."""

    def __init__(self) -> None:
        self.sent, self._isend, self._broadcast = 0, dist.isend, dist.broadcast

    def isend(self, tensor, dst, *args, **kwargs):
        self.sent += tensor.numel() * tensor.element_size()
        return self._isend(tensor, dst, *args, **kwargs)

    def broadcast(self, tensor, src, group=None, **kwargs):
        if src == dist.get_rank():
            self.sent += tensor.numel() * tensor.element_size() * (dist.get_world_size(group) - 1)
        return self._broadcast(tensor, src, group=group, **kwargs)

    def __enter__(self) -> _Wire:
        dist.isend, dist.broadcast = self.isend, self.broadcast
        return self

    def __exit__(self, *exc: object) -> None:
        dist.isend, dist.broadcast = self._isend, self._broadcast


def run_cases(layers: int, steps: int, cases: list[tuple[int, int]]) -> list[dict]:
    """Per (warmup_steps, patches): this rank's max abs difference from one process and bytes per step."""
    model = _pixart(layers)
    ref = _denoise(model, steps)
    stats = CommStats(dist.get_rank())
    team = _team(stats)
    results = []
    for warmup, patches in cases:
        pipe = PipeFusion(model, team, patches, warmup)
        with stats.measure() as region, _Wire() as wire:
            out = _denoise(model, steps)
        pipe.remove()
        assert wire.sent == region.total_bytes, (wire.sent, region.as_dict())
        results.append(
            {
                "err": float((out - ref).abs().max()),
                "scale": float(ref.abs().max()),
                "finite": bool(out.isfinite().all()),
                "bytes": region.total_bytes,
            }
        )
    return results


def _formula(stage: int, stages: int, steps: int) -> int:
    return steps * step_bytes(stages, B, SIDE * SIDE // 4, HIDDEN, OUT_FEATURES, 8)[stage]


@pytest.mark.parametrize("world,layers", [(2, 3), (4, 5)])
def test_exact_and_stale(dist_pool, world, layers):
    steps = 4
    cases = [(steps + 1, 3), (0, 1), (1, 4), (2, 3)]  # (a) W > steps, (b) M = 1 from W = 0, (c) stale twice
    results = dist_pool(world).run(run_cases, layers, steps, cases)
    for rank, per_rank in enumerate(results):
        for (warmup, patches), got in zip(cases, per_rank, strict=True):
            what = f"rank {rank} warmup {warmup} patches {patches}"
            assert got["bytes"] == _formula(rank, world, steps), what
            if warmup >= steps or patches == 1:  # (a), (b): exact
                assert got["err"] <= 1e-10, (what, got)
            else:  # (c): stale K/V after warm-up; measured max |diff| / max |ref| <= 8.0e-4 (W = 1, 2..4 stages)
                assert got["finite"] and 1e-8 < got["err"] < 3e-3 * got["scale"], (what, got)


def run_pipeline(warmup: int, patches: int, cfg_parallel: int = 1) -> float:
    """diffusers' PixArt-alpha pipeline (CFG: batch 2, a masked prompt; 4 DDIM steps, 256 image tokens) under
    PipeFusion over all ranks (``cfg_parallel`` = 2: over half of them, installed by ``ds_seqpar.dit.parallelize``
    beside CFG parallelism): max abs difference of its final latents from the same pipeline in one process."""
    from diffusers import AutoencoderKL, DDIMScheduler, PixArtAlphaPipeline

    from ds_seqpar.dit import parallelize

    transformer = _pixart(4)
    vae = AutoencoderKL.from_config(AutoencoderKL.load_config("assets/tiny-pixart/vae")).double()
    scheduler = DDIMScheduler.from_pretrained("assets/tiny-pixart/scheduler", clip_sample=False)
    pipe = PixArtAlphaPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=scheduler
    )
    g = torch.Generator().manual_seed(3)
    prompt, negative = (torch.randn(1, TEXT, 32, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(1, TEXT, dtype=torch.long)
    mask[:, 7:] = 0

    def generate() -> torch.Tensor:
        return pipe(prompt=None, negative_prompt=None, prompt_embeds=prompt, prompt_attention_mask=mask,
                    negative_prompt_embeds=negative, negative_prompt_attention_mask=torch.ones_like(mask),
                    num_inference_steps=4, guidance_scale=4.5, height=64, width=64, output_type="latent",
                    generator=torch.Generator().manual_seed(5), use_resolution_binning=False).images  # fmt: skip

    ref = generate()
    if cfg_parallel == 1:
        fusion = PipeFusion(transformer, _team(), patches, warmup)
    else:
        stages = dist.get_world_size() // cfg_parallel
        dit = {
            "cfg_parallel": cfg_parallel,
            "pipefusion": {"degree": stages, "patches": patches, "warmup_steps": warmup},
        }
        fusion = parallelize(pipe, {"sequence_parallel": {"size": 1, "dit": dit}})
    out = generate()
    fusion.remove()
    return float((out - ref).abs().max())


@pytest.mark.slow
def test_diffusers_pipeline_with_cfg_and_a_prompt_mask(dist_pool):
    assert max(dist_pool(2).run(run_pipeline, 4, 4)) <= 1e-10  # warm-up through every step: exact
    assert min(dist_pool(2).run(run_pipeline, 1, 4)) > 1e-8  # stale K/V from step 1 on: engaged


@pytest.mark.slow
def test_beside_cfg_parallel_through_parallelize(dist_pool):
    """4 ranks = 2 guidance branches x 2 stages (``ds_seqpar.dit.parallelize``)."""
    assert max(dist_pool(4).run(run_pipeline, 4, 4, 2)) <= 1e-10
    assert min(dist_pool(4).run(run_pipeline, 1, 4, 2)) > 1e-8


def run_dit() -> list[float]:
    """Class-conditional DiT (its plan gathers proj_out_2), 3 calls on the same input under PipeFusion(M=4, W=1):
    max abs difference of each output from one process."""
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    model = DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
                                  num_layers=4, sample_size=16, patch_size=2, num_embeds_ada_norm=10)  # fmt: skip
    model = model.double().eval()
    x, t, labels = (
        torch.randn(2, 4, SIDE, SIDE, dtype=torch.float64),
        torch.tensor([10, 500]),
        torch.tensor([1, 3]),
    )
    with torch.no_grad():
        ref = model(x, timestep=t, class_labels=labels).sample
        fusion = PipeFusion(model, _team(), 4, 1)
        outs = [model(x, timestep=t, class_labels=labels).sample for _ in range(3)]
    fusion.remove()
    return [float((out - ref).abs().max()) for out in outs]


@pytest.mark.slow
def test_class_conditional_dit(dist_pool):
    """Call 0 is the warm-up (exact); call 1's stale K/V come from the same input, so they are this step's: exact."""
    for errors in dist_pool(2).run(run_dit):
        assert max(errors) <= 1e-10, errors


def run_latents(layers: int, steps: int, warmup: int, patches: int) -> torch.Tensor:
    """The final latents under PipeFusion on this pool's ranks."""
    model = _pixart(layers)
    pipe = PipeFusion(model, _team(), patches, warmup)
    out = _denoise(model, steps)
    pipe.remove()
    return out


@pytest.mark.slow
def test_stale_result_does_not_depend_on_the_stage_count(dist_pool):
    """Patch m at layer l sees this step's K/V of patches <= m and the last step's of the rest, whoever owns l."""
    two, four = (dist_pool(p).run(run_latents, 4, 4, 1, 4)[0] for p in (2, 4))
    assert (two - four).abs().max() <= 1e-12


def run_twice(steps: int, warmup: int, patches: int) -> float:
    """Two generations on one PipeFusion without reset(): the second starts from its own warm-up by itself (its
    first timestep is above the last one of the first run), so it repeats the first exactly."""
    model = _pixart(2)
    pipe = PipeFusion(model, _team(), patches, warmup)
    first, second = _denoise(model, steps), _denoise(model, steps)
    pipe.remove()
    return float((first - second).abs().max())


def test_a_new_generation_resets_by_itself(dist_pool):
    assert max(dist_pool(2).run(run_twice, 3, 1, 4)) <= 1e-12


def _one_call(model: torch.nn.Module, batch: int) -> torch.Tensor:
    x = torch.randn(batch, 4, SIDE, SIDE, dtype=torch.float64)
    prompt = torch.randn(batch, TEXT, 32, dtype=torch.float64)
    cond = {"resolution": None, "aspect_ratio": None}
    # timestep 0: not above the last step's, so the call continues the run (a higher one would reset it)
    return model(x, timestep=torch.zeros(batch), encoder_hidden_states=prompt, added_cond_kwargs=cond)[0]


def run_errors() -> list[str]:
    """The refusals, each before any communication (the pool's ranks stay in step: no hang, next task runs)."""
    from diffusers import SD3Transformer2DModel

    from ds_seqpar.integrations.dit.attention import ATTENTION_RULES, SeqParAttnProcessor

    team, model, messages = _team(), _pixart(2), []

    def refused(make, error=ValueError):
        with pytest.raises(error) as caught:
            make()
        messages.append(str(caught.value))

    refused(lambda: PipeFusion(model, team, 0, 1))
    refused(lambda: PipeFusion(model, team, 2, -1))
    refused(lambda: PipeFusion(_pixart(1), team, 2, 1))  # more stages than blocks
    torch.manual_seed(0)
    sd3 = SD3Transformer2DModel.from_config(SD3Transformer2DModel.load_config("assets/tiny-sd3/transformer"))
    refused(lambda: PipeFusion(sd3, team, 2, 1), UnsupportedModelError)
    attn = model.transformer_blocks[0].attn1
    inner = attn.processor
    attn.set_processor(SeqParAttnProcessor(inner, ATTENTION_RULES["AttnProcessor2_0"], None, "x"))
    refused(lambda: PipeFusion(model, team, 2, 1), UnsupportedModelError)  # DitParallel inside a stage
    attn.set_processor(inner)
    pipe = PipeFusion(model, team, SIDE * SIDE // 4 + 1, 0)
    refused(lambda: _denoise(model, 2))  # more patches than tokens, at the first call
    pipe.remove()
    pipe = PipeFusion(model, team, 2, 0)
    _denoise(model, 1)  # fills the K/V buffers (B = 2): a call with another batch without reset() is refused
    with torch.no_grad():
        refused(lambda: _one_call(model, 1))
    pipe.reset()
    refused(lambda: _one_call(model, B), RuntimeError)  # with autograd on
    pipe.remove()
    return messages


def test_errors_before_any_collective(dist_pool):
    messages = dist_pool(2).run(run_errors)[0]
    for needle in ("patches=0", "warmup_steps=-1", "2 stages but", "joint attention", "already served by DitParallel",
                   "patches=65 is more than the 64", "call reset() before", "inference only"):  # fmt: skip
        assert any(needle in m for m in messages), (needle, messages)


def test_stage_and_patch_cuts():
    assert [list(stage_blocks(5, 4, s)) for s in range(4)] == [[0, 1], [2], [3], [4]]
    assert patch_bounds(64, 3) == [(0, 22), (22, 21), (43, 21)]
    assert step_bytes(3, 2, 64, 8, 4, 4) == {0: 4096, 1: 4096, 2: 2 * 2048}

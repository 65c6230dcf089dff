"""Regenerate the tiny diffusion-transformer assets ``assets/tiny-pixart``, ``tiny-sd3`` and ``tiny-flux``.

Run once: ``.venv/bin/python assets/make_tiny_dits.py``. Each asset is a diffusers pipeline folder with
configs only (``model_index.json``, ``transformer/``, ``scheduler/``, ``vae/``): no weights, no text
encoder, no tokenizer. ``ds_seqpar.dit.load_tiny_pipeline`` builds it with seeded random weights; the
prompts are given as embeddings (docs/dit.md). Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VAE = {
    "_class_name": "AutoencoderKL",
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
    "block_out_channels": [8, 16],
    "layers_per_block": 1,
    "latent_channels": 4,
    "norm_num_groups": 4,
    "sample_size": 32,
}
ASSETS = {
    "tiny-pixart": {
        "pipeline": "PixArtAlphaPipeline",
        "transformer": {
            "_class_name": "PixArtTransformer2DModel",
            "num_attention_heads": 4,
            "attention_head_dim": 16,
            "in_channels": 4,
            "out_channels": 8,
            "num_layers": 2,
            "cross_attention_dim": 64,
            "sample_size": 16,
            "patch_size": 2,
            "caption_channels": 32,
            "norm_type": "ada_norm_single",
            "use_additional_conditions": False,
        },
        "scheduler": {"_class_name": "DPMSolverMultistepScheduler", "num_train_timesteps": 1000},
        "vae": {**VAE, "latent_channels": 4},
    },
    "tiny-sd3": {
        "pipeline": "StableDiffusion3Pipeline",
        "transformer": {
            "_class_name": "SD3Transformer2DModel",
            "sample_size": 16,
            "patch_size": 2,
            "in_channels": 4,
            "out_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 4,
            "joint_attention_dim": 32,
            "caption_projection_dim": 64,
            "pooled_projection_dim": 32,
            "pos_embed_max_size": 32,
        },
        "scheduler": {
            "_class_name": "FlowMatchEulerDiscreteScheduler",
            "num_train_timesteps": 1000,
            "shift": 3.0,
        },
        "vae": {**VAE, "latent_channels": 4},
    },
    "tiny-flux": {
        "pipeline": "FluxPipeline",
        "transformer": {
            "_class_name": "FluxTransformer2DModel",
            "patch_size": 1,
            "in_channels": 16,
            "num_layers": 1,
            "num_single_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 4,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 32,
            "axes_dims_rope": [4, 6, 6],
        },
        "scheduler": {
            "_class_name": "FlowMatchEulerDiscreteScheduler",
            "num_train_timesteps": 1000,
            "shift": 1.0,
        },
        "vae": {**VAE, "latent_channels": 4},
    },
}


def main() -> None:
    for name, spec in ASSETS.items():
        out = ROOT / name
        index = {"_class_name": spec["pipeline"]}
        for part in ("transformer", "scheduler", "vae"):
            (out / part).mkdir(parents=True, exist_ok=True)
            config_file = "scheduler_config.json" if part == "scheduler" else "config.json"
            (out / part / config_file).write_text(json.dumps(spec[part], indent=2) + "\n")
            index[part] = ["diffusers", spec[part]["_class_name"]]
        (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""``python -m ds_seqpar.report``: versions, kernel table, the mesh of a config, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from ds_seqpar import SequenceParallelConfig, plan_mesh, report
from ds_seqpar.ops.attention import KERNELS
from ds_seqpar.ops.sparse.kernels import SPARSE_KERNELS
from ds_seqpar.parallel.comm_volume import attention_layer_bytes
from ds_seqpar.report import mesh as mesh_section
from ds_seqpar.report.text import fmt_bytes

REPO = Path(__file__).resolve().parents[1]
USP = str(REPO / "ds_configs" / "usp_zero3.json")
CPU = [("cpu", torch.float32), ("cpu", torch.bfloat16), ("cpu", torch.float64)]


def test_versions_name_installed_packages_and_absent_ones(monkeypatch):
    text = "\n".join(report.versions_section())
    for name in ("torch", "deepspeed", "transformers", "accelerate"):
        version = metadata.version(name)
        assert report.package_versions()[name] == version
        assert any(line.startswith(f"{name} ") and version in line for line in text.splitlines()), name
    real = metadata.version

    def without_peft(name: str) -> str:
        if name == "peft":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", without_peft)
    assert report.package_versions()["peft"] is None
    line = next(line for line in report.versions_section() if line.startswith("peft "))
    assert line.endswith("not installed")


def test_kernel_table_names_every_kernel_and_cpu_availability():
    matrix = report.kernel_matrix(CPU)
    assert set(KERNELS) <= set(matrix) and {f"sparse {n}" for n in SPARSE_KERNELS} <= set(matrix)
    for name in ("torch", "sdpa"):
        assert matrix[name][("cpu", torch.float32)] == "yes"
    assert matrix["cuda_sdpa"][("cpu", torch.float32)] == "needs CUDA tensors (got device 'cpu')"
    assert matrix["auto"][("cpu", torch.float32)] == "sdpa"  # docs/kernels.md: auto picks sdpa on CPU
    assert matrix["auto + softcap"][("cpu", torch.float32)] == "torch"
    assert matrix["sparse blocks"][("cpu", torch.float64)] == "yes"
    text = "\n".join(report.kernels_section(CPU))
    assert "cpu float32" in text and "cpu bfloat16" in text and "cpu float64" in text
    for name in [*KERNELS, *(f"sparse {n}" for n in SPARSE_KERNELS)]:
        assert f"\n  {name} " in text, name
    assert "needs CUDA tensors (got device 'cpu')" in text  # a reason, as a numbered note
    assert [c for c, _ in report.kernel_columns(cuda=True)].count("cuda") == 3


def test_cuda_columns_come_from_the_registry_without_a_gpu():
    """The availability checks read the device type and dtype only, so CUDA columns render anywhere."""
    cuda16 = ("cuda", torch.float16)
    matrix = report.kernel_matrix(report.kernel_columns(cuda=True))
    assert matrix["cuda_sdpa"][cuda16] == "yes"
    assert matrix["sdpa"][cuda16] == "needs CPU tensors (got device 'cuda')"
    assert matrix["auto"][cuda16] in ("flash_attn", "cuda_sdpa")


def test_usp_config_on_8_ranks_prints_the_mesh_and_bytes(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert report.main(["--config", USP, "--world", "8"]) == 0
    out = capsys.readouterr().out
    # tiny-llama: H=4, H_kv=2, so "auto" gives U=2 and the size 4 leaves R=2; 8 ranks = dp 2
    assert "8 = dp 2 x P 4" in out
    assert "4 = U 2 x R 2" in out
    assert '2 ("auto": H=4, H_kv=2)' in out
    assert "2 = R_outer 1 x R_inner 2" in out
    assert "  ulysses     [0, 1] [2, 3] [4, 5] [6, 7]\n" in out
    assert "  ring        [0, 2] [1, 3] [4, 6] [5, 7]\n" in out
    assert "  dp          [0, 4] [1, 5] [2, 6] [3, 7]\n" in out
    settings = SequenceParallelConfig(size=4, ulysses_degree=2).validate()
    layer = attention_layer_bytes(settings, 4096, 4, 2, 16, element_bytes=4)  # bf16 off: fp32
    assert f"({layer.forward['all_to_all']:,} B)" in out and f"({layer.backward['p2p']:,} B)" in out
    assert "S=4096, B=1, H=4, H_kv=2, D=16, float32" in out


def test_world_defaults_to_world_size_then_the_section(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert "16 = dp 4 x P 4" in "\n".join(report.mesh_report(USP))
    monkeypatch.delenv("WORLD_SIZE")
    assert "4 = dp 1 x P 4" in "\n".join(report.mesh_report(USP))


def test_large_worlds_print_the_first_groups_only():
    lines = mesh_section.group_lines(plan_mesh(128, 4, 2))
    sp = next(line for line in lines if line.startswith("  sp "))
    assert sp.endswith("... (32 groups of 4)") and sp.count("[") == mesh_section.SHOWN_GROUPS
    sp_dp = next(line for line in lines if line.startswith("  sp_dp "))
    assert "[0, 1, 2, 3, 4, 5, 6, 7, ... +120]" in sp_dp


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "no/such.json"], "DeepSpeed config file 'no/such.json' does not exist"),
        (["--config", USP, "--world", "6"], "sequence_parallel.size=4 does not divide the world size 6"),
        (["--config", USP, "--model-config", "no/such/model"], "model config 'no/such/model' does not exist"),
        (["--config", str(REPO / "README.md")], "is not valid JSON"),
    ],
)
def test_bad_inputs_print_one_line_and_exit_2(argv, message, capsys):
    assert report.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ds_seqpar.report: error: ") and message in err, err


def test_module_entry_point_exits_2_without_a_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "ds_seqpar.report", "--config", "no/such.json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "'no/such.json' does not exist" in proc.stderr


def test_topology_schedules_print_their_structure_and_link_classes(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    ring = {"schedule": "startrail", "team_size": 2}
    path = tmp_path / "startrail.json"
    path.write_text(
        json.dumps(
            {"sequence_parallel": {"size": 16, "ulysses_degree": 1, "ranks_per_node": 2, "ring": ring}}
        )
    )
    assert report.main(["--config", str(path), "--world", "16"]) == 0
    out = capsys.readouterr().out
    assert "ranks per node ............. 2" in out
    assert "StarTrail .................. C 2: 8 teams of 2 ring ranks, sub-rings of 4" in out
    # member 1 of a team: the skew hop and 3 sub-ring hops of a team block (2 x 256 tokens x H_kv 2 x D 16,
    # K and V, fp32) cross nodes; the team's gathers and merge stay inside
    block = 2 * 256 * 2 * 16 * 2 * 4
    assert f"inter-node  forward {fmt_bytes(4 * block)}" in out

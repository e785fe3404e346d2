"""Quantized weights for the linear and MoE layers: a method per scheme (`registry.py`), applied
to a built model before its weights load (`apply_quantization`), gpt-fast style: the model code
does not mention quantization. Only FP8 (W8A8, e4m3) exists so far (`fp8.py`)."""

"""PDMESH_PDL: programmatic dependent launch, only where a CUDA device of compute capability 9.0
or newer runs the kernels (the GPU test is tests/gpu/test_gpu_engine.py). In this folder: its
conftest imports pdmesh.kernels.triton under the interpreter; an import from a test elsewhere
would decorate every kernel for a GPU first."""

from __future__ import annotations

import pytest
import torch

from pdmesh import envs
from pdmesh.kernels.triton.pdl import pdl, pdl_launch


def test_on_by_default_and_never_off_cuda(monkeypatch) -> None:
    monkeypatch.delenv("PDMESH_PDL", raising=False)
    assert envs.pdl() is True
    monkeypatch.setenv("PDMESH_PDL", "0")
    assert envs.pdl() is False
    monkeypatch.setenv("PDMESH_PDL", "1")
    assert pdl(torch.device("cpu")) is False  # the interpreter: no launch option at all
    assert pdl_launch(False) == {}
    assert pdl_launch(True) == {"launch_pdl": True}


def test_a_bad_value_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("PDMESH_PDL", "yes")
    with pytest.raises(ValueError, match="PDMESH_PDL must be 0 or 1, got 'yes'"):
        envs.pdl()

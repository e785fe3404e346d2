"""CPU implementations of the kernels, registered with `pdmesh.kernels.backend`.

Imported on demand by `backend.pick` the first time a kernel runs on a CPU tensor; importing this
package registers every kernel below under its wrapper's name.
"""

from pdmesh.kernels.cpu import attention, kv_store, norm, onednn_linear, prologue, rotary

__all__ = ["attention", "kv_store", "norm", "onednn_linear", "prologue", "rotary"]

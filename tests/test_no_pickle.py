"""No pickle on any socket: the source of every package folder is scanned for the modules and
calls that (un)pickle, so none can creep in unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "pdmesh",
    "engine",
    "kernels",
    "router",
    "prefill_service",
    "decode_service",
    "kv_transfer",
    "bench",
    "protos",
)
# Modules whose purpose is to (un)pickle, or to move Python objects between processes with it.
PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal"}
PICKLING_MODULES |= {"joblib", "multiprocessing.connection", "multiprocessing.managers"}
# Calls that pickle under the hood: zmq's *_pyobj, torch.distributed's *_object* collectives,
# multiprocessing queues and pipes, and Python's copyreg hooks.
PICKLING_CALLS = {
    "send_pyobj",
    "recv_pyobj",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "Pipe",
    "Queue",
    "SimpleQueue",
    "JoinableQueue",
    "Manager",
    "Pool",
}
# Where an exception is justified: file -> the names it may use, and why.
ALLOWED = {
    # The serving benchmark's client runs the offline peer in a child process of its own and
    # takes its figures back through a Pool's pipe: a benchmark, not a service, and no socket.
    "bench/serving.py": {"Pool"},
}


def _sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    return [p for p in files if "_pb2" not in p.name]


def _offences(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    allowed = ALLOWED.get(path.relative_to(root).as_posix(), set())
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module in PICKLING_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.module == "multiprocessing":
            found += [a.name for a in node.names if a.name in PICKLING_CALLS]
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else None
            if isinstance(node.func, ast.Name):
                name = node.func.id
            if name in PICKLING_CALLS and _is_pickling_call(node, name):
                found.append(name)
            if name == "load" and _unsafe_load(node):
                found.append("torch.load / numpy.load that may unpickle")
    return [f"{path.relative_to(root)}:{name}" for name in found if name not in allowed]


def _is_pickling_call(node: ast.Call, name: str) -> bool:
    """Queue and SimpleQueue also exist in `queue` and asyncio (in-process, no pickle): only
    multiprocessing's count."""
    if name not in {"Queue", "SimpleQueue", "JoinableQueue", "Pipe", "Pool", "Manager"}:
        return True
    owner = node.func.value if isinstance(node.func, ast.Attribute) else None
    text = ast.unparse(owner) if owner is not None else ""
    return "multiprocessing" in text or "get_context" in text or text == "mp"


def _unsafe_load(node: ast.Call) -> bool:
    owner = ast.unparse(node.func.value) if isinstance(node.func, ast.Attribute) else ""
    keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
    if owner == "torch":
        return keywords.get("weights_only") != "True"
    if owner in ("np", "numpy"):
        return keywords.get("allow_pickle") == "True"
    return False


def test_no_source_file_pickles() -> None:
    sources = _sources()
    assert len(sources) > 100  # the scan sees the whole product
    offences = [o for path in sources for o in _offences(path)]
    assert not offences, offences


def test_the_scan_catches_pickling(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nimport torch\nimport multiprocessing\n"
        "sock.send_pyobj(x)\ntorch.load(f)\nmultiprocessing.Queue()\n"
        "torch.distributed.broadcast_object_list([x])\n"
    )
    offences = [o.split(":", 1)[1] for o in _offences(bad, tmp_path)]
    assert set(offences) == {
        "pickle",
        "send_pyobj",
        "torch.load / numpy.load that may unpickle",
        "Queue",
        "broadcast_object_list",
    }

"""No private name (a leading underscore) is imported or read across package lines, in rpc_core
or ps_train, as ``tests/rpc_core/test_layering.py`` does for imports.

The rule and its limits are those of ``tests._private_names`` (read from the source with
``ast``; a package is each directory with an ``__init__.py``): importing another package's
private name, using a private attribute of a module or object imported from another package
(dotted chains and ``getattr`` with a constant name too), and reading a private attribute that
only the classes of a package the module imports define (``rref._owner_id``). The underscore
names of torch's own RPC API are public for us (``TORCH_PUBLIC``): rpc_core re-implements
them under the same names, and programs call them.

Limits: the static type of an expression is unknown, so the last kind is a guess from
attribute names; it misses an attribute that the reader's own package defines too, one of an
object whose package the module does not import, and a call's result (``f()._x``) otherwise.
Other libraries' private names (``torch._C``) are theirs to judge, and tests are not checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ps_train
import rpc_core
from tests._private_names import Checker, Violation, is_private

ROOTS = (Path(rpc_core.__file__).resolve().parent, Path(ps_train.__file__).resolve().parent)

# The underscore names torch.distributed.rpc and torch.distributed.autograd define (torch 2.14),
# and the underscore members of their public classes (RRef, DistAutogradContext, RpcAgent,
# TensorPipeRpcBackendOptions): part of torch's API, so public for rpc_core's users and code.
TORCH_MODULE_NAMES = {
    "torch.distributed.rpc": frozenset(
        {
            "_DEFAULT_INIT_METHOD",
            "_DEFAULT_NUM_WORKER_THREADS",
            "_DEFAULT_RPC_TIMEOUT_SEC",
            "_TensorPipeRpcBackendOptionsBase",
            "_UNSET_RPC_TIMEOUT",
            "_cleanup_python_rpc_handler",
            "_delete_all_user_and_unforked_owner_rrefs",
            "_destroy_rref_context",
            "_disable_jit_rref_pickle",
            "_disable_server_process_global_profiler",
            "_enable_jit_rref_pickle",
            "_enable_server_process_global_profiler",
            "_get_current_rpc_agent",
            "_get_debug_info",
            "_init_counter",
            "_init_counter_lock",
            "_init_rpc_backend",
            "_invoke_remote_builtin",
            "_invoke_remote_python_udf",
            "_invoke_remote_torchscript",
            "_invoke_rpc_builtin",
            "_invoke_rpc_python_udf",
            "_invoke_rpc_torchscript",
            "_is_current_rpc_agent_set",
            "_is_tensorpipe_available",
            "_reset_current_rpc_agent",
            "_rref_context_get_debug_info",
            "_server_process_global_profile",
            "_set_and_start_rpc_agent",
            "_set_profiler_node_id",
            "_set_rpc_timeout",
            "_utils",
            "_validate_rpc_args",
        }
    ),
    "torch.distributed.autograd": frozenset(
        {
            "_current_context",
            "_get_debug_info",
            "_get_max_id",
            "_init",
            "_is_valid_context",
            "_new_context",
            "_release_context",
            "_retrieve_context",
        }
    ),
}
TORCH_CLASS_MEMBERS = {
    "torch.distributed.rpc.RRef": frozenset(
        {"_deserialize", "_get_future", "_get_profiling_future", "_get_type", "_serialize", "_set_profiling_future"}
    ),
    "torch.distributed.rpc.RpcAgent": frozenset({"_get_device_map"}),
    "torch.distributed.rpc.TensorPipeRpcBackendOptions": frozenset({"_set_device_map"}),
    "torch._C._distributed_autograd.DistAutogradContext": frozenset(
        {"_context_id", "_known_worker_ids", "_recv_functions", "_send_functions"}
    ),
}
TORCH_PUBLIC = frozenset().union(*TORCH_MODULE_NAMES.values(), *TORCH_CLASS_MEMBERS.values())


@pytest.fixture(scope="module")
def found() -> list[Violation]:
    return Checker(ROOTS, TORCH_PUBLIC).violations()


def test_rpc_core_uses_no_private_name_of_another_package(found: list[Violation]) -> None:
    mine = [str(v) for v in found if v.module.split(".")[0] == "rpc_core"]
    assert not mine, "private names used across package lines:\n  " + "\n  ".join(mine)


def test_ps_train_uses_no_private_name_of_another_package(found: list[Violation]) -> None:
    mine = [str(v) for v in found if v.module.split(".")[0] == "ps_train"]
    assert not mine, "private names used across package lines:\n  " + "\n  ".join(mine)


def test_the_torch_names_allowed_are_torch_s() -> None:
    import importlib

    for module, names in TORCH_MODULE_NAMES.items():
        defined = {n for n in dir(importlib.import_module(module)) if is_private(n)}
        assert names == defined, f"{module}: {sorted(names ^ defined)}"
    for qualified, members in TORCH_CLASS_MEMBERS.items():
        module, _, cls = qualified.rpartition(".")
        assert members <= set(dir(getattr(importlib.import_module(module), cls))), qualified


# -- the checker itself, on small made-up packages ------------------------------------------------------
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pkg"


def test_the_checker_sees_each_kind_of_crossing_and_only_those(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "from .state import _ctx, _helper\n",  # its own package: fine
            "pkg/low/state.py": (
                "_ctx = object()\n"
                "def _helper(): ...\n"
                "def _is_valid_context(i): ...\n"
                "class Handle:\n"
                "    __slots__ = ('_slot',)\n"
                "    _flag = False\n"
                "    def __init__(self):\n"
                "        self._owner_id = 0\n"
                "        self._lock = None\n"
                "    def _method(self): ...\n"
            ),
            "pkg/low/_hidden.py": "",
            "pkg/high/__init__.py": "",
            "pkg/high/user.py": (
                "import torch\n"
                "import pkg.low.state\n"
                "from pkg.low import state as st, _hidden\n"
                "from ..low import _helper\n"  # 1: a private name of another package
                "from ..low.state import Handle, _is_valid_context\n"  # torch's name: public
                "class Mine:\n"
                "    def __init__(self):\n"
                "        self._lock = None\n"
                "def f(h, x):\n"
                "    st._ctx\n"  # 2: a module's private global
                "    pkg.low.state._ctx = 1\n"  # 2: through a dotted chain, written
                "    Handle._flag\n"  # 2: a private attribute of an imported class
                "    getattr(st, '_ctx')\n"  # 2: getattr with a constant name
                "    h._owner_id\n"  # 3: only pkg.low's classes define it
                "    h._method()\n"  # 3: a private method
                "    h._slot\n"  # 3: from __slots__
                "    h._lock\n"  # this package's Mine defines _lock too: unknown, not flagged
                "    x.__class__\n"  # a dunder: not private
                "    torch._C\n"  # another library's private: not ours to judge
                "    x._values()\n"  # defined by no class of ours
            ),
        },
    )
    found = [str(v) for v in Checker([root], {"_is_valid_context"}).violations()]
    assert found == [
        "pkg.high.user (line 3) imports pkg.low._hidden",
        "pkg.high.user (line 4) imports pkg.low._helper",
        "pkg.high.user (line 10) reads pkg.low.state._ctx",
        "pkg.high.user (line 11) writes pkg.low.state._ctx",
        "pkg.high.user (line 12) reads pkg.low.state.<object>._flag",
        "pkg.high.user (line 13) reads pkg.low.state._ctx",
        "pkg.high.user (line 14) reads ._owner_id (defined by pkg.low)",
        "pkg.high.user (line 15) reads ._method (defined by pkg.low)",
        "pkg.high.user (line 16) reads ._slot (defined by pkg.low)",
    ]


def test_a_package_s_top_level_modules_and_its_subpackages_are_different_packages(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from .sub.impl import _x\n",  # a parent reaching into its subpackage
            "pkg/api.py": "from . import knobs\nknobs._limit\n",  # same package (pkg): fine
            "pkg/knobs.py": "_limit = 1\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/impl.py": "from .. import knobs\n_x = knobs._limit\n",  # a subpackage reaching up
            "pkg/other/__init__.py": "",
            "pkg/other/mod.py": "class C:\n    def _start(self): ...\n",
            "pkg/other/base.py": "class Base:\n    def _start(self): ...\n",
            # a subclass calling its base's private method: the base is another package's
            "pkg/sub/derived.py": (
                "from ..other.base import Base\nclass D(Base):\n    def __init__(self):\n        self._start()\n"
            ),
        },
    )
    found = [str(v) for v in Checker([root]).violations()]
    assert found == [
        "pkg (line 1) imports pkg.sub.impl._x",
        "pkg.sub.derived (line 4) reads ._start (defined by pkg.other)",
        "pkg.sub.impl (line 2) reads pkg.knobs._limit",
    ]
